// Every op of the CUDA backend against the CPU reference (backend/cpu) on random inputs (never zeros), at small
// shapes and at DeepSeek V4 Flash's real ones. GPU outputs are poisoned (NaN, or -7777 for ids) before each op so
// an unwritten element fails. Quantized weights are compared with the CPU's quantize_activations mode (the GPU
// quantizes activations by the same rules, so only float summation order differs); float weights and every
// other op with either mode. Each case prints its error; exits 77 (ctest: skipped) without a GPU.
#include "backend/backend.h"
#include "backend/cuda.h"
#include "format/quant.h"
#include "util/half.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <numeric>
#include <random>
#include <set>

using namespace dsv4;

namespace {

// ---------------------------------------------------------------------------------------------------------------------
// Backends and tensors on both sides
// ---------------------------------------------------------------------------------------------------------------------
Backend & gpu() {
    static std::unique_ptr<Backend> b = make_cuda_backend({});
    return *b;
}
Backend & cpu(bool quantize_activations = true) {
    static std::unique_ptr<Backend> q = make_cpu_backend({0, true});
    static std::unique_ptr<Backend> f = make_cpu_backend({0, false});
    return quantize_activations ? *q : *f;
}

std::mt19937_64 & rng() {
    static std::mt19937_64 r(1234);
    return r;
}

std::vector<float> randn(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float & x : v) x = d(rng());
    return v;
}

// A tensor with the same contents on the CPU (both reference modes share host memory) and on the GPU.
struct Both {
    Tensor c, g;
};

class Store {
  public:
    Both make(GgmlType type, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1, int64_t ne3 = 1) {
        Tensor t = make_tensor(type, nullptr, ne0, ne1, ne2, ne3);
        const size_t bytes = type == GgmlType::I32 ? size_t(t.n_elements()) * 4 : t.n_bytes();
        cpu_.push_back(cpu().alloc(bytes));
        gpu_.push_back(gpu().alloc(bytes));
        Both b{t, t};
        b.c.data = cpu_.back()->data();
        b.g.data = gpu_.back()->data();
        return b;
    }
    Both values(const std::vector<float> & v, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1, int64_t ne3 = 1) {
        Both b = make(GgmlType::F32, ne0, ne1, ne2, ne3);
        EXPECT_EQ(v.size(), size_t(b.c.n_elements()));
        set(b, v.data(), v.size() * 4);
        return b;
    }
    // BF16 tensors of v rounded to nearest even (the indexer keys of the official numerics).
    Both bf16_values(const std::vector<float> & v, int64_t ne0, int64_t ne1 = 1) {
        Both b = make(GgmlType::BF16, ne0, ne1);
        std::vector<uint16_t> h(v.size());
        for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
        set(b, h.data(), h.size() * 2);
        return b;
    }
    Both ids(const std::vector<int32_t> & v, int64_t ne0, int64_t ne1 = 1) {
        Both b = make(GgmlType::I32, ne0, ne1);
        set(b, v.data(), v.size() * 4);
        return b;
    }
    // An output: zero on the CPU, poisoned on the GPU.
    Both out(GgmlType type, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1, int64_t ne3 = 1) {
        Both b = make(type, ne0, ne1, ne2, ne3);
        const size_t n = size_t(b.c.n_elements());
        std::memset(b.c.data, 0, n * 4);
        if (type == GgmlType::I32) {
            std::vector<int32_t> p(n, -7777);
            gpu().write(b.g, p.data(), n * 4);
        } else {
            gpu().fill(b.g, std::numeric_limits<float>::quiet_NaN());
        }
        return b;
    }
    static void set(const Both & b, const void * data, size_t bytes) {
        std::memcpy(b.c.data, data, bytes);
        gpu().write(b.g, data, bytes);
    }
    // A weight of any type with random codes (scales kept sane), uploaded to both backends.
    Both weight(GgmlType type, int64_t ne0, int64_t ne1, int64_t ne2 = 1) {
        Tensor t = make_tensor(type, nullptr, ne0, ne1, ne2);
        host_.emplace_back(t.n_bytes());
        std::vector<uint8_t> & h = host_.back();
        random_weight(type, ne0, t.rows(), h.data());
        t.data = h.data();
        std::unique_ptr<BackendBuffer> storage;
        Both b{cpu().upload_weight(t, nullptr), gpu().upload_weight(t, &storage)};
        gpu_.push_back(std::move(storage));
        return b;
    }

    static void random_weight(GgmlType type, int64_t ne0, int64_t rows, uint8_t * dst) {
        std::uniform_int_distribution<int> byte(0, 255);
        std::uniform_real_distribution<float> u(0.5f, 1.5f);
        const float fan = 1.0f / std::sqrt(float(ne0));
        if (type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16) {
            const std::vector<float> v = randn(size_t(ne0 * rows), fan);
            for (int64_t r = 0; r < rows; ++r)
                quantize_row(type, v.data() + r * ne0, dst + size_t(r) * row_bytes(type, ne0), ne0);
            return;
        }
        const size_t bytes = row_bytes(type, ne0) * size_t(rows);
        for (size_t i = 0; i < bytes; ++i) dst[i] = uint8_t(byte(rng()));
        const TypeTraits & tr = type_traits(type);
        const size_t nb = bytes / tr.block_bytes;
        auto put16 = [](uint8_t * p, float v) {
            const uint16_t h = f32_to_f16(v);
            std::memcpy(p, &h, 2);
        };
        for (size_t i = 0; i < nb; ++i) {
            uint8_t * b = dst + i * tr.block_bytes;
            switch (type) {
                case GgmlType::Q8_0:
                    put16(b, fan / 64 * u(rng()));
                    break;
                case GgmlType::Q2_K:
                    put16(b + 80, fan / 8 * u(rng()));
                    put16(b + 82, fan / 16 * u(rng()));
                    break;
                case GgmlType::Q4_K:
                    put16(b, fan / 64 * u(rng()));
                    put16(b + 2, fan / 32 * u(rng()));
                    break;
                case GgmlType::IQ2_XXS:
                    put16(b, fan / 16 * u(rng()));
                    break;
                case GgmlType::MXFP4:
                    b[0] = uint8_t(118 + byte(rng()) % 6);
                    break;
                default:
                    break;
            }
        }
    }

  private:
    std::deque<std::vector<uint8_t>> host_;
    std::vector<std::unique_ptr<BackendBuffer>> cpu_, gpu_;
};

std::vector<float> read_gpu(const Tensor & t) {
    std::vector<float> v(size_t(t.n_elements()));
    gpu().read(t, v.data(), v.size() * 4);
    return v;
}
// A BF16 tensor's values as f32, from either backend.
std::vector<float> read_bf16(Backend & b, const Tensor & t) {
    std::vector<uint16_t> h(size_t(t.n_elements()));
    b.read(t, h.data(), h.size() * 2);
    std::vector<float> v(h.size());
    for (size_t i = 0; i < h.size(); ++i) v[i] = bf16_to_f32(h[i]);
    return v;
}
std::vector<int32_t> read_gpu_ids(const Tensor & t) {
    std::vector<int32_t> v(size_t(t.n_elements()));
    gpu().read(t, v.data(), v.size() * 4);
    return v;
}

// max |got - ref| over the reference's RMS (equal values, infinities included, count as exact); fails on a
// non-finite result where the reference is finite.
double compare(const std::string & what, const float * ref, const std::vector<float> & got, double tol) {
    double ss = 0, max_abs = 0;
    size_t bad = 0, finite = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isfinite(ref[i])) {
            ss += double(ref[i]) * ref[i];
            ++finite;
        }
        if (got[i] == ref[i]) continue;
        if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) {
            ++bad;
            continue;
        }
        max_abs = std::max(max_abs, std::fabs(double(got[i]) - double(ref[i])));
    }
    const double rms = std::sqrt(ss / double(std::max<size_t>(finite, 1)));
    const double rel = max_abs / std::max(rms, 1e-30);
    std::printf("  %-58s max|err| %.3g  rel %.3g  (rms %.3g, n %zu)\n", what.c_str(), max_abs, rel, rms, got.size());
    EXPECT_EQ(bad, 0u) << what << ": non-finite or unwritten values";
    EXPECT_LE(rel, tol) << what;
    return rel;
}
double compare(const std::string & what, const Both & t, double tol) {
    return compare(what, t.c.f32(), read_gpu(t.g), tol);
}

// Tensor-core products against f32 activations: weights and activations rounded to f16 (2^-12 relative each),
// products summed in f32; the largest error over a product's outputs stays near 1e-3 of their RMS.
constexpr double kTensorCoreTol = 4e-3;

// For outputs that end in a rounding step (FP8, FP4): an input that differs in the last bit may round to the
// neighbouring code, so count the elements off by more than float noise instead.
void compare_rounded(const std::string & what, const std::vector<float> & got, const float * ref, double max_fraction) {
    double ss = 0;
    for (size_t i = 0; i < got.size(); ++i) ss += double(ref[i]) * ref[i];
    const double rms = std::sqrt(ss / double(std::max<size_t>(got.size(), 1)));
    size_t off = 0, bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (!std::isfinite(got[i]))
            ++bad;
        else if (std::fabs(double(got[i]) - ref[i]) > 1e-5 * rms)
            ++off;
    }
    std::printf("  %-58s %zu of %zu elements off by a rounding step\n", what.c_str(), off, got.size());
    EXPECT_EQ(bad, 0u) << what;
    EXPECT_LE(double(off), max_fraction * double(got.size())) << what;
}
void compare_rounded(const std::string & what, const Both & t, double max_fraction) {
    compare_rounded(what, read_gpu(t.g), t.c.f32(), max_fraction);
}

std::string shape(const Tensor & t) {
    return "[" + std::to_string(t.ne[0]) + "," + std::to_string(t.ne[1]) + "," + std::to_string(t.ne[2]) + "," +
           std::to_string(t.ne[3]) + "]";
}

bool is_float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

std::vector<float> inv_freq(int n_rot, float base) {
    std::vector<float> f(size_t(n_rot / 2));
    for (int i = 0; i < n_rot / 2; ++i) f[size_t(i)] = 1.0f / std::pow(base, float(2 * i) / float(n_rot));
    return f;
}

// ---------------------------------------------------------------------------------------------------------------------
// Dense ops
// ---------------------------------------------------------------------------------------------------------------------
struct MatCase {
    GgmlType type;
    int64_t in, out, n;
};

class Matmul : public ::testing::TestWithParam<MatCase> {};

