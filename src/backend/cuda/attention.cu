// Attention-side ops: the raw ring, the compressors (pooling completed blocks and advancing their frontier
// state), the lightning indexer (scores and an exact top-k), and sink attention over the window plus the
// compressed rows. Every kernel reads the positions from device memory and sizes its grid from capacities, so
// a decode step's launches never change.
#include "backend/cuda/common.cuh"

#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <climits>
#include <type_traits>

namespace dsv4::cuda {

namespace {

unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// ---------------------------------------------------------------------------------------------------------------------
// Raw ring
// ---------------------------------------------------------------------------------------------------------------------
__global__ void store_rows_kernel(float * ring, int64_t ring_rows, const float * rows, int64_t n, int64_t width,
                                  const int32_t * positions) {
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n * width) return;
    const int64_t t = i / width, c = i % width;
    ring[(int64_t(positions[t]) % ring_rows) * width + c] = rows[i];
}

// ---------------------------------------------------------------------------------------------------------------------
// Compressor
// ---------------------------------------------------------------------------------------------------------------------
// The chunk's positions are consecutive: p0 = positions[0] .. p0 + n - 1. Values and scores of position q come
// from the chunk (q >= p0, score plus ape[q mod R]) or from the frontier state as it was before the chunk.
struct Candidate {
    float v, s;
};

__device__ __forceinline__ Candidate chunk_value(const CompressorArgs & a, int64_t q, int64_t p0, int64_t col) {
    const int64_t t = q - p0;
    return {a.kv[t * a.wide + col], a.score[t * a.wide + col] + weight_element(a.ape, q % a.ratio, col)};
}

// The pooled value of channel c of block b (softmax over the candidates' scores), c < width.
__device__ float pool_channel(const CompressorArgs & a, int64_t p0, int64_t b, int64_t c, int64_t width) {
    const int64_t R = a.ratio;
    const int64_t open0 = a.overlap ? R : 0;
    auto get = [&](int64_t q, int64_t col) -> Candidate {
        if (q >= p0) return chunk_value(a, q, p0, col);
        if (q >= b * R) {  // this block's earlier tokens: the open rows
            const int64_t r = open0 + q % R;
            return {a.state_kv[r * a.wide + col], a.state_score[r * a.wide + col]};
        }
        // The previous block: completed before the chunk (its rows moved to [0, R)) or the open block then.
        const int64_t slot = q - (b - 1) * R;
        const int64_t r = b * R <= p0 ? slot : open0 + slot;
        return {a.state_kv[r * a.wide + col], a.state_score[r * a.wide + col]};
    };
    // Candidates in the CPU's order: the previous block's first halves (overlap), then this block's.
    float m = -INFINITY;
    if (a.overlap)
        for (int64_t r = 0; r < R; ++r) m = fmaxf(m, get((b - 1) * R + r, c).s);
    for (int64_t r = 0; r < R; ++r) m = fmaxf(m, get(b * R + r, (a.overlap ? width : 0) + c).s);
    float denom = 0, acc = 0;
    auto add = [&](Candidate x) {
        if (x.s == -INFINITY) return;
        const float p = expf(x.s - m);
        denom += p;
        acc += p * x.v;
    };
    if (a.overlap)
        for (int64_t r = 0; r < R; ++r) add(get((b - 1) * R + r, c));
    for (int64_t r = 0; r < R; ++r) add(get(b * R + r, (a.overlap ? width : 0) + c));
    return acc / denom;
}

// Pools and finishes the row of every block that the chunk completes, one block per token: the pooled row in
// shared memory, then RMSNorm, RoPE at the block's first position b·R, rounding, and the store.
__global__ void compressor_rows_kernel(const CompressorArgs a) {
    const float freq0 = rope_freq0(a.inv_freq, a.n_rot);
    const int64_t t = blockIdx.x;
    const int64_t pos = a.positions[t], p0 = a.positions[0], R = a.ratio;
    pdl_begin();
    extern __shared__ float row[];  // [width]
    __shared__ double red[32];
    const int64_t width = a.overlap ? a.wide / 2 : a.wide;
    if (pos % R != R - 1 || pos / R >= a.capacity) return;
    const int64_t b = pos / R;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
        row[i] = pool_channel(a, p0, b, i, width);
        ss += double(row[i]) * double(row[i]);
    }
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(float(ss / double(width)) + a.eps);
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) row[i] = a.norm[i] * (row[i] * scale);
    __syncthreads();
    rope_row_shared(row, width, a.n_rot, a.inv_freq, freq0, float(b * R));
    __syncthreads();
    if (a.rounding == 1) fp8_row_shared(row, a.fp8_dims);
    if (a.rounding == 2) hadamard_fp4_shared(row, width);
    if (a.store_bf16) {  // exact for the official numerics' FP4-rounded indexer keys (indexer_key_type)
        __nv_bfloat16 * dst = static_cast<__nv_bfloat16 *>(a.store) + b * width;
        for (int64_t i = threadIdx.x; i < width; i += blockDim.x) dst[i] = __float2bfloat16_rn(row[i]);
    } else {
        float * dst = static_cast<float *>(a.store) + b * width;
        for (int64_t i = threadIdx.x; i < width; i += blockDim.x) dst[i] = row[i];
    }
}

// Advances the frontier: afterwards the open rows hold the open block's tokens (empty slots (0, -inf)) and, with
// overlap, rows [0, R) the last completed block. One thread per (slot, column) reads and writes only its own cells.
__global__ void compressor_state_kernel(const CompressorArgs a) {
    const int64_t p0 = a.positions[0], p_end = a.positions[a.n - 1] + 1;
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t R = a.ratio;
    if (i >= R * a.wide) return;
    const int64_t s = i / a.wide, col = i % a.wide;
    const int64_t b_open = p_end / R, b_old = p0 / R;
    const int64_t open0 = a.overlap ? R : 0;
    const int64_t oi = (open0 + s) * a.wide + col;
    const Candidate old_open{a.state_kv[oi], a.state_score[oi]};
    const int64_t q = b_open * R + s;
    Candidate open{0.0f, -INFINITY};
    if (q < p_end) open = q >= p0 ? chunk_value(a, q, p0, col) : old_open;
    if (a.overlap && b_open != b_old) {
        const int64_t qp = (b_open - 1) * R + s;
        const Candidate prev = qp >= p0 ? chunk_value(a, qp, p0, col) : old_open;
        a.state_kv[s * a.wide + col] = prev.v;
        a.state_score[s * a.wide + col] = prev.s;
    }
    a.state_kv[oi] = open.v;
    a.state_score[oi] = open.s;
}

// ---------------------------------------------------------------------------------------------------------------------
// Indexer
// ---------------------------------------------------------------------------------------------------------------------
constexpr int kIdxKeysPerBlock = 32;  // 8 warps × 4 keys

// Four key values from element i on (a multiple of 4) of the stored keys. The WMMA kernels below score f32 keys
// only (BF16 ones go to the bf16 tiles); the CUDA-core kernels take either (BF16 reaches them with the tensor
// cores off).
__device__ __forceinline__ float4 load_key4_f32(const IndexerArgs & a, int64_t i) {
    return __ldg(reinterpret_cast<const float4 *>(static_cast<const float *>(a.keys) + i));
}
__device__ __forceinline__ float4 load_key4(const IndexerArgs & a, int64_t i) {
    if (!a.keys_bf16) return load_key4_f32(a, i);
    const uint2 v = __ldg(reinterpret_cast<const uint2 *>(static_cast<const uint16_t *>(a.keys) + i));
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}

// The compressed rows token t sees: those its position has completed (one per ratio positions), as stored.
__device__ __forceinline__ int64_t indexer_visible(const IndexerArgs & a, int64_t t) {
    return min(int64_t(a.positions[t] + 1) / a.ratio, a.capacity);
}
// The rows token t of a prefill block scores: its visible rows when they are more than top_k (else the top-k takes
// them all unscored), 0 for a token past the launch's.
__device__ __forceinline__ int64_t indexer_scored(const IndexerArgs & a, int64_t t) {
    const int64_t visible = t < a.n ? indexer_visible(a, t) : 0;
    return visible > a.top_k ? visible : 0;
}

__global__ void indexer_scores_kernel(const IndexerArgs a) {
    pdl_begin();
    extern __shared__ float smem_idx[];
    const int64_t t = blockIdx.y;
    const int64_t visible = indexer_visible(a, t);
    const int64_t key0 = int64_t(blockIdx.x) * kIdxKeysPerBlock;
    if (visible <= a.top_k || key0 >= visible) return;
    const int64_t d = a.dim, H = a.heads, qs = d + 4;
    float * q = smem_idx;    // [H][d + 4]
    float * w = q + H * qs;  // [H]
    for (int64_t i = threadIdx.x; i < H * d; i += blockDim.x) q[(i / d) * qs + i % d] = a.q[t * H * d + i];
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) w[i] = a.w[t * H + i];
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t kb = key0 + 4 * warp;
    if (kb >= visible) return;
    const int nk = int(std::min<int64_t>(4, visible - kb));
    float sc[4] = {0, 0, 0, 0};
    for (int64_t h = lane; h < H; h += 32) {
        float dot[4] = {0, 0, 0, 0};
        for (int64_t d4 = 0; d4 < d; d4 += 4) {
            const float4 qv = *reinterpret_cast<const float4 *>(q + h * qs + d4);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (j >= nk) break;
                const float4 kv = load_key4(a, (kb + j) * d + d4);
                dot[j] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) sc[j] += w[h] * fmaxf(0.0f, dot[j]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float s = warp_sum(sc[j]);
        if (lane == 0 && j < nk) a.scores[t * a.capacity + kb + j] = s * a.key_scale;
    }
}

// V4's indexer shape (64 heads × 128): a warp scores one key at a time with the key's 128 values spread over its
// lanes (four each, one load) and every head's partial dot product in registers, then a transposing butterfly
// leaves each lane two whole heads (62 shuffles instead of 64 reductions of 5). The general kernel above walks the
// dimensions in each lane instead: 64 dependent steps per key, which left a decode step at a few thousand rows
// latency-bound on a handful of multiprocessors (34 µs of a 260 µs layer). A key per warp and block-strided key
// groups over at most two blocks a multiprocessor: a warp's key reads the 32 KB of queries from shared memory, so
// 4 keys a warp in a row (as before) kept a decode step's ~530 rows on 17 multiprocessors, bound by their shared
// memory (9.3 µs a CSA layer at 2K against 4.4 now); a long context's rows still take several rounds a warp.
constexpr int kIdxFastHeads = 64, kIdxFastDim = 128;

