// Element-wise and per-row ops: weight re-layout, embedding rows, RMSNorm, RoPE, SwiGLU, the official FP8/FP4
// round trips, hyper-connections (mixing weights, Sinkhorn, stream sums), sampling candidates and the MoE router.
// Float arithmetic follows the CPU backend's expressions (double sums of squares, the same FP8/FP4 bit rules).
#include "backend/cuda/common.cuh"

#include <cooperative_groups.h>
#include <mma.h>

#include <cxxabi.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dsv4::cuda {

bool env_switch(const char * name, bool default_on) {
    const char * e = std::getenv(name);
    return e ? std::strcmp(e, "0") != 0 : default_on;
}

bool pdl_enabled() {
    static const bool on = env_switch("DSV4_CUDA_PDL", true);
    return on;
}

bool launch_skipped(const void * kernel) {
    static const std::vector<std::string> patterns = [] {
        std::vector<std::string> v;
        const char * e = std::getenv("DSV4_CUDA_SKIP");
        for (std::string_view rest = e ? e : ""; !rest.empty();) {
            const size_t comma = rest.find(',');
            if (comma != 0) v.emplace_back(rest.substr(0, comma));
            rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
        }
        return v;
    }();
    if (patterns.empty()) return false;
    static std::mutex mu;
    static std::unordered_map<const void *, bool> known;
    const std::lock_guard<std::mutex> lock(mu);
    if (const auto it = known.find(kernel); it != known.end()) return it->second;
    const char * mangled = nullptr;
    std::string name;
    if (cudaFuncGetName(&mangled, kernel) == cudaSuccess && mangled) {
        int status = 0;
        char * d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
        name = status == 0 && d ? d : mangled;
        std::free(d);
    }
    bool skip = false;
    for (const std::string & p : patterns) skip = skip || name.find(p) != std::string::npos;
    if (skip) std::fprintf(stderr, "cuda: DSV4_CUDA_SKIP: not launching %s\n", name.c_str());
    return known[kernel] = skip;
}

BlockSplit block_split(GgmlType type) {
    switch (type) {
        case GgmlType::Q8_0:
            return {34, 2, 32};
        case GgmlType::IQ2_XXS:
            return {66, 2, 64};
        case GgmlType::MXFP4:
            return {17, 1, 16};
        case GgmlType::Q2_K:
            return {84, 0, 80};
        default:
            return {0, 0, 0};
    }
}

namespace {

unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// ---------------------------------------------------------------------------------------------------------------------
// Weights and rows
// ---------------------------------------------------------------------------------------------------------------------
__global__ void repack_kernel(BlockSplit sp, const uint8_t * src, uint8_t * dst, int64_t first, int64_t n,
                              int64_t total) {
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint8_t * b = src + i * sp.block_bytes;
    const int64_t gb = first + i;
    uint8_t * pay = dst + gb * sp.payload_bytes;
    const int scale_bytes = sp.block_bytes - sp.payload_bytes;
    uint8_t * sc = dst + total * sp.payload_bytes + gb * scale_bytes;
    for (int j = 0; j < sp.payload_bytes; ++j) pay[j] = b[sp.payload_offset + j];
    int o = 0;
    for (int j = 0; j < sp.block_bytes; ++j)
        if (j < sp.payload_offset || j >= sp.payload_offset + sp.payload_bytes) sc[o++] = b[j];
}

// IQ2_XXS (kernels.h): the file block is d (2 bytes) and eight groups of (4 grid indices, a word of 28 sign bits and
// the 4-bit scale); the device's payload keeps the grid indices and reorders the word's bits, its scales are d.
__global__ void repack_iq2_kernel(const uint8_t * src, uint8_t * dst, int64_t first, int64_t n, int64_t total) {
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint8_t * b = src + i * 66;  // file blocks: 2-byte aligned only
    const int64_t gb = first + i;
    uint32_t * pay = reinterpret_cast<uint32_t *>(dst + gb * 64);
    for (int g = 0; g < 8; ++g) {
        uint32_t word[2];
        for (int w = 0; w < 2; ++w) {
            const uint8_t * p = b + 2 + 8 * g + 4 * w;
            word[w] = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
        }
        uint32_t signs = word[1] & 0xf0000000u;
        for (int run = 0; run < 4; ++run)
            for (int e = 0; e < 7; ++e) signs |= ((word[1] >> (7 * run + e)) & 1u) << (4 * e + run);
        pay[2 * g] = word[0];
        pay[2 * g + 1] = signs;
    }
    dst[total * 64 + 2 * gb] = b[0];
    dst[total * 64 + 2 * gb + 1] = b[1];
}

__global__ void fill_kernel(float * dst, int64_t n, float v) {
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = v;
}

__global__ void get_rows_kernel(WeightRef table, const int32_t * ids, float * out) {
    pdl_begin();
    const int64_t t = blockIdx.y;
    const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c < table.ne0) out[t * table.ne0 + c] = weight_element(table, ids[t], c);
}

// ---------------------------------------------------------------------------------------------------------------------
// Norms, RoPE, element-wise
// ---------------------------------------------------------------------------------------------------------------------
// A norm's weights (gamma: a weight, which no kernel writes) for this thread's elements threadIdx.x + j·blockDim.x,
// read before the kernel waits for the previous one: a one-token norm is a chain of round trips (x, its sum over
// the block, gamma), and this takes gamma's out of it. Rows wider than kNormRegs values a thread read gamma as
// they go; g then holds nothing.
constexpr int kNormRegs = 16;  // the decode rows: 4096 over 256 threads
__device__ __forceinline__ bool norm_in_regs(int64_t width) { return width <= int64_t(kNormRegs) * blockDim.x; }
__device__ __forceinline__ void load_gamma(const float * gamma, int64_t width, float (&g)[kNormRegs]) {
    if (!norm_in_regs(width)) return;
#pragma unroll
    for (int j = 0; j < kNormRegs; ++j) {
        const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
        g[j] = gamma && i < width ? gamma[i] : 1.0f;
    }
}

__global__ void rms_norm_kernel(const float * x, const float * gamma, float * y, int64_t width, float eps) {
    float g[kNormRegs];
    load_gamma(gamma, width, g);
    pdl_begin();
    __shared__ double red[32];
    const float * xr = x + int64_t(blockIdx.x) * width;
    float * yr = y + int64_t(blockIdx.x) * width;
    if (norm_in_regs(width)) {  // the same sums as the loop below: each thread's elements in order, then the block
        float v[kNormRegs];
#pragma unroll
        for (int j = 0; j < kNormRegs; ++j) {
            const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
            v[j] = i < width ? xr[i] : 0.0f;
        }
        double ss = 0;
#pragma unroll
        for (int j = 0; j < kNormRegs; ++j) ss += double(v[j]) * double(v[j]);
        ss = block_sum(ss, red);
        const float scale = 1.0f / sqrtf(float(ss / double(width)) + eps);
#pragma unroll
        for (int j = 0; j < kNormRegs; ++j) {
            const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
            if (i < width) yr[i] = gamma ? g[j] * (v[j] * scale) : v[j] * scale;
        }
        return;
    }
    double ss = 0;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) ss += double(xr[i]) * double(xr[i]);
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(float(ss / double(width)) + eps);
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = xr[i] * scale;
        yr[i] = gamma ? gamma[i] * v : v;
    }
}

__global__ void rope_kernel(float * x, int64_t n, int64_t heads, int64_t width, const float * inv_freq, int n_rot,
                            const int32_t * positions, bool inverse) {
    pdl_begin();
    const int half = n_rot / 2;
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n * heads * half) return;
    const int64_t pair = i % half, th = i / half, t = th / heads;
    rope_pair(x + th * width + (width - n_rot) + 2 * pair, float(positions[t]), inv_freq[pair], inverse);
}

// One block per (token, head) row of each target (target 0's rows first): RMSNorm, RoPE, FP8 rounding and the ring
// copy with the expressions of rms_norm_kernel (same block size for the same width: same sum order), rope_kernel,
// fp8_kernel and store_rows. A decode step's query heads and K=V row share a launch (one dependent step fewer).
__global__ void norm_rope_kernel(NormRopeArgs a) {
    extern __shared__ float row[];  // [width]
    __shared__ double red[32];
    int64_t th = blockIdx.x;
    int ti = 0;
    while (ti + 1 < a.n_targets && th >= a.n * a.t[ti].heads) th -= a.n * a.t[ti++].heads;
    const NormRopeRows & r = a.t[ti];
    const int64_t t = th / r.heads, h = th % r.heads, width = r.width;
    float g[kNormRegs];
    load_gamma(r.gamma, width, g);
    const float freq0 = rope_freq0(a.inv_freq, a.n_rot);
    const int32_t pos = a.positions[t];
    pdl_begin();
    float * xr = r.x + th * width;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
        row[i] = xr[i];
        ss += double(row[i]) * double(row[i]);
    }
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(float(ss / double(width)) + a.eps);
    if (norm_in_regs(width)) {
#pragma unroll
        for (int j = 0; j < kNormRegs; ++j) {
            const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
            if (i < width) row[i] = r.gamma ? g[j] * (row[i] * scale) : row[i] * scale;
        }
    } else {
        for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
            const float v = row[i] * scale;
            row[i] = r.gamma ? r.gamma[i] * v : v;
        }
    }
    __syncthreads();
    rope_row_shared(row, width, a.n_rot, a.inv_freq, freq0, float(pos));
    __syncthreads();
    if (r.fp8_dims > 0) fp8_row_shared(row, r.fp8_dims);
    float * ring = r.ring ? r.ring + ((int64_t(pos) % r.ring_rows) * r.heads + h) * width : nullptr;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
        xr[i] = row[i];
        if (ring) ring[i] = row[i];
    }
}

