// AVX2/FMA/F16C kernels for format/quant (this file alone is compiled with -mavx2 -mfma -mf16c; quant.cpp calls
// it only when the CPU has all three). Every helper lives in an anonymous namespace and nothing from a shared
// header with inline code is called, so no AVX2 instance of a shared inline function can reach the link.
//
// Integer dot products use the unsigned·signed byte multiply (vpmaddubsw): the weight side is made unsigned
// (Q2_K/Q4_K codes and IQ2 grid magnitudes already are; Q8_0 and MXFP4 move their sign onto the activation),
// the 16-bit pair sums cannot saturate for these ranges, and vpmaddwd widens to 32 bits while applying 16-bit
// scales. Kernels keep two to four independent accumulators so consecutive blocks do not serialize on one
// add chain, and name each one: GCC keeps an indexed accumulator array (acc[i & 1]) on the stack, which cost
// up to 20 % through store forwarding.
#include "format/quant_impl.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstring>

namespace dsv4::quant_detail::avx2 {

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float f16(uint16_t h) { return _cvtsh_ss(h); }

inline uint32_t load_u32(const void * p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

inline __m256i loadu256(const void * p) { return _mm256_loadu_si256(static_cast<const __m256i *>(p)); }
inline __m128i loadu128(const void * p) { return _mm_loadu_si128(static_cast<const __m128i *>(p)); }

// 8 i32 lanes, each the sum of 4 products w·a of signed bytes. |w| is at most 128 and |a| at most 127
// (activations never hold -128), so a pair of products fits the 16-bit intermediate.
inline __m256i dot_i8(__m256i w, __m256i a) {
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

// 2^(e-128), the MXFP4 block scale for the doubled value table.
inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// 32 MXFP4 values as i8: low nibbles are elements 0-15, high nibbles 16-31.
inline __m256i mxfp4_values(const uint8_t * qs, __m256i table) {
    const __m128i q = loadu128(qs);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    return _mm256_shuffle_epi8(table, nib);
}

// The low 8 bytes of a vector as 8 f32 lanes (signed / unsigned bytes).
inline __m256 i8x8_to_ps(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }
inline __m256 u8x8_to_ps(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

inline uint16_t bf16_round(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40);
    x += 0x7fff + ((x >> 16) & 1);
    return uint16_t(x >> 16);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Float weights · f32
// ---------------------------------------------------------------------------------------------------------------------
namespace {

// Four accumulators over 32 values per step, then single vectors, then a scalar tail.
template <typename Load>
inline float dot_float(int64_t n, const float * x, Load load8, float (*load1)(const void *, int64_t), const void * w) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(load8(i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(load8(i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(load8(i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(load8(i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(i), _mm256_loadu_ps(x + i), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; ++i) s += load1(w, i) * x[i];
    return s;
}

float load1_f32(const void * w, int64_t i) { return static_cast<const float *>(w)[i]; }
float load1_f16(const void * w, int64_t i) { return f16(static_cast<const uint16_t *>(w)[i]); }
float load1_bf16(const void * w, int64_t i) {
    const uint32_t bits = uint32_t(static_cast<const uint16_t *>(w)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace

float dot_f32_f32(int64_t n, const void * w, const float * x) {
    const float * p = static_cast<const float *>(w);
    return dot_float(
        n, x, [p](int64_t i) { return _mm256_loadu_ps(p + i); }, load1_f32, w);
}

float dot_f16_f32(int64_t n, const void * w, const float * x) {
    const uint16_t * p = static_cast<const uint16_t *>(w);
    return dot_float(
        n, x, [p](int64_t i) { return _mm256_cvtph_ps(loadu128(p + i)); }, load1_f16, w);
}

float dot_bf16_f32(int64_t n, const void * w, const float * x) {
    const uint16_t * p = static_cast<const uint16_t *>(w);
    auto load8 = [p](int64_t i) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(loadu128(p + i)), 16));
    };
    return dot_float(n, x, load8, load1_bf16, w);
}

// ---------------------------------------------------------------------------------------------------------------------
// Quantized weights · f32 (decode to f32 in registers; per-sub-block sums are scaled once)
// ---------------------------------------------------------------------------------------------------------------------
namespace {

// Σ q·x over one block of 32 i8 values (8 lanes), before the block scale.
inline __m256 i8x32_dot(__m128i lo, __m128i hi, const float * x) {
    __m256 s = _mm256_mul_ps(i8x8_to_ps(lo), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(i8x8_to_ps(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(i8x8_to_ps(hi), _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(i8x8_to_ps(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + 24), s);
}

inline __m256 q8_0_block_f32(const BlockQ8_0 & b, const float * x) {
    return _mm256_mul_ps(_mm256_set1_ps(f16(b.d)), i8x32_dot(loadu128(b.qs), loadu128(b.qs + 16), x));
}

inline __m256 mxfp4_block_f32(const BlockMXFP4 & b, __m256i table, const float * x) {
    const __m256i v = mxfp4_values(b.qs, table);
    const __m256 s = i8x32_dot(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1), x);
    return _mm256_mul_ps(_mm256_set1_ps(e8m0_half(b.e)), s);
}

}  // namespace

float dot_q8_0_f32(int64_t n, const void * wv, const float * x) {
    const BlockQ8_0 * w = static_cast<const BlockQ8_0 *>(wv);
    const int64_t nb = n / QK8_0;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        acc0 = _mm256_add_ps(acc0, q8_0_block_f32(w[i], x + QK8_0 * i));
        acc1 = _mm256_add_ps(acc1, q8_0_block_f32(w[i + 1], x + QK8_0 * (i + 1)));
    }
    if (i < nb) acc0 = _mm256_add_ps(acc0, q8_0_block_f32(w[i], x + QK8_0 * i));
    return hsum(_mm256_add_ps(acc0, acc1));
}

float dot_mxfp4_f32(int64_t n, const void * wv, const float * x) {
    const BlockMXFP4 * w = static_cast<const BlockMXFP4 *>(wv);
    const int64_t nb = n / QK_MXFP4;
    const __m256i table = _mm256_broadcastsi128_si256(loadu128(kMxfp4Doubled));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        acc0 = _mm256_add_ps(acc0, mxfp4_block_f32(w[i], table, x + QK_MXFP4 * i));
        acc1 = _mm256_add_ps(acc1, mxfp4_block_f32(w[i + 1], table, x + QK_MXFP4 * (i + 1)));
    }
    if (i < nb) acc0 = _mm256_add_ps(acc0, mxfp4_block_f32(w[i], table, x + QK_MXFP4 * i));
    return hsum(_mm256_add_ps(acc0, acc1));
}

// Q2_K: per sub-block of 16, Σ (dl·q − ml)·x = dl·Σ q·x − ml·Σ x.
float dot_q2_k_f32(int64_t n, const void * wv, const float * x) {
    const BlockQ2_K * w = static_cast<const BlockQ2_K *>(wv);
    const int64_t nb = n / QK_K;
    const __m128i m3 = _mm_set1_epi8(3);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        const float d = f16(w[i].d), dmin = f16(w[i].dmin);
        for (int h = 0; h < 2; ++h)
            for (int half = 0; half < 2; ++half) {
                const __m128i bytes = loadu128(w[i].qs + 32 * h + 16 * half);
                for (int g = 0; g < 4; ++g) {
                    const __m128i q = _mm_and_si128(_mm_srl_epi16(bytes, _mm_cvtsi32_si128(2 * g)), m3);
                    const float * xs = x + 128 * h + 32 * g + 16 * half;
                    const __m256 x0 = _mm256_loadu_ps(xs), x1 = _mm256_loadu_ps(xs + 8);
                    const __m256 qx =
                        _mm256_fmadd_ps(u8x8_to_ps(q), x0, _mm256_mul_ps(u8x8_to_ps(_mm_srli_si128(q, 8)), x1));
                    const uint8_t sc = w[i].scales[8 * h + 2 * g + half];
                    __m256 & a = acc[g & 1];
                    a = _mm256_fmadd_ps(_mm256_set1_ps(d * float(sc & 15)), qx, a);
                    a = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * float(sc >> 4)), _mm256_add_ps(x0, x1), a);
                }
            }
    }
    return hsum(_mm256_add_ps(acc[0], acc[1]));
}

float dot_q4_k_f32(int64_t n, const void * wv, const float * x) {
    const BlockQ4_K * w = static_cast<const BlockQ4_K *>(wv);
    const int64_t nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        const float d = f16(w[i].d), dmin = f16(w[i].dmin);
        const uint8_t * sc = w[i].scales;
        for (int p = 0; p < 4; ++p) {
            const __m256i bytes = loadu256(w[i].qs + 32 * p);
            for (int half = 0; half < 2; ++half) {
                const int j = 2 * p + half;
                const int s = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
                const int m = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
                const __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(bytes, 4) : bytes, m4);
                const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
                const float * xs = x + 32 * j;
                const __m256 x0 = _mm256_loadu_ps(xs), x1 = _mm256_loadu_ps(xs + 8);
                const __m256 x2 = _mm256_loadu_ps(xs + 16), x3 = _mm256_loadu_ps(xs + 24);
                __m256 qx = _mm256_mul_ps(u8x8_to_ps(lo), x0);
                qx = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(lo, 8)), x1, qx);
                qx = _mm256_fmadd_ps(u8x8_to_ps(hi), x2, qx);
                qx = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(hi, 8)), x3, qx);
                const __m256 xsum = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
                __m256 & a = acc[half];
                a = _mm256_fmadd_ps(_mm256_set1_ps(d * float(s)), qx, a);
                a = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * float(m)), xsum, a);
            }
        }
    }
    return hsum(_mm256_add_ps(acc[0], acc[1]));
}

