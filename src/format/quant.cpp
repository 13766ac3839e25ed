// Quant formats: element codecs (E4M3, E8M0, E2M1), the official FP8/FP4 round trips and Hadamard, block
// dequantizers and quantizers, scalar dot products, and the run-time choice between them and the AVX2 kernels.
//
// Dequantizers evaluate exactly ggml's float expressions in ggml's order (e.g. Q2_K `(d·sc)·q − dmin·m`), so a
// dequantized row equals ggml's bit for bit; tests/data/quant/ggml_vectors.bin checks this.
#include "format/quant.h"

#include "format/q4k_scales.h"
#include "format/quant_impl.h"
#include "util/error.h"
#include "util/half.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define DSV4_QUANT_X86 1
#else
#define DSV4_QUANT_X86 0
#endif

namespace dsv4 {

using quant_detail::kIq2;
using quant_detail::kMxfp4Doubled;

namespace {

// ---------------------------------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------------------------------

// Nearest integer with ties to even, for |v| < 2^22: adding 1.5·2^23 leaves the rounded integer in the low
// mantissa bits (the FPU rounds the sum in its default nearest-even mode). No libm call, no UB on NaN.
inline int nearest_int(float v) {
    const float f = v + 12582912.0f;
    return int(f32_bits(f) & 0x007fffff) - 0x00400000;
}

// Nearest-even integer clamped to [lo, hi]; NaN maps to 0, out-of-range values to the bounds.
inline int round_clamp(float v, int lo, int hi) {
    if (v != v) return 0;
    if (v <= float(lo)) return lo;
    if (v >= float(hi)) return hi;
    return nearest_int(v);
}

// f16 → f32 without branches, so scalar loops over f16 data vectorize (the fallback path on CPUs without
// F16C, e.g. ARM builds). Bit-identical to util/half.h's f16_to_f32 for every code, NaN payloads included:
// normals and inf/NaN rebias the exponent; subnormals are the integer mantissa times 2^-24, computed from an
// integer so a denormals-are-zero FPU mode cannot flush them.
// (Masks rather than ?: because GCC does not if-convert the latter here.)
inline float fp16(uint16_t h) {
    const uint32_t em = h & 0x7fffu;
    const uint32_t normal_mask = 0u - uint32_t(em >= 0x0400u);
    const uint32_t special_mask = 0u - uint32_t(em >= 0x7c00u);
    const uint32_t normal = (em << 13) + (112u << 23) + (special_mask & (112u << 23));
    const uint32_t subnormal = f32_bits(float(int(em)) * 0x1p-24f);
    return f32_from_bits((uint32_t(h & 0x8000) << 16) | (normal & normal_mask) | (subnormal & ~normal_mask));
}

// 2^(e-128): the scale of an MXFP4 block whose codes index the doubled table. e = 0 and 1 are subnormal.
inline float e8m0_half(uint8_t e) { return f32_from_bits(e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23); }

// 2^e for a normal float exponent (-126 <= e <= 127).
inline float pow2(int e) { return f32_from_bits(uint32_t(e + 127) << 23); }

// floor(log2(x)) for finite x > 0.
inline int floor_log2(float x) {
    const uint32_t b = f32_bits(x) & 0x7fffffff;
    const int exp = int(b >> 23);
    if (exp == 0) return int(std::bit_width(b)) - 150;  // subnormal: x = b·2^-149
    return exp - 127;
}

inline uint32_t load_u32(const void * p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

bool quant_supported(GgmlType t) {
    switch (t) {
        case GgmlType::F32:
        case GgmlType::F16:
        case GgmlType::BF16:
        case GgmlType::Q8_0:
        case GgmlType::Q8_K:
        case GgmlType::Q2_K:
        case GgmlType::Q4_K:
        case GgmlType::IQ2_XXS:
        case GgmlType::MXFP4:
            return true;
        default:
            return false;
    }
}

// Validates a row: a type this file handles and a whole number of its blocks. Returns the block count.
int64_t check_row(GgmlType type, int64_t n, const char * what) {
    const TypeTraits & t = type_traits(type);
    if (!quant_supported(type)) fail("quant {}: type {} is not supported", what, t.name);
    if (n < 0 || n % t.block_elems != 0)
        fail("quant {}({}): a row of {} values is not a whole number of {}-value blocks", what, t.name, n,
             t.block_elems);
    return n / t.block_elems;
}

// ---------------------------------------------------------------------------------------------------------------------
// CPU feature dispatch
// ---------------------------------------------------------------------------------------------------------------------
std::atomic<bool> g_force_scalar{false};

bool cpu_has_avx2() {
#if DSV4_QUANT_X86
    // F16C is read from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c". The
    // AVX2 check already covers the OS saving YMM state.
    static const bool ok = [] {
        __builtin_cpu_init();
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    }();
    return ok;
#else
    return false;
#endif
}

inline bool use_avx2() { return !g_force_scalar.load(std::memory_order_relaxed) && cpu_has_avx2(); }

// ---------------------------------------------------------------------------------------------------------------------
// Dequantizers (scalar; ggml's expressions and order, so the results match ggml bit for bit)
// ---------------------------------------------------------------------------------------------------------------------
void dequant_q8_0(const BlockQ8_0 * b, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += QK8_0) {
        const float d = fp16(b[i].d);
        for (int j = 0; j < QK8_0; ++j) y[j] = float(b[i].qs[j]) * d;
    }
}

void dequant_q8_k(const BlockQ8_K * b, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += QK_K)
        for (int j = 0; j < QK_K; ++j) y[j] = b[i].d * float(b[i].qs[j]);
}

void dequant_q2_k(const BlockQ2_K * b, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16(b[i].d);
        const float dmin = fp16(b[i].dmin);
        // Element 128h + 32g + l sits in bits 2g of qs[32h + l]; sub-block (scale) index is its position / 16.
        for (int h = 0; h < 2; ++h)
            for (int g = 0; g < 4; ++g)
                for (int half = 0; half < 2; ++half) {
                    const uint8_t sc = b[i].scales[8 * h + 2 * g + half];
                    const float dl = d * float(sc & 15);
                    const float ml = dmin * float(sc >> 4);
                    const uint8_t * q = b[i].qs + 32 * h + 16 * half;
                    for (int l = 0; l < 16; ++l) *y++ = dl * float((q[l] >> (2 * g)) & 3) - ml;
                }
    }
}

