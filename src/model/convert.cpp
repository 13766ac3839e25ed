#include "model/convert.h"

#include "model/layout.h"

#include "format/gguf.h"
#include "format/quant.h"
#include "format/safetensors.h"
#include "util/error.h"
#include "util/file.h"
#include "util/half.h"
#include "util/log.h"
#include "util/thread_pool.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

namespace dsv4 {

namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------------------------------
// Source configuration: transformers' DeepseekV4Config or DeepSeek's ModelArgs, normalised
// ---------------------------------------------------------------------------------------------------------------------

struct SrcLayer {
    int64_t ratio = 0;
    bool csa = false;
    bool hash = false;
};

struct SrcConfig {
    bool official = false;  // DeepSeek's inference checkpoint (else transformers)
    int64_t vocab = 0, dim = 0, n_layer = 0, n_head = 0, head_dim = 0, n_rot = 0, q_lora = 0, o_groups = 0,
            o_lora = 0, expert_ff = 0, n_expert = 0, n_used = 0, window = 0, idx_heads = 0, idx_dim = 0, idx_top_k = 0,
            hc = 0, hc_iters = 0, max_ctx = 0;
    double route_scale = 1, swiglu_limit = 0, hc_eps = 0, norm_eps = 0, rope_base = 10000, rope_base_compressed = 0;
    bool yarn = false;
    double yarn_factor = 1, yarn_original = 0, yarn_beta_fast = 32, yarn_beta_slow = 1;
    std::vector<SrcLayer> layers;
};

template <typename T> T need(const json & j, const char * key, const std::string & file) {
    DSV4_CHECK(j.contains(key), "{}: missing '{}'", file, key);
    try {
        return j.at(key).get<T>();
    } catch (const json::exception & e) {
        fail("{}: '{}' has the wrong type: {}", file, key, e.what());
    }
}

template <typename T> T opt(const json & j, const char * key, T fallback) {
    if (!j.contains(key) || j.at(key).is_null()) return fallback;
    try {
        return j.at(key).get<T>();
    } catch (const json::exception &) {
        return fallback;
    }
}

// The hyperparameters both config formats have, under their two names (transformers', DeepSeek's ModelArgs).
// A field with no default is required.
struct ConfigKey {
    const char * hf;
    const char * official;
    int64_t SrcConfig::*count = nullptr;
    double SrcConfig::*real = nullptr;
    std::optional<double> fallback;
};

const ConfigKey kConfigKeys[] = {
    {"vocab_size", "vocab_size", &SrcConfig::vocab, nullptr, {}},
    {"hidden_size", "dim", &SrcConfig::dim, nullptr, {}},
    {"num_hidden_layers", "n_layers", &SrcConfig::n_layer, nullptr, {}},
    {"num_attention_heads", "n_heads", &SrcConfig::n_head, nullptr, {}},
    {"head_dim", "head_dim", &SrcConfig::head_dim, nullptr, {}},
    {"q_lora_rank", "q_lora_rank", &SrcConfig::q_lora, nullptr, {}},
    {"o_groups", "o_groups", &SrcConfig::o_groups, nullptr, {}},
    {"o_lora_rank", "o_lora_rank", &SrcConfig::o_lora, nullptr, {}},
    {"moe_intermediate_size", "moe_inter_dim", &SrcConfig::expert_ff, nullptr, {}},
    {"n_routed_experts", "n_routed_experts", &SrcConfig::n_expert, nullptr, {}},
    {"num_experts_per_tok", "n_activated_experts", &SrcConfig::n_used, nullptr, {}},
    {"sliding_window", "window_size", &SrcConfig::window, nullptr, {}},
    {"hc_mult", "hc_mult", &SrcConfig::hc, nullptr, {}},
    {"index_n_heads", "index_n_heads", &SrcConfig::idx_heads, nullptr, 0},
    {"index_head_dim", "index_head_dim", &SrcConfig::idx_dim, nullptr, 0},
    {"index_topk", "index_topk", &SrcConfig::idx_top_k, nullptr, 0},
    {"hc_sinkhorn_iters", "hc_sinkhorn_iters", &SrcConfig::hc_iters, nullptr, 20},
    {"max_position_embeddings", "max_seq_len", &SrcConfig::max_ctx, nullptr, 0},
    {"hc_eps", "hc_eps", nullptr, &SrcConfig::hc_eps, 1e-6},
    {"rms_norm_eps", "norm_eps", nullptr, &SrcConfig::norm_eps, 1e-6},
    {"routed_scaling_factor", "route_scale", nullptr, &SrcConfig::route_scale, 1.0},
    {"swiglu_limit", "swiglu_limit", nullptr, &SrcConfig::swiglu_limit, 0.0},
    {"rope_theta", "rope_theta", nullptr, &SrcConfig::rope_base, 10000.0},
};

void read_common_keys(const json & j, const std::string & file, bool official, SrcConfig & c) {
    for (const ConfigKey & k : kConfigKeys) {
        const char * key = official ? k.official : k.hf;
        if (k.count) c.*k.count = k.fallback ? opt<int64_t>(j, key, int64_t(*k.fallback)) : need<int64_t>(j, key, file);
        else c.*k.real = k.fallback ? opt<double>(j, key, *k.fallback) : need<double>(j, key, file);
    }
    c.rope_base_compressed = opt<double>(j, "compress_rope_theta", c.rope_base);
}

SrcConfig read_hf_config(const json & j, const std::string & file) {
    SrcConfig c;
    read_common_keys(j, file, false, c);
    c.n_rot = j.contains("qk_rope_head_dim") && !j["qk_rope_head_dim"].is_null()
                  ? j["qk_rope_head_dim"].get<int64_t>()
                  : int64_t(double(c.head_dim) * opt<double>(j, "partial_rotary_factor", 1.0));

    // rope_parameters: nested {main, compress} as transformers writes it, or a flat dict for the compressed rope.
    json compress = json::object();
    if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
        const json & rp = j["rope_parameters"];
        if (rp.contains("compress")) {
            compress = rp["compress"];
            if (rp.contains("main")) c.rope_base = opt<double>(rp["main"], "rope_theta", c.rope_base);
        } else {
            compress = rp;
        }
    }
    c.rope_base_compressed = opt<double>(compress, "rope_theta", c.rope_base_compressed);
    c.yarn = opt<std::string>(compress, "rope_type", "default") == "yarn";
    if (c.yarn) {
        c.yarn_factor = need<double>(compress, "factor", file + " rope_parameters");
        c.yarn_original = need<double>(compress, "original_max_position_embeddings", file + " rope_parameters");
        c.yarn_beta_fast = opt<double>(compress, "beta_fast", 32.0);
        c.yarn_beta_slow = opt<double>(compress, "beta_slow", 1.0);
    }