__global__ void add_kernel(const float * a, const float * b, float * out, int64_t n) {
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

__global__ void swiglu_kernel(const float * g, const float * u, float * out, int64_t n, float limit) {
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) out[i] = swiglu_one(g[i], u[i], limit);
}

// ---------------------------------------------------------------------------------------------------------------------
// FP8 / FP4 round trips
// ---------------------------------------------------------------------------------------------------------------------
// Blocks of 64 over [0, n_dims); a trailing partial block is rounded as a block of its own (as the CPU does).
__global__ void fp8_kernel(float * x, int64_t rows, int64_t width, int64_t n_dims) {
    pdl_begin();
    const int64_t full = n_dims / 64, per_row = full + (n_dims > full * 64 ? 1 : 0);
    const int64_t blk = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (blk >= rows * per_row) return;
    const int64_t r = blk / per_row, b = blk % per_row;
    const int len = b < full ? 64 : int(n_dims - full * 64);
    roundtrip_block<true>(x + r * width + b * 64, len);
}

// One block per row; the row is staged in shared memory (width floats).
__global__ void hadamard_fp4_kernel(float * x, int64_t width) {
    pdl_begin();
    extern __shared__ float row[];
    float * xr = x + int64_t(blockIdx.x) * width;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) row[i] = xr[i];
    __syncthreads();
    hadamard_fp4_shared(row, width);
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) xr[i] = row[i];
}

// ---------------------------------------------------------------------------------------------------------------------
// Hyper-connections
// ---------------------------------------------------------------------------------------------------------------------
constexpr int kMaxMix = 48;
constexpr int kHcChunk = 256;  // stream-row values per partial block: 64 blocks for one V4 token
constexpr int kThreadsHc = 256;

__global__ void hc_expand_kernel(const float * x, float * streams, int64_t n, int64_t hc, int64_t width) {
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n * hc * width) return;
    const int64_t t = i / (hc * width), c = i % width;
    streams[i] = x[t * width + c];
}

__host__ __device__ inline int64_t mix_record(int64_t n_mix) {
    return 2 + n_mix + (n_mix & 1);
}  // [double ss][n_mix floats], 8-aligned

// The mixing matrix is F16 in every quantized file and F32 in f32 ones; other types take the generic path.
enum class FnKind { f16, f32, any };

template <FnKind K>
__device__ __forceinline__ float fn_element(const WeightRef & w, int64_t r, int64_t e) {
    if constexpr (K == FnKind::f16)
        return f16_bits_to_f32(reinterpret_cast<const uint16_t *>(w.data)[r * w.ne0 + e]);
    else if constexpr (K == FnKind::f32)
        return reinterpret_cast<const float *>(w.data)[r * w.ne0 + e];
    else
        return weight_element(w, r, e);
}

// Partial sums of x·x (double) and fn·x over one chunk (kHcChunk elements) of the hc·D stream rows, two ways:
// hc_rows_kernel below for a few tokens (decode), the tiles here for a prefill chunk.
//
// Prefill: the chunk's mixing weights and kHcTokensPerBlock tokens' values go to shared memory once. A warp then
// owns four mixing rows for all 16 tokens: each lane a 4-token × 4-row tile over every eighth column of the chunk,
// so that each value read from shared memory serves four products (one read per product before), and the eight
// lanes of a tile add their sums by shuffles. One more warp sums the tokens' squares (double). No warp diverges:
// every lane of a warp works on the same rows.
constexpr int kHcTokensPerBlock = 16;
constexpr int kHcLdX = kHcChunk + 2;  // token rows two banks apart: 4 token groups × 8 column slices hit 32 banks
constexpr int kHcLdF = kHcChunk + 1;  // mixing rows

size_t hc_tiles_smem(int n_mix) {
    return (size_t((n_mix + 3) / 4 * 4) * kHcLdF + size_t(kHcTokensPerBlock) * kHcLdX) * sizeof(float);
}

template <FnKind K>
__global__ void hc_partial_tiles_kernel(HcArgs a, int n_mix) {
    static_assert(kHcTokensPerBlock == 16 && kHcChunk % 8 == 0, "the lane tiling below");
    pdl_begin();
    extern __shared__ float hc_smem[];
    const int groups = (n_mix + 3) / 4;
    float * fn = hc_smem;                        // [groups · 4][kHcLdF], rows past n_mix zero
    float * xs = hc_smem + groups * 4 * kHcLdF;  // [kHcTokensPerBlock][kHcLdX], tokens past the end zero
    const int64_t len = a.hc * a.width;
    const int64_t chunk = blockIdx.x, e0 = chunk * kHcChunk;
    const int width = int(min(int64_t(kHcChunk), len - e0));
    const int64_t t0 = int64_t(blockIdx.y) * kHcTokensPerBlock;
    const int n_tok = int(min(int64_t(kHcTokensPerBlock), a.n - t0));
    for (int i = threadIdx.x; i < groups * 4 * kHcChunk; i += blockDim.x) {
        const int r = i / kHcChunk, c = i % kHcChunk;
        fn[r * kHcLdF + c] = r < n_mix && c < width ? fn_element<K>(a.fn, r, e0 + c) : 0.0f;
    }
    for (int i = threadIdx.x; i < kHcTokensPerBlock * kHcChunk; i += blockDim.x) {
        const int t = i / kHcChunk, c = i % kHcChunk;
        xs[t * kHcLdX + c] = t < n_tok && c < width ? a.streams[(t0 + t) * len + e0 + c] : 0.0f;
    }
    __syncthreads();
    const int64_t rec = mix_record(n_mix);
    auto record = [&](int t) { return a.partial + ((t0 + t) * gridDim.x + chunk) * rec; };
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int g = warp; g <= groups; g += kThreadsHc / 32) {
        if (g < groups) {
            const int tg = lane / 8, slice = lane % 8;  // tokens 4tg .. 4tg + 3, columns slice, slice + 8, ...
            float acc[4][4] = {};
            for (int c = slice; c < kHcChunk; c += 8) {
                float xv[4], fv[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) xv[i] = xs[(4 * tg + i) * kHcLdX + c];
#pragma unroll
                for (int j = 0; j < 4; ++j) fv[j] = fn[(4 * g + j) * kHcLdF + c];
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(xv[i], fv[j], acc[i][j]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int o = 1; o < 8; o <<= 1) acc[i][j] += __shfl_xor_sync(kFull, acc[i][j], o);
            if (slice == 0)
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (4 * tg + i < n_tok && 4 * g + j < n_mix) record(4 * tg + i)[2 + 4 * g + j] = acc[i][j];
        } else {
            const int t = lane / 2, half = lane % 2;  // token t, every other column
            double ss = 0;
            for (int c = half; c < kHcChunk; c += 2) {
                const double v = xs[t * kHcLdX + c];
                ss += v * v;
            }
            ss += __shfl_xor_sync(kFull, ss, 1);
            if (half == 0 && t < n_tok) *reinterpret_cast<double *>(record(t)) = ss;
        }
    }
}

// Prefill with an F16 mixing matrix (every quantized file) on the tensor cores: fn·x of 16 tokens over a chunk as
// f16 products with f32 sums (WMMA 16×16×16), x split into two f16 parts, hi = f16(x) and lo = f16(x - hi), so a
// product keeps about 22 of x's 24 bits (fn is f16 already). The block's x is first scaled by a power of two that
// brings its largest magnitude to [2^14, 2^15), clear of f16's range limit (and of its subnormals, for small
// values), and the sums scaled back. The FFMA tiles above are bound by their shared-memory reads (an 8K chunk:
// ~1 ms a call); these by reading x. Warp w takes columns 32w .. 32w + 31 of the chunk for both 16-row tiles of
// mixing rows; the eight warps' sums meet in shared memory.
constexpr int kHcTcRows = 32;          // mixing rows, padded to two WMMA tiles (n_mix <= 32)
constexpr int kHcTcLd = kHcChunk + 8;  // halves per shared row: 16-byte aligned, rows 4 banks apart
static_assert(kHcChunk == 256 && kThreadsHc == 256 && kHcTokensPerBlock == 16, "the staging and warp layout below");