__global__ void __launch_bounds__(256) indexer_scores_h64_kernel(const IndexerArgs a) {
    pdl_begin();
    __shared__ __align__(16) float q[kIdxFastHeads * kIdxFastDim];
    __shared__ float w[kIdxFastHeads];
    const int64_t t = blockIdx.y;
    const int64_t visible = indexer_visible(a, t);
    if (visible <= a.top_k || int64_t(blockIdx.x) * 8 >= visible) return;
    for (int i = threadIdx.x; i < kIdxFastHeads * kIdxFastDim / 4; i += blockDim.x)
        reinterpret_cast<float4 *>(q)[i] = reinterpret_cast<const float4 *>(a.q + t * kIdxFastHeads * kIdxFastDim)[i];
    if (threadIdx.x < kIdxFastHeads) w[threadIdx.x] = a.w[t * kIdxFastHeads + threadIdx.x];
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // The heads lane ends up holding: bit b of the lane picks the upper half at butterfly step b (16, 8, .., 1).
    const int h0 = ((lane >> 4) & 1) * 32 + ((lane >> 3) & 1) * 16 + ((lane >> 2) & 1) * 8 + ((lane >> 1) & 1) * 4 +
                   (lane & 1) * 2;
    for (int64_t key = int64_t(blockIdx.x) * 8 + warp; key < visible; key += int64_t(gridDim.x) * 8) {
        const float4 kv = load_key4(a, key * kIdxFastDim + 4 * lane);
        float v[kIdxFastHeads];
#pragma unroll
        for (int h = 0; h < kIdxFastHeads; ++h) {
            const float4 qv = reinterpret_cast<const float4 *>(q + h * kIdxFastDim)[lane];
            v[h] = qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
        }
        butterfly_half<64>(v, lane, 16);
        butterfly_half<32>(v, lane, 8);
        butterfly_half<16>(v, lane, 4);
        butterfly_half<8>(v, lane, 2);
        butterfly_half<4>(v, lane, 1);
        const float s = warp_sum(w[h0] * fmaxf(0.0f, v[0]) + w[h0 + 1] * fmaxf(0.0f, v[1]));
        if (lane == 0) a.scores[t * a.capacity + key] = s * a.key_scale;
    }
}

// F32 keys (the reference numerics with the tensor cores on; BF16 keys take the bf16 tiles further down).
// Prefill chunks on the tensor cores: a block takes kIdxTcTokens tokens' 64 heads (64 query rows each, f16, resident
// in shared memory) and walks the visible keys in tiles of 64 rows converted to f16; 4 warps a token, each 16 query
// rows × the tile's 64 keys (WMMA, f32 accumulators), staged in shared memory for relu, the head weights and the sum
// over heads of each (token, key). The per-key kernel above does the 128 × 64 products of a (token, key) in f32 on
// the CUDA cores (12 ms for an 8K chunk over 2K rows); these tiles do them in about a tenth. Four tokens a block
// load and convert each key tile once for twice the queries of two (157 KB of shared memory, one block a
// multiprocessor: the 4-layer file's 256K prefill 8.35 → 8.15 s, session 23); two where a block cannot hold that
// (sm_120/121). Numerics: queries and keys rounded to f16, products and sums in f32; the sums' order does not
// depend on the tokens a block takes.
constexpr int kIdxTcKeys = 64;
constexpr int kIdxTcLd = kIdxFastDim + 8, kIdxTcLdS = kIdxTcKeys + 4;  // padded rows (halves, floats)
template <int TOK>
constexpr size_t idx_tc_smem() {
    return size_t(TOK * kIdxFastHeads + kIdxTcKeys) * kIdxTcLd * 2 + size_t(TOK * kIdxFastHeads) * kIdxTcLdS * 4;
}

// Four f32 values as f16 at dst (8-byte aligned).
__device__ __forceinline__ void store_f16x4(half * dst, float4 v) {
    reinterpret_cast<half2 *>(dst)[0] = __floats2half2_rn(v.x, v.y);
    reinterpret_cast<half2 *>(dst)[1] = __floats2half2_rn(v.z, v.w);
}

// A thread pair per (token, key) of the tile: kIdxTcTokens · 128 threads.
template <int kIdxTcTokens>
__global__ void __launch_bounds__(kIdxTcTokens * 128) indexer_scores_tc_kernel(const IndexerArgs a) {
    constexpr int kIdxTcRows = kIdxTcTokens * kIdxFastHeads;
    using namespace nvcuda;
    pdl_begin();
    extern __shared__ __align__(128) uint8_t smem_idx_tc[];
    half * qs = reinterpret_cast<half *>(smem_idx_tc);                   // [token · 64 + head][kIdxTcLd]
    half * ks = qs + kIdxTcRows * kIdxTcLd;                              // [key][kIdxTcLd]
    float * ss = reinterpret_cast<float *>(ks + kIdxTcKeys * kIdxTcLd);  // [token · 64 + head][kIdxTcLdS]
    __shared__ float ws[kIdxTcRows];
    __shared__ int64_t scored[kIdxTcTokens];  // visible rows of a token that has more than top_k, else 0
    const int64_t t0 = int64_t(blockIdx.x) * kIdxTcTokens;
    if (threadIdx.x < kIdxTcTokens) scored[threadIdx.x] = indexer_scored(a, t0 + threadIdx.x);
    for (int i = threadIdx.x; i < kIdxTcRows * kIdxFastDim / 4; i += blockDim.x) {
        const int r = i / (kIdxFastDim / 4), c = i % (kIdxFastDim / 4) * 4;
        const bool in = t0 + r / kIdxFastHeads < a.n;
        store_f16x4(qs + r * kIdxTcLd + c,
                    in ? *reinterpret_cast<const float4 *>(a.q + (t0 * kIdxFastHeads + r) * kIdxFastDim + c)
                       : make_float4(0, 0, 0, 0));
    }
    for (int i = threadIdx.x; i < kIdxTcRows; i += blockDim.x)
        ws[i] = t0 + i / kIdxFastHeads < a.n ? a.w[t0 * kIdxFastHeads + i] : 0.0f;
    __syncthreads();
    int64_t keys = 0;
#pragma unroll
    for (int i = 0; i < kIdxTcTokens; ++i) keys = max(keys, scored[i]);
    const int warp = threadIdx.x / 32;
    for (int64_t key0 = 0; key0 < keys; key0 += kIdxTcKeys) {
        for (int i = threadIdx.x; i < kIdxTcKeys * kIdxFastDim / 4; i += blockDim.x) {
            const int r = i / (kIdxFastDim / 4), c = i % (kIdxFastDim / 4) * 4;
            store_f16x4(ks + r * kIdxTcLd + c,
                        key0 + r < keys ? load_key4_f32(a, (key0 + r) * kIdxFastDim + c) : make_float4(0, 0, 0, 0));
        }
        __syncthreads();
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kIdxTcKeys / 16];
#pragma unroll
        for (int j = 0; j < kIdxTcKeys / 16; ++j) wmma::fill_fragment(acc[j], 0.0f);
#pragma unroll
        for (int kk = 0; kk < kIdxFastDim; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> qf;
            wmma::load_matrix_sync(qf, qs + warp * 16 * kIdxTcLd + kk, kIdxTcLd);
#pragma unroll
            for (int j = 0; j < kIdxTcKeys / 16; ++j) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, ks + j * 16 * kIdxTcLd + kk, kIdxTcLd);
                wmma::mma_sync(acc[j], qf, kf, acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < kIdxTcKeys / 16; ++j)
            wmma::store_matrix_sync(ss + warp * 16 * kIdxTcLdS + j * 16, acc[j], kIdxTcLdS, wmma::mem_row_major);
        __syncthreads();
        // Thread pair (2o, 2o + 1): token o / 64, key o % 64, the even and the odd heads (rows one apart: no bank
        // conflict between the pair).
        const int o = threadIdx.x / 2, odd = threadIdx.x % 2, tok = o / kIdxTcKeys, key = o % kIdxTcKeys;
        float sum = 0.0f;
        for (int h = odd; h < kIdxFastHeads; h += 2) {
            const int row = tok * kIdxFastHeads + h;
            sum += ws[row] * fmaxf(0.0f, ss[row * kIdxTcLdS + key]);
        }
        sum += __shfl_xor_sync(kFull, sum, 1);
        if (!odd && key0 + key < scored[tok]) a.scores[(t0 + tok) * a.capacity + key0 + key] = sum * a.key_scale;
        __syncthreads();  // the next tile overwrites ks and ss
    }
}

// Decode on the tensor cores: a token's 64 heads are one 64-row operand (f16 in shared memory, staged by every
// block), and each warp scores 16 keys a step (four 16 × 16 tiles over the 128 dimensions), so 16 keys' 128 × 64
// products cost 32 tensor-core instructions instead of the h64 kernel's 32 KB of shared-memory reads per key (that
// kernel is bound by them). The keys of a warp's next step load while it reduces the current one. Same numerics as
// the prefill tiles above, so tensor_cores gates it too.
// H200 traces of a 4-layer q2 file (session 19): 14.9 -> 5.2 µs a CSA layer at 32K, 4.4 -> 4.1 at 2K.
constexpr int kIdxDecWarps = 4, kIdxDecKeys = 16, kIdxDecLdS = kIdxDecKeys + 4;

__global__ void __launch_bounds__(kIdxDecWarps * 32) indexer_scores_tc_decode_kernel(const IndexerArgs a) {
    using namespace nvcuda;
    pdl_begin();
    __shared__ __align__(128) half qs[kIdxFastHeads * kIdxTcLd];  // [head][kIdxTcLd]
    // A warp's keys ([key][kIdxTcLd] f16), then its products ([head][kIdxDecLdS] f32) in the same bytes.
    __shared__ __align__(128) float stage[kIdxDecWarps][kIdxFastHeads * kIdxDecLdS];
    __shared__ float ws[kIdxFastHeads];
    static_assert(kIdxDecKeys * kIdxTcLd * sizeof(half) <= sizeof(stage[0]), "a warp's keys fit its stage");
    const int64_t t = blockIdx.y;
    const int64_t visible = indexer_visible(a, t);
    const int64_t stride = int64_t(gridDim.x) * kIdxDecWarps * kIdxDecKeys;
    if (visible <= a.top_k || int64_t(blockIdx.x) * kIdxDecWarps * kIdxDecKeys >= visible) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t key0 = (int64_t(blockIdx.x) * kIdxDecWarps + warp) * kIdxDecKeys;
    // Lane l holds dimensions 4l..4l+3 of each of the step's keys.
    float4 kv[kIdxDecKeys];
    auto load_keys = [&](int64_t k0) {
#pragma unroll
        for (int r = 0; r < kIdxDecKeys; ++r)
            kv[r] = k0 + r < visible ? load_key4_f32(a, (k0 + r) * kIdxFastDim + 4 * lane) : make_float4(0, 0, 0, 0);
    };
    // Every load of the queries and of the first keys is issued before any is used: one round trip, not one per
    // staging step (a loop that stored each value as it arrived took ~16 round trips, 6.9 µs at 2K).
    constexpr int kQueryLoads = kIdxFastHeads * kIdxFastDim / 4 / (kIdxDecWarps * 32);
    float4 qv[kQueryLoads];
#pragma unroll
    for (int i = 0; i < kQueryLoads; ++i)
        qv[i] = reinterpret_cast<const float4 *>(a.q + t * kIdxFastHeads * kIdxFastDim)[threadIdx.x + i * blockDim.x];
    load_keys(key0);
#pragma unroll
    for (int i = 0; i < kQueryLoads; ++i) {
        const int f = int(threadIdx.x + i * blockDim.x) * 4, r = f / kIdxFastDim, c = f % kIdxFastDim;
        store_f16x4(qs + r * kIdxTcLd + c, qv[i]);
    }
    if (threadIdx.x < kIdxFastHeads) ws[threadIdx.x] = a.w[t * kIdxFastHeads + threadIdx.x];
    __syncthreads();
    half * ks = reinterpret_cast<half *>(stage[warp]);
    float * ss = stage[warp];
    for (; key0 < visible; key0 += stride) {
#pragma unroll
        for (int r = 0; r < kIdxDecKeys; ++r) store_f16x4(ks + r * kIdxTcLd + 4 * lane, kv[r]);
        __syncwarp();
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kIdxFastHeads / 16];
#pragma unroll
        for (int m = 0; m < kIdxFastHeads / 16; ++m) wmma::fill_fragment(acc[m], 0.0f);
#pragma unroll
        for (int kk = 0; kk < kIdxFastDim; kk += 16) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> kf;
            wmma::load_matrix_sync(kf, ks + kk, kIdxTcLd);
#pragma unroll
            for (int m = 0; m < kIdxFastHeads / 16; ++m) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> qf;
                wmma::load_matrix_sync(qf, qs + m * 16 * kIdxTcLd + kk, kIdxTcLd);
                wmma::mma_sync(acc[m], qf, kf, acc[m]);
            }
        }
        __syncwarp();  // every lane has read the keys before the products overwrite them
        if (key0 + stride < visible) load_keys(key0 + stride);