    // Layer schedule: layer_types + compress_rates, or the legacy compress_ratios.
    std::vector<std::string> types;
    if (j.contains("layer_types")) types = j["layer_types"].get<std::vector<std::string>>();
    std::map<std::string, int64_t> rates = {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 128}};
    if (j.contains("compress_rates") && j["compress_rates"].is_object())
        for (auto & [k, v] : j["compress_rates"].items()) rates[k] = v.get<int64_t>();
    if (types.empty() && j.contains("compress_ratios")) {
        for (int64_t r : j["compress_ratios"].get<std::vector<int64_t>>())
            types.push_back(r == 0 ? "sliding_attention" : r == 4 ? "compressed_sparse_attention"
                                                                   : "heavily_compressed_attention");
        types.resize(size_t(c.n_layer));
    }
    DSV4_CHECK(int64_t(types.size()) == c.n_layer, "{}: layer_types has {} entries for {} layers", file,
               types.size(), c.n_layer);
    std::vector<std::string> mlp;
    if (j.contains("mlp_layer_types")) {
        mlp = j["mlp_layer_types"].get<std::vector<std::string>>();
    } else {
        const int64_t n_hash = opt<int64_t>(j, "num_hash_layers", 3);
        for (int64_t i = 0; i < c.n_layer; ++i) mlp.push_back(i < n_hash ? "hash_moe" : "moe");
    }
    DSV4_CHECK(int64_t(mlp.size()) == c.n_layer, "{}: mlp_layer_types has {} entries for {} layers", file, mlp.size(),
               c.n_layer);
    for (int64_t i = 0; i < c.n_layer; ++i) {
        SrcLayer l;
        const std::string & t = types[size_t(i)];
        if (t == "sliding_attention") {
            l.ratio = 0;
        } else if (t == "compressed_sparse_attention" || t == "heavily_compressed_attention") {
            DSV4_CHECK(rates.count(t), "{}: compress_rates has no entry for {}", file, t);
            l.ratio = rates[t];
            l.csa = t == "compressed_sparse_attention";
        } else {
            fail("{}: layer_types[{}] = '{}' is not a DeepSeek V4 layer type", file, i, t);
        }
        DSV4_CHECK(mlp[size_t(i)] == "hash_moe" || mlp[size_t(i)] == "moe", "{}: mlp_layer_types[{}] = '{}'", file, i,
                   mlp[size_t(i)]);
        l.hash = mlp[size_t(i)] == "hash_moe";
        c.layers.push_back(l);
    }
    return c;
}

