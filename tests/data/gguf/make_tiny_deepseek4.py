#!/usr/bin/env python3
# Writes tiny-deepseek4.gguf with llama.cpp's own gguf-py (GGUFWriter, and its quants module for Q8_0), so that
# dsv4's reader is tested against a file from an independent writer. The file follows llama.cpp's `deepseek4`
# layout (keys and tensor names) with toy sizes; the weights are random and mean nothing.
#
# Needs gguf-py from a llama.cpp checkout (it is not vendored here) and numpy (Debian: python3-numpy; the
# gguf-py of late 2024 also imports sentencepiece: python3-sentencepiece):
#   PYTHONPATH=<llama.cpp>/gguf-py /usr/bin/python3 make_tiny_deepseek4.py
#   PYTHONPATH=<llama.cpp>/gguf-py /usr/bin/python3 <llama.cpp>/gguf-py/scripts/gguf_dump.py tiny-deepseek4.gguf \
#       > tiny-deepseek4.gguf-py-dump.txt
#   PYTHONPATH=<llama.cpp>/gguf-py /usr/bin/python3 <llama.cpp>/gguf-py/scripts/gguf_dump.py --markdown \
#       tiny-deepseek4.gguf > tiny-deepseek4.gguf-py-dump.md
# (newer checkouts keep the script at gguf-py/gguf/scripts/gguf_dump.py.) The committed file and dumps were made
# with gguf-py 0.10.0 (llama.cpp's gguf-py of October 2024) and numpy 1.24.
import os

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T

# Toy hyper-parameters. Every width that a Q8_0 row runs along is a multiple of 32 (the block size).
E = 64  # embedding
V = 32  # vocabulary
N_LAYER = 3
RATIOS = [0, 4, 128]  # compress ratio per layer: none, indexed (4), plain (128)
H, D = 2, 32  # heads, head dim
R = 32  # q lora rank
G, OR = 2, 32  # output groups, output lora rank
HC = 4
M = (2 + HC) * HC
NE, NU, FF = 4, 2, 32  # experts, experts used, expert ffn width
IH, ID = 2, 32  # indexer heads, indexer head dim
HASH_LAYERS = 1

rng = np.random.default_rng(20261130)
out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny-deepseek4.gguf")
w = gguf.GGUFWriter(out_path, "deepseek4")


def tensor(name, ne, kind):
    # `ne` is in ggml order; numpy wants it reversed.
    shape = tuple(reversed(ne))
    if kind == "i32":
        w.add_tensor(name, rng.integers(0, NE, size=shape, dtype=np.int32))
        return
    data = rng.standard_normal(shape).astype(np.float32) * 0.05
    if kind == "f32":
        w.add_tensor(name, data)
    elif kind == "f16":
        w.add_tensor(name, data.astype(np.float16))
    elif kind == "bf16":
        w.add_tensor(name, gguf.quants.quantize(data, T.BF16), raw_dtype=T.BF16)
    elif kind == "q8_0":
        w.add_tensor(name, gguf.quants.quantize(data, T.Q8_0), raw_dtype=T.Q8_0)
    else:
        raise ValueError(kind)


# ---- metadata (llama.cpp's deepseek4 loader keys) ----
w.add_name("tiny-deepseek4")
w.add_uint32("general.file_type", 7)  # MOSTLY_Q8_0
w.add_uint32("deepseek4.context_length", 4096)
w.add_uint32("deepseek4.embedding_length", E)
w.add_uint32("deepseek4.block_count", N_LAYER)
w.add_uint32("deepseek4.vocab_size", V)
w.add_uint32("deepseek4.attention.head_count", H)
w.add_uint32("deepseek4.attention.head_count_kv", 1)
w.add_uint32("deepseek4.attention.key_length", D)
w.add_uint32("deepseek4.attention.value_length", D)
w.add_uint32("deepseek4.rope.dimension_count", 16)
w.add_float32("deepseek4.rope.freq_base", 10000.0)
w.add_string("deepseek4.rope.scaling.type", "yarn")
w.add_float32("deepseek4.rope.scaling.factor", 16.0)
w.add_uint32("deepseek4.rope.scaling.original_context_length", 1024)
w.add_float32("deepseek4.rope.scaling.yarn_beta_fast", 32.0)
w.add_float32("deepseek4.rope.scaling.yarn_beta_slow", 1.0)
w.add_uint32("deepseek4.expert_count", NE)
w.add_uint32("deepseek4.expert_used_count", NU)
w.add_uint32("deepseek4.expert_feed_forward_length", FF)
w.add_uint32("deepseek4.expert_shared_count", 1)
w.add_float32("deepseek4.expert_weights_scale", 1.5)
w.add_bool("deepseek4.expert_weights_norm", True)
w.add_uint32("deepseek4.expert_gating_func", 4)
w.add_float32("deepseek4.attention.layer_norm_rms_epsilon", 1e-6)
w.add_uint32("deepseek4.attention.q_lora_rank", R)
w.add_uint32("deepseek4.attention.sliding_window", 8)
w.add_uint32("deepseek4.attention.output_group_count", G)
w.add_uint32("deepseek4.attention.output_lora_rank", OR)
w.add_float32("deepseek4.attention.compress_rope_freq_base", 160000.0)
w.add_array("deepseek4.attention.compress_ratios", RATIOS)  # i32 array
w.add_uint32("deepseek4.attention.indexer.head_count", IH)
w.add_uint32("deepseek4.attention.indexer.key_length", ID)
w.add_uint32("deepseek4.attention.indexer.top_k", 4)
w.add_uint32("deepseek4.hyper_connection.count", HC)
w.add_uint32("deepseek4.hyper_connection.sinkhorn_iterations", 20)
w.add_float32("deepseek4.hyper_connection.epsilon", 1e-6)
w.add_uint32("deepseek4.hash_layer_count", HASH_LAYERS)
w.add_array("deepseek4.swiglu_clamp_exp", [10.0] * N_LAYER)  # f32 array

