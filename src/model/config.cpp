#include "model/config.h"

#include "util/error.h"

#include <algorithm>
#include <cmath>

namespace dsv4 {

const char * layer_kind_name(LayerKind kind) {
    switch (kind) {
        case LayerKind::sliding: return "sliding";
        case LayerKind::csa: return "csa";
        case LayerKind::hca: return "hca";
    }
    return "?";
}

namespace {

constexpr const char * kArch = "deepseek4";

struct KeyReader {
    const GgufFile & file;

    std::string key(std::string_view suffix) const { return std::string(kArch) + "." + std::string(suffix); }

    // A bound for counts nothing else bounds, high enough for any shape and low enough that products do not overflow.
    static constexpr int64_t kMaxCount = int64_t(1) << 40;

    int64_t count(std::string_view suffix, int64_t min = 1, int64_t max = kMaxCount) const {
        const std::string k = key(suffix);
        const int64_t v = file.get_i64(k);
        DSV4_CHECK(v >= min && v <= max, "{}: {} = {} is outside [{}, {}]", file.path(), k, v, min, max);
        return v;
    }
    std::optional<int64_t> count_opt(std::string_view suffix, int64_t min = 0, int64_t max = kMaxCount) const {
        const std::string k = key(suffix);
        if (!file.has(k)) return std::nullopt;
        return count(suffix, min, max);
    }
    double real(std::string_view suffix) const {
        const std::string k = key(suffix);
        const double v = file.get_f64(k);
        DSV4_CHECK(std::isfinite(v), "{}: {} is not finite", file.path(), k);
        return v;
    }
    double real_or(std::string_view suffix, double fallback) const {
        return file.has(key(suffix)) ? real(suffix) : fallback;
    }
    // A per-layer array (or a scalar meaning "every layer").
    std::vector<double> per_layer(std::string_view suffix, int64_t n_layer) const {
        const std::string k = key(suffix);
        const GgufValue * v = file.find(k);
        DSV4_CHECK(v, "{}: missing metadata key {}", file.path(), k);
        if (v->type != GgufType::ARRAY) return std::vector<double>(size_t(n_layer), real(suffix));
        std::vector<double> a = file.get_f64_array(k);
        DSV4_CHECK(int64_t(a.size()) >= n_layer, "{}: {} has {} entries, the model has {} layers", file.path(), k,
                   a.size(), n_layer);
        return a;
    }
};

}  // namespace

ModelConfig load_config(const GgufFile & file) {
    const std::string arch(file.get_string("general.architecture"));
    DSV4_CHECK(arch == kArch, "{}: general.architecture is '{}', expected '{}'", file.path(), arch, kArch);
    KeyReader k{file};
    ModelConfig c;
    c.name = std::string(file.get_string_opt("general.name").value_or(""));

    // llama.cpp files count an in-file MTP block in block_count and say so in nextn_predict_layers.
    // Per-layer tables are sized by it before any tensor is checked: bounded so that a corrupt count is an error,
    // not an allocation of gigabytes (V4 Flash has 43 layers plus the MTP block).
    const int64_t block_count = k.count("block_count", 1, 4096);
    const int64_t n_nextn = k.count_opt("nextn_predict_layers").value_or(0);
    DSV4_CHECK(n_nextn < block_count, "{}: {}.nextn_predict_layers ({}) leaves no main layers", file.path(), kArch,
               n_nextn);
    c.n_layer = block_count - n_nextn;
    c.n_embd = k.count("embedding_length");
    c.n_ctx_train = k.count_opt("context_length").value_or(0);
    if (auto v = k.count_opt("vocab_size", 1)) {
        c.n_vocab = *v;
    } else if (const GgufTensorInfo * emb = file.find_tensor("token_embd.weight")) {
        c.n_vocab = emb->ne[1];
    } else {
        fail("{}: missing metadata key {}.vocab_size and no token_embd.weight", file.path(), kArch);
    }

    c.n_head = k.count("attention.head_count");
    if (auto kv_heads = k.count_opt("attention.head_count_kv"))
        DSV4_CHECK(*kv_heads == 1, "{}: {}.attention.head_count_kv = {}; DeepSeek V4 has one shared K=V head",
                   file.path(), kArch, *kv_heads);
    c.head_dim = k.count("attention.key_length");
    if (auto vlen = k.count_opt("attention.value_length"))
        DSV4_CHECK(*vlen == c.head_dim, "{}: {}.attention.value_length ({}) differs from key_length ({}); K and V are "
                   "one vector", file.path(), kArch, *vlen, c.head_dim);
    c.n_rot = k.count("rope.dimension_count", 2, c.head_dim);
    DSV4_CHECK(c.n_rot % 2 == 0, "{}: {}.rope.dimension_count = {} must be even", file.path(), kArch, c.n_rot);
    c.q_lora_rank = k.count("attention.q_lora_rank");
    c.o_groups = k.count("attention.output_group_count");
    c.o_lora_rank = k.count("attention.output_lora_rank");
    DSV4_CHECK(c.n_head % c.o_groups == 0, "{}: {} heads do not split into {} output groups", file.path(), c.n_head,
               c.o_groups);
    c.window = k.count("attention.sliding_window", 1);
    c.rope_base = k.real_or("rope.freq_base", 10000.0);
    c.rope_base_compressed = k.real_or("attention.compress_rope_freq_base", c.rope_base);
    DSV4_CHECK(c.rope_base > 1 && c.rope_base_compressed > 1, "{}: rope bases must be > 1", file.path());

    const auto scaling_type = file.get_string_opt(k.key("rope.scaling.type"));
    const double factor = k.real_or("rope.scaling.factor", 1.0);
    c.yarn.enabled = scaling_type ? *scaling_type == "yarn" : factor != 1.0;
    if (scaling_type)
        DSV4_CHECK(*scaling_type == "yarn" || *scaling_type == "none", "{}: {}.rope.scaling.type '{}' is not supported "
                   "(yarn or none)", file.path(), kArch, *scaling_type);
    if (c.yarn.enabled) {
        c.yarn.factor = factor;
        c.yarn.original_context = double(k.count("rope.scaling.original_context_length"));
        c.yarn.beta_fast = k.real_or("rope.scaling.yarn_beta_fast", 32.0);
        c.yarn.beta_slow = k.real_or("rope.scaling.yarn_beta_slow", 1.0);
        DSV4_CHECK(c.yarn.factor > 0, "{}: {}.rope.scaling.factor must be positive", file.path(), kArch);
    }

    c.n_expert = k.count("expert_count");
    c.n_expert_used = k.count("expert_used_count", 1, c.n_expert);
    c.n_expert_shared = k.count_opt("expert_shared_count").value_or(1);
    DSV4_CHECK(c.n_expert_shared == 1, "{}: {}.expert_shared_count = {}; only one shared expert is supported",
               file.path(), kArch, c.n_expert_shared);
    c.expert_ff = k.count("expert_feed_forward_length");
    c.route_scale = float(k.real_or("expert_weights_scale", 1.0));
    if (auto func = k.count_opt("expert_gating_func"))
        DSV4_CHECK(*func == 4, "{}: {}.expert_gating_func = {}; DeepSeek V4 routes with sqrt(softplus) (4)",
                   file.path(), kArch, *func);
    if (auto norm = file.get_bool_opt(k.key("expert_weights_norm")))
        DSV4_CHECK(*norm, "{}: {}.expert_weights_norm is false; V4 always renormalises", file.path(), kArch);
    if (auto groups = k.count_opt("expert_group_count"))
        DSV4_CHECK(*groups <= 1, "{}: {}.expert_group_count = {}; group-limited routing is not part of V4",
                   file.path(), kArch, *groups);

    c.hc = k.count("hyper_connection.count", 1, 16);
    // V4 runs 20; the bound keeps a corrupt value from turning every token into hours of Sinkhorn rounds.
    c.hc_iters = k.count_opt("hyper_connection.sinkhorn_iterations", 1, 1000).value_or(20);
    c.hc_eps = float(k.real("hyper_connection.epsilon"));
    c.norm_eps = float(k.real("attention.layer_norm_rms_epsilon"));

    const std::vector<double> ratios = k.per_layer("attention.compress_ratios", c.n_layer);
    const std::vector<double> limits = k.per_layer("swiglu_clamp_exp", c.n_layer);
    const std::vector<double> limits_shared =
        file.has(k.key("swiglu_clamp_shexp")) ? k.per_layer("swiglu_clamp_shexp", c.n_layer) : limits;
    bool any_csa = false;
    c.layers.resize(size_t(c.n_layer));
    for (int64_t il = 0; il < c.n_layer; ++il) {
        LayerConfig & l = c.layers[size_t(il)];
        const double r = ratios[size_t(il)];
        DSV4_CHECK(r >= 0 && r == std::floor(r) && r <= (1 << 20), "{}: {}.attention.compress_ratios[{}] = {} is not "
                   "a ratio (0 or a positive integer)", file.path(), kArch, il, r);
        l.compress_ratio = int64_t(r);
        const bool has_indexer = file.find_tensor(fmt::format("blk.{}.indexer.attn_q_b.weight", il)) != nullptr;
        l.kind = l.compress_ratio == 0 ? LayerKind::sliding : has_indexer ? LayerKind::csa : LayerKind::hca;
        DSV4_CHECK(l.compress_ratio != 0 || !has_indexer, "{}: layer {} has an indexer but compress ratio 0",
                   file.path(), il);
        any_csa |= l.kind == LayerKind::csa;
        // Hash routing goes with the token→expert table (V4 Flash: the leading layers; test models may mix).
        l.hash_routed = file.find_tensor(fmt::format("blk.{}.ffn_gate_tid2eid.weight", il)) != nullptr;
        c.n_hash_layers += l.hash_routed;
        l.swiglu_limit = float(limits[size_t(il)]);
        l.swiglu_limit_shared = float(limits_shared[size_t(il)]);
        DSV4_CHECK(l.swiglu_limit >= 0 && l.swiglu_limit_shared >= 0, "{}: layer {}: negative SwiGLU clamp",
                   file.path(), il);
    }
    if (auto n_hash = k.count_opt("hash_layer_count"))
        DSV4_CHECK(*n_hash == c.n_hash_layers, "{}: {}.hash_layer_count = {} but {} layers have a token→expert table "
                   "(ffn_gate_tid2eid)", file.path(), kArch, *n_hash, c.n_hash_layers);
    if (any_csa) {
        c.indexer_heads = k.count("attention.indexer.head_count");
        c.indexer_dim = k.count("attention.indexer.key_length");
        // V4 selects 512 rows; the bound keeps a corrupt value from sizing the selection buffers past memory.
        c.indexer_top_k = k.count("attention.indexer.top_k", 0, int64_t(1) << 16);
        DSV4_CHECK((c.indexer_dim & (c.indexer_dim - 1)) == 0, "{}: {}.attention.indexer.key_length = {} must be a "
                   "power of two (Hadamard rotation)", file.path(), kArch, c.indexer_dim);
        DSV4_CHECK(c.n_rot <= c.indexer_dim, "{}: rope dims {} exceed the indexer head width {}", file.path(),
                   c.n_rot, c.indexer_dim);
    }
    return c;
}

std::vector<float> rope_inv_freq(const ModelConfig & c, LayerKind kind) {
    const bool compressed = kind != LayerKind::sliding;
    const double theta = compressed ? c.rope_base_compressed : c.rope_base;
    const int64_t half = c.n_rot / 2;
    std::vector<float> out(static_cast<size_t>(half));
    // As the reference: exponents 2i/r in f32, base frequencies theta^-e in f32, then the YaRN blend in f32.
    for (int64_t i = 0; i < half; ++i) {
        const float e = float(2 * i) / float(c.n_rot);
        out[size_t(i)] = 1.0f / std::pow(float(theta), e);
    }
    if (!compressed || !c.yarn.enabled) return out;
    const double r = double(c.n_rot);
    auto corr_dim = [&](double n_rot) {
        return r * std::log(c.yarn.original_context / (n_rot * 2 * M_PI)) / (2 * std::log(theta));
    };
    const double lo = std::max(std::floor(corr_dim(c.yarn.beta_fast)), 0.0);
    double hi = std::min(std::ceil(corr_dim(c.yarn.beta_slow)), r - 1);
    if (lo == hi) hi += 0.001;
    const float factor = float(c.yarn.factor);
    for (int64_t i = 0; i < half; ++i) {
        const float ramp = std::clamp((float(i) - float(lo)) / (float(hi) - float(lo)), 0.0f, 1.0f);
        const float keep = 1.0f - ramp;  // 1: original frequency (fast pairs); 0: frequency / factor
        out[size_t(i)] = out[size_t(i)] / factor * (1.0f - keep) + out[size_t(i)] * keep;
    }
    return out;
}

}  // namespace dsv4