#pragma unroll
        for (int m = 0; m < kIdxFastHeads / 16; ++m)
            wmma::store_matrix_sync(ss + m * 16 * kIdxDecLdS, acc[m], kIdxDecLdS, wmma::mem_row_major);
        __syncwarp();
        // Lanes l and l + 16 sum key l % 16 over the even and the odd heads (rows one apart: 20 banks apart).
        const int key = lane % kIdxDecKeys;
        float sum = 0.0f;
        for (int h = lane / kIdxDecKeys; h < kIdxFastHeads; h += 2)
            sum += ws[h] * fmaxf(0.0f, ss[h * kIdxDecLdS + key]);
        sum += __shfl_xor_sync(kFull, sum, kIdxDecKeys);
        if (lane < kIdxDecKeys && key0 + key < visible) a.scores[t * a.capacity + key0 + key] = sum * a.key_scale;
        __syncwarp();  // the sums are read before the next keys land
    }
}

// BF16 keys (the official numerics' state) on mma.sync tiles, prefill chunks and decode steps alike. The keys are
// copied into shared memory as stored (cp.async, two stages: the next tile lands while this one is multiplied) and
// the queries rounded to bf16 once a block, both exact for the official numerics' FP4-rounded values, so the f32
// products and sums are the WMMA kernels' with a different order. A warp multiplies its token's 64 heads by 32 keys
// (4 × 4 tiles of m16n8k16, operands by ldmatrix from rows padded to 272 bytes) and reduces in registers: each lane
// weighs and relu's its 8 heads of 8 keys, and a transposing butterfly over the lanes' head groups (7 shuffles)
// leaves every lane one (key, sum): no staging of products in shared memory and no barrier between tiles but the
// stage's. Blocks take TOK tokens and every gridDim.y-th tile of WPT · 32 keys: a prefill chunk walks all its
// visible keys in each block (one slice, the latest tokens' blocks first: they have the most keys), a decode step
// spreads a token's keys over slices.
constexpr int kIdxMmaLd = kIdxFastDim + 8;  // bf16 a shared row: an ldmatrix's 8 rows start in distinct bank groups

template <int TOK, int WPT>
constexpr size_t idx_mma_smem() {
    return size_t(TOK * kIdxFastHeads + 2 * WPT * 32) * kIdxMmaLd * sizeof(__nv_bfloat16);
}

template <int TOK, int WPT>
__global__ void __launch_bounds__(TOK * WPT * 32, 2) indexer_scores_mma_kernel(const IndexerArgs a) {
    constexpr int kThreads = TOK * WPT * 32, kTileKeys = WPT * 32;
    constexpr int kChunks = kIdxFastDim * 2 / 16;  // 16-byte copies a key row
    static_assert(kTileKeys * kChunks % kThreads == 0, "a tile's copies spread evenly over the threads");
    extern __shared__ __align__(128) uint8_t smem_idx_mma[];
    __nv_bfloat16 * qs = reinterpret_cast<__nv_bfloat16 *>(smem_idx_mma);  // [token · 64 + head][kIdxMmaLd]
    __nv_bfloat16 * ks = qs + TOK * kIdxFastHeads * kIdxMmaLd;             // [stage][key][kIdxMmaLd]
    __shared__ int64_t scored[TOK];  // visible rows of a token that has more than top_k, else 0
    const int64_t t0 = int64_t(gridDim.x - 1 - blockIdx.x) * TOK;
    if (threadIdx.x < TOK) scored[threadIdx.x] = indexer_scored(a, t0 + threadIdx.x);  // positions only
    pdl_begin();
    __syncthreads();
    int64_t keys = 0;
#pragma unroll
    for (int i = 0; i < TOK; ++i) keys = max(keys, scored[i]);
    const int64_t tiles = (keys + kTileKeys - 1) / kTileKeys;
    if (int64_t(blockIdx.y) >= tiles) return;  // block-uniform
    const __nv_bfloat16 * key_rows = static_cast<const __nv_bfloat16 *>(a.keys);
    const auto load_tile = [&](int64_t tile, int stage) {
        __nv_bfloat16 * dst = ks + stage * kTileKeys * kIdxMmaLd;
        const int64_t k0 = tile * kTileKeys;
#pragma unroll
        for (int j = 0; j < kTileKeys * kChunks / kThreads; ++j) {
            const int i = threadIdx.x + j * kThreads, r = i / kChunks, c = i % kChunks * 8;
            cp_async16(dst + r * kIdxMmaLd + c, k0 + r < keys ? key_rows + (k0 + r) * kIdxFastDim + c : nullptr);
        }
        cp_async_commit();
    };
    load_tile(blockIdx.y, 0);
    for (int i = threadIdx.x; i < TOK * kIdxFastHeads * kIdxFastDim / 4; i += kThreads) {
        const int r = i / (kIdxFastDim / 4), c = i % (kIdxFastDim / 4) * 4;
        const float4 v = t0 + r / kIdxFastHeads < a.n
                             ? *reinterpret_cast<const float4 *>(a.q + (t0 * kIdxFastHeads + r) * kIdxFastDim + c)
                             : make_float4(0, 0, 0, 0);
        reinterpret_cast<__nv_bfloat162 *>(qs + r * kIdxMmaLd + c)[0] = __floats2bfloat162_rn(v.x, v.y);
        reinterpret_cast<__nv_bfloat162 *>(qs + r * kIdxMmaLd + c)[1] = __floats2bfloat162_rn(v.z, v.w);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tok = warp / WPT, g = lane / 4;
    const int64_t t = t0 + tok;
    // The head weights of this lane's accumulator rows: heads 16m + g and 16m + g + 8 of head tile m.
    float wh[8];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        wh[2 * m] = t < a.n ? a.w[t * kIdxFastHeads + 16 * m + g] : 0.0f;
        wh[2 * m + 1] = t < a.n ? a.w[t * kIdxFastHeads + 16 * m + g + 8] : 0.0f;
    }
    // The (key tile, column) this lane's sum lands on after the butterfly: bits 4, 3 of the lane pick the key tile,
    // bit 2 the column of the pair, bits 1, 0 the pair.
    const int out_key = ((lane >> 4) & 1) * 16 + ((lane >> 3) & 1) * 8 + (lane & 3) * 2 + ((lane >> 2) & 1);
    const __nv_bfloat16 * qt = qs + tok * kIdxFastHeads * kIdxMmaLd;
    int stage = 0;
    for (int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y, stage ^= 1) {
        // The other stage was last read before the barrier that closed the previous tile.
        const bool more = tile + gridDim.y < tiles;
        if (more) {
            load_tile(tile + gridDim.y, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int64_t k0 = tile * kTileKeys + (warp % WPT) * 32;  // this warp's first key
        if (k0 < scored[tok]) {
            const __nv_bfloat16 * kt = ks + (stage * kTileKeys + (warp % WPT) * 32) * kIdxMmaLd;
            float acc[4][4][4] = {};  // [head tile][key tile of 8][fragment]
#pragma unroll
            for (int kk = 0; kk < kIdxFastDim; kk += 16) {
                // Keys [key][dim] are the column-major B, queries [head][dim] the row-major A.
                uint32_t b[2][4];
#pragma unroll
                for (int j = 0; j < 2; ++j) ldmatrix_b2(b[j], kt + 16 * j * kIdxMmaLd + kk, kIdxMmaLd, lane);
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    uint32_t af[4];
                    ldmatrix_a(af, qt + 16 * m * kIdxMmaLd + kk, kIdxMmaLd, lane);
#pragma unroll
                    for (int n = 0; n < 4; ++n)
                        mma_16816<true>(acc[m][n], af, b[n / 2][2 * (n % 2)], b[n / 2][2 * (n % 2) + 1]);
                }
            }
            // v[2n + c]: this lane's 8 heads of key 8n + 2 (lane % 4) + c, weighed.
            float v[8];
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    float sum = 0.0f;
#pragma unroll
                    for (int m = 0; m < 4; ++m)
                        sum += wh[2 * m] * fmaxf(0.0f, acc[m][n][c]) + wh[2 * m + 1] * fmaxf(0.0f, acc[m][n][2 + c]);
                    v[2 * n + c] = sum;
                }
            butterfly_half<8>(v, lane, 16);
            butterfly_half<4>(v, lane, 8);
            butterfly_half<2>(v, lane, 4);
            if (k0 + out_key < scored[tok]) a.scores[t * a.capacity + k0 + out_key] = v[0] * a.key_scale;
        }
        __syncthreads();  // every warp has read this stage before the next tile's copies overwrite it
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Indexer top-k
// ---------------------------------------------------------------------------------------------------------------------
// Order-preserving key of a score: larger score, larger key; -0 and +0 equal; NaN lowest.
__device__ __forceinline__ uint32_t score_key(float f) {
    if (f != f) return 0;
    const uint32_t b = __float_as_uint(f + 0.0f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A coarse digit (13 bits) that never decreases as the score grows and is equal for equal keys: the score as f16,
// ordered like score_key, without its 3 lowest bits. With 5 exponent bits instead of 8, a row of scores spreads
// over hundreds of these bins, where the top byte of score_key puts nearly all of them in one or two.
__device__ __forceinline__ int coarse_digit(float f) {
    if (f != f) return 0;
    const uint32_t b = __half_as_ushort(__float2half_rn(f + 0.0f));
    return int(((b & 0x8000u) ? ~b & 0xffffu : b | 0x8000u) >> 3);
}

// The k highest of n scores (ties to the lower index), their indices written ascending to sel[0, k), k <= n, by
// every thread of a block of kTopkThreads. A decode step's CSA layer runs this one block alone, so its time is its
// instructions and the chain of barriers between them. Session 18's radix select (four 8-bit passes over
// score_key, now the fallback below) took 14.6 µs at 32K (8192 rows) and 5.4 at 2K: its first passes put nearly
// every row in one or two digits, where each warp's `__match_any_sync` and same-address atomics serialised. The
// coarse path below: 7.3 µs at 32K, 4.2 at 2K (session 19, H200 traces; 33,269 instructions a decode launch against
// 61,926).
constexpr int kTopkThreads = 1024;
constexpr int kTopkRegKeys = 16;       // scores a thread keeps in registers: rows up to 16384 (64K context, ratio 4)
constexpr int kTopkCoarseBins = 8192;  // 13-bit coarse digits, eight a thread in the scan
constexpr int kTopkCandidates = 512;   // most rows of the threshold's coarse bin that are ranked one by one
constexpr int kTopkUnits = kTopkRegKeys * 32;
constexpr int kTopkMaxRows = kTopkThreads * kTopkRegKeys;
constexpr int kTopkSliceRows = 8192;  // a split decode's slice: 8 rows a thread in registers
constexpr int kTopkSplitTokens = 8;   // launches of up to this many tokens split rows past the registers

struct TopkShared {
    int hist[kTopkCoarseBins];  // coarse counts; the radix passes use [0, 256) and [256, 512), one a pass
    uint32_t cand_key[kTopkCandidates];
    int cand_row[kTopkCandidates];
    uint32_t kept[kTopkMaxRows / 32];  // the threshold bin's kept rows, a bit each
    int units[kTopkUnits];  // kept rows per (chunk, warp), then their exclusive prefix: rows in order; from L2:
                            // each warp's rows above, then equal to, the k-th key
    int red[33];
    int bin, above, bin_rows, candidates;  // coarse: the threshold's bin, rows in higher bins, rows in it, gathered
    uint32_t prefix;  // radix: the k-th key's digits found so far; coarse from L2: the k-th key
    int remaining;    // how many keys with that prefix (equal to it) are still to be kept
};

// With s.hist holding the coarse counts of the rows: the bin that holds the k-th score (s.bin), the rows in higher
// bins (s.above) and in it (s.bin_rows), for every thread. Thread t scans bins 8191 - 8t down to 8184 - 8t: the
// rows of higher bins come first.
__device__ void coarse_threshold(int k, TopkShared & s) {
    static_assert(kTopkCoarseBins == 8 * kTopkThreads, "eight bins a thread");
    const int bottom = kTopkCoarseBins - 8 - 8 * int(threadIdx.x);
    int bins[8];
    *reinterpret_cast<int4 *>(bins) = reinterpret_cast<const int4 *>(s.hist + bottom)[0];
    *reinterpret_cast<int4 *>(bins + 4) = reinterpret_cast<const int4 *>(s.hist + bottom)[1];
    int mine = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) mine += bins[b];
    int higher;
    block_exclusive_scan(mine, higher, s.red);
    if (higher < k && higher + mine >= k) {
        for (int b = 7; b >= 0; --b) {
            if (higher + bins[b] >= k) {
                s.bin = bottom + b;
                s.above = higher;
                s.bin_rows = bins[b];
                break;
            }
            higher += bins[b];
        }
    }
    __syncthreads();
}

// Rows up to kTopkThreads · kTopkRegKeys, their scores in registers: thread t holds rows j·kTopkThreads + t (chunk
// j; a warp's 32 rows of a chunk are a unit).
// 1. A histogram of coarse_digit (the lanes of a warp mostly hit different bins: plain atomics) and one block scan
//    find the bin holding the k-th score. Rows in higher bins are kept, rows in lower ones dropped.
// 2. One pass counts each unit's rows above that bin and gathers the bin's rows (a few dozen at 32K in the
//    synthetic files); a warp per gathered row ranks it against the others (key, then lower row first); the first
//    k - above are kept and counted in their units.
// 3. One block scan of the units gives each unit its first output slot, and a ballot each row's place in it.
// Returns false, having written nothing, when the bin holds more than kTopkCandidates rows (ties, or scores within
// an f16 step): the radix select below takes those.
__device__ bool block_top_k_coarse(const float * sc, int n, int k, int32_t * sel, TopkShared & s) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int chunks = (n + kTopkThreads - 1) / kTopkThreads;  // <= kTopkRegKeys
    float v[kTopkRegKeys];
#pragma unroll
    for (int j = 0; j < kTopkRegKeys; ++j) v[j] = sc[min(j * kTopkThreads + tid, n - 1)];  // rows past n: never used
    for (int i = tid; i < kTopkCoarseBins / 4; i += kTopkThreads)
        reinterpret_cast<int4 *>(s.hist)[i] = int4{0, 0, 0, 0};
    for (int i = tid; i < kTopkMaxRows / 32; i += kTopkThreads) s.kept[i] = 0;
    if (tid == 0) s.candidates = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kTopkRegKeys; ++j) {
        if (j >= chunks) break;
        if (j * kTopkThreads + tid < n) atomicAdd(&s.hist[coarse_digit(v[j])], 1);
    }
    __syncthreads();
    coarse_threshold(k, s);
    if (s.bin_rows > kTopkCandidates) return false;
    const int bin = s.bin;
    const unsigned lower_lanes = (1u << lane) - 1;
    unsigned above = 0, in_bin = 0;  // a bit per chunk
#pragma unroll
    for (int j = 0; j < kTopkRegKeys; ++j) {
        if (j >= chunks) break;
        const int row = j * kTopkThreads + tid, d = row < n ? coarse_digit(v[j]) : -1;
        const unsigned gt = __ballot_sync(kFull, d > bin), in = __ballot_sync(kFull, d == bin);
        if (lane == 0) s.units[j * 32 + warp] = __popc(gt);
        above |= ((gt >> lane) & 1) << j;
        in_bin |= ((in >> lane) & 1) << j;
        if (in) {
            const int leader = __ffs(in) - 1;
            int base = 0;
            if (lane == leader) base = atomicAdd(&s.candidates, __popc(in));
            base = __shfl_sync(kFull, base, leader);
            if (d == bin) {
                const int slot = base + __popc(in & lower_lanes);
                s.cand_key[slot] = score_key(v[j]);
                s.cand_row[slot] = row;
            }
        }
    }
    __syncthreads();
    const int rows = s.bin_rows, need = k - s.above;
    for (int c = warp; c < rows; c += kTopkThreads / 32) {
        const uint32_t kc = s.cand_key[c];
        const int rc = s.cand_row[c];
        int ahead = 0;
        for (int o = lane; o < rows; o += 32) {
            const uint32_t ko = s.cand_key[o];
            ahead += ko > kc || (ko == kc && s.cand_row[o] < rc);
        }
        if (__reduce_add_sync(kFull, unsigned(ahead)) < unsigned(need) && lane == 0) {
            atomicOr(&s.kept[rc / 32], 1u << (rc % 32));
            atomicAdd(&s.units[rc / 32], 1);  // unit (chunk rc / kTopkThreads, warp rc % kTopkThreads / 32)
        }
    }
    __syncthreads();
    const int units = chunks * 32;
    const int count = tid < units ? s.units[tid] : 0;
    int before;
    block_exclusive_scan(count, before, s.red);
    if (tid < units) s.units[tid] = before;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kTopkRegKeys; ++j) {
        if (j >= chunks) break;
        const int row = j * kTopkThreads + tid;
        const bool keep = ((above >> j) & 1) || (((in_bin >> j) & 1) && ((s.kept[row / 32] >> (row % 32)) & 1));
        const unsigned m = __ballot_sync(kFull, keep);
        if (keep) sel[s.units[j * 32 + warp] + __popc(m & lower_lanes)] = row;
    }
    return true;
}