__global__ void __launch_bounds__(kThreadsHc) hc_partial_tc_kernel(HcArgs a, int n_mix) {
    using namespace nvcuda;
    __shared__ __align__(32) half fn_s[kHcTcRows * kHcTcLd];
    __shared__ __align__(32) half x_s[2][kHcTokensPerBlock * kHcTcLd];  // hi, lo; then the warps' sums
    __shared__ double ss_s[kHcTokensPerBlock][2];
    __shared__ float max_s[kThreadsHc / 32];
    static_assert(sizeof(x_s) >= kThreadsHc / 32 * kHcTokensPerBlock * kHcTcRows * sizeof(float), "sums fit");
    const int64_t len = a.hc * a.width;
    const int64_t chunk = blockIdx.x, e0 = chunk * kHcChunk;
    const int width = int(min(int64_t(kHcChunk), len - e0));
    const int64_t t0 = int64_t(blockIdx.y) * kHcTokensPerBlock;
    const int n_tok = int(min(int64_t(kHcTokensPerBlock), a.n - t0));
    const uint16_t * fn = reinterpret_cast<const uint16_t *>(a.fn.data);
    // The chunk's mixing columns (weights: before the wait), 8 at a time where the chunk is whole and the rows stay
    // 16-byte aligned; rows past n_mix and columns past the end zero.
    const bool whole = width == kHcChunk;
    if (whole && a.fn.ne0 % 8 == 0 && (reinterpret_cast<uintptr_t>(fn) & 15) == 0) {
        // The rows past n_mix take a loop of their own, so no load is formed for them: a guarded __ldg was issued
        // anyway in attention_tc_kernel (address 0, session 26).
        constexpr int kGroups = kHcChunk / 8;
        for (int i = threadIdx.x; i < n_mix * kGroups; i += kThreadsHc) {
            const int r = i / kGroups, c = i % kGroups * 8;
            *reinterpret_cast<uint4 *>(fn_s + r * kHcTcLd + c) =
                __ldg(reinterpret_cast<const uint4 *>(fn + r * a.fn.ne0 + e0 + c));
        }
        for (int i = n_mix * kGroups + threadIdx.x; i < kHcTcRows * kGroups; i += kThreadsHc)
            *reinterpret_cast<uint4 *>(fn_s + i / kGroups * kHcTcLd + i % kGroups * 8) = make_uint4(0, 0, 0, 0);
    } else {
        for (int i = threadIdx.x; i < kHcTcRows * kHcChunk; i += kThreadsHc) {
            const int r = i / kHcChunk, c = i % kHcChunk;
            fn_s[r * kHcTcLd + c] = __ushort_as_half(r < n_mix && c < width ? fn[r * a.fn.ne0 + e0 + c] : uint16_t(0));
        }
    }
    pdl_begin();
    // x: thread i stages columns 4 (i % 64) .. + 3 of tokens i / 64 + 4k, k < 4 (a warp reads 512 contiguous bytes
    // per load); the sums of squares (double) per token over its two warps.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c4 = threadIdx.x % 64 * 4;
    const bool vec_x = whole && len % 4 == 0;
    float v[4][4];
    double ss[4];
    float amax = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int t = threadIdx.x / 64 + 4 * k;
        const float * xr = a.streams + (t0 + t) * len + e0 + c4;
        if (vec_x) {
            const float4 f = t < n_tok ? *reinterpret_cast<const float4 *>(xr) : make_float4(0, 0, 0, 0);
            v[k][0] = f.x, v[k][1] = f.y, v[k][2] = f.z, v[k][3] = f.w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) v[k][j] = t < n_tok && c4 + j < width ? xr[j] : 0.0f;
        }
        ss[k] = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            ss[k] += double(v[k][j]) * double(v[k][j]);
            amax = fmaxf(amax, fabsf(v[k][j]));
        }
        ss[k] = warp_sum(ss[k]);
    }
    if (lane == 0)
#pragma unroll
        for (int k = 0; k < 4; ++k) ss_s[threadIdx.x / 64 + 4 * k][warp % 2] = ss[k];
    amax = warp_max(amax);
    if (lane == 0) max_s[warp] = amax;
    __syncthreads();
    amax = 0;
    for (int w = 0; w < kThreadsHc / 32; ++w) amax = fmaxf(amax, max_s[w]);
    const int shift = amax > 0.0f ? 14 - ilogbf(amax) : 0;  // x·2^shift has its largest magnitude in [2^14, 2^15)
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int at = (threadIdx.x / 64 + 4 * k) * kHcTcLd + c4 + j;
            const float xv = ldexpf(v[k][j], shift);
            const half hi = __float2half_rn(xv);
            x_s[0][at] = hi;
            x_s[1][at] = __float2half_rn(xv - __half2float(hi));
        }
    __syncthreads();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
    wmma::fill_fragment(acc[0], 0.0f);
    wmma::fill_fragment(acc[1], 0.0f);
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
        const int k0 = warp * 32 + ks * 16;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> b[2];
        wmma::load_matrix_sync(b[0], fn_s + k0, kHcTcLd);
        wmma::load_matrix_sync(b[1], fn_s + 16 * kHcTcLd + k0, kHcTcLd);
#pragma unroll
        for (int part = 0; part < 2; ++part) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> xa;
            wmma::load_matrix_sync(xa, x_s[part] + k0, kHcTcLd);
            wmma::mma_sync(acc[0], xa, b[0], acc[0]);
            wmma::mma_sync(acc[1], xa, b[1], acc[1]);
        }
    }
    __syncthreads();
    float * sums = reinterpret_cast<float *>(x_s);  // [warp][token][row]
    wmma::store_matrix_sync(sums + warp * kHcTokensPerBlock * kHcTcRows, acc[0], kHcTcRows, wmma::mem_row_major);
    wmma::store_matrix_sync(sums + warp * kHcTokensPerBlock * kHcTcRows + 16, acc[1], kHcTcRows, wmma::mem_row_major);
    __syncthreads();
    const int64_t rec = mix_record(n_mix);
    auto record = [&](int t) { return a.partial + ((t0 + t) * gridDim.x + chunk) * rec; };
    for (int i = threadIdx.x; i < kHcTokensPerBlock * kHcTcRows; i += kThreadsHc) {
        const int t = i / kHcTcRows, r = i % kHcTcRows;
        if (t >= n_tok || r >= n_mix) continue;
        float s = 0;
        for (int w = 0; w < kThreadsHc / 32; ++w) s += sums[(w * kHcTokensPerBlock + t) * kHcTcRows + r];
        record(t)[2 + r] = ldexpf(s, -shift);
    }
    if (int(threadIdx.x) < n_tok)
        *reinterpret_cast<double *>(record(threadIdx.x)) = ss_s[threadIdx.x][0] + ss_s[threadIdx.x][1];
}

// Sinkhorn on hc×hc (source i, destination j), as the CPU backend: row softmax + eps, a column normalisation,
// then (iters - 1) rounds of row then column normalisation, each denominator plus eps.
__device__ void sinkhorn(float * c, int hc, int iters, float eps) {
    for (int i = 0; i < hc; ++i) {
        float * row = c + i * hc;
        float m = row[0];
        for (int j = 1; j < hc; ++j) m = fmaxf(m, row[j]);
        float s = 0;
        for (int j = 0; j < hc; ++j) s += row[j] = expf(row[j] - m);
        for (int j = 0; j < hc; ++j) row[j] = row[j] / s + eps;
    }
    for (int j = 0; j < hc; ++j) {
        float s = 0;
        for (int i = 0; i < hc; ++i) s += c[i * hc + j];
        for (int i = 0; i < hc; ++i) c[i * hc + j] /= s + eps;
    }
    for (int it = 1; it < iters; ++it) {
        for (int i = 0; i < hc; ++i) {
            float s = 0;
            for (int j = 0; j < hc; ++j) s += c[i * hc + j];
            for (int j = 0; j < hc; ++j) c[i * hc + j] /= s + eps;
        }
        for (int j = 0; j < hc; ++j) {
            float s = 0;
            for (int i = 0; i < hc; ++i) s += c[i * hc + j];
            for (int i = 0; i < hc; ++i) c[i * hc + j] /= s + eps;
        }
    }
}

// The same Sinkhorn for hc = 4 (V4's stream count) by 16 lanes of one warp, lane 4i + j owning c[i][j]: row sums
// over lanes xor 1, 2 and column sums over lanes xor 4, 8 replace the serial loops (the serial version is a chain
// of ~2000 dependent divisions per call).
__device__ float sinkhorn4(float c, int iters, float eps) {
    const int lane = threadIdx.x & 31;
    auto row_sum = [](float v) {
        v += __shfl_xor_sync(kFull, v, 1);
        return v + __shfl_xor_sync(kFull, v, 2);
    };
    auto col_sum = [](float v) {
        v += __shfl_xor_sync(kFull, v, 4);
        return v + __shfl_xor_sync(kFull, v, 8);
    };
    float m = c;
    m = fmaxf(m, __shfl_xor_sync(kFull, m, 1));
    m = fmaxf(m, __shfl_xor_sync(kFull, m, 2));
    c = expf(c - m);
    c = c / row_sum(c) + eps;
    c /= col_sum(c) + eps;
    for (int it = 1; it < iters; ++it) {
        c /= row_sum(c) + eps;
        c /= col_sum(c) + eps;
    }
    return lane < 16 ? c : 0.0f;
}

// Decode (fewer than kHcRowsTokens tokens) where the cluster kernel below does not run (a GPU without clusters of
// 16 blocks, a row too wide for one block, hc != 4): one kernel per sublayer boundary, where a partial kernel and a
// one-block finish ran before (and, for a fused HCPost, a third kernel). A block owns kHcChunk elements of one
// token's hc·D stream row: it first applies the previous sublayer's HCPost to them when asked (the same sum as
// hc_post_kernel), then reduces their products with the n_mix mixing rows and their squares into the token's
// partial record. The block that completes a token's records (a counter per token) does the finish. A decode step
// has one token, so every step here is serial latency: the fusion saves two launches per boundary, and the weights
// a block needs (its mixing columns, the scales and biases) are read before it waits for the previous kernel.
constexpr int kHcRowsCols = 19;  // y columns per thread held in registers: D <= 19 · 224 = 4256 with hc = 4

