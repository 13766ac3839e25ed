// Quantization block formats: dequantize, quantize (from f32) and CPU dot products, plus the FP8/FP4
// round trips that DeepSeek's official numerics apply to activations.
//
// Weight formats (ggml-compatible blocks, ../shared/docs/formats-spec.md §2): F32, F16, BF16, Q8_0, Q2_K,
// Q4_K, IQ2_XXS, MXFP4; Q8_K is an activation format. FP8 E4M3 with E8M0 block scales is the official
// checkpoint format (decoded by the converter).
//
// Dot products come in two forms:
//   - vec_dot_f32: weight row · f32 activations. Equals dequantize-then-dot up to float reassociation.
//   - vec_dot:     weight row · activations pre-quantized to dot_type(weight) (8-bit blocks, integer
//                  arithmetic), the fast path for quantized weights.
// Each has an AVX2/FMA implementation chosen at run time when the CPU has it, and a scalar fallback that
// gives the same result within float tolerance.
#pragma once

#include "format/types.h"

#include <cstddef>
#include <cstdint>

namespace dsv4 {

// ---------------------------------------------------------------------------------------------------------------------
// Block layouts (byte-compatible with ggml)
// ---------------------------------------------------------------------------------------------------------------------
constexpr int64_t QK8_0 = 32;
constexpr int64_t QK_K = 256;
constexpr int64_t QK_MXFP4 = 32;

struct BlockQ8_0 {
    uint16_t d;  // f16 scale
    int8_t qs[QK8_0];
};
static_assert(sizeof(BlockQ8_0) == 34);

struct BlockQ8_K {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];  // sums of each group of 16 qs
};
static_assert(sizeof(BlockQ8_K) == 292);

struct BlockQ2_K {
    uint8_t scales[QK_K / 16];  // low nibble scale, high nibble min, per 16 values
    uint8_t qs[QK_K / 4];       // 2-bit codes
    uint16_t d;                 // f16 super-block scale for scales
    uint16_t dmin;              // f16 super-block scale for mins
};
static_assert(sizeof(BlockQ2_K) == 84);

struct BlockQ4_K {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];  // 6-bit scales and mins of 8 sub-blocks of 32
    uint8_t qs[QK_K / 2];
};
static_assert(sizeof(BlockQ4_K) == 144);

struct BlockIQ2_XXS {
    uint16_t d;
    uint16_t qs[QK_K / 8];  // per 32 values: four 8-bit grid indices, then four 7-bit sign indices + 4-bit scale
};
static_assert(sizeof(BlockIQ2_XXS) == 66);

struct BlockMXFP4 {
    uint8_t e;                 // E8M0 shared exponent
    uint8_t qs[QK_MXFP4 / 2];  // E2M1 codes: low nibbles are values 0..15, high nibbles 16..31
};
static_assert(sizeof(BlockMXFP4) == 17);

// 8-bit activation block paired with Q8_0 and MXFP4 weights. The scale stays f32 (not f16 as in a stored
// Q8_0 block): activations have a wide range and the extra rounding of d is avoidable error.
struct BlockQ8A {
    float d;
    int8_t qs[QK8_0];
};
static_assert(sizeof(BlockQ8A) == 36);

// ---------------------------------------------------------------------------------------------------------------------
// Conversions
// ---------------------------------------------------------------------------------------------------------------------

// n must be a multiple of the type's block size (checked; dsv4::Error otherwise).
void dequantize_row(GgmlType type, const void * src, float * dst, int64_t n);

// Quantizes n values (Q8_K too, as quantize_activations does). Q8_0 and Q8_K follow ggml's reference rules
// exactly. Q2_K, Q4_K and IQ2_XXS search scales and codes for the least weighted squared error, and MXFP4 picks
// each block's exponent that way; `importance` (n weights >= 0, may be null for all ones) scales those
// weights, as an imatrix does.
void quantize_row(GgmlType type, const float * src, void * dst, int64_t n, const float * importance = nullptr);