namespace {

// One IQ2_XXS group (32 values) · x, scaled by the group's db.
inline __m256 iq2_xxs_group_f32(const BlockIQ2_XXS & w, float d, int g, const float * x) {
    const __m256i sign_bit = _mm256_set1_epi32(int(0x80000000u));
    const uint8_t * gi = reinterpret_cast<const uint8_t *>(w.qs + 4 * g);
    const uint32_t sgn = load_u32(w.qs + 4 * g + 2);
    __m256 s = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
        const __m128i grid = _mm_cvtsi64_si128(int64_t(kIq2.grid[gi[k]]));
        const __m128i pm1 = _mm_cvtsi64_si128(int64_t(kIq2.sign_pm1[(sgn >> (7 * k)) & 127]));
        const __m256i flip = _mm256_and_si256(_mm256_cvtepi8_epi32(pm1), sign_bit);  // -1 → sign bit
        const __m256 v = _mm256_xor_ps(u8x8_to_ps(grid), _mm256_castsi256_ps(flip));
        s = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + 8 * k), s);
    }
    return _mm256_mul_ps(_mm256_set1_ps(d * (0.5f + float(sgn >> 28)) * 0.25f), s);
}

}  // namespace

float dot_iq2_xxs_f32(int64_t n, const void * wv, const float * x) {
    const BlockIQ2_XXS * w = static_cast<const BlockIQ2_XXS *>(wv);
    const int64_t nb = n / QK_K;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        const float d = f16(w[i].d);
        for (int g = 0; g < 8; g += 2) {
            acc0 = _mm256_add_ps(acc0, iq2_xxs_group_f32(w[i], d, g, x + 32 * g));
            acc1 = _mm256_add_ps(acc1, iq2_xxs_group_f32(w[i], d, g + 1, x + 32 * (g + 1)));
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

// ---------------------------------------------------------------------------------------------------------------------
// Quantized weights · quantized activations
// ---------------------------------------------------------------------------------------------------------------------
float dot_q8_0_q8a(int64_t n, const void * wv, const void * av) {
    const BlockQ8_0 * w = static_cast<const BlockQ8_0 *>(wv);
    const BlockQ8A * a = static_cast<const BlockQ8A *>(av);
    const int64_t nb = n / QK8_0;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        const __m256i p0 = dot_i8(loadu256(w[i].qs), loadu256(a[i].qs));
        const __m256i p1 = dot_i8(loadu256(w[i + 1].qs), loadu256(a[i + 1].qs));
        const __m256i p2 = dot_i8(loadu256(w[i + 2].qs), loadu256(a[i + 2].qs));
        const __m256i p3 = dot_i8(loadu256(w[i + 3].qs), loadu256(a[i + 3].qs));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(f16(w[i].d) * a[i].d), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(f16(w[i + 1].d) * a[i + 1].d), _mm256_cvtepi32_ps(p1), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_set1_ps(f16(w[i + 2].d) * a[i + 2].d), _mm256_cvtepi32_ps(p2), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_set1_ps(f16(w[i + 3].d) * a[i + 3].d), _mm256_cvtepi32_ps(p3), acc3);
    }
    for (; i < nb; ++i) {
        const __m256i p = dot_i8(loadu256(w[i].qs), loadu256(a[i].qs));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(f16(w[i].d) * a[i].d), _mm256_cvtepi32_ps(p), acc0);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
}

