// Tests for format/quant: hand-built blocks, ggml's own dequantizer output, quantizer error bounds, dot
// products against dequantize-then-dot, AVX2 against scalar, the FP8/FP4/E8M0 codecs and Hadamard.
#include "format/quant.h"

#include "util/error.h"
#include "util/half.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace dsv4 {
namespace {

const GgmlType kWeightTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16,    GgmlType::Q8_0,
                                 GgmlType::Q2_K, GgmlType::Q4_K, GgmlType::IQ2_XXS, GgmlType::MXFP4};

bool has_avx2() {
    quant_force_scalar(false);
    return std::string(quant_simd_name()) == "avx2";
}

// Runs fn once per implementation this machine has (scalar always, AVX2 when present), restoring the default.
template <typename Fn>
void for_each_impl(Fn fn) {
    for (bool scalar : {true, false}) {
        if (!scalar && !has_avx2()) continue;
        quant_force_scalar(scalar);
        SCOPED_TRACE(scalar ? "scalar" : "avx2");
        fn();
    }
    quant_force_scalar(false);
}

std::vector<float> gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, sigma);
    std::vector<float> v(n);
    for (float & x : v) x = dist(rng);
    return v;
}

std::vector<float> uniform(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float & x : v) x = dist(rng);
    return v;
}

std::vector<uint8_t> quantized(GgmlType t, const std::vector<float> & x, const float * importance = nullptr) {
    std::vector<uint8_t> q(row_bytes(t, int64_t(x.size())));
    quantize_row(t, x.data(), q.data(), int64_t(x.size()), importance);
    return q;
}

std::vector<float> dequantized(GgmlType t, const void * q, int64_t n) {
    std::vector<float> y(size_t(n), 0.0f);
    dequantize_row(t, q, y.data(), n);
    return y;
}

double rel_rmse(const std::vector<float> & ref, const std::vector<float> & got) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
        den += double(ref[i]) * ref[i];
    }
    return std::sqrt(num / den);
}

uint32_t bits_of(float f) { return f32_bits(f); }

// ---------------------------------------------------------------------------------------------------------------------
// Layout and hand-built blocks
// ---------------------------------------------------------------------------------------------------------------------
TEST(Quant, BlockSizesMatchTypeTable) {
    EXPECT_EQ(type_traits(GgmlType::Q8_0).block_bytes, sizeof(BlockQ8_0));
    EXPECT_EQ(type_traits(GgmlType::Q8_K).block_bytes, sizeof(BlockQ8_K));
    EXPECT_EQ(type_traits(GgmlType::Q2_K).block_bytes, sizeof(BlockQ2_K));
    EXPECT_EQ(type_traits(GgmlType::Q4_K).block_bytes, sizeof(BlockQ4_K));
    EXPECT_EQ(type_traits(GgmlType::IQ2_XXS).block_bytes, sizeof(BlockIQ2_XXS));
    EXPECT_EQ(type_traits(GgmlType::MXFP4).block_bytes, sizeof(BlockMXFP4));
    EXPECT_EQ(offsetof(BlockQ2_K, d), 80u);
    EXPECT_EQ(offsetof(BlockQ4_K, qs), 16u);
    EXPECT_EQ(offsetof(BlockQ8_K, bsums), 260u);
}

TEST(Quant, HandBlockFloats) {
    const uint16_t h[4] = {0x3c00, 0xc000, 0x0001, 0x7bff};  // 1, -2, 2^-24, 65504
    const uint16_t b[3] = {0x3f80, 0xc040, 0x4049};          // 1, -3, 3.140625
    std::vector<float> y(4);
    for_each_impl([&] {
        dequantize_row(GgmlType::F16, h, y.data(), 4);
        EXPECT_EQ(y[0], 1.0f);
        EXPECT_EQ(y[1], -2.0f);
        EXPECT_EQ(y[2], std::ldexp(1.0f, -24));
        EXPECT_EQ(y[3], 65504.0f);
        dequantize_row(GgmlType::BF16, b, y.data(), 3);
        EXPECT_EQ(y[0], 1.0f);
        EXPECT_EQ(y[1], -3.0f);
        EXPECT_EQ(y[2], 3.140625f);
    });
}

TEST(Quant, F16DecodeEveryCode) {
    // The scalar path's branch-free decoder against util/half.h, over all 65536 codes (NaNs bit for bit too).
    std::vector<uint16_t> all(65536);
    for (int i = 0; i < 65536; ++i) all[i] = uint16_t(i);
    std::vector<float> y(65536);
    quant_force_scalar(true);
    dequantize_row(GgmlType::F16, all.data(), y.data(), 65536);
    quant_force_scalar(false);
    for (int i = 0; i < 65536; ++i) ASSERT_EQ(bits_of(y[i]), bits_of(f16_to_f32(uint16_t(i)))) << i;
}

TEST(Quant, HandBlockQ8_0) {
    BlockQ8_0 blk{};
    blk.d = 0x3800;  // 0.5
    blk.qs[0] = -128;
    blk.qs[1] = 127;
    blk.qs[2] = -3;
    blk.qs[31] = 1;
    const std::vector<float> y = dequantized(GgmlType::Q8_0, &blk, 32);
    EXPECT_EQ(y[0], -64.0f);
    EXPECT_EQ(y[1], 63.5f);
    EXPECT_EQ(y[2], -1.5f);
    EXPECT_EQ(y[3], 0.0f);
    EXPECT_EQ(y[31], 0.5f);
}

TEST(Quant, HandBlockQ8_K) {
    BlockQ8_K blk{};
    blk.d = 0.25f;
    blk.qs[0] = -127;
    blk.qs[255] = 4;
    const std::vector<float> y = dequantized(GgmlType::Q8_K, &blk, 256);
    EXPECT_EQ(y[0], -31.75f);
    EXPECT_EQ(y[1], 0.0f);
    EXPECT_EQ(y[255], 1.0f);
}