// ---------------------------------------------------------------------------------------------------------------------
// Dot products
// ---------------------------------------------------------------------------------------------------------------------

// The activation format vec_dot expects for a weight type: F32 for F32/F16/BF16, "Q8A" (BlockQ8A, reported
// as GgmlType::Q8_0) for Q8_0 and MXFP4, Q8_K for Q2_K, Q4_K and IQ2_XXS.
GgmlType dot_type(GgmlType weight);
// Bytes of n activations in dot_type(weight).
size_t dot_row_bytes(GgmlType weight, int64_t n);
// Quantizes f32 activations into dot_type(weight) (a plain copy for float weights).
void quantize_activations(GgmlType weight, const float * x, void * dst, int64_t n);

// Both throw dsv4::Error for a type without a dot product or an n that is not a whole number of blocks.
// `act` must come from quantize_activations (vec_dot relies on Q8A/Q8_K codes never being -128).
float vec_dot(GgmlType weight, int64_t n, const void * w_row, const void * act);
float vec_dot_f32(GgmlType weight, int64_t n, const void * w_row, const float * x);

// out[r] = vec_dot(weight, n, w_rows + r·w_stride, act) for r < n_rows (w_stride in bytes), with one
// validation and dispatch for all rows. (A kernel taking four Q8_0 rows per activation load was tried: equal
// speed from cache and half the bandwidth when streaming from memory, so rows run one after another.)
void vec_dot_rows(GgmlType weight, int64_t n, const void * w_rows, size_t w_stride, int n_rows, const void * act,
                  float * out);

// Which implementation the dot products use: "avx2" or "scalar". force_scalar(true) is for tests.
const char * quant_simd_name();
void quant_force_scalar(bool on);

// ---------------------------------------------------------------------------------------------------------------------
// FP8 / FP4 element formats and the official activation round trips
// ---------------------------------------------------------------------------------------------------------------------
float e4m3_to_f32(uint8_t bits);  // E4M3 "fn": no infinities, 0x7f/0xff are NaN
uint8_t f32_to_e4m3(float x);     // nearest, ties to even, saturating at ±448 (±inf too); NaN gives 0x7f/0xff
float e8m0_to_f32(uint8_t bits);  // 2^(bits-127); bits 0 gives 2^-127 (subnormal), 255 is NaN (OCP)
float e2m1_to_f32(uint8_t code);  // 4-bit code: bit 3 sign, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}
uint8_t f32_to_e2m1(float x);     // nearest, ties to the even code, saturating at ±6; NaN gives 0

// ceil(log2(x)) from the float's bits: exponent, +1 when any mantissa bit is set (exact, unlike
// ceilf(log2f(x))). Subnormals are exact too; +inf gives 128. Throws dsv4::Error unless x > 0.
int ceil_log2_exact(float x);

// The official UE8M0 round trips. n must be a multiple of `block` (dsv4::Error otherwise).
// FP8Sim: per block, a = max(amax, 1e-4), s = 2^ceil_log2_exact(a·fp32(1/448)), x = s·e4m3(x/s).
// (a times the f32 reciprocal, not a/448, as the official kernels compute it.)
void fp8_roundtrip(float * x, int64_t n, int64_t block = 64);
// FP4Sim: per block, a = max(amax, 6·2^-126), s = 2^ceil_log2_exact(a·fp32(1/6)), x = s·e2m1(x/s).
void fp4_roundtrip(float * x, int64_t n, int64_t block = 32);
// Walsh-Hadamard transform in Sylvester order (butterflies (a, b) → (a+b, a−b) at strides 1, 2, 4, …),
// then scaled by fp32(1/sqrt(n)); n must be a power of two (dsv4::Error otherwise).
void hadamard_inplace(float * x, int64_t n);

}  // namespace dsv4