float dot_mxfp4_q8a(int64_t n, const void * wv, const void * av) {
    const BlockMXFP4 * w = static_cast<const BlockMXFP4 *>(wv);
    const BlockQ8A * a = static_cast<const BlockQ8A *>(av);
    const int64_t nb = n / QK_MXFP4;
    const __m256i table = _mm256_broadcastsi128_si256(loadu128(kMxfp4Doubled));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const __m256i p0 = dot_i8(mxfp4_values(w[i].qs, table), loadu256(a[i].qs));
        const __m256i p1 = dot_i8(mxfp4_values(w[i + 1].qs, table), loadu256(a[i + 1].qs));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(e8m0_half(w[i].e) * a[i].d), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(e8m0_half(w[i + 1].e) * a[i + 1].d), _mm256_cvtepi32_ps(p1), acc1);
    }
    for (; i < nb; ++i) {
        const __m256i p = dot_i8(mxfp4_values(w[i].qs, table), loadu256(a[i].qs));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(e8m0_half(w[i].e) * a[i].d), _mm256_cvtepi32_ps(p), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

// Q2_K · Q8_K. For each 32 activations 128h + 32g + (0..31), the codes are bits 2g of the 32 bytes
// qs[32h ..]; vpmaddubsw gives 16 pair sums whose low half belongs to sub-block 8h + 2g and high half to
// 8h + 2g + 1, so a byte shuffle that broadcasts those two 4-bit scales (as 16-bit lanes) feeds vpmaddwd.
float dot_q2_k_q8k(int64_t n, const void * wv, const void * av) {
    const BlockQ2_K * w = static_cast<const BlockQ2_K *>(wv);
    const BlockQ8_K * a = static_cast<const BlockQ8_K *>(av);
    const int64_t nb = n / QK_K;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    // Shuffle controls: low 128 bits pick byte s (scale of the first 16), high 128 bits byte s + 1; the 0x80
    // bytes zero the upper half of each 16-bit lane.
    __m256i pick[8];
    for (int s = 0; s < 8; ++s)
        pick[s] =
            _mm256_set_m128i(_mm_set1_epi16(short(0x8000 | (2 * s + 1))), _mm_set1_epi16(short(0x8000 | (2 * s))));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t i = 0; i < nb; ++i) {
        const __m128i raw = loadu128(w[i].scales);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_and_si128(raw, m4));
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
        const __m256i msum = _mm256_madd_epi16(mins, loadu256(a[i].bsums));
        const int8_t * q8 = a[i].qs;
        __m256i isum0 = _mm256_setzero_si256(), isum1 = isum0;
        for (int h = 0; h < 2; ++h) {
            const __m256i q = loadu256(w[i].qs + 32 * h);
            const __m256i q0 = _mm256_and_si256(q, m3);
            const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(q, 2), m3);
            const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(q, 4), m3);
            const __m256i q3 = _mm256_and_si256(_mm256_srli_epi16(q, 6), m3);
            const __m256i p0 = _mm256_maddubs_epi16(q0, loadu256(q8 + 128 * h));
            const __m256i p1 = _mm256_maddubs_epi16(q1, loadu256(q8 + 128 * h + 32));
            const __m256i p2 = _mm256_maddubs_epi16(q2, loadu256(q8 + 128 * h + 64));
            const __m256i p3 = _mm256_maddubs_epi16(q3, loadu256(q8 + 128 * h + 96));
            isum0 = _mm256_add_epi32(isum0, _mm256_madd_epi16(p0, _mm256_shuffle_epi8(scales, pick[4 * h])));
            isum1 = _mm256_add_epi32(isum1, _mm256_madd_epi16(p1, _mm256_shuffle_epi8(scales, pick[4 * h + 1])));
            isum0 = _mm256_add_epi32(isum0, _mm256_madd_epi16(p2, _mm256_shuffle_epi8(scales, pick[4 * h + 2])));
            isum1 = _mm256_add_epi32(isum1, _mm256_madd_epi16(p3, _mm256_shuffle_epi8(scales, pick[4 * h + 3])));
        }
        const float dall = a[i].d * f16(w[i].d), dmin = a[i].d * f16(w[i].dmin);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dall), _mm256_cvtepi32_ps(_mm256_add_epi32(isum0, isum1)), acc0);
        acc1 = _mm256_fnmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(msum), acc1);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