TEST(Quant, HandBlockQ2_K) {
    BlockQ2_K blk{};
    blk.d = 0x3c00;          // 1
    blk.dmin = 0x3800;       // 0.5
    blk.scales[0] = 0x21;    // elements 0-15: scale 1, min 2
    blk.scales[3] = 0x07;    // elements 48-63: scale 7, min 0
    blk.scales[9] = 0xf2;    // elements 144-159: scale 2, min 15
    blk.qs[0] = 0xe4;        // byte 0 holds elements 0, 32, 64, 96 with codes 0, 1, 2, 3
    blk.qs[21] = 0x0c;       // element 32 + 21 = 53: code 3
    blk.qs[32 + 16] = 0x02;  // element 128 + 16 = 144: code 2
    const std::vector<float> y = dequantized(GgmlType::Q2_K, &blk, 256);
    EXPECT_EQ(y[0], -1.0f);  // 1·1·0 − 0.5·2
    EXPECT_EQ(y[1], -1.0f);
    EXPECT_EQ(y[32], 0.0f);   // sub-block 2 has scale and min 0
    EXPECT_EQ(y[53], 21.0f);  // 7·3
    EXPECT_EQ(y[48], 0.0f);
    EXPECT_EQ(y[144], -3.5f);  // 2·2 − 0.5·15
    EXPECT_EQ(y[145], -7.5f);
    EXPECT_EQ(y[96], 0.0f);
}

TEST(Quant, HandBlockQ4_K) {
    BlockQ4_K blk{};
    blk.d = 0x3800;     // 0.5
    blk.dmin = 0x3400;  // 0.25
    // Sub-block 1: scale 3, min 4. Sub-block 5: scale 37 = 0b10'0101, min 50 = 0b11'0010.
    blk.scales[1] = 3 | 2 << 6;  // low 6 bits: scale 1; top bits: scale 5 >> 4
    blk.scales[5] = 4 | 3 << 6;  // low 6 bits: min 1; top bits: min 5 >> 4
    blk.scales[9] = 0x25;        // scale 5 & 15 = 5, min 5 & 15 = 2
    blk.qs[0] = 0xa0;            // element 0 (sub-block 0): 0; element 32 (sub-block 1): 10
    blk.qs[64 + 7] = 0xf0;       // element 135 (sub-block 4): 0; element 167 (sub-block 5): 15
    const std::vector<float> y = dequantized(GgmlType::Q4_K, &blk, 256);
    EXPECT_EQ(y[0], 0.0f);
    EXPECT_EQ(y[32], 14.0f);    // 0.5·3·10 − 0.25·4
    EXPECT_EQ(y[33], -1.0f);    // code 0
    EXPECT_EQ(y[135], 0.0f);    // sub-block 4: scale and min 0
    EXPECT_EQ(y[167], 265.0f);  // 0.5·37·15 − 0.25·50
    EXPECT_EQ(y[161], -12.5f);
}

TEST(Quant, HandBlockIQ2_XXS) {
    BlockIQ2_XXS blk{};
    blk.d = 0x3c00;  // 1
    // Group 0: grid points 0 (all level 0), 1 (element 0 at level 2), 255 (levels 0,1,0,0,1,2,2,2), 0.
    // Sign indices 0 (none), 1 (elements 0 and, by parity, 7), 3 (elements 0, 1), 127 (all eight); scale 3.
    const uint32_t grid_word = 0u | 1u << 8 | 255u << 16 | 0u << 24;
    const uint32_t sign_word = 0u | 1u << 7 | 3u << 14 | 127u << 21 | 3u << 28;
    std::memcpy(blk.qs, &grid_word, 4);
    std::memcpy(blk.qs + 2, &sign_word, 4);
    const std::vector<float> y = dequantized(GgmlType::IQ2_XXS, &blk, 256);
    const float db = 0.875f;                                     // 1·(0.5 + 3)·0.25
    const float expect[32] = {8,   8,   8,  8,  8,  8,  8,  8,   //
                              -43, 8,   8,  8,  8,  8,  8,  -8,  //
                              -8,  -25, 8,  8,  25, 43, 43, 43,  //
                              -8,  -8,  -8, -8, -8, -8, -8, -8};
    for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], db * expect[i]) << i;
    // Groups 1-7 are all zero bytes: grid point 0, no signs, scale 0 → d·0.5·0.25·8.
    EXPECT_EQ(y[100], 1.0f);
}

TEST(Quant, HandBlockMXFP4) {
    BlockMXFP4 blk[3]{};
    blk[0].e = 128;  // 2^(e-128) = 1 on the doubled table: values 0, 1, 2, 3, 4, 6, 8, 12
    blk[0].qs[0] = 0x71;
    blk[0].qs[15] = 0xf9;
    blk[1].e = 127;  // 0.5: the plain E2M1 values
    blk[1].qs[2] = 0x5b;
    blk[2].e = 0;  // 2^-128
    blk[2].qs[0] = 0x07;
    const std::vector<float> y = dequantized(GgmlType::MXFP4, blk, 96);
    EXPECT_EQ(y[0], 1.0f);
    EXPECT_EQ(y[16], 12.0f);  // high nibble of byte 0 is element 16
    EXPECT_EQ(y[15], -1.0f);
    EXPECT_EQ(y[31], -12.0f);
    EXPECT_EQ(y[1], 0.0f);
    EXPECT_EQ(y[32 + 2], -1.5f);
    EXPECT_EQ(y[32 + 18], 3.0f);
    EXPECT_EQ(y[64], std::ldexp(12.0f, -128));
}

// ---------------------------------------------------------------------------------------------------------------------
// ggml's output (tests/data/quant/ggml_vectors.bin, see its README)
// ---------------------------------------------------------------------------------------------------------------------
struct VectorSection {
    GgmlType type;
    uint32_t kind;  // 0: blocks → ggml's dequantized values; 1: values → ggml's reference quantization
    std::vector<float> values;
    std::vector<uint8_t> blocks;
};

