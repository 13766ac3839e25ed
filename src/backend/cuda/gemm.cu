// Tensor-core products for many tokens (prefill): the same MatvecArgs as matvec.cu (several targets, grouped
// projections, expert tiles, SwiGLU of gate and up, a SwiGLU activation, an addend), computed tile by tile with
// WMMA. The activations are rounded to f16 once, by gemm_activations (with their SwiGLU when x_up is given); a
// block decodes BM = 128 weight rows (64 for small products) × 64 columns to f16 in shared memory (decode8: one
// load and one scale per eight weights), loads 64 tokens' f16 activations beside them and accumulates in f32.
// Each weight byte is read once per 64 tokens instead of once per 8 with the integer dot products, each
// activation once per 128 rows, and the multiply-adds run on the tensor cores.
//
// Numerics: f16 activations (11-bit significand) instead of matvec's 8-bit codes, so these products are closer
// to f32 activations than the decode path is; a weight decodes to the f16 nearest its exact value.
#include "backend/cuda/common.cuh"

#include <mma.h>

namespace dsv4::cuda {
namespace {

using namespace nvcuda;

constexpr int kBN = kGemmTileTokens;  // tokens per block
constexpr int kBK = 64;               // columns per step
constexpr int kLd = kBK + 8;          // halves per shared row: a 16-byte multiple, and rows start on different banks

// Warps: BM / 32 × 2, each a 32-row × 32-token part of the BM × 64 output tile.
template <int BM>
constexpr int gemm_threads() {
    return BM / 32 * 2 * 32;
}

// Shared memory: during the K loop the weight tile(s) [BM][kLd] and the activation tile [kBN][kLd] (f16); after
// it, the same bytes hold the output tile [kBN][BM + 4] (f32; SwiGLU is applied in the accumulators).
template <int BM, bool GLU>
constexpr size_t gemm_smem() {
    constexpr size_t loop = size_t((GLU ? 2 : 1) * BM + kBN) * kLd * 2;
    constexpr size_t out = size_t(kBN) * (BM + 4) * 4;
    return loop > out ? loop : out;
}

// Eight weights (row, col..col+7) as f16 into dst (16-byte aligned); rows past the matrix are zero.
template <GgmlType T>
__device__ __forceinline__ void weights8_to_smem(const WeightRef & w, int64_t row, bool valid, int64_t col,
                                                 half * dst) {
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (valid) {
        if constexpr (T == GgmlType::F16) {
            packed = __ldg(reinterpret_cast<const uint4 *>(w.data + (row * w.ne0 + col) * 2));
        } else {
            float v[8];
            if constexpr (T == GgmlType::BF16) {
                const uint4 raw = __ldg(reinterpret_cast<const uint4 *>(w.data + (row * w.ne0 + col) * 2));
                const uint32_t word[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    v[2 * j] = bf16_bits_to_f32(uint16_t(word[j]));
                    v[2 * j + 1] = bf16_bits_to_f32(uint16_t(word[j] >> 16));
                }
            } else {
                decode8<T>(w, row, col, v);
            }
            half2 h[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
            packed = *reinterpret_cast<const uint4 *>(h);
        }
    }
    *reinterpret_cast<uint4 *>(dst) = packed;
}

template <GgmlType T, bool GLU, int BM>
__global__ void __launch_bounds__(gemm_threads<BM>()) gemm_kernel(const MatvecArgs a) {
    constexpr int kThreads = gemm_threads<BM>(), kLdOut = BM + 4;
    __shared__ __align__(128) uint8_t smem[gemm_smem<BM, GLU>()];
    __shared__ int64_t src[kBN], dst[kBN];
    __shared__ int n_tok_shared;
    half * ws = reinterpret_cast<half *>(smem);     // [GLU ? 2 : 1][BM][kLd]
    half * xs = ws + (GLU ? 2 : 1) * BM * kLd;      // [kBN][kLd]
    float * out = reinterpret_cast<float *>(smem);  // [kBN][kLdOut]

    MatvecTarget t = a.t[0];
#pragma unroll
    for (int i = 1; i < kMaxTargets; ++i)
        if (i < a.n_targets && int(blockIdx.x) >= a.t[i].first_block) t = a.t[i];
    const int64_t row0 = int64_t(int(blockIdx.x) - t.first_block) * BM;
    const int64_t k = t.w.ne0, group = blockIdx.z;
    pdl_begin();

    // The block's tokens: a plain range, or one expert's pairs.
    int64_t row_off = group * t.rows;
    if (a.tiles) {
        if (int(blockIdx.y) >= *a.n_tiles) return;
        const int32_t * tl = a.tiles + 3 * blockIdx.y;
        row_off += int64_t(tl[0]) * t.rows;
        if (threadIdx.x < kBN) {
            const int64_t p = int(threadIdx.x) < tl[2] ? a.pairs[tl[1] + threadIdx.x] : 0;
            src[threadIdx.x] = p / a.src_div;
            dst[threadIdx.x] = p;
        }
        if (threadIdx.x == 0) n_tok_shared = tl[2];
    } else {
        const int64_t t0 = int64_t(blockIdx.y) * kBN;
        if (threadIdx.x < kBN) src[threadIdx.x] = dst[threadIdx.x] = t0 + threadIdx.x;
        if (threadIdx.x == 0) n_tok_shared = int(min(int64_t(kBN), a.n - t0));
    }
    __syncthreads();
    const int n_tok = n_tok_shared;

    const int warp = threadIdx.x / 32;
    const int wr = (warp / 2) * 32, wc = (warp % 2) * 32;  // the warp's rows and tokens in the tile
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[GLU ? 2 : 1][2][2];
#pragma unroll
    for (int m = 0; m < (GLU ? 2 : 1); ++m)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[m][i][j], 0.0f);

    for (int64_t k0 = 0; k0 < k; k0 += kBK) {
        // BM rows × 8 groups of 8 weights (and the same of up), then 64 tokens × 8 groups of 8 activations.
        for (int g = threadIdx.x; g < BM * (kBK / 8); g += kThreads) {
            const int r = g / (kBK / 8), c8 = (g % (kBK / 8)) * 8;
            const bool valid = row0 + r < t.rows;
            const int64_t row = row_off + row0 + r;
            weights8_to_smem<T>(t.w, row, valid, k0 + c8, ws + r * kLd + c8);
            if constexpr (GLU) weights8_to_smem<T>(t.w_up, row, valid, k0 + c8, ws + (BM + r) * kLd + c8);
        }
        for (int g = threadIdx.x; g < kBN * (kBK / 8); g += kThreads) {
            const int i = g / (kBK / 8), c8 = (g % (kBK / 8)) * 8;
            const uint4 v =
                i < n_tok ? __ldg(reinterpret_cast<const uint4 *>(a.x_f16 + src[i] * a.x_stride + group * k + k0 + c8))
                          : make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4 *>(xs + i * kLd + c8) = v;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kBK; kk += 16) {
            // Weights are row-major [row][k]; the activation tile [token][k] is the column-major K × N operand.
            wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> xf[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(xf[j], xs + (wc + 16 * j) * kLd + kk, kLd);
#pragma unroll
            for (int m = 0; m < (GLU ? 2 : 1); ++m)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> wf;
                    wmma::load_matrix_sync(wf, ws + (m * BM + wr + 16 * i) * kLd + kk, kLd);
#pragma unroll
                    for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[m][i][j], wf, xf[j], acc[m][i][j]);
                }
        }
        __syncthreads();
    }

