// Internal to format/quant: the format tables and the AVX2 kernels that quant.cpp dispatches to.
//
// quant_avx2.cpp is the only file compiled with -mavx2 -mfma -mf16c. Nothing here may be an inline function
// or a template that both it and a plain file instantiate: the linker keeps one copy of such a function, and
// if it kept the AVX2 one a CPU without AVX2 would fault in scalar code. So this header holds data and
// plain declarations only; the kernels take validated arguments (n a whole number of blocks).
#pragma once

#include "format/quant.h"

#include <cstdint>

namespace dsv4::quant_detail {

// ---------------------------------------------------------------------------------------------------------------------
// Tables (quant_tables.cpp)
// ---------------------------------------------------------------------------------------------------------------------
struct Iq2Tables {
    // [256] u64: the IQ2_XXS grid; byte e of entry k is the magnitude (8, 25 or 43) of element e.
    uint64_t grid[256];
    // [256] u16: level (0, 1, 2) of each of the 8 elements of entry k, 2 bits per element, element 0 lowest
    // (the kgrid encoding). The quantizer searches over levels.
    uint16_t levels[256];
    // [128] u8: sign byte for a 7-bit sign index: bit e set = element e negative; bit 7 restores even parity.
    uint8_t signs[128];
    // [128] u64: the same signs expanded to bytes, 0xff (-1) where the element is negative and 0x01 (+1)
    // elsewhere: a multiplier for vpsignb, and the sign bit after widening to i32.
    uint64_t sign_pm1[128];
};
extern const Iq2Tables kIq2;

// [16] i8: E2M1 values doubled (ggml's MXFP4 table): code c → 2·e2m1(c), so a block's scale is 2^(e-128).
extern const int8_t kMxfp4Doubled[16];

// ---------------------------------------------------------------------------------------------------------------------
// AVX2/FMA/F16C kernels (quant_avx2.cpp). n counts values; it is a whole number of the weight's blocks.
// ---------------------------------------------------------------------------------------------------------------------
namespace avx2 {

// Weight row · f32 activations.
float dot_f32_f32(int64_t n, const void * w, const float * x);
float dot_f16_f32(int64_t n, const void * w, const float * x);
float dot_bf16_f32(int64_t n, const void * w, const float * x);
float dot_q8_0_f32(int64_t n, const void * w, const float * x);
float dot_q2_k_f32(int64_t n, const void * w, const float * x);
float dot_q4_k_f32(int64_t n, const void * w, const float * x);
float dot_iq2_xxs_f32(int64_t n, const void * w, const float * x);
float dot_mxfp4_f32(int64_t n, const void * w, const float * x);

// Weight row · quantized activations (BlockQ8A for Q8_0/MXFP4, BlockQ8_K for the K and IQ2 types).
float dot_q8_0_q8a(int64_t n, const void * w, const void * a);
float dot_mxfp4_q8a(int64_t n, const void * w, const void * a);
float dot_q2_k_q8k(int64_t n, const void * w, const void * a);
float dot_q4_k_q8k(int64_t n, const void * w, const void * a);
float dot_iq2_xxs_q8k(int64_t n, const void * w, const void * a);

// Bulk conversions; results equal util/half.h's scalar functions bit for bit (NaN payloads aside).
void f16_to_f32(const uint16_t * src, float * dst, int64_t n);
void f32_to_f16(const float * src, uint16_t * dst, int64_t n);
void bf16_to_f32(const uint16_t * src, float * dst, int64_t n);
void f32_to_bf16(const float * src, uint16_t * dst, int64_t n);

// Activation quantizers; bit-identical to the scalar ones in quant.cpp.
void quantize_q8a(const float * x, BlockQ8A * y, int64_t n);
void quantize_q8_k(const float * x, BlockQ8_K * y, int64_t n);

}  // namespace avx2
}  // namespace dsv4::quant_detail
