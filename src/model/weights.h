// Model weights: every tensor of the forward pass bound by its GGUF name, with shape and type checked against
// the configuration. Matrices keep the type of the file (any type format/quant supports); small vectors (norms,
// sinks, HC scales and bases, router biases) are converted to F32 at load. Shapes are in ggml order
// [ne0 = input width, ne1 = output rows, ne2 = experts].
//
// Names: the llama.cpp `deepseek4` layout (formats-spec.md §1.6, peer-llamacpp.md §2.2), which ds4's files share.
// MTP comes either from ds4's separate file (`mtp.0.*`) or from llama.cpp's extra block (`blk.{n_layer}.*` with
// `nextn.*`).
#pragma once

#include "backend/backend.h"
#include "format/gguf.h"
#include "model/config.h"

#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace dsv4 {

struct LayerWeights {
    // hyper-connections around the attention sublayer and the FFN sublayer
    Tensor hc_attn_fn;     // [hc·D, (2+hc)·hc]
    Tensor hc_attn_scale;  // F32 [3]
    Tensor hc_attn_base;   // F32 [(2+hc)·hc]
    Tensor hc_ffn_fn;      // [hc·D, (2+hc)·hc]
    Tensor hc_ffn_scale;   // F32 [3]
    Tensor hc_ffn_base;    // F32 [(2+hc)·hc]

    // attention
    Tensor attn_norm;  // F32 [D]
    Tensor q_a;        // [D, q_lora]
    Tensor q_a_norm;   // F32 [q_lora]
    Tensor q_b;        // [q_lora, H·d]
    Tensor kv;         // [D, d]: the one K=V head
    Tensor kv_norm;    // F32 [d]
    Tensor sinks;      // F32 [H]: per-head sink logits
    Tensor o_a;        // [H·d/G, G·o_lora]: group g uses rows [g·o_lora, (g+1)·o_lora)
    Tensor o_b;        // [G·o_lora, D]

    // compressor (csa and hca layers); c = 2 on csa layers (overlapping blocks), 1 on hca
    Tensor comp_kv;    // [D, c·d]
    Tensor comp_gate;  // [D, c·d]
    Tensor comp_ape;   // [c·d, R]: gate bias per position in the block
    Tensor comp_norm;  // F32 [d]

    // lightning indexer (csa layers)
    Tensor idx_q_b;        // [q_lora, H_I·d_I]
    Tensor idx_proj;       // [D, H_I]: per-head weights
    Tensor idx_comp_kv;    // [D, 2·d_I]
    Tensor idx_comp_gate;  // [D, 2·d_I]
    Tensor idx_comp_ape;   // [2·d_I, R]
    Tensor idx_comp_norm;  // F32 [d_I]

    // mixture of experts
    Tensor ffn_norm;     // F32 [D]
    Tensor gate_inp;     // [D, E]: router
    Tensor exp_probs_b;  // F32 [E]: selection bias (score-routed layers; zero when the file has none)
    Tensor tid2eid;      // I32 [k, V]: token → experts (hash-routed layers)
    Tensor gate_exps;    // [D, I, E]
    Tensor up_exps;      // [D, I, E]
    Tensor down_exps;    // [I, D, E]
    Tensor gate_shexp;   // [D, I]
    Tensor up_shexp;     // [D, I]
    Tensor down_shexp;   // [I, D]
};

// The multi-token-prediction block: one ordinary sliding-window layer plus its input projections and head.
struct MtpWeights {
    LayerWeights block;
    LayerConfig config;
    Tensor e_proj;          // [D, D]: applied to enorm(embedding)   (null when eh_proj is used)
    Tensor h_proj;          // [D, D]: applied to hnorm(hidden)      (null when eh_proj is used)
    Tensor eh_proj;         // [2D, D]: llama.cpp's fused [e_proj | h_proj] (null when split)
    Tensor enorm;           // F32 [D]
    Tensor hnorm;           // F32 [D]
    Tensor norm;            // F32 [D]: before the shared LM head
    Tensor hc_head_fn;      // [hc·D, hc]
    Tensor hc_head_scale;   // F32 [1]
    Tensor hc_head_base;    // F32 [hc]
};

struct ModelWeights {
    Tensor token_embd;       // [D, V]
    Tensor output_hc_fn;     // [hc·D, hc]
    Tensor output_hc_scale;  // F32 [1]
    Tensor output_hc_base;   // F32 [hc]
    Tensor output_norm;      // F32 [D]
    Tensor output;           // [D, V]
    std::vector<LayerWeights> layers;
    std::optional<MtpWeights> mtp;

    // F32 copies of small vectors and device copies of matrices.
    std::vector<std::unique_ptr<BackendBuffer>> storage;
};

// Called after each tensor is in backend memory with the bytes done and the bytes of all tensors.
using LoadProgressFn = std::function<void(uint64_t bytes_done, uint64_t bytes_total)>;

// Binds every tensor of `file` (and of `mtp_file`, ds4's separate MTP GGUF, when given) and uploads them to the
// backend. Throws dsv4::Error naming the file and the tensor for a missing tensor, a wrong shape or an
// unsupported type.
ModelWeights load_weights(const GgufFile & file, const ModelConfig & config, Backend & backend,
                          const GgufFile * mtp_file = nullptr, const LoadProgressFn & progress = {});

}  // namespace dsv4