    // SwiGLU in the accumulators (gate and up fragments share their element layout), then the tile staged as
    // [token][row] so that consecutive threads store consecutive output rows of a token.
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if constexpr (GLU)
                for (int e = 0; e < acc[0][i][j].num_elements; ++e)
                    acc[0][i][j].x[e] = swiglu_one(acc[0][i][j].x[e], acc[1][i][j].x[e], a.limit);
            wmma::store_matrix_sync(out + (wc + 16 * j) * kLdOut + wr + 16 * i, acc[0][i][j], kLdOut,
                                    wmma::mem_col_major);
        }
    __syncthreads();
    const int64_t ycol = group * t.rows;
    for (int idx = threadIdx.x; idx < kBN * BM; idx += kThreads) {
        const int i = idx / BM, r = idx % BM;
        if (i >= n_tok || row0 + r >= t.rows) continue;
        const float v = out[i * kLdOut + r];
        const int64_t at = dst[i] * t.y_stride + ycol + row0 + r;
        t.y[at] = t.add ? t.add[at] + v : v;
    }
}

// Activations to f16, once per product: rows × width values (swiglu of x and x_up when x_up is given).
__global__ void activations_f16_kernel(const float * x, const float * x_up, float limit, int64_t n, half * dst) {
    pdl_begin();
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    const float4 x0 = *reinterpret_cast<const float4 *>(x + i), x1 = *reinterpret_cast<const float4 *>(x + i + 4);
    float v[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    if (x_up) {
        const float4 u0 = *reinterpret_cast<const float4 *>(x_up + i);
        const float4 u1 = *reinterpret_cast<const float4 *>(x_up + i + 4);
        const float u[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = swiglu_one(v[e], u[e], limit);
    }
    half2 h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
    *reinterpret_cast<uint4 *>(dst + i) = *reinterpret_cast<const uint4 *>(h);
}

template <GgmlType T>
void launch_gemm(const MatvecArgs & a, int bm, dim3 grid, cudaStream_t s) {
    auto go = [&](auto kernel, int threads) { launch(kernel, grid, dim3(threads), 0, s, a); };
    if (bm == 128)
        a.glu ? go(gemm_kernel<T, true, 128>, gemm_threads<128>())
              : go(gemm_kernel<T, false, 128>, gemm_threads<128>());
    else
        a.glu ? go(gemm_kernel<T, true, 64>, gemm_threads<64>()) : go(gemm_kernel<T, false, 64>, gemm_threads<64>());
}

// One launch over targets of one weight type. 128-row blocks read each activation tile half as often; 64-row
// blocks when 128 would leave the GPU with few blocks (small products).
void gemm_one_type(MatvecArgs a, int64_t max_tiles, cudaStream_t s) {
    int64_t rows = 0;
    for (int i = 0; i < a.n_targets; ++i) rows += a.t[i].rows;
    const int bm = rows / 128 * max_tiles * a.groups >= 4 * device_sms() ? 128 : 64;
    int first = 0;
    for (int i = 0; i < a.n_targets; ++i) {
        a.t[i].first_block = first;
        a.t[i].blocks = int((a.t[i].rows + bm - 1) / bm);
        first += a.t[i].blocks;
    }
    const dim3 grid(unsigned(first), unsigned(max_tiles), unsigned(a.groups));
    switch (a.t[0].w.type) {
        case GgmlType::F16:
            return launch_gemm<GgmlType::F16>(a, bm, grid, s);
        case GgmlType::BF16:
            return launch_gemm<GgmlType::BF16>(a, bm, grid, s);
        case GgmlType::Q8_0:
            return launch_gemm<GgmlType::Q8_0>(a, bm, grid, s);
        case GgmlType::MXFP4:
            return launch_gemm<GgmlType::MXFP4>(a, bm, grid, s);
        case GgmlType::Q2_K:
            return launch_gemm<GgmlType::Q2_K>(a, bm, grid, s);
        case GgmlType::Q4_K:
            return launch_gemm<GgmlType::Q4_K>(a, bm, grid, s);
        case GgmlType::IQ2_XXS:
            return launch_gemm<GgmlType::IQ2_XXS>(a, bm, grid, s);
        default:
            return;
    }
}

bool aligned16(const void * p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool gemm_supported(GgmlType w, int64_t k) {
    switch (w) {
        case GgmlType::F16:
        case GgmlType::BF16:
        case GgmlType::Q8_0:
        case GgmlType::MXFP4:
        case GgmlType::Q2_K:
        case GgmlType::Q4_K:
        case GgmlType::IQ2_XXS:
            return k % kBK == 0;
        default:  // F32 weights (the oracle fixtures) keep their exact f32 products
            return false;
    }
}

bool gemm_inputs_aligned(const MatvecArgs & a) {
    return aligned16(a.x) && (!a.x_up || aligned16(a.x_up)) && a.x_stride % 8 == 0;
}

void gemm_activations(const float * x, const float * x_up, float limit, int64_t rows, int64_t width, uint16_t * dst,
                      cudaStream_t s) {
    const int64_t n = rows * width, threads = 256;
    if (n > 0)
        launch(activations_f16_kernel, dim3(unsigned((n / 8 + threads - 1) / threads)), dim3(threads), 0, s, x, x_up,
               limit, n, reinterpret_cast<half *>(dst));
}

void gemm(const MatvecArgs & args, int64_t max_tiles, cudaStream_t s) {
    if (max_tiles <= 0 || args.n_targets <= 0) return;
    for_each_weight_type(args, [&](const MatvecArgs & sub) { gemm_one_type(sub, max_tiles, s); });
}

}  // namespace dsv4::cuda