TEST_P(Matmul, MatchesCpu) {
    const MatCase m = GetParam();
    Store s;
    const Both w = s.weight(m.type, m.in, m.out);
    const Both x = s.values(randn(size_t(m.in * m.n)), m.in, m.n);
    const Both y = s.out(GgmlType::F32, m.out, m.n);
    gpu().matmul(w.g, x.g, y.g);
    cpu(true).matmul(w.c, x.c, y.c);
    const bool tc = cuda_tensor_core_product(m.type, m.in, m.n);
    const std::string what = std::string(tc ? "matmul (tensor cores) " : "matmul ") + std::string(type_name(m.type)) +
                             " " + shape(w.c) + " n=" + std::to_string(m.n);
    // Integer dot products: the CPU's 8-bit activation path to float noise. Tensor cores: f16 activations, so
    // the 8-bit CPU path differs by its own quantization error.
    compare(what + " vs cpu", y, tc ? 0.1 : 1e-4);
    // Against f32 activations: exact for float weights, the 8-bit activation error on the integer path, the f16
    // rounding of weights and activations on the tensor cores.
    Both yf = s.out(GgmlType::F32, m.out, m.n);
    cpu(false).matmul(w.c, x.c, yf.c);
    compare(what + " vs cpu f32 act", yf.c.f32(), read_gpu(y.g),
            tc                      ? kTensorCoreTol
            : is_float_type(m.type) ? 1e-4
                                    : 0.1);
}

INSTANTIATE_TEST_SUITE_P(Types, Matmul,
                         ::testing::Values(
                             // every type, small and odd token counts (tiles of 4 with a remainder)
                             MatCase{GgmlType::F32, 256, 96, 1}, MatCase{GgmlType::F32, 100, 37, 11},
                             MatCase{GgmlType::F32, 37, 5, 3}, MatCase{GgmlType::F16, 256, 96, 3},
                             MatCase{GgmlType::F16, 24, 10, 9}, MatCase{GgmlType::BF16, 512, 64, 17},
                             MatCase{GgmlType::Q8_0, 256, 96, 1}, MatCase{GgmlType::Q8_0, 64, 33, 13},
                             MatCase{GgmlType::Q2_K, 512, 70, 1}, MatCase{GgmlType::Q2_K, 256, 64, 21},
                             MatCase{GgmlType::Q4_K, 512, 70, 2}, MatCase{GgmlType::Q4_K, 256, 64, 33},
                             MatCase{GgmlType::IQ2_XXS, 512, 70, 1}, MatCase{GgmlType::IQ2_XXS, 256, 64, 19},
                             MatCase{GgmlType::MXFP4, 256, 70, 1}, MatCase{GgmlType::MXFP4, 96, 64, 10},
                             // V4 Flash: q_a, q_b, kv, o_b, shared expert (Q8_0); compressor, indexer, router (F16)
                             MatCase{GgmlType::Q8_0, 4096, 1024, 1}, MatCase{GgmlType::Q8_0, 1024, 32768, 1},
                             MatCase{GgmlType::Q8_0, 1024, 32768, 9}, MatCase{GgmlType::Q8_0, 4096, 512, 1},
                             MatCase{GgmlType::Q8_0, 8192, 4096, 1}, MatCase{GgmlType::Q8_0, 8192, 4096, 40},
                             MatCase{GgmlType::Q8_0, 4096, 2048, 1}, MatCase{GgmlType::Q8_0, 2048, 4096, 3},
                             MatCase{GgmlType::F16, 4096, 1024, 1}, MatCase{GgmlType::F16, 1024, 8192, 2},
                             MatCase{GgmlType::F16, 4096, 256, 1}, MatCase{GgmlType::F16, 4096, 64, 5},
                             MatCase{GgmlType::IQ2_XXS, 4096, 2048, 1}, MatCase{GgmlType::Q2_K, 2048, 4096, 1},
                             MatCase{GgmlType::Q4_K, 4096, 2048, 1}, MatCase{GgmlType::Q4_K, 2048, 4096, 12},
                             // one token whose quantized row is too wide to quantize in the block
                             MatCase{GgmlType::Q2_K, 32768, 24, 1}, MatCase{GgmlType::Q8_0, 65536, 8, 1},
                             // one token: rows of 16384 and 32768 values (a block's 8 warps split each pair of
                             // rows), a width that is not a power of two
                             MatCase{GgmlType::Q8_0, 16384, 40, 1}, MatCase{GgmlType::Q8_0, 32768, 20, 1},
                             MatCase{GgmlType::Q8_0, 1280, 300, 1},
                             // prefill on the tensor cores: every type, partial tiles of rows and tokens, real shapes;
                             // F32 and widths not a multiple of 64 stay on the integer path
                             MatCase{GgmlType::F16, 256, 96, 64}, MatCase{GgmlType::BF16, 512, 64, 100},
                             MatCase{GgmlType::Q8_0, 1024, 130, 77}, MatCase{GgmlType::Q2_K, 512, 70, 40},
                             MatCase{GgmlType::Q4_K, 256, 64, 33}, MatCase{GgmlType::IQ2_XXS, 512, 70, 65},
                             MatCase{GgmlType::MXFP4, 256, 70, 50}, MatCase{GgmlType::F32, 256, 96, 64},
                             MatCase{GgmlType::F16, 24, 10, 40}, MatCase{GgmlType::Q8_0, 1024, 32768, 128},
                             MatCase{GgmlType::Q8_0, 4096, 1024, 300}, MatCase{GgmlType::IQ2_XXS, 4096, 2048, 64},
                             // 128-token tiles with a partial last tile, 64-row tiles (few rows)
                             MatCase{GgmlType::IQ2_XXS, 512, 70, 200}, MatCase{GgmlType::Q2_K, 512, 200, 130},
                             MatCase{GgmlType::Q4_K, 256, 96, 257}, MatCase{GgmlType::MXFP4, 256, 70, 140},
                             // products with two waves of larger tiles (on sm_90a, wgmma): 256 rows (the last
                             // row block partial in the Q2_K case), 128 rows
                             MatCase{GgmlType::Q8_0, 1024, 32768, 300}, MatCase{GgmlType::F16, 1024, 8192, 1100},
                             MatCase{GgmlType::Q2_K, 512, 5000, 1700}, MatCase{GgmlType::Q8_0, 1024, 4096, 1100}));

// The tensor-core tiles decode each weight to the f16 nearest its exact value (gemm.cu): with one-hot activations a
// product returns those weights, which must equal the CPU's dequantized values rounded to f16, bit for bit. Two
// shapes: 256 rows (the small mma.sync tiles) and 8192 rows × 2304 tokens (the largest tiles: wgmma on sm_90a, or
// 128-row mma.sync tiles).
TEST(Ops, MatmulTilesDecodeWeightsExactly) {
    constexpr int64_t K = 256;
    for (GgmlType type : {GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q4_K,
                          GgmlType::IQ2_XXS, GgmlType::MXFP4}) {
        for (const auto & [rows, n] : {std::pair<int64_t, int64_t>{256, 256}, {8192, 9 * K}}) {
            const std::string what = "tile decode " + std::string(type_name(type)) + " " + std::to_string(rows) +
                                     " rows, n=" + std::to_string(n);
            if (!cuda_tensor_core_product(type, K, n)) {
                std::printf("  %-58s not on the tensor cores here\n", what.c_str());
                continue;
            }
            Store s;
            const Both w = s.weight(type, K, rows);
            std::vector<float> x(size_t(K * n), 0.0f);
            for (int64_t j = 0; j < n; ++j) x[size_t(j * K + j % K)] = 1.0f;
            const Both xs = s.values(x, K, n);
            const Both y = s.out(GgmlType::F32, rows, n);
            gpu().matmul(w.g, xs.g, y.g);
            const std::vector<float> got = read_gpu(y.g);
            std::vector<float> wrow(static_cast<size_t>(K));
            size_t off = 0;
            for (int64_t r = 0; r < rows; ++r) {
                dequantize_row(type, static_cast<const uint8_t *>(w.c.data) + size_t(r) * row_bytes(type, K),
                               wrow.data(), K);
                for (int64_t j = 0; j < n; ++j) off += got[size_t(j * rows + r)] != round_f16(wrow[size_t(j % K)]);
            }
            std::printf("  %-58s %zu of %zu differ\n", what.c_str(), off, got.size());
            EXPECT_EQ(off, 0u) << what;
        }
    }
}

// A product of one input in a matmul_many call: its weight type and output rows.
struct Proj {
    GgmlType type;
    int64_t out;
};

// matmul_many of one random input [in, n] into fresh weights of `proj` (uploaded after the input, right before the
// call), on the GPU against the CPU (its 8-bit path, or f32 activations where every product takes the tensor
// cores), each target compared.
void check_matmul_many(const std::string & name, const std::vector<Proj> & proj, int64_t in, int64_t n) {
    Store s;
    bool tc = true;
    for (const Proj & p : proj) tc = tc && cuda_tensor_core_product(p.type, in, n);
    const Both x = s.values(randn(size_t(in * n)), in, n);
    std::vector<Both> ws, ys;
    std::vector<MatmulTarget> tg, tc_targets;
    for (const Proj & p : proj) {
        ws.push_back(s.weight(p.type, in, p.out));
        ys.push_back(s.out(GgmlType::F32, p.out, n));
        tg.push_back({ws.back().g, ys.back().g});
        tc_targets.push_back({ws.back().c, ys.back().c});
    }
    gpu().matmul_many(x.g, tg);
    cpu(!tc).matmul_many(x.c, tc_targets);
    for (size_t i = 0; i < ys.size(); ++i)
        compare("matmul_many " + name + (tc ? " (tensor cores)" : "") + " n=" + std::to_string(n) + " target " +
                    std::to_string(i) + " " + std::string(type_name(proj[i].type)) + " " + shape(ws[i].c),
                ys[i], tc ? kTensorCoreTol : 1e-4);
}

