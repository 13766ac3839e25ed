// The CPU backend: the reference every other backend is checked against. Plain loops over row-major f32
// activations; the heavy dot products go through format/quant (AVX2 when the CPU has it); parallel work is
// split over a fork-join thread pool.
#include "backend/backend.h"
#include "format/quant.h"
#include "util/aligned.h"
#include "util/error.h"
#include "util/half.h"
#include "util/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace dsv4 {

namespace {

// ---------------------------------------------------------------------------------------------------------------------
// Small vector helpers
// ---------------------------------------------------------------------------------------------------------------------

// Compiled for AVX2 and a baseline on x86; the loader picks one at start-up (these run inside attention and HC).
#if defined(__x86_64__)
#define DSV4_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DSV4_CPU_CLONES
#endif

DSV4_CPU_CLONES float dot_f32(const float * a, const float * b, int64_t n) {
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
        s4 += a[i + 4] * b[i + 4];
        s5 += a[i + 5] * b[i + 5];
        s6 += a[i + 6] * b[i + 6];
        s7 += a[i + 7] * b[i + 7];
    }
    for (; i < n; ++i) s0 += a[i] * b[i];
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
}

DSV4_CPU_CLONES void axpy_f32(float * y, float a, const float * x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

bool is_float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// torch.nn.functional.softplus with its default threshold: linear above 20.
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

double sum_squares(const float * x, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
    return s;
}

class HostBuffer final : public BackendBuffer {
  public:
    explicit HostBuffer(size_t bytes) : buf_(bytes) {}
    void * data() override { return buf_.data(); }
    size_t size() const override { return buf_.size(); }

  private:
    AlignedBuffer buf_;
};

// ---------------------------------------------------------------------------------------------------------------------
// The backend
// ---------------------------------------------------------------------------------------------------------------------

class CpuBackend final : public Backend {
  public:
    explicit CpuBackend(const CpuBackendOptions & options)
        : options_(options), pool_(options.n_threads), scratch_(size_t(pool_.size())) {}

    std::string name() const override { return std::string("cpu (") + quant_simd_name() + ")"; }

    // ---- memory ----------------------------------------------------------------------------------------------
    std::unique_ptr<BackendBuffer> alloc(size_t bytes) override { return std::make_unique<HostBuffer>(bytes); }

    Tensor upload_weight(const Tensor & host, std::unique_ptr<BackendBuffer> *) override { return host; }

    void write(const Tensor & dst, const void * host, size_t bytes, size_t offset) override {
        std::memcpy(static_cast<uint8_t *>(dst.data) + offset, host, bytes);
    }
    void read(const Tensor & src, void * host, size_t bytes, size_t offset) override {
        std::memcpy(host, static_cast<const uint8_t *>(src.data) + offset, bytes);
    }
    void copy(const Tensor & dst, const Tensor & src, size_t bytes, size_t dst_offset, size_t src_offset) override {
        std::memmove(static_cast<uint8_t *>(dst.data) + dst_offset,
                     static_cast<const uint8_t *>(src.data) + src_offset, bytes);
    }
    void fill(const Tensor & dst, float value) override { std::fill_n(dst.f32(), dst.n_elements(), value); }
    void synchronize() override {}

    // ---- dense ops -------------------------------------------------------------------------------------------
    void get_rows(const Tensor & table, const Tensor & ids, const Tensor & out) override {
        const int64_t width = table.ne[0];
        const int64_t n = ids.n_elements();
        const size_t rb = table.row_bytes();
        pool_.parallel_for(size_t(n), 1, [&](size_t b, size_t e, int) {
            for (size_t t = b; t < e; ++t) {
                const int32_t id = ids.i32()[t];
                dequantize_row(table.type, static_cast<const uint8_t *>(table.data) + size_t(id) * rb,
                               out.f32() + t * width, width);
            }
        });
    }

    void matmul(const Tensor & w, const Tensor & x, const Tensor & y) override {
        matmul_rows(w, 0, w.ne[1], x.f32(), x.ne[0], x.rows(), y.f32(), y.ne[0]);
    }

    void matmul_many(const Tensor & x, std::span<const MatmulTarget> targets) override {
        // x does not change during the call: targets of one activation type quantize it once.
        for (size_t i = 0; i < targets.size(); ++i)
            matmul_rows(targets[i].w, 0, targets[i].w.ne[1], x.f32(), x.ne[0], x.rows(), targets[i].y.f32(),
                        targets[i].y.ne[0], /*reuse_activations=*/i > 0);
    }

    void matmul_grouped(const Tensor & w, const Tensor & x, const Tensor & y, int64_t groups) override {
        const int64_t in_g = w.ne[0];
        const int64_t out_g = w.ne[1] / groups;
        // Each group is a matmul over a column slice of x (stride x.ne[0]) into a column slice of y.
        for (int64_t g = 0; g < groups; ++g)
            matmul_rows(w, g * out_g, out_g, x.f32() + g * in_g, x.ne[0], x.rows(), y.f32() + g * out_g, y.ne[0]);
    }

    void rms_norm(const Tensor & x, const Tensor & gamma, const Tensor & y, float eps) override {
        const int64_t width = x.ne[0];
        pool_.parallel_for(size_t(x.rows()), 16, [&](size_t b, size_t e, int) {
            for (size_t r = b; r < e; ++r)
                norm_row(x.f32() + r * width, gamma ? gamma.f32() : nullptr, y.f32() + r * width, width, eps);
        });
    }

    void rope(const Tensor & x, const RopeSpec & spec, const Tensor & positions, bool inverse) override {
        const int64_t width = x.ne[0];
        const int64_t heads = x.ne[1];
        const int64_t n = x.rows() / heads;
        pool_.parallel_for(size_t(n), 4, [&](size_t b, size_t e, int) {
            for (size_t t = b; t < e; ++t)
                rope_heads(x.f32() + int64_t(t) * heads * width, heads, width, spec, positions.i32()[t], inverse);
        });
    }

    void add(const Tensor & a, const Tensor & b, const Tensor & out) override {
        const int64_t n = out.n_elements();
        pool_.parallel_for(size_t(n), 1 << 14, [&](size_t s, size_t e, int) {
            for (size_t i = s; i < e; ++i) out.f32()[i] = a.f32()[i] + b.f32()[i];
        });
    }

    void swiglu(const Tensor & gate, const Tensor & up, const Tensor & out, float limit) override {
        const int64_t n = out.n_elements();
        pool_.parallel_for(size_t(n), 1 << 14, [&](size_t s, size_t e, int) {
            for (size_t i = s; i < e; ++i) out.f32()[i] = swiglu_one(gate.f32()[i], up.f32()[i], limit);
        });
    }

    void swiglu_matmul_add(const Tensor & w, const Tensor & gate, const Tensor & up, float limit, const Tensor & add,
                           const Tensor & y) override {
        const int64_t in = gate.ne[0], n = gate.rows(), out = y.ne[0];
        fused_act_.reserve(size_t(n * in) * sizeof(float));
        fused_out_.reserve(size_t(n * out) * sizeof(float));
        float * h = fused_act_.as<float>();
        float * p = fused_out_.as<float>();
        pool_.parallel_for(size_t(n * in), 1 << 14, [&](size_t b, size_t e, int) {
            for (size_t i = b; i < e; ++i) h[i] = swiglu_one(gate.f32()[i], up.f32()[i], limit);
        });
        matmul_rows(w, 0, w.ne[1], h, in, n, p, out);
        pool_.parallel_for(size_t(n * out), 1 << 14, [&](size_t b, size_t e, int) {
            for (size_t i = b; i < e; ++i) y.f32()[i] = add.f32()[i] + p[i];
        });
    }

    void norm_rope(std::span<const NormRopeTarget> targets, float eps, const RopeSpec & rope,
                   const Tensor & positions) override {
        for (const NormRopeTarget & r : targets) {
            const int64_t width = r.x.ne[0], heads = r.x.ne[1], n = r.x.rows() / heads;
            const size_t token_bytes = size_t(heads * width) * sizeof(float);
            pool_.parallel_for(size_t(n), 1, [&](size_t b, size_t e, int) {
                for (size_t t = b; t < e; ++t) {
                    float * xt = r.x.f32() + int64_t(t) * heads * width;
                    const int32_t pos = positions.i32()[t];
                    for (int64_t h = 0; h < heads; ++h)
                        norm_row(xt + h * width, r.gamma ? r.gamma.f32() : nullptr, xt + h * width, width, eps);
                    rope_heads(xt, heads, width, rope, pos, false);
                    if (r.fp8_dims > 0)
                        for (int64_t h = 0; h < heads; ++h) fp8_row(xt + h * width, r.fp8_dims);
                    if (r.ring)
                        std::memcpy(static_cast<uint8_t *>(r.ring.data) + size_t(pos % r.ring.rows()) * token_bytes, xt,
                                    token_bytes);
                }
            });
        }
    }

    // ---- official numerics -----------------------------------------------------------------------------------
    void fp8_roundtrip(const Tensor & x, int64_t n_dims) override {
        const int64_t width = x.ne[0];
        pool_.parallel_for(size_t(x.rows()), 16, [&](size_t b, size_t e, int) {
            for (size_t r = b; r < e; ++r) fp8_row(x.f32() + r * width, n_dims);
        });
    }

    void hadamard_fp4_roundtrip(const Tensor & x) override {
        const int64_t width = x.ne[0];
        pool_.parallel_for(size_t(x.rows()), 16, [&](size_t b, size_t e, int) {
            for (size_t r = b; r < e; ++r) hadamard_fp4_row(x.f32() + r * width, width);
        });
    }

    // ---- hyper-connections -----------------------------------------------------------------------------------
    void hc_expand(const Tensor & x, const Tensor & streams) override {
        const int64_t width = x.ne[0];
        const int64_t hc = streams.ne[1];
        for (int64_t t = 0; t < x.rows(); ++t)
            for (int64_t h = 0; h < hc; ++h)
                std::memcpy(streams.f32() + (t * hc + h) * width, x.f32() + t * width, size_t(width) * sizeof(float));
    }

    void hc_pre(const Tensor & streams, const HcPre & w, const Tensor & y, const Tensor & post,
                const Tensor & comb) override {
        const int64_t width = streams.ne[0];
        const int64_t hc = streams.ne[1];
        const int64_t n = streams.rows() / hc;
        const int64_t n_mix = w.fn.ne[1];
        const float * sc = w.scale.f32();
        const float * bs = w.base.f32();
        pool_.parallel_for(size_t(n), 1, [&](size_t b, size_t e, int thread) {
            float * mix = scratch_floats(thread, size_t(n_mix));
            for (size_t t = b; t < e; ++t) {
                const float * x = streams.f32() + int64_t(t) * hc * width;
                mix_weights(w.fn, x, hc * width, w.eps_norm, mix);
                float * pt = post.f32() + int64_t(t) * hc;
                float * ct = comb.f32() + int64_t(t) * hc * hc;
                float pre[64];
                for (int64_t h = 0; h < hc; ++h) {
                    pre[h] = sigmoid(mix[h] * sc[0] + bs[h]) + w.eps_hc;
                    pt[h] = 2.0f * sigmoid(mix[hc + h] * sc[1] + bs[hc + h]);
                }
                for (int64_t i = 0; i < hc * hc; ++i) ct[i] = mix[2 * hc + i] * sc[2] + bs[2 * hc + i];
                sinkhorn(ct, hc, w.iters, w.eps_hc);
                float * yt = y.f32() + int64_t(t) * width;
                for (int64_t c = 0; c < width; ++c) {
                    float s = 0;
                    for (int64_t h = 0; h < hc; ++h) s += pre[h] * x[h * width + c];
                    yt[c] = s;
                }
                if (w.norm) norm_row(yt, w.norm.f32(), yt, width, w.eps_norm);
            }
        });
    }

    void hc_post(const Tensor & streams, const Tensor & o, const Tensor & post, const Tensor & comb,
                 const Tensor & out) override {
        const int64_t width = streams.ne[0];
        const int64_t hc = streams.ne[1];
        const int64_t n = streams.rows() / hc;
        pool_.parallel_for(size_t(n * hc), 1, [&](size_t b, size_t e, int) {
            for (size_t tj = b; tj < e; ++tj) {
                const int64_t t = int64_t(tj) / hc, j = int64_t(tj) % hc;
                const float * x = streams.f32() + t * hc * width;
                const float * ct = comb.f32() + t * hc * hc;
                const float pj = post.f32()[t * hc + j];
                const float * ot = o.f32() + t * width;
                float * dst = out.f32() + (t * hc + j) * width;
                for (int64_t c = 0; c < width; ++c) {
                    float s = pj * ot[c];
                    for (int64_t i = 0; i < hc; ++i) s += ct[i * hc + j] * x[i * width + c];
                    dst[c] = s;
                }
            }
        });
    }

    void hc_head(const Tensor & streams, const Tensor & fn, const Tensor & scale, const Tensor & base, float eps_hc,
                 float eps_norm, const Tensor & z) override {
        const int64_t width = streams.ne[0];
        const int64_t hc = streams.ne[1];
        const int64_t n = streams.rows() / hc;
        pool_.parallel_for(size_t(n), 1, [&](size_t b, size_t e, int thread) {
            float * mix = scratch_floats(thread, size_t(hc));
            for (size_t t = b; t < e; ++t) {
                const float * x = streams.f32() + int64_t(t) * hc * width;
                mix_weights(fn, x, hc * width, eps_norm, mix);
                float w[64];
                for (int64_t h = 0; h < hc; ++h) w[h] = sigmoid(mix[h] * scale.f32()[0] + base.f32()[h]) + eps_hc;
                float * zt = z.f32() + int64_t(t) * width;
                for (int64_t c = 0; c < width; ++c) {
                    float s = 0;
                    for (int64_t h = 0; h < hc; ++h) s += w[h] * x[h * width + c];
                    zt[c] = s;
                }
            }
        });
    }

    // ---- attention -------------------------------------------------------------------------------------------
    void store_rows(const Tensor & ring, const Tensor & rows, const Tensor & positions) override {
        const size_t rb = rows.row_bytes();
        for (int64_t t = 0; t < rows.rows(); ++t)
            std::memcpy(static_cast<uint8_t *>(ring.data) + size_t(positions.i32()[t] % ring.rows()) * rb,
                        static_cast<const uint8_t *>(rows.data) + size_t(t) * rb, rb);
    }

    void compressor_update(const Tensor & kv, const Tensor & score, const Tensor & ape, const Tensor & state_kv,
                           const Tensor & state_score, const Tensor & positions, int64_t ratio, bool overlap,
                           const CompressedRowFinish & finish, const Tensor & store) override {
        const int64_t wide = kv.ne[0];  // c·width
        const int64_t width = overlap ? wide / 2 : wide;
        const int64_t n = kv.rows();
        const int64_t open_row0 = overlap ? ratio : 0;  // first state row of the open block
        std::vector<float> ape_row(static_cast<size_t>(wide), 0.0f);
        // A BF16 store (indexer keys under the official numerics) takes the finished row rounded from f32.
        DSV4_CHECK(store.type == GgmlType::F32 || store.type == GgmlType::BF16,
                   "compressor_update: the store must be F32 or BF16");
        std::vector<float> finished(store.type == GgmlType::BF16 ? size_t(width) : 0);
        float * skv = state_kv.f32();
        float * ssc = state_score.f32();
        for (int64_t t = 0; t < n; ++t) {
            const int64_t pos = positions.i32()[t];
            const int64_t slot = pos % ratio;
            dequantize_row(ape.type, static_cast<const uint8_t *>(ape.data) + size_t(slot) * ape.row_bytes(),
                           ape_row.data(), wide);
            float * rkv = skv + (open_row0 + slot) * wide;
            float * rsc = ssc + (open_row0 + slot) * wide;
            std::memcpy(rkv, kv.f32() + t * wide, size_t(wide) * sizeof(float));
            for (int64_t c = 0; c < wide; ++c) rsc[c] = score.f32()[t * wide + c] + ape_row[size_t(c)];
            if (slot != ratio - 1) continue;

            // Block complete: softmax over its candidates per channel, in f32.
            const int64_t block = pos / ratio;
            float * dst = store.type == GgmlType::BF16 ? finished.data() : store.f32() + block * width;
            pool_.parallel_for(size_t(width), 64, [&](size_t cb, size_t ce, int) {
                for (size_t c = cb; c < ce; ++c) {
                    float m = -std::numeric_limits<float>::infinity();
                    auto each = [&](auto && fn) {
                        if (overlap) {
                            for (int64_t r = 0; r < ratio; ++r) fn(skv[r * wide + c], ssc[r * wide + c]);
                            for (int64_t r = ratio; r < 2 * ratio; ++r)
                                fn(skv[r * wide + width + c], ssc[r * wide + width + c]);
                        } else {
                            for (int64_t r = 0; r < ratio; ++r) fn(skv[r * wide + c], ssc[r * wide + c]);
                        }
                    };
                    each([&](float, float s) { m = std::max(m, s); });
                    float denom = 0, acc = 0;
                    each([&](float v, float s) {
                        if (s == -std::numeric_limits<float>::infinity()) return;
                        const float p = std::exp(s - m);
                        denom += p;
                        acc += p * v;
                    });
                    dst[c] = acc / denom;
                }
            });
            norm_row(dst, finish.norm.f32(), dst, width, finish.eps);
            rope_heads(dst, 1, width, finish.rope, block * ratio, false);
            if (finish.rounding == RowRounding::fp8) fp8_row(dst, finish.fp8_dims);
            if (finish.rounding == RowRounding::hadamard_fp4) hadamard_fp4_row(dst, width);
            if (store.type == GgmlType::BF16) {
                uint16_t * out = static_cast<uint16_t *>(store.data) + block * width;
                for (int64_t c = 0; c < width; ++c) out[c] = f32_to_bf16(dst[c]);
            }
            if (overlap) {
                // The completed block becomes the previous block of the next one.
                std::memcpy(skv, skv + ratio * wide, size_t(ratio * wide) * sizeof(float));
                std::memcpy(ssc, ssc + ratio * wide, size_t(ratio * wide) * sizeof(float));
            }
            std::fill_n(skv + open_row0 * wide, ratio * wide, 0.0f);
            std::fill_n(ssc + open_row0 * wide, ratio * wide, -std::numeric_limits<float>::infinity());
        }
    }

    void indexer_select(const Tensor & q, const Tensor & w, const Tensor & keys, const Tensor & positions,
                        int64_t ratio, float key_scale, const Tensor & selected) override {
        const int64_t heads = q.ne[1];
        const int64_t dim = q.ne[0];
        const int64_t n = q.rows() / heads;
        const int64_t top_k = selected.ne[0];
        DSV4_CHECK(keys.type == GgmlType::F32 || keys.type == GgmlType::BF16,
                   "indexer_select: keys must be F32 or BF16");
        pool_.parallel_for(size_t(n), 1, [&](size_t b, size_t e, int) {
            std::vector<float> scores, key_row(keys.type == GgmlType::BF16 ? size_t(dim) : 0);
            std::vector<int32_t> order;
            for (size_t t = b; t < e; ++t) {
                const int64_t visible = (int64_t(positions.i32()[t]) + 1) / ratio;
                DSV4_CHECK(visible <= keys.rows(), "indexer_select: position {} sees {} keys, {} given",
                           positions.i32()[t], visible, keys.rows());
                int32_t * sel = selected.i32() + int64_t(t) * top_k;
                std::fill_n(sel, top_k, -1);
                if (visible <= top_k) {
                    for (int64_t r = 0; r < visible; ++r) sel[r] = int32_t(r);
                    continue;
                }
                const float * qt = q.f32() + int64_t(t) * heads * dim;
                const float * wt = w.f32() + int64_t(t) * heads;
                scores.resize(size_t(visible));
                for (int64_t r = 0; r < visible; ++r) {
                    const float * k = key_row.data();
                    if (keys.type == GgmlType::BF16) {
                        const uint16_t * kb = static_cast<const uint16_t *>(keys.data) + r * dim;
                        for (int64_t c = 0; c < dim; ++c) key_row[size_t(c)] = bf16_to_f32(kb[c]);
                    } else {
                        k = keys.f32() + r * dim;
                    }
                    float s = 0;
                    for (int64_t h = 0; h < heads; ++h) s += wt[h] * std::max(0.0f, dot_f32(qt + h * dim, k, dim));
                    scores[size_t(r)] = s * key_scale;
                }
                order.resize(size_t(visible));
                std::iota(order.begin(), order.end(), 0);
                // Highest scores first; ties to the lower row id so the choice is deterministic.
                std::nth_element(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t c) {
                    return scores[size_t(a)] > scores[size_t(c)] || (scores[size_t(a)] == scores[size_t(c)] && a < c);
                });
                std::sort(order.begin(), order.begin() + top_k);
                std::copy_n(order.begin(), top_k, sel);
            }
        });
    }

    void attention(const Tensor & q, const Tensor & raw, const Tensor & positions, int64_t window,
                   const CompressedRows & comp, const Tensor & sinks, float scale, const Tensor & out,
                   const RopeSpec * unrotate) override {
        const int64_t dim = q.ne[0];
        const int64_t heads = q.ne[1];
        const int64_t n = q.rows() / heads;
        const int64_t ring = raw.rows();
        pool_.parallel_for(size_t(n), 1, [&](size_t b, size_t e, int) {
            std::vector<const float *> rows;
            std::vector<float> logits;
            for (size_t t = b; t < e; ++t) {
                const int64_t pos = positions.i32()[t];
                // Keys in summation order: the raw window oldest to newest, then compressed rows by index.
                rows.clear();
                for (int64_t p = std::max<int64_t>(0, pos - window + 1); p <= pos; ++p)
                    rows.push_back(raw.f32() + (p % ring) * dim);
                if (comp.rows) {
                    if (comp.selected) {
                        const int64_t top_k = comp.selected.ne[0];
                        const int32_t * sel = comp.selected.i32() + int64_t(t) * top_k;
                        for (int64_t j = 0; j < top_k; ++j)
                            if (sel[j] >= 0) rows.push_back(comp.rows.f32() + int64_t(sel[j]) * dim);
                    } else {
                        const int64_t visible = (pos + 1) / comp.ratio;
                        DSV4_CHECK(visible <= comp.rows.rows(),
                                   "attention: position {} sees {} compressed rows, {} given", pos, visible,
                                   comp.rows.rows());
                        for (int64_t r = 0; r < visible; ++r) rows.push_back(comp.rows.f32() + r * dim);
                    }
                }
                const int64_t nk = int64_t(rows.size());
                logits.resize(size_t(nk));
                for (int64_t h = 0; h < heads; ++h) {
                    const float * qh = q.f32() + (int64_t(t) * heads + h) * dim;
                    const float sink = sinks.f32()[h];
                    float m = sink;
                    for (int64_t j = 0; j < nk; ++j) {
                        logits[size_t(j)] = dot_f32(qh, rows[size_t(j)], dim) * scale;
                        m = std::max(m, logits[size_t(j)]);
                    }
                    float denom = std::exp(sink - m);
                    float * oh = out.f32() + (int64_t(t) * heads + h) * dim;
                    std::fill_n(oh, dim, 0.0f);
                    for (int64_t j = 0; j < nk; ++j) {
                        const float p = std::exp(logits[size_t(j)] - m);
                        denom += p;
                        axpy_f32(oh, p, rows[size_t(j)], dim);
                    }
                    const float inv = 1.0f / denom;
                    for (int64_t c = 0; c < dim; ++c) oh[c] *= inv;
                }
            }
        });
        if (unrotate) rope(out, *unrotate, positions, true);
    }

    // ---- sampling --------------------------------------------------------------------------------------------
    void logit_candidates(const Tensor & logits, const Tensor & ids, const Tensor & values,
                          const Tensor & stats) override {
        const int64_t n_vocab = logits.ne[0], k = ids.ne[0];
        const float neg_inf = -std::numeric_limits<float>::infinity();
        std::vector<int64_t> bins(static_cast<size_t>(n_vocab));
        for (int64_t r = 0; r < logits.rows(); ++r) {
            const float * row = logits.f32() + r * n_vocab;
            auto clean = [&](int64_t i) { return std::isnan(row[i]) ? neg_inf : row[i]; };
            float max = neg_inf;
            int64_t argmax = 0;
            for (int64_t i = 0; i < n_vocab; ++i)
                if (clean(i) > max) max = clean(i), argmax = i;
            double sum = 0;
            std::vector<int64_t> hist(kCandidateBins, 0);
            for (int64_t i = 0; i < n_vocab; ++i) {
                bins[size_t(i)] = kCandidateBins;
                if (max == neg_inf || clean(i) == neg_inf) continue;
                sum += double(std::exp(clean(i) - max));
                const float d = (max - clean(i)) * float(kCandidateBinsPerNat);
                if (d < float(kCandidateBins)) ++hist[size_t(bins[size_t(i)] = int64_t(d))];
            }
            int64_t kept_bins = 0, count = 0;
            while (kept_bins < kCandidateBins && count + hist[size_t(kept_bins)] <= k)
                count += hist[size_t(kept_bins++)];
            int64_t j = 0;
            for (int64_t i = 0; i < n_vocab; ++i)
                if (bins[size_t(i)] < kept_bins) {
                    ids.i32()[r * k + j] = int32_t(i);
                    values.f32()[r * k + j++] = clean(i);
                }
            for (; j < k; ++j) {
                ids.i32()[r * k + j] = -1;
                values.f32()[r * k + j] = neg_inf;
            }
            float * st = stats.f32() + 4 * r;
            st[0] = max;
            st[1] = float(std::log(sum));
            st[2] = float(count);
            st[3] = float(argmax);
        }
    }

    // ---- mixture of experts ----------------------------------------------------------------------------------
    void router(const Tensor & logits, const Tensor & bias, const Tensor & tid2eid, const Tensor & tokens,
                float route_scale, const Tensor & experts, const Tensor & weights) override {
        const int64_t n_expert = logits.ne[0];
        const int64_t n = logits.rows();
        const int64_t k = experts.ne[0];
        const size_t n_slots = static_cast<size_t>(n_expert);
        std::vector<float> p(n_slots), sel_score(n_slots);
        std::vector<int32_t> order(n_slots);
        for (int64_t t = 0; t < n; ++t) {
            const float * lt = logits.f32() + t * n_expert;
            for (int64_t e = 0; e < n_expert; ++e) p[size_t(e)] = std::sqrt(softplus(lt[e]));
            int32_t * et = experts.i32() + t * k;
            if (tid2eid) {
                std::copy_n(tid2eid.i32() + int64_t(tokens.i32()[t]) * k, k, et);
            } else {
                for (int64_t e = 0; e < n_expert; ++e) sel_score[size_t(e)] = p[size_t(e)] + (bias ? bias.f32()[e] : 0);
                std::iota(order.begin(), order.end(), 0);
                std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
                    return sel_score[size_t(a)] > sel_score[size_t(b)] ||
                           (sel_score[size_t(a)] == sel_score[size_t(b)] && a < b);
                });
                std::copy_n(order.begin(), k, et);
            }
            float sum = 0;
            for (int64_t j = 0; j < k; ++j) sum += p[size_t(et[j])];
            const float norm = route_scale / (sum + 1e-20f);
            for (int64_t j = 0; j < k; ++j) weights.f32()[t * k + j] = p[size_t(et[j])] * norm;
        }
    }

    void moe(const Tensor & x, const Tensor & experts, const Tensor & weights, const Tensor & gate, const Tensor & up,
             const Tensor & down, float limit, const Tensor & out) override {
        const int64_t dim = x.ne[0];
        const int64_t inner = gate.ne[1];
        const int64_t n_expert = gate.ne[2];
        const int64_t n = x.rows();
        const int64_t k = experts.ne[0];
        // Group the (token, slot) pairs by expert so each expert's weights are read once per call.
        std::vector<std::vector<std::pair<int32_t, float>>> by_expert(static_cast<size_t>(n_expert));
        for (int64_t t = 0; t < n; ++t)
            for (int64_t j = 0; j < k; ++j) {
                const int32_t e = experts.i32()[t * k + j];
                DSV4_CHECK(e >= 0 && e < n_expert, "expert id {} out of range [0, {})", e, n_expert);
                by_expert[size_t(e)].push_back({int32_t(t), weights.f32()[t * k + j]});
            }
        std::fill_n(out.f32(), n * dim, 0.0f);
        AlignedBuffer xs, hg, hu, yd;
        for (int64_t e = 0; e < n_expert; ++e) {
            const auto & rows = by_expert[size_t(e)];
            if (rows.empty()) continue;
            const int64_t m = int64_t(rows.size());
            xs.reserve(size_t(m * dim) * sizeof(float));
            hg.reserve(size_t(m * inner) * sizeof(float));
            hu.reserve(size_t(m * inner) * sizeof(float));
            yd.reserve(size_t(m * dim) * sizeof(float));
            for (int64_t r = 0; r < m; ++r)
                std::memcpy(xs.as<float>() + r * dim, x.f32() + int64_t(rows[size_t(r)].first) * dim,
                            size_t(dim) * sizeof(float));
            matmul_rows(expert_matrix(gate, e), 0, inner, xs.as<float>(), dim, m, hg.as<float>(), inner);
            matmul_rows(expert_matrix(up, e), 0, inner, xs.as<float>(), dim, m, hu.as<float>(), inner);
            for (int64_t i = 0; i < m * inner; ++i)
                hg.as<float>()[i] = swiglu_one(hg.as<float>()[i], hu.as<float>()[i], limit);
            matmul_rows(expert_matrix(down, e), 0, dim, hg.as<float>(), inner, m, yd.as<float>(), dim);
            for (int64_t r = 0; r < m; ++r)
                axpy_f32(out.f32() + int64_t(rows[size_t(r)].first) * dim, rows[size_t(r)].second,
                         yd.as<float>() + r * dim, dim);
        }
    }

  private:
    // y = x / sqrt(mean(x^2) + eps) (· gamma). The statistic in double: the reference (torch, fp32) sums pairwise,
    // and a double sum stays closer to the exact value than any single-precision order.
    static void norm_row(const float * x, const float * gamma, float * y, int64_t n, float eps) {
        const float scale = 1.0f / std::sqrt(float(sum_squares(x, n) / double(n)) + eps);
        if (gamma)
            for (int64_t i = 0; i < n; ++i) y[i] = gamma[i] * (x[i] * scale);
        else
            for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale;
    }

    // Rotates the last n_rot channels of `heads` consecutive rows of `width` by one position. Angles in f32 as
    // the reference computes them: float(position) · inv_freq.
    static void rope_heads(float * x, int64_t heads, int64_t width, const RopeSpec & spec, int64_t pos, bool inverse) {
        const int64_t half = spec.n_rot / 2;
        const float * inv_freq = spec.inv_freq.f32();
        float cs[512];
        DSV4_CHECK(half <= 256, "rope over {} channels is more than this backend handles", spec.n_rot);
        for (int64_t i = 0; i < half; ++i) {
            const float ang = float(pos) * inv_freq[i];
            cs[2 * i] = std::cos(ang);
            cs[2 * i + 1] = inverse ? -std::sin(ang) : std::sin(ang);
        }
        for (int64_t h = 0; h < heads; ++h) {
            float * v = x + h * width + (width - spec.n_rot);
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[2 * i], c = v[2 * i + 1];
                v[2 * i] = a * cs[2 * i] - c * cs[2 * i + 1];
                v[2 * i + 1] = a * cs[2 * i + 1] + c * cs[2 * i];
            }
        }
    }

    // V4's widths are whole blocks (448 = 7 × 64 KV channels, 128-wide indexer rows); a test model's trailing
    // partial block is rounded as a block of its own.
    static void fp8_row(float * x, int64_t n_dims) {
        const int64_t full = n_dims / 64 * 64;
        if (full > 0) dsv4::fp8_roundtrip(x, full, 64);
        if (n_dims > full) dsv4::fp8_roundtrip(x + full, n_dims - full, n_dims - full);
    }

    static void hadamard_fp4_row(float * x, int64_t width) {
        hadamard_inplace(x, width);
        dsv4::fp4_roundtrip(x, width, std::min<int64_t>(width, 32));
    }

    static float swiglu_one(float g, float u, float limit) {
        if (limit > 0) {
            g = std::min(g, limit);
            u = std::clamp(u, -limit, limit);
        }
        return g / (1.0f + std::exp(-g)) * u;
    }

    static Tensor expert_matrix(const Tensor & t, int64_t e) {
        Tensor m = make_tensor(t.type, nullptr, t.ne[0], t.ne[1]);
        m.data = static_cast<uint8_t *>(t.data) + size_t(e) * m.n_bytes();
        return m;
    }

    float * scratch_floats(int thread, size_t n) {
        AlignedBuffer & b = scratch_[size_t(thread)];
        b.reserve(n * sizeof(float));
        return b.as<float>();
    }

    // mix = fn · rms0(x) for the HC mixing matrix fn [len, n_mix]. The reference normalises first, then
    // multiplies; the official code multiplies then scales: equal up to rounding.
    void mix_weights(const Tensor & fn, const float * x, int64_t len, float eps, float * mix) {
        const float scale = 1.0f / std::sqrt(float(sum_squares(x, len) / double(len)) + eps);
        std::vector<float> xn(static_cast<size_t>(len));
        for (int64_t i = 0; i < len; ++i) xn[size_t(i)] = x[i] * scale;
        const size_t rb = fn.row_bytes();
        for (int64_t r = 0; r < fn.ne[1]; ++r)
            mix[r] = vec_dot_f32(fn.type, len, static_cast<const uint8_t *>(fn.data) + size_t(r) * rb, xn.data());
    }

    // Sinkhorn on an hc×hc matrix c (source i, destination j): softmax over j plus eps, a column normalisation,
    // then (iters − 1) rounds of row then column normalisation, each denominator plus eps.
    static void sinkhorn(float * c, int64_t hc, int iters, float eps) {
        for (int64_t i = 0; i < hc; ++i) {
            float * row = c + i * hc;
            float m = row[0];
            for (int64_t j = 1; j < hc; ++j) m = std::max(m, row[j]);
            float s = 0;
            for (int64_t j = 0; j < hc; ++j) s += row[j] = std::exp(row[j] - m);
            for (int64_t j = 0; j < hc; ++j) row[j] = row[j] / s + eps;
        }
        auto normalise_columns = [&] {
            for (int64_t j = 0; j < hc; ++j) {
                float s = 0;
                for (int64_t i = 0; i < hc; ++i) s += c[i * hc + j];
                for (int64_t i = 0; i < hc; ++i) c[i * hc + j] /= s + eps;
            }
        };
        normalise_columns();
        for (int it = 1; it < iters; ++it) {
            for (int64_t i = 0; i < hc; ++i) {
                float s = 0;
                for (int64_t j = 0; j < hc; ++j) s += c[i * hc + j];
                for (int64_t j = 0; j < hc; ++j) c[i * hc + j] /= s + eps;
            }
            normalise_columns();
        }
    }

    // y[t, r0 + r] for r < n_rows = W row (row0 + r) · x[t], t < n. x rows have stride x_stride floats, y rows
    // y_stride floats. Weight rows are split across threads; each thread streams its rows past every token, so a
    // weight row is read from memory once per call whatever n is.
    // reuse_activations: the previous call had the same x, unchanged since (matmul_many); the quantized copy
    // is reused when the activation type matches too.
    void matmul_rows(const Tensor & w, int64_t row0, int64_t n_rows, const float * x, int64_t x_stride, int64_t n,
                     float * y, int64_t y_stride, bool reuse_activations = false) {
        const int64_t in = w.ne[0];
        const size_t rb = w.row_bytes();
        const uint8_t * wbase = static_cast<const uint8_t *>(w.data) + size_t(row0) * rb;
        const bool quantized = options_.quantize_activations && !is_float_type(w.type);
        const size_t act_bytes = quantized ? dot_row_bytes(w.type, in) : 0;
        const ActKey key{x, x_stride, n, in, quantized ? dot_type(w.type) : GgmlType::F32};
        if (quantized && !(reuse_activations && key == act_key_)) {
            act_.reserve(act_bytes * size_t(n));
            uint8_t * qa = act_.as<uint8_t>();
            pool_.parallel_for(size_t(n), 1, [&](size_t b, size_t e, int) {
                for (size_t t = b; t < e; ++t)
                    quantize_activations(w.type, x + int64_t(t) * x_stride, qa + t * act_bytes, in);
            });
            act_key_ = key;
        }
        const uint8_t * qa = act_.as<uint8_t>();
        // ~32 KB of weights per task keeps tasks coarse enough for the pool and fine enough to balance.
        const size_t grain = std::max<size_t>(1, (size_t(32) << 10) / std::max<size_t>(rb, 1));
        pool_.parallel_for(size_t(n_rows), grain, [&](size_t b, size_t e, int) {
            for (size_t r = b; r < e; ++r) {
                const uint8_t * wr = wbase + r * rb;
                for (int64_t t = 0; t < n; ++t) {
                    y[t * y_stride + int64_t(r)] = quantized
                                                       ? vec_dot(w.type, in, wr, qa + size_t(t) * act_bytes)
                                                       : vec_dot_f32(w.type, in, wr, x + t * x_stride);
                }
            }
        });
    }

    CpuBackendOptions options_;
    ThreadPool pool_;
    std::vector<AlignedBuffer> scratch_;  // per thread
    // The quantized activations of the last matmul input and what they were made from.
    struct ActKey {
        const float * x = nullptr;
        int64_t stride = 0, n = 0, in = 0;
        GgmlType type = GgmlType::F32;
        bool operator==(const ActKey &) const = default;
    };
    AlignedBuffer act_;
    ActKey act_key_;
    AlignedBuffer fused_act_, fused_out_;  // swiglu_matmul_add: the activated rows and the product
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendOptions & options) {
    return std::make_unique<CpuBackend>(options);
}

}  // namespace dsv4
