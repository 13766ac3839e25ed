// IEEE binary16 and bfloat16 conversions (scalar, exact, round-to-nearest-even). Bulk conversions with
// F16C/AVX2 live in format/quant.
#pragma once

#include <cstdint>
#include <cstring>

namespace dsv4 {

inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float f32_from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));  // inf / nan
    if (exp == 0) {
        if (man == 0) return f32_from_bits(sign);
        // subnormal: normalise
        int e = -1;
        do {
            man <<= 1;
            ++e;
        } while (!(man & 0x400));
        man &= 0x3ff;
        return f32_from_bits(sign | uint32_t(127 - 15 - e) << 23 | man << 13);
    }
    return f32_from_bits(sign | (exp + 127 - 15) << 23 | man << 13);
}

inline uint16_t f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 : 0);  // inf / nan
    if (x >= 0x477ff000u) return sign | 0x7c00;                                 // rounds to inf
    if (x < 0x38800000u) {                                                       // subnormal or zero in f16
        if (x < 0x33000000u) return sign;                                        // below half the smallest
        const uint32_t e = x >> 23;
        const uint32_t m = (x & 0x7fffff) | 0x800000;
        const uint32_t shift = 126 - e;  // 14..24
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1);
        const uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) ++r;
        return sign | uint16_t(r);
    }
    uint32_t r = ((x >> 13) - ((127 - 15) << 10));
    const uint32_t rem = x & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
    return sign | uint16_t(r);
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40);  // quiet nan
    x += 0x7fff + ((x >> 16) & 1);
    return uint16_t(x >> 16);
}

// Rounds through the 16-bit format and back (used to model what a KV cache stores).
inline float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

}  // namespace dsv4