// The norm's weights join y's row in the finish's dynamic shared memory when both fit in 48 KB.
__host__ __device__ inline bool hc_rows_norm_in_smem(int64_t width) { return width * 8 <= 48 * 1024; }

struct HcRowsShared {
    float red[kThreadsHc / 32][kMaxMix];
    double red_ss[kThreadsHc / 32];
    float mix[kMaxMix];
    float w[16];
    float comb[256];
    double ss_total;
    bool last;
};

// The block's warp partials summed in warp order: row r's mixing sum by thread r < n_mix (row(r, sum)) and the
// squares' double by thread ss_thread (squares(sum)). The rows kernel's records and the finish's totals both end so.
template <class Row, class Squares>
__device__ __forceinline__ void sum_warp_partials(const HcRowsShared & sh, int n_mix, int ss_thread, Row row,
                                                  Squares squares) {
    const int r = int(threadIdx.x);
    if (r < n_mix) {
        float s = 0;
        for (int w = 0; w < kThreadsHc / 32; ++w) s += sh.red[w][r];
        row(r, s);
    }
    if (r == ss_thread) {
        double ss = 0;
        for (int w = 0; w < kThreadsHc / 32; ++w) ss += sh.red_ss[w];
        squares(ss);
    }
}

// Thread r's mixing weight's bias and scale (weights: read before the block waits for the previous kernel).
struct HcMixParam {
    float bias = 0.0f, scale = 0.0f;
};
__device__ __forceinline__ HcMixParam hc_mix_param(const HcArgs & a, int n_mix) {
    const int r = int(threadIdx.x);
    if (r >= n_mix) return {};
    return {a.base[r], a.scale[a.head ? 0 : min(r / int(a.hc), 2)]};
}

// The finish of token t by one block of kThreadsHc threads: the chunk sums (from shared memory, in a fixed order),
// the mixing weights a thread each, then Sinkhorn on warp 0 (hc = 4) beside y and its norm on the other warps, which
// meet at a named barrier that warp 0 does not join. kRegs holds the token's streams in registers (decode: the
// one block's loads all in flight at once); a prefill's blocks, many per multiprocessor, load them as they go.
template <bool kRegs>
__device__ void hc_finish_token(const HcArgs & a, int n_mix, int chunks, int64_t t, HcMixParam mp, HcRowsShared & sh) {
    const int hc = int(a.hc);
    const int64_t rec = mix_record(n_mix), len = a.hc * a.width;
    const float * part = a.partial + t * chunks * rec;
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    const bool sinkhorn_warp = !a.head && hc == 4;
    const int y0 = sinkhorn_warp ? 32 : 0, y_threads = kThreadsHc - y0, yt = int(threadIdx.x) - y0;
    // Other blocks wrote the records and (fused HCPost) the streams: read through L2, not a stale L1 line. The
    // records come first, in one batch of coalesced loads (7 a thread for V4) issued before the streams' loads so
    // that they do not queue behind them (a warp per mixing row, loading as it summed, took 3 µs of each boundary).
    extern __shared__ __align__(16) float smem_f[];
    float * recs = smem_f;                // [chunks][rec] the partial records
    float * row = smem_f + chunks * rec;  // [width] y before the norm's scale (normed y only)
    float * norm_w = a.norm && hc_rows_norm_in_smem(a.width) ? row + a.width : nullptr;  // the norm's weights
    const int total = chunks * int(rec);
    for (int i0 = 0; i0 < total; i0 += 8 * kThreadsHc) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = i0 + j * kThreadsHc + int(threadIdx.x);
            v[j] = i < total ? __ldcg(part + i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = i0 + j * kThreadsHc + int(threadIdx.x);
            if (i < total) recs[i] = v[j];
        }
    }
    const float * x = a.streams + t * len;
    const bool in_regs = kRegs && hc == 4 && a.width <= int64_t(kHcRowsCols) * y_threads;
    float xs[kRegs ? kHcRowsCols : 1][4];
    if constexpr (kRegs)
        if (in_regs && yt >= 0)
#pragma unroll
            for (int j = 0; j < kHcRowsCols; ++j) {
                const int64_t c = yt + int64_t(j) * y_threads;
#pragma unroll
                for (int h = 0; h < 4; ++h) xs[j][h] = c < a.width ? __ldcg(x + h * a.width + c) : 0.0f;
            }
    // The norm's weights travel to shared memory meanwhile (no registers held), each thread's own columns.
    if (norm_w && yt >= 0) {
        for (int64_t c = yt; c < a.width; c += y_threads) cp_async4(norm_w + c, a.norm + c);
        cp_async_commit();
    }
    __syncthreads();
    // Each row's sum over the chunks in a fixed order: warp w sums chunks w, w + 8, ... (a lane per row, the last
    // lane also the squares' double), then one thread per row adds the eight.
    for (int r = lane; r < n_mix; r += 32) {
        float s = 0;
        for (int c = warp; c < chunks; c += kThreadsHc / 32) s += recs[c * rec + 2 + r];
        sh.red[warp][r] = s;
    }
    if (lane == 31) {
        double ss = 0;
        for (int c = warp; c < chunks; c += kThreadsHc / 32) ss += *reinterpret_cast<const double *>(recs + c * rec);
        sh.red_ss[warp] = ss;
    }
    __syncthreads();
    sum_warp_partials(
        sh, n_mix, kThreadsHc - 1, [&](int r, float s) { sh.mix[r] = s; }, [&](double ss) { sh.ss_total = ss; });
    __syncthreads();
    if (int(threadIdx.x) < n_mix) {
        const int r = int(threadIdx.x);
        const float m = sh.mix[r] * (1.0f / sqrtf(float(sh.ss_total / double(len)) + a.eps_norm));
        if (r < hc)
            sh.w[r] = sigmoidf_(m * mp.scale + mp.bias) + a.eps_hc;
        else if (r < 2 * hc)
            a.post[t * hc + r - hc] = 2.0f * sigmoidf_(m * mp.scale + mp.bias);
        else
            sh.comb[r - 2 * hc] = m * mp.scale + mp.bias;
    }
    __syncthreads();
    if (!a.head && hc != 4) {
        if (threadIdx.x == 0) {
            sinkhorn(sh.comb, hc, a.iters, a.eps_hc);
            for (int i = 0; i < hc * hc; ++i) a.comb[t * hc * hc + i] = sh.comb[i];
        }
    } else if (sinkhorn_warp && warp == 0) {
        const float c = sinkhorn4(lane < 16 ? sh.comb[lane] : 0.0f, a.iters, a.eps_hc);
        if (lane < 16) a.comb[t * 16 + lane] = c;
        return;
    }
    float * y = a.y + t * a.width;
    // f(c, s) for this thread's columns c with their weighted sums s, from registers (an unrolled loop, so that xs
    // stays in registers) or memory; the sum order over h is the same either way.
    auto each_column = [&](auto && f) {
        if (kRegs && in_regs) {
#pragma unroll
            for (int j = 0; j < (kRegs ? kHcRowsCols : 1); ++j) {
                const int64_t c = yt + int64_t(j) * y_threads;
                float s = 0;
#pragma unroll
                for (int h = 0; h < 4; ++h) s += sh.w[h] * xs[j][h];
                if (c < a.width) f(c, s);
            }
        } else {
            for (int64_t c = yt; c < a.width; c += y_threads) {
                float s = 0;
                if (hc == 4) {  // the four loads issued together
                    float v[4];
#pragma unroll
                    for (int h = 0; h < 4; ++h) v[h] = __ldcg(x + h * a.width + c);
#pragma unroll
                    for (int h = 0; h < 4; ++h) s += sh.w[h] * v[h];
                } else {
                    for (int h = 0; h < hc; ++h) s += sh.w[h] * __ldcg(x + h * a.width + c);
                }
                f(c, s);
            }
        }
    };
    if (!a.norm) {
        each_column([&](int64_t c, float s) { y[c] = s; });
        return;
    }
    // The sublayer's input norm, as rms_norm_kernel computes it (in double, then scaled in f32); y waits in shared
    // memory for the scale.
    double ss = 0;
    each_column([&](int64_t c, float s) {
        row[c] = s;
        ss += double(s) * double(s);
    });
    ss = warp_sum(ss);
    if (lane == 0) sh.red_ss[warp] = ss;
    asm volatile("bar.sync 1, %0;" ::"r"(y_threads) : "memory");
    ss = 0;
    for (int i = y0 / 32; i < kThreadsHc / 32; ++i) ss += sh.red_ss[i];
    const float scale = 1.0f / sqrtf(float(ss / double(a.width)) + a.eps_norm);
    if (norm_w) cp_async_wait<0>();
    const float * nw = norm_w ? norm_w : a.norm;
    for (int64_t c = yt; c < a.width; c += y_threads) y[c] = nw[c] * (row[c] * scale);
}