SrcConfig read_official_config(const json & j, const std::string & file) {
    SrcConfig c;
    c.official = true;
    read_common_keys(j, file, true, c);
    c.n_rot = need<int64_t>(j, "rope_head_dim", file);
    const std::string score = opt<std::string>(j, "score_func", "sqrtsoftplus");
    DSV4_CHECK(score == "sqrtsoftplus", "{}: score_func '{}' is not DeepSeek V4's sqrtsoftplus", file, score);
    c.yarn_factor = opt<double>(j, "rope_factor", 1.0);
    c.yarn_original = double(opt<int64_t>(j, "original_seq_len", 0));
    c.yarn = c.yarn_factor != 1.0 && c.yarn_original > 0;
    c.yarn_beta_fast = opt<double>(j, "beta_fast", 32.0);
    c.yarn_beta_slow = opt<double>(j, "beta_slow", 1.0);
    const auto ratios = need<std::vector<int64_t>>(j, "compress_ratios", file);
    DSV4_CHECK(int64_t(ratios.size()) >= c.n_layer, "{}: compress_ratios has {} entries for {} layers", file,
               ratios.size(), c.n_layer);
    const int64_t n_hash = opt<int64_t>(j, "n_hash_layers", 0);
    for (int64_t i = 0; i < c.n_layer; ++i) {
        SrcLayer l;
        l.ratio = ratios[size_t(i)];
        DSV4_CHECK(l.ratio >= 0, "{}: compress_ratios[{}] is negative", file, i);
        l.csa = l.ratio == 4;  // the official model gives overlap + indexer to ratio 4 only
        l.hash = i < n_hash;
        c.layers.push_back(l);
    }
    return c;
}

// ---------------------------------------------------------------------------------------------------------------------
// Row sources: each output tensor is produced row by row as f32, whatever the source encoding
// ---------------------------------------------------------------------------------------------------------------------

struct RowSource {
    int64_t rows = 0;
    int64_t cols = 0;
    std::function<void(int64_t row, float * out)> read;
};

float element_f32(const StTensor & t, size_t i) {
    const uint8_t * p = t.data;
    switch (t.dtype) {
        case StDtype::F32: {
            float v;
            std::memcpy(&v, p + 4 * i, 4);
            return v;
        }
        case StDtype::F16: {
            uint16_t v;
            std::memcpy(&v, p + 2 * i, 2);
            return f16_to_f32(v);
        }
        case StDtype::BF16: {
            uint16_t v;
            std::memcpy(&v, p + 2 * i, 2);
            return bf16_to_f32(v);
        }
        case StDtype::F64: {
            double v;
            std::memcpy(&v, p + 8 * i, 8);
            return float(v);
        }
        case StDtype::F8_E4M3: return e4m3_to_f32(p[i]);
        default: fail("{}: tensor '{}' has dtype {}, not a float type", *t.file, t.name, st_dtype_name(t.dtype));
    }
}