void dequant_q4_k(const BlockQ4_K * b, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16(b[i].d);
        const float dmin = fp16(b[i].dmin);
        // Sub-blocks 2p (low nibbles) and 2p+1 (high nibbles) share the 32 bytes qs[32p ..].
        for (int p = 0; p < 4; ++p) {
            const uint8_t * q = b[i].qs + 32 * p;
            for (int half = 0; half < 2; ++half) {
                int s, m;
                q4k_scale_min(b[i].scales, 2 * p + half, s, m);
                const float dl = d * float(s);
                const float ml = dmin * float(m);
                for (int l = 0; l < 32; ++l) *y++ = dl * float(half ? q[l] >> 4 : q[l] & 15) - ml;
            }
        }
    }
}

void dequant_iq2_xxs(const BlockIQ2_XXS * b, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16(b[i].d);
        for (int g = 0; g < 8; ++g) {
            const uint32_t idx = load_u32(b[i].qs + 4 * g);
            const uint32_t sgn = load_u32(b[i].qs + 4 * g + 2);
            const float db = d * (0.5f + float(sgn >> 28)) * 0.25f;
            for (int k = 0; k < 4; ++k) {
                const uint64_t grid = kIq2.grid[(idx >> (8 * k)) & 255];
                const uint8_t signs = kIq2.signs[(sgn >> (7 * k)) & 127];
                for (int e = 0; e < 8; ++e) {
                    const float v = db * float((grid >> (8 * e)) & 255);
                    *y++ = (signs >> e) & 1 ? -v : v;
                }
            }
        }
    }
}

void dequant_mxfp4(const BlockMXFP4 * b, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += QK_MXFP4) {
        const float d = e8m0_half(b[i].e);
        for (int j = 0; j < QK_MXFP4 / 2; ++j) {
            y[j] = float(kMxfp4Doubled[b[i].qs[j] & 15]) * d;
            y[j + QK_MXFP4 / 2] = float(kMxfp4Doubled[b[i].qs[j] >> 4]) * d;
        }
    }
}

void f16_row_to_f32(const uint16_t * src, float * dst, int64_t n) {
#if DSV4_QUANT_X86
    if (use_avx2()) return quant_detail::avx2::f16_to_f32(src, dst, n);
#endif
    for (int64_t i = 0; i < n; ++i) dst[i] = fp16(src[i]);
}

void bf16_row_to_f32(const uint16_t * src, float * dst, int64_t n) {
#if DSV4_QUANT_X86
    if (use_avx2()) return quant_detail::avx2::bf16_to_f32(src, dst, n);
#endif
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

// ---------------------------------------------------------------------------------------------------------------------
// Quantizers: Q8_0, Q8_K and Q8A (ggml's / ds4's rules), MXFP4
// ---------------------------------------------------------------------------------------------------------------------

// ggml's quantize_row_q8_0_ref: d = amax/127, q = round-half-away(x/d) computed as x·(1/d), d stored as f16.
void quantize_q8_0(const float * x, BlockQ8_0 * y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = f32_to_f16(d);
        for (int j = 0; j < QK8_0; ++j) {
            const float v = std::round(x[j] * id);
            y[i].qs[j] = int8_t(v != v ? 0 : std::clamp(v, -128.0f, 127.0f));
        }
    }
}

// ggml's quantize_row_q8_K_ref (the rule ds4 uses for expert activations): the scale comes from the signed
// element of largest magnitude, so that element maps to exactly -127.
void quantize_q8_k_scalar(const float * x, BlockQ8_K * y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < QK_K; ++j) {
            const float ax = std::fabs(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (amax == 0.0f) {
            std::memset(&y[i], 0, sizeof(BlockQ8_K));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; ++j) y[i].qs[j] = int8_t(round_clamp(iscale * x[j], -128, 127));
        for (int g = 0; g < QK_K / 16; ++g) {
            int sum = 0;
            for (int l = 0; l < 16; ++l) sum += y[i].qs[16 * g + l];
            y[i].bsums[g] = int16_t(sum);
        }
        y[i].d = 1.0f / iscale;
    }
}

// ds4's activation rule for Q8_0 weights: d = amax/127 kept in f32, q = nearest-even(x/d).
void quantize_q8a_scalar(const float * x, BlockQ8A * y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        y[i].d = d;
        for (int j = 0; j < QK8_0; ++j) y[i].qs[j] = d != 0.0f ? int8_t(round_clamp(x[j] / d, -127, 127)) : 0;
    }
}

void quantize_q8_k(const float * x, BlockQ8_K * y, int64_t nb) {
#if DSV4_QUANT_X86
    if (use_avx2()) return quant_detail::avx2::quantize_q8_k(x, y, nb * QK_K);
#endif
    quantize_q8_k_scalar(x, y, nb);
}

void quantize_q8a(const float * x, BlockQ8A * y, int64_t nb) {
#if DSV4_QUANT_X86
    if (use_avx2()) return quant_detail::avx2::quantize_q8a(x, y, nb * QK8_0);
#endif
    quantize_q8a_scalar(x, y, nb);
}