// One token's large Q8_0 and F16 products, which take the ring kernel on sm_90 (matvec.cu: at least 16 MB in one
// launch, K of 1024 to 8192): each K, with rows that the blocks do not divide evenly, alone and as several products
// of one input streamed one after another (segments, Q8_0 then F16: the FFN's router and shared gate/up; an odd
// Q8_0 segment at K = 1024, whose last warp's second row is the next segment's; fewer rows than blocks). Their
// weights are uploaded right before the product, as session 50 found the producer reading a weight whose upload was
// still running. The small_smem variant runs them on matvec_kernel.
TEST(Ops, MatmulRing) {
    for (auto [in, out] : {std::pair<int64_t, int64_t>{1024, 32768}, {2048, 12000}, {4096, 6001}, {8192, 4096}}) {
        Store s;
        const Both w = s.weight(GgmlType::Q8_0, in, out);
        const Both x = s.values(randn(size_t(in)), in, 1);
        const Both y = s.out(GgmlType::F32, out, 1);
        gpu().matmul(w.g, x.g, y.g);
        cpu(true).matmul(w.c, x.c, y.c);
        compare("matmul q8_0 " + shape(w.c) + " n=1 vs cpu", y, 1e-4);
    }
    const GgmlType q8 = GgmlType::Q8_0, f16 = GgmlType::F16;
    check_matmul_many("ring ffn", {{f16, 256}, {q8, 2048}, {q8, 2048}}, 4096, 1);
    check_matmul_many("ring odd segment", {{q8, 8191}, {q8, 3001}, {f16, 3333}}, 1024, 1);
    check_matmul_many("ring few rows", {{f16, 4100}, {q8, 123}}, 2048, 1);
    check_matmul_many("ring few rows", {{f16, 1000}, {q8, 77}}, 8192, 1);
    // A batched decode step's tokens (3 and 5 to 8) take ring_batch_kernel where every target is Q8_0 and ungrouped:
    // each K, rows that the 16-row tiles and the blocks do not divide, several products of one input. 2 and 4 tokens
    // take the tiles.
    for (int64_t n : {2, 3, 4, 8})
        for (auto [in, out] : {std::pair<int64_t, int64_t>{1024, 32768}, {2048, 12000}, {4096, 6001}, {8192, 4096}}) {
            Store s;
            const Both w = s.weight(GgmlType::Q8_0, in, out);
            const Both x = s.values(randn(size_t(in * n)), in, n);
            const Both y = s.out(GgmlType::F32, out, n);
            gpu().matmul(w.g, x.g, y.g);
            cpu(true).matmul(w.c, x.c, y.c);
            compare("matmul q8_0 " + shape(w.c) + " n=" + std::to_string(n) + " vs cpu", y, 1e-4);
        }
    check_matmul_many("ring batch", {{q8, 4096}, {q8, 2047}}, 4096, 5);
}

TEST(Ops, MatmulGroupedOutputProjection) {
    for (int64_t n : {1, 3, 20, 70}) {
        Store s;
        const int64_t G = 8, in_g = 4096, out_g = 1024;
        const bool tc = cuda_tensor_core_product(GgmlType::Q8_0, in_g, n);
        const Both w = s.weight(GgmlType::Q8_0, in_g, G * out_g);
        const Both x = s.values(randn(size_t(G * in_g * n)), G * in_g, n);
        const Both y = s.out(GgmlType::F32, G * out_g, n);
        gpu().matmul_grouped(w.g, x.g, y.g, G);
        cpu(!tc).matmul_grouped(w.c, x.c, y.c, G);
        compare("matmul_grouped q8_0 o_a [4096, 8x1024] n=" + std::to_string(n), y, tc ? kTensorCoreTol : 1e-4);
    }
    Store s;
    const Both w = s.weight(GgmlType::F32, 16, 2 * 24);
    const Both x = s.values(randn(2 * 16 * 5), 32, 5);
    const Both y = s.out(GgmlType::F32, 48, 5);
    gpu().matmul_grouped(w.g, x.g, y.g, 2);
    cpu().matmul_grouped(w.c, x.c, y.c, 2);
    compare("matmul_grouped f32 [16, 2x24] n=5", y, 1e-5);
}

// The projections of one input in one call: the attention's seven (Q8_0 and F16: one launch), a sliding layer's
// two (Q8_0 only), the FFN's three, a mix of other types (one launch per type), and more targets than one launch
// takes.
TEST(Ops, MatmulMany) {
    const std::vector<Proj> attention = {{GgmlType::Q8_0, 1024}, {GgmlType::Q8_0, 512}, {GgmlType::F16, 1024},
                                         {GgmlType::F16, 1024},  {GgmlType::F16, 256},  {GgmlType::F16, 256},
                                         {GgmlType::F16, 64}};
    const std::vector<Proj> ffn = {{GgmlType::F16, 256}, {GgmlType::Q8_0, 2048}, {GgmlType::Q8_0, 2048}};
    const std::vector<Proj> sliding = {{GgmlType::Q8_0, 1024}, {GgmlType::Q8_0, 512}};  // q_a and kv: Q8_0 only
    const std::vector<Proj> mixed = {{GgmlType::Q2_K, 70},    {GgmlType::Q8_0, 33}, {GgmlType::F32, 17},
                                     {GgmlType::IQ2_XXS, 40}, {GgmlType::F16, 9},   {GgmlType::Q8_0, 5}};
    std::vector<Proj> many;
    for (int i = 0; i < 11; ++i) many.push_back({i % 3 ? GgmlType::Q8_0 : GgmlType::F16, 16 + 8 * i});
    struct Case {
        const char * name;
        const std::vector<Proj> & proj;
        int64_t in;
    };
    for (const Case & c :
         {Case{"attention", attention, 4096}, Case{"ffn", ffn, 4096}, Case{"sliding attention", sliding, 4096},
          Case{"mixed", mixed, 512}, Case{"11 targets", many, 256}}) {
        for (int64_t n : {1, 5, 19, 48}) check_matmul_many(c.name, c.proj, c.in, n);
    }
}

// A branch (Backend::begin_branch) beside the main chain, eagerly, captured and replayed: a chain of 64 in-place adds
// and a product on the branch, a product on the main stream after end_branch, and an add after join_branch that reads
// both of the branch's outputs. The branch's chain takes far longer than the main stream's product, so a join that
// did not wait would read a partial sum; the two products quantize their inputs at once, each in its own arena.
TEST(Ops, BranchJoinsBeforeItsResultsAreRead) {
    Store s;
    const int64_t len = 1 << 20, k = 4096, rows = 4096;
    const std::vector<float> start = randn(size_t(len), 100.0f);
    const Both acc = s.values(start, len), one = s.values(std::vector<float>(size_t(len), 1.0f), len);
    const Both x1 = s.values(randn(size_t(k)), k), x2 = s.values(randn(size_t(k)), k);
    const Both w1 = s.weight(GgmlType::Q8_0, k, rows), w2 = s.weight(GgmlType::Q8_0, k, 2 * rows);
    const Both y1 = s.out(GgmlType::F32, rows), y2 = s.out(GgmlType::F32, 2 * rows), sum = s.out(GgmlType::F32, rows);
    const auto step = [&](Backend & b, Tensor Both::*side) {
        b.begin_branch(1);
        for (int i = 0; i < 64; ++i) b.add(acc.*side, one.*side, acc.*side);
        b.matmul(w1.*side, x1.*side, y1.*side);
        b.end_branch();
        b.matmul(w2.*side, x2.*side, y2.*side);
        b.join_branch();
        b.add(make_tensor(GgmlType::F32, (acc.*side).data, rows), y1.*side, sum.*side);
    };
    for (const char * run : {"eager", "captured", "replayed"}) {
        Store::set(acc, start.data(), start.size() * 4);
        gpu().run_captured(0xb7a2c4, [&] { step(gpu(), &Both::g); });
        step(cpu(), &Both::c);
        compare(std::string("branch: 64 adds (") + run + ")", acc, 0.0);
        compare(std::string("branch: Q8_0 product (") + run + ")", y1, 1e-4);
        compare(std::string("main: Q8_0 product beside it (") + run + ")", y2, 1e-4);
        compare(std::string("after the join: sum of both branch outputs (") + run + ")", sum, 1e-6);
    }
}

// The shared expert's down projection with its activation and the routed sum fused (Q8_0 in the quantized files,
// float types in the others; one token quantizes in the block, several through the activation rows).
TEST(Ops, SwigluMatmulAdd) {
    // Q8_0 4096 x 4096: one token on the ring kernel (its addend).
    for (auto [type, in, out] : {std::tuple<GgmlType, int64_t, int64_t>{GgmlType::Q8_0, 2048, 4096},
                                 {GgmlType::Q8_0, 4096, 4096},
                                 {GgmlType::F16, 2048, 256},
                                 {GgmlType::F32, 48, 36},
                                 {GgmlType::Q2_K, 512, 64}}) {
        for (int64_t n : {1, 3, 12, 40}) {
            Store s;
            const bool tc = cuda_tensor_core_product(type, in, n);
            const Both w = s.weight(type, in, out);
            const Both g = s.values(randn(size_t(in * n), 2.0f), in, n),
                       u = s.values(randn(size_t(in * n), 2.0f), in, n);
            const Both add = s.values(randn(size_t(out * n)), out, n);
            const Both y = s.out(GgmlType::F32, out, n);
            gpu().swiglu_matmul_add(w.g, g.g, u.g, 10.0f, add.g, y.g);
            cpu(!tc).swiglu_matmul_add(w.c, g.c, u.c, 10.0f, add.c, y.c);
            const std::string what = std::string("swiglu_matmul_add ") + (tc ? "(tensor cores) " : "") +
                                     std::string(type_name(type)) + " " + shape(w.c) + " n=" + std::to_string(n);
            // The activated values equal the CPU's to ~1 ulp; a value that lands on a code boundary can round to
            // the neighbouring 8-bit code (as in the MoE's hidden rows).
            compare(what + " vs cpu", y, tc ? kTensorCoreTol : is_float_type(type) ? 1e-5 : 1e-2);
            // And equal to the unfused GPU ops (swiglu, matmul, add): the same arithmetic, launch for launch.
            const Both h = s.out(GgmlType::F32, in, n), p = s.out(GgmlType::F32, out, n);
            gpu().swiglu(g.g, u.g, h.g, 10.0f);
            gpu().matmul(w.g, h.g, p.g);
            gpu().add(add.g, p.g, p.g);
            compare(what + " vs unfused gpu ops", read_gpu(p.g).data(), read_gpu(y.g), 1e-6);
            // In place on the addend.
            gpu().swiglu_matmul_add(w.g, g.g, u.g, 10.0f, add.g, add.g);
            compare(what + " in place", read_gpu(y.g).data(), read_gpu(add.g), 0.0);
        }
    }
}

TEST(Ops, GetRows) {
    for (GgmlType type : {GgmlType::F16, GgmlType::F32, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::IQ2_XXS,
                          GgmlType::Q4_K, GgmlType::MXFP4, GgmlType::BF16}) {
        Store s;
        const Both table = s.weight(type, 512, 300);
        std::vector<int32_t> ids = {0, 299, 17, 17, 150, 3};
        const Both id = s.ids(ids, 6);
        const Both out = s.out(GgmlType::F32, 512, 6);
        gpu().get_rows(table.g, id.g, out.g);
        cpu().get_rows(table.c, id.c, out.c);
        compare("get_rows " + std::string(type_name(type)), out, 0.0);
    }
}