// A 2-D (or 1-D) float tensor, [rows, cols] in torch order.
RowSource plain(const StTensor & t) {
    RowSource s;
    s.cols = t.shape.empty() ? 1 : t.shape.back();
    s.rows = s.cols ? t.n_elements() / s.cols : 0;
    s.read = [&t, cols = s.cols](int64_t r, float * out) {
        for (int64_t c = 0; c < cols; ++c) out[c] = element_f32(t, size_t(r * cols + c));
    };
    return s;
}

float scale_value(const StTensor & scale, size_t i) {
    if (scale.dtype == StDtype::F8_E8M0 || scale.dtype == StDtype::U8) return e8m0_to_f32(scale.data[i]);
    return element_f32(scale, i);
}

// FP8 E4M3 weight [rows, cols] with one scale per 128×128 tile, scale [ceil(rows/128), ceil(cols/128)].
RowSource fp8_blocked(const StTensor & w, const StTensor & scale) {
    DSV4_CHECK(w.shape.size() == 2 && scale.shape.size() == 2, "{}: FP8 tensor '{}' must be 2-D with a 2-D scale",
               *w.file, w.name);
    const int64_t rows = w.shape[0], cols = w.shape[1];
    const int64_t srows = (rows + 127) / 128, scols = (cols + 127) / 128;
    DSV4_CHECK(scale.shape[0] == srows && scale.shape[1] == scols, "{}: scale of '{}' is [{}, {}], expected [{}, {}]",
               *w.file, w.name, scale.shape[0], scale.shape[1], srows, scols);
    RowSource s{rows, cols, nullptr};
    s.read = [&w, &scale, cols, scols](int64_t r, float * out) {
        for (int64_t c = 0; c < cols; ++c)
            out[c] = e4m3_to_f32(w.data[size_t(r * cols + c)]) * scale_value(scale, size_t((r / 128) * scols + c / 128));
    };
    return s;
}

// Packed FP4 E2M1 expert weight: I8 [rows, cols/2] (even column in the low nibble), scale [rows, cols/32].
RowSource fp4_packed(const StTensor & w, const StTensor & scale) {
    DSV4_CHECK(w.shape.size() == 2 && scale.shape.size() == 2, "{}: FP4 tensor '{}' must be 2-D with a 2-D scale",
               *w.file, w.name);
    const int64_t rows = w.shape[0], cols = w.shape[1] * 2;
    DSV4_CHECK(scale.shape[0] == rows && scale.shape[1] * 32 == cols, "{}: scale of '{}' is [{}, {}], expected [{}, {}]",
               *w.file, w.name, scale.shape[0], scale.shape[1], rows, cols / 32);
    RowSource s{rows, cols, nullptr};
    s.read = [&w, &scale, cols](int64_t r, float * out) {
        const uint8_t * packed = w.data + size_t(r * cols / 2);
        for (int64_t c = 0; c < cols; ++c) {
            const uint8_t byte = packed[c / 2];
            const uint8_t code = (c & 1) ? byte >> 4 : byte & 15;
            out[c] = e2m1_to_f32(code) * scale_value(scale, size_t(r * (cols / 32) + c / 32));
        }
    };
    return s;
}

// Rows [first, first + count) of each of `n` consecutive [per, cols] slices of a 3-D tensor [n, per, cols],
// stacked: output row j is slice j / count, row first + j % count.
RowSource stacked_slices(const StTensor & t, int64_t first, int64_t count) {
    DSV4_CHECK(t.shape.size() == 3, "{}: tensor '{}' must be 3-D", *t.file, t.name);
    const int64_t n = t.shape[0], per = t.shape[1], cols = t.shape[2];
    DSV4_CHECK(first + count <= per, "{}: tensor '{}' has {} rows per slice, need {}", *t.file, t.name, per,
               first + count);
    RowSource s{n * count, cols, nullptr};
    s.read = [&t, first, count, per, cols](int64_t j, float * out) {
        const int64_t row = (j / count) * per + first + j % count;
        for (int64_t c = 0; c < cols; ++c) out[c] = element_f32(t, size_t(row * cols + c));
    };
    return s;
}