// One radix histogram step of a warp: lanes with `in` set agree on a digit first, and one of them adds the group's
// count (the radix passes' digits cluster).
__device__ __forceinline__ void histogram_add(int * hist, bool in, uint32_t digit) {
    const unsigned voters = __ballot_sync(kFull, in);
    if (in) {
        const unsigned same = __match_any_sync(voters, digit);
        if ((threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[digit], __popc(same));
    }
}

// Warp w of a top-k block owns the contiguous rows [w·c, (w+1)·c) of n in the passes below: c a multiple of 32, so
// that a warp reads them 32 in a row (one line a load).
__device__ __forceinline__ int topk_run(int n) { return (n + kTopkThreads - 1) / kTopkThreads * 32; }

// Writes the rows of the warp's run [lo, hi) whose key is above thr, and the first need_eq over the block of those
// equal to it (the lowest indices win), to sel ascending, given each warp's counts of keys above (gt) and equal to
// (eq) thr in its run: two block scans of those counts give each warp its first output slot and how many of its
// keys equal to thr it keeps; ballots order the rows inside a warp's 32. The scores are read from L2 once.
__device__ void place_top_k(const float * sc, int lo, int hi, uint32_t thr, int need_eq, int gt, int eq, int32_t * sel,
                            TopkShared & s) {
    const int lane = threadIdx.x & 31;
    const unsigned lower_lanes = (1u << lane) - 1;
    int eq_before;  // lane 0 alone holds the warp's counts in the scans
    block_exclusive_scan(lane == 0 ? eq : 0, eq_before, s.red);
    const int eq_keep = max(0, min(eq, need_eq - __shfl_sync(kFull, eq_before, 0)));
    int out;
    block_exclusive_scan(lane == 0 ? gt + eq_keep : 0, out, s.red);
    out = __shfl_sync(kFull, out, 0);
    for (int base = lo, kept_eq = 0; base < hi; base += 32) {
        const int i = base + lane;
        const uint32_t kv = i < hi ? score_key(sc[i]) : 0;
        const unsigned eqs = __ballot_sync(kFull, i < hi && kv == thr);
        const bool keep = i < hi && (kv > thr || (kv == thr && kept_eq + __popc(eqs & lower_lanes) < eq_keep));
        const unsigned kept = __ballot_sync(kFull, keep);
        if (keep) sel[out + __popc(kept & lower_lanes)] = i;
        out += __popc(kept);
        kept_eq += __popc(eqs);
    }
}

// place_top_k with the counts taken by one more pass over the scores. (A thread's own contiguous rows, as before
// session 24, made every load of a prefill chunk's 1024-thread blocks touch 32 lines: 0.51 s of top-k in a 256K
// prefill's CSA layer, 0.42 s by warps.)
__device__ void write_top_k(const float * sc, int n, uint32_t thr, int need_eq, int32_t * sel, TopkShared & s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = topk_run(n), lo = min(n, warp * c), hi = min(n, lo + c);
    int gt = 0, eq = 0;
    for (int i = lo + lane; i < hi; i += 32) {
        const uint32_t kv = score_key(sc[i]);
        gt += kv > thr;
        eq += kv == thr;
    }
    place_top_k(sc, lo, hi, thr, need_eq, int(__reduce_add_sync(kFull, unsigned(gt))),
                int(__reduce_add_sync(kFull, unsigned(eq))), sel, s);
}

// Rows past the registers (contexts past 64K): the coarse bins with the scores read from L2 in each pass. One pass
// counts the coarse digits; one gathers the threshold bin's keys and rows and counts each warp's rows in higher
// bins; a warp per gathered key counts the keys above and equal to it, which gives the exact k-th key and how many
// keys equal to it are kept; the gathered keys complete each warp's counts, and place_top_k writes the selection:
// three reads of the scores (four until session 24, when the counts took a pass of their own: 424 → 414 ms of
// top-k in a 256K prefill's CSA layer on an H200, where the passes wait on instructions more than on memory; a
// GB10's 273 GB/s should feel the pass more). At 128K (32768 rows) 18.7 µs a CSA layer against the radix select's
// 45.7 (session 21's traces). Returns false, having written nothing, when the bin holds more than kTopkCandidates
// rows.
__device__ bool block_top_k_coarse_l2(const float * sc, int n, int k, int32_t * sel, TopkShared & s) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int i = tid; i < kTopkCoarseBins / 4; i += kTopkThreads)
        reinterpret_cast<int4 *>(s.hist)[i] = int4{0, 0, 0, 0};
    if (tid == 0) s.candidates = 0;
    __syncthreads();
#pragma unroll 8
    for (int i = tid; i < n; i += kTopkThreads) atomicAdd(&s.hist[coarse_digit(sc[i])], 1);
    __syncthreads();
    coarse_threshold(k, s);
    if (s.bin_rows > kTopkCandidates) return false;
    const int bin = s.bin;
    const int c = topk_run(n), lo = min(n, warp * c), hi = min(n, lo + c);
    int above = 0;