// MXFP4: the OCP scale rule picks e = floor(log2 amax) - 2 (so amax/2^(e-127) lies in [4, 8) and values above
// 6 clip); one exponent higher never clips but is coarser. Both are tried and the lower weighted squared error
// kept.
void quantize_mxfp4(const float * x, BlockMXFP4 * y, int64_t nb, const float * importance) {
    for (int64_t i = 0; i < nb; ++i, x += QK_MXFP4) {
        const float * w = importance ? importance + i * QK_MXFP4 : nullptr;
        float amax = 0.0f;
        for (int j = 0; j < QK_MXFP4; ++j) amax = std::max(amax, std::fabs(x[j]));
        y[i].e = 0;
        std::memset(y[i].qs, 0, sizeof(y[i].qs));
        if (!(amax > 0.0f)) continue;
        const int e0 = std::clamp(std::isfinite(amax) ? floor_log2(amax) - 2 + 127 : 254, 0, 254);
        double best = std::numeric_limits<double>::infinity();
        for (int e = e0; e <= std::min(e0 + 1, 254); ++e) {
            const float scale = 2.0f * e8m0_half(uint8_t(e));  // 2^(e-127)
            uint8_t codes[QK_MXFP4];
            double err = 0.0;
            for (int j = 0; j < QK_MXFP4; ++j) {
                codes[j] = f32_to_e2m1(x[j] / scale);
                const double diff = double(e2m1_to_f32(codes[j])) * scale - x[j];
                err += (w ? std::max(w[j], 0.0f) : 1.0f) * diff * diff;
            }
            if (err < best) {
                best = err;
                y[i].e = uint8_t(e);
                for (int j = 0; j < QK_MXFP4 / 2; ++j) y[i].qs[j] = uint8_t(codes[j] | codes[j + QK_MXFP4 / 2] << 4);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Q2_K / Q4_K quantizer: per sub-block affine fit, then quantized super-block scales, then a local search
// ---------------------------------------------------------------------------------------------------------------------

// Per-element weights of one 256-value super-block: importance (or 1) times sqrt(σ² + x²), which favours the
// large values without ignoring the small ones. A sub-block whose weights are all zero gets unit weights.
void block_weights(const float * x, const float * importance, int sub, float * w) {
    float sumx2 = 0.0f;
    for (int i = 0; i < QK_K; ++i) sumx2 += x[i] * x[i];
    const float sigma2 = sumx2 / QK_K;
    for (int i = 0; i < QK_K; ++i) {
        const float imp = importance ? std::max(importance[i], 0.0f) : 1.0f;
        w[i] = imp * std::sqrt(sigma2 + x[i] * x[i]);
    }
    for (int s = 0; s < QK_K; s += sub) {
        float sw = 0.0f;
        for (int i = 0; i < sub; ++i) sw += w[s + i];
        if (!(sw > 0.0f))
            for (int i = 0; i < sub; ++i) w[s + i] = 1.0f;
    }
}

struct AffineFit {
    float scale;  // >= 0
    float min;    // >= 0; value = scale·L − min
};

// Weighted least squares for a and b in x ≈ a·L + b with b ≤ 0 (the format subtracts a non-negative min).
// Returns the weighted squared error.
float fit_affine(const float * x, const float * w, const uint8_t * L, int n, float & a, float & b) {
    float sw = 0, sl = 0, sl2 = 0, sx = 0, slx = 0;
    for (int i = 0; i < n; ++i) {
        const float l = L[i];
        sw += w[i];
        sl += w[i] * l;
        sl2 += w[i] * l * l;
        sx += w[i] * x[i];
        slx += w[i] * l * x[i];
    }
    const float det = sw * sl2 - sl * sl;
    if (det > 0.0f) {
        a = (sw * slx - sl * sx) / det;
        b = (sl2 * sx - sl * slx) / det;
    } else {
        a = 0.0f;
        b = sw > 0.0f ? sx / sw : 0.0f;
    }
    if (b > 0.0f) {
        b = 0.0f;
        a = sl2 > 0.0f ? slx / sl2 : 0.0f;
    }
    if (a < 0.0f) a = 0.0f;
    float err = 0.0f;
    for (int i = 0; i < n; ++i) {
        const float diff = a * float(L[i]) + b - x[i];
        err += w[i] * diff * diff;
    }
    return err;
}

// Fits one sub-block of n values to codes 0..nmax. Starting points spread the range [min(x,0), max(x)] over
// nmax ± 0.9 steps; each gets codes by rounding and a least-squares (scale, min); the best start is then
// polished by alternating code assignment and refit until the error stops falling.
AffineFit fit_sub_block(const float * x, const float * w, int n, int nmax, uint8_t * L) {
    float lo = 0.0f, hi = x[0];
    for (int i = 0; i < n; ++i) {
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
    }
    if (!(hi > lo)) {  // all values equal and <= 0 (or NaN): the min alone represents them
        std::fill(L, L + n, uint8_t(0));
        return {0.0f, std::isfinite(lo) ? -lo : 0.0f};
    }
    uint8_t cand[32];
    float best_err = std::numeric_limits<float>::infinity(), best_a = 0.0f, best_b = lo;
    std::fill(L, L + n, uint8_t(0));
    for (int step = 0; step <= 24; ++step) {
        const float iscale = (float(nmax) - 0.9f + 0.075f * float(step)) / (hi - lo);
        for (int i = 0; i < n; ++i) cand[i] = uint8_t(round_clamp(iscale * (x[i] - lo), 0, nmax));
        float a, b;
        const float err = fit_affine(x, w, cand, n, a, b);
        if (err < best_err) {
            best_err = err;
            best_a = a;
            best_b = b;
            std::copy(cand, cand + n, L);
        }
    }
    for (int iter = 0; iter < 4 && best_a > 0.0f; ++iter) {
        const float inv = 1.0f / best_a;
        for (int i = 0; i < n; ++i) cand[i] = uint8_t(round_clamp((x[i] - best_b) * inv, 0, nmax));
        float a, b;
        const float err = fit_affine(x, w, cand, n, a, b);
        if (!(err < best_err)) break;
        best_err = err;
        best_a = a;
        best_b = b;
        std::copy(cand, cand + n, L);
    }
    return {best_a, -best_b};
}

// Quantizes non-negative values v[0..n) to d·q with q in 0..nmax and one shared d, minimising the weighted
// squared error: a few trial steps around max/nmax, each refined by least squares.
float fit_shared_scale(const float * v, const float * sw, int n, int nmax, uint8_t * q) {
    float vmax = 0.0f;
    for (int i = 0; i < n; ++i) vmax = std::max(vmax, v[i]);
    std::fill(q, q + n, uint8_t(0));
    if (!(vmax > 1e-30f)) return 0.0f;
    float best_err = std::numeric_limits<float>::infinity(), best_d = vmax / float(nmax);
    uint8_t cand[16];
    for (int step = -6; step <= 6; ++step) {
        const float d0 = vmax / (float(nmax) + 0.15f * float(step));
        for (int i = 0; i < n; ++i) cand[i] = uint8_t(round_clamp(v[i] / d0, 0, nmax));
        float sqv = 0.0f, sqq = 0.0f;
        for (int i = 0; i < n; ++i) {
            sqv += sw[i] * v[i] * float(cand[i]);
            sqq += sw[i] * float(cand[i]) * float(cand[i]);
        }
        const float d = sqq > 0.0f ? sqv / sqq : d0;
        float err = 0.0f;
        for (int i = 0; i < n; ++i) {
            const float diff = v[i] - d * float(round_clamp(v[i] / d, 0, nmax));
            err += sw[i] * diff * diff;
        }
        if (err < best_err) {
            best_err = err;
            best_d = d;
        }
    }
    for (int i = 0; i < n; ++i) q[i] = uint8_t(round_clamp(v[i] / best_d, 0, nmax));
    return best_d;
}

// With the stored (f16-rounded) super-block scales fixed, picks each sub-block's scale and min code among
// the neighbours of the fitted ones, and its element codes, by the actual weighted error of the dequantized
// values (evaluated with the dequantizer's expression).
void refine_sub_block(const float * x, const float * w, int n, int nmax, int smax, float d, float dmin, uint8_t & ls,
                      uint8_t & lm, uint8_t * L) {
    float best = std::numeric_limits<float>::infinity();
    const int ls0 = ls, lm0 = lm;
    uint8_t cand[32];
    for (int s = std::max(ls0 - 1, 0); s <= std::min(ls0 + 1, smax); ++s)
        for (int m = std::max(lm0 - 1, 0); m <= std::min(lm0 + 1, smax); ++m) {
            const float dl = d * float(s), ml = dmin * float(m);
            float err = 0.0f;
            for (int i = 0; i < n; ++i) {
                cand[i] = dl > 0.0f ? uint8_t(round_clamp((x[i] + ml) / dl, 0, nmax)) : 0;
                const float diff = dl * float(cand[i]) - ml - x[i];
                err += w[i] * diff * diff;
            }
            if (err < best) {
                best = err;
                ls = uint8_t(s);
                lm = uint8_t(m);
                std::copy(cand, cand + n, L);
            }
        }
}

// Shared by Q2_K (16 sub-blocks of 16, 2-bit codes, 4-bit scales) and Q4_K (8 of 32, 4-bit codes, 6-bit scales).
template <int kSub, int kNmax, int kSmax>
void quantize_k_super_block(const float * x, const float * importance, uint8_t * L, uint8_t * ls, uint8_t * lm,
                            uint16_t & d16, uint16_t & dmin16) {
    constexpr int kNsub = QK_K / kSub;
    float w[QK_K], scales[kNsub], mins[kNsub], sw[kNsub];
    block_weights(x, importance, kSub, w);
    for (int j = 0; j < kNsub; ++j) {
        const AffineFit f = fit_sub_block(x + kSub * j, w + kSub * j, kSub, kNmax, L + kSub * j);
        scales[j] = f.scale;
        mins[j] = f.min;
        sw[j] = 0.0f;
        for (int i = 0; i < kSub; ++i) sw[j] += w[kSub * j + i];
    }
    d16 = f32_to_f16(fit_shared_scale(scales, sw, kNsub, kSmax, ls));
    dmin16 = f32_to_f16(fit_shared_scale(mins, sw, kNsub, kSmax, lm));
    const float d = fp16(d16), dmin = fp16(dmin16);
    for (int j = 0; j < kNsub; ++j)
        refine_sub_block(x + kSub * j, w + kSub * j, kSub, kNmax, kSmax, d, dmin, ls[j], lm[j], L + kSub * j);
}

void quantize_q2_k(const float * x, BlockQ2_K * y, int64_t nb, const float * importance) {
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        uint8_t L[QK_K], ls[16], lm[16];
        quantize_k_super_block<16, 3, 15>(x, importance ? importance + i * QK_K : nullptr, L, ls, lm, y[i].d,
                                          y[i].dmin);
        for (int j = 0; j < 16; ++j) y[i].scales[j] = uint8_t(ls[j] | lm[j] << 4);
        for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 32; ++l) {
                const uint8_t * q = L + 128 * h + l;
                y[i].qs[32 * h + l] = uint8_t(q[0] | q[32] << 2 | q[64] << 4 | q[96] << 6);
            }
    }
}

void quantize_q4_k(const float * x, BlockQ4_K * y, int64_t nb, const float * importance) {
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        uint8_t L[QK_K], ls[8], lm[8];
        quantize_k_super_block<32, 15, 63>(x, importance ? importance + i * QK_K : nullptr, L, ls, lm, y[i].d,
                                           y[i].dmin);
        // 6-bit packing: sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scale) and 4-7 (min); 4-7 keep their
        // low 4 bits in bytes 8-11 and their top 2 bits in the spare top bits of bytes 0-7.
        uint8_t * sc = y[i].scales;
        for (int j = 0; j < 4; ++j) {
            sc[j] = uint8_t(ls[j] | (ls[j + 4] >> 4) << 6);
            sc[j + 4] = uint8_t(lm[j] | (lm[j + 4] >> 4) << 6);
            sc[j + 8] = uint8_t((ls[j + 4] & 15) | (lm[j + 4] & 15) << 4);
        }
        for (int p = 0; p < 4; ++p)
            for (int l = 0; l < 32; ++l) y[i].qs[32 * p + l] = uint8_t(L[64 * p + l] | L[64 * p + 32 + l] << 4);
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// IQ2_XXS quantizer
// ---------------------------------------------------------------------------------------------------------------------
//
// A group of 32 values has one scale s = d·(2·ls+1); each chunk of 8 is s·G·sign with G one of the 256 grid
// points (levels G ∈ {1, 3.125, 5.375} = {8, 25, 43}/8) and an even number of negative signs. Signs come from
// the data; when a chunk has an odd count the least important element (smallest w·x²) takes the wrong sign,
// so its target becomes −|x|. For a fixed s the best grid point of a chunk minimises
// s²·A_e − 2s·B_e with A_e = Σ w·G², B_e = Σ w·G·t: A and B are computed once per chunk for all 256 points
// (from two 4-element halves of 81 level combinations each), then the group scale is searched.

constexpr float kIq2Level[3] = {1.0f, 3.125f, 5.375f};

struct Iq2Chunk {
    float A[256], B[256];
};

void iq2_chunk_sums(const float * t, const float * w, Iq2Chunk & c) {
    // Partial sums over elements 0-3 and 4-7, indexed by their 8-bit level code (2 bits per element).
    float pa[2][256], pb[2][256];
    for (int half = 0; half < 2; ++half) {
        const float * th = t + 4 * half;
        const float * wh = w + 4 * half;
        for (int l0 = 0; l0 < 3; ++l0)
            for (int l1 = 0; l1 < 3; ++l1)
                for (int l2 = 0; l2 < 3; ++l2)
                    for (int l3 = 0; l3 < 3; ++l3) {
                        const int code = l0 | l1 << 2 | l2 << 4 | l3 << 6;
                        const float g[4] = {kIq2Level[l0], kIq2Level[l1], kIq2Level[l2], kIq2Level[l3]};
                        float a = 0.0f, b = 0.0f;
                        for (int e = 0; e < 4; ++e) {
                            a += wh[e] * g[e] * g[e];
                            b += wh[e] * g[e] * th[e];
                        }
                        pa[half][code] = a;
                        pb[half][code] = b;
                    }
    }
    for (int k = 0; k < 256; ++k) {
        const uint16_t lv = kIq2.levels[k];
        c.A[k] = pa[0][lv & 255] + pa[1][lv >> 8];
        c.B[k] = pb[0][lv & 255] + pb[1][lv >> 8];
    }
}

// Best grid point of every chunk for scale s; returns Σ (s²A − 2sB) (the error minus the constant Σ w·t²).
// The search spends nearly all its time here, so the loops are shaped for the compiler's vectorizer: errors of
// all 256 points, then their minimum over 8 independent lanes, then the first point that attains it.
float iq2_choose(const Iq2Chunk * chunks, float s, uint8_t * idx) {
    float total = 0.0f;
    for (int k = 0; k < 4; ++k) {
        float err[256];
        for (int e = 0; e < 256; ++e) err[e] = s * (s * chunks[k].A[e] - 2.0f * chunks[k].B[e]);
        float lane[8];
        std::fill(lane, lane + 8, std::numeric_limits<float>::infinity());
        for (int e = 0; e < 256; e += 8)
            for (int l = 0; l < 8; ++l) lane[l] = err[e + l] < lane[l] ? err[e + l] : lane[l];
        float best = lane[0];
        for (int l = 1; l < 8; ++l) best = lane[l] < best ? lane[l] : best;
        int best_e = 0;
        while (best_e < 255 && !(err[best_e] == best)) ++best_e;
        idx[k] = uint8_t(best_e);
        total += best;
    }
    return total;
}

void quantize_iq2_xxs(const float * x, BlockIQ2_XXS * y, int64_t nb, const float * importance) {
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        float w[QK_K];
        block_weights(x, importance ? importance + i * QK_K : nullptr, 32, w);
        Iq2Chunk chunks[8][4];
        uint8_t sign7[8][4];
        float group_scale[8];
        for (int g = 0; g < 8; ++g) {
            float tmax = 0.0f;
            for (int k = 0; k < 4; ++k) {
                const float * xc = x + 32 * g + 8 * k;
                const float * wc = w + 32 * g + 8 * k;
                float t[8];
                unsigned neg = 0;
                for (int e = 0; e < 8; ++e) {
                    t[e] = std::fabs(xc[e]);
                    if (xc[e] < 0.0f) neg |= 1u << e;
                }
                if (std::popcount(neg) & 1) {
                    int least = 0;
                    for (int e = 1; e < 8; ++e)
                        if (wc[e] * xc[e] * xc[e] < wc[least] * xc[least] * xc[least]) least = e;
                    t[least] = -t[least];
                    neg ^= 1u << least;
                }
                for (int e = 0; e < 8; ++e) tmax = std::max(tmax, t[e]);
                sign7[g][k] = uint8_t(neg & 127);  // the 8th sign follows from the now even parity
                iq2_chunk_sums(t, wc, chunks[g][k]);
            }
            // Scale search: five starts that map the largest target to 2.5, 3.5, …, 6.5 (the grid's levels are
            // 1, 3.125, 5.375), each followed by one least-squares refit of s for the points it chose. Finer
            // start spacing measured no better.
            float best = std::numeric_limits<float>::infinity(), best_s = 0.0f;
            if (tmax > 1e-30f && std::isfinite(tmax)) {
                for (int step = 0; step <= 4; ++step) {
                    float s = tmax / (2.5f + 1.0f * float(step));
                    uint8_t idx[4];
                    float err = iq2_choose(chunks[g], s, idx);
                    float sa = 0.0f, sb = 0.0f;
                    for (int k = 0; k < 4; ++k) {
                        sa += chunks[g][k].A[idx[k]];
                        sb += chunks[g][k].B[idx[k]];
                    }
                    if (sa > 0.0f && sb > 0.0f) {
                        const float s2 = sb / sa;
                        const float err2 = iq2_choose(chunks[g], s2, idx);
                        if (err2 < err) {
                            err = err2;
                            s = s2;
                        }
                    }
                    if (err < best) {
                        best = err;
                        best_s = s;
                    }
                }
            }
            group_scale[g] = best_s;
        }
        const float max_scale = *std::max_element(group_scale, group_scale + 8);
        y[i].d = f32_to_f16(max_scale / 31.0f);
        const float d = fp16(y[i].d);
        std::memset(y[i].qs, 0, sizeof(y[i].qs));
        if (!(d > 0.0f)) {
            y[i].d = 0;
            continue;
        }
        // With d fixed, each group takes the best of the three 4-bit scale codes around its fitted scale.
        for (int g = 0; g < 8; ++g) {
            const int l0 = round_clamp((group_scale[g] / d - 1.0f) * 0.5f, 0, 15);
            float best = std::numeric_limits<float>::infinity();
            int best_l = l0;
            uint8_t best_idx[4] = {0, 0, 0, 0};
            for (int l = std::max(l0 - 1, 0); l <= std::min(l0 + 1, 15); ++l) {
                uint8_t idx[4];
                const float err = iq2_choose(chunks[g], d * float(2 * l + 1), idx);
                if (err < best) {
                    best = err;
                    best_l = l;
                    std::copy(idx, idx + 4, best_idx);
                }
            }
            const uint32_t grid_word = uint32_t(best_idx[0]) | uint32_t(best_idx[1]) << 8 |
                                       uint32_t(best_idx[2]) << 16 | uint32_t(best_idx[3]) << 24;
            const uint32_t sign_word = uint32_t(sign7[g][0]) | uint32_t(sign7[g][1]) << 7 |
                                       uint32_t(sign7[g][2]) << 14 | uint32_t(sign7[g][3]) << 21 |
                                       uint32_t(best_l) << 28;
            std::memcpy(y[i].qs + 4 * g, &grid_word, 4);
            std::memcpy(y[i].qs + 4 * g + 2, &sign_word, 4);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Scalar dot products
// ---------------------------------------------------------------------------------------------------------------------

// Plain float rows: eight partial sums (the SIMD lane order) keep the rounding error near the vector
// kernel's.
template <typename Load>
float dot_float_row(int64_t n, const float * x, Load load) {
    float acc[8] = {};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += load(i + l) * x[i + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) s += load(i) * x[i];
    return s;
}

float dot_f32_f32(int64_t n, const void * w, const float * x) {
    const float * p = static_cast<const float *>(w);
    return dot_float_row(n, x, [p](int64_t i) { return p[i]; });
}
float dot_f16_f32(int64_t n, const void * w, const float * x) {
    const uint16_t * p = static_cast<const uint16_t *>(w);
    return dot_float_row(n, x, [p](int64_t i) { return fp16(p[i]); });
}
float dot_bf16_f32(int64_t n, const void * w, const float * x) {
    const uint16_t * p = static_cast<const uint16_t *>(w);
    return dot_float_row(n, x, [p](int64_t i) { return bf16_to_f32(p[i]); });
}

// Quantized weights · f32: dequantize one block, dot it, add the block's sum (two-level summation).
template <typename Block, int64_t kBlock, void (*kDequant)(const Block *, float *, int64_t)>
float dot_blocks_f32(int64_t n, const void * w, const float * x) {
    const Block * b = static_cast<const Block *>(w);
    float tmp[kBlock];
    float sum = 0.0f;
    for (int64_t i = 0; i < n / kBlock; ++i, x += kBlock) {
        kDequant(b + i, tmp, 1);
        float s = 0.0f;
        for (int64_t j = 0; j < kBlock; ++j) s += tmp[j] * x[j];
        sum += s;
    }
    return sum;
}

float dot_q8_0_q8a(int64_t n, const void * wv, const void * av) {
    const BlockQ8_0 * w = static_cast<const BlockQ8_0 *>(wv);
    const BlockQ8A * a = static_cast<const BlockQ8A *>(av);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK8_0; ++i) {
        int isum = 0;
        for (int j = 0; j < QK8_0; ++j) isum += int(w[i].qs[j]) * int(a[i].qs[j]);
        sum += fp16(w[i].d) * a[i].d * float(isum);
    }
    return sum;
}

float dot_mxfp4_q8a(int64_t n, const void * wv, const void * av) {
    const BlockMXFP4 * w = static_cast<const BlockMXFP4 *>(wv);
    const BlockQ8A * a = static_cast<const BlockQ8A *>(av);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_MXFP4; ++i) {
        int isum = 0;
        for (int j = 0; j < QK_MXFP4 / 2; ++j) {
            isum += kMxfp4Doubled[w[i].qs[j] & 15] * int(a[i].qs[j]);
            isum += kMxfp4Doubled[w[i].qs[j] >> 4] * int(a[i].qs[j + QK_MXFP4 / 2]);
        }
        sum += e8m0_half(w[i].e) * a[i].d * float(isum);
    }
    return sum;
}

// K-quants · Q8_K: Σ d·sc·q·a − dmin·m·a per sub-block; the min term uses the activation's 16-value sums.
float dot_q2_k_q8k(int64_t n, const void * wv, const void * av) {
    const BlockQ2_K * w = static_cast<const BlockQ2_K *>(wv);
    const BlockQ8_K * a = static_cast<const BlockQ8_K *>(av);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; ++i) {
        int isum = 0, msum = 0;
        for (int s = 0; s < 16; ++s) msum += (w[i].scales[s] >> 4) * a[i].bsums[s];
        for (int h = 0; h < 2; ++h)
            for (int g = 0; g < 4; ++g)
                for (int half = 0; half < 2; ++half) {
                    const uint8_t * q = w[i].qs + 32 * h + 16 * half;
                    const int8_t * q8 = a[i].qs + 128 * h + 32 * g + 16 * half;
                    int s = 0;
                    for (int l = 0; l < 16; ++l) s += ((q[l] >> (2 * g)) & 3) * q8[l];
                    isum += (w[i].scales[8 * h + 2 * g + half] & 15) * s;
                }
        sum += a[i].d * fp16(w[i].d) * float(isum) - a[i].d * fp16(w[i].dmin) * float(msum);
    }
    return sum;
}

float dot_q4_k_q8k(int64_t n, const void * wv, const void * av) {
    const BlockQ4_K * w = static_cast<const BlockQ4_K *>(wv);
    const BlockQ8_K * a = static_cast<const BlockQ8_K *>(av);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; ++i) {
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; ++j) {
            int s, m;
            q4k_scale_min(w[i].scales, j, s, m);
            msum += m * (a[i].bsums[2 * j] + a[i].bsums[2 * j + 1]);
            const uint8_t * q = w[i].qs + 32 * (j / 2);
            const int8_t * q8 = a[i].qs + 32 * j;
            const int shift = 4 * (j & 1);
            int t = 0;
            for (int l = 0; l < 32; ++l) t += ((q[l] >> shift) & 15) * q8[l];
            isum += s * t;
        }
        sum += a[i].d * fp16(w[i].d) * float(isum) - a[i].d * fp16(w[i].dmin) * float(msum);
    }
    return sum;
}