// Concatenates the rows of several sources with the same width.
RowSource concat_rows(std::vector<RowSource> parts) {
    RowSource s;
    s.cols = parts.empty() ? 0 : parts[0].cols;
    std::vector<int64_t> starts;
    for (auto & p : parts) {
        DSV4_CHECK(p.cols == s.cols, "expert matrices of different widths ({} and {})", p.cols, s.cols);
        starts.push_back(s.rows);
        s.rows += p.rows;
    }
    s.read = [parts = std::move(parts), starts](int64_t r, float * out) {
        size_t i = size_t(std::upper_bound(starts.begin(), starts.end(), r) - starts.begin()) - 1;
        parts[i].read(r - starts[i], out);
    };
    return s;
}

// ---------------------------------------------------------------------------------------------------------------------
// The plan: every tensor of the layout with its source
// ---------------------------------------------------------------------------------------------------------------------

ModelConfig model_config(const SrcConfig & s, const std::string & name) {
    ModelConfig c;
    c.name = name;
    c.n_layer = s.n_layer;
    c.n_embd = s.dim;
    c.n_vocab = s.vocab;
    c.n_ctx_train = s.max_ctx;
    c.n_head = s.n_head;
    c.head_dim = s.head_dim;
    c.n_rot = s.n_rot;
    c.q_lora_rank = s.q_lora;
    c.o_groups = s.o_groups;
    c.o_lora_rank = s.o_lora;
    c.window = s.window;
    c.rope_base = s.rope_base;
    c.rope_base_compressed = s.rope_base_compressed;
    c.yarn = {s.yarn, s.yarn_factor, s.yarn_original, s.yarn_beta_fast, s.yarn_beta_slow};
    c.indexer_heads = s.idx_heads;
    c.indexer_dim = s.idx_dim;
    c.indexer_top_k = s.idx_top_k;
    c.n_expert = s.n_expert;
    c.n_expert_used = s.n_used;
    c.n_expert_shared = 1;
    c.expert_ff = s.expert_ff;
    c.route_scale = float(s.route_scale);
    c.hc = s.hc;
    c.hc_iters = s.hc_iters;
    c.hc_eps = float(s.hc_eps);
    c.norm_eps = float(s.norm_eps);
    for (const SrcLayer & l : s.layers) {
        LayerConfig lc;
        lc.kind = l.ratio == 0 ? LayerKind::sliding : l.csa ? LayerKind::csa : LayerKind::hca;
        lc.compress_ratio = l.ratio;
        lc.hash_routed = l.hash;
        lc.swiglu_limit = lc.swiglu_limit_shared = float(s.swiglu_limit);
        c.n_hash_layers += l.hash;
        c.layers.push_back(lc);
    }
    return c;
}

}  // namespace