# Tokenizer: a handful of tokens; not a working vocabulary.
tokens = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
tokens += ["Ġ", "Ġthe", "Ġa", "é", "中文", "\n", "ĠĠ"]
tokens += [chr(ord("a") + i) for i in range(V - len(tokens))]
w.add_tokenizer_model("gpt2")
w.add_tokenizer_pre("joyai-llm")
w.add_token_list(tokens)
w.add_token_types([3, 3, 3, 3] + [1] * (V - 4))  # CONTROL for the specials, NORMAL for the rest
w.add_token_merges(["Ġ t", "Ġt h", "Ġth e", "a b"])
w.add_bos_token_id(0)
w.add_eos_token_id(1)
w.add_add_bos_token(True)
w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

# Every other value type, so the reader is checked on each against gguf-py.
w.add_uint8("test.u8", 200)
w.add_int8("test.i8", -100)
w.add_uint16("test.u16", 60000)
w.add_int16("test.i16", -30000)
w.add_uint64("test.u64", 1 << 40)
w.add_int64("test.i64", -(1 << 40))
w.add_float64("test.f64", 0.1)
w.add_bool("test.false", False)
w.add_array("test.nested", [[1, 2], [3, 4, 5], [6]])  # array of i32 arrays
w.add_array("test.nested_str", [["x", "yy"], ["zzz"]])

# ---- tensors (llama.cpp's deepseek4 names; ggml order shapes) ----
tensor("token_embd.weight", [E, V], "f16")
for i in range(N_LAYER):
    p = f"blk.{i}."
    ratio = RATIOS[i]
    tensor(p + "hc_attn_fn.weight", [HC * E, M], "f16")
    tensor(p + "hc_attn_scale.weight", [3], "f32")
    tensor(p + "hc_attn_base.weight", [M], "f32")
    tensor(p + "attn_norm.weight", [E], "f32")
    tensor(p + "attn_q_a.weight", [E, R], "q8_0")
    tensor(p + "attn_q_a_norm.weight", [R], "f32")
    tensor(p + "attn_q_b.weight", [R, H * D], "q8_0")
    tensor(p + "attn_kv.weight", [E, D], "q8_0")
    tensor(p + "attn_kv_a_norm.weight", [D], "f32")
    tensor(p + "attn_sinks.weight", [H], "f32")
    tensor(p + "attn_output_a.weight", [H * D // G, OR * G], "q8_0")
    tensor(p + "attn_output_b.weight", [G * OR, E], "q8_0")
    if ratio != 0:
        c = 2 if ratio == 4 else 1
        tensor(p + "attn_compressor_ape.weight", [c * D, ratio], "f16")
        tensor(p + "attn_compressor_kv.weight", [E, c * D], "f16")
        tensor(p + "attn_compressor_gate.weight", [E, c * D], "f16")
        tensor(p + "attn_compressor_norm.weight", [D], "f32")
    if ratio == 4:
        tensor(p + "indexer.attn_q_b.weight", [R, IH * ID], "f16")
        tensor(p + "indexer.proj.weight", [E, IH], "f16")
        tensor(p + "indexer_compressor_ape.weight", [2 * ID, 4], "f16")
        tensor(p + "indexer_compressor_kv.weight", [E, 2 * ID], "f16")
        tensor(p + "indexer_compressor_gate.weight", [E, 2 * ID], "f16")
        tensor(p + "indexer_compressor_norm.weight", [ID], "f32")
    tensor(p + "hc_ffn_fn.weight", [HC * E, M], "f16")
    tensor(p + "hc_ffn_scale.weight", [3], "f32")
    tensor(p + "hc_ffn_base.weight", [M], "f32")
    tensor(p + "ffn_norm.weight", [E], "f32")
    tensor(p + "ffn_gate_inp.weight", [E, NE], "bf16" if i == 2 else "f16")
    if i < HASH_LAYERS:
        tensor(p + "ffn_gate_tid2eid.weight", [NU, V], "i32")
    else:
        tensor(p + "exp_probs_b.bias", [NE], "f32")
    tensor(p + "ffn_gate_exps.weight", [E, FF, NE], "q8_0")
    tensor(p + "ffn_up_exps.weight", [E, FF, NE], "q8_0")
    tensor(p + "ffn_down_exps.weight", [FF, E, NE], "q8_0")
    tensor(p + "ffn_gate_shexp.weight", [E, FF], "q8_0")
    tensor(p + "ffn_up_shexp.weight", [E, FF], "q8_0")
    tensor(p + "ffn_down_shexp.weight", [FF, E], "q8_0")
tensor("output_hc_base.weight", [HC], "f32")
tensor("output_hc_fn.weight", [HC * E, HC], "f16")
tensor("output_hc_scale.weight", [1], "f32")
tensor("output_norm.weight", [E], "f32")
tensor("output.weight", [E, V], "q8_0")

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(out_path, os.path.getsize(out_path))
