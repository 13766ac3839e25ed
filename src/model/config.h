// Model configuration: the hyperparameters of a DeepSeek V4 model, read from GGUF metadata (architecture
// `deepseek4`, the keys llama.cpp and ds4 files use; ../shared/docs/formats-spec.md §1.5, peer-llamacpp.md §2.1)
// and validated. Nothing about the real 43-layer shape is assumed: tiny test models, V4 Flash and variants load
// through this one path.
#pragma once

#include "format/gguf.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {

// What the attention of a layer sees besides its raw sliding window.
enum class LayerKind {
    sliding,     // ratio 0: raw window only
    csa,         // compressed sparse attention: overlapping compressor + lightning indexer
    hca,         // heavily compressed attention: non-overlapping compressor, every row visible
};

const char * layer_kind_name(LayerKind kind);

// YaRN frequency interpolation (compressed layers of V4 Flash).
struct YarnParams {
    bool enabled = false;
    double factor = 1;
    double original_context = 0;
    double beta_fast = 32;
    double beta_slow = 1;
};

struct LayerConfig {
    LayerKind kind = LayerKind::sliding;
    int64_t compress_ratio = 0;  // R: tokens per compressed row (0 for sliding layers)
    bool hash_routed = false;    // experts from the token→expert table instead of the router's top-k
    float swiglu_limit = 0;      // clamp of routed experts (0: none)
    float swiglu_limit_shared = 0;
};

struct ModelConfig {
    std::string name;
    int64_t n_layer = 0;
    int64_t n_embd = 0;        // D
    int64_t n_vocab = 0;
    int64_t n_ctx_train = 0;   // deepseek4.context_length (0 when absent)

    // attention
    int64_t n_head = 0;        // H
    int64_t head_dim = 0;      // d: the single K=V head and each query head
    int64_t n_rot = 0;         // r: rotated trailing channels of each head
    int64_t q_lora_rank = 0;
    int64_t o_groups = 0;      // G
    int64_t o_lora_rank = 0;   // per group
    int64_t window = 0;        // raw sliding window, including the current token
    double rope_base = 0;              // sliding layers
    double rope_base_compressed = 0;   // csa/hca layers
    YarnParams yarn;                   // csa/hca layers only

    // lightning indexer (csa layers)
    int64_t indexer_heads = 0;
    int64_t indexer_dim = 0;
    int64_t indexer_top_k = 0;

    // mixture of experts
    int64_t n_expert = 0;
    int64_t n_expert_used = 0;
    int64_t n_expert_shared = 0;
    int64_t expert_ff = 0;
    int64_t n_hash_layers = 0;
    float route_scale = 1;

    // hyper-connections
    int64_t hc = 0;            // streams
    int64_t hc_iters = 0;      // Sinkhorn iterations
    float hc_eps = 0;

    float norm_eps = 0;

    std::vector<LayerConfig> layers;

    int64_t hc_mix() const { return (2 + hc) * hc; }
    int64_t q_dim() const { return n_head * head_dim; }
};

// Reads and validates the configuration. The layer kinds follow the compress ratios and the tensors present
// (a compressed layer is CSA exactly when it has an indexer). Throws dsv4::Error naming the file and the key.
ModelConfig load_config(const GgufFile & file);

// Per-pair inverse frequencies [n_rot / 2] of a layer kind, as the reference computes them (f32).
std::vector<float> rope_inv_freq(const ModelConfig & config, LayerKind kind);

}  // namespace dsv4