std::pair<const char *, const char *> checkpoint_tensor_names(Slot slot) {
    switch (slot) {
        case Slot::token_embd: return {"model.embed_tokens.weight", "embed.weight"};
        case Slot::output_norm: return {"model.norm.weight", "norm.weight"};
        case Slot::output: return {"lm_head.weight", "head.weight"};
        case Slot::output_hc_fn: return {"model.hc_head.hc_fn", "hc_head_fn"};
        case Slot::output_hc_scale: return {"model.hc_head.hc_scale", "hc_head_scale"};
        case Slot::output_hc_base: return {"model.hc_head.hc_base", "hc_head_base"};
        case Slot::hc_attn_fn: return {"attn_hc.fn", "hc_attn_fn"};
        case Slot::hc_attn_scale: return {"attn_hc.scale", "hc_attn_scale"};
        case Slot::hc_attn_base: return {"attn_hc.base", "hc_attn_base"};
        case Slot::hc_ffn_fn: return {"ffn_hc.fn", "hc_ffn_fn"};
        case Slot::hc_ffn_scale: return {"ffn_hc.scale", "hc_ffn_scale"};
        case Slot::hc_ffn_base: return {"ffn_hc.base", "hc_ffn_base"};
        case Slot::attn_norm: return {"input_layernorm.weight", "attn_norm.weight"};
        case Slot::q_a: return {"self_attn.q_a_proj.weight", "attn.wq_a.weight"};
        case Slot::q_a_norm: return {"self_attn.q_a_norm.weight", "attn.q_norm.weight"};
        case Slot::q_b: return {"self_attn.q_b_proj.weight", "attn.wq_b.weight"};
        case Slot::kv: return {"self_attn.kv_proj.weight", "attn.wkv.weight"};
        case Slot::kv_norm: return {"self_attn.kv_norm.weight", "attn.kv_norm.weight"};
        case Slot::sinks: return {"self_attn.sinks", "attn.attn_sink"};
        case Slot::o_a: return {"self_attn.o_a_proj.weight", "attn.wo_a.weight"};
        case Slot::o_b: return {"self_attn.o_b_proj.weight", "attn.wo_b.weight"};
        case Slot::comp_kv: return {"self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"};
        case Slot::comp_gate: return {"self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"};
        case Slot::comp_ape: return {"self_attn.compressor.position_bias", "attn.compressor.ape"};
        case Slot::comp_norm: return {"self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"};
        case Slot::idx_q_b: return {"self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"};
        case Slot::idx_proj:
            return {"self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"};
        case Slot::idx_comp_kv: return {"self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"};
        case Slot::idx_comp_gate:
            return {"self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"};
        case Slot::idx_comp_ape: return {"self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"};
        case Slot::idx_comp_norm:
            return {"self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"};
        case Slot::ffn_norm: return {"post_attention_layernorm.weight", "ffn_norm.weight"};
        case Slot::gate_inp: return {"mlp.gate.weight", "ffn.gate.weight"};
        case Slot::exp_probs_b: return {"mlp.gate.e_score_correction_bias", "ffn.gate.bias"};
        case Slot::tid2eid: return {"mlp.gate.tid2eid", "ffn.gate.tid2eid"};
        case Slot::gate_shexp: return {"mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"};
        case Slot::up_shexp: return {"mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"};
        case Slot::down_shexp: return {"mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"};
        default: return {nullptr, nullptr};
    }
}

namespace {

struct Planned {
    TensorSpec spec;
    GgmlType type;
    RowSource src;
    const StTensor * table = nullptr;  // Role::table: the I64/I32 source
};

class Planner {
  public:
    Planner(const SafetensorsSet & st, const ModelConfig & c, StorageMix mix) : st_(st), c_(c), mix_(mix) {}

    std::vector<Planned> plan() {
        std::vector<Planned> out;
        for (const TensorSpec & spec : tensor_layout(c_)) {
            const std::string h = spec.layer < 0 ? "" : fmt::format("model.layers.{}.", spec.layer);
            const std::string o = spec.layer < 0 ? "" : fmt::format("layers.{}.", spec.layer);
            Planned p{spec, storage_type(spec.role, mix_, spec.ne[0]), {}, nullptr};
            if (p.type != storage_type(spec.role, mix_, int64_t(1) << 20)) ++fallbacks_;
            auto [hf, off] = checkpoint_tensor_names(spec.slot);
            if (spec.slot == Slot::exp_probs_b && !find(h + hf, o + off)) continue;  // optional: a zero bias
            if (spec.role == Role::table) {
                p.table = &need(h + hf, o + off);
                check_table(*p.table);
            } else if (spec.slot == Slot::gate_exps || spec.slot == Slot::up_exps || spec.slot == Slot::down_exps) {
                p.src = experts(spec.slot, h, o);
            } else if (spec.slot == Slot::output && !find(hf, off)) {
                p.src = src("model.embed_tokens.weight", "embed.weight");  // tied embeddings
            } else {
                p.src = src(h + hf, o + off);
            }
            if (!p.table)
                DSV4_CHECK(p.src.cols == spec.ne[0] && p.src.rows == spec.rows(),
                           "checkpoint tensor for '{}' is [{} rows, {} cols], expected [{} rows, {} cols]", spec.name,
                           p.src.rows, p.src.cols, spec.rows(), spec.ne[0]);
            out.push_back(std::move(p));
        }
        return out;
    }

    size_t fallbacks() const { return fallbacks_; }

  private:
    const StTensor * find(const std::string & hf, const std::string & official) const {
        for (const std::string & n : {hf, official, "model." + official})
            if (const StTensor * t = st_.find(n)) return t;
        return nullptr;
    }