// kMix: the mixing rows' count when known at compile time (V4's 24 of a sublayer boundary), else 0 (n_mix).
template <FnKind K, int kMix>
__global__ void __launch_bounds__(kThreadsHc) hc_rows_kernel(HcArgs a, int n_mix, int chunks) {
    static_assert(kHcChunk == kThreadsHc, "a thread owns one element of the chunk");
    __shared__ HcRowsShared sh;
    if constexpr (kMix > 0) n_mix = kMix;
    const int64_t len = a.hc * a.width;
    const int64_t chunk = blockIdx.x, t = blockIdx.y, e = chunk * kHcChunk + threadIdx.x;
    const bool inside = e < len;
    const int hc = int(a.hc);
    float fn[kMaxMix];
#pragma unroll
    for (int r = 0; r < kMaxMix; ++r) fn[r] = inside && r < n_mix ? fn_element<K>(a.fn, r, e) : 0.0f;
    const int r = int(threadIdx.x);
    const HcMixParam mp = hc_mix_param(a, n_mix);
    pdl_begin();
    float v = 0.0f;
    if (inside) {
        if (a.post_streams) {
            const int64_t h = e / a.width, c = e % a.width;
            const float * ct = a.comb + t * hc * hc;
            float s = a.post[t * hc + h] * a.post_o[t * a.width + c];
            for (int k = 0; k < hc; ++k) s += ct[k * hc + h] * a.post_streams[(t * hc + k) * a.width + c];
            a.streams[t * len + e] = v = s;
        } else {
            v = a.streams[t * len + e];
        }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // With kMix the rows' warp sums are independent chains of shuffles the compiler interleaves; with a runtime
    // count each ends in a branch, and the 24 chains of five dependent shuffles ran one after another (session 12:
    // a V4 boundary 13.7 → 10.6 µs in the decode graph).
#pragma unroll
    for (int i = 0; i < (kMix > 0 ? kMix : kMaxMix); ++i) {
        if (kMix == 0 && i >= n_mix) break;
        const float s = warp_sum(fn[i] * v);
        if (lane == 0) sh.red[warp][i] = s;
    }
    const double ss = warp_sum(double(v) * double(v));
    if (lane == 0) sh.red_ss[warp] = ss;
    __syncthreads();
    const int64_t rec = mix_record(n_mix);
    float * out = a.partial + (t * chunks + chunk) * rec;
    sum_warp_partials(
        sh, n_mix, 0, [&](int i, float s) { out[2 + i] = s; },
        [&](double ss) { *reinterpret_cast<double *>(out) = ss; });
    // Every writer's stores are visible device-wide before its block counts itself done.
    __threadfence();
    __syncthreads();
    if (r == 0) {
        sh.last = atomicAdd(a.done + t, 1u) == unsigned(chunks - 1);
        if (sh.last) a.done[t] = 0;  // every block of the token has counted: ready for the next launch
    }
    __syncthreads();
    if (sh.last) hc_finish_token<true>(a, n_mix, chunks, t, mp, sh);
}

// Decode by a cluster of kHcClusterBlocks blocks per token (hc = 4): a thread owns one column of the four streams
// and holds its 4 · n_mix mixing weights in registers (read before the wait). Each block pushes its mixing sums and
// the four streams' Gram matrix G (10 sums; its trace is the squares' sum) into every block's shared memory, and
// after one cluster barrier each block has the token's totals: the mixing weights w, and y's squares without a
// second pass, Σ_c y_c² = wᵀ G w. The rows kernel above spent a fence, a counter and a one-block finish reading the
// streams back from L2. comb receives Sinkhorn's input, the logits: its 20 rounds were this kernel's tail (~2.5 µs
// after y), and hc_sinkhorn, launched by the backend on a second stream, runs them beside the next sublayer.
constexpr int kHcClusterBlocks = 16;
constexpr int kHcClusterMaxWarps = 32;
constexpr int kGram = 10;  // G[h][k], h <= k, row by row

struct HcClusterShared {
    float part[kHcClusterBlocks][kMaxMix];   // [rank][row] the blocks' mixing sums, pushed by their owners
    double part_g[kHcClusterBlocks][kGram];  // [rank][] the blocks' Gram matrices
    float red[kHcClusterMaxWarps][kMaxMix];  // [warp][row] this block's warp sums
    double red_g[kHcClusterMaxWarps][kGram];
    double gram[kGram];  // the token's
    float w[4];
};

// Threads of a block: a column each, rounded to whole warps, and at least the kMaxMix + kGram that sum the totals.
int hc_cluster_columns(int64_t width) {
    return std::max(64, int((width + kHcClusterBlocks - 1) / kHcClusterBlocks + 31) / 32 * 32);
}
static_assert(kMaxMix + kGram <= 64);

template <FnKind K, int kMix>
__global__ void hc_cluster_kernel(HcArgs a) {
    __shared__ HcClusterShared sh;
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    const int rank = int(cluster.block_rank());
    const int64_t W = a.width, t = blockIdx.y;
    const int cols = int(blockDim.x), tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
    const int col_warps = cols / 32;
    const int64_t c = int64_t(rank) * cols + tid;
    const bool inside = c < W;
    float fn[kMix][4];
#pragma unroll
    for (int r = 0; r < kMix; ++r)
#pragma unroll
        for (int h = 0; h < 4; ++h) fn[r][h] = inside ? fn_element<K>(a.fn, r, h * W + c) : 0.0f;
    const float norm_w = inside && a.norm ? a.norm[c] : 0.0f;
    const HcMixParam mp = hc_mix_param(a, kMix);
    // comb was final long before, so it is read before the wait too: its Sinkhorn ran beside the sublayer (the poll),
    // or, with nothing pending, the backend's memset of the count ahead of this launch waited for every kernel before.
    // Every block polls (thread 0, then a barrier) before pdl_begin lets the next kernel launch, including blocks
    // whose columns lie past the row. When only the threads that read comb polled, a narrow row's other blocks let
    // the sublayer after this boundary launch while it still polled; that chain, resident and waiting on this
    // boundary, then kept the Sinkhorn from ever running (session 19: a test fixture trapped here, two boundaries
    // polling at once). With nothing launched after it, a polling boundary waits only on work that needs nothing
    // from it: the Sinkhorn, whose own inputs are complete.
    float ct[16];
    if (a.post_streams && a.sinkhorns_wait) {
        if (tid == 0)
            for (unsigned polls = 0; count_acquire(a.sinkhorns) < a.sinkhorns_wait; ++polls)
                if (polls == 1u << 24) {  // ~3 s: a Sinkhorn that never launched fails loudly, never hangs
                    printf("dsv4: boundary of token %d waited for %u Sinkhorns, %u done\n", int(t), a.sinkhorns_wait,
                           count_acquire(a.sinkhorns));
                    __trap();
                }
        __syncthreads();
    }
    if (a.post_streams && inside)
#pragma unroll
        for (int i = 0; i < 16; ++i) ct[i] = __ldcg(a.comb + t * 16 + i);
    pdl_begin();
    float x[4] = {};
    if (inside) {
        if (a.post_streams) {  // hc_post_kernel's sum
            const float ov = a.post_o[t * W + c];
            float ps[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) ps[k] = a.post_streams[(t * 4 + k) * W + c];
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                float v = a.post[t * 4 + h] * ov;
#pragma unroll
                for (int k = 0; k < 4; ++k) v += ct[k * 4 + h] * ps[k];
                x[h] = v;
                a.streams[(t * 4 + h) * W + c] = v;
            }
        } else {
#pragma unroll
            for (int h = 0; h < 4; ++h) x[h] = a.streams[(t * 4 + h) * W + c];
        }
    }
    // The warp sums spread over the lanes (each row's total stored by one lane, lane 0's value in warp_sum): the 24
    // rows' and 10 Gram sums as 5 · 34 shuffles each were most of a boundary's instructions.
    constexpr int kMixSlots = kMix <= 4 ? 4 : kMix <= 8 ? 8 : kMix <= 16 ? 16 : 32, kGramSlots = 16;
    static_assert(kMix <= kMixSlots && kGram <= kGramSlots);
    float p[kMixSlots];
#pragma unroll
    for (int r = 0; r < kMixSlots; ++r) {
        p[r] = 0.0f;
        if (r < kMix)
#pragma unroll
            for (int h = 0; h < 4; ++h) p[r] += fn[r][h] * x[h];
    }
    warp_sums_to(p, kMix, sh.red[warp], lane);
    double gv[kGramSlots];
#pragma unroll
    for (int h = 0, g = 0; h < 4; ++h)
#pragma unroll
        for (int k = h; k < 4; ++k, ++g) gv[g] = double(x[h]) * double(x[k]);
#pragma unroll
    for (int g = kGram; g < kGramSlots; ++g) gv[g] = 0.0;
    warp_sums_to(gv, kGram, sh.red_g[warp], lane);
    __syncthreads();
    for (int i = tid; i < kHcClusterBlocks * (kMix + kGram); i += int(blockDim.x)) {
        const int dst = i / (kMix + kGram), r = i % (kMix + kGram);
        if (r < kMix) {
            float v = 0.0f;
            for (int w = 0; w < col_warps; ++w) v += sh.red[w][r];
            *cluster.map_shared_rank(&sh.part[rank][r], dst) = v;
        } else {
            double v = 0;
            for (int w = 0; w < col_warps; ++w) v += sh.red_g[w][r - kMix];
            *cluster.map_shared_rank(&sh.part_g[rank][r - kMix], dst) = v;
        }
    }
    // Every push lands before any block reads its totals; none is made after, so a block may exit when done.
    cluster_arrive();
    cluster_wait();
    if (tid < kMix) {
        float v = 0.0f;
        double ss = 0;
        for (int b = 0; b < kHcClusterBlocks; ++b) {
            v += sh.part[b][tid];
            ss += (sh.part_g[b][0] + sh.part_g[b][4]) + (sh.part_g[b][7] + sh.part_g[b][9]);
        }
        const float m = v * (1.0f / sqrtf(float(ss / double(4 * W)) + a.eps_norm)), z = m * mp.scale + mp.bias;
        if (tid < 4)
            sh.w[tid] = sigmoidf_(z) + a.eps_hc;
        else if (tid < 8 && rank == 0)
            a.post[t * 4 + tid - 4] = 2.0f * sigmoidf_(z);
        if (tid >= 8 && rank == 0) a.comb[t * 16 + tid - 8] = z;
    } else if (tid < kMix + kGram) {
        double v = 0;
        for (int b = 0; b < kHcClusterBlocks; ++b) v += sh.part_g[b][tid - kMix];
        sh.gram[tid - kMix] = v;
    }
    __syncthreads();
    float v = 0.0f;
#pragma unroll
    for (int h = 0; h < 4; ++h) v += sh.w[h] * x[h];
    if (a.norm) {
        double yy = 0;
#pragma unroll
        for (int h = 0, g = 0; h < 4; ++h)
#pragma unroll
            for (int k = h; k < 4; ++k, ++g) {
                const double wh = sh.w[h], wk = sh.w[k];
                yy += (h == k ? 1.0 : 2.0) * wh * wk * sh.gram[g];
            }
        v = norm_w * (v * (1.0f / sqrtf(float(yy / double(W)) + a.eps_norm)));
    }
    if (inside) a.y[t * W + c] = v;
}