// Q4_K · Q8_K: 32 bytes of codes hold sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles).
float dot_q4_k_q8k(int64_t n, const void * wv, const void * av) {
    const BlockQ4_K * w = static_cast<const BlockQ4_K *>(wv);
    const BlockQ8_K * a = static_cast<const BlockQ8_K *>(av);
    const int64_t nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t i = 0; i < nb; ++i) {
        // Unpack the 6-bit scales and mins: bytes 0-3 / 4-7 carry sub-blocks 0-3 in their low 6 bits and the
        // top 2 bits of sub-blocks 4-7; bytes 8-11 carry the low 4 bits of sub-blocks 4-7.
        uint32_t u[3];
        std::memcpy(u, w[i].scales, 12);
        const uint32_t k6 = 0x3f3f3f3fu, k4 = 0x0f0f0f0fu, k2 = 0xc0c0c0c0u;
        const uint32_t sc_lo = u[0] & k6, mn_lo = u[1] & k6;
        const uint32_t sc_hi = (u[2] & k4) | ((u[0] & k2) >> 2);
        const uint32_t mn_hi = ((u[2] >> 4) & k4) | ((u[1] & k2) >> 2);
        const __m128i sc8 = _mm_set_epi32(0, 0, int(sc_hi), int(sc_lo));
        const __m128i mn8 = _mm_set_epi32(0, 0, int(mn_hi), int(mn_lo));
        // Mins against the bsums: each 32-value sub-block owns two 16-value sums.
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
        const __m256i msum = _mm256_madd_epi16(mins, loadu256(a[i].bsums));
        // Scales as 16-bit lanes, broadcast per sub-block below.
        const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc8));
        const int8_t * q8 = a[i].qs;
        __m256i isum0 = _mm256_setzero_si256(), isum1 = isum0;
        for (int p = 0; p < 4; ++p) {
            const __m256i q = loadu256(w[i].qs + 32 * p);
            const __m256i lo = _mm256_and_si256(q, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            const __m256i plo = _mm256_maddubs_epi16(lo, loadu256(q8 + 64 * p));
            const __m256i phi = _mm256_maddubs_epi16(hi, loadu256(q8 + 64 * p + 32));
            const __m256i slo = _mm256_shuffle_epi8(scales16, _mm256_set1_epi16(short(0x0100 + 0x0202 * (2 * p))));
            const __m256i shi = _mm256_shuffle_epi8(scales16, _mm256_set1_epi16(short(0x0100 + 0x0202 * (2 * p + 1))));
            isum0 = _mm256_add_epi32(isum0, _mm256_madd_epi16(plo, slo));
            isum1 = _mm256_add_epi32(isum1, _mm256_madd_epi16(phi, shi));
        }
        const float dall = a[i].d * f16(w[i].d), dmin = a[i].d * f16(w[i].dmin);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dall), _mm256_cvtepi32_ps(_mm256_add_epi32(isum0, isum1)), acc0);
        acc1 = _mm256_fnmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(msum), acc1);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

