#include "model/synth.h"

#include "format/gguf.h"
#include "format/quant.h"
#include "util/error.h"
#include "util/half.h"
#include "util/thread_pool.h"

#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>

namespace dsv4 {

ModelConfig flash_config(int64_t n_layer) {
    DSV4_CHECK(n_layer >= 1, "a model needs at least one layer (got {})", n_layer);
    ModelConfig c;
    c.name = fmt::format("DeepSeek-V4-Flash shape, {} layers, random weights", n_layer);
    c.n_layer = n_layer;
    c.n_embd = 4096;
    c.n_vocab = 129280;
    c.n_ctx_train = 1048576;
    c.n_head = 64;
    c.head_dim = 512;
    c.n_rot = 64;
    c.q_lora_rank = 1024;
    c.o_groups = 8;
    c.o_lora_rank = 1024;
    c.window = 128;
    c.rope_base = 10000;
    c.rope_base_compressed = 160000;
    c.yarn = {true, 16, 65536, 32, 1};
    c.indexer_heads = 64;
    c.indexer_dim = 128;
    c.indexer_top_k = 512;
    c.n_expert = 256;
    c.n_expert_used = 6;
    c.n_expert_shared = 1;
    c.expert_ff = 2048;
    c.route_scale = 1.5f;
    c.hc = 4;
    c.hc_iters = 20;
    c.hc_eps = 1e-6f;
    c.norm_eps = 1e-6f;
    for (int64_t il = 0; il < n_layer; ++il) {
        LayerConfig l;
        l.compress_ratio = il < 2 ? 0 : il % 2 == 0 ? 4 : 128;
        l.kind = il < 2 ? LayerKind::sliding : il % 2 == 0 ? LayerKind::csa : LayerKind::hca;
        l.hash_routed = il < 3;
        l.swiglu_limit = l.swiglu_limit_shared = 10.0f;
        c.n_hash_layers += l.hash_routed;
        c.layers.push_back(l);
    }
    return c;
}

ModelConfig mini_config(int64_t n_layer, int64_t n_vocab) {
    ModelConfig c = flash_config(n_layer);
    c.name = fmt::format("dsv4 mini, {} layers, random weights", n_layer);
    c.n_vocab = n_vocab;
    c.n_embd = 256;
    c.n_head = 4;
    c.head_dim = 128;
    c.n_rot = 64;
    c.q_lora_rank = 128;
    c.o_groups = 2;
    c.o_lora_rank = 128;
    c.indexer_heads = 4;
    c.indexer_dim = 64;
    c.indexer_top_k = 16;
    c.n_expert = 8;
    c.n_expert_used = 2;
    c.expert_ff = 256;
    return c;
}

namespace {

// ---------------------------------------------------------------------------------------------------------------------
// Seeded random numbers: one independent stream per (tensor, row), so rows can be drawn in parallel and a file is
// the same whatever the thread count.
// ---------------------------------------------------------------------------------------------------------------------

uint64_t splitmix64(uint64_t & s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

class Rng {
  public:
    Rng(uint64_t seed, uint64_t stream, uint64_t row) : s_(seed * 0x100000001b3ull ^ stream * 0x9e3779b97f4a7c15ull ^ row) {
        splitmix64(s_);
    }
    uint64_t next() { return splitmix64(s_); }
    void fill(void * dst, size_t n) {
        uint8_t * p = static_cast<uint8_t *>(dst);
        for (; n >= 8; n -= 8, p += 8) {
            const uint64_t r = next();
            std::memcpy(p, &r, 8);
        }
        if (n) {
            const uint64_t r = next();
            std::memcpy(p, &r, n);
        }
    }
    float uniform() { return float(next() >> 40) * (1.0f / float(1 << 24)); }  // [0, 1)
    // Box-Muller; the second value of each pair is kept for the next call.
    float normal() {
        if (have_spare_) {
            have_spare_ = false;
            return spare_;
        }
        const float u1 = std::max(uniform(), 1e-7f), u2 = uniform();
        const float r = std::sqrt(-2.0f * std::log(u1));
        spare_ = r * std::sin(6.2831853f * u2);
        have_spare_ = true;
        return r * std::cos(6.2831853f * u2);
    }

  private:
    uint64_t s_;
    float spare_ = 0;
    bool have_spare_ = false;
};

// How a tensor's values are drawn: N(mean, std), or U(lo, hi) when uniform.
struct Init {
    float mean = 0, std = 1;
    bool uniform = false;
};

Init init_for(const TensorSpec & s, const ModelConfig & c) {
    const float fan_in = float(s.ne[0]);
    switch (s.slot) {
        case Slot::token_embd: return {0, 1};
        case Slot::output: return {0, 2.5f / std::sqrt(float(c.n_embd))};
        case Slot::output_hc_fn:
        case Slot::hc_attn_fn:
        case Slot::hc_ffn_fn:
        case Slot::mtp_hc_head_fn: return {0, 1.0f / std::sqrt(float(c.hc * c.n_embd))};
        case Slot::output_hc_base:
        case Slot::hc_attn_base:
        case Slot::hc_ffn_base:
        case Slot::mtp_hc_head_base:
        case Slot::comp_ape:
        case Slot::idx_comp_ape: return {0, 0.5f};
        case Slot::output_hc_scale:
        case Slot::hc_attn_scale:
        case Slot::hc_ffn_scale:
        case Slot::mtp_hc_head_scale: return {0.5f, 1.5f, true};
        case Slot::kv_norm:
        case Slot::comp_norm: return {1.6f, 0.15f};
        case Slot::output_norm:
        case Slot::attn_norm:
        case Slot::q_a_norm:
        case Slot::idx_comp_norm:
        case Slot::ffn_norm:
        case Slot::mtp_enorm:
        case Slot::mtp_hnorm:
        case Slot::mtp_norm: return {1.0f, 0.15f};
        case Slot::sinks: return {0, 1};
        case Slot::exp_probs_b: return {0, 0.1f};
        case Slot::gate_inp: return {0, 1.5f / std::sqrt(fan_in)};
        default: return {0, 1.0f / std::sqrt(fan_in)};
    }
}

void fill_values(Rng & rng, const Init & init, float * out, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        out[i] = init.uniform ? init.mean + (init.std - init.mean) * rng.uniform() : init.mean + init.std * rng.normal();
}

float rms(const float * x, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += double(x[i]) * x[i];
    return float(std::sqrt(s / double(n)));
}

// Random codes of a 256-value super-block type with unit scales, then d (and dmin) set so that the block's RMS is
// `target`. Q2_K and Q4_K pick mins that cancel the codes' mean, so the values are centred like real weights.
template <typename Block> void random_block(Rng & rng, GgmlType type, float target, Block & b) {
    std::memset(&b, 0, sizeof b);
    if constexpr (std::is_same_v<Block, BlockIQ2_XXS>) {
        for (int g = 0; g < 8; ++g) {
            const uint32_t grid = uint32_t(rng.next());
            uint32_t signs_scale = 0;
            for (int k = 0; k < 4; ++k) signs_scale |= uint32_t(rng.next() & 127) << (7 * k);
            signs_scale |= uint32_t(rng.next() & 15) << 28;
            std::memcpy(&b.qs[4 * g], &grid, 4);
            std::memcpy(&b.qs[4 * g + 2], &signs_scale, 4);
        }
        b.d = f32_to_f16(1.0f);
    } else if constexpr (std::is_same_v<Block, BlockQ2_K>) {
        for (auto & s : b.scales) {
            const int sc = 1 + int(rng.next() % 10);
            s = uint8_t(sc | (std::lround(1.5 * sc) << 4));
        }
        rng.fill(b.qs, sizeof b.qs);
        b.d = b.dmin = f32_to_f16(1.0f);
    } else if constexpr (std::is_same_v<Block, BlockQ4_K>) {
        int S[8], M[8];
        for (int j = 0; j < 8; ++j) {
            S[j] = 1 + int(rng.next() % 8);
            M[j] = int(std::lround(7.5 * S[j]));
        }
        for (int j = 0; j < 4; ++j) {
            b.scales[j] = uint8_t((S[j] & 63) | ((S[j + 4] >> 4) << 6));
            b.scales[j + 4] = uint8_t((M[j] & 63) | ((M[j + 4] >> 4) << 6));
            b.scales[j + 8] = uint8_t((S[j + 4] & 15) | ((M[j + 4] & 15) << 4));
        }
        rng.fill(b.qs, sizeof b.qs);
        b.d = b.dmin = f32_to_f16(1.0f);
    }
    float values[QK_K];
    dequantize_row(type, &b, values, QK_K);
    const float scale = target / std::max(rms(values, QK_K), 1e-20f);
    b.d = f32_to_f16(scale);
    if constexpr (!std::is_same_v<Block, BlockIQ2_XXS>) b.dmin = b.d;
}

// One row of a tensor in its storage type.
void synth_row(const TensorSpec & spec, GgmlType type, const Init & init, Rng & rng, uint8_t * dst, float * scratch) {
    const int64_t n = spec.ne[0];
    switch (type) {
        case GgmlType::IQ2_XXS:
            for (int64_t b = 0; b < n / QK_K; ++b) random_block(rng, type, init.std, reinterpret_cast<BlockIQ2_XXS *>(dst)[b]);
            return;
        case GgmlType::Q2_K:
            for (int64_t b = 0; b < n / QK_K; ++b) random_block(rng, type, init.std, reinterpret_cast<BlockQ2_K *>(dst)[b]);
            return;
        case GgmlType::Q4_K:
            for (int64_t b = 0; b < n / QK_K; ++b) random_block(rng, type, init.std, reinterpret_cast<BlockQ4_K *>(dst)[b]);
            return;
        default:
            fill_values(rng, init, scratch, n);
            if (type == GgmlType::F32)
                std::memcpy(dst, scratch, size_t(n) * sizeof(float));
            else
                quantize_row(type, scratch, dst, n);
    }
}

class TensorWriter {
  public:
    TensorWriter(GgufWriter & w, uint64_t seed, const ModelConfig & c, uint64_t * done, uint64_t total,
                 const std::function<void(uint64_t, uint64_t)> & progress)
        : w_(w), seed_(seed), c_(c), done_(done), total_(total), progress_(progress) {}

    void write(const TensorSpec & spec, GgmlType type, uint64_t stream) {
        if (spec.role == Role::table) {
            // Each token gets k distinct experts.
            std::vector<int32_t> ids(size_t(spec.ne[0] * spec.ne[1]));
            std::vector<int32_t> perm(size_t(c_.n_expert));
            Rng rng(seed_, stream, 0);
            for (int64_t t = 0; t < spec.ne[1]; ++t) {
                std::iota(perm.begin(), perm.end(), 0);
                for (int64_t j = 0; j < spec.ne[0]; ++j) {
                    const size_t pick = size_t(j) + size_t(rng.next() % uint64_t(c_.n_expert - j));
                    std::swap(perm[size_t(j)], perm[pick]);
                    ids[size_t(t * spec.ne[0] + j)] = perm[size_t(j)];
                }
            }
            emit(ids.data(), ids.size() * sizeof(int32_t));
            return;
        }
        const Init init = init_for(spec, c_);
        const size_t rb = row_bytes(type, spec.ne[0]);
        const int64_t rows = spec.rows();
        const int64_t batch = std::max<int64_t>(1, int64_t((size_t(32) << 20) / rb));
        for (int64_t r0 = 0; r0 < rows; r0 += batch) {
            const int64_t nr = std::min(batch, rows - r0);
            chunk_.resize(size_t(nr) * rb);
            pool_.parallel_for(size_t(nr), 1, [&](size_t b, size_t e, int) {
                std::vector<float> scratch(static_cast<size_t>(spec.ne[0]));
                for (size_t r = b; r < e; ++r) {
                    Rng rng(seed_, stream, uint64_t(r0) + r);
                    synth_row(spec, type, init, rng, chunk_.data() + r * rb, scratch.data());
                }
            });
            emit(chunk_.data(), chunk_.size());
        }
    }

  private:
    void emit(const void * data, size_t bytes) {
        w_.write_tensor_data(data, bytes);
        *done_ += bytes;
        if (progress_) progress_(*done_, total_);
    }

    GgufWriter & w_;
    uint64_t seed_;
    const ModelConfig & c_;
    uint64_t * done_;
    uint64_t total_;
    const std::function<void(uint64_t, uint64_t)> & progress_;
    ThreadPool pool_;
    std::vector<uint8_t> chunk_;
};

uint64_t tensor_bytes(const TensorSpec & s, GgmlType type) { return row_bytes(type, s.ne[0]) * uint64_t(s.rows()); }

}  // namespace

uint64_t write_synthetic_model(const SynthOptions & o, const std::string & path) {
    const ModelConfig & c = o.config;
    std::optional<GgufFile> vocab;
    if (!o.vocab_path.empty()) {
        vocab = GgufFile::open(o.vocab_path);
        const size_t n_tokens = vocab->get_string_array("tokenizer.ggml.tokens").size();
        DSV4_CHECK(int64_t(n_tokens) == c.n_vocab, "{}: {} tokens, the model's vocabulary is {}", o.vocab_path,
                   n_tokens, c.n_vocab);
    }
    std::vector<TensorSpec> specs = tensor_layout(c);
    if (o.mtp_in_file) {
        std::vector<TensorSpec> mtp = mtp_layout(c, "blk." + std::to_string(c.n_layer) + ".", true);
        specs.insert(specs.end(), mtp.begin(), mtp.end());
    }
    std::vector<TensorSpec> mtp_specs;
    if (!o.mtp_path.empty()) mtp_specs = mtp_layout(c, "mtp.0.", false);

    uint64_t total = 0, done = 0;
    for (const auto * list : {&specs, &mtp_specs})
        for (const TensorSpec & s : *list) total += tensor_bytes(s, storage_type(s.role, o.mix, s.ne[0]));

    auto write_file = [&](const std::string & file, const std::vector<TensorSpec> & list, bool main, uint64_t base) {
        GgufWriter w(file);
        if (main) {
            store_config(w, c, o.mtp_in_file);
            w.set("general.description", GgufValue::make_string(
                fmt::format("dsv4-synth: random weights (seed {}, mix {}) for benchmarks and tests; not a trained model",
                            o.seed, storage_mix_name(o.mix))));
            if (vocab)
                for (const GgufKv & kv : vocab->metadata())
                    if (kv.key.rfind("tokenizer.", 0) == 0) w.set(kv.key, kv.value);
        } else {
            w.set("general.architecture", GgufValue::make_string("deepseek4"));
            w.set("general.name", GgufValue::make_string(c.name + " (MTP)"));
        }
        for (const TensorSpec & s : list)
            w.add_tensor(s.name, storage_type(s.role, o.mix, s.ne[0]), {s.ne[0], s.ne[1], s.ne[2]});
        TensorWriter tw(w, o.seed, c, &done, total, o.progress);
        for (size_t i = 0; i < list.size(); ++i)
            tw.write(list[i], storage_type(list[i].role, o.mix, list[i].ne[0]), base + i);
        w.finish();
    };
    write_file(path, specs, true, 0);
    if (!mtp_specs.empty()) write_file(o.mtp_path, mtp_specs, false, specs.size());
    return done;
}

}  // namespace dsv4