std::vector<VectorSection> load_ggml_vectors() {
    const std::string path = std::string(DSV4_TEST_DATA) + "/quant/ggml_vectors.bin";
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open " + path);
    char magic[8];
    uint32_t count = 0;
    f.read(magic, 8);
    f.read(reinterpret_cast<char *>(&count), 4);
    if (std::string(magic, 8) != "DSV4QV01") throw std::runtime_error("bad magic in " + path);
    std::vector<VectorSection> out;
    for (uint32_t s = 0; s < count; ++s) {
        uint32_t hdr[4];
        f.read(reinterpret_cast<char *>(hdr), sizeof hdr);
        VectorSection v{GgmlType(hdr[0]), hdr[1], std::vector<float>(hdr[2]), std::vector<uint8_t>(hdr[3])};
        auto read_values = [&] { f.read(reinterpret_cast<char *>(v.values.data()), std::streamsize(hdr[2]) * 4); };
        auto read_blocks = [&] { f.read(reinterpret_cast<char *>(v.blocks.data()), std::streamsize(hdr[3])); };
        if (v.kind == 0) {
            read_blocks();
            read_values();
        } else {
            read_values();
            read_blocks();
        }
        if (!f) throw std::runtime_error("truncated " + path);
        out.push_back(std::move(v));
    }
    return out;
}