// IQ2_XXS · Q8_K: the four 8-byte grid points of a group form one 32-byte vector of magnitudes; their ±1
// signs move onto the activations (vpsignb), and the group's 2·ls + 1 multiplies in vpmaddwd. The 1/8 and both
// d's are applied once per block.
namespace {

// i32 partial sums of group g (32 values) of an IQ2_XXS block against its activations.
inline __m256i iq2_xxs_group(const BlockIQ2_XXS & w, const int8_t * q8, int g) {
    const uint64_t * grid = kIq2.grid;
    const uint64_t * sign = kIq2.sign_pm1;
    // The grid indices are plain bytes: load them directly rather than shifting them out of a word.
    const uint8_t * gi = reinterpret_cast<const uint8_t *>(w.qs + 4 * g);
    const uint32_t sgn = load_u32(w.qs + 4 * g + 2);
    const __m256i gv =
        _mm256_set_epi64x(int64_t(grid[gi[3]]), int64_t(grid[gi[2]]), int64_t(grid[gi[1]]), int64_t(grid[gi[0]]));
    const __m256i sv = _mm256_set_epi64x(int64_t(sign[(sgn >> 21) & 127]), int64_t(sign[(sgn >> 14) & 127]),
                                         int64_t(sign[(sgn >> 7) & 127]), int64_t(sign[sgn & 127]));
    const __m256i p16 = _mm256_maddubs_epi16(gv, _mm256_sign_epi8(loadu256(q8 + 32 * g), sv));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(short(2 * (sgn >> 28) + 1)));
}

}  // namespace