#pragma unroll 8
    for (int i = lo + lane; i < hi; i += 32) {
        const float f = sc[i];
        const int d = coarse_digit(f);
        above += d > bin;
        if (d == bin) {
            const int slot = atomicAdd(&s.candidates, 1);
            s.cand_key[slot] = score_key(f);
            s.cand_row[slot] = i;
        }
    }
    above = int(__reduce_add_sync(kFull, unsigned(above)));
    int * warp_gt = s.units;  // [32]: each warp's rows above the k-th key, then [32]: equal to it
    int * warp_eq = s.units + 32;
    if (lane == 0) {
        warp_gt[warp] = above;
        warp_eq[warp] = 0;
    }
    __syncthreads();
    const int rows = s.bin_rows, need = k - s.above;
    for (int r = warp; r < rows; r += kTopkThreads / 32) {
        const uint32_t kr = s.cand_key[r];
        int gt = 0, eq = 0;
        for (int o = lane; o < rows; o += 32) {
            gt += s.cand_key[o] > kr;
            eq += s.cand_key[o] == kr;
        }
        gt = int(__reduce_add_sync(kFull, unsigned(gt)));
        eq = int(__reduce_add_sync(kFull, unsigned(eq)));
        if (lane == 0 && gt < need && gt + eq >= need) {  // equal keys write the same values
            s.prefix = kr;
            s.remaining = need - gt;
        }
    }
    __syncthreads();
    const uint32_t thr = s.prefix;
    for (int r = tid; r < rows; r += kTopkThreads) {
        const uint32_t kr = s.cand_key[r];
        if (kr > thr) atomicAdd(&warp_gt[s.cand_row[r] / c], 1);
        if (kr == thr) atomicAdd(&warp_eq[s.cand_row[r] / c], 1);
    }
    __syncthreads();
    place_top_k(sc, lo, hi, thr, s.remaining, warp_gt[warp], warp_eq[warp], sel, s);
    return true;
}

// The general path (rows whose threshold bin is too full for the coarse paths: ties, or scores within an f16
// step): four 8-bit radix passes over score_key, the scores read from L2 in each, find the k-th key and how many
// keys equal to it are kept, and write_top_k writes the selection.
__device__ void block_top_k_radix(const float * sc, int n, int k, int32_t * sel, TopkShared & s) {
    const int tid = threadIdx.x;
    for (int i = tid; i < 512; i += kTopkThreads) s.hist[i] = 0;
    if (tid == 0) {
        s.prefix = 0;
        s.remaining = k;
    }
    __syncthreads();
    uint32_t mask = 0;
    for (int pass = 0; pass < 4; ++pass) {
        const int shift = 24 - 8 * pass;
        const uint32_t prefix = s.prefix;
        int *hist = s.hist + 256 * (pass & 1), *next = s.hist + 256 * ((pass + 1) & 1);
        for (int base = 0; base < n; base += kTopkThreads) {
            const int i = base + tid;
            const uint32_t kv = i < n ? score_key(sc[i]) : 0;
            histogram_add(hist, i < n && (kv & mask) == prefix, (kv >> shift) & 255);
        }
        __syncthreads();
        // Warp 0 scans the histogram from the top digit down, each lane over 8 digits; the lane where the running
        // count reaches the remaining k-th key walks its own 8 and records the digit. It also clears `next`.
        if (tid < 32) {
            const int lane = tid, rem = s.remaining;
            int local = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                local += hist[255 - 8 * lane - j];
                next[8 * lane + j] = 0;
            }
            int incl = local;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(kFull, incl, o);
                if (lane >= o) incl += v;
            }
            const int excl = incl - local;
            if (excl < rem && incl >= rem) {
                int cum = excl;
                for (int j = 0; j < 8; ++j) {
                    const int dgt = 255 - 8 * lane - j;
                    if (cum + hist[dgt] >= rem) {
                        s.prefix = prefix | uint32_t(dgt) << shift;
                        s.remaining = rem - cum;
                        break;
                    }
                    cum += hist[dgt];
                }
            }
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    write_top_k(sc, n, s.prefix, s.remaining, sel, s);
}

// The k highest of n scores by one block, whichever path the rows take.
__device__ void block_top_k(const float * sc, int n, int k, int32_t * sel, TopkShared & s) {
    const bool in_registers = n <= kTopkMaxRows;
    if (in_registers ? block_top_k_coarse(sc, n, k, sel, s) : block_top_k_coarse_l2(sc, n, k, sel, s)) return;
    block_top_k_radix(sc, n, k, sel, s);
}

// A decode step's rows past the registers, split: slices of about kTopkSliceRows rows, each slice's top k chosen
// by a block of its own (indexer_topk_slices_kernel), then the token's block chooses the top k of those candidates.
// A row among the top k of all rows is among the top k of its slice (every row ranked above it in the slice is
// ranked above it in all rows), so the candidates hold the answer. They are stored slice after slice, each slice's
// ascending, so a candidate's index orders like its row: the ties still go to the lower row. One block alone took
// 18.7 µs at 128K (32768 rows) and 187 at 1M (262144; session 22's traces), its passes growing with the rows.
struct TopkSlices {
    int count;      // slices
    int rows;       // rows of each slice but the last (which may have fewer)
    int per_slice;  // candidates of each slice but the last: min(k, rows)
};

__host__ __device__ inline TopkSlices topk_slices(int visible, int k) {
    const int most = std::max(1, kTopkMaxRows / k);  // the candidates stay within the registers of the second block
    const int count = std::min(most, (visible + kTopkSliceRows - 1) / kTopkSliceRows);
    const int rows = (visible + count - 1) / count;
    return {count, rows, std::min(k, rows)};
}

// Slice blockIdx.x of token blockIdx.y: its top k (all its rows when it has k or fewer) as candidates, rows
// ascending, with their scores. Tokens whose rows fit one block's registers have nothing to split.
__global__ void __launch_bounds__(kTopkThreads) indexer_topk_slices_kernel(const IndexerArgs a) {
    pdl_begin();
    __shared__ TopkShared s;
    const int64_t t = blockIdx.y;
    const int visible = int(indexer_visible(a, t));
    if (visible <= kTopkMaxRows) return;
    const TopkSlices sl = topk_slices(visible, int(a.top_k));
    if (int(blockIdx.x) >= sl.count) return;
    const int first = int(blockIdx.x) * sl.rows, n = min(sl.rows, visible - first), k = min(int(a.top_k), n);
    const float * sc = a.scores + t * a.capacity + first;
    float * cand_score = a.cand_scores + t * kTopkMaxRows + int64_t(blockIdx.x) * sl.per_slice;
    int32_t * cand_row = a.cand_rows + t * kTopkMaxRows + int64_t(blockIdx.x) * sl.per_slice;
    if (n > k) block_top_k(sc, n, k, cand_row, s);
    __syncthreads();  // every thread's selection is written before any is read back
    for (int j = threadIdx.x; j < k; j += kTopkThreads) {
        const int r = n > k ? cand_row[j] : j;
        cand_score[j] = sc[r];
        cand_row[j] = first + r;
    }
}

// The top_k highest scores of each token's visible rows (ties to the lower row, ascending); with split slices, the
// top_k of their candidates.
__global__ void __launch_bounds__(kTopkThreads) indexer_topk_kernel(const IndexerArgs a) {
    const int64_t t = blockIdx.x;
    const int64_t visible = indexer_visible(a, t);
    pdl_begin();
    __shared__ TopkShared s;
    int32_t * sel = a.selected + t * a.top_k;
    if (visible <= a.top_k) {
        for (int64_t j = threadIdx.x; j < a.top_k; j += blockDim.x) sel[j] = j < visible ? int32_t(j) : -1;
        return;
    }
    const int n = int(visible), k = int(a.top_k);
    if (!a.cand_rows || n <= kTopkMaxRows) {
        block_top_k(a.scores + t * a.capacity, n, k, sel, s);
        return;
    }
    const TopkSlices sl = topk_slices(n, k);
    const int last = sl.count - 1, candidates = last * sl.per_slice + min(k, n - last * sl.rows);
    const int32_t * cand_row = a.cand_rows + t * kTopkMaxRows;
    if (candidates > k) block_top_k(a.cand_scores + t * kTopkMaxRows, candidates, k, sel, s);
    __syncthreads();  // every thread's selection is written before any is read back
    for (int j = threadIdx.x; j < k; j += kTopkThreads) sel[j] = cand_row[candidates > k ? sel[j] : j];
}

// ---------------------------------------------------------------------------------------------------------------------
// Sink attention
// ---------------------------------------------------------------------------------------------------------------------
constexpr int kAttnWarps = 8;  // heads per block

struct KeyList {
    int64_t nw, nc, p_lo;
};

__device__ __forceinline__ KeyList key_list(const AttentionArgs & a, int64_t pos) {
    KeyList k;
    k.p_lo = std::max<int64_t>(0, pos - a.window + 1);
    k.nw = pos - k.p_lo + 1;
    k.nc = !a.comp ? 0 : a.selected ? a.top_k : std::min<int64_t>((pos + 1) / a.ratio, a.comp_capacity);
    return k;
}

// Element `odd` of the pair (x0, x1) after rope_pair(inverse) at position pos: the same expressions, so the fused
// rotation equals rope_kernel's bit for bit.
__device__ __forceinline__ float unrotated(float x0, float x1, int odd, float inv_freq, int32_t pos) {
    float v[2] = {x0, x1};
    rope_pair(v, float(pos), inv_freq, true);
    return v[odd];
}

// Row j of the token's keys, or null for an unused selection slot.
__device__ __forceinline__ const float * key_row(const AttentionArgs & a, const KeyList & kl, int64_t t, int64_t j) {
    if (j < kl.nw) return a.raw + ((kl.p_lo + j) % a.ring) * a.dim;
    const int64_t jj = j - kl.nw;
    if (!a.selected) return a.comp + jj * a.dim;
    const int32_t idx = a.selected[t * a.top_k + jj];
    return idx >= 0 && idx < a.comp_capacity ? a.comp + int64_t(idx) * a.dim : nullptr;
}

// Keys a block stages in shared memory at once: 32 KB of f32 rows a buffer (16 keys of V4's 512-wide heads: a
// decode split's keys in one or two chunks), two buffers (the next chunk's copies run while the warps work on this
// one), 8..64 keys and a multiple of the widest step (8 keys). ld: a staged row's floats, 32 · DPL.
__host__ __device__ inline int attention_chunk_keys(int ld) { return std::min(64, std::max(8, 8192 / ld / 8 * 8)); }