TEST(Quant, GgmlVectorsBitExact) {
    const std::vector<VectorSection> sections = load_ggml_vectors();
    ASSERT_EQ(sections.size(), 8u);
    for_each_impl([&] {
        for (const VectorSection & s : sections) {
            SCOPED_TRACE(std::string(type_name(s.type)) + (s.kind == 0 ? " dequantize" : " quantize"));
            const int64_t n = int64_t(s.values.size());
            ASSERT_EQ(row_bytes(s.type, n), s.blocks.size());
            if (s.kind == 0) {
                const std::vector<float> y = dequantized(s.type, s.blocks.data(), n);
                int mismatches = 0;
                for (int64_t i = 0; i < n; ++i)
                    if (bits_of(y[i]) != bits_of(s.values[i]) && mismatches++ < 5)
                        ADD_FAILURE() << "element " << i << ": " << y[i] << " vs ggml " << s.values[i];
                EXPECT_EQ(mismatches, 0);
            } else {
                std::vector<uint8_t> q(s.blocks.size());
                quantize_row(s.type, s.values.data(), q.data(), n);
                EXPECT_EQ(q, s.blocks);
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------------------------------
// Quantizer error
// ---------------------------------------------------------------------------------------------------------------------
struct ErrorBound {
    GgmlType type;
    double gaussian, uniform;  // largest accepted relative RMSE
};

// Bounds sit about 20 % above the errors measured when they were set (docs/quant-benchmarks.md has the
// numbers); a quantizer that loses its search or mis-packs a field exceeds them. Q8_0/Q8_K's 0.01 is loose.
const ErrorBound kBounds[] = {
    {GgmlType::F16, 2.6e-4, 2.4e-4}, {GgmlType::BF16, 2e-3, 1.8e-3}, {GgmlType::Q8_0, 0.01, 0.01},
    {GgmlType::Q8_K, 0.01, 0.01},    {GgmlType::Q4_K, 0.085, 0.065}, {GgmlType::Q2_K, 0.32, 0.265},
    {GgmlType::IQ2_XXS, 0.40, 0.39}, {GgmlType::MXFP4, 0.135, 0.12},
};

TEST(Quant, QuantizeErrorBounds) {
    const int64_t n = 8 * 4096;
    const std::vector<float> g = gaussian(n, 1), u = uniform(n, 2);
    for (const ErrorBound & b : kBounds) {
        SCOPED_TRACE(type_name(b.type));
        const double eg = rel_rmse(g, dequantized(b.type, quantized(b.type, g).data(), n));
        const double eu = rel_rmse(u, dequantized(b.type, quantized(b.type, u).data(), n));
        std::printf("  %-8s rel RMSE gaussian %.5f uniform %.5f\n", std::string(type_name(b.type)).c_str(), eg, eu);
        EXPECT_LT(eg, b.gaussian);
        EXPECT_LT(eu, b.uniform);
        EXPECT_GT(eg, 0.0);
    }
}

// Min/max rounding of each sub-block with exact float scale and offset: what a quantizer without a search gets.
double minmax_rmse(const std::vector<float> & x, int sub, int nmax) {
    std::vector<float> y(x.size());
    for (size_t s = 0; s < x.size(); s += size_t(sub)) {
        const float lo = *std::min_element(x.begin() + s, x.begin() + s + sub);
        const float hi = *std::max_element(x.begin() + s, x.begin() + s + sub);
        const float step = (hi - lo) / float(nmax);
        for (size_t i = s; i < s + size_t(sub); ++i) y[i] = lo + step * std::nearbyint((x[i] - lo) / step);
    }
    return rel_rmse(x, y);
}

TEST(Quant, SearchBeatsMinMaxRounding) {
    // The fitted codes must beat plain min/max rounding even though that baseline keeps exact f32 scales
    // while Q2_K/Q4_K store 4/6-bit ones.
    const int64_t n = 4 * 4096;
    const std::vector<float> g = gaussian(n, 3);
    const double q4 = rel_rmse(g, dequantized(GgmlType::Q4_K, quantized(GgmlType::Q4_K, g).data(), n));
    const double q2 = rel_rmse(g, dequantized(GgmlType::Q2_K, quantized(GgmlType::Q2_K, g).data(), n));
    const double iq2 = rel_rmse(g, dequantized(GgmlType::IQ2_XXS, quantized(GgmlType::IQ2_XXS, g).data(), n));
    EXPECT_LT(q4, minmax_rmse(g, 32, 15));
    EXPECT_LT(q2, minmax_rmse(g, 16, 3));
    // More bits, less error: Q4_K (4.5 bpw) < Q2_K (2.625) < IQ2_XXS (2.06).
    EXPECT_LT(q4, q2);
    EXPECT_LT(q2, iq2);
}

TEST(Quant, ImportanceSteersTheError) {
    // Half the elements (random) matter 100x more; with the importance vector their error must drop.
    const int64_t n = 4 * 4096;
    const std::vector<float> x = gaussian(n, 4);
    std::vector<float> imp(n);
    std::mt19937 rng(5);
    for (float & v : imp) v = (rng() & 1) ? 100.0f : 1.0f;
    auto weighted = [&](const std::vector<float> & y) {
        double e = 0;
        for (int64_t i = 0; i < n; ++i) e += imp[i] * (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
        return e;
    };
    for (GgmlType t : {GgmlType::Q2_K, GgmlType::Q4_K, GgmlType::IQ2_XXS, GgmlType::MXFP4}) {
        SCOPED_TRACE(type_name(t));
        const double plain = weighted(dequantized(t, quantized(t, x).data(), n));
        const double steered = weighted(dequantized(t, quantized(t, x, imp.data()).data(), n));
        // MXFP4's only free choice is each block's exponent (two candidates), so its gain is small.
        EXPECT_LT(steered, (t == GgmlType::MXFP4 ? 1.0 : 0.9) * plain);
    }
}

TEST(Quant, QuantizeEdgeBlocks) {
    // Zeros, a constant, one spike: each type must give finite values and keep the spike's sign and rough size.
    for (GgmlType t : kWeightTypes) {
        SCOPED_TRACE(type_name(t));
        const int64_t n = 256;
        std::vector<float> zeros(n, 0.0f), constant(n, -0.75f), spike(n, 0.0f);
        spike[77] = 5.5f;
        for (const auto * x : {&zeros, &constant, &spike}) {
            const std::vector<float> y = dequantized(t, quantized(t, *x).data(), n);
            for (float v : y) ASSERT_TRUE(std::isfinite(v));
            if (x == &zeros && t != GgmlType::IQ2_XXS) {  // IQ2_XXS has no zero level
                for (float v : y) EXPECT_EQ(v, 0.0f);
            }
            if (x == &constant && t != GgmlType::IQ2_XXS) {
                EXPECT_NEAR(y[10], -0.75f, 0.1f);
            }
            if (x == &spike) {
                EXPECT_NEAR(y[77], 5.5f, t == GgmlType::IQ2_XXS ? 1.5f : 0.5f);
            }
        }
    }
}

TEST(Quant, ActivationRules) {
    // Q8A: d = amax/127 in f32, codes nearest-even of x/d.
    std::vector<float> x(32, 0.0f);
    x[0] = 127.0f;
    x[1] = -63.5f;
    x[2] = 0.5f;
    x[3] = 1.5f;
    x[4] = 2.5f;
    x[5] = -2.5f;
    for_each_impl([&] {
        BlockQ8A a;
        quantize_activations(GgmlType::Q8_0, x.data(), &a, 32);
        EXPECT_EQ(a.d, 1.0f);
        EXPECT_EQ(a.qs[0], 127);
        EXPECT_EQ(a.qs[1], -64);
        EXPECT_EQ(a.qs[2], 0);
        EXPECT_EQ(a.qs[3], 2);
        EXPECT_EQ(a.qs[4], 2);
        EXPECT_EQ(a.qs[5], -2);
    });
    // Q8_K: scale from the signed element of largest magnitude (the first one on a tie), bsums per 16.
    std::vector<float> k = gaussian(256, 6);
    k[5] = -10.0f;
    k[6] = 10.0f;
    for_each_impl([&] {
        BlockQ8_K a;
        quantize_activations(GgmlType::Q2_K, k.data(), &a, 256);
        EXPECT_EQ(a.d, 1.0f / (-127.0f / -10.0f));
        EXPECT_EQ(a.qs[5], -127);
        EXPECT_EQ(a.qs[6], 127);
        for (int g = 0; g < 16; ++g) {
            int s = 0;
            for (int l = 0; l < 16; ++l) s += a.qs[16 * g + l];
            EXPECT_EQ(a.bsums[g], s);
        }
    });
}

// ---------------------------------------------------------------------------------------------------------------------
// Dot products
// ---------------------------------------------------------------------------------------------------------------------

// A dot product equals the exact (double) sum to 1e-5 of Σ|w·x|, the scale its float rounding is relative to
// (relative to the dot itself would fail on sums that cancel).
void expect_dot_near(double got, const std::vector<float> & w, const std::vector<float> & x) {
    double exact = 0, mag = 0;
    for (size_t i = 0; i < w.size(); ++i) {
        exact += double(w[i]) * x[i];
        mag += std::fabs(double(w[i]) * x[i]);
    }
    EXPECT_NEAR(got, exact, 1e-5 * mag + 1e-30);
}

TEST(Quant, DotF32EqualsDequantizeThenDot) {
    for_each_impl([&] {
        for (GgmlType t : kWeightTypes)
            for (int64_t n : {256, 2048, 4096}) {
                SCOPED_TRACE(std::string(type_name(t)) + " n=" + std::to_string(n));
                const std::vector<uint8_t> q = quantized(t, gaussian(n, 10 + uint32_t(n)));
                const std::vector<float> w = dequantized(t, q.data(), n);
                const std::vector<float> x = gaussian(n, 20 + uint32_t(n));
                expect_dot_near(vec_dot_f32(t, n, q.data(), x.data()), w, x);
            }
    });
}

TEST(Quant, DotQuantizedEqualsDequantizedBoth) {
    for_each_impl([&] {
        for (GgmlType t : kWeightTypes)
            for (int64_t n : {256, 2048, 4096}) {
                SCOPED_TRACE(std::string(type_name(t)) + " n=" + std::to_string(n));
                const std::vector<uint8_t> q = quantized(t, gaussian(n, 30 + uint32_t(n)));
                const std::vector<float> w = dequantized(t, q.data(), n);
                const std::vector<float> x = gaussian(n, 40 + uint32_t(n), 3.0f);
                std::vector<uint8_t> act(dot_row_bytes(t, n));
                quantize_activations(t, x.data(), act.data(), n);
                // The activations as the kernel sees them.
                std::vector<float> xa(n);
                const GgmlType at = dot_type(t);
                if (at == GgmlType::F32)
                    xa = x;
                else if (at == GgmlType::Q8_K)
                    dequantize_row(GgmlType::Q8_K, act.data(), xa.data(), n);
                else {
                    const BlockQ8A * b = reinterpret_cast<const BlockQ8A *>(act.data());
                    for (int64_t i = 0; i < n; ++i) xa[i] = b[i / 32].d * float(b[i / 32].qs[i % 32]);
                }
                expect_dot_near(vec_dot(t, n, q.data(), act.data()), w, xa);
                // And the quantized activations stay close to the originals.
                EXPECT_LT(rel_rmse(x, xa), 0.01);
            }
    });
}

TEST(Quant, DotRowsEqualsVecDot) {
    for_each_impl([&] {
        for (GgmlType t : kWeightTypes) {
            SCOPED_TRACE(type_name(t));
            const int64_t n = 512;
            const int rows = 11;                         // two groups of four and a tail of three
            const size_t stride = row_bytes(t, n) + 64;  // padded rows
            std::vector<uint8_t> w(stride * rows);
            for (int r = 0; r < rows; ++r) {
                const std::vector<uint8_t> q = quantized(t, gaussian(n, 50 + uint32_t(r)));
                std::memcpy(w.data() + r * stride, q.data(), q.size());
            }
            const std::vector<float> x = gaussian(n, 60);
            std::vector<uint8_t> act(dot_row_bytes(t, n));
            quantize_activations(t, x.data(), act.data(), n);
            std::vector<float> out(rows + 1, -1.0f);
            vec_dot_rows(t, n, w.data(), stride, rows, act.data(), out.data());
            for (int r = 0; r < rows; ++r) {
                const float one = vec_dot(t, n, w.data() + r * stride, act.data());
                EXPECT_NEAR(out[r], one, 1e-5f * (std::fabs(one) + 1.0f)) << r;
            }
            EXPECT_EQ(out[rows], -1.0f);  // nothing past n_rows is written
        }
    });
}

// Random weight bytes (with sane scales) exercise code paths a quantizer never produces: every code, -128 in
// Q8_0, all IQ2 grid and sign indices, large 6-bit Q4_K scales.
std::vector<uint8_t> random_row(GgmlType t, int64_t n, std::mt19937 & rng) {
    std::vector<uint8_t> q(row_bytes(t, n));
    for (auto & b : q) b = uint8_t(rng());
    const size_t bb = type_traits(t).block_bytes;
    auto set_f16 = [&](size_t off) {
        const uint16_t h = f32_to_f16(std::ldexp(float(rng() % 1000 + 1) / 1000.0f, int(rng() % 8) - 8));
        std::memcpy(&q[off], &h, 2);
    };
    for (size_t b = 0; b < q.size(); b += bb) switch (t) {
            case GgmlType::Q8_0:
                set_f16(b);
                break;
            case GgmlType::Q2_K:
                set_f16(b + 80), set_f16(b + 82);
                break;
            case GgmlType::Q4_K:
                set_f16(b), set_f16(b + 2);
                break;
            case GgmlType::IQ2_XXS:
                set_f16(b);
                break;
            case GgmlType::MXFP4:
                q[b] = uint8_t(110 + rng() % 30);
                break;
            default:
                break;
        }
    if (t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16)
        quantize_row(t, gaussian(n, rng()).data(), q.data(), n);
    return q;
}

TEST(Quant, SimdMatchesScalar) {
    if (!has_avx2()) GTEST_SKIP() << "no AVX2 on this CPU";
    std::mt19937 rng(7);
    for (GgmlType t : kWeightTypes) {
        SCOPED_TRACE(type_name(t));
        const int64_t block = type_traits(t).block_elems == 1 ? 1 : type_traits(t).block_elems;
        for (int iter = 0; iter < 40; ++iter) {
            const int64_t n = block == 1 ? int64_t(rng() % 300) : block * int64_t(1 + rng() % 17);
            const std::vector<uint8_t> q = random_row(t, n, rng);
            const std::vector<float> x = gaussian(n, rng());
            std::vector<uint8_t> act(dot_row_bytes(t, n));
            quantize_activations(t, x.data(), act.data(), n);
            const std::vector<float> w = dequantized(t, q.data(), n);
            std::vector<float> xa(x);
            if (dot_type(t) == GgmlType::Q8_K) dequantize_row(GgmlType::Q8_K, act.data(), xa.data(), n);
            double mag = 0, mag_q = 0;
            for (int64_t i = 0; i < n; ++i) {
                mag += std::fabs(double(w[i]) * x[i]);
                mag_q += std::fabs(double(w[i]) * xa[i]);
            }
            quant_force_scalar(true);
            const float s_f32 = vec_dot_f32(t, n, q.data(), x.data());
            const float s_q = vec_dot(t, n, q.data(), act.data());
            quant_force_scalar(false);
            const float v_f32 = vec_dot_f32(t, n, q.data(), x.data());
            const float v_q = vec_dot(t, n, q.data(), act.data());
            EXPECT_NEAR(s_f32, v_f32, 1e-5 * mag + 1e-30) << "n=" << n;
            EXPECT_NEAR(s_q, v_q, 1e-5 * (dot_type(t) == GgmlType::F32 ? mag : 4 * mag_q) + 1e-30) << "n=" << n;
        }
    }
}

TEST(Quant, SimdConversionsBitExact) {
    if (!has_avx2()) GTEST_SKIP() << "no AVX2 on this CPU";
    std::mt19937 rng(8);
    // f32 inputs covering normals, f16 subnormals and overflow, exact ties; 16-bit inputs over every code.
    std::vector<float> x;
    for (int i = 0; i < 4000; ++i) x.push_back(f32_from_bits((rng() & 0x807fffffu) | (100 + rng() % 48) << 23));
    for (int e = -30; e <= 17; ++e) x.push_back(std::ldexp(1.0f + float(rng() % 2048) / 2048.0f, e));
    x.push_back(65520.0f), x.push_back(65519.0f), x.push_back(-1e30f), x.push_back(std::ldexp(1.0f, -25));
    x.push_back(1.0f + std::ldexp(1.0f, -11)), x.push_back(1.0f + std::ldexp(3.0f, -11));  // f16 ties
    x.push_back(1.0f + std::ldexp(1.0f, -8)), x.push_back(1.0f + std::ldexp(3.0f, -8));    // bf16 ties
    x.push_back(std::numeric_limits<float>::infinity());
    const int64_t n = int64_t(x.size());
    std::vector<uint16_t> all(65536);
    for (int i = 0; i < 65536; ++i) all[i] = uint16_t(i);
    for (GgmlType t : {GgmlType::F16, GgmlType::BF16}) {
        SCOPED_TRACE(type_name(t));
        std::vector<uint16_t> hs(n), hv(n);
        std::vector<float> ys(65536), yv(65536);
        quant_force_scalar(true);
        quantize_row(t, x.data(), hs.data(), n);
        dequantize_row(t, all.data(), ys.data(), 65536);
        quant_force_scalar(false);
        quantize_row(t, x.data(), hv.data(), n);
        dequantize_row(t, all.data(), yv.data(), 65536);
        EXPECT_EQ(hs, hv);
        for (int i = 0; i < 65536; ++i) {
            if (!std::isnan(ys[i])) {
                ASSERT_EQ(bits_of(ys[i]), bits_of(yv[i])) << i;
            }
        }
    }
    // Activation quantizers, including exact .5 ties after scaling.
    for (int iter = 0; iter < 20; ++iter) {
        std::vector<float> a = gaussian(1024, rng(), float(iter + 1));
        if (iter % 2) a[3] = 127.0f, a[4] = 0.5f, a[5] = -2.5f, a[260] = -127.0f, a[261] = 63.5f;
        for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q2_K}) {
            std::vector<uint8_t> s(dot_row_bytes(t, 1024)), v(s.size());
            quant_force_scalar(true);
            quantize_activations(t, a.data(), s.data(), 1024);
            quant_force_scalar(false);
            quantize_activations(t, a.data(), v.data(), 1024);
            EXPECT_EQ(s, v);
        }
    }
}

TEST(Quant, RowLengthErrors) {
    float x[512] = {};
    uint8_t buf[4096] = {};
    EXPECT_THROW(dequantize_row(GgmlType::Q8_0, buf, x, 33), Error);
    EXPECT_THROW(dequantize_row(GgmlType::Q2_K, buf, x, 128), Error);
    EXPECT_THROW(dequantize_row(GgmlType::Q4_0, buf, x, 32), Error);  // a type dsv4 does not dequantize
    EXPECT_THROW(quantize_row(GgmlType::IQ2_XXS, x, buf, 100), Error);
    EXPECT_THROW(quantize_row(GgmlType::MXFP4, x, buf, -32), Error);
    EXPECT_THROW(vec_dot(GgmlType::Q4_K, 300, buf, buf), Error);
    EXPECT_THROW(vec_dot_f32(GgmlType::Q8_0, 48, buf, x), Error);
    EXPECT_THROW(vec_dot_f32(GgmlType::Q8_K, 256, buf, x), Error);  // Q8_K is an activation format only
    float out[4];
    EXPECT_THROW(vec_dot_rows(GgmlType::Q8_0, 40, buf, 64, 1, buf, out), Error);
    EXPECT_THROW(vec_dot_rows(GgmlType::Q8_0, 32, buf, 64, -1, buf, out), Error);
    EXPECT_THROW(dot_row_bytes(GgmlType::MXFP4, 31), Error);
    EXPECT_THROW(quantize_activations(GgmlType::Q2_K, x, buf, 255), Error);
    EXPECT_THROW(dot_type(GgmlType::Q8_K), Error);
    try {
        dequantize_row(GgmlType::Q8_0, buf, x, 33);
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("q8_0"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("33"), std::string::npos) << e.what();
    }
}

TEST(Quant, DotTypes) {
    EXPECT_EQ(dot_type(GgmlType::F16), GgmlType::F32);
    EXPECT_EQ(dot_type(GgmlType::BF16), GgmlType::F32);
    EXPECT_EQ(dot_type(GgmlType::Q8_0), GgmlType::Q8_0);
    EXPECT_EQ(dot_type(GgmlType::MXFP4), GgmlType::Q8_0);
    EXPECT_EQ(dot_type(GgmlType::Q2_K), GgmlType::Q8_K);
    EXPECT_EQ(dot_type(GgmlType::IQ2_XXS), GgmlType::Q8_K);
    EXPECT_EQ(dot_row_bytes(GgmlType::Q8_0, 4096), 128u * 36);
    EXPECT_EQ(dot_row_bytes(GgmlType::Q4_K, 4096), 16u * 292);
    EXPECT_EQ(dot_row_bytes(GgmlType::F16, 10), 40u);
}

// ---------------------------------------------------------------------------------------------------------------------
// FP8 / FP4 / E8M0 codecs and round trips
// ---------------------------------------------------------------------------------------------------------------------
TEST(Quant, E4M3Decode) {
    EXPECT_EQ(e4m3_to_f32(0x00), 0.0f);
    EXPECT_TRUE(std::signbit(e4m3_to_f32(0x80)));
    EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
    EXPECT_EQ(e4m3_to_f32(0x07), std::ldexp(7.0f, -9));
    EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
    EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
    EXPECT_EQ(e4m3_to_f32(0x3c), 1.5f);
    EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
    EXPECT_EQ(e4m3_to_f32(0xfe), -448.0f);
    EXPECT_EQ(e4m3_to_f32(0xc5), -3.25f);  // exponent 8, mantissa 5: −1.625·2
    EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
    EXPECT_TRUE(std::isnan(e4m3_to_f32(0xff)));
    EXPECT_FALSE(std::isnan(e4m3_to_f32(0x78)));  // exponent 15 with mantissa < 7 is a number (256)
    EXPECT_EQ(e4m3_to_f32(0x78), 256.0f);
}

TEST(Quant, E4M3Encode) {
    EXPECT_EQ(f32_to_e4m3(1.0f), 0x38);
    EXPECT_EQ(f32_to_e4m3(-1.5f), 0xbc);
    EXPECT_EQ(f32_to_e4m3(448.0f), 0x7e);
    // Saturation: past the largest value (448), infinities too.
    EXPECT_EQ(f32_to_e4m3(447.0f), 0x7e);
    EXPECT_EQ(f32_to_e4m3(464.0f), 0x7e);  // the tie with 480 (not a value in E4M3FN) saturates
    EXPECT_EQ(f32_to_e4m3(1e9f), 0x7e);
    EXPECT_EQ(f32_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
    EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
    // Ties to the even mantissa.
    EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);  // 1 | 1.125
    EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3a);  // 1.125 | 1.25
    EXPECT_EQ(f32_to_e4m3(432.0f), 0x7e);   // 416 | 448
    EXPECT_EQ(f32_to_e4m3(1.0626f), 0x39);
    // Subnormals (steps of 2^-9) and the carry into the first normal.
    EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);   // 0 | 2^-9
    EXPECT_EQ(f32_to_e4m3(std::ldexp(3.0f, -10)), 0x02);   // 2^-9 | 2·2^-9
    EXPECT_EQ(f32_to_e4m3(std::ldexp(15.0f, -10)), 0x08);  // 7·2^-9 | 2^-6
    EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -9)), 0x01);
    EXPECT_EQ(f32_to_e4m3(-std::ldexp(1.0f, -20)), 0x80);
    // Every value decodes and re-encodes to itself; every midpoint goes to the even neighbour.
    for (int c = 0; c < 0x7e; ++c) {
        const float v = e4m3_to_f32(uint8_t(c)), next = e4m3_to_f32(uint8_t(c + 1));
        EXPECT_EQ(f32_to_e4m3(v), c);
        EXPECT_EQ(f32_to_e4m3(-v), c | 0x80);
        EXPECT_EQ(f32_to_e4m3(0.5f * (v + next)), (c & 1) ? c + 1 : c) << c;
        EXPECT_EQ(f32_to_e4m3(std::nextafter(0.5f * (v + next), 0.0f)), c) << c;
    }
}