// IQ2_XXS · Q8_K: value = d·(2·ls+1)/8 · G · sign, so the integer sum carries (2·ls+1) and the block 1/8.
float dot_iq2_xxs_q8k(int64_t n, const void * wv, const void * av) {
    const BlockIQ2_XXS * w = static_cast<const BlockIQ2_XXS *>(wv);
    const BlockQ8_K * a = static_cast<const BlockQ8_K *>(av);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; ++i) {
        int isum = 0;
        for (int g = 0; g < 8; ++g) {
            const uint32_t idx = load_u32(w[i].qs + 4 * g);
            const uint32_t sgn = load_u32(w[i].qs + 4 * g + 2);
            const int8_t * q8 = a[i].qs + 32 * g;
            int gsum = 0;
            for (int k = 0; k < 4; ++k) {
                const uint64_t grid = kIq2.grid[(idx >> (8 * k)) & 255];
                const uint8_t signs = kIq2.signs[(sgn >> (7 * k)) & 127];
                for (int e = 0; e < 8; ++e) {
                    const int v = int((grid >> (8 * e)) & 255) * q8[8 * k + e];
                    gsum += (signs >> e) & 1 ? -v : v;
                }
            }
            isum += int(2 * (sgn >> 28) + 1) * gsum;
        }
        sum += fp16(w[i].d) * a[i].d * 0.125f * float(isum);
    }
    return sum;
}

