#!/usr/bin/env python3
"""Makes dsv4's extra oracle fixtures with HF transformers (run on the GPU machine; needs torch,
transformers >= 5.17, safetensors, numpy, and a copy of ../shared/oracle for make_reference.py).

    python3 tests/oracle/make_fixtures.py --oracle-dir ORACLE --official-tiny DIR --out OUT

Writes under OUT:
  lite-seed2/     the real structural constants (window 128, CSA 4, HCA 128, top-k below the row count) at
                  small widths, 520 tokens: crosses the window and four HCA blocks
  wide-seed1/     widths that are multiples of 256 (K-quant and IQ2_XXS blocks fit), weights rounded to bf16
                  values and stored as BF16 (exact), for the quantized-conversion tests
  medium-seed1/   make_reference.py's own `medium` config (too large to commit: used on the device only)
  official-tiny-hf/logits_hf.npy   HF's logits for DeepSeek's official-format tiny checkpoint, its FP8/FP4 weights
                  dequantized: the reference-numerics target for dsv4's reading of official checkpoints
"""
import argparse
import copy
import json
import os
import sys

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
SWA = "sliding_attention"
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0,
        "beta_slow": 1.0}


def extra_configs():
    lite = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, partial_rotary_factor=0.125, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, norm_topk_prob=True,
        layer_types=[SWA, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 128}, sliding_window=128, index_n_heads=4, index_head_dim=16, index_topk=32,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=2.0, rope_theta=10000.0,
        compress_rope_theta=160000.0, rope_parameters=dict(YARN), max_position_embeddings=1048576,
        rms_norm_eps=1e-6, tie_word_embeddings=False)
    wide = dict(
        vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, partial_rotary_factor=0.125, q_lora_rank=128, o_groups=2, o_lora_rank=128,
        moe_intermediate_size=256, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, norm_topk_prob=True,
        layer_types=[CSA, HCA], mlp_layer_types=["hash_moe", "moe"],
        compress_rates={CSA: 4, HCA: 16}, sliding_window=32, index_n_heads=4, index_head_dim=32, index_topk=8,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, rope_theta=10000.0,
        compress_rope_theta=160000.0, rope_parameters=dict(YARN), max_position_embeddings=1048576,
        rms_norm_eps=1e-6, tie_word_embeddings=False)
    return {
        "lite": {"hf": lite, "seq_len": 520, "prefill": 200, "lm_scale": 2.5, "intermediates": "none"},
        "wide": {"hf": wide, "seq_len": 160, "prefill": 40, "lm_scale": 2.5, "intermediates": "none"},
    }


def to_bf16_file(path):
    """Rewrites a safetensors file with every float tensor as BF16 (callers made the values bf16-exact)."""
    import torch
    from safetensors.torch import load_file, save_file

    sd = load_file(path)
    out = {}
    for k, v in sd.items():
        if v.is_floating_point():
            b = v.to(torch.bfloat16)
            assert torch.equal(b.float(), v.float()), f"{k} is not bf16-exact"
            out[k] = b
        else:
            out[k] = v
    save_file(out, path, metadata={"format": "pt", "note": "bf16-exact weights; logits from fp32 compute"})


def run_reference(mr, name, seed, out, bf16_exact=False, extra=()):
    """make_reference.main, optionally rounding every float parameter to a bf16 value after init."""
    original = mr.init_weights
    if bf16_exact:
        def init_rounded(model, cfg, spec, s):
            import torch
            rules = original(model, cfg, spec, s)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
                for n, b in model.named_buffers():
                    if b.is_floating_point() and "inv_freq" not in n:
                        b.copy_(b.to(torch.bfloat16).float())
            return rules
        mr.init_weights = init_rounded
    try:
        mr.main(["--config", name, "--seed", str(seed), "--out", out, *extra])
    finally:
        mr.init_weights = original
    if bf16_exact:
        to_bf16_file(os.path.join(out, "model.safetensors"))