TEST(Ops, RmsNormRopeAddSwiglu) {
    Store s;
    for (int64_t n : {1, 7}) {
        const Both x = s.values(randn(size_t(4096 * n), 3.0f), 4096, n);
        const Both g = s.values(randn(4096), 4096);
        const Both y = s.out(GgmlType::F32, 4096, n);
        gpu().rms_norm(x.g, g.g, y.g, 1e-6f);
        cpu().rms_norm(x.c, g.c, y.c, 1e-6f);
        compare("rms_norm [4096] gamma n=" + std::to_string(n), y, 1e-6);
        const Both q = s.values(randn(size_t(512 * 64 * n)), 512, 64, 1, n);
        gpu().rms_norm(q.g, Tensor{}, q.g, 1e-6f);  // in place, no gamma
        cpu().rms_norm(q.c, Tensor{}, q.c, 1e-6f);
        compare("rms_norm [512] x 64 heads in place n=" + std::to_string(n), q, 1e-6);

        std::vector<int32_t> pos(static_cast<size_t>(n));
        for (int64_t t = 0; t < n; ++t) pos[size_t(t)] = int32_t(t == 0 ? 131071 : 5 * t + 3);
        const Both p = s.ids(pos, n);
        RopeSpec sc, sg;
        const Both f = s.values(inv_freq(64, 160000.0f), 32);
        sc.inv_freq = f.c;
        sg.inv_freq = f.g;
        sc.n_rot = sg.n_rot = 64;
        for (bool inverse : {false, true}) {
            gpu().rope(q.g, sg, p.g, inverse);
            cpu().rope(q.c, sc, p.c, inverse);
            compare(std::string("rope 64 of 512 x 64 heads ") + (inverse ? "inverse" : "forward") +
                        " n=" + std::to_string(n),
                    q, 2e-5);
        }
        const Both a = s.values(randn(size_t(2048 * n), 4.0f), 2048, n),
                   b = s.values(randn(size_t(2048 * n), 4.0f), 2048, n);
        const Both o = s.out(GgmlType::F32, 2048, n);
        gpu().add(a.g, b.g, o.g);
        cpu().add(a.c, b.c, o.c);
        compare("add", o, 0.0);
        for (float limit : {0.0f, 10.0f}) {
            const Both w = s.out(GgmlType::F32, 2048, n);
            gpu().swiglu(a.g, b.g, w.g, limit);
            cpu().swiglu(a.c, b.c, w.c, limit);
            compare("swiglu limit " + std::to_string(limit), w, 1e-6);
        }
    }
}

// The query heads (64 × 512, no gamma) and the K=V row (gamma, FP8 of the unrotated channels, into the ring).
TEST(Ops, NormRope) {
    for (int64_t n : {1, 6}) {
        Store s;
        std::vector<int32_t> pos(static_cast<size_t>(n));
        for (int64_t t = 0; t < n; ++t) pos[size_t(t)] = int32_t(t == 0 ? 131071 : 400 + t);
        const Both p = s.ids(pos, n);
        const Both f = s.values(inv_freq(64, 160000.0f), 32);
        RopeSpec sc, sg;
        sc.inv_freq = f.c;
        sg.inv_freq = f.g;
        sc.n_rot = sg.n_rot = 64;
        const std::string tag = " n=" + std::to_string(n);
        const Both q = s.values(randn(size_t(512 * 64 * n), 3.0f), 512, 64, 1, n);
        const NormRopeTarget qg[] = {{q.g}}, qc[] = {{q.c}};
        gpu().norm_rope(qg, 1e-6f, sg, p.g);
        cpu().norm_rope(qc, 1e-6f, sc, p.c);
        compare("norm_rope q 64 heads x 512" + tag, q, 2e-5);
        std::vector<float> gv = randn(512, 0.1f);
        for (float & v : gv) v += 1.0f;
        const Both gamma = s.values(gv, 512);
        for (int64_t fp8 : {int64_t(0), int64_t(448)}) {
            const Both kv = s.values(randn(size_t(512 * n), 2.0f), 512, 1, 1, n);
            const Both ring = s.values(randn(size_t(130 * 512)), 512, 130);
            // The unfused ops on the GPU, on a copy.
            const Both kv2 = s.values(std::vector<float>(size_t(512 * n)), 512, 1, 1, n);
            const Both ring2 = s.values(std::vector<float>(size_t(130 * 512)), 512, 130);
            gpu().copy(kv2.g, kv.g, kv.g.n_bytes());
            gpu().copy(ring2.g, ring.g, ring.g.n_bytes());
            const NormRopeTarget kvg[] = {{kv.g, gamma.g, fp8, ring.g}}, kvc[] = {{kv.c, gamma.c, fp8, ring.c}};
            gpu().norm_rope(kvg, 1e-6f, sg, p.g);
            cpu().norm_rope(kvc, 1e-6f, sc, p.c);
            const std::string what = "norm_rope kv fp8 " + std::to_string(fp8) + tag;
            if (fp8 == 0) {
                compare(what, kv, 2e-5);
                compare(what + " ring", ring, 2e-5);
            } else {
                compare_rounded(what, kv, 0.01);
                compare_rounded(what + " ring", ring, 0.01);
            }
            if (fp8) continue;  // a last-bit difference may move an element by a rounding step: checked above
            const Tensor kv2_rows = reshape(kv2.g, 512, n);
            gpu().rms_norm(kv2_rows, gamma.g, kv2_rows, 1e-6f);
            gpu().rope(kv2.g, sg, p.g, false);
            gpu().store_rows(ring2.g, kv2_rows, p.g);
            compare(what + " vs unfused gpu ops", read_gpu(kv2.g).data(), read_gpu(kv.g), 1e-6);
            compare(what + " ring vs unfused gpu ops", read_gpu(ring2.g).data(), read_gpu(ring.g), 1e-6);
        }
        // The query heads and the K=V row in one call (one launch on the GPU) give the separate calls' values bit
        // for bit; targets of different widths (blocks sized for the wider) against the CPU.
        {
            const Both qa = s.values(randn(size_t(512 * 64 * n), 3.0f), 512, 64, 1, n);
            const Both kva = s.values(randn(size_t(512 * n), 2.0f), 512, 1, 1, n);
            const Both ringa = s.values(randn(size_t(130 * 512)), 512, 130);
            const Both qb = s.values(std::vector<float>(size_t(512 * 64 * n)), 512, 64, 1, n);
            const Both kvb = s.values(std::vector<float>(size_t(512 * n)), 512, 1, 1, n);
            const Both ringb = s.values(std::vector<float>(size_t(130 * 512)), 512, 130);
            gpu().copy(qb.g, qa.g, qa.g.n_bytes());
            gpu().copy(kvb.g, kva.g, kva.g.n_bytes());
            gpu().copy(ringb.g, ringa.g, ringa.g.n_bytes());
            const NormRopeTarget both[] = {{qa.g}, {kva.g, gamma.g, 448, ringa.g}};
            gpu().norm_rope(both, 1e-6f, sg, p.g);
            const NormRopeTarget q_alone[] = {{qb.g}}, kv_alone[] = {{kvb.g, gamma.g, 448, ringb.g}};
            gpu().norm_rope(q_alone, 1e-6f, sg, p.g);
            gpu().norm_rope(kv_alone, 1e-6f, sg, p.g);
            compare("norm_rope q + kv in one call" + tag, read_gpu(qb.g).data(), read_gpu(qa.g), 0.0);
            compare("norm_rope q + kv in one call, kv" + tag, read_gpu(kvb.g).data(), read_gpu(kva.g), 0.0);
            compare("norm_rope q + kv in one call, ring" + tag, read_gpu(ringb.g).data(), read_gpu(ringa.g), 0.0);

            const Both wide = s.values(randn(size_t(512 * 4 * n), 1.5f), 512, 4, 1, n);
            const Both narrow = s.values(randn(size_t(128 * 3 * n), 1.5f), 128, 3, 1, n);
            const Both g128 = s.values(std::vector<float>(gv.begin(), gv.begin() + 128), 128);
            const NormRopeTarget mg[] = {{narrow.g, g128.g}, {wide.g}}, mc[] = {{narrow.c, g128.c}, {wide.c}};
            gpu().norm_rope(mg, 1e-6f, sg, p.g);
            cpu().norm_rope(mc, 1e-6f, sc, p.c);
            compare("norm_rope widths 128 and 512 in one call, 128" + tag, narrow, 2e-5);
            compare("norm_rope widths 128 and 512 in one call, 512" + tag, wide, 2e-5);
        }
    }
}