float dot_iq2_xxs_q8k(int64_t n, const void * wv, const void * av) {
    const BlockIQ2_XXS * w = static_cast<const BlockIQ2_XXS *>(wv);
    const BlockQ8_K * a = static_cast<const BlockQ8_K *>(av);
    const int64_t nb = n / QK_K;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
        // Two groups per step into two named accumulators (see the top of the file).
        __m256i isum0 = _mm256_setzero_si256(), isum1 = isum0;
        for (int g = 0; g < 8; g += 2) {
            isum0 = _mm256_add_epi32(isum0, iq2_xxs_group(w[i], a[i].qs, g));
            isum1 = _mm256_add_epi32(isum1, iq2_xxs_group(w[i], a[i].qs, g + 1));
        }
        const __m256 s = _mm256_cvtepi32_ps(_mm256_add_epi32(isum0, isum1));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w[i].d) * a[i].d * 0.125f), s, acc);
    }
    return hsum(acc);
}

// ---------------------------------------------------------------------------------------------------------------------
// Row conversions
// ---------------------------------------------------------------------------------------------------------------------
void f16_to_f32(const uint16_t * src, float * dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(loadu128(src + i)));
        _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(loadu128(src + i + 8)));
    }
    for (; i < n; ++i) dst[i] = f16(src[i]);
}

void f32_to_f16(const float * src, uint16_t * dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

void bf16_to_f32(const uint16_t * src, float * dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + i),
                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(loadu128(src + i)), 16));
    for (; i < n; ++i) {
        const uint32_t bits = uint32_t(src[i]) << 16;
        std::memcpy(dst + i, &bits, 4);
    }
}