// ---------------------------------------------------------------------------------------------------------------------
// Kernel selection
// ---------------------------------------------------------------------------------------------------------------------
using DotF32Fn = float (*)(int64_t, const void *, const float *);
using DotQFn = float (*)(int64_t, const void *, const void *);

struct DotKernels {
    DotF32Fn f32;
    DotQFn q;  // null for float weights (their activations are f32)
};

struct DotEntry {
    int64_t block;
    DotKernels impl[2];  // [0] scalar, [1] AVX2
};

#if DSV4_QUANT_X86
#define DSV4_AVX2(f) quant_detail::avx2::f
#else
#define DSV4_AVX2(f) nullptr
#endif

constexpr DotEntry kDotF32{1, {{dot_f32_f32, nullptr}, {DSV4_AVX2(dot_f32_f32), nullptr}}};
constexpr DotEntry kDotF16{1, {{dot_f16_f32, nullptr}, {DSV4_AVX2(dot_f16_f32), nullptr}}};
constexpr DotEntry kDotBF16{1, {{dot_bf16_f32, nullptr}, {DSV4_AVX2(dot_bf16_f32), nullptr}}};
constexpr DotEntry kDotQ8_0{QK8_0,
                            {{dot_blocks_f32<BlockQ8_0, QK8_0, dequant_q8_0>, dot_q8_0_q8a},
                             {DSV4_AVX2(dot_q8_0_f32), DSV4_AVX2(dot_q8_0_q8a)}}};