TEST(Ops, OfficialRoundTrips) {
    Store s;
    for (auto [width, dims] : {std::pair<int64_t, int64_t>{512, 448}, {100, 100}, {64, 40}}) {
        const Both x = s.values(randn(size_t(width * 9), 2.0f), width, 9);
        gpu().fp8_roundtrip(x.g, dims);
        cpu().fp8_roundtrip(x.c, dims);
        compare("fp8_roundtrip width " + std::to_string(width) + " dims " + std::to_string(dims), x, 0.0);
    }
    for (int64_t width : {128, 16, 8, 1024}) {
        const Both x = s.values(randn(size_t(width * 70), 0.7f), width, 70);
        gpu().hadamard_fp4_roundtrip(x.g);
        cpu().hadamard_fp4_roundtrip(x.c);
        compare("hadamard_fp4_roundtrip width " + std::to_string(width), x, 0.0);
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Hyper-connections
// ---------------------------------------------------------------------------------------------------------------------
TEST(Ops, HyperConnections) {
    // n < 16: the decode kernel (a block per chunk and token, the last one of a token finishing; rows wider
    // than 4256 are not held in registers, and past 6144 the norm's weights stay in global memory); n >= 16: the
    // prefill kernels (16-token tiles), with a partial last tile and chunks narrower than 256 values.
    for (auto [D, n, type] : {std::tuple<int64_t, int64_t, GgmlType>{4096, 1, GgmlType::F16},
                              {4096, 3, GgmlType::F16},
                              {5120, 2, GgmlType::F16},
                              {7168, 1, GgmlType::F16},
                              {64, 5, GgmlType::F32},
                              {32, 2, GgmlType::BF16},
                              {4096, 40, GgmlType::F16},
                              {64, 20, GgmlType::F32},
                              {32, 17, GgmlType::BF16}}) {
        Store s;
        const int64_t hc = 4, mix = (2 + hc) * hc;
        const std::string tag =
            " D=" + std::to_string(D) + " n=" + std::to_string(n) + " " + std::string(type_name(type));
        const Both x = s.values(randn(size_t(D * n)), D, n);
        const Both st = s.out(GgmlType::F32, D, hc, 1, n);
        gpu().hc_expand(x.g, st.g);
        cpu().hc_expand(x.c, st.c);
        compare("hc_expand" + tag, st, 0.0);
        // Distinct streams for the mixing.
        const Both streams = s.values(randn(size_t(D * hc * n), 2.0f), D, hc, 1, n);
        const Both fn = s.weight(type, hc * D, mix);
        const Both scale = s.values({0.9f, 1.1f, 0.7f}, 3);
        const Both base = s.values(randn(size_t(mix), 0.5f), mix);
        const Both y = s.out(GgmlType::F32, D, n), post = s.out(GgmlType::F32, hc, n),
                   comb = s.out(GgmlType::F32, hc, hc, 1, n);
        gpu().hc_pre(streams.g, HcPre{fn.g, scale.g, base.g, Tensor{}, 20, 1e-6f, 1e-6f}, y.g, post.g, comb.g);
        cpu().hc_pre(streams.c, HcPre{fn.c, scale.c, base.c, Tensor{}, 20, 1e-6f, 1e-6f}, y.c, post.c, comb.c);
        compare("hc_pre y" + tag, y, 1e-5);
        compare("hc_pre post" + tag, post, 1e-5);
        compare("hc_pre comb (Sinkhorn 20)" + tag, comb, 1e-5);
        // With the sublayer's input norm fused in: the same as hc_pre, then rms_norm.
        std::vector<float> gv = randn(size_t(D), 0.1f);
        for (float & v : gv) v += 1.0f;
        const Both gamma = s.values(gv, D);
        const Both yn = s.out(GgmlType::F32, D, n), post2 = s.out(GgmlType::F32, hc, n),
                   comb2 = s.out(GgmlType::F32, hc, hc, 1, n);
        const HcPre normed_g{fn.g, scale.g, base.g, gamma.g, 20, 1e-6f, 1e-6f},
            normed_c{fn.c, scale.c, base.c, gamma.c, 20, 1e-6f, 1e-6f};
        gpu().hc_pre(streams.g, normed_g, yn.g, post2.g, comb2.g);
        cpu().hc_pre(streams.c, normed_c, yn.c, post2.c, comb2.c);
        compare("hc_pre normed y" + tag, yn, 1e-5);
        compare("hc_pre normed post" + tag, post2, 1e-5);
        Both yr = s.out(GgmlType::F32, D, n);
        cpu().rms_norm(y.c, gamma.c, yr.c, 1e-6f);
        compare("hc_pre normed y vs unfused gpu hc_pre + rms_norm" + tag, yr.c.f32(), read_gpu(yn.g), 1e-5);
        const Both o = s.values(randn(size_t(D * n)), D, n);
        const Both out = s.out(GgmlType::F32, D, hc, 1, n);
        gpu().hc_post(streams.g, o.g, post.g, comb.g, out.g);
        cpu().hc_post(streams.c, o.c, post.c, comb.c, out.c);
        compare("hc_post" + tag, out, 1e-5);
        // HCPost fused with the next HCPre (one kernel below 16 tokens): the streams it writes, then what hc_pre
        // gives on them; post2 and comb2 are its inputs and then its outputs.
        const Both out2 = s.out(GgmlType::F32, D, hc, 1, n), y3 = s.out(GgmlType::F32, D, n);
        gpu().hc_post_pre(streams.g, o.g, post2.g, comb2.g, out2.g, normed_g, y3.g);
        cpu().hc_post_pre(streams.c, o.c, post2.c, comb2.c, out2.c, normed_c, y3.c);
        compare("hc_post_pre streams" + tag, out2, 1e-5);
        compare("hc_post_pre normed y" + tag, y3, 1e-5);
        compare("hc_post_pre post" + tag, post2, 1e-5);
        compare("hc_post_pre comb" + tag, comb2, 1e-5);
        // Two boundaries in a row with no read between, as a decode step runs them: below 16 tokens the second's
        // HCPost reads the comb whose Sinkhorn the first left running on the second stream.
        const Both out3 = s.out(GgmlType::F32, D, hc, 1, n), y4 = s.out(GgmlType::F32, D, n);
        for (Backend * b : {&gpu(), &cpu()}) {
            const bool g = b == &gpu();
            const HcPre & w = g ? normed_g : normed_c;
            auto at = [&](const Both & t) { return g ? t.g : t.c; };
            b->hc_post_pre(at(streams), at(o), at(post2), at(comb2), at(out2), w, at(y3));
            b->hc_post_pre(at(out2), at(o), at(post2), at(comb2), at(out3), w, at(y4));
        }
        compare("two boundaries: streams" + tag, out3, 1e-5);
        compare("two boundaries: normed y" + tag, y4, 1e-5);
        compare("two boundaries: comb" + tag, comb2, 1e-5);
        const Both hfn = s.weight(type, hc * D, hc);
        const Both hscale = s.values({1.3f}, 1);
        const Both hbase = s.values(randn(size_t(hc), 0.5f), hc);
        const Both z = s.out(GgmlType::F32, D, n);
        gpu().hc_head(streams.g, hfn.g, hscale.g, hbase.g, 1e-6f, 1e-6f, z.g);
        cpu().hc_head(streams.c, hfn.c, hscale.c, hbase.c, 1e-6f, 1e-6f, z.c);
        compare("hc_head" + tag, z, 1e-5);
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Attention side
// ---------------------------------------------------------------------------------------------------------------------
TEST(Ops, StoreRows) {
    Store s;
    const Both ring = s.values(randn(130 * 512), 512, 130);
    const Both rows = s.values(randn(5 * 512), 512, 5);
    const Both pos = s.ids({400, 401, 402, 403, 404}, 5);
    gpu().store_rows(ring.g, rows.g, pos.g);
    cpu().store_rows(ring.c, rows.c, pos.c);
    compare("store_rows ring 130 x 512", ring, 0.0);
}

struct CompCase {
    const char * name;
    int64_t width, ratio;
    bool overlap;
    RowRounding rounding;
    bool bf16_store = false;  // the official numerics' indexer keys: also checked against an F32 store on the CPU
};

// A stream of chunks through one compressor: state and stored rows compared after every chunk.
TEST(Ops, CompressorUpdate) {
    for (const CompCase & cc :
         {CompCase{"csa kv (R 4, overlap)", 512, 4, true, RowRounding::none},
          CompCase{"csa kv fp8", 512, 4, true, RowRounding::fp8},
          CompCase{"indexer keys (R 4, overlap, hadamard fp4)", 128, 4, true, RowRounding::hadamard_fp4},
          CompCase{"indexer keys in bf16", 128, 4, true, RowRounding::hadamard_fp4, true},
          CompCase{"hca kv (R 128) fp8", 512, 128, false, RowRounding::fp8},
          CompCase{"small (R 8, overlap)", 32, 8, true, RowRounding::none}}) {
        Store s;
        const int64_t c = cc.overlap ? 2 : 1, wide = c * cc.width, R = cc.ratio, cap = 700 / R + 2;
        const Both skv = s.values(std::vector<float>(size_t(c * R * wide), 0.0f), wide, c * R);
        const Both ssc =
            s.values(std::vector<float>(size_t(c * R * wide), -std::numeric_limits<float>::infinity()), wide, c * R);
        const std::vector<float> zeros(size_t(cap * cc.width), 0.0f);
        const Both store = cc.bf16_store ? s.bf16_values(zeros, cc.width, cap) : s.values(zeros, cc.width, cap);
        // The BF16 case's twin on the CPU: the same chunks into a second state and an F32 store.
        const Both skv32 = s.values(std::vector<float>(size_t(c * R * wide), 0.0f), wide, c * R);
        const Both ssc32 =
            s.values(std::vector<float>(size_t(c * R * wide), -std::numeric_limits<float>::infinity()), wide, c * R);
        const Both store32 = s.values(zeros, cc.width, cap);
        const Both ape = s.weight(GgmlType::F16, wide, R);
        std::vector<float> nv = randn(size_t(cc.width), 0.1f);
        for (float & v : nv) v += 1.0f;
        const Both norm = s.values(nv, cc.width);
        const Both f =
            s.values(inv_freq(std::min<int>(64, int(cc.width)), 160000.0f), std::min<int64_t>(32, cc.width / 2));
        CompressedRowFinish fc, fg;
        fc.norm = norm.c;
        fg.norm = norm.g;
        fc.rope.inv_freq = f.c;
        fg.rope.inv_freq = f.g;
        fc.rope.n_rot = fg.rope.n_rot = int(std::min<int64_t>(64, cc.width));
        fc.rounding = fg.rounding = cc.rounding;
        fc.fp8_dims = fg.fp8_dims = cc.width - fc.rope.n_rot;
        int64_t pos = 0;
        int step = 0;
        for (int64_t n : {1, 1, 2, 5, 1, 8, 3, 16, 1, 1, 1, 40, 7, 130, 1, 2, 300, 1}) {
            std::vector<int32_t> p(static_cast<size_t>(n));
            std::iota(p.begin(), p.end(), int32_t(pos));
            const Both positions = s.ids(p, n);
            const Both kv = s.values(randn(size_t(n * wide)), wide, n);
            const Both score = s.values(randn(size_t(n * wide), 2.0f), wide, n);
            gpu().compressor_update(kv.g, score.g, ape.g, skv.g, ssc.g, positions.g, R, cc.overlap, fg, store.g);
            cpu().compressor_update(kv.c, score.c, ape.c, skv.c, ssc.c, positions.c, R, cc.overlap, fc, store.c);
            if (cc.bf16_store)
                cpu().compressor_update(kv.c, score.c, ape.c, skv32.c, ssc32.c, positions.c, R, cc.overlap, fc,
                                        store32.c);
            pos += n;
            const std::string tag = std::string(" ") + cc.name + " after chunk " + std::to_string(step++) + " (pos " +
                                    std::to_string(pos) + ")";
            compare("compressor state kv" + tag, skv, 0.0);
            compare("compressor state score" + tag, ssc, 0.0);
            if (cc.bf16_store) {
                // FP4-rounded rows are exact in BF16: the CPU's BF16 store widens to its F32 store bit for bit.
                const std::vector<float> c16 = read_bf16(cpu(), store.c), g16 = read_bf16(gpu(), store.g);
                EXPECT_EQ(c16, std::vector<float>(store32.c.f32(), store32.c.f32() + c16.size())) << tag;
                compare_rounded("compressor stored rows" + tag, g16, c16.data(), 0.01);
            } else if (cc.rounding == RowRounding::none) {
                compare("compressor stored rows" + tag, store, 1e-5);
            } else {
                compare_rounded("compressor stored rows" + tag, store, 0.01);
            }
        }
    }
}

// Host scores in double for checking a selection.
std::vector<double> index_scores(const std::vector<float> & q, const std::vector<float> & w,
                                 const std::vector<float> & keys, int64_t t, int64_t H, int64_t d, int64_t visible,
                                 float key_scale) {
    std::vector<double> s(static_cast<size_t>(visible));
    for (int64_t r = 0; r < visible; ++r) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h) {
            double dot = 0;
            for (int64_t i = 0; i < d; ++i) dot += double(q[size_t((t * H + h) * d + i)]) * keys[size_t(r * d + i)];
            acc += double(w[size_t(t * H + h)]) * std::max(0.0, dot);
        }
        s[size_t(r)] = acc * key_scale;
    }
    return s;
}

TEST(Ops, IndexerSelect) {
    // A few decode-size tokens, then a prefill chunk; partial key tiles, tokens below and above top_k visible rows.
    // Queries and keys are f16 values: the backend scores on the tensor cores (f16 operands, f32 sums; the official
    // numerics' FP4-rounded values are exact there), so only the order of the f32 sums differs from the CPU's. The
    // decode cases run again on a backend without tensor cores (the f32 kernel of reference numerics). The top-k
    // takes random keys through its coarse bins, keys equal in pairs through them with ties inside the threshold's
    // bin, and all-equal keys (one bin of every row) through its radix select. The long rows' tokens see 7500 and
    // 12500 rows (coarse bins, 8 and 13 rows a thread) and 17500 (more than the registers hold: split into
    // slices of about 8192 rows whose candidates a second block selects from), with random keys, keys equal in pairs
    // and all-equal keys (radix select). One token sees 262500 rows (1M context: 32 slices of 8204 rows, 16384
    // candidates); nine tokens see 16500 to 17500 rows each, too many tokens to split (one block a token, the coarse
    // bins with the scores read from L2, as in a prefill chunk past 64K). Random decode, prefill and 1M-context keys
    // stored as BF16 (the official numerics' state, scored by the bf16 tiles: queries are bf16 values there, as the
    // official numerics' FP4-rounded ones are) follow, and the nine tokens again with keys equal in pairs (ties in the
    // threshold's bin, ordered across the warps' runs of rows) and all-equal keys (the radix select past the
    // registers) close the list.
    static std::unique_ptr<Backend> no_tc = make_cuda_backend({.tensor_cores = false});
    struct SelCase {
        int shape;
        bool f32 = false;   // the decode cases again, without tensor cores
        bool bf16 = false;  // random keys stored as BF16 (official numerics)
    };
    std::vector<SelCase> cases;
    for (int shape = 0; shape < 8; ++shape) cases.push_back({shape});
    for (int shape : {0, 1, 4, 5}) cases.push_back({shape, true});
    for (int shape : {8, 9}) cases.push_back({shape});
    for (int shape : {0, 2, 8}) cases.push_back({shape, false, true});
    for (int shape : {10, 11}) cases.push_back({shape});
    for (const SelCase & sel_case : cases) {
        const int shape = sel_case.shape;
        const bool f32 = sel_case.f32, bf16 = sel_case.bf16;
        const bool prefill = shape == 2 || shape == 3, ties = shape == 1 || shape == 3 || shape == 7 || shape == 11;
        const bool long_rows = shape == 4 || shape == 6 || shape == 7;
        const bool pairs = shape == 5 || shape == 6 || shape == 10, nine = shape >= 9;
        Store s;
        const int64_t H = 64, d = 128, R = 4, K = 512;
        const int64_t cap = shape == 8 ? 262600 : long_rows || nine ? 17600 : prefill ? 1100 : 700;
        std::vector<int32_t> pos = {2799, 1500, 100, 2050, 2051};
        if (long_rows) pos = {70000, 30000, 50000};
        if (shape == 8) pos = {1050000};
        if (nine) pos = {66000, 70000, 67000, 69500, 66500, 68000, 70003, 67777, 68888};
        if (prefill) {
            pos.clear();
            for (int t = 0; t < 41; ++t) pos.push_back(1000 + 85 * t);
        }
        const int64_t n = int64_t(pos.size());
        std::vector<float> q = randn(size_t(n * H * d)), w = randn(size_t(n * H));
        std::vector<float> keys = randn(size_t(cap * d));
        for (std::vector<float> * v : {&q, &keys})
            for (float & x : *v) x = round_f16(x);
        if (bf16)
            for (std::vector<float> * v : {&q, &keys})
                for (float & x : *v) x = round_bf16(x);
        if (ties)
            for (int64_t r = 1; r < cap; ++r) std::copy_n(keys.begin(), d, keys.begin() + r * d);
        if (pairs)
            for (int64_t r = 1; r < cap; r += 2) std::copy_n(keys.begin() + (r - 1) * d, d, keys.begin() + r * d);
        const Both bq = s.values(q, d, H, 1, n), bw = s.values(w, H, n);
        const Both bk = bf16 ? s.bf16_values(keys, d, cap) : s.values(keys, d, cap);
        const Both bp = s.ids(pos, n);
        const Both sel = s.out(GgmlType::I32, K, n);
        const float key_scale = 1.0f / std::sqrt(float(d) * float(H));
        if (f32) {
            gpu().synchronize();  // the inputs are written on gpu()'s stream
            no_tc->indexer_select(bq.g, bw.g, bk.g, bp.g, R, key_scale, sel.g);
            no_tc->synchronize();
        } else {
            gpu().indexer_select(bq.g, bw.g, bk.g, bp.g, R, key_scale, sel.g);
        }
        cpu().indexer_select(bq.c, bw.c, bk.c, bp.c, R, key_scale, sel.c);
        const std::vector<int32_t> got = read_gpu_ids(sel.g);
        int64_t differ = 0;
        for (int64_t t = 0; t < n; ++t) {
            const int64_t visible = std::min<int64_t>((pos[size_t(t)] + 1) / R, cap);
            const int32_t * g = got.data() + t * K;
            const int32_t * c = sel.c.i32() + t * K;
            // Ascending, -1 padded, the right count.
            const int64_t count = std::min(visible, K);
            for (int64_t j = 0; j < K; ++j) {
                if (j < count) {
                    ASSERT_GE(g[j], 0) << "token " << t << " slot " << j;
                    ASSERT_LT(g[j], visible);
                    if (j > 0) {
                        ASSERT_LT(g[j - 1], g[j]);
                    }
                } else {
                    ASSERT_EQ(g[j], -1) << "token " << t << " slot " << j;
                }
            }
            if (visible <= K) {
                for (int64_t j = 0; j < K; ++j) EXPECT_EQ(g[j], c[j]);
                continue;
            }
            // A valid top-k: every kept row scores at least every dropped row (up to float noise).
            const std::vector<double> sc = index_scores(q, w, keys, t, H, d, visible, key_scale);
            std::set<int32_t> kept(g, g + K), ref(c, c + K);
            double min_kept = 1e300, max_dropped = -1e300, scale = 0;
            for (int64_t r = 0; r < visible; ++r) {
                scale = std::max(scale, std::fabs(sc[size_t(r)]));
                if (kept.count(int32_t(r)))
                    min_kept = std::min(min_kept, sc[size_t(r)]);
                else
                    max_dropped = std::max(max_dropped, sc[size_t(r)]);
            }
            EXPECT_GE(min_kept, max_dropped - 1e-5 * scale) << "token " << t;
            std::vector<int32_t> diff;
            std::set_symmetric_difference(kept.begin(), kept.end(), ref.begin(), ref.end(), std::back_inserter(diff));
            differ += int64_t(diff.size()) / 2;
            if (ties) {
                EXPECT_TRUE(diff.empty()) << "ties must go to the lower rows";
            }
            if (pairs)
                for (int32_t r = 0; r + 1 < int32_t(visible); r += 2) {
                    EXPECT_FALSE(kept.count(r + 1) && !kept.count(r))
                        << "token " << t << ": the tie of rows " << r << " and " << r + 1 << " went to the higher";
                }
        }
        std::printf("  indexer_select %s%s%s%s: %ld of %ld selections differ from the CPU's (near ties)\n",
                    f32 ? "f32, " : "", bf16 ? "bf16 keys, " : "",
                    prefill      ? "prefill, "
                    : long_rows  ? "long rows, "
                    : shape == 8 ? "1M context, "
                    : nine       ? "long rows, 9 tokens, "
                                 : "",
                    ties    ? "all-equal keys"
                    : pairs ? "keys equal in pairs"
                            : "random",
                    differ, n * K);
        EXPECT_LE(differ, 4);
    }
}

TEST(Ops, Attention) {
    struct Case {
        const char * name;
        int64_t n, heads, dim, window, cap, ratio, top_k, p0;
    };
    for (const Case & c : {Case{"flash csa decode", 1, 64, 512, 128, 800, 4, 512, 3100},
                           Case{"flash csa n=5", 5, 64, 512, 128, 800, 4, 512, 2000},
                           Case{"flash hca decode", 1, 64, 512, 128, 300, 128, 0, 30000},
                           // decode over many keys: an HCA layer at 1M context (one and three tokens: on the
                           // tensor cores, keys split over blocks), three tokens at 256K, and a capacity of many
                           // rows with few of them visible
                           Case{"flash hca decode 1M", 1, 64, 512, 128, 8200, 128, 0, 1049000},
                           Case{"flash hca n=3 at 256K", 3, 64, 512, 128, 2100, 128, 0, 262000},
                           Case{"flash hca n=3 at 1M", 3, 64, 512, 128, 8200, 128, 0, 1049000},
                           Case{"flash hca decode, 23 of 1000 rows", 1, 64, 512, 128, 1000, 128, 0, 3000},
                           Case{"flash hca n=48", 48, 64, 512, 128, 300, 128, 0, 30000},
                           Case{"flash sliding decode", 1, 64, 512, 128, 0, 0, 0, 77},
                           Case{"flash sliding n=40 from 0", 40, 64, 512, 128, 0, 0, 0, 0},
                           Case{"tiny csa", 7, 2, 16, 128, 40, 4, 4, 3}, Case{"tiny hca", 9, 4, 32, 8, 40, 8, 0, 60},
                           // prefill on the tensor cores: CSA with unused selection slots, a partial head group,
                           // keys that end inside a 64-key tile, every head width with a kernel
                           Case{"flash csa n=64", 64, 64, 512, 128, 800, 4, 512, 2500},
                           Case{"csa 80 heads of 128 n=33", 33, 80, 128, 128, 200, 4, 100, 500},
                           Case{"hca 16 heads of 64 n=40", 40, 16, 64, 8, 40, 8, 0, 100},
                           Case{"sliding 8 heads of 256 n=50", 50, 8, 256, 128, 0, 0, 0, 10}}) {
        Store s;
        const int64_t ring = c.window + c.n - 1 + 3;
        const Both q = s.values(randn(size_t(c.n * c.heads * c.dim)), c.dim, c.heads, 1, c.n);
        const Both raw = s.values(randn(size_t(ring * c.dim)), c.dim, ring);
        std::vector<int32_t> pos(static_cast<size_t>(c.n));
        std::iota(pos.begin(), pos.end(), int32_t(c.p0));
        const Both bp = s.ids(pos, c.n);
        const Both sinks = s.values(randn(size_t(c.heads)), c.heads);
        CompressedRows cc, cg;
        Both rows, sel;
        if (c.cap > 0) {
            rows = s.values(randn(size_t(c.cap * c.dim)), c.dim, c.cap);
            cc.rows = rows.c;
            cg.rows = rows.g;
            cc.ratio = cg.ratio = c.ratio;
            if (c.top_k > 0) {
                std::vector<int32_t> ids(size_t(c.n * c.top_k), -1);
                for (int64_t t = 0; t < c.n; ++t) {
                    const int64_t visible = std::min<int64_t>((pos[size_t(t)] + 1) / c.ratio, c.cap);
                    std::vector<int32_t> all(static_cast<size_t>(visible));
                    std::iota(all.begin(), all.end(), 0);
                    std::shuffle(all.begin(), all.end(), rng());
                    all.resize(size_t(std::min(visible, c.top_k - 1)));
                    std::sort(all.begin(), all.end());
                    std::copy(all.begin(), all.end(), ids.begin() + t * c.top_k);
                }
                sel = s.ids(ids, c.top_k, c.n);
                cc.selected = sel.c;
                cg.selected = sel.g;
            }
        }
        const Both out = s.out(GgmlType::F32, c.dim, c.heads, 1, c.n);
        const float scale = 1.0f / std::sqrt(float(c.dim));
        gpu().attention(q.g, raw.g, bp.g, c.window, cg, sinks.g, scale, out.g, nullptr);
        cpu().attention(q.c, raw.c, bp.c, c.window, cc, sinks.c, scale, out.c, nullptr);
        // Tensor cores: queries, keys and probabilities in f16 (f32 scores and sums).
        const double keys = double(c.window + (c.top_k > 0 ? c.top_k : c.cap));
        const bool tc = cuda_tensor_core_attention(c.dim, c.n, int64_t(keys));
        const std::string name = std::string(tc ? "attention (tensor cores) " : "attention ") + c.name;
        // f32: the CPU sums in another order; over many keys the error grows and the output's RMS falls (a mean of
        // more values), so the bound grows with the keys (8323 at 1M: 2.3e-5 measured).
        compare(name, out, tc ? 1e-2 : 2e-5 * std::max(1.0, keys / 2048.0));
        // The output turned back by the query's angle inside the op: attention then the inverse rope, exactly.
        const int64_t n_rot = std::min<int64_t>(64, c.dim / 2);
        const Both f = s.values(inv_freq(n_rot, 10000.0f), n_rot / 2);
        RopeSpec rg;
        rg.inv_freq = f.g;
        rg.n_rot = int(n_rot);
        const Both back = s.out(GgmlType::F32, c.dim, c.heads, 1, c.n);
        gpu().attention(q.g, raw.g, bp.g, c.window, cg, sinks.g, scale, back.g, &rg);
        gpu().rope(out.g, rg, bp.g, true);
        compare(name + ", unrotated in the op", read_gpu(out.g).data(), read_gpu(back.g), 0.0);
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Mixture of experts
// ---------------------------------------------------------------------------------------------------------------------
TEST(Ops, Router) {
    // V4's 256 experts and top-6, a tiny model's 16, and widths that take the kernel's wider lanes (300, 1024); tied
    // scores (logits of a few values, no bias) check that ties go to the lower expert as on the CPU.
    struct Case {
        int64_t E, k;
        bool ties;
    };
    for (const Case c : {Case{256, 6, false}, Case{256, 6, true}, Case{16, 4, false}, Case{300, 8, true},
                         Case{1024, 32, false}}) {
        Store s;
        const int64_t n = 9, E = c.E, k = c.k, V = 1000;
        std::vector<float> lv = randn(size_t(n * E), 2.0f);
        if (c.ties)
            for (float & v : lv) v = std::round(v);  // five or so distinct logits a token
        const Both logits = s.values(lv, E, n);
        const Both bias = s.values(randn(size_t(E), 0.1f), E);
        std::vector<int32_t> table(size_t(k * V)), tokens(static_cast<size_t>(n));
        for (auto & v : table) v = int32_t(rng()() % uint64_t(E));
        for (auto & v : tokens) v = int32_t(rng()() % uint64_t(V));
        const Both tid2eid = s.ids(table, k, V), tok = s.ids(tokens, n);
        for (bool hash : {false, true}) {
            const bool with_bias = !hash && !c.ties;
            const Both ex = s.out(GgmlType::I32, k, n), w = s.out(GgmlType::F32, k, n);
            gpu().router(logits.g, with_bias ? bias.g : Tensor{}, hash ? tid2eid.g : Tensor{}, tok.g, 1.5f, ex.g, w.g);
            cpu().router(logits.c, with_bias ? bias.c : Tensor{}, hash ? tid2eid.c : Tensor{}, tok.c, 1.5f, ex.c, w.c);
            const std::string name = std::string(hash ? "hash" : "top-") + (hash ? "" : std::to_string(k)) + " of " +
                                     std::to_string(E) + (c.ties ? ", tied scores" : "");
            const std::vector<int32_t> ge = read_gpu_ids(ex.g);
            for (size_t i = 0; i < ge.size(); ++i) ASSERT_EQ(ge[i], ex.c.i32()[i]) << name << ", choice " << i;
            compare("router weights " + name, w, 1e-6);
        }
    }
}

TEST(Ops, LogitCandidates) {
    // Rows of the real vocabulary: normal logits at two spreads (many candidates fit, or few), one flat row (more
    // than k share the top bin: none), one with NaN and -inf, and one peaked (a few far above the rest).
    Store s;
    for (const auto & [V, k] : {std::pair<int64_t, int64_t>{129280, 1024}, {129280, 20}, {700, 700}}) {
        const int64_t rows = 5;
        std::vector<float> l = randn(size_t(rows * V), 3.0f);
        for (int64_t i = 0; i < V; ++i) l[size_t(V + i)] *= 0.05f;
        std::fill(l.begin() + 2 * V, l.begin() + 3 * V, 0.25f);
        for (int64_t i = 0; i < V; ++i)
            if (i % 3) l[size_t(3 * V + i)] = i % 2 ? std::numeric_limits<float>::quiet_NaN() : -INFINITY;
        for (int64_t i = 0; i < 6; ++i) l[size_t(4 * V + (i * 7919) % V)] = 30.0f + float(i % 2);
        const Both logits = s.values(l, V, rows);
        const Both ids = s.out(GgmlType::I32, k, rows), values = s.out(GgmlType::F32, k, rows),
                   stats = s.out(GgmlType::F32, 4, rows);
        gpu().logit_candidates(logits.g, ids.g, values.g, stats.g);
        cpu().logit_candidates(logits.c, ids.c, values.c, stats.c);
        const std::vector<int32_t> gi = read_gpu_ids(ids.g);
        for (size_t i = 0; i < gi.size(); ++i)
            ASSERT_EQ(gi[i], ids.c.i32()[i]) << "V " << V << " k " << k << " at " << i;
        std::vector<float> gv(size_t(k * rows)), gs(size_t(4 * rows));
        gpu().read(values.g, gv.data(), gv.size() * 4);
        gpu().read(stats.g, gs.data(), gs.size() * 4);
        for (size_t i = 0; i < gv.size(); ++i) ASSERT_EQ(gv[i], values.c.f32()[i]) << i;
        for (int64_t r = 0; r < rows; ++r) {
            const float * cs = stats.c.f32() + 4 * r;
            EXPECT_EQ(gs[size_t(4 * r)], cs[0]);                                      // max
            EXPECT_NEAR(gs[size_t(4 * r + 1)], cs[1], 1e-5 * std::max(1.0f, cs[1]));  // log-sum
            EXPECT_EQ(gs[size_t(4 * r + 2)], cs[2]);                                  // count
            EXPECT_EQ(gs[size_t(4 * r + 3)], cs[3]);                                  // argmax
            // Every logit left out is below every candidate.
            const int64_t n = int64_t(cs[2]);
            float lowest = INFINITY;
            std::vector<bool> in(size_t(V), false);
            for (int64_t j = 0; j < n; ++j) {
                lowest = std::min(lowest, values.c.f32()[r * k + j]);
                in[size_t(ids.c.i32()[r * k + j])] = true;
            }
            for (int64_t i = 0; i < V && n > 0; ++i) {
                if (!in[size_t(i)] && !std::isnan(l[size_t(r * V + i)])) {
                    ASSERT_LT(l[size_t(r * V + i)], lowest);
                }
            }
            std::printf("logit_candidates V %ld k %ld row %ld: %ld candidates, argmax %.0f, log-sum %.6f vs %.6f\n",
                        long(V), long(k), long(r), long(n), cs[3], gs[size_t(4 * r + 1)], cs[1]);
        }
    }
}

struct MoeCase {
    GgmlType gate, down;
    int64_t dim, inner, n_expert, k, n;
    int64_t routed_to = 0;  // tokens choose among the first routed_to experts (0: all), leaving the others unused
    bool hot = false;       // every token picks expert 0 besides k - 1 others: a hot expert with n of the n·k pairs
};

class Moe : public ::testing::TestWithParam<MoeCase> {};

TEST_P(Moe, MatchesCpu) {
    const MoeCase m = GetParam();
    Store s;
    const Both gate = s.weight(m.gate, m.dim, m.inner, m.n_expert), up = s.weight(m.gate, m.dim, m.inner, m.n_expert);
    const Both down = s.weight(m.down, m.inner, m.dim, m.n_expert);
    const Both x = s.values(randn(size_t(m.dim * m.n)), m.dim, m.n);
    std::vector<int32_t> ids(size_t(m.n * m.k));
    std::vector<float> w(size_t(m.n * m.k));
    for (int64_t t = 0; t < m.n; ++t) {
        std::vector<int32_t> all(static_cast<size_t>(m.routed_to ? m.routed_to : m.n_expert));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng());
        if (m.hot) std::swap(all[0], *std::find(all.begin(), all.end(), 0));
        for (int64_t j = 0; j < m.k; ++j) {
            ids[size_t(t * m.k + j)] = all[size_t(j)];
            w[size_t(t * m.k + j)] = 0.1f + float(rng()() % 100) / 100.0f;
        }
    }
    const Both ex = s.ids(ids, m.k, m.n), wt = s.values(w, m.k, m.n);
    const Both out = s.out(GgmlType::F32, m.dim, m.n);
    gpu().moe(x.g, ex.g, wt.g, gate.g, up.g, down.g, 10.0f, out.g);
    cpu().moe(x.c, ex.c, wt.c, gate.c, up.c, down.c, 10.0f, out.c);
    const bool tc = cuda_tensor_core_moe(m.gate, m.down, m.dim, m.inner, m.n * m.k, m.n_expert);
    const std::string what = std::string(tc ? "moe (tensor cores) " : "moe ") + std::string(type_name(m.gate)) + "/" +
                             std::string(type_name(m.down)) + " D=" + std::to_string(m.dim) +
                             " I=" + std::to_string(m.inner) + " E=" + std::to_string(m.n_expert) +
                             " k=" + std::to_string(m.k) + " n=" + std::to_string(m.n);
    // The hidden rows are computed, then quantized to 8 bits for the down projection: a hidden value one ulp
    // away from the CPU's can land on the neighbouring code (odds ~1e-5 per value), which moves that token's
    // outputs by ~1e-3 of their RMS. The matmul cases check the products themselves to float noise.
    // On the tensor cores (f16 activations) the 8-bit CPU path differs by its own quantization error.
    const double rel = compare(what + " vs cpu", out, tc ? 0.2 : 1e-2);
    Both of = s.out(GgmlType::F32, m.dim, m.n);
    cpu(false).moe(x.c, ex.c, wt.c, gate.c, up.c, down.c, 10.0f, of.c);
    // On the tensor cores two rounded products are chained (x and the hidden rows both go to f16, and SwiGLU can
    // amplify a hidden row's error), so the bound is twice a single product's; and the result must stay far closer
    // to the f32 path than the CPU's own 8-bit activations are (about 20× on these shapes).
    const double rel_f32 = compare(what + " vs cpu f32 act", of.c.f32(), read_gpu(out.g),
                                   tc                      ? 2 * kTensorCoreTol
                                   : is_float_type(m.gate) ? 1e-4
                                                           : 0.2);
    if (!is_float_type(m.gate) && !tc) {
        EXPECT_LT(rel, 0.25 * rel_f32) << "GPU further from the 8-bit CPU path than its own quantization noise";
    }
    if (!is_float_type(m.gate) && tc) {
        EXPECT_LT(rel_f32, 0.125 * rel) << "tensor-core MoE not much closer to f32 than the 8-bit CPU path";
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Moe,
                         ::testing::Values(MoeCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, 4096, 2048, 16, 6, 1},
                                           MoeCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, 4096, 2048, 16, 6, 5},
                                           MoeCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, 4096, 2048, 16, 6, 40},
                                           MoeCase{GgmlType::Q4_K, GgmlType::Q4_K, 4096, 2048, 8, 6, 3},
                                           MoeCase{GgmlType::Q8_0, GgmlType::Q8_0, 256, 256, 8, 2, 11},
                                           MoeCase{GgmlType::MXFP4, GgmlType::MXFP4, 256, 128, 8, 2, 4},
                                           MoeCase{GgmlType::F16, GgmlType::F16, 256, 96, 8, 2, 9},
                                           MoeCase{GgmlType::F32, GgmlType::F32, 32, 16, 4, 1, 6},
                                           // one token: a tile per pair from the router's ids (no plan kernel)
                                           MoeCase{GgmlType::Q8_0, GgmlType::Q8_0, 256, 256, 8, 2, 1},
                                           MoeCase{GgmlType::MXFP4, GgmlType::MXFP4, 256, 128, 8, 8, 1},
                                           MoeCase{GgmlType::F16, GgmlType::F16, 256, 96, 8, 2, 1},
                                           // prefill chunks on the tensor cores (at least 8 pairs per expert)
                                           MoeCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, 4096, 2048, 16, 6, 100},
                                           MoeCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, 4096, 2048, 16, 6, 400},
                                           MoeCase{GgmlType::Q4_K, GgmlType::Q4_K, 1024, 512, 8, 6, 200},
                                           MoeCase{GgmlType::Q4_K, GgmlType::Q4_K, 4096, 2048, 8, 6, 40},
                                           MoeCase{GgmlType::Q8_0, GgmlType::Q8_0, 256, 256, 8, 2, 64},
                                           MoeCase{GgmlType::MXFP4, GgmlType::MXFP4, 256, 128, 8, 2, 70},
                                           MoeCase{GgmlType::F16, GgmlType::F16, 256, 128, 8, 2, 64},
                                           // with the experts on cuBLAS (backend_ops_test_moe_cublas: from 256
                                           // pairs an expert on average, in slots of 1.25 times the mean count):
                                           // all experts, unused experts (no slot), and a hot expert (700 of 4200
                                           // pairs: two slots of 352 rows, the others one)
                                           MoeCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, 4096, 2048, 16, 6, 700},
                                           MoeCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, 4096, 2048, 16, 6, 700, 15},
                                           MoeCase{GgmlType::Q4_K, GgmlType::Q2_K, 1024, 512, 8, 4, 520, 5},
                                           MoeCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, 4096, 2048, 16, 6, 700, 0,
                                                   true}));