TEST(Quant, E8M0AndE2M1) {
    EXPECT_EQ(e8m0_to_f32(127), 1.0f);
    EXPECT_EQ(e8m0_to_f32(128), 2.0f);
    EXPECT_EQ(e8m0_to_f32(1), std::ldexp(1.0f, -126));
    EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.0f, -127));  // subnormal
    EXPECT_EQ(bits_of(e8m0_to_f32(0)), 0x00400000u);
    EXPECT_EQ(e8m0_to_f32(254), std::ldexp(1.0f, 127));
    EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));

    const float mags[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (int c = 0; c < 8; ++c) {
        EXPECT_EQ(e2m1_to_f32(uint8_t(c)), mags[c]);
        EXPECT_EQ(e2m1_to_f32(uint8_t(c | 8)), -mags[c]);
        EXPECT_EQ(f32_to_e2m1(mags[c]), c);
        if (c) {
            EXPECT_EQ(f32_to_e2m1(-mags[c]), c | 8);
        }
    }
    // Midpoints go to the even code.
    EXPECT_EQ(f32_to_e2m1(0.25f), 0);
    EXPECT_EQ(f32_to_e2m1(0.75f), 2);
    EXPECT_EQ(f32_to_e2m1(1.25f), 2);
    EXPECT_EQ(f32_to_e2m1(1.75f), 4);
    EXPECT_EQ(f32_to_e2m1(2.5f), 4);
    EXPECT_EQ(f32_to_e2m1(3.5f), 6);
    EXPECT_EQ(f32_to_e2m1(5.0f), 6);
    EXPECT_EQ(f32_to_e2m1(-5.0f), 14);
    EXPECT_EQ(f32_to_e2m1(0.26f), 1);
    EXPECT_EQ(f32_to_e2m1(5.01f), 7);
    EXPECT_EQ(f32_to_e2m1(100.0f), 7);  // saturates at 6
    EXPECT_EQ(f32_to_e2m1(-0.1f), 8);   // −0
    EXPECT_EQ(f32_to_e2m1(std::numeric_limits<float>::quiet_NaN()), 0);
}