constexpr DotEntry kDotQ2_K{QK_K,
                            {{dot_blocks_f32<BlockQ2_K, QK_K, dequant_q2_k>, dot_q2_k_q8k},
                             {DSV4_AVX2(dot_q2_k_f32), DSV4_AVX2(dot_q2_k_q8k)}}};
constexpr DotEntry kDotQ4_K{QK_K,
                            {{dot_blocks_f32<BlockQ4_K, QK_K, dequant_q4_k>, dot_q4_k_q8k},
                             {DSV4_AVX2(dot_q4_k_f32), DSV4_AVX2(dot_q4_k_q8k)}}};
constexpr DotEntry kDotIQ2_XXS{QK_K,
                               {{dot_blocks_f32<BlockIQ2_XXS, QK_K, dequant_iq2_xxs>, dot_iq2_xxs_q8k},
                                {DSV4_AVX2(dot_iq2_xxs_f32), DSV4_AVX2(dot_iq2_xxs_q8k)}}};
constexpr DotEntry kDotMXFP4{QK_MXFP4,
                             {{dot_blocks_f32<BlockMXFP4, QK_MXFP4, dequant_mxfp4>, dot_mxfp4_q8a},
                              {DSV4_AVX2(dot_mxfp4_f32), DSV4_AVX2(dot_mxfp4_q8a)}}};