    const StTensor & need(const std::string & hf, const std::string & official) const {
        const StTensor * t = find(hf, official);
        DSV4_CHECK(t, "checkpoint has no tensor '{}' (or '{}')", hf, official);
        return *t;
    }

    // A float tensor, dequantized from FP8 when it comes with a block scale.
    RowSource src(const std::string & hf, const std::string & official) const {
        const StTensor & t = need(hf, official);
        if (t.dtype == StDtype::F8_E4M3) {
            const std::string base = t.name.substr(0, t.name.size() - std::string(".weight").size());
            const StTensor * scale = st_.find(base + ".scale");
            if (!scale) scale = st_.find(t.name + "_scale_inv");
            DSV4_CHECK(scale, "checkpoint has FP8 tensor '{}' without its '{}.scale'", t.name, base);
            return fp8_blocked(t, *scale);
        }
        return plain(t);
    }

    void check_table(const StTensor & t) const {
        DSV4_CHECK(t.shape.size() == 2 && t.shape[0] == c_.n_vocab && t.shape[1] == c_.n_expert_used,
                   "{}: '{}' should be [{}, {}]", *t.file, t.name, c_.n_vocab, c_.n_expert_used);
        DSV4_CHECK(t.dtype == StDtype::I64 || t.dtype == StDtype::I32, "{}: '{}' has dtype {}, expected I64 or I32",
                   *t.file, t.name, st_dtype_name(t.dtype));
    }

    // Routed experts: transformers stacks them ([E, 2I, D] gate_up, [E, D, I] down); DeepSeek stores one matrix
    // per expert, as packed FP4 with per-32 scales or as a float tensor.
    RowSource experts(Slot slot, const std::string & h, const std::string & o) const {
        const int64_t I = c_.expert_ff, D = c_.n_embd;
        if (const StTensor * gu = st_.find(h + "mlp.experts.gate_up_proj")) {
            if (slot == Slot::down_exps) return stacked_slices(need(h + "mlp.experts.down_proj", ""), 0, D);
            return stacked_slices(*gu, slot == Slot::gate_exps ? 0 : I, I);
        }
        const char * w = slot == Slot::gate_exps ? "w1" : slot == Slot::up_exps ? "w3" : "w2";
        std::vector<RowSource> parts;
        for (int64_t e = 0; e < c_.n_expert; ++e) {
            const std::string base = fmt::format("{}ffn.experts.{}.{}", o, e, w);
            const StTensor & t = need(base + ".weight", base + ".weight");
            if (t.dtype == StDtype::I8 || t.dtype == StDtype::U8)
                parts.push_back(fp4_packed(t, need(base + ".scale", base + ".scale")));
            else
                parts.push_back(src(base + ".weight", base + ".weight"));
        }
        return concat_rows(std::move(parts));
    }

    const SafetensorsSet & st_;
    const ModelConfig & c_;
    StorageMix mix_;
    size_t fallbacks_ = 0;
};

}  // namespace