TEST(Quant, CeilLog2Exact) {
    EXPECT_EQ(ceil_log2_exact(1.0f), 0);
    EXPECT_EQ(ceil_log2_exact(std::nextafter(1.0f, 2.0f)), 1);
    EXPECT_EQ(ceil_log2_exact(0.5f), -1);
    EXPECT_EQ(ceil_log2_exact(0.75f), 0);
    EXPECT_EQ(ceil_log2_exact(3.0f), 2);
    EXPECT_EQ(ceil_log2_exact(4.0f), 2);
    EXPECT_EQ(ceil_log2_exact(std::numeric_limits<float>::min()), -126);
    EXPECT_EQ(ceil_log2_exact(std::numeric_limits<float>::denorm_min()), -149);
    EXPECT_EQ(ceil_log2_exact(3 * std::numeric_limits<float>::denorm_min()), -147);
    EXPECT_EQ(ceil_log2_exact(std::numeric_limits<float>::infinity()), 128);
    // 256·(1 + 2^-23): log2f rounds to exactly 8, but the value is above 2^8.
    const float x = std::nextafter(256.0f, 512.0f);
    EXPECT_EQ(ceil_log2_exact(x), 9);
    EXPECT_EQ(std::ceil(std::log2(x)), 8.0f);  // why the float formula is not used
    EXPECT_THROW(ceil_log2_exact(0.0f), Error);
    EXPECT_THROW(ceil_log2_exact(-1.0f), Error);
    EXPECT_THROW(ceil_log2_exact(std::numeric_limits<float>::quiet_NaN()), Error);
}