void f32_to_bf16(const float * src, uint16_t * dst, int64_t n) {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    auto round8 = [&](const float * p) {
        const __m256i x = _mm256_castps_si256(_mm256_loadu_ps(p));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
        const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, bias), lsb), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
        return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(x, 16), quiet), nan);
    };
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        // packus works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7]; the permute restores a0-7 b0-7.
        const __m256i packed = _mm256_packus_epi32(round8(src + i), round8(src + i + 8));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + i), _mm256_permute4x64_epi64(packed, 0xd8));
    }
    for (; i < n; ++i) dst[i] = bf16_round(src[i]);
}

// ---------------------------------------------------------------------------------------------------------------------
// Activation quantizers (bit-identical to the scalar ones: same division / multiplication, nearest-even)
// ---------------------------------------------------------------------------------------------------------------------
namespace {

inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// 32 floats → 32 saturated i8, in order (the packs interleave per 128-bit lane; the permute undoes it).
inline __m256i round_pack32(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(v0, kMode));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(v1, kMode));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(v2, kMode));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(v3, kMode));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

}  // namespace

void quantize_q8a(const float * x, BlockQ8A * y, int64_t n) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < n / QK8_0; ++i, x += QK8_0) {
        const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, abs_mask), _mm256_and_ps(v1, abs_mask)),
                                       _mm256_max_ps(_mm256_and_ps(v2, abs_mask), _mm256_and_ps(v3, abs_mask)));
        const float d = hmax(m) / 127.0f;
        y[i].d = d;
        if (d == 0.0f) {
            std::memset(y[i].qs, 0, QK8_0);
            continue;
        }
        const __m256 dv = _mm256_set1_ps(d);
        const __m256i q =
            round_pack32(_mm256_div_ps(v0, dv), _mm256_div_ps(v1, dv), _mm256_div_ps(v2, dv), _mm256_div_ps(v3, dv));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(y[i].qs), _mm256_max_epi8(q, _mm256_set1_epi8(-127)));
    }
}

void quantize_q8_k(const float * x, BlockQ8_K * y, int64_t n) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < n / QK_K; ++i, x += QK_K) {
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask));
        const float amax = hmax(m);
        if (amax == 0.0f) {
            std::memset(&y[i], 0, sizeof(BlockQ8_K));
            continue;
        }
        // The scale follows the first element of largest magnitude, with its sign.
        float max = 0.0f;
        const __m256 am = _mm256_set1_ps(amax);
        for (int j = 0; j < QK_K; j += 8) {
            const int hit =
                _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask), am, _CMP_EQ_OQ));
            if (hit) {
                max = x[j + __builtin_ctz(unsigned(hit))];
                break;
            }
        }
        const float iscale = -127.0f / max;
        const __m256 is = _mm256_set1_ps(iscale);
        for (int j = 0; j < QK_K; j += 32) {
            const __m256i q = round_pack32(
                _mm256_mul_ps(is, _mm256_loadu_ps(x + j)), _mm256_mul_ps(is, _mm256_loadu_ps(x + j + 8)),
                _mm256_mul_ps(is, _mm256_loadu_ps(x + j + 16)), _mm256_mul_ps(is, _mm256_loadu_ps(x + j + 24)));
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(y[i].qs + j), q);
            // Sums of each 16 codes: widen to i16, pairwise-add to i32, then fold within each 128-bit half.
            const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
            const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
            const __m256i s = _mm256_hadd_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi16(1)),
                                                _mm256_madd_epi16(hi, _mm256_set1_epi16(1)));
            // Per 128-bit half, s holds 4-code sums: low half codes 0-3, 4-7, 16-19, 20-23; high half 8-11,
            // 12-15, 24-27, 28-31. Adding the halves leaves two partial sums per group of 16.
            const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            y[i].bsums[j / 16] = int16_t(_mm_extract_epi32(t, 0) + _mm_extract_epi32(t, 1));
            y[i].bsums[j / 16 + 1] = int16_t(_mm_extract_epi32(t, 2) + _mm_extract_epi32(t, 3));
        }
        y[i].d = 1.0f / iscale;
    }
}

}  // namespace dsv4::quant_detail::avx2

#endif