// The FFN sublayer (moe_ffn) at V4 Flash's widths with 16 experts. The CUDA backend's decode path for the q2 mix
// (x quantized once for both kinds, the shared expert's down projection inside the routed gate/up launch, the
// down's input quantized by its blocks, the shared row added by the combine) must equal the CPU's within the MoE's
// bound and its own composition of the parts (Backend::moe_ffn, the definition): bit for bit for one token; for a
// batch of tokens (a one-token product per pair, where the composition groups the pairs by expert) within float
// summation order, as a product's split may differ. 16 tokens of 16 experts share experts in most pairs; 17 tokens
// take the composition, as do other mixes. Top-k and hash routing.
struct MoeFfnCase {
    GgmlType gate, down;
    bool hash;
    int64_t n;
};

class MoeFfnOp : public ::testing::TestWithParam<MoeFfnCase> {};

TEST_P(MoeFfnOp, MatchesComposition) {
    const MoeFfnCase m = GetParam();
    const int64_t D = 4096, I = 2048, I_sh = 2048, E = 16, k = 6, V = 1000;
    Store s;
    const Both gate_inp = s.weight(GgmlType::F16, D, E);
    const Both gate_sh = s.weight(GgmlType::Q8_0, D, I_sh), up_sh = s.weight(GgmlType::Q8_0, D, I_sh);
    const Both down_sh = s.weight(GgmlType::Q8_0, I_sh, D);
    const Both gate = s.weight(m.gate, D, I, E), up = s.weight(m.gate, D, I, E), down = s.weight(m.down, I, D, E);
    const Both bias = s.values(randn(size_t(E), 0.1f), E);
    std::vector<int32_t> table(size_t(k * V)), tokens(static_cast<size_t>(m.n));
    for (auto & v : table) v = int32_t(rng()() % uint64_t(E));
    for (auto & v : tokens) v = int32_t(rng()() % uint64_t(V));
    const Both tid2eid = s.ids(table, k, V), tok = s.ids(tokens, m.n);
    const Both x = s.values(randn(size_t(D * m.n)), D, m.n);
    struct Run {
        Both logits, g, u, experts, weights, out;
    };
    auto run = [&](bool composed) {
        Run r{s.out(GgmlType::F32, E, m.n), s.out(GgmlType::F32, I_sh, m.n), s.out(GgmlType::F32, I_sh, m.n),
              s.out(GgmlType::I32, k, m.n), s.out(GgmlType::F32, k, m.n),    s.out(GgmlType::F32, D, m.n)};
        for (bool on_gpu : {true, false}) {
            if (composed && !on_gpu) break;  // the CPU side runs once, with the fused run
            auto side = [&](const Both & b) { return on_gpu ? b.g : b.c; };
            MoeFfn f;
            f.gate_inp = side(gate_inp);
            if (m.hash) {
                f.tid2eid = side(tid2eid);
                f.tokens = side(tok);
            } else {
                f.bias = side(bias);
            }
            f.route_scale = 1.5f;
            f.gate_sh = side(gate_sh);
            f.up_sh = side(up_sh);
            f.down_sh = side(down_sh);
            f.limit_sh = 10.0f;
            f.gate = side(gate);
            f.up = side(up);
            f.down = side(down);
            f.limit = 10.0f;
            f.logits = side(r.logits);
            f.g = side(r.g);
            f.u = side(r.u);
            f.experts = side(r.experts);
            f.weights = side(r.weights);
            if (!on_gpu)
                cpu().moe_ffn(x.c, f, r.out.c);
            else if (composed)
                gpu().Backend::moe_ffn(x.g, f, r.out.g);
            else
                gpu().moe_ffn(x.g, f, r.out.g);
        }
        return r;
    };
    const Run fused = run(false), composed = run(true);
    const std::string what = std::string("moe_ffn ") + std::string(type_name(m.gate)) + "/" +
                             std::string(type_name(m.down)) + (m.hash ? " hash" : " top-6") +
                             " n=" + std::to_string(m.n);
    const std::vector<int32_t> ge = read_gpu_ids(fused.experts.g);
    for (size_t i = 0; i < ge.size(); ++i) ASSERT_EQ(ge[i], fused.experts.c.i32()[i]) << what << " expert " << i;
    compare(what + " vs cpu", fused.out, 1e-2);
    compare(what + " vs its composition", read_gpu(composed.out.g).data(), read_gpu(fused.out.g),
            m.n == 1 ? 0.0 : 1e-5);
    compare(what + " weights vs its composition", read_gpu(composed.weights.g).data(), read_gpu(fused.weights.g), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MoeFfnOp,
                         ::testing::Values(MoeFfnCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, false, 1},
                                           MoeFfnCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, true, 1},
                                           MoeFfnCase{GgmlType::Q4_K, GgmlType::Q4_K, false, 1},
                                           MoeFfnCase{GgmlType::Q8_0, GgmlType::Q8_0, false, 1},
                                           MoeFfnCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, false, 3},
                                           MoeFfnCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, true, 4},
                                           MoeFfnCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, false, 16},
                                           MoeFfnCase{GgmlType::IQ2_XXS, GgmlType::Q2_K, false, 17}));

}  // namespace

int main(int argc, char ** argv) {
    if (cuda_device_count() == 0) {
        std::printf("no CUDA device: skipped\n");
        return 77;
    }
    std::printf("%s\n", cuda_device_summary().c_str());
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