TEST(Quant, Fp8RoundTrip) {
    std::vector<float> x(128, 0.0f);
    // Block 0: amax 448, so amax/448 is exactly 2^0 and s = 1.
    x[0] = 448.0f, x[1] = 1.0f, x[2] = 0.3f, x[3] = -0.3f, x[4] = 1e-9f;
    // Block 1: amax 449 needs s = 2: 449/2 = 224.5 → 224; 1 → 0.5 exactly; 3.3/2 = 1.65 → 1.625.
    x[64] = 449.0f, x[65] = 1.0f, x[66] = 3.3f, x[67] = -896.0f * 0.25f;
    fp8_roundtrip(x.data(), 128, 64);
    EXPECT_EQ(x[0], 448.0f);
    EXPECT_EQ(x[1], 1.0f);
    EXPECT_EQ(x[2], 0.3125f);  // 1.2·2^-2 → mantissa 1.25
    EXPECT_EQ(x[3], -0.3125f);
    EXPECT_EQ(x[4], 0.0f);  // below half of 2^-9 at s = 1
    EXPECT_EQ(x[64], 448.0f);
    EXPECT_EQ(x[65], 1.0f);
    EXPECT_EQ(x[66], 3.25f);
    EXPECT_EQ(x[67], -224.0f);
    // amax = 896 = 448·2 is an exact power-of-two ratio: s = 2, not 4.
    std::vector<float> y(64, 0.0f);
    y[0] = 896.0f, y[1] = 3.0f, y[2] = 2.25f;
    fp8_roundtrip(y.data(), 64, 64);
    EXPECT_EQ(y[0], 896.0f);
    EXPECT_EQ(y[1], 3.0f);
    EXPECT_EQ(y[2], 2.25f);
    // 3·2^-8 is exact at s = 2 (code 3·2^-9) but would become 2^-6 at s = 4 (1.5·2^-9 ties to 2·2^-9).
    std::vector<float> z(64, 0.0f);
    z[0] = 896.0f, z[1] = std::ldexp(3.0f, -8);
    fp8_roundtrip(z.data(), 64, 64);
    EXPECT_EQ(z[1], std::ldexp(3.0f, -8));
    // An all-tiny block uses the 1e-4 floor: s = 2^ceil(log2(1e-4/448)) = 2^-22; 1e-9/2^-22 ≈ 2.15·2^-9 → 2.
    std::vector<float> t(64, 0.0f);
    t[0] = 1e-9f;
    fp8_roundtrip(t.data(), 64, 64);
    EXPECT_EQ(t[0], std::ldexp(1.0f, -30));
    EXPECT_EQ(t[1], 0.0f);
    // Non-finite input stays contained: NaN stays NaN, infinity saturates, other values survive as numbers.
    std::vector<float> u(64, 1.0f);
    u[0] = std::numeric_limits<float>::quiet_NaN();
    fp8_roundtrip(u.data(), 64, 64);
    EXPECT_TRUE(std::isnan(u[0]));
    EXPECT_EQ(u[1], 1.0f);
    EXPECT_THROW(fp8_roundtrip(x.data(), 100, 64), Error);
    EXPECT_THROW(fp8_roundtrip(x.data(), 64, 0), Error);
}