// One warp per head, 8 heads per block; keys of the token are split over gridDim.y blocks; with one split the
// output is final, else a partial (max, denominator, numerator) per split. The block copies its keys into shared
// memory a chunk at a time (cp.async, each warp its own rows, the next chunk in flight while the warps use this
// one), so a chunk costs one memory round trip; the warps' steps of kKeys keys then wait only for shared memory
// and their shuffles. Rows are padded with zeros to 32 · DPL floats and missing keys are rows of zeros, so a lane's
// loads are plain loads at constant offsets: with a bounds check and a 64-bit index per element a CSA layer's
// split (20 keys) executed ~180 instructions a key, without them ~130 (Nsight Compute), and took 13 µs against 10.
template <int DPL>
__global__ void __launch_bounds__(kAttnWarps * 32, 2) attention_kernel(const AttentionArgs a, int64_t per_split) {
    constexpr int ld = 32 * DPL;
    extern __shared__ __align__(16) float attn_keys[];  // [2][chunk][ld] the staged key rows (f32)
    __shared__ bool attn_valid[2][64];                  // whether row r of a buffer is a key (else zeros)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t h = int64_t(blockIdx.x) * kAttnWarps + warp, t = blockIdx.z, split = blockIdx.y;
    const bool active = h < a.heads;  // a partial head group's idle warps still copy their rows
    const float sink = gridDim.y == 1 && active ? a.sinks[h] : 0.0f;  // a weight: read before the wait
    const int d = int(a.dim), chunk = attention_chunk_keys(ld);
    for (int i = threadIdx.x; i < 2 * chunk * (ld - d); i += blockDim.x)
        attn_keys[(i / (ld - d)) * ld + d + i % (ld - d)] = 0.0f;  // the pads, never copied into
    const KeyList kl = key_list(a, a.positions[t]);
    pdl_begin();
    const int64_t nk = kl.nw + kl.nc;
    const int64_t j0 = split * per_split, j1 = min(nk, j0 + per_split);
    // Chunk c0.. into buffer b: warp w copies rows w, w + 8, ...; every lane finds the row itself (the selected
    // index is one load for the warp).
    auto stage = [&](int64_t c0, int b) {
        float * dst = attn_keys + b * chunk * ld;
        for (int r = warp; r < chunk; r += kAttnWarps) {
            const float * src = c0 + r < j1 ? key_row(a, kl, t, c0 + r) : nullptr;
            if (lane == 0) attn_valid[b][r] = src != nullptr;
            float * row = dst + r * ld;
            if (d % 4 == 0)
                for (int e = 4 * lane; e < d; e += 128) cp_async16(row + e, src ? src + e : nullptr);  // null: zeros
            else
                for (int e = lane; e < d; e += 32)
                    if (src)
                        cp_async4(row + e, src + e);
                    else
                        row[e] = 0.0f;
        }
        cp_async_commit();
    };
    if (j0 < j1) stage(j0, 0);
    float qv[DPL], o[DPL];
    const float * qh = a.q + (t * a.heads + (active ? h : 0)) * a.dim;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
        const int e = lane + 32 * i;
        qv[i] = e < d ? qh[e] : 0.0f;
        o[i] = 0.0f;
    }
    // kKeys keys per step: their loads and reductions are independent, so a step costs about one shared-memory and
    // one shuffle latency instead of kKeys of each.
    constexpr int kKeys = DPL <= 4 ? 8 : 4;
    float m = -INFINITY, den = 0.0f;
    for (int64_t c0 = j0, b = 0; c0 < j1; c0 += chunk, b ^= 1) {
        if (c0 + chunk < j1) {
            stage(c0 + chunk, int(b ^ 1));  // its buffer's last readers passed the barrier that ended their chunk
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const float * rows = attn_keys + int(b) * chunk * ld + lane;
        const int keys = int(min(int64_t(chunk), j1 - c0));
        for (int s = 0; active && s < keys; s += kKeys) {
            float kv[kKeys][DPL];
            float l[kKeys];
#pragma unroll
            for (int jj = 0; jj < kKeys; ++jj) {
                const float * kr = rows + (s + jj) * ld;
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < DPL; ++i) {
                    kv[jj][i] = kr[32 * i];
                    dot += qv[i] * kv[jj][i];
                }
                l[jj] = s + jj < keys && attn_valid[b][s + jj] ? dot : -INFINITY;
            }
            float m_new = m;
#pragma unroll
            for (int jj = 0; jj < kKeys; ++jj) {
                l[jj] = warp_sum(l[jj]) * a.scale;  // -inf (no key) stays -inf
                m_new = fmaxf(m_new, l[jj]);
            }
            if (m_new == -INFINITY) continue;  // no key in this step
            const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
            float p[kKeys];
            den *= corr;
#pragma unroll
            for (int jj = 0; jj < kKeys; ++jj) {
                p[jj] = expf(l[jj] - m_new);  // 0 for no key
                den += p[jj];
            }
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                float v = o[i] * corr;
#pragma unroll
                for (int jj = 0; jj < kKeys; ++jj) v += p[jj] * kv[jj][i];
                o[i] = v;
            }
            m = m_new;
        }
        __syncthreads();
    }
    if (!active) return;
    if (gridDim.y == 1) {
        const float mf = fmaxf(m, sink);
        const float c = m == -INFINITY ? 0.0f : expf(m - mf);
        const float inv = 1.0f / (den * c + expf(sink - mf));
        float * out = a.out + (t * a.heads + h) * d;
        const int64_t rot0 = d - a.out_n_rot;  // first rotated channel (even)
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            const int e = lane + 32 * i;
            float v = o[i] * c * inv;
            // The pair (e, e ^ 1) sits in neighbouring lanes (32 is even).
            const float other = __shfl_xor_sync(kFull, v, 1);
            if (a.out_n_rot > 0 && e >= rot0 && e < d)
                v = unrotated(e & 1 ? other : v, e & 1 ? v : other, e & 1, a.out_inv_freq[(e - rot0) / 2],
                              a.positions[t]);
            if (e < d) out[e] = v;
        }
    } else {
        float * part = a.partial + ((t * a.heads + h) * gridDim.y + split) * (d + 2);
        if (lane == 0) {
            part[0] = m;
            part[1] = den;
        }
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            const int e = lane + 32 * i;
            if (e < d) part[2 + e] = o[i];
        }
    }
}

// Splits of one head at most (attention_splits clamps to it): the combine gives each lane two of them.
constexpr int kMaxSplits = 64;

// One block per (token, head): warp 0 weighs the splits (max, denominator with the sink; each split's weight
// exp(m_s - max) computed once, by its lane, and kept in shared memory), then every thread sums two channels over
// the splits. A block per head, not a warp, so a decode step's 64 heads keep 64 SMs busy, and
// the split loop's loads are independent (no branch around them) so they overlap. The numerators do not depend on
// the weights: a thread's first batch of them (every split of a decode step up to 32) is loaded with the maxima,
// so the kernel waits on one L2 round trip after the attention, not two.
__global__ void attention_combine_kernel(const AttentionArgs a, int splits) {
    __shared__ float weight[kMaxSplits];
    __shared__ float s_inv;
    const int64_t th = blockIdx.x, h = th % a.heads, d = a.dim;
    const float sink = a.sinks[h];  // a weight: read before the wait
    const int64_t rot0 = d - a.out_n_rot, e_first = 2 * int64_t(threadIdx.x);
    const float inv_freq = a.out_n_rot > 0 && e_first >= rot0 && e_first < d ? a.out_inv_freq[(e_first - rot0) / 2] : 0;
    const float pos = float(a.positions[th / a.heads]);
    pdl_begin();
    const float * part = a.partial + th * splits * (d + 2);
    // An empty split's numerator was never written: its weight is 0 and it must add nothing, not 0·NaN. The
    // numerators of kBatch splits are loaded before any is added (a decode step has 16-64 splits: one L2 round trip
    // per split was most of this kernel's time, and one per 8 splits still 5 for a CSA layer's 33); the sum order
    // stays split by split.
    constexpr int kBatch = 32;
    float v0[kBatch], v1[kBatch];
    const auto load_batch = [&](int64_t e, int s0) {
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
            const float * p = part + (s0 + j) * (d + 2) + 2 + e;
            v0[j] = s0 + j < splits ? p[0] : 0.0f;
            v1[j] = s0 + j < splits && e + 1 < d ? p[1] : 0.0f;
        }
    };
    if (e_first < d) load_batch(e_first, 0);
    if (threadIdx.x < 32) {
        // A lane's splits (lane, lane + 32) and their maxima and denominators, loaded at once.
        const int lane = threadIdx.x;
        float ms[kMaxSplits / 32], dn[kMaxSplits / 32];
#pragma unroll
        for (int i = 0; i < kMaxSplits / 32; ++i) {
            const int s = lane + 32 * i;
            ms[i] = s < splits ? part[s * (d + 2)] : -INFINITY;
            dn[i] = s < splits ? part[s * (d + 2) + 1] : 0.0f;
        }
        float mf = sink;
#pragma unroll
        for (int i = 0; i < kMaxSplits / 32; ++i) mf = fmaxf(mf, ms[i]);
        mf = warp_max(mf);
        float den = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxSplits / 32; ++i) {
            const int s = lane + 32 * i;
            if (s >= splits) break;
            const float wgt = ms[i] == -INFINITY ? 0.0f : expf(ms[i] - mf);
            weight[s] = wgt;
            den += wgt == 0.0f ? 0.0f : dn[i] * wgt;
        }
        den = warp_sum(den) + expf(sink - mf);
        if (lane == 0) s_inv = 1.0f / den;
    }
    __syncthreads();
    const float inv = s_inv;
    for (int64_t e = e_first; e < d; e += 2 * int64_t(blockDim.x)) {
        float acc0 = 0.0f, acc1 = 0.0f;
        const bool pair = e + 1 < d;
        for (int s0 = 0; s0 < splits; s0 += kBatch) {
            if (e != e_first || s0 != 0) load_batch(e, s0);
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                if (s0 + j >= splits) break;
                const float wgt = weight[s0 + j];
                acc0 += wgt != 0.0f ? v0[j] * wgt : 0.0f;
                acc1 += wgt != 0.0f ? v1[j] * wgt : 0.0f;
            }
        }
        float v[2] = {acc0 * inv, acc1 * inv};
        if (a.out_n_rot > 0 && e >= rot0)
            rope_pair(v, pos, e == e_first ? inv_freq : a.out_inv_freq[(e - rot0) / 2], true);
        a.out[th * d + e] = v[0];
        if (pair) a.out[th * d + e + 1] = v[1];
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Sink attention on the tensor cores (prefill)
// ---------------------------------------------------------------------------------------------------------------------
// A block per (token, HEADS heads): the heads are the rows of a HEADS × d query tile, and the token's keys (window,
// then compressed rows) pass through shared memory KEYS at a time as f16. One pass with an online softmax on
// mma.sync tiles, whose accumulator layout is known (lane 4g + c holds rows g and g + 8 of its 16-row tile), so a
// warp rescales its own output rows when their max grows; until session 26 two WMMA passes (max and sum, then P·V)
// staged and scored every key twice. The warps form HEADS / 16 head tiles × kGroups groups: warp w takes head tile
// w % (HEADS / 16) and, of each key tile, group w / (HEADS / 16)'s keys for the scores and its d / kGroups channels
// for the output; a row's max is agreed through shared memory, its sum is added up once at the end.
template <int D, int HEADS, int KEYS, int WARPS>
constexpr size_t attention_tc_smem() {
    return size_t(HEADS + KEYS) * (D + 8) * 2          // query tile, key tile (f16)
           + size_t(HEADS) * (KEYS + 8) * 2            // probabilities (f16)
           + size_t(WARPS / (HEADS / 16)) * HEADS * 4  // each group's row maxima (then sums)
           + size_t(KEYS) * sizeof(const float *);     // the key tile's rows
}

