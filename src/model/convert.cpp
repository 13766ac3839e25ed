#include "model/convert.h"

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

bool parse_convert_type(std::string_view name, ConvertType * out) {
    static const std::pair<std::string_view, ConvertType> kTypes[] = {
        {"f32", ConvertType::f32}, {"f16", ConvertType::f16}, {"bf16", ConvertType::bf16},
        {"q8_0", ConvertType::q8_0}, {"q2", ConvertType::q2}, {"q4", ConvertType::q4}};
    for (auto & [n, t] : kTypes)
        if (n == name) {
            *out = t;
            return true;
        }
    return false;
}

const char * convert_type_name(ConvertType type) {
    switch (type) {
        case ConvertType::f32: return "f32";
        case ConvertType::f16: return "f16";
        case ConvertType::bf16: return "bf16";
        case ConvertType::q8_0: return "q8_0";
        case ConvertType::q2: return "q2";
        case ConvertType::q4: return "q4";
    }
    return "?";
}

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

SrcConfig read_hf_config(const json & j, const std::string & file) {
    SrcConfig c;
    c.vocab = need<int64_t>(j, "vocab_size", file);
    c.dim = need<int64_t>(j, "hidden_size", file);
    c.n_layer = need<int64_t>(j, "num_hidden_layers", file);
    c.n_head = need<int64_t>(j, "num_attention_heads", file);
    c.head_dim = need<int64_t>(j, "head_dim", file);
    c.n_rot = j.contains("qk_rope_head_dim") && !j["qk_rope_head_dim"].is_null()
                  ? j["qk_rope_head_dim"].get<int64_t>()
                  : int64_t(double(c.head_dim) * opt<double>(j, "partial_rotary_factor", 1.0));
    c.q_lora = need<int64_t>(j, "q_lora_rank", file);
    c.o_groups = need<int64_t>(j, "o_groups", file);
    c.o_lora = need<int64_t>(j, "o_lora_rank", file);
    c.expert_ff = need<int64_t>(j, "moe_intermediate_size", file);
    c.n_expert = need<int64_t>(j, "n_routed_experts", file);
    c.n_used = need<int64_t>(j, "num_experts_per_tok", file);
    c.window = need<int64_t>(j, "sliding_window", file);
    c.idx_heads = opt<int64_t>(j, "index_n_heads", 0);
    c.idx_dim = opt<int64_t>(j, "index_head_dim", 0);
    c.idx_top_k = opt<int64_t>(j, "index_topk", 0);
    c.hc = need<int64_t>(j, "hc_mult", file);
    c.hc_iters = opt<int64_t>(j, "hc_sinkhorn_iters", 20);
    c.hc_eps = opt<double>(j, "hc_eps", 1e-6);
    c.norm_eps = opt<double>(j, "rms_norm_eps", 1e-6);
    c.route_scale = opt<double>(j, "routed_scaling_factor", 1.0);
    c.swiglu_limit = opt<double>(j, "swiglu_limit", 0.0);
    c.max_ctx = opt<int64_t>(j, "max_position_embeddings", 0);
    c.rope_base = opt<double>(j, "rope_theta", 10000.0);
    c.rope_base_compressed = opt<double>(j, "compress_rope_theta", c.rope_base);

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
    c.vocab = need<int64_t>(j, "vocab_size", file);
    c.dim = need<int64_t>(j, "dim", file);
    c.n_layer = need<int64_t>(j, "n_layers", file);
    c.n_head = need<int64_t>(j, "n_heads", file);
    c.head_dim = need<int64_t>(j, "head_dim", file);
    c.n_rot = need<int64_t>(j, "rope_head_dim", file);
    c.q_lora = need<int64_t>(j, "q_lora_rank", file);
    c.o_groups = need<int64_t>(j, "o_groups", file);
    c.o_lora = need<int64_t>(j, "o_lora_rank", file);
    c.expert_ff = need<int64_t>(j, "moe_inter_dim", file);
    c.n_expert = need<int64_t>(j, "n_routed_experts", file);
    c.n_used = need<int64_t>(j, "n_activated_experts", file);
    c.window = need<int64_t>(j, "window_size", file);
    c.idx_heads = opt<int64_t>(j, "index_n_heads", 0);
    c.idx_dim = opt<int64_t>(j, "index_head_dim", 0);
    c.idx_top_k = opt<int64_t>(j, "index_topk", 0);
    c.hc = need<int64_t>(j, "hc_mult", file);
    c.hc_iters = opt<int64_t>(j, "hc_sinkhorn_iters", 20);
    c.hc_eps = opt<double>(j, "hc_eps", 1e-6);
    c.norm_eps = opt<double>(j, "norm_eps", 1e-6);
    c.route_scale = opt<double>(j, "route_scale", 1.0);
    c.swiglu_limit = opt<double>(j, "swiglu_limit", 0.0);
    c.max_ctx = opt<int64_t>(j, "max_seq_len", 0);
    c.rope_base = opt<double>(j, "rope_theta", 10000.0);
    c.rope_base_compressed = opt<double>(j, "compress_rope_theta", c.rope_base);
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
// The plan: every output tensor with its type and source
// ---------------------------------------------------------------------------------------------------------------------

enum class Role {
    vector,      // norms, sinks, HC scale/base, router bias: always F32
    table,       // token → experts: I32
    embedding,   // token embedding
    control,     // HC mixing, router, compressors, indexer: F16 in quantized files (ds4's recipe)
    dense,       // attention projections, shared expert, LM head
    expert_gate, // routed expert gate/up
    expert_down, // routed expert down
};

struct Planned {
    std::string name;
    GgmlType type;
    std::vector<int64_t> ne;  // ggml order
    RowSource src;
    const StTensor * table = nullptr;  // Role::table: the I64/I32 source
};

GgmlType float_type(ConvertType t) {
    return t == ConvertType::f32 ? GgmlType::F32 : t == ConvertType::bf16 ? GgmlType::BF16 : GgmlType::F16;
}

GgmlType type_for(Role role, ConvertType t) {
    const bool quantized = t == ConvertType::q8_0 || t == ConvertType::q2 || t == ConvertType::q4;
    switch (role) {
        case Role::vector: return GgmlType::F32;
        case Role::table: return GgmlType::I32;
        case Role::embedding:
        case Role::control: return quantized ? GgmlType::F16 : float_type(t);
        case Role::dense: return quantized ? GgmlType::Q8_0 : float_type(t);
        case Role::expert_gate:
            return t == ConvertType::q2 ? GgmlType::IQ2_XXS : t == ConvertType::q4 ? GgmlType::Q4_K
                                          : t == ConvertType::q8_0 ? GgmlType::Q8_0 : float_type(t);
        case Role::expert_down:
            return t == ConvertType::q2 ? GgmlType::Q2_K : t == ConvertType::q4 ? GgmlType::Q4_K
                                          : t == ConvertType::q8_0 ? GgmlType::Q8_0 : float_type(t);
    }
    return GgmlType::F32;
}

class Planner {
  public:
    Planner(const SafetensorsSet & st, const SrcConfig & c, ConvertType type) : st_(st), c_(c), type_(type) {}

    std::vector<Planned> plan() {
        const int64_t D = c_.dim, V = c_.vocab;
        add("token_embd.weight", Role::embedding, {D, V}, src("model.embed_tokens.weight", "embed.weight"));
        add("output_norm.weight", Role::vector, {D}, src("model.norm.weight", "norm.weight"));
        const bool tied = !find("lm_head.weight", "head.weight");
        add("output.weight", Role::dense, {D, V},
            tied ? src("model.embed_tokens.weight", "embed.weight") : src("lm_head.weight", "head.weight"));
        add("output_hc_fn.weight", Role::control, {c_.hc * D, c_.hc}, src("model.hc_head.hc_fn", "hc_head_fn"));
        add("output_hc_scale.weight", Role::vector, {1}, src("model.hc_head.hc_scale", "hc_head_scale"));
        add("output_hc_base.weight", Role::vector, {c_.hc}, src("model.hc_head.hc_base", "hc_head_base"));
        for (int64_t il = 0; il < c_.n_layer; ++il) plan_layer(il);
        return std::move(out_);
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
        DSV4_CHECK(t, "checkpoint has no tensor '{}' (or '{}')", c_.official ? official : hf,
                   c_.official ? hf : official);
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

    void add(const std::string & name, Role role, std::vector<int64_t> ne, RowSource s) {
        int64_t rows = 1;
        for (size_t i = 1; i < ne.size(); ++i) rows *= ne[i];
        DSV4_CHECK(s.cols == ne[0] && s.rows == rows, "tensor for '{}' is [{} rows, {} cols], expected [{} rows, {} cols]",
                   name, s.rows, s.cols, rows, ne[0]);
        GgmlType type = type_for(role, type_);
        // Rows that do not split into the type's blocks fall back to Q8_0, then to F16.
        if (ne[0] % type_traits(type).block_elems != 0) {
            GgmlType fb = ne[0] % QK8_0 == 0 && type != GgmlType::Q8_0 ? GgmlType::Q8_0 : GgmlType::F16;
            log_debug("{}: rows of {} do not fit {} blocks; stored as {}", name, ne[0], type_name(type), type_name(fb));
            type = fb;
            ++fallbacks_;
        }
        out_.push_back({name, type, std::move(ne), std::move(s), nullptr});
    }

    void add_table(const std::string & name, const StTensor & t) {
        DSV4_CHECK(t.shape.size() == 2 && t.shape[0] == c_.vocab && t.shape[1] == c_.n_used,
                   "{}: '{}' should be [{}, {}]", *t.file, t.name, c_.vocab, c_.n_used);
        DSV4_CHECK(t.dtype == StDtype::I64 || t.dtype == StDtype::I32, "{}: '{}' has dtype {}, expected I64 or I32",
                   *t.file, t.name, st_dtype_name(t.dtype));
        out_.push_back({name, GgmlType::I32, {c_.n_used, c_.vocab}, {}, &t});
    }

    void plan_layer(int64_t il) {
        const SrcLayer & l = c_.layers[size_t(il)];
        const int64_t D = c_.dim, d = c_.head_dim, mix = (2 + c_.hc) * c_.hc;
        const std::string h = fmt::format("model.layers.{}.", il), o = fmt::format("layers.{}.", il);
        const std::string g = fmt::format("blk.{}.", il);
        auto S = [&](const std::string & hf, const std::string & off) { return src(h + hf, o + off); };

        add(g + "hc_attn_fn.weight", Role::control, {c_.hc * D, mix}, S("attn_hc.fn", "hc_attn_fn"));
        add(g + "hc_attn_scale.weight", Role::vector, {3}, S("attn_hc.scale", "hc_attn_scale"));
        add(g + "hc_attn_base.weight", Role::vector, {mix}, S("attn_hc.base", "hc_attn_base"));
        add(g + "hc_ffn_fn.weight", Role::control, {c_.hc * D, mix}, S("ffn_hc.fn", "hc_ffn_fn"));
        add(g + "hc_ffn_scale.weight", Role::vector, {3}, S("ffn_hc.scale", "hc_ffn_scale"));
        add(g + "hc_ffn_base.weight", Role::vector, {mix}, S("ffn_hc.base", "hc_ffn_base"));

        add(g + "attn_norm.weight", Role::vector, {D}, S("input_layernorm.weight", "attn_norm.weight"));
        add(g + "attn_q_a.weight", Role::dense, {D, c_.q_lora}, S("self_attn.q_a_proj.weight", "attn.wq_a.weight"));
        add(g + "attn_q_a_norm.weight", Role::vector, {c_.q_lora}, S("self_attn.q_a_norm.weight", "attn.q_norm.weight"));
        add(g + "attn_q_b.weight", Role::dense, {c_.q_lora, c_.n_head * d},
            S("self_attn.q_b_proj.weight", "attn.wq_b.weight"));
        add(g + "attn_kv.weight", Role::dense, {D, d}, S("self_attn.kv_proj.weight", "attn.wkv.weight"));
        add(g + "attn_kv_a_norm.weight", Role::vector, {d}, S("self_attn.kv_norm.weight", "attn.kv_norm.weight"));
        add(g + "attn_sinks.weight", Role::vector, {c_.n_head}, S("self_attn.sinks", "attn.attn_sink"));
        add(g + "attn_output_a.weight", Role::dense, {c_.n_head * d / c_.o_groups, c_.o_groups * c_.o_lora},
            S("self_attn.o_a_proj.weight", "attn.wo_a.weight"));
        add(g + "attn_output_b.weight", Role::dense, {c_.o_groups * c_.o_lora, D},
            S("self_attn.o_b_proj.weight", "attn.wo_b.weight"));

        if (l.ratio != 0) {
            const int64_t w = (l.csa ? 2 : 1) * d;
            add(g + "attn_compressor_kv.weight", Role::control, {D, w},
                S("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"));
            add(g + "attn_compressor_gate.weight", Role::control, {D, w},
                S("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"));
            add(g + "attn_compressor_ape.weight", Role::control, {w, l.ratio},
                S("self_attn.compressor.position_bias", "attn.compressor.ape"));
            add(g + "attn_compressor_norm.weight", Role::vector, {d},
                S("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"));
        }
        if (l.csa) {
            const int64_t dI = c_.idx_dim;
            const std::string hi = "self_attn.compressor.indexer.", oi = "attn.indexer.";
            add(g + "indexer.attn_q_b.weight", Role::control, {c_.q_lora, c_.idx_heads * dI},
                S(hi + "q_b_proj.weight", oi + "wq_b.weight"));
            add(g + "indexer.proj.weight", Role::control, {D, c_.idx_heads},
                S(hi + "scorer.weights_proj.weight", oi + "weights_proj.weight"));
            add(g + "indexer_compressor_kv.weight", Role::control, {D, 2 * dI},
                S(hi + "kv_proj.weight", oi + "compressor.wkv.weight"));
            add(g + "indexer_compressor_gate.weight", Role::control, {D, 2 * dI},
                S(hi + "gate_proj.weight", oi + "compressor.wgate.weight"));
            add(g + "indexer_compressor_ape.weight", Role::control, {2 * dI, l.ratio},
                S(hi + "position_bias", oi + "compressor.ape"));
            add(g + "indexer_compressor_norm.weight", Role::vector, {dI},
                S(hi + "kv_norm.weight", oi + "compressor.norm.weight"));
        }

        add(g + "ffn_norm.weight", Role::vector, {D}, S("post_attention_layernorm.weight", "ffn_norm.weight"));
        add(g + "ffn_gate_inp.weight", Role::control, {D, c_.n_expert}, S("mlp.gate.weight", "ffn.gate.weight"));
        if (l.hash) {
            add_table(g + "ffn_gate_tid2eid.weight", need(h + "mlp.gate.tid2eid", o + "ffn.gate.tid2eid"));
        } else if (find(h + "mlp.gate.e_score_correction_bias", o + "ffn.gate.bias")) {
            add(g + "exp_probs_b.bias", Role::vector, {c_.n_expert},
                S("mlp.gate.e_score_correction_bias", "ffn.gate.bias"));
        }

        const int64_t I = c_.expert_ff, E = c_.n_expert;
        if (const StTensor * gu = st_.find(h + "mlp.experts.gate_up_proj")) {
            const StTensor & down = need(h + "mlp.experts.down_proj", o + "ffn.experts.0.w2.weight");
            add(g + "ffn_gate_exps.weight", Role::expert_gate, {D, I, E}, stacked_slices(*gu, 0, I));
            add(g + "ffn_up_exps.weight", Role::expert_gate, {D, I, E}, stacked_slices(*gu, I, I));
            add(g + "ffn_down_exps.weight", Role::expert_down, {I, D, E}, stacked_slices(down, 0, D));
        } else {
            auto experts = [&](const char * w) {
                std::vector<RowSource> parts;
                for (int64_t e = 0; e < E; ++e) {
                    const std::string base = fmt::format("{}ffn.experts.{}.{}", o, e, w);
                    const StTensor & t = need(base + ".weight", base + ".weight");
                    if (t.dtype == StDtype::I8 || t.dtype == StDtype::U8)
                        parts.push_back(fp4_packed(t, need(base + ".scale", base + ".scale")));
                    else
                        parts.push_back(src(base + ".weight", base + ".weight"));
                }
                return concat_rows(std::move(parts));
            };
            add(g + "ffn_gate_exps.weight", Role::expert_gate, {D, I, E}, experts("w1"));
            add(g + "ffn_up_exps.weight", Role::expert_gate, {D, I, E}, experts("w3"));
            add(g + "ffn_down_exps.weight", Role::expert_down, {I, D, E}, experts("w2"));
        }
        add(g + "ffn_gate_shexp.weight", Role::dense, {D, I},
            S("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"));
        add(g + "ffn_up_shexp.weight", Role::dense, {D, I},
            S("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"));
        add(g + "ffn_down_shexp.weight", Role::dense, {I, D},
            S("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"));
    }

    const SafetensorsSet & st_;
    const SrcConfig & c_;
    ConvertType type_;
    std::vector<Planned> out_;
    size_t fallbacks_ = 0;
};

void write_metadata(GgufWriter & w, const SrcConfig & c, const ConvertOptions & opt, const std::string & name,
                    const GgufFile * vocab) {
    const std::string a = "deepseek4.";
    auto u32 = [&](const std::string & k, int64_t v) { w.set(a + k, GgufValue::make_u32(uint32_t(v))); };
    auto f32 = [&](const std::string & k, double v) { w.set(a + k, GgufValue::make_f32(float(v))); };
    w.set("general.architecture", GgufValue::make_string("deepseek4"));
    w.set("general.name", GgufValue::make_string(name));
    w.set("general.converter", GgufValue::make_string(fmt::format("dsv4-convert --type {}", convert_type_name(opt.type))));
    if (c.max_ctx > 0) u32("context_length", c.max_ctx);
    u32("embedding_length", c.dim);
    u32("block_count", c.n_layer);
    u32("vocab_size", c.vocab);
    u32("attention.head_count", c.n_head);
    u32("attention.head_count_kv", 1);
    u32("attention.key_length", c.head_dim);
    u32("attention.value_length", c.head_dim);
    u32("rope.dimension_count", c.n_rot);
    u32("attention.q_lora_rank", c.q_lora);
    u32("attention.output_lora_rank", c.o_lora);
    u32("attention.output_group_count", c.o_groups);
    u32("attention.sliding_window", c.window);
    f32("attention.layer_norm_rms_epsilon", c.norm_eps);
    f32("rope.freq_base", c.rope_base);
    f32("attention.compress_rope_freq_base", c.rope_base_compressed);
    w.set(a + "rope.scaling.type", GgufValue::make_string(c.yarn ? "yarn" : "none"));
    if (c.yarn) {
        f32("rope.scaling.factor", c.yarn_factor);
        u32("rope.scaling.original_context_length", int64_t(c.yarn_original));
        f32("rope.scaling.yarn_beta_fast", c.yarn_beta_fast);
        f32("rope.scaling.yarn_beta_slow", c.yarn_beta_slow);
    }
    u32("expert_count", c.n_expert);
    u32("expert_used_count", c.n_used);
    u32("expert_shared_count", 1);
    u32("expert_feed_forward_length", c.expert_ff);
    u32("expert_gating_func", 4);
    f32("expert_weights_scale", c.route_scale);
    w.set(a + "expert_weights_norm", GgufValue::make_bool(true));
    // V4 Flash hash-routes its leading layers, which is all llama.cpp accepts; dsv4 reads the routing of each
    // layer from its token→expert table, so test models may mix.
    int64_t n_hash = 0;
    for (const SrcLayer & l : c.layers) n_hash += l.hash;
    u32("hash_layer_count", n_hash);
    if (c.idx_heads > 0) {
        u32("attention.indexer.head_count", c.idx_heads);
        u32("attention.indexer.key_length", c.idx_dim);
        u32("attention.indexer.top_k", c.idx_top_k);
    }
    u32("hyper_connection.count", c.hc);
    u32("hyper_connection.sinkhorn_iterations", c.hc_iters);
    f32("hyper_connection.epsilon", c.hc_eps);
    std::vector<GgufValue> ratios, limits;
    for (const SrcLayer & l : c.layers) {
        ratios.push_back(GgufValue::make_i32(int32_t(l.ratio)));
        limits.push_back(GgufValue::make_f32(float(c.swiglu_limit)));
    }
    w.set(a + "attention.compress_ratios", GgufValue::make_array(GgufType::INT32, std::move(ratios)));
    w.set(a + "swiglu_clamp_exp", GgufValue::make_array(GgufType::FLOAT32, std::move(limits)));
    if (vocab) {
        for (const GgufKv & kv : vocab->metadata())
            if (kv.key.rfind("tokenizer.", 0) == 0) w.set(kv.key, kv.value);
    }
}

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

    Planner planner(st, c, options.type);
    std::vector<Planned> plan = planner.plan();

    const std::string name = options.name.empty() ? fs::path(input_dir).filename().string() : options.name;
    GgufWriter w(output_path);
    write_metadata(w, c, options, name, vocab ? &*vocab : nullptr);
    uint64_t total = 0;
    for (const Planned & p : plan) {
        w.add_tensor(p.name, p.type, p.ne);
        int64_t rows = 1;
        for (size_t i = 1; i < p.ne.size(); ++i) rows *= p.ne[i];
        total += row_bytes(p.type, p.ne[0]) * uint64_t(rows);
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
            const int64_t cols = p.ne[0];
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