TEST(Quant, Fp4RoundTrip) {
    std::vector<float> x(64, 0.0f);
    // Block 0: amax 6 → s = 1.
    const float in0[] = {6.0f, 0.25f, 0.75f, 2.5f, 5.0f, -3.5f, 1.3f, -0.2f};
    const float out0[] = {6.0f, 0.0f, 1.0f, 2.0f, 4.0f, -4.0f, 1.5f, -0.0f};
    for (int i = 0; i < 8; ++i) x[i] = in0[i];
    // Block 1: amax 7 → s = 2: 7/2 = 3.5 → 4 → 8; 1/2 = 0.5; 5/2 = 2.5 → 2 → 4.
    x[32] = 7.0f, x[33] = 1.0f, x[34] = 5.0f;
    fp4_roundtrip(x.data(), 64, 32);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(x[i], out0[i]) << i;
    EXPECT_EQ(x[32], 8.0f);
    EXPECT_EQ(x[33], 1.0f);
    EXPECT_EQ(x[34], 4.0f);
    // amax = 12 = 6·2: s = 2 exactly; 1.5 → 0.75 → 1 (tie to even code) → 2.
    std::vector<float> y(32, 0.0f);
    y[0] = 12.0f, y[1] = 1.5f, y[2] = -12.0f;
    fp4_roundtrip(y.data(), 32, 32);
    EXPECT_EQ(y[0], 12.0f);
    EXPECT_EQ(y[1], 2.0f);
    EXPECT_EQ(y[2], -12.0f);
    // A zero block stays zero (the 6·2^-126 floor keeps the scale finite and normal).
    std::vector<float> z(32, 0.0f);
    fp4_roundtrip(z.data(), 32, 32);
    for (float v : z) EXPECT_EQ(v, 0.0f);
    EXPECT_THROW(fp4_roundtrip(x.data(), 48, 32), Error);
}

TEST(Quant, Hadamard) {
    for (int64_t n : {1, 2, 8, 128}) {
        SCOPED_TRACE(n);
        const std::vector<float> x = gaussian(size_t(n), uint32_t(n));
        std::vector<float> y = x;
        hadamard_inplace(y.data(), n);
        // Sylvester's H[i][j] = (−1)^popcount(i & j), over sqrt(n).
        for (int64_t i = 0; i < n; ++i) {
            double s = 0;
            for (int64_t j = 0; j < n; ++j) s += (std::popcount(uint64_t(i & j)) & 1 ? -1.0 : 1.0) * x[j];
            EXPECT_NEAR(y[i], s / std::sqrt(double(n)), 1e-5) << i;
        }
    }
    // n = 8 by hand: e_3 maps to column 3 of H8.
    float e3[8] = {0, 0, 0, 1, 0, 0, 0, 0};
    hadamard_inplace(e3, 8);
    const float c = float(1.0 / std::sqrt(8.0));
    const float col3[8] = {1, -1, -1, 1, 1, -1, -1, 1};
    for (int i = 0; i < 8; ++i) EXPECT_EQ(e3[i], c * col3[i]);
    float bad[6] = {};
    EXPECT_THROW(hadamard_inplace(bad, 6), Error);
    EXPECT_THROW(hadamard_inplace(bad, 0), Error);
}

}  // namespace
}  // namespace dsv4
