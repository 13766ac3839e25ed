#include "model/layout.h"

#include "format/quant.h"
#include "util/error.h"

namespace dsv4 {

const char * slot_suffix(Slot slot) {
    switch (slot) {
        case Slot::token_embd: return "token_embd.weight";
        case Slot::output_norm: return "output_norm.weight";
        case Slot::output: return "output.weight";
        case Slot::output_hc_fn: return "output_hc_fn.weight";
        case Slot::output_hc_scale: return "output_hc_scale.weight";
        case Slot::output_hc_base: return "output_hc_base.weight";
        case Slot::hc_attn_fn: return "hc_attn_fn.weight";
        case Slot::hc_attn_scale: return "hc_attn_scale.weight";
        case Slot::hc_attn_base: return "hc_attn_base.weight";
        case Slot::hc_ffn_fn: return "hc_ffn_fn.weight";
        case Slot::hc_ffn_scale: return "hc_ffn_scale.weight";
        case Slot::hc_ffn_base: return "hc_ffn_base.weight";
        case Slot::attn_norm: return "attn_norm.weight";
        case Slot::q_a: return "attn_q_a.weight";
        case Slot::q_a_norm: return "attn_q_a_norm.weight";
        case Slot::q_b: return "attn_q_b.weight";
        case Slot::kv: return "attn_kv.weight";
        case Slot::kv_norm: return "attn_kv_a_norm.weight";
        case Slot::sinks: return "attn_sinks.weight";
        case Slot::o_a: return "attn_output_a.weight";
        case Slot::o_b: return "attn_output_b.weight";
        case Slot::comp_kv: return "attn_compressor_kv.weight";
        case Slot::comp_gate: return "attn_compressor_gate.weight";
        case Slot::comp_ape: return "attn_compressor_ape.weight";
        case Slot::comp_norm: return "attn_compressor_norm.weight";
        // The indexer's names mix a dot and underscores: that is the layout files carry.
        case Slot::idx_q_b: return "indexer.attn_q_b.weight";
        case Slot::idx_proj: return "indexer.proj.weight";
        case Slot::idx_comp_kv: return "indexer_compressor_kv.weight";
        case Slot::idx_comp_gate: return "indexer_compressor_gate.weight";
        case Slot::idx_comp_ape: return "indexer_compressor_ape.weight";
        case Slot::idx_comp_norm: return "indexer_compressor_norm.weight";
        case Slot::ffn_norm: return "ffn_norm.weight";
        case Slot::gate_inp: return "ffn_gate_inp.weight";
        case Slot::exp_probs_b: return "exp_probs_b.bias";
        case Slot::tid2eid: return "ffn_gate_tid2eid.weight";
        case Slot::gate_exps: return "ffn_gate_exps.weight";
        case Slot::up_exps: return "ffn_up_exps.weight";
        case Slot::down_exps: return "ffn_down_exps.weight";
        case Slot::gate_shexp: return "ffn_gate_shexp.weight";
        case Slot::up_shexp: return "ffn_up_shexp.weight";
        case Slot::down_shexp: return "ffn_down_shexp.weight";
        case Slot::mtp_eh_proj: return "nextn.eh_proj.weight";
        case Slot::mtp_e_proj: return "e_proj.weight";
        case Slot::mtp_h_proj: return "h_proj.weight";
        case Slot::mtp_enorm: return "enorm.weight";
        case Slot::mtp_hnorm: return "hnorm.weight";
        case Slot::mtp_norm: return "norm.weight";
        case Slot::mtp_hc_head_fn: return "hc_head_fn.weight";
        case Slot::mtp_hc_head_scale: return "hc_head_scale.weight";
        case Slot::mtp_hc_head_base: return "hc_head_base.weight";
    }
    return "?";
}

namespace {

void add(std::vector<TensorSpec> & out, Slot slot, int64_t layer, const std::string & prefix, Role role,
         int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1) {
    TensorSpec s;
    s.slot = slot;
    s.layer = layer;
    s.name = prefix + slot_suffix(slot);
    s.ne[0] = ne0;
    s.ne[1] = ne1;
    s.ne[2] = ne2;
    s.role = role;
    out.push_back(std::move(s));
}

void add_block(std::vector<TensorSpec> & out, const ModelConfig & c, const LayerConfig & lc, int64_t il,
               const std::string & p) {
    const int64_t D = c.n_embd, d = c.head_dim, mix = c.hc_mix(), I = c.expert_ff, E = c.n_expert;
    add(out, Slot::hc_attn_fn, il, p, Role::control, c.hc * D, mix);
    add(out, Slot::hc_attn_scale, il, p, Role::vector, 3);
    add(out, Slot::hc_attn_base, il, p, Role::vector, mix);
    add(out, Slot::hc_ffn_fn, il, p, Role::control, c.hc * D, mix);
    add(out, Slot::hc_ffn_scale, il, p, Role::vector, 3);
    add(out, Slot::hc_ffn_base, il, p, Role::vector, mix);
    add(out, Slot::attn_norm, il, p, Role::vector, D);
    add(out, Slot::q_a, il, p, Role::dense, D, c.q_lora_rank);
    add(out, Slot::q_a_norm, il, p, Role::vector, c.q_lora_rank);
    add(out, Slot::q_b, il, p, Role::dense, c.q_lora_rank, c.q_dim());
    add(out, Slot::kv, il, p, Role::dense, D, d);
    add(out, Slot::kv_norm, il, p, Role::vector, d);
    add(out, Slot::sinks, il, p, Role::vector, c.n_head);
    add(out, Slot::o_a, il, p, Role::dense, c.q_dim() / c.o_groups, c.o_groups * c.o_lora_rank);
    add(out, Slot::o_b, il, p, Role::dense, c.o_groups * c.o_lora_rank, D);
    if (lc.kind != LayerKind::sliding) {
        const int64_t w = (lc.kind == LayerKind::csa ? 2 : 1) * d;
        add(out, Slot::comp_kv, il, p, Role::control, D, w);
        add(out, Slot::comp_gate, il, p, Role::control, D, w);
        add(out, Slot::comp_ape, il, p, Role::control, w, lc.compress_ratio);
        add(out, Slot::comp_norm, il, p, Role::vector, d);
    }
    if (lc.kind == LayerKind::csa) {
        const int64_t dI = c.indexer_dim;
        add(out, Slot::idx_q_b, il, p, Role::control, c.q_lora_rank, c.indexer_heads * dI);
        add(out, Slot::idx_proj, il, p, Role::control, D, c.indexer_heads);
        add(out, Slot::idx_comp_kv, il, p, Role::control, D, 2 * dI);
        add(out, Slot::idx_comp_gate, il, p, Role::control, D, 2 * dI);
        add(out, Slot::idx_comp_ape, il, p, Role::control, 2 * dI, lc.compress_ratio);
        add(out, Slot::idx_comp_norm, il, p, Role::vector, dI);
    }
    add(out, Slot::ffn_norm, il, p, Role::vector, D);
    add(out, Slot::gate_inp, il, p, Role::control, D, E);
    if (lc.hash_routed)
        add(out, Slot::tid2eid, il, p, Role::table, c.n_expert_used, c.n_vocab);
    else
        add(out, Slot::exp_probs_b, il, p, Role::vector, E);
    add(out, Slot::gate_exps, il, p, Role::expert_gate, D, I, E);
    add(out, Slot::up_exps, il, p, Role::expert_gate, D, I, E);
    add(out, Slot::down_exps, il, p, Role::expert_down, I, D, E);
    add(out, Slot::gate_shexp, il, p, Role::dense, D, I * c.n_expert_shared);
    add(out, Slot::up_shexp, il, p, Role::dense, D, I * c.n_expert_shared);
    add(out, Slot::down_shexp, il, p, Role::dense, I * c.n_expert_shared, D);
}

}  // namespace

std::vector<TensorSpec> tensor_layout(const ModelConfig & c) {
    std::vector<TensorSpec> out;
    const int64_t D = c.n_embd;
    add(out, Slot::token_embd, -1, "", Role::embedding, D, c.n_vocab);
    add(out, Slot::output_norm, -1, "", Role::vector, D);
    add(out, Slot::output, -1, "", Role::dense, D, c.n_vocab);
    add(out, Slot::output_hc_fn, -1, "", Role::control, c.hc * D, c.hc);
    add(out, Slot::output_hc_scale, -1, "", Role::vector, 1);
    add(out, Slot::output_hc_base, -1, "", Role::vector, c.hc);
    for (int64_t il = 0; il < c.n_layer; ++il)
        add_block(out, c, c.layers[size_t(il)], il, "blk." + std::to_string(il) + ".");
    return out;
}

LayerConfig mtp_layer_config(const ModelConfig & c) {
    LayerConfig lc = c.layers.back();
    lc.kind = LayerKind::sliding;
    lc.compress_ratio = 0;
    lc.hash_routed = false;
    return lc;
}

std::vector<TensorSpec> mtp_layout(const ModelConfig & c, const std::string & p, bool llama_cpp_layout) {
    std::vector<TensorSpec> out;
    const int64_t D = c.n_embd, il = c.n_layer;
    add_block(out, c, mtp_layer_config(c), il, p);
    if (llama_cpp_layout) {
        add(out, Slot::mtp_eh_proj, il, p, Role::dense, 2 * D, D);
        add(out, Slot::mtp_enorm, il, p + "nextn.", Role::vector, D);
        add(out, Slot::mtp_hnorm, il, p + "nextn.", Role::vector, D);
    } else {
        add(out, Slot::mtp_e_proj, il, p, Role::dense, D, D);
        add(out, Slot::mtp_h_proj, il, p, Role::dense, D, D);
        add(out, Slot::mtp_enorm, il, p, Role::vector, D);
        add(out, Slot::mtp_hnorm, il, p, Role::vector, D);
        add(out, Slot::mtp_norm, il, p, Role::vector, D);
        add(out, Slot::mtp_hc_head_fn, il, p, Role::control, c.hc * D, c.hc);
        add(out, Slot::mtp_hc_head_scale, il, p, Role::vector, 1);
        add(out, Slot::mtp_hc_head_base, il, p, Role::vector, c.hc);
    }
    return out;
}

bool parse_storage_mix(std::string_view name, StorageMix * out) {
    static const std::pair<std::string_view, StorageMix> kMixes[] = {
        {"f32", StorageMix::f32},   {"f16", StorageMix::f16}, {"bf16", StorageMix::bf16},
        {"q8_0", StorageMix::q8_0}, {"q2", StorageMix::q2},   {"q4", StorageMix::q4}};
    for (auto & [n, m] : kMixes)
        if (n == name) {
            *out = m;
            return true;
        }
    return false;
}

const char * storage_mix_name(StorageMix mix) {
    switch (mix) {
        case StorageMix::f32: return "f32";
        case StorageMix::f16: return "f16";
        case StorageMix::bf16: return "bf16";
        case StorageMix::q8_0: return "q8_0";
        case StorageMix::q2: return "q2";
        case StorageMix::q4: return "q4";
    }
    return "?";
}

GgmlType storage_type(Role role, StorageMix mix, int64_t row_width) {
    const bool quantized = mix == StorageMix::q8_0 || mix == StorageMix::q2 || mix == StorageMix::q4;
    const GgmlType plain = mix == StorageMix::f32 ? GgmlType::F32 : mix == StorageMix::bf16 ? GgmlType::BF16
                                                                                          : GgmlType::F16;
    GgmlType t = plain;
    switch (role) {
        case Role::vector: return GgmlType::F32;
        case Role::table: return GgmlType::I32;
        // ds4's recipe: embedding, HC, router, compressors and indexer stay F16 in quantized files.
        case Role::embedding:
        case Role::control: t = quantized ? GgmlType::F16 : plain; break;
        case Role::dense: t = quantized ? GgmlType::Q8_0 : plain; break;
        case Role::expert_gate:
            t = mix == StorageMix::q2 ? GgmlType::IQ2_XXS : mix == StorageMix::q4 ? GgmlType::Q4_K
                : mix == StorageMix::q8_0                 ? GgmlType::Q8_0
                                                          : plain;
            break;
        case Role::expert_down:
            t = mix == StorageMix::q2 ? GgmlType::Q2_K : mix == StorageMix::q4 ? GgmlType::Q4_K
                : mix == StorageMix::q8_0                 ? GgmlType::Q8_0
                                                          : plain;
            break;
    }
    if (row_width % type_traits(t).block_elems != 0)
        t = row_width % QK8_0 == 0 && t != GgmlType::Q8_0 ? GgmlType::Q8_0 : GgmlType::F16;
    return t;
}

void store_config(GgufWriter & w, const ModelConfig & c, bool with_mtp) {
    const std::string a = "deepseek4.";
    auto u32 = [&](const char * k, int64_t v) { w.set(a + k, GgufValue::make_u32(uint32_t(v))); };
    auto f32 = [&](const char * k, double v) { w.set(a + k, GgufValue::make_f32(float(v))); };
    w.set("general.architecture", GgufValue::make_string("deepseek4"));
    if (!c.name.empty()) w.set("general.name", GgufValue::make_string(c.name));
    if (c.n_ctx_train > 0) u32("context_length", c.n_ctx_train);
    u32("embedding_length", c.n_embd);
    // llama.cpp counts an in-file MTP block in block_count and names how many in nextn_predict_layers.
    u32("block_count", c.n_layer + (with_mtp ? 1 : 0));
    if (with_mtp) u32("nextn_predict_layers", 1);
    u32("vocab_size", c.n_vocab);
    u32("attention.head_count", c.n_head);
    u32("attention.head_count_kv", 1);
    u32("attention.key_length", c.head_dim);
    u32("attention.value_length", c.head_dim);
    u32("rope.dimension_count", c.n_rot);
    u32("attention.q_lora_rank", c.q_lora_rank);
    u32("attention.output_lora_rank", c.o_lora_rank);
    u32("attention.output_group_count", c.o_groups);
    u32("attention.sliding_window", c.window);
    f32("attention.layer_norm_rms_epsilon", c.norm_eps);
    f32("rope.freq_base", c.rope_base);
    f32("attention.compress_rope_freq_base", c.rope_base_compressed);
    w.set(a + "rope.scaling.type", GgufValue::make_string(c.yarn.enabled ? "yarn" : "none"));
    if (c.yarn.enabled) {
        f32("rope.scaling.factor", c.yarn.factor);
        u32("rope.scaling.original_context_length", int64_t(c.yarn.original_context));
        f32("rope.scaling.yarn_beta_fast", c.yarn.beta_fast);
        f32("rope.scaling.yarn_beta_slow", c.yarn.beta_slow);
    }
    u32("expert_count", c.n_expert);
    u32("expert_used_count", c.n_expert_used);
    u32("expert_shared_count", c.n_expert_shared);
    u32("expert_feed_forward_length", c.expert_ff);
    u32("expert_gating_func", 4);
    f32("expert_weights_scale", c.route_scale);
    w.set(a + "expert_weights_norm", GgufValue::make_bool(true));
    // V4 Flash hash-routes its leading layers (all llama.cpp accepts); dsv4 reads each layer's routing from its
    // token→expert table, so test models may mix.
    int64_t n_hash = 0;
    for (const LayerConfig & l : c.layers) n_hash += l.hash_routed;
    u32("hash_layer_count", n_hash);
    if (c.indexer_heads > 0) {
        u32("attention.indexer.head_count", c.indexer_heads);
        u32("attention.indexer.key_length", c.indexer_dim);
        u32("attention.indexer.top_k", c.indexer_top_k);
    }
    u32("hyper_connection.count", c.hc);
    u32("hyper_connection.sinkhorn_iterations", c.hc_iters);
    f32("hyper_connection.epsilon", c.hc_eps);
    std::vector<GgufValue> ratios, limits, limits_shared;
    bool shared_differs = false;
    for (const LayerConfig & l : c.layers) {
        ratios.push_back(GgufValue::make_i32(int32_t(l.compress_ratio)));
        limits.push_back(GgufValue::make_f32(l.swiglu_limit));
        limits_shared.push_back(GgufValue::make_f32(l.swiglu_limit_shared));
        shared_differs |= l.swiglu_limit_shared != l.swiglu_limit;
    }
    if (with_mtp) {
        const LayerConfig m = mtp_layer_config(c);
        ratios.push_back(GgufValue::make_i32(0));
        limits.push_back(GgufValue::make_f32(m.swiglu_limit));
        limits_shared.push_back(GgufValue::make_f32(m.swiglu_limit_shared));
    }
    w.set(a + "attention.compress_ratios", GgufValue::make_array(GgufType::INT32, std::move(ratios)));
    w.set(a + "swiglu_clamp_exp", GgufValue::make_array(GgufType::FLOAT32, std::move(limits)));
    if (shared_differs) w.set(a + "swiglu_clamp_shexp", GgufValue::make_array(GgufType::FLOAT32, std::move(limits_shared)));
}

}  // namespace dsv4