ConvertStats convert_checkpoint(const std::string & input_dir, const std::string & output_path,
                                const ConvertOptions & options) {
    namespace fs = std::filesystem;
    const std::string config_path = (fs::path(input_dir) / "config.json").string();
    json j;
    try {
        j = json::parse(read_file(config_path));
    } catch (const json::exception & e) {
        fail("{}: not valid JSON: {}", config_path, e.what());
    }
    DSV4_CHECK(j.is_object(), "{}: not a JSON object", config_path);
    const bool official = j.contains("n_layers") && j.contains("dim");
    if (!official) {
        const std::string mt = opt<std::string>(j, "model_type", "");
        DSV4_CHECK(mt == "deepseek_v4" || mt.empty(), "{}: model_type '{}' is not deepseek_v4", config_path, mt);
    }
    const SrcConfig c = official ? read_official_config(j, config_path) : read_hf_config(j, config_path);
    DSV4_CHECK(c.dim > 0 && c.n_layer > 0 && c.n_head > 0 && c.head_dim > 0 && c.vocab > 0 && c.hc > 0,
               "{}: sizes must be positive", config_path);

    const SafetensorsSet st = SafetensorsSet::open(input_dir);
    std::optional<GgufFile> vocab;
    if (!options.vocab_path.empty()) {
        vocab = GgufFile::open(options.vocab_path);
        const auto tokens = vocab->find("tokenizer.ggml.tokens");
        DSV4_CHECK(tokens && tokens->type == GgufType::ARRAY, "{}: no tokenizer.ggml.tokens", options.vocab_path);
        DSV4_CHECK(int64_t(tokens->array.size()) <= c.vocab, "{}: {} tokens do not fit the model's vocabulary of {}",
                   options.vocab_path, tokens->array.size(), c.vocab);
    }

    const std::string name = options.name.empty() ? fs::path(input_dir).filename().string() : options.name;
    const ModelConfig config = model_config(c, name);
    Planner planner(st, config, options.mix);
    std::vector<Planned> plan = planner.plan();

    GgufWriter w(output_path);
    store_config(w, config);
    w.set("general.converter", GgufValue::make_string(fmt::format("dsv4-convert --type {}", storage_mix_name(options.mix))));
    if (vocab)
        for (const GgufKv & kv : vocab->metadata())
            if (kv.key.rfind("tokenizer.", 0) == 0) w.set(kv.key, kv.value);
    uint64_t total = 0;
    for (const Planned & p : plan) {
        w.add_tensor(p.spec.name, p.type, {p.spec.ne[0], p.spec.ne[1], p.spec.ne[2]});
        total += row_bytes(p.type, p.spec.ne[0]) * uint64_t(p.spec.rows());
    }

    ThreadPool pool;
    ConvertStats stats;
    std::vector<uint8_t> chunk;
    for (const Planned & p : plan) {
        if (p.table) {
            // Token → experts: narrowed to I32, each id checked.
            const int64_t n = c.vocab * c.n_used;
            std::vector<int32_t> ids(static_cast<size_t>(n));
            for (int64_t i = 0; i < n; ++i) {
                int64_t v;
                if (p.table->dtype == StDtype::I64) {
                    std::memcpy(&v, p.table->data + 8 * i, 8);
                } else {
                    int32_t v32;
                    std::memcpy(&v32, p.table->data + 4 * i, 4);
                    v = v32;
                }
                DSV4_CHECK(v >= 0 && v < c.n_expert, "{}: '{}' element {} = {} is not an expert id", *p.table->file,
                           p.table->name, i, v);
                ids[size_t(i)] = int32_t(v);
            }
            w.write_tensor_data(ids.data(), ids.size() * sizeof(int32_t));
            stats.bytes += ids.size() * sizeof(int32_t);
        } else {
            const int64_t cols = p.spec.ne[0];
            const int64_t rows = p.src.rows;
            const size_t rb = row_bytes(p.type, cols);
            // Rows are converted in parallel batches and written in order: memory stays bounded by the batch.
            const int64_t batch = std::max<int64_t>(1, int64_t((size_t(16) << 20) / std::max<size_t>(rb, 1)));
            for (int64_t r0 = 0; r0 < rows; r0 += batch) {
                const int64_t nr = std::min(batch, rows - r0);
                chunk.resize(size_t(nr) * rb);
                pool.parallel_for(size_t(nr), 1, [&](size_t b, size_t e, int) {
                    std::vector<float> row(static_cast<size_t>(cols));
                    for (size_t r = b; r < e; ++r) {
                        p.src.read(r0 + int64_t(r), row.data());
                        uint8_t * dst = chunk.data() + r * rb;
                        if (p.type == GgmlType::F32)
                            std::memcpy(dst, row.data(), rb);
                        else
                            quantize_row(p.type, row.data(), dst, cols);
                    }
                });
                w.write_tensor_data(chunk.data(), chunk.size());
                stats.bytes += chunk.size();
                if (options.progress) options.progress(stats.bytes, total);
            }
        }
        ++stats.n_tensors;
    }
    w.finish();
    stats.n_fallbacks = planner.fallbacks();
    return stats;
}

}  // namespace dsv4
