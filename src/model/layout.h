// The tensor layout of a deepseek4 GGUF: every tensor a configuration has, with its name, shape and role.
// One table serves the loader (model/weights), the converter (model/convert) and the synthetic-model generator
// (model/synth), and store_config() is the inverse of load_config(), so what dsv4 writes it can read.
//
// Names and shapes follow llama.cpp's `deepseek4` layout (formats-spec.md §1.6, peer-llamacpp.md §2.2); shapes
// are ggml order [ne0 = input width, ne1 = rows, ne2 = experts].
#pragma once

#include "format/gguf.h"
#include "format/types.h"
#include "model/config.h"

#include <string>
#include <vector>

namespace dsv4 {

enum class Slot {
    // model
    token_embd, output_norm, output, output_hc_fn, output_hc_scale, output_hc_base,
    // layer
    hc_attn_fn, hc_attn_scale, hc_attn_base, hc_ffn_fn, hc_ffn_scale, hc_ffn_base,
    attn_norm, q_a, q_a_norm, q_b, kv, kv_norm, sinks, o_a, o_b,
    comp_kv, comp_gate, comp_ape, comp_norm,
    idx_q_b, idx_proj, idx_comp_kv, idx_comp_gate, idx_comp_ape, idx_comp_norm,
    ffn_norm, gate_inp, exp_probs_b, tid2eid, gate_exps, up_exps, down_exps, gate_shexp, up_shexp, down_shexp,
    // MTP (llama.cpp keeps them under blk.{n_layer}.nextn.*, ds4 under mtp.0.*)
    mtp_eh_proj, mtp_e_proj, mtp_h_proj, mtp_enorm, mtp_hnorm, mtp_norm, mtp_hc_head_fn, mtp_hc_head_scale,
    mtp_hc_head_base,
};

// How a tensor is stored and initialised: the storage recipes (dsv4-convert --type, dsv4-synth --mix) pick a
// type per role.
enum class Role {
    vector,       // norms, sinks, HC scale/base, router bias: F32
    table,        // token → experts: I32
    embedding,    // token embedding
    control,      // HC mixing, router, compressors, indexer (F16 in ds4's quantized files)
    dense,        // attention projections, shared expert, LM head, MTP projections
    expert_gate,  // routed expert gate/up
    expert_down,  // routed expert down
};

struct TensorSpec {
    Slot slot;
    int64_t layer = -1;  // -1: not a layer tensor
    std::string name;
    int64_t ne[3] = {1, 1, 1};
    Role role = Role::vector;

    int64_t rows() const { return ne[1] * ne[2]; }
};

// The suffix of a slot's tensor name ("attn_q_a.weight"); model tensors have their whole name.
const char * slot_suffix(Slot slot);

// Every tensor of the main model, in file order: the model tensors, then layer by layer. Score-routed layers
// list exp_probs_b (ds4's files may omit it: the loader accepts that).
std::vector<TensorSpec> tensor_layout(const ModelConfig & config);

// The MTP block's tensors under `prefix` ("blk.{n_layer}." for llama.cpp's in-file layout, with fused eh_proj and
// no HC head of its own; "mtp.0." for ds4's separate file, with split e/h projections and its own HC head).
std::vector<TensorSpec> mtp_layout(const ModelConfig & config, const std::string & prefix, bool llama_cpp_layout);

// The layer configuration an MTP block runs with: a sliding-window, score-routed layer.
LayerConfig mtp_layer_config(const ModelConfig & config);

// Storage recipes shared by the converter and the synthetic generator.
enum class StorageMix { f32, f16, bf16, q8_0, q2, q4 };
bool parse_storage_mix(std::string_view name, StorageMix * out);
const char * storage_mix_name(StorageMix mix);
// The type a role gets under a mix; rows that do not split into its blocks fall back to Q8_0, then F16.
GgmlType storage_type(Role role, StorageMix mix, int64_t row_width);

// Writes the `deepseek4.*` metadata of a configuration (the inverse of load_config).
void store_config(GgufWriter & writer, const ModelConfig & config, bool with_mtp = false);

}  // namespace dsv4