def official_to_hf(official_dir, out_dir):
    """HF logits for DeepSeek's official-format checkpoint: FP8/FP4 weights dequantized, names mapped."""
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    args = json.load(open(os.path.join(official_dir, "config.json")))
    tokens = json.load(open(os.path.join(official_dir, "tokens.json")))["tokens"]
    raw = load_file(os.path.join(official_dir, "model.safetensors"))

    def deq(name):
        w = raw[name]
        if w.dtype == torch.float8_e4m3fn:
            s = raw[name[: -len(".weight")] + ".scale"].float()
            rows, cols = w.shape
            s = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            return w.float() * s
        if w.dtype == torch.int8:  # packed FP4 E2M1, even column in the low nibble, one E8M0 scale per 32
            table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
            b = w.view(torch.uint8).long()
            vals = torch.stack([table[b & 15], table[b >> 4]], -1).reshape(w.shape[0], -1)
            s = raw[name[: -len(".weight")] + ".scale"].float().repeat_interleave(32, 1)
            return vals * s
        return w.float()

    n_layers = args["n_layers"]
    ratios = args["compress_ratios"][:n_layers]
    kinds = [SWA if r == 0 else CSA if r == 4 else HCA for r in ratios]
    rates = {CSA: 4}
    for r in ratios:
        if r not in (0, 4):
            rates[HCA] = r
    cfg = DeepseekV4Config(
        vocab_size=args["vocab_size"], hidden_size=args["dim"], num_hidden_layers=n_layers,
        num_attention_heads=args["n_heads"], num_key_value_heads=1, head_dim=args["head_dim"],
        qk_rope_head_dim=args["rope_head_dim"], q_lora_rank=args["q_lora_rank"], o_groups=args["o_groups"],
        o_lora_rank=args["o_lora_rank"], moe_intermediate_size=args["moe_inter_dim"],
        n_routed_experts=args["n_routed_experts"], num_experts_per_tok=args["n_activated_experts"],
        n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=float(args["route_scale"]),
        norm_topk_prob=True, layer_types=kinds,
        mlp_layer_types=["hash_moe" if i < args["n_hash_layers"] else "moe" for i in range(n_layers)],
        compress_rates=rates, sliding_window=args["window_size"], index_n_heads=args["index_n_heads"],
        index_head_dim=args["index_head_dim"], index_topk=args["index_topk"], hc_mult=args["hc_mult"],
        hc_sinkhorn_iters=args["hc_sinkhorn_iters"], hc_eps=float(args["hc_eps"]),
        swiglu_limit=float(args["swiglu_limit"]), rope_theta=float(args["rope_theta"]),
        compress_rope_theta=float(args["compress_rope_theta"]),
        rope_parameters={"rope_type": "yarn", "factor": float(args["rope_factor"]),
                         "original_max_position_embeddings": args["original_seq_len"],
                         "beta_fast": float(args["beta_fast"]), "beta_slow": float(args["beta_slow"])},
        max_position_embeddings=65536, rms_norm_eps=float(args["norm_eps"]), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")

    sd = {"model.embed_tokens.weight": deq("embed.weight"), "lm_head.weight": deq("head.weight"),
          "model.norm.weight": deq("norm.weight")}
    for k in ("fn", "base", "scale"):
        sd[f"model.hc_head.hc_{k}"] = deq(f"hc_head_{k}")
    attn_map = {"wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight", "wq_b.weight": "q_b_proj.weight",
                "wkv.weight": "kv_proj.weight", "kv_norm.weight": "kv_norm.weight", "wo_a.weight": "o_a_proj.weight",
                "wo_b.weight": "o_b_proj.weight", "attn_sink": "sinks",
                "compressor.wkv.weight": "compressor.kv_proj.weight",
                "compressor.wgate.weight": "compressor.gate_proj.weight", "compressor.ape": "compressor.position_bias",
                "compressor.norm.weight": "compressor.kv_norm.weight",
                "indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
                "indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
                "indexer.compressor.ape": "compressor.indexer.position_bias",
                "indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
                "indexer.wq_b.weight": "compressor.indexer.q_b_proj.weight",
                "indexer.weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight"}
    for i in range(n_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        sd[h + "input_layernorm.weight"] = deq(o + "attn_norm.weight")
        sd[h + "post_attention_layernorm.weight"] = deq(o + "ffn_norm.weight")
        for k in ("fn", "base", "scale"):
            sd[h + f"attn_hc.{k}"] = deq(o + f"hc_attn_{k}")
            sd[h + f"ffn_hc.{k}"] = deq(o + f"hc_ffn_{k}")
        for src, dst in attn_map.items():
            if o + "attn." + src in raw:
                sd[h + "self_attn." + dst] = deq(o + "attn." + src)
        sd[h + "mlp.gate.weight"] = deq(o + "ffn.gate.weight")
        if o + "ffn.gate.bias" in raw:
            sd[h + "mlp.gate.e_score_correction_bias"] = deq(o + "ffn.gate.bias")
        if o + "ffn.gate.tid2eid" in raw:
            sd[h + "mlp.gate.tid2eid"] = raw[o + "ffn.gate.tid2eid"]
        E = args["n_routed_experts"]
        sd[h + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([deq(f"{o}ffn.experts.{e}.w1.weight"), deq(f"{o}ffn.experts.{e}.w3.weight")]) for e in range(E)])
        sd[h + "mlp.experts.down_proj"] = torch.stack([deq(f"{o}ffn.experts.{e}.w2.weight") for e in range(E)])
        for src, dst in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            sd[h + f"mlp.shared_experts.{dst}.weight"] = deq(o + f"ffn.shared_experts.{src}.weight")
    own = model.state_dict()
    missing = [k for k in own if k not in sd and "inv_freq" not in k]
    unexpected = [k for k in sd if k not in own]
    assert not missing and not unexpected, (missing, unexpected)
    for k, v in sd.items():
        assert own[k].shape == v.shape, (k, own[k].shape, v.shape)
        own[k].copy_(v.to(own[k].dtype))
    rope = model.config.qk_rope_head_dim if hasattr(model.config, "qk_rope_head_dim") else None
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = model.to(dev)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens], device=dev), use_cache=False).logits[0].float().cpu()
    os.makedirs(out_dir, exist_ok=True)
    np.save(os.path.join(out_dir, "logits_hf.npy"), logits.numpy().astype(np.float32))
    json.dump({"source": "HF transformers DeepseekV4ForCausalLM on the dequantized official-tiny checkpoint",
               "rope_head_dim": rope, "layer_types": kinds, "compress_rates": rates},
              open(os.path.join(out_dir, "meta.json"), "w"), indent=1)
    print(f"official-tiny-hf: logits {tuple(logits.shape)}, std {logits.std().item():.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle-dir", required=True)
    ap.add_argument("--official-tiny", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, args.oracle_dir)
    import make_reference as mr

    mr.CONFIGS.update(copy.deepcopy(extra_configs()))
    os.makedirs(args.out, exist_ok=True)
    official_to_hf(args.official_tiny, os.path.join(args.out, "official-tiny-hf"))
    run_reference(mr, "lite", 2, os.path.join(args.out, "lite-seed2"))
    run_reference(mr, "wide", 1, os.path.join(args.out, "wide-seed1"), bf16_exact=True)
    run_reference(mr, "medium", 1, os.path.join(args.out, "medium-seed1"), extra=("--intermediates", "none"))


if __name__ == "__main__":
    main()
