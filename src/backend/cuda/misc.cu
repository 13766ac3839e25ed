// Element-wise and per-row ops: weight re-layout, embedding rows, RMSNorm, RoPE, SwiGLU, the official FP8/FP4
// round trips, hyper-connections (mixing weights, Sinkhorn, stream sums) and the MoE router. Float arithmetic
// follows the CPU backend's expressions (double sums of squares, the same FP8/FP4 bit rules).
#include "backend/cuda/common.cuh"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

namespace dsv4::cuda {

bool pdl_enabled() {
    static const bool on = [] {
        const char * e = std::getenv("DSV4_CUDA_PDL");
        return !e || std::strcmp(e, "0") != 0;
    }();
    return on;
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
__global__ void rms_norm_kernel(const float * x, const float * gamma, float * y, int64_t width, float eps) {
    pdl_begin();
    __shared__ double red[32];
    const float * xr = x + int64_t(blockIdx.x) * width;
    float * yr = y + int64_t(blockIdx.x) * width;
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
    const float ang = float(positions[t]) * inv_freq[pair];
    const float c = cosf(ang), s = inverse ? -sinf(ang) : sinf(ang);
    float * v = x + th * width + (width - n_rot) + 2 * pair;
    const float a = v[0], b = v[1];
    v[0] = a * c - b * s;
    v[1] = a * s + b * c;
}

// One block per (token, head) row: RMSNorm, RoPE, FP8 rounding and the ring copy with the expressions of
// rms_norm_kernel (same block size: same sum order), rope_kernel, fp8_kernel and store_rows.
__global__ void norm_rope_kernel(NormRopeArgs a) {
    pdl_begin();
    extern __shared__ float row[];  // [width]
    __shared__ double red[32];
    const int64_t th = blockIdx.x, t = th / a.heads, h = th % a.heads, width = a.width;
    float * xr = a.x + th * width;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
        row[i] = xr[i];
        ss += double(row[i]) * double(row[i]);
    }
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(float(ss / double(width)) + a.eps);
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = row[i] * scale;
        row[i] = a.gamma ? a.gamma[i] * v : v;
    }
    __syncthreads();
    const int32_t pos = a.positions[t];
    for (int i = threadIdx.x; i < a.n_rot / 2; i += blockDim.x) {
        const float ang = float(pos) * a.inv_freq[i];
        const float c = cosf(ang), s = sinf(ang);
        float * v = row + (width - a.n_rot) + 2 * i;
        const float x0 = v[0], x1 = v[1];
        v[0] = x0 * c - x1 * s;
        v[1] = x0 * s + x1 * c;
    }
    __syncthreads();
    if (a.fp8_dims > 0) fp8_row_shared(row, a.fp8_dims);
    float * ring = a.ring ? a.ring + ((int64_t(pos) % a.ring_rows) * a.heads + h) * width : nullptr;
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

// Partial sums of x·x (double) and fn·x over one chunk (kHcChunk elements) of the hc·D stream rows, two ways.
// Decode (a few tokens): a thread owns one element and keeps its n_mix mixing weights in registers; the block
// reduces each product over its warps, token by token. Latency-bound, so the reductions run in parallel.
static_assert(kHcChunk == kThreadsHc, "a thread owns one element of the chunk");

template <FnKind K>
__global__ void hc_partial_rows_kernel(HcArgs a, int n_mix) {
    pdl_begin();
    __shared__ float red[kThreadsHc / 32][kMaxMix];
    __shared__ double red_ss[kThreadsHc / 32];
    const int64_t len = a.hc * a.width;
    const int64_t chunk = blockIdx.x, e = chunk * kHcChunk + threadIdx.x;
    const bool inside = e < len;
    float fn[kMaxMix];
#pragma unroll
    for (int r = 0; r < kMaxMix; ++r) fn[r] = inside && r < n_mix ? fn_element<K>(a.fn, r, e) : 0.0f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t rec = mix_record(n_mix);
    for (int64_t t = blockIdx.y; t < a.n; t += gridDim.y) {
        const float v = inside ? a.streams[t * len + e] : 0.0f;
#pragma unroll
        for (int r = 0; r < kMaxMix; ++r) {
            if (r >= n_mix) break;
            const float s = warp_sum(fn[r] * v);
            if (lane == 0) red[warp][r] = s;
        }
        const double ss = warp_sum(double(v) * double(v));
        if (lane == 0) red_ss[warp] = ss;
        __syncthreads();
        float * out = a.partial + (t * gridDim.x + chunk) * rec;
        if (threadIdx.x < n_mix) {
            float s = 0;
            for (int w = 0; w < int(blockDim.x / 32); ++w) s += red[w][threadIdx.x];
            out[2 + threadIdx.x] = s;
        }
        if (threadIdx.x == 0) {
            double s = 0;
            for (int w = 0; w < int(blockDim.x / 32); ++w) s += red_ss[w];
            *reinterpret_cast<double *>(out) = s;
        }
        __syncthreads();
    }
}

// Prefill: the chunk's mixing weights and kHcTokensPerBlock tokens' values go to shared memory once, and each
// thread computes whole (token, mix) dot products. Throughput-bound: no shuffles (24 warp sums per element
// spent most of a prefill's hc time in the decode kernel).
constexpr int kHcTokensPerBlock = 16;
constexpr int kHcLd = kHcChunk + 1;  // padded rows: the threads of a warp read different rows at one column

template <FnKind K>
__global__ void hc_partial_tiles_kernel(HcArgs a, int n_mix) {
    pdl_begin();
    extern __shared__ float hc_smem[];
    float * fn = hc_smem;                  // [n_mix][kHcLd]
    float * xs = hc_smem + n_mix * kHcLd;  // [kHcTokensPerBlock][kHcLd]
    const int64_t len = a.hc * a.width;
    const int64_t chunk = blockIdx.x, e0 = chunk * kHcChunk;
    const int width = int(min(int64_t(kHcChunk), len - e0));
    const int64_t t0 = int64_t(blockIdx.y) * kHcTokensPerBlock;
    const int n_tok = int(min(int64_t(kHcTokensPerBlock), a.n - t0));
    for (int i = threadIdx.x; i < n_mix * kHcChunk; i += blockDim.x) {
        const int r = i / kHcChunk, c = i % kHcChunk;
        fn[r * kHcLd + c] = c < width ? fn_element<K>(a.fn, r, e0 + c) : 0.0f;
    }
    for (int i = threadIdx.x; i < n_tok * kHcChunk; i += blockDim.x) {
        const int t = i / kHcChunk, c = i % kHcChunk;
        xs[t * kHcLd + c] = c < width ? a.streams[(t0 + t) * len + e0 + c] : 0.0f;
    }
    __syncthreads();
    const int64_t rec = mix_record(n_mix);
    for (int p = threadIdx.x; p < n_tok * (n_mix + 1); p += blockDim.x) {
        const int t = p / (n_mix + 1), r = p % (n_mix + 1);
        const float * x = xs + t * kHcLd;
        float * out = a.partial + ((t0 + t) * gridDim.x + chunk) * rec;
        // Four running sums: shorter dependency chains.
        if (r < n_mix) {
            const float * f = fn + r * kHcLd;
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int c = 0; c < kHcChunk; c += 4)
#pragma unroll
                for (int j = 0; j < 4; ++j) s[j] += f[c + j] * x[c + j];
            out[2 + r] = (s[0] + s[1]) + (s[2] + s[3]);
        } else {
            double ss[4] = {0, 0, 0, 0};
            for (int c = 0; c < kHcChunk; c += 4)
#pragma unroll
                for (int j = 0; j < 4; ++j) ss[j] += double(x[c + j]) * double(x[c + j]);
            *reinterpret_cast<double *>(out) = (ss[0] + ss[1]) + (ss[2] + ss[3]);
        }
    }
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

__global__ void hc_finish_kernel(HcArgs a, int n_mix, int chunks) {
    pdl_begin();
    __shared__ float mix[kMaxMix];
    __shared__ float w[16];
    __shared__ float comb[256];
    const int64_t t = blockIdx.x;
    const int hc = int(a.hc);
    const int64_t rec = mix_record(n_mix);
    const float * part = a.partial + t * chunks * rec;
    __shared__ double ss_total;
    // A warp per mixing weight (and one for the sum of squares) adds up the chunks: its lanes' loads are
    // independent, where one thread walking 64 chunks waits for each load in turn (29 µs of a 300 µs layer).
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    for (int r = warp; r <= n_mix; r += int(blockDim.x) / 32) {
        if (r < n_mix) {
            float s = 0;
            for (int c = lane; c < chunks; c += 32) s += part[c * rec + 2 + r];
            s = warp_sum(s);
            if (lane == 0) mix[r] = s;
        } else {
            double ss = 0;
            for (int c = lane; c < chunks; c += 32) ss += *reinterpret_cast<const double *>(part + c * rec);
            ss = warp_sum(ss);
            if (lane == 0) ss_total = ss;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const float scale = 1.0f / sqrtf(float(ss_total / double(a.hc * a.width)) + a.eps_norm);
        for (int r = 0; r < n_mix; ++r) mix[r] *= scale;
        for (int h = 0; h < hc; ++h) w[h] = sigmoidf_(mix[h] * a.scale[0] + a.base[h]) + a.eps_hc;
        if (!a.head) {
            for (int h = 0; h < hc; ++h)
                a.post[t * hc + h] = 2.0f * sigmoidf_(mix[hc + h] * a.scale[1] + a.base[hc + h]);
            for (int i = 0; i < hc * hc; ++i) comb[i] = mix[2 * hc + i] * a.scale[2] + a.base[2 * hc + i];
            if (hc != 4) {
                sinkhorn(comb, hc, a.iters, a.eps_hc);
                for (int i = 0; i < hc * hc; ++i) a.comb[t * hc * hc + i] = comb[i];
            }
        }
    }
    __syncthreads();
    if (!a.head && hc == 4 && threadIdx.x < 32) {
        const float c = sinkhorn4(threadIdx.x < 16 ? comb[threadIdx.x] : 0.0f, a.iters, a.eps_hc);
        if (threadIdx.x < 16) a.comb[t * 16 + threadIdx.x] = c;
    }
    __syncthreads();
    const float * x = a.streams + t * hc * a.width;
    float * y = a.y + t * a.width;
    if (!a.norm) {
        for (int64_t c = threadIdx.x; c < a.width; c += blockDim.x) {
            float s = 0;
            for (int h = 0; h < hc; ++h) s += w[h] * x[h * a.width + c];
            y[c] = s;
        }
        return;
    }
    // The sublayer's input norm, as rms_norm_kernel computes it (same block size, so the same sum order).
    extern __shared__ float row[];  // [width]
    __shared__ double red[32];
    double ss = 0;
    for (int64_t c = threadIdx.x; c < a.width; c += blockDim.x) {
        float s = 0;
        for (int h = 0; h < hc; ++h) s += w[h] * x[h * a.width + c];
        row[c] = s;
        ss += double(s) * double(s);
    }
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(float(ss / double(a.width)) + a.eps_norm);
    for (int64_t c = threadIdx.x; c < a.width; c += blockDim.x) y[c] = a.norm[c] * (row[c] * scale);
}

__global__ void hc_post_kernel(const float * streams, const float * o, const float * post, const float * comb,
                               float * out, int64_t n, int64_t hc, int64_t width) {
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n * hc * width) return;
    const int64_t c = i % width, tj = i / width, t = tj / hc, j = tj % hc;
    const float * x = streams + t * hc * width;
    const float * ct = comb + t * hc * hc;
    float s = post[t * hc + j] * o[t * width + c];
    for (int64_t k = 0; k < hc; ++k) s += ct[k * hc + j] * x[k * width + c];
    out[i] = s;
}

// ---------------------------------------------------------------------------------------------------------------------
// Sampling candidates: one block per row of logits
// ---------------------------------------------------------------------------------------------------------------------
// The row's k largest logits (ties to the lower id, NaN as -inf) ascending by id with their values, and its max and
// log Σ exp(l − max), so that the host samples from k numbers instead of reading the vocabulary.
__global__ void __launch_bounds__(kTopkThreads) top_logits_kernel(const float * logits, int64_t n_vocab, int k,
                                                                  int32_t * ids, float * values, float * stats) {
    pdl_begin();
    __shared__ float red_f[32];
    __shared__ double red_d[32];
    const float * row = logits + int64_t(blockIdx.x) * n_vocab;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float x = row[i];
        if (x == x) m = fmaxf(m, x);
    }
    m = warp_max(m);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red_f[threadIdx.x >> 5] = m;
    __syncthreads();
    m = warp_max((threadIdx.x & 31) < (blockDim.x >> 5) ? red_f[threadIdx.x & 31] : -INFINITY);
    // Each term in f32 (exp of a value <= 0), the sum in double: the CPU sums double exps; both agree to ~1e-7.
    double sum = 0;
    if (m > -INFINITY)
        for (int64_t i = threadIdx.x; i < n_vocab; i += blockDim.x) {
            const float x = row[i];
            if (x == x) sum += double(expf(x - m));
        }
    sum = block_sum(sum, red_d);
    int32_t * sel = ids + int64_t(blockIdx.x) * k;
    block_top_k(row, n_vocab, k, sel, LogitKey{});
    __syncthreads();
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const float x = row[sel[j]];
        values[int64_t(blockIdx.x) * k + j] = x == x ? x : -INFINITY;
    }
    if (threadIdx.x == 0) {
        stats[2 * blockIdx.x] = m;
        stats[2 * blockIdx.x + 1] = float(log(sum));
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Router: one warp per token
// ---------------------------------------------------------------------------------------------------------------------
constexpr int kRouterWarps = 4;

__global__ void router_kernel(const float * logits, const float * bias, const int32_t * tid2eid, const int32_t * tokens,
                              int64_t n, int n_expert, int k, float route_scale, int32_t * experts, float * weights) {
    pdl_begin();
    extern __shared__ float sm_router[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = int64_t(blockIdx.x) * kRouterWarps + warp;
    if (t >= n) return;
    float * p = sm_router + warp * 2 * n_expert;
    float * score = p + n_expert;
    const float * lt = logits + t * n_expert;
    for (int e = lane; e < n_expert; e += 32) {
        const float x = lt[e];
        p[e] = sqrtf(x > 20.0f ? x : log1pf(expf(x)));
        score[e] = p[e] + (bias ? bias[e] : 0.0f);
    }
    __syncwarp();
    int32_t * et = experts + t * k;
    if (tid2eid) {
        for (int j = lane; j < k; j += 32) et[j] = tid2eid[int64_t(tokens[t]) * k + j];
    } else {
        // k rounds of arg-max: highest score, ties to the lower id (the CPU's partial_sort order).
        for (int j = 0; j < k; ++j) {
            float best = -INFINITY;
            int best_e = INT_MAX;
            for (int e = lane; e < n_expert; e += 32) {
                const float s = score[e];
                if (s != s) continue;
                if (best_e == INT_MAX || s > best || (s == best && e < best_e)) {
                    best = s;
                    best_e = e;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ob = __shfl_xor_sync(kFull, best, o);
                const int oe = __shfl_xor_sync(kFull, best_e, o);
                if (oe != INT_MAX && (best_e == INT_MAX || ob > best || (ob == best && oe < best_e))) {
                    best = ob;
                    best_e = oe;
                }
            }
            if (lane == 0) et[j] = best_e == INT_MAX ? 0 : best_e;
            if (best_e != INT_MAX && lane == best_e % 32) score[best_e] = __int_as_float(0x7fffffff);  // NaN: taken
            __syncwarp();
        }
    }
    __syncwarp();
    if (lane == 0) {
        float sum = 0;
        for (int j = 0; j < k; ++j) {
            const int e = et[j];
            sum += (e >= 0 && e < n_expert) ? p[e] : 0.0f;
        }
        const float norm = route_scale / (sum + 1e-20f);
        for (int j = 0; j < k; ++j) {
            const int e = et[j];
            weights[t * k + j] = (e >= 0 && e < n_expert) ? p[e] * norm : 0.0f;
        }
    }
}

}  // namespace

void repack_blocks(GgmlType type, const uint8_t * src, uint8_t * dst, int64_t first_block, int64_t n_blocks,
                   int64_t total_blocks, cudaStream_t s) {
    if (n_blocks <= 0) return;
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
    if (a.n <= 0) return;
    launch(norm_rope_kernel, dim3(unsigned(a.n * a.heads)), dim3(a.width >= 1024 ? 256 : 128),
           size_t(a.width) * sizeof(float), s, a);
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

void hc_mix(const HcArgs & a, cudaStream_t s) {
    if (a.n <= 0) return;
    const int n_mix = int(hc_n_mix(a.hc, a.head));
    const int chunks = int((a.hc * a.width + kHcChunk - 1) / kHcChunk);
    // The two partial kernels sum in different orders; a prefill and the decode steps after it each use one.
    const bool tiles = a.n >= kHcTokensPerBlock;
    const dim3 grid(unsigned(chunks), unsigned(tiles ? (a.n + kHcTokensPerBlock - 1) / kHcTokensPerBlock : a.n));
    const size_t smem = tiles ? size_t(n_mix + kHcTokensPerBlock) * kHcLd * sizeof(float) : 0;
    auto go = [&](auto rows_kernel, auto tiles_kernel) {
        if (tiles)
            launch(tiles_kernel, grid, dim3(kThreadsHc), smem, s, a, n_mix);
        else
            launch(rows_kernel, grid, dim3(kThreadsHc), smem, s, a, n_mix);
    };
    switch (a.fn.type) {
        case GgmlType::F16:
            go(hc_partial_rows_kernel<FnKind::f16>, hc_partial_tiles_kernel<FnKind::f16>);
            break;
        case GgmlType::F32:
            go(hc_partial_rows_kernel<FnKind::f32>, hc_partial_tiles_kernel<FnKind::f32>);
            break;
        default:
            go(hc_partial_rows_kernel<FnKind::any>, hc_partial_tiles_kernel<FnKind::any>);
            break;
    }
    launch(hc_finish_kernel, dim3(unsigned(a.n)), dim3(256), a.norm ? size_t(a.width) * sizeof(float) : 0, s, a, n_mix,
           chunks);
}

void hc_post(const float * streams, const float * o, const float * post, const float * comb, float * out, int64_t n,
             int64_t hc, int64_t width, cudaStream_t s) {
    const int64_t total = n * hc * width;
    if (total > 0)
        launch(hc_post_kernel, dim3(blocks_for(total, 256)), dim3(256), 0, s, streams, o, post, comb, out, n, hc,
               width);
}

void router(const float * logits, const float * bias, const int32_t * tid2eid, const int32_t * tokens, int64_t n,
            int64_t n_expert, int64_t k, float route_scale, int32_t * experts, float * weights, cudaStream_t s) {
    if (n <= 0) return;
    const size_t smem = size_t(kRouterWarps) * 2 * size_t(n_expert) * sizeof(float);
    launch(router_kernel, dim3(blocks_for(n, kRouterWarps)), dim3(kRouterWarps * 32), smem, s, logits, bias, tid2eid,
           tokens, n, int(n_expert), int(k), route_scale, experts, weights);
}

void top_logits(const float * logits, int64_t rows, int64_t n_vocab, int64_t k, int32_t * ids, float * values,
                float * stats, cudaStream_t s) {
    if (rows > 0)
        launch(top_logits_kernel, dim3(unsigned(rows)), dim3(kTopkThreads), 0, s, logits, n_vocab, int(k), ids, values,
               stats);
}

}  // namespace dsv4::cuda