#undef DSV4_AVX2

// Validates (type, n) and picks the implementation in one step: this runs once per weight row in the matmul,
// so it avoids the general type-table lookup.
DotKernels dot_kernels(GgmlType t, int64_t n, const char * what) {
    const DotEntry * e;
    switch (t) {
        case GgmlType::F32:
            e = &kDotF32;
            break;
        case GgmlType::F16:
            e = &kDotF16;
            break;
        case GgmlType::BF16:
            e = &kDotBF16;
            break;
        case GgmlType::Q8_0:
            e = &kDotQ8_0;
            break;
        case GgmlType::Q2_K:
            e = &kDotQ2_K;
            break;
        case GgmlType::Q4_K:
            e = &kDotQ4_K;
            break;
        case GgmlType::IQ2_XXS:
            e = &kDotIQ2_XXS;
            break;
        case GgmlType::MXFP4:
            e = &kDotMXFP4;
            break;
        default:
            fail("quant {}: weight type {} has no dot product", what, type_name(t));
    }
    if (n < 0 || n % e->block != 0) [[unlikely]]
        fail("quant {}({}): a row of {} values is not a whole number of {}-value blocks", what, type_name(t), n,
             e->block);
    return e->impl[use_avx2() ? 1 : 0];
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Element formats
// ---------------------------------------------------------------------------------------------------------------------
float e4m3_to_f32(uint8_t bits) {
    const uint32_t sign = uint32_t(bits & 0x80) << 24;
    const uint32_t exp = (bits >> 3) & 15, man = bits & 7;
    if (exp == 15 && man == 7) return f32_from_bits(sign | 0x7fc00000u);
    if (exp == 0) return f32_from_bits(sign | f32_bits(float(man) * (1.0f / 512.0f)));  // man·2^-9
    return f32_from_bits(sign | (exp + 120) << 23 | man << 20);
}

uint8_t f32_to_e4m3(float x) {
    const uint32_t b = f32_bits(x);
    const uint8_t sign = uint8_t((b >> 24) & 0x80);
    const uint32_t a = b & 0x7fffffff;
    if (a > 0x7f800000u) return sign | 0x7f;   // NaN
    if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448 (and inf) saturates to 448
    // Below 2^-6 the steps are 2^-9 (subnormals); rounding up to 8 lands on the smallest normal, code 0x08.
    if (a < 0x3c800000u) return sign | uint8_t(nearest_int(f32_from_bits(a) * 512.0f));
    // Keep 3 mantissa bits, nearest even. A carry out of the mantissa increments the exponent field, which is
    // the next code, so the packed code can be rounded as an integer.
    uint32_t code = ((a >> 23) - 120) << 3 | ((a >> 20) & 7);
    const uint32_t rem = a & 0xfffff;
    if (rem > 0x80000 || (rem == 0x80000 && (code & 1))) ++code;
    return sign | uint8_t(code);
}

float e8m0_to_f32(uint8_t bits) {
    if (bits == 0) return f32_from_bits(0x00400000u);    // 2^-127, subnormal
    if (bits == 255) return f32_from_bits(0x7fc00000u);  // the E8M0 NaN code
    return f32_from_bits(uint32_t(bits) << 23);
}

float e2m1_to_f32(uint8_t code) {
    static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = kMagnitude[code & 7];
    return code & 8 ? -v : v;
}

uint8_t f32_to_e2m1(float x) {
    const float a = std::fabs(x);
    if (a != a) return 0;
    const uint8_t sign = std::signbit(x) ? 8 : 0;
    // Count the midpoints below a. Midpoint k lies between codes k and k+1; a tie stays on the even one, so
    // passing needs a > mid after an even code and a >= mid after an odd one.
    static constexpr float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    uint8_t code = 0;
    for (int k = 0; k < 7; ++k) code += (k & 1) ? (a >= kMid[k]) : (a > kMid[k]);
    return sign | code;
}

int ceil_log2_exact(float x) {
    if (!(x > 0.0f)) fail("ceil_log2_exact: x = {} is not positive", x);
    const uint32_t b = f32_bits(x);
    const int exp = int(b >> 23);
    const uint32_t man = b & 0x7fffff;
    if (exp == 0) return int(std::bit_width(man - 1)) - 149;  // subnormal: x = man·2^-149
    return exp - 127 + (man != 0 ? 1 : 0);
}

namespace {

void check_block(int64_t n, int64_t block, const char * what) {
    if (block <= 0 || n < 0 || n % block != 0)
        fail("{}: a row of {} values is not a whole number of blocks of {}", what, n, block);
}

// Shared body of the two round trips: per block, the power-of-two scale from amax·(1/qmax) (the official
// kernels multiply by the f32 reciprocal rather than divide), then code and decode every value.
template <uint8_t (*kEncode)(float), float (*kDecode)(uint8_t)>
void roundtrip(float * x, int64_t n, int64_t block, float amax_floor, float inv_qmax) {
    for (int64_t b = 0; b < n; b += block) {
        float amax = 0.0f;
        for (int64_t j = 0; j < block; ++j) amax = std::max(amax, std::fabs(x[b + j]));  // NaN ignored
        amax = std::max(amax, amax_floor);
        // An infinite amax would give 2^128; clamping keeps the scale finite and inputs saturate instead.
        const float s = pow2(std::min(ceil_log2_exact(amax * inv_qmax), 127));
        for (int64_t j = 0; j < block; ++j) x[b + j] = s * kDecode(kEncode(x[b + j] / s));
    }
}

}  // namespace

void fp8_roundtrip(float * x, int64_t n, int64_t block) {
    check_block(n, block, "fp8_roundtrip");
    roundtrip<f32_to_e4m3, e4m3_to_f32>(x, n, block, 1e-4f, 1.0f / 448.0f);
}

void fp4_roundtrip(float * x, int64_t n, int64_t block) {
    check_block(n, block, "fp4_roundtrip");
    roundtrip<f32_to_e2m1, e2m1_to_f32>(x, n, block, 6.0f * std::numeric_limits<float>::min(), 1.0f / 6.0f);
}

void hadamard_inplace(float * x, int64_t n) {
    if (n <= 0 || (n & (n - 1)) != 0) fail("hadamard_inplace: n = {} is not a power of two", n);
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; ++j) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float scale = float(1.0 / std::sqrt(double(n)));
    for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

// ---------------------------------------------------------------------------------------------------------------------
// Public conversions
// ---------------------------------------------------------------------------------------------------------------------
void dequantize_row(GgmlType type, const void * src, float * dst, int64_t n) {
    const int64_t nb = check_row(type, n, "dequantize_row");
    switch (type) {
        case GgmlType::F32:
            std::memcpy(dst, src, size_t(n) * sizeof(float));
            break;
        case GgmlType::F16:
            f16_row_to_f32(static_cast<const uint16_t *>(src), dst, n);
            break;
        case GgmlType::BF16:
            bf16_row_to_f32(static_cast<const uint16_t *>(src), dst, n);
            break;
        case GgmlType::Q8_0:
            dequant_q8_0(static_cast<const BlockQ8_0 *>(src), dst, nb);
            break;
        case GgmlType::Q8_K:
            dequant_q8_k(static_cast<const BlockQ8_K *>(src), dst, nb);
            break;
        case GgmlType::Q2_K:
            dequant_q2_k(static_cast<const BlockQ2_K *>(src), dst, nb);
            break;
        case GgmlType::Q4_K:
            dequant_q4_k(static_cast<const BlockQ4_K *>(src), dst, nb);
            break;
        case GgmlType::IQ2_XXS:
            dequant_iq2_xxs(static_cast<const BlockIQ2_XXS *>(src), dst, nb);
            break;
        case GgmlType::MXFP4:
            dequant_mxfp4(static_cast<const BlockMXFP4 *>(src), dst, nb);
            break;
        default:
            break;  // rejected by check_row
    }
}

void quantize_row(GgmlType type, const float * src, void * dst, int64_t n, const float * importance) {
    const int64_t nb = check_row(type, n, "quantize_row");
    switch (type) {
        case GgmlType::F32:
            std::memcpy(dst, src, size_t(n) * sizeof(float));
            break;
        case GgmlType::F16: {
            uint16_t * d = static_cast<uint16_t *>(dst);
#if DSV4_QUANT_X86
            if (use_avx2()) {
                quant_detail::avx2::f32_to_f16(src, d, n);
                break;
            }
#endif
            for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
            break;
        }
        case GgmlType::BF16: {
            uint16_t * d = static_cast<uint16_t *>(dst);
#if DSV4_QUANT_X86
            if (use_avx2()) {
                quant_detail::avx2::f32_to_bf16(src, d, n);
                break;
            }
#endif
            for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
            break;
        }
        case GgmlType::Q8_0:
            quantize_q8_0(src, static_cast<BlockQ8_0 *>(dst), nb);
            break;
        case GgmlType::Q8_K:
            quantize_q8_k(src, static_cast<BlockQ8_K *>(dst), nb);
            break;
        case GgmlType::Q2_K:
            quantize_q2_k(src, static_cast<BlockQ2_K *>(dst), nb, importance);
            break;
        case GgmlType::Q4_K:
            quantize_q4_k(src, static_cast<BlockQ4_K *>(dst), nb, importance);
            break;
        case GgmlType::IQ2_XXS:
            quantize_iq2_xxs(src, static_cast<BlockIQ2_XXS *>(dst), nb, importance);
            break;
        case GgmlType::MXFP4:
            quantize_mxfp4(src, static_cast<BlockMXFP4 *>(dst), nb, importance);
            break;
        default:
            break;
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Public dot products
// ---------------------------------------------------------------------------------------------------------------------
GgmlType dot_type(GgmlType weight) {
    switch (weight) {
        case GgmlType::F32:
        case GgmlType::F16:
        case GgmlType::BF16:
            return GgmlType::F32;
        case GgmlType::Q8_0:
        case GgmlType::MXFP4:
            return GgmlType::Q8_0;  // BlockQ8A
        case GgmlType::Q2_K:
        case GgmlType::Q4_K:
        case GgmlType::IQ2_XXS:
            return GgmlType::Q8_K;
        default:
            fail("quant dot_type: weight type {} has no dot product", type_name(weight));
    }
}

size_t dot_row_bytes(GgmlType weight, int64_t n) {
    const GgmlType act = dot_type(weight);
    const int64_t nb = check_row(weight, n, "dot_row_bytes");
    if (act == GgmlType::F32) return size_t(n) * sizeof(float);
    if (act == GgmlType::Q8_0) return size_t(nb) * sizeof(BlockQ8A);
    return size_t(nb) * sizeof(BlockQ8_K);
}

void quantize_activations(GgmlType weight, const float * x, void * dst, int64_t n) {
    const GgmlType act = dot_type(weight);
    const int64_t nb = check_row(weight, n, "quantize_activations");
    if (act == GgmlType::F32)
        std::memcpy(dst, x, size_t(n) * sizeof(float));
    else if (act == GgmlType::Q8_0)
        quantize_q8a(x, static_cast<BlockQ8A *>(dst), nb);
    else
        quantize_q8_k(x, static_cast<BlockQ8_K *>(dst), nb);
}

float vec_dot_f32(GgmlType weight, int64_t n, const void * w_row, const float * x) {
    return dot_kernels(weight, n, "vec_dot_f32").f32(n, w_row, x);
}

float vec_dot(GgmlType weight, int64_t n, const void * w_row, const void * act) {
    const DotKernels k = dot_kernels(weight, n, "vec_dot");
    return k.q ? k.q(n, w_row, act) : k.f32(n, w_row, static_cast<const float *>(act));
}

void vec_dot_rows(GgmlType weight, int64_t n, const void * w_rows, size_t w_stride, int n_rows, const void * act,
                  float * out) {
    const DotKernels k = dot_kernels(weight, n, "vec_dot_rows");
    if (n_rows < 0) fail("quant vec_dot_rows: n_rows = {} is negative", n_rows);
    const uint8_t * w = static_cast<const uint8_t *>(w_rows);
    for (int r = 0; r < n_rows; ++r) {
        const void * row = w + r * w_stride;
        out[r] = k.q ? k.q(n, row, act) : k.f32(n, row, static_cast<const float *>(act));
    }
}

const char * quant_simd_name() { return use_avx2() ? "avx2" : "scalar"; }

void quant_force_scalar(bool on) { g_force_scalar.store(on, std::memory_order_relaxed); }

}  // namespace dsv4