template <int D, int HEADS, int KEYS, int WARPS, bool SPLIT>
__global__ void __launch_bounds__(WARPS * 32) attention_tc_kernel(const AttentionArgs a, int64_t per_split) {
    constexpr int kThreads = WARPS * 32, kLd = D + 8, kLdP = KEYS + 8;
    constexpr int kHeadTiles = HEADS / 16, kGroups = WARPS / kHeadTiles;
    constexpr int kGroupKeys = KEYS / kGroups, kGroupChannels = D / kGroups;
    constexpr int kKeyN8 = kGroupKeys / 8, kChannelN8 = kGroupChannels / 8;
    static_assert(WARPS % kHeadTiles == 0 && kGroupKeys % 8 == 0 && (kKeyN8 == 1 || kKeyN8 % 2 == 0) &&
                      kChannelN8 % 2 == 0 && KEYS % 16 == 0,
                  "a warp's keys and channels are whole 8-column tiles");
    extern __shared__ __align__(128) uint8_t smem[];
    half * qs = reinterpret_cast<half *>(smem);                        // [HEADS][kLd]
    half * ks = qs + HEADS * kLd;                                      // [KEYS][kLd] keys = values
    half * ps = ks + KEYS * kLd;                                       // [HEADS][kLdP]
    float * group_red = reinterpret_cast<float *>(ps + HEADS * kLdP);  // [kGroups][HEADS]
    const float ** key_ptr = reinterpret_cast<const float **>(group_red + kGroups * HEADS);  // [KEYS]

    const int64_t t = blockIdx.x, h0 = int64_t(blockIdx.y) * HEADS;
    const KeyList kl = key_list(a, a.positions[t]);
    pdl_begin();
    // SPLIT (decode): the token's keys split over gridDim.z blocks, per_split each, whose partials the combine merges.
    const int64_t j_begin = int64_t(blockIdx.z) * per_split;
    const int64_t nk = std::min(kl.nw + kl.nc, j_begin + per_split);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c4 = lane % 4;
    const int head_tile = warp % kHeadTiles, group = warp / kHeadTiles;
    const int r0 = head_tile * 16 + g, r1 = r0 + 8;  // this lane's two head rows
    const int key0 = group * kGroupKeys, ch0 = group * kGroupChannels;

    // R rows of D floats (src(r), or null for a row of zeros) into a tile of f16 rows: a thread's groups of 8 values
    // are loaded kBatch at a time before any is converted, so a 64-row tile costs few memory round trips at d = 512,
    // not one a group (prefill at 128K: +2.3 % tokens a second, session 22). A zero row's loads read the query
    // instead and are dropped: guarded as `p ? __ldg(p) : 0`, the 512-thread kernel at d = 128 still read address 0
    // (compute-sanitizer, session 26).
    constexpr int kBatch = 4;
    auto stage = [&](auto rows, half * dst, auto src) {
        constexpr int kRowGroups = decltype(rows)::value * (D / 8);
        for (int g0 = tid; g0 < kRowGroups; g0 += kBatch * kThreads) {
            float4 x[kBatch][2];
#pragma unroll
            for (int b = 0; b < kBatch; ++b) {
                const int gi = g0 + b * kThreads;
                const float * row = gi < kRowGroups ? src(gi / (D / 8)) : nullptr;
                const float4 * p = reinterpret_cast<const float4 *>(row ? row + (gi % (D / 8)) * 8 : a.q);
                x[b][0] = __ldg(p);
                x[b][1] = __ldg(p + 1);
                if (!row) x[b][0] = x[b][1] = make_float4(0, 0, 0, 0);
            }
#pragma unroll
            for (int b = 0; b < kBatch; ++b) {
                const int gi = g0 + b * kThreads;
                if (gi >= kRowGroups) break;
                store_f16x8(dst + (gi / (D / 8)) * kLd + (gi % (D / 8)) * 8, x[b][0], x[b][1]);
            }
        }
    };
    stage(std::integral_constant<int, HEADS>(), qs,
          [&](int h) { return h0 + h < a.heads ? a.q + (t * a.heads + h0 + h) * D : nullptr; });

    float out[kChannelN8][4] = {};             // rows r0 ([0], [1]) and r1 ([2], [3]), channels ch0 + 8j + 2c4 + {0, 1}
    float max0 = -INFINITY, max1 = -INFINITY;  // the rows' max so far (every group agrees)
    float sum0 = 0.0f, sum1 = 0.0f;            // exp-sums of this lane's keys so far, at the running max
    for (int64_t j0 = j_begin; j0 < nk; j0 += KEYS) {
        // Keys [j0, j0 + KEYS) into ks (unused selection slots and keys past the end: zero rows, marked null). The
        // previous tile's last reads of ks and ps end before this barrier; of key_ptr and group_red, before the
        // previous probabilities were written.
        if (tid < KEYS) key_ptr[tid] = j0 + tid < nk ? key_row(a, kl, t, j0 + tid) : nullptr;
        __syncthreads();
        stage(std::integral_constant<int, KEYS>(), ks, [&](int k) { return key_ptr[k]; });
        __syncthreads();

        float score[kKeyN8][4] = {};
        for (int kk = 0; kk < D; kk += 16) {
            uint32_t af[4];
            ldmatrix_a(af, qs + head_tile * 16 * kLd + kk, kLd, lane);
            if constexpr (kKeyN8 == 1) {
                uint32_t b[2];
                ldmatrix_b1(b, ks + key0 * kLd + kk, kLd, lane);
                mma_16816(score[0], af, b[0], b[1]);
            } else {
#pragma unroll
                for (int n = 0; n < kKeyN8; n += 2) {
                    uint32_t b[4];
                    ldmatrix_b2(b, ks + (key0 + 8 * n) * kLd + kk, kLd, lane);
                    mma_16816(score[n], af, b[0], b[1]);
                    mma_16816(score[n + 1], af, b[2], b[3]);
                }
            }
        }
        float tile0 = -INFINITY, tile1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < kKeyN8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool valid = key_ptr[key0 + 8 * n + 2 * c4 + e] != nullptr;
                score[n][e] = valid ? score[n][e] * a.scale : -INFINITY;
                score[n][2 + e] = valid ? score[n][2 + e] * a.scale : -INFINITY;
                tile0 = fmaxf(tile0, score[n][e]);
                tile1 = fmaxf(tile1, score[n][2 + e]);
            }
#pragma unroll
        for (int o = 1; o < 4; o *= 2) {
            tile0 = fmaxf(tile0, __shfl_xor_sync(kFull, tile0, o));
            tile1 = fmaxf(tile1, __shfl_xor_sync(kFull, tile1, o));
        }
        if (c4 == 0) {
            group_red[group * HEADS + r0] = tile0;
            group_red[group * HEADS + r1] = tile1;
        }
        __syncthreads();
        float new0 = max0, new1 = max1;
#pragma unroll
        for (int q = 0; q < kGroups; ++q) {
            new0 = fmaxf(new0, group_red[q * HEADS + r0]);
            new1 = fmaxf(new1, group_red[q * HEADS + r1]);
        }
        // A row with no visible key yet keeps max -inf, zero probabilities and a zero output.
        const float alpha0 = new0 == -INFINITY ? 0.0f : expf(max0 - new0);
        const float alpha1 = new1 == -INFINITY ? 0.0f : expf(max1 - new1);
        max0 = new0;
        max1 = new1;
        sum0 *= alpha0;
        sum1 *= alpha1;
#pragma unroll
        for (int n = 0; n < kKeyN8; ++n) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                p[e] = new0 == -INFINITY ? 0.0f : expf(score[n][e] - new0);
                p[2 + e] = new1 == -INFINITY ? 0.0f : expf(score[n][2 + e] - new1);
            }
            sum0 += p[0] + p[1];
            sum1 += p[2] + p[3];
            const int col = key0 + 8 * n + 2 * c4;
            *reinterpret_cast<half2 *>(ps + r0 * kLdP + col) = __floats2half2_rn(p[0], p[1]);
            *reinterpret_cast<half2 *>(ps + r1 * kLdP + col) = __floats2half2_rn(p[2], p[3]);
        }
#pragma unroll
        for (int j = 0; j < kChannelN8; ++j) {
            out[j][0] *= alpha0;
            out[j][1] *= alpha0;
            out[j][2] *= alpha1;
            out[j][3] *= alpha1;
        }
        __syncthreads();

        // P (16 heads × KEYS) · V (KEYS × this group's channels); V is the key tile read through the transposing load.
#pragma unroll
        for (int kk = 0; kk < KEYS; kk += 16) {
            uint32_t af[4];
            ldmatrix_a(af, ps + head_tile * 16 * kLdP + kk, kLdP, lane);
#pragma unroll
            for (int j = 0; j < kChannelN8; j += 2) {
                uint32_t b[4];
                ldmatrix_b2_trans(b, ks + kk * kLd + ch0 + 8 * j, kLd, lane);
                mma_16816(out[j], af, b[0], b[1]);
                mma_16816(out[j + 1], af, b[2], b[3]);
            }
        }
    }

    // The rows' exp-sums: over the quad's lanes, then over the groups (group_red's maxima were last read before
    // the previous barrier).
#pragma unroll
    for (int o = 1; o < 4; o *= 2) {
        sum0 += __shfl_xor_sync(kFull, sum0, o);
        sum1 += __shfl_xor_sync(kFull, sum1, o);
    }
    __syncthreads();
    if (c4 == 0) {
        group_red[group * HEADS + r0] = sum0;
        group_red[group * HEADS + r1] = sum1;
    }
    __syncthreads();
    // The sink joins the denominator, as in attention_kernel's one-split case; the inverse rope of the last
    // out_n_rot channels (adjacent pairs, as a lane holds them) as the rows are written. A split writes its
    // partial (max, denominator, numerators) instead, as attention_kernel's splits do.
#pragma unroll
    for (int half_row = 0; half_row < 2; ++half_row) {
        const int r = half_row ? r1 : r0;
        if (h0 + r >= a.heads) continue;
        float total = 0.0f;
#pragma unroll
        for (int q = 0; q < kGroups; ++q) total += group_red[q * HEADS + r];
        const float m = half_row ? max1 : max0;
        if constexpr (SPLIT) {
            float * part = a.partial + ((t * a.heads + h0 + r) * gridDim.z + blockIdx.z) * (D + 2);
            if (group == 0 && c4 == 0) {
                part[0] = m;
                part[1] = total;
            }
#pragma unroll
            for (int j = 0; j < kChannelN8; ++j)
                __stwb(reinterpret_cast<float2 *>(part + 2 + ch0 + 8 * j + 2 * c4),
                       make_float2(out[j][2 * half_row], out[j][2 * half_row + 1]));  // as the output's, below
            continue;
        }
        const float sink = a.sinks[h0 + r];
        const float mf = fmaxf(m, sink);
        const float corr = m == -INFINITY ? 0.0f : expf(m - mf);
        const float weight = corr / (total * corr + expf(sink - mf));
        float * dst = a.out + (t * a.heads + h0 + r) * D;
#pragma unroll
        for (int j = 0; j < kChannelN8; ++j) {
            const int c = ch0 + 8 * j + 2 * c4;
            float v[2] = {out[j][2 * half_row] * weight, out[j][2 * half_row + 1] * weight};
            if (a.out_n_rot > 0 && c >= D - a.out_n_rot)
                rope_pair(v, float(a.positions[t]), a.out_inv_freq[(c - (D - a.out_n_rot)) / 2], true);
            __stwb(reinterpret_cast<float2 *>(dst + c), make_float2(v[0], v[1]));  // nvcc split a plain float2 store
        }
    }
}

// 64 heads × 64 keys a tile on 16 warps where a block's shared memory holds them (141 KB at d = 512), else 32 heads ×
// 32 keys on 8 (68 KB: sm_120/121 at d = 512, where each key row is then staged by two blocks a token). On the H200
// 64 × 64 on 8 warps was 5 % slower (session 26); 32 heads × 64 keys on 8 warps 10 % slower at one block a
// multiprocessor and 2 % at two (session 27; session 26 had found it as fast).
template <int D>
constexpr size_t attention_wide_smem() {
    return attention_tc_smem<D, 64, 64, 16>();
}

template <int D>
void launch_attention_tc(const AttentionArgs & a, int splits, int64_t per_split, cudaStream_t s) {
    const auto run = [&](auto kernel, int heads, int warps, size_t smem) {
        launch(kernel, dim3(unsigned(a.n), unsigned((a.heads + heads - 1) / heads), unsigned(splits)), dim3(warps * 32),
               smem, s, a, per_split);
    };
    // Prefill's kernel carries no split code (the partial writes it never makes; their cost measured 0.2-0.5 %).
    const auto tiles = [&](auto split) {
        constexpr bool kSplit = decltype(split)::value;
        if (attention_wide_smem<D>() <= device_smem_optin())
            run(attention_tc_kernel<D, 64, 64, 16, kSplit>, 64, 16, attention_wide_smem<D>());
        else
            run(attention_tc_kernel<D, 32, 32, 8, kSplit>, 32, 8, attention_tc_smem<D, 32, 32, 8>());
    };
    if (splits > 1)
        tiles(std::true_type());
    else
        tiles(std::false_type());
}