// Prefill's finish: a block per token.
__global__ void __launch_bounds__(kThreadsHc) hc_finish_kernel(HcArgs a, int n_mix, int chunks) {
    __shared__ HcRowsShared sh;
    const HcMixParam mp = hc_mix_param(a, n_mix);
    pdl_begin();
    hc_finish_token<false>(a, n_mix, chunks, blockIdx.x, mp, sh);
}

// One thread per (token, column), all hc outputs of it: the token's hc stream values of that column come from
// memory once (the j loop finds them in L1) and no index needs a division. A thread per output element, as before,
// read every stream value hc times and spent its time in 64-bit divisions (1.3 ms a call for an 8K chunk; with this
// kernel the 8-layer file's 8K prefill went from 40.0 to 38.2 ms per layer, two calls each).
__global__ void hc_post_kernel(const float * streams, const float * o, const float * post, const float * comb,
                               float * out, int64_t n, int64_t hc, int64_t width) {
    pdl_begin();
    const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= width) return;
    for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
        const float * x = streams + t * hc * width + c;
        const float * ct = comb + t * hc * hc;
        const float ov = o[t * width + c];
        for (int64_t j = 0; j < hc; ++j) {
            float s = post[t * hc + j] * ov;
            for (int64_t k = 0; k < hc; ++k) s += ct[k * hc + j] * x[k * width];
            out[(t * hc + j) * width + c] = s;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Sampling candidates: three kernels, each a block of 1024 threads per slice of a row
// ---------------------------------------------------------------------------------------------------------------------
// One block per row took 48 µs of every decode step on the real vocabulary: three passes over 517 KB through one
// multiprocessor, and on a row whose logits crowd into a few bins, histogram atomics queued on a few shared words.
// Slices spread the passes over the GPU (the maximum; Σ exp and the histogram; the members), a warp adds its
// lanes' equal bins with one atomic, and the last block of the last pass sorts the members.
constexpr int kCandThreads = 1024;
constexpr int kCandMaxSlices = 64;
static_assert(kCandidateBins == kCandThreads, "one histogram bin per thread");

// A row's state between the passes, in the op's scratch.
struct CandRow {
    float slice_max[kCandMaxSlices];
    int slice_arg[kCandMaxSlices];  // lowest id holding the slice's maximum
    double slice_sum[kCandMaxSlices];
    int hist[kCandidateBins];
    unsigned long long members[kCandidateBins];  // (id << 32) | logit bits, in any order
    unsigned count, done;
};

int cand_slices(int64_t n_vocab) { return int(std::clamp<int64_t>((n_vocab + 4095) / 4096, 1, kCandMaxSlices)); }

__device__ __forceinline__ float clean_logit(float x) { return x == x ? x : -INFINITY; }

// Calls f(i, logit, inside) for the block's slice of its row, NaN as -inf, thread t taking elements t, t + 1024, ...
// of the slice; every thread makes the same number of calls (inside false past the end, logit -inf), so that
// warps may vote inside f.
template <class F>
__device__ __forceinline__ void for_each_slice_logit(const float * logits, int64_t n_vocab, F f) {
    const int64_t len = (n_vocab + gridDim.x - 1) / gridDim.x, begin = int64_t(blockIdx.x) * len;
    const int64_t end = min(n_vocab, begin + len);
    const float * row = logits + int64_t(blockIdx.y) * n_vocab;
    for (int64_t i0 = begin; i0 < end; i0 += kCandThreads) {
        const int64_t i = i0 + threadIdx.x;
        f(i, i < end ? clean_logit(row[i]) : -INFINITY, i < end);
    }
}

// Larger logit, then lower id.
__device__ __forceinline__ void max_arg(float & m, int & arg, float om, int oa) {
    if (om > m || (om == m && oa < arg)) m = om, arg = oa;
}
__device__ __forceinline__ void warp_max_arg(float & m, int & arg) {
    for (int o = 16; o > 0; o >>= 1) max_arg(m, arg, __shfl_xor_sync(kFull, m, o), __shfl_xor_sync(kFull, arg, o));
}

// The block's largest (m, arg) by max_arg; every thread gets it (1024 threads: 32 warps).
__device__ void block_max_arg(float & m, int & arg) {
    __shared__ float red_m[32];
    __shared__ int red_a[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_max_arg(m, arg);
    if (lane == 0) red_m[warp] = m, red_a[warp] = arg;
    __syncthreads();
    m = red_m[lane], arg = red_a[lane];
    warp_max_arg(m, arg);
}

// The row's maximum and its lowest id from the slices' (every block of the later passes reads them).
__device__ void row_max(const CandRow & rc, float & m, int & arg) {
    m = -INFINITY, arg = INT_MAX;
    if (int(threadIdx.x) < int(gridDim.x))
        m = __ldcg(rc.slice_max + threadIdx.x), arg = __ldcg(rc.slice_arg + threadIdx.x);
    block_max_arg(m, arg);
}

// The bin of a logit: the same f32 expression as the CPU's, so both pick the same members (-inf: past the last).
__device__ __forceinline__ int cand_bin(float m, float x) {
    const float d = (m - x) * float(kCandidateBinsPerNat);
    return d < float(kCandidateBins) ? int(d) : kCandidateBins;
}

// Pass 1: each slice's maximum. Block 0 also clears the row's histogram and counters for the later passes.
__global__ void __launch_bounds__(kCandThreads) cand_max_kernel(const float * logits, int64_t n_vocab, CandRow * rows) {
    pdl_begin();
    CandRow & rc = rows[blockIdx.y];
    if (blockIdx.x == 0) {
        rc.hist[threadIdx.x] = 0;
        if (threadIdx.x == 0) rc.count = rc.done = 0;
    }
    float m = -INFINITY;
    int arg = INT_MAX;
    for_each_slice_logit(logits, n_vocab, [&](int64_t i, float x, bool inside) {
        if (inside) max_arg(m, arg, x, int(i));
    });
    block_max_arg(m, arg);
    if (threadIdx.x == 0) rc.slice_max[blockIdx.x] = m, rc.slice_arg[blockIdx.x] = arg;
}

// Pass 2: each slice's Σ exp(l − m) (double) and its bin counts, added to the row's histogram.
__global__ void __launch_bounds__(kCandThreads)
    cand_hist_kernel(const float * logits, int64_t n_vocab, CandRow * rows) {
    pdl_begin();
    __shared__ int hist[kCandidateBins];
    __shared__ double red_d[32];
    CandRow & rc = rows[blockIdx.y];
    const int lane = threadIdx.x & 31;
    hist[threadIdx.x] = 0;
    float m;
    int arg;
    row_max(rc, m, arg);  // its barrier also publishes the cleared histogram
    double sum = 0;
    if (m > -INFINITY)
        for_each_slice_logit(logits, n_vocab, [&](int64_t, float x, bool) {
            int b = kCandidateBins;
            if (x != -INFINITY) {
                sum += double(expf(x - m));
                b = cand_bin(m, x);
            }
            const unsigned same = __match_any_sync(kFull, b);
            if (b < kCandidateBins && lane == __ffs(same) - 1) atomicAdd(&hist[b], __popc(same));
        });
    sum = block_sum(sum, red_d);  // its barriers also publish the histogram
    if (hist[threadIdx.x]) atomicAdd(&rc.hist[threadIdx.x], hist[threadIdx.x]);
    if (threadIdx.x == 0) rc.slice_sum[blockIdx.x] = sum;
}

// Pass 3: the bins kept (the longest run from bin 0 whose members fit in k), each slice's members appended to the
// row's list; the block that finishes last sorts them by id and writes the outputs.
__global__ void __launch_bounds__(kCandThreads)
    cand_members_kernel(const float * logits, int64_t n_vocab, int k, CandRow * rows, int32_t * ids, float * values,
                        float * stats) {
    pdl_begin();
    __shared__ unsigned long long members[kCandidateBins];
    __shared__ int red_i[33];
    __shared__ bool last;
    CandRow & rc = rows[blockIdx.y];
    const int lane = threadIdx.x & 31;
    float m;
    int arg;
    row_max(rc, m, arg);
    const int h = __ldcg(rc.hist + threadIdx.x);  // thread t holds bin t
    int excl;
    block_exclusive_scan(h, excl, red_i);
    const int kept_bins = m > -INFINITY ? __syncthreads_count(excl + h <= k) : 0;
    for_each_slice_logit(logits, n_vocab, [&](int64_t i, float x, bool) {
        const bool take = cand_bin(m, x) < kept_bins;
        const unsigned votes = __ballot_sync(kFull, take);
        if (!votes) return;
        const int leader = __ffs(votes) - 1;
        unsigned at = 0;
        if (lane == leader) at = atomicAdd(&rc.count, unsigned(__popc(votes)));
        at = __shfl_sync(kFull, at, leader) + __popc(votes & ((1u << lane) - 1));
        if (take) rc.members[at] = (uint64_t(i) << 32) | __float_as_uint(x);
    });
    // Every block's members are visible device-wide before it counts itself done.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&rc.done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    const int n_cand = int(__ldcg(&rc.count));
    members[threadIdx.x] = int(threadIdx.x) < n_cand ? __ldcg(rc.members + threadIdx.x) : ~0ull;
    __syncthreads();
    // Bitonic sort of the 1024 slots (empty ones last).
    for (int size = 2; size <= kCandThreads; size <<= 1)
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            const int i = threadIdx.x, j = i ^ stride;
            if (j > i) {
                const unsigned long long a = members[i], b = members[j];
                if (((i & size) == 0) == (a > b)) members[i] = b, members[j] = a;
            }
            __syncthreads();
        }
    int32_t * out_ids = ids + int64_t(blockIdx.y) * k;
    float * out_values = values + int64_t(blockIdx.y) * k;
    for (int j = threadIdx.x; j < k; j += kCandThreads) {
        out_ids[j] = j < n_cand ? int32_t(members[j] >> 32) : -1;
        out_values[j] = j < n_cand ? __uint_as_float(uint32_t(members[j])) : -INFINITY;
    }
    if (threadIdx.x == 0) {
        double sum = 0;  // the slices in order: the same total every run
        for (int b = 0; b < int(gridDim.x); ++b) sum += __ldcg(rc.slice_sum + b);
        float * st = stats + 4 * int64_t(blockIdx.y);
        st[0] = m;
        st[1] = float(log(sum));
        st[2] = float(n_cand);
        st[3] = float(arg == INT_MAX ? 0 : arg);
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Router: one warp per token (k <= 32 choices)
// ---------------------------------------------------------------------------------------------------------------------
constexpr int kRouterWarps = 4;

// A score's order as an unsigned key: larger keys for larger floats, 0 for NaN (never chosen), -0 as +0.
__device__ __forceinline__ uint32_t router_key(float s) {
    if (s != s) return 0;
    const uint32_t u = __float_as_uint(s == 0.0f ? 0.0f : s);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

// Lane l of a token's warp owns experts l + 32 j, j < kPerLane: their logits are loaded at once and their scores
// stay in registers, so each of the k rounds of arg-max is the lane's own maximum and two warp reductions (the
// highest key, then the lowest expert holding it: ties to the lower id, the CPU's partial_sort order). Rounds that
// kept the scores in shared memory and reduced (score, id) pairs by shuffles took ~0.7 µs each: a top-k layer's
// router ended ~6 µs after the logits, a hash layer's ~2 (session 55's traces).
template <int kPerLane>
__global__ void router_kernel(const float * logits, const float * bias, const int32_t * tid2eid, const int32_t * tokens,
                              int64_t n, int n_expert, int k, float route_scale, int32_t * experts, float * weights) {
    extern __shared__ float sm_router[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = int64_t(blockIdx.x) * kRouterWarps + warp;
    float * p = sm_router + warp * n_expert;  // [n_expert] the token's probabilities, read back for the weights
    // The bias (a weight) is in registers before the previous kernel ends: one round trip fewer after it. So is a
    // hash layer's choice (the token, written by the host, and the table, a weight): two round trips fewer.
    float b[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) b[j] = bias && lane + 32 * j < n_expert ? bias[lane + 32 * j] : 0.0f;
    const int hashed = tid2eid && t < n && lane < k ? tid2eid[int64_t(tokens[t]) * k + lane] : 0;
    pdl_begin();
    if (t >= n) return;
    const float * lt = logits + t * n_expert;
    float x[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) x[j] = lane + 32 * j < n_expert ? lt[lane + 32 * j] : 0.0f;
    uint32_t key[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        const float pe = sqrtf(x[j] > 20.0f ? x[j] : log1pf(expf(x[j])));
        if (e < n_expert) p[e] = pe;
        key[j] = e < n_expert ? router_key(b[j] + pe) : 0;
    }
    __syncwarp();
    // Lane j keeps the j-th choice (k <= 32): the weights then need no read-back of the choices.
    int mine = hashed;
    if (!tid2eid)
        for (int r = 0; r < k; ++r) {
            uint32_t best = 0;
            int best_j = 0;
#pragma unroll
            for (int j = 0; j < kPerLane; ++j)
                if (key[j] > best) {
                    best = key[j];
                    best_j = j;
                }
            const uint32_t top = __reduce_max_sync(kFull, best);
            const int win = __reduce_min_sync(kFull, top != 0 && best == top ? lane + 32 * best_j : INT_MAX);
            if (lane == r) mine = win == INT_MAX ? 0 : win;
            if (win != INT_MAX && lane == win % 32)
#pragma unroll
                for (int j = 0; j < kPerLane; ++j)
                    if (j == win / 32) key[j] = 0;  // taken
        }
    const bool valid = lane < k && mine >= 0 && mine < n_expert;
    const float pe = valid ? p[mine] : 0.0f;
    // The sum in choice order, as the CPU adds it.
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += __shfl_sync(kFull, pe, j);
    const float norm = route_scale / (sum + 1e-20f);
    if (lane < k) {
        experts[t * k + lane] = mine;
        weights[t * k + lane] = pe * norm;
    }
}

}  // namespace

void repack_blocks(GgmlType type, const uint8_t * src, uint8_t * dst, int64_t first_block, int64_t n_blocks,
                   int64_t total_blocks, cudaStream_t s) {
    if (n_blocks <= 0) return;
    if (type == GgmlType::IQ2_XXS)
        return launch(repack_iq2_kernel, dim3(blocks_for(n_blocks, 256)), dim3(256), 0, s, src, dst, first_block,
                      n_blocks, total_blocks);
    launch(repack_kernel, dim3(blocks_for(n_blocks, 256)), dim3(256), 0, s, block_split(type), src, dst, first_block,
           n_blocks, total_blocks);
}

void fill_f32(float * dst, int64_t n, float value, cudaStream_t s) {
    if (n > 0) launch(fill_kernel, dim3(blocks_for(n, 256)), dim3(256), 0, s, dst, n, value);
}

void get_rows(const WeightRef & table, const int32_t * ids, int64_t n, float * out, cudaStream_t s) {
    if (n > 0) launch(get_rows_kernel, dim3(blocks_for(table.ne0, 256), unsigned(n)), dim3(256), 0, s, table, ids, out);
}

void rms_norm(const float * x, const float * gamma, float * y, int64_t rows, int64_t width, float eps, cudaStream_t s) {
    if (rows > 0)
        launch(rms_norm_kernel, dim3(unsigned(rows)), dim3(width >= 1024 ? 256 : 128), 0, s, x, gamma, y, width, eps);
}

void rope(float * x, int64_t n, int64_t heads, int64_t width, const float * inv_freq, int n_rot,
          const int32_t * positions, bool inverse, cudaStream_t s) {
    const int64_t total = n * heads * (n_rot / 2);
    if (total > 0)
        launch(rope_kernel, dim3(blocks_for(total, 256)), dim3(256), 0, s, x, n, heads, width, inv_freq, n_rot,
               positions, inverse);
}

void norm_rope(const NormRopeArgs & a, cudaStream_t s) {
    int64_t rows = 0, width = 0;
    for (int i = 0; i < a.n_targets; ++i) {
        rows += a.n * a.t[i].heads;
        width = std::max(width, a.t[i].width);
    }
    if (rows > 0)
        launch(norm_rope_kernel, dim3(unsigned(rows)), dim3(width >= 1024 ? 256 : 128), size_t(width) * sizeof(float),
               s, a);
}

void add(const float * a, const float * b, float * out, int64_t n, cudaStream_t s) {
    if (n > 0) launch(add_kernel, dim3(blocks_for(n, 256)), dim3(256), 0, s, a, b, out, n);
}

void swiglu(const float * gate, const float * up, float * out, int64_t n, float limit, cudaStream_t s) {
    if (n > 0) launch(swiglu_kernel, dim3(blocks_for(n, 256)), dim3(256), 0, s, gate, up, out, n, limit);
}

void fp8_roundtrip(float * x, int64_t rows, int64_t width, int64_t n_dims, cudaStream_t s) {
    const int64_t per_row = n_dims / 64 + (n_dims % 64 ? 1 : 0);
    if (rows > 0 && per_row > 0)
        launch(fp8_kernel, dim3(blocks_for(rows * per_row * 32, 256)), dim3(256), 0, s, x, rows, width, n_dims);
}

void hadamard_fp4_roundtrip(float * x, int64_t rows, int64_t width, cudaStream_t s) {
    if (rows <= 0) return;
    const size_t smem = size_t(width) * sizeof(float);
    launch(hadamard_fp4_kernel, dim3(unsigned(rows)), dim3(128), smem, s, x, width);
}

void hc_expand(const float * x, float * streams, int64_t n, int64_t hc, int64_t width, cudaStream_t s) {
    const int64_t total = n * hc * width;
    if (total > 0) launch(hc_expand_kernel, dim3(blocks_for(total, 256)), dim3(256), 0, s, x, streams, n, hc, width);
}

int64_t hc_n_mix(int64_t hc, bool head) { return head ? hc : (2 + hc) * hc; }

int64_t hc_partial_floats(int64_t n, int64_t hc, int64_t width, int64_t n_mix) {
    return n * ((hc * width + kHcChunk - 1) / kHcChunk) * mix_record(n_mix);
}

// The cluster kernel where the device runs clusters of kHcClusterBlocks and a block of one thread per column fits
// (DSV4_CUDA_HC_CLUSTER=0: never, so that tests reach the rows kernel on any GPU).
template <FnKind K, int kMix>
bool hc_cluster_fits(int64_t width) {
    // The widest block that fits a multiprocessor's registers (0: no clusters of kHcClusterBlocks here).
    static const int max_threads = [] {
        auto kernel = hc_cluster_kernel<K, kMix>;
        const char * e = std::getenv("DSV4_CUDA_HC_CLUSTER");
        if ((e && e[0] == '0') ||
            cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        cudaLaunchAttribute attr = cluster_dim_attr(kHcClusterBlocks);
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(kHcClusterBlocks);
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        for (int threads = 1024; threads >= 64; threads -= 32) {
            cfg.blockDim = dim3(unsigned(threads));
            int clusters = 0;
            if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) cudaGetLastError();
            if (clusters > 0) return threads;
        }
        return 0;
    }();
    return hc_cluster_columns(width) <= max_threads;
}

// A warp per token.
__global__ void hc_sinkhorn_kernel(float * comb, int iters, float eps, unsigned * count) {
    pdl_begin();
    float * c = comb + int64_t(threadIdx.x / 32) * 16;
    const int lane = int(threadIdx.x % 32);
    const float v = sinkhorn4(lane < 16 ? c[lane] : 0.0f, iters, eps);
    if (lane < 16) c[lane] = v;
    __syncthreads();
    if (threadIdx.x == 0) count_release(count);
}

// f(kind) with the mixing matrix's FnKind as a compile-time constant.
template <class F>
auto with_fn_kind(GgmlType type, F f) {
    switch (type) {
        case GgmlType::F16:
            return f(std::integral_constant<FnKind, FnKind::f16>{});
        case GgmlType::F32:
            return f(std::integral_constant<FnKind, FnKind::f32>{});
        default:
            return f(std::integral_constant<FnKind, FnKind::any>{});
    }
}

// f(mix) with the cluster kernel's mixing count (24: a boundary, 4: the head) as a compile-time constant.
template <class F>
auto with_cluster_mix(const HcArgs & a, F f) {
    return a.head ? f(std::integral_constant<int, 4>{}) : f(std::integral_constant<int, 24>{});
}

bool hc_mix_clusters(const HcArgs & a) {
    if (!(a.n > 0 && a.n < kHcRowsTokens && a.hc == 4)) return false;
    return with_fn_kind(a.fn.type, [&](auto kind) {
        return with_cluster_mix(
            a, [&](auto mix) { return hc_cluster_fits<decltype(kind)::value, decltype(mix)::value>(a.width); });
    });
}

void hc_mix(const HcArgs & a, cudaStream_t s) {
    if (a.n <= 0) return;
    const int n_mix = int(hc_n_mix(a.hc, a.head));
    const int chunks = int((a.hc * a.width + kHcChunk - 1) / kHcChunk);
    // The finish's dynamic shared memory: the token's partial records, y's row (normed y only), and the norm's
    // weights where they fit.
    const size_t finish_smem = (size_t(chunks) * size_t(mix_record(n_mix)) +
                                (a.norm ? size_t(a.width) * (hc_rows_norm_in_smem(a.width) ? 2 : 1) : 0)) *
                               sizeof(float);
    // The two partial kernels sum in different orders; a prefill and the decode steps after it each use one.
    if (hc_mix_clusters(a))
        return with_fn_kind(a.fn.type, [&](auto kind) {
            with_cluster_mix(a, [&](auto mix) {
                launch_cluster(hc_cluster_kernel<decltype(kind)::value, decltype(mix)::value>, kHcClusterBlocks,
                               dim3(kHcClusterBlocks, unsigned(a.n)), dim3(unsigned(hc_cluster_columns(a.width))), 0, s,
                               a);
            });
        });
    if (a.n < kHcRowsTokens) {
        with_fn_kind(a.fn.type, [&](auto kind) {
            constexpr FnKind K = decltype(kind)::value;
            constexpr int kBoundaryMix = (2 + 4) * 4;  // V4's sublayer boundary: hc_n_mix(4 streams, not the head)
            launch(n_mix == kBoundaryMix ? hc_rows_kernel<K, kBoundaryMix> : hc_rows_kernel<K, 0>,
                   dim3(unsigned(chunks), unsigned(a.n)), dim3(kThreadsHc), finish_smem, s, a, n_mix, chunks);
        });
        return;
    }
    static_assert(kHcRowsTokens == kHcTokensPerBlock, "the tiles serve every chunk the decode kernel does not");
    if (a.post_streams) hc_post(a.post_streams, a.post_o, a.post, a.comb, a.streams, a.n, a.hc, a.width, s);
    const dim3 tiles(unsigned(chunks), unsigned((a.n + kHcTokensPerBlock - 1) / kHcTokensPerBlock));
    if (a.tensor_cores && a.fn.type == GgmlType::F16 && n_mix <= kHcTcRows)
        launch(hc_partial_tc_kernel, tiles, dim3(kThreadsHc), 0, s, a, n_mix);
    else
        with_fn_kind(a.fn.type, [&](auto kind) {
            launch(hc_partial_tiles_kernel<decltype(kind)::value>, tiles, dim3(kThreadsHc), hc_tiles_smem(n_mix), s, a,
                   n_mix);
        });
    launch(hc_finish_kernel, dim3(unsigned(a.n)), dim3(kThreadsHc), finish_smem, s, a, n_mix, chunks);
}

void hc_sinkhorn(float * comb, int64_t n, int iters, float eps, unsigned * count, cudaStream_t s) {
    if (n > 0) launch(hc_sinkhorn_kernel, dim3(1), dim3(unsigned(32 * n)), 0, s, comb, iters, eps, count);
}

void hc_post(const float * streams, const float * o, const float * post, const float * comb, float * out, int64_t n,
             int64_t hc, int64_t width, cudaStream_t s) {
    // 64-thread blocks: a decode step's 4096 columns still spread over 64 blocks.
    if (n * hc * width > 0)
        launch(hc_post_kernel, dim3(blocks_for(width, 64), unsigned(std::min<int64_t>(n, 65535))), dim3(64), 0, s,
               streams, o, post, comb, out, n, hc, width);
}

void router(const float * logits, const float * bias, const int32_t * tid2eid, const int32_t * tokens, int64_t n,
            int64_t n_expert, int64_t k, float route_scale, int32_t * experts, float * weights, cudaStream_t s) {
    if (n <= 0) return;
    const size_t smem = size_t(kRouterWarps) * size_t(n_expert) * sizeof(float);
    const auto run = [&](auto kernel) {
        launch(kernel, dim3(blocks_for(n, kRouterWarps)), dim3(kRouterWarps * 32), smem, s, logits, bias, tid2eid,
               tokens, n, int(n_expert), int(k), route_scale, experts, weights);
    };
    if (n_expert <= 32 * 8)
        run(router_kernel<8>);
    else if (n_expert <= 32 * 16)
        run(router_kernel<16>);
    else
        run(router_kernel<kRouterMaxExperts / 32>);
}

size_t logit_candidates_scratch(int64_t rows) { return size_t(rows) * sizeof(CandRow); }

void logit_candidates(const float * logits, int64_t rows, int64_t n_vocab, int64_t k, int32_t * ids, float * values,
                      float * stats, void * scratch, cudaStream_t s) {
    if (rows <= 0) return;
    CandRow * cand = static_cast<CandRow *>(scratch);
    const dim3 grid(unsigned(cand_slices(n_vocab)), unsigned(rows));
    launch(cand_max_kernel, grid, dim3(kCandThreads), 0, s, logits, n_vocab, cand);
    launch(cand_hist_kernel, grid, dim3(kCandThreads), 0, s, logits, n_vocab, cand);
    launch(cand_members_kernel, grid, dim3(kCandThreads), 0, s, logits, n_vocab, int(k), cand, ids, values, stats);
}

}  // namespace dsv4::cuda