size_t attention_tc_smem(int64_t dim) {  // the smallest tiles' bytes; SIZE_MAX: no kernel for that width
    switch (dim) {
        case 64:
            return attention_tc_smem<64, 32, 32, 8>();
        case 128:
            return attention_tc_smem<128, 32, 32, 8>();
        case 256:
            return attention_tc_smem<256, 32, 32, 8>();
        case 512:
            return attention_tc_smem<512, 32, 32, 8>();
        default:
            return SIZE_MAX;
    }
}

int64_t max_keys(const AttentionArgs & a) { return a.window + (!a.comp ? 0 : a.selected ? a.top_k : a.comp_capacity); }

}  // namespace

void store_rows(float * ring, int64_t ring_rows, const float * rows, int64_t n, int64_t width,
                const int32_t * positions, cudaStream_t s) {
    if (n * width > 0)
        launch(store_rows_kernel, dim3(blocks_for(n * width, 256)), dim3(256), 0, s, ring, ring_rows, rows, n, width,
               positions);
}

void compressor_update(const CompressorArgs & a, cudaStream_t s) {
    if (a.n <= 0) return;
    const int64_t width = a.overlap ? a.wide / 2 : a.wide;
    // Every pooling thread owns one channel (up to 512: a V4 row); the state update runs after every pool read.
    const int threads = int(std::clamp<int64_t>((width + 31) / 32 * 32, 64, 512));
    launch(compressor_rows_kernel, dim3(unsigned(a.n)), dim3(threads), size_t(width) * sizeof(float), s, a);
    launch(compressor_state_kernel, dim3(blocks_for(a.ratio * a.wide, 256)), dim3(256), 0, s, a);
}

// Whether a launch splits its tokens' top-k over slices (a decode step past the registers' rows; graph-stable: the
// capacity decides, not the position).
bool indexer_topk_split(int64_t n, int64_t capacity, int64_t top_k) {
    return n <= kTopkSplitTokens && capacity > kTopkMaxRows && top_k > 0 && 2 * top_k <= kTopkMaxRows;
}

// The scores' part of the scratch, 16-byte aligned: the split top-k's candidates follow it.
size_t indexer_scores_bytes(int64_t n, int64_t capacity) {
    return (size_t(n * capacity) * sizeof(float) + 15) / 16 * 16;
}

size_t indexer_scratch_bytes(int64_t n, int64_t capacity, int64_t top_k) {
    return indexer_scores_bytes(n, capacity) +
           (indexer_topk_split(n, capacity, top_k) ? size_t(n) * kTopkMaxRows * 8 : 0);
}

void indexer_select(IndexerArgs a, cudaStream_t s) {
    if (a.n <= 0) return;
    const bool split = indexer_topk_split(a.n, a.capacity, a.top_k);
    if (split) {
        a.cand_scores =
            reinterpret_cast<float *>(reinterpret_cast<char *>(a.scores) + indexer_scores_bytes(a.n, a.capacity));
        a.cand_rows = reinterpret_cast<int32_t *>(a.cand_scores + a.n * kTopkMaxRows);
    }
    const size_t smem = size_t(a.heads * (a.dim + 4) + a.heads) * sizeof(float);
    const dim3 grid(blocks_for(a.capacity, kIdxKeysPerBlock), unsigned(a.n));
    const bool h64 = a.heads == kIdxFastHeads && a.dim == kIdxFastDim;
    const auto tc_prefill = [&](auto tokens) {
        constexpr int kTok = decltype(tokens)::value;
        launch(indexer_scores_tc_kernel<kTok>, dim3(unsigned((a.n + kTok - 1) / kTok)), dim3(kTok * 128),
               idx_tc_smem<kTok>(), s, a);
    };
    // A prefill chunk's blocks walk every key tile; a decode step's tokens spread theirs over slices, two blocks a
    // multiprocessor (as many as the shared memory holds).
    const auto mma_scores = [&](auto tokens, auto warps_a_token) {
        constexpr int kTok = decltype(tokens)::value, kWpt = decltype(warps_a_token)::value;
        const unsigned slices =
            kTok > 1
                ? 1u
                : std::max(1u, std::min<unsigned>(blocks_for(a.capacity, kWpt * 32), unsigned(2 * device_sms() / a.n)));
        launch(indexer_scores_mma_kernel<kTok, kWpt>, dim3(unsigned((a.n + kTok - 1) / kTok), slices),
               dim3(kTok * kWpt * 32), idx_mma_smem<kTok, kWpt>(), s, a);
    };
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using I4 = std::integral_constant<int, 4>;
    if (a.capacity > a.top_k && h64 && a.tensor_cores && a.keys_bf16) {
        if (a.n < kGemmMinTokens)
            mma_scores(I1(), I4());
        else if (idx_mma_smem<4, 2>() + 1024 <= device_smem_optin())  // + its static scored; not on sm_120/121
            mma_scores(I4(), I2());
        else
            mma_scores(I2(), I2());
    } else if (a.capacity > a.top_k && h64 && a.tensor_cores && a.n >= kGemmMinTokens) {
        if (idx_tc_smem<4>() + 2048 <= device_smem_optin())  // + its static ws and scored; not on sm_120/121
            tc_prefill(I4());
        else
            tc_prefill(I2());
    } else if (a.capacity > a.top_k && h64 && a.tensor_cores) {  // up to four blocks a multiprocessor: at long
        // contexts their warps' key loads are what is in flight (two a multiprocessor: 12.5 µs at 128K, 67 at 1M;
        // four: 9.2 and 39.5, session 22's traces)
        const dim3 dec_grid(
            std::min<unsigned>(blocks_for(a.capacity, kIdxDecWarps * kIdxDecKeys), unsigned(4 * device_sms())),
            unsigned(a.n));
        launch(indexer_scores_tc_decode_kernel, dec_grid, dim3(kIdxDecWarps * 32), 0, s, a);
    } else if (a.capacity > a.top_k && h64)
        launch(indexer_scores_h64_kernel,
               dim3(std::min<unsigned>(blocks_for(a.capacity, 8), unsigned(2 * device_sms())), unsigned(a.n)),
               dim3(256), 0, s, a);
    else if (a.capacity > a.top_k)
        launch(indexer_scores_kernel, grid, dim3(256), smem, s, a);
    if (split)
        launch(indexer_topk_slices_kernel,
               dim3(unsigned(topk_slices(int(a.capacity), int(a.top_k)).count), unsigned(a.n)), dim3(kTopkThreads), 0,
               s, a);
    launch(indexer_topk_kernel, dim3(unsigned(a.n)), dim3(kTopkThreads), 0, s, a);
}

// Decode launches whose keys reach this many (an HCA layer's compressed rows from ~512K of context) take the
// tensor-core tiles, their keys split over the multiprocessors. Below it the CUDA-core kernel's splits were faster
// than the old two-pass tiles (session 22: 14 µs at 128K against 38–44; not re-measured against the one-pass
// tiles); at 1M the CUDA-core kernel took 87 µs, the one-pass tiles 52.8 (session 27).
constexpr int64_t kTcDecodeKeys = 4096;

bool attention_tensor_cores(int64_t dim, int64_t n, int64_t keys) {
    return attention_tc_smem(dim) <= device_smem_optin() && (n >= kGemmMinTokens || keys >= kTcDecodeKeys);
}

static bool takes_tiles(const AttentionArgs & a) {
    return a.tensor_cores && attention_tensor_cores(a.dim, a.n, max_keys(a));
}

// CUDA cores: two blocks per multiprocessor, each split at least 8 keys (two steps of kKeys = 4 for 512-wide heads):
// a warp's steps are dependent (loads, dot product, shuffles, exp), so a decode step's time is about its longest
// split. (At least 32 keys per split, as before session 7, left a sliding-window layer's 64 heads on 32 blocks of 8
// steps each.) Tiles: none for prefill; at decode one block of up to 64 heads a multiprocessor (one fits), each
// split whole 64-key tiles.
static int splits_of(const AttentionArgs & a, bool tiles) {
    if (tiles) {
        if (a.n >= kGemmMinTokens) return 1;
        const int64_t want = std::clamp<int64_t>(device_sms() / (a.n * ((a.heads + 63) / 64)), 1, kMaxSplits);
        const int64_t tiles_per_split = (max_keys(a) + 64 * want - 1) / (64 * want);
        return int((max_keys(a) + 64 * tiles_per_split - 1) / (64 * tiles_per_split));  // none of them empty
    }
    const int64_t groups = (a.heads + kAttnWarps - 1) / kAttnWarps;
    const int64_t want = (int64_t(device_sms()) * 2 + a.n * groups - 1) / (a.n * groups);
    const int64_t most = std::max<int64_t>(1, (max_keys(a) + 7) / 8);
    return int(std::clamp<int64_t>(want, 1, std::min<int64_t>(most, kMaxSplits)));
}

int attention_splits(const AttentionArgs & a) { return splits_of(a, takes_tiles(a)); }

int64_t attention_partial_floats(const AttentionArgs & a) {
    const int splits = attention_splits(a);
    return splits > 1 ? a.n * a.heads * splits * (a.dim + 2) : 0;
}

void attention(const AttentionArgs & a, cudaStream_t s) {
    if (a.n <= 0) return;
    const bool tiles = takes_tiles(a);
    const int splits = splits_of(a, tiles);
    const int64_t per_split = (max_keys(a) + splits - 1) / splits;
    if (tiles) {
        const int64_t tile_split = (per_split + 63) / 64 * 64;  // whole tiles: no split pays for a partial one
        switch (a.dim) {
            case 64:
                launch_attention_tc<64>(a, splits, tile_split, s);
                break;
            case 128:
                launch_attention_tc<128>(a, splits, tile_split, s);
                break;
            case 256:
                launch_attention_tc<256>(a, splits, tile_split, s);
                break;
            default:
                launch_attention_tc<512>(a, splits, tile_split, s);
        }
    } else {
        const dim3 grid(unsigned((a.heads + kAttnWarps - 1) / kAttnWarps), unsigned(splits), unsigned(a.n));
        // A lane's values of a head (DPL): 512-wide heads 16, narrower ones the next power of two.
        const int dpl = a.dim <= 32 ? 1 : a.dim <= 64 ? 2 : a.dim <= 128 ? 4 : a.dim <= 256 ? 8 : 16;
        const size_t smem = 2 * size_t(attention_chunk_keys(32 * dpl)) * size_t(32 * dpl) * sizeof(float);
        const auto run = [&](auto kernel) { launch(kernel, grid, dim3(kAttnWarps * 32), smem, s, a, per_split); };
        if (dpl == 1)
            run(attention_kernel<1>);
        else if (dpl == 2)
            run(attention_kernel<2>);
        else if (dpl == 4)
            run(attention_kernel<4>);
        else if (dpl == 8)
            run(attention_kernel<8>);
        else
            run(attention_kernel<16>);
    }
    if (splits > 1)
        launch(attention_combine_kernel, dim3(unsigned(a.n * a.heads)),
               dim3(unsigned(std::clamp<int64_t>((a.dim / 2 + 31) / 32 * 32, 32, 256))), 0, s, a, splits);
}

}  // namespace dsv4::cuda
