// Device helpers shared by the kernel files: number formats (bit-exact ports of format/quant's scalar rules),
// weight element access in the upload layout, warp and block reductions.
#pragma once

#include "backend/cuda/kernels.h"
#include "backend/cuda/launch_attrs.cuh"
#include "backend/cuda/mbarrier.cuh"
#include "format/q4k_scales.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <utility>

namespace dsv4::cuda {

constexpr unsigned kFull = 0xffffffffu;

// ---------------------------------------------------------------------------------------------------------------------
// Launches: programmatic dependent launch (sm_90 and later)
// ---------------------------------------------------------------------------------------------------------------------
// Every kernel is launched with programmatic stream serialization: its blocks may start while the previous kernel of
// the stream is still running (a decode step is ~30 short dependent kernels; this hides most of each launch's latency,
// and lets a product stream its weights into L2 meanwhile). The rule that keeps this correct: every kernel calls
// pdl_begin() in every block before it touches any memory another kernel writes or reads (only weights, which no kernel
// writes after their upload, may be read or prefetched before it: the upload's repack kernel writes the quantized ones,
// so the backend ends each such upload with a memset, which no kernel after it overtakes, as float weights arrive by
// copies; and the chunk's positions and token ids, which only the host writes, by copies that the stream orders before
// the chunk's first kernel: a position read after the wait is one more round trip in the chain when other loads depend
// on it). pdl_begin() first lets the next kernel launch, then waits until the previous kernel has completed and its
// writes are visible. Letting the next one launch before waiting (rather than after) means a chain of kernels can be
// resident at once as far as their blocks fit, each waiting for the one before: a product's blocks start prefetching
// their weights while two or three small kernels before it still run (session 18: -1.9 % a layer at 2K, -1.4 % at 32K).
// It also means that nothing another kernel writes may be read before the wait, however far back that kernel is, except
// through a handshake of its own (the Sinkhorn count, hc_sinkhorn) or as a hint whose staleness only wastes a prefetch
// (moe_down's expert ids). A kernel that waits on such a handshake does so in every block before pdl_begin(): a block
// that let the next kernel launch while another still waited could leave the chain after it resident, waiting on the
// waiter, and the awaited kernel unscheduled (session 19). DSV4_CUDA_PDL=0 launches plainly (the instructions are then
// no-ops).
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

bool pdl_enabled();
// DSV4_CUDA_SKIP=a,b: kernels whose demangled name contains a or b are not launched. The results are then wrong; it
// exists to measure what a kernel costs inside a decode step's graph (the step's time without it), which Nsight's
// serialized per-kernel times overstate for short kernels.
bool launch_skipped(const void * kernel);

// Attribute A of the current device, read once per device: launches size their grids and tiles by them. At least
// `floor`; `fallback` for a device number past the cache.
template <cudaDeviceAttr A>
int device_attribute(int fallback, int floor) {
    static int value[64] = {};
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 0 || dev >= 64) return fallback;
    if (value[dev] == 0) cudaDeviceGetAttribute(&value[dev], A, dev);
    return std::max(value[dev], floor);
}
// Multiprocessors of the current device.
inline int device_sms() { return device_attribute<cudaDevAttrMultiProcessorCount>(132, 1); }
// Dynamic shared memory a block may have on the current device (sm_90: 227 KB; sm_120 and sm_121: 99 KB). Every
// kernel shape that depends on it asks here, so DSV4_CUDA_SMEM_LIMIT=101376 (bytes; it only lowers the value, to
// no less than 48 KB, and a value that is not a number is ignored) makes an H200 take sm_120/121's tiles and
// shapes: the tests run them there (with DSV4_CUDA_WGMMA=0).
inline size_t device_smem_optin() {
    static const size_t limit = [] {
        const char * e = std::getenv("DSV4_CUDA_SMEM_LIMIT");
        char * end = nullptr;
        const unsigned long long v = e ? std::strtoull(e, &end, 10) : 0;
        return e && *e && *end == 0 ? std::max<size_t>(size_t(v), 48 * 1024) : SIZE_MAX;
    }();
    return std::min(limit, size_t(device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(48 * 1024, 48 * 1024)));
}

// Blocks grouped into clusters of cluster_x along x where cluster_x > 1.
template <typename... Params, typename... Args>
void launch_cluster(void (*kernel)(Params...), unsigned cluster_x, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                    Args &&... args) {
    if (launch_skipped(reinterpret_cast<const void *>(kernel))) return;
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    cudaLaunchAttribute attr[3] = {};
    unsigned n = 0;
    if (pdl_enabled()) attr[n++] = pdl_attr();
    if (cluster_x > 1) attr[n++] = cluster_dim_attr(cluster_x);
    // A launch on a stream of raised priority (the CUDA backend's branches) keeps it in a captured graph.
    int priority = 0;
    if (cudaStreamGetPriority(s, &priority) == cudaSuccess && priority != 0) {
        attr[n].id = cudaLaunchAttributePriority;
        attr[n++].val.priority = priority;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = n;
    cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args &&... args) {
    launch_cluster(kernel, 1, grid, block, smem, s, std::forward<Args>(args)...);
}

// Cluster barrier halves: arrive releases this thread's writes (shared memory of other blocks included), wait
// acquires those of every thread that arrived. Every thread of the cluster takes part, each warp converged.
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// A count between kernels that no graph edge orders (see hc_sinkhorn): release after the data, acquire before it.
__device__ __forceinline__ void count_release(unsigned * f) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(f) : "memory");
}
__device__ __forceinline__ unsigned count_acquire(const unsigned * f) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
    return v;
}

// Global -> shared without passing through registers (16 bytes by L2 only, 4 bytes through L1); zeros when src
// is null.
__device__ __forceinline__ void cp_async16(void * dst, const void * src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src ? src : dst),
                 "r"(src ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void * dst, const void * src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src));
}
// With the bytes to read given (16 or 4, or 0: zeros; src must be a valid address either way).
__device__ __forceinline__ void cp_async16(void * dst, const void * src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(void * dst, const void * src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}

// Four 8×8 matrices of 16-bit values from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void * p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
// mma.sync m16n8k16 operands of the 16 × 16 block at p of a row-major shared tile of 16-bit values, ld a row.
// A (rows are M): matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
template <typename T>
__device__ __forceinline__ void ldmatrix_a(uint32_t (&r)[4], const T * p, int ld, int lane) {
    ldmatrix_x4(r, p + (lane & 15) * ld + (lane >> 4) * 8);
}
// B stored [n][k] (column-major K × N), two 8-column tiles: matrices (n 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7),
// (8-15, 8-15), so r[0..1] is columns 0-7's operand and r[2..3] columns 8-15's.
template <typename T>
__device__ __forceinline__ void ldmatrix_b2(uint32_t (&r)[4], const T * p, int ld, int lane) {
    ldmatrix_x4(r, p + ((lane & 7) + ((lane >> 4) << 3)) * ld + ((lane >> 3) & 1) * 8);
}

// One 8-column tile of B stored [n][k]: matrices (n 0-7, k 0-7), (0-7, 8-15) from lanes 0-15's addresses.
template <typename T>
__device__ __forceinline__ void ldmatrix_b1(uint32_t (&r)[2], const T * p, int ld, int lane) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(p + (lane & 7) * ld + ((lane >> 3) & 1) * 8)));
}
// B stored [k][n] (row-major K × N), two 8-column tiles through the transposing load: matrices (k 0-7, n 0-7),
// (8-15, 0-7), (0-7, 8-15), (8-15, 8-15), so r[0..1] is columns 0-7's operand and r[2..3] columns 8-15's.
template <typename T>
__device__ __forceinline__ void ldmatrix_b2_trans(uint32_t (&r)[4], const T * p, int ld, int lane) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p + (lane & 15) * ld + (lane >> 4) * 8)));
}

// c += a (16×16, row-major) · b (16×8, column-major): f16 operands, or bf16 ones (BF16), f32 accumulators.
template <bool BF16 = false>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (BF16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Pulls [p, p + bytes) into L2 (a hint: it returns no data, so it is safe on memory being written).
__device__ __forceinline__ void prefetch_l2(const uint8_t * p, int64_t bytes) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(127);
    const uintptr_t end = reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes);
    for (uintptr_t a = first + uintptr_t(threadIdx.x) * 128; a < end; a += uintptr_t(blockDim.x) * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}

// ---------------------------------------------------------------------------------------------------------------------
// Scalars
// ---------------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
// Eight values rounded to f16 (to nearest) in one 16-byte store: the tensor cores' operand rows are written so.
__device__ __forceinline__ void store_f16x8(void * dst, float4 lo, float4 hi) {
    const half2 h[4] = {__floats2half2_rn(lo.x, lo.y), __floats2half2_rn(lo.z, lo.w), __floats2half2_rn(hi.x, hi.y),
                        __floats2half2_rn(hi.z, hi.w)};
    *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(h);
}
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }
// 2^(e-128): the scale of an MXFP4 block whose codes index the doubled E2M1 table.
__device__ __forceinline__ float e8m0_half(uint8_t e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23);
}
__device__ __forceinline__ float pow2i(int e) { return __uint_as_float(uint32_t(e + 127) << 23); }

// quant.cpp's round_clamp: nearest-even integer clamped to [lo, hi]; NaN gives 0.
__device__ __forceinline__ int round_clamp(float v, int lo, int hi) {
    if (v != v) return 0;
    if (v <= float(lo)) return lo;
    if (v >= float(hi)) return hi;
    return __float2int_rn(v);
}

// ceil(log2(x)) for x > 0 from the bits (quant.cpp's ceil_log2_exact); callers guarantee x > 0.
__device__ __forceinline__ int ceil_log2_exact(float x) {
    const uint32_t b = __float_as_uint(x);
    const int exp = int(b >> 23);
    const uint32_t man = b & 0x7fffff;
    if (exp == 0) return (32 - __clz(man - 1)) - 149;
    return exp - 127 + (man != 0 ? 1 : 0);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float swiglu_one(float g, float u, float limit) {
    if (limit > 0) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

// ---------------------------------------------------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}
__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}
// One butterfly step over the first N values: lanes with bit o set keep the upper half, the others the lower, each
// adding its partner's copy of the half it keeps. A template so that every index is a constant (registers).
template <int N, int S, class T>
__device__ __forceinline__ void butterfly_half(T (&v)[S], int lane, int o) {
    const bool upper = lane & o;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
        const T send = upper ? v[i] : v[i + N / 2];
        const T keep = upper ? v[i + N / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(kFull, send, o);
    }
}

// The warp totals of a lane's N values (N a power of two, at most 32) written to out[0, rows), rows <= N: a
// transposing butterfly leaves lane l with the total of value l >> (5 - log2 N), and the first lane holding each
// total stores it. Each value's additions pair the same lanes in the same order as warp_sum's, so the totals are
// warp_sum's bit for bit, for 2N - 2 shuffles instead of 5N (a sublayer boundary sums 24 floats and 10 doubles).
template <int N, class T>
__device__ __forceinline__ void warp_sums_to(T (&v)[N], int rows, T * out, int lane) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0);
    constexpr int shift = N >= 32 ? 0 : N >= 16 ? 1 : N >= 8 ? 2 : N >= 4 ? 3 : N >= 2 ? 4 : 5;
    if constexpr (N >= 2) butterfly_half<N>(v, lane, 16);
    if constexpr (N >= 4) butterfly_half<N / 2>(v, lane, 8);
    if constexpr (N >= 8) butterfly_half<N / 4>(v, lane, 4);
    if constexpr (N >= 16) butterfly_half<N / 8>(v, lane, 2);
    if constexpr (N >= 32) butterfly_half<N / 16>(v, lane, 1);
    T s = v[0];
#pragma unroll
    for (int o = (1 << shift) >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
    if ((lane & ((1 << shift) - 1)) == 0 && (lane >> shift) < rows) out[lane >> shift] = s;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result. `red` holds 32
// values; the block must reach this call together.
template <typename T>
__device__ T block_sum(T v, T * red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    T s = lane < n_warps ? red[lane] : T(0);
    return warp_sum(s);
}

// Exclusive scan of one value per thread over the block (blockDim.x = 1024); returns the block total. `red` holds
// 33 values.
__device__ inline int block_exclusive_scan(int v, int & excl, int * red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += t;
    }
    __syncthreads();
    if (lane == 31) red[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < int(blockDim.x >> 5) ? red[lane] : 0;
        int wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(kFull, wi, o);
            if (lane >= o) wi += t;
        }
        red[lane] = wi - w;  // exclusive prefix of warp totals
        if (lane == 31) red[32] = wi;
    }
    __syncthreads();
    excl = red[warp] + incl - v;
    return red[32];
}

// Calls run(sub) once per weight type among args' targets, sub holding that type's targets in their order.
template <class Run>
void for_each_weight_type(const MatvecArgs & args, Run && run) {
    for (int i = 0; i < args.n_targets; ++i) {
        bool seen = false;
        for (int j = 0; j < i; ++j) seen = seen || args.t[j].w.type == args.t[i].w.type;
        if (seen) continue;
        MatvecArgs sub = args;
        sub.n_targets = 0;
        for (int j = i; j < args.n_targets; ++j)
            if (args.t[j].w.type == args.t[i].w.type) sub.t[sub.n_targets++] = args.t[j];
        run(sub);
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Weight elements (get_rows, small control matrices of any type, tensor-core tiles)
// ---------------------------------------------------------------------------------------------------------------------
// Payload and scale bytes of block gb in the split layout.
__device__ __forceinline__ const uint8_t * split_payload(const WeightRef & w, int64_t gb, int payload_bytes) {
    return w.data + gb * payload_bytes;
}
__device__ __forceinline__ const uint8_t * split_scales(const WeightRef & w, int64_t gb, int payload_bytes,
                                                        int scale_bytes) {
    return w.data + w.n_blocks * payload_bytes + gb * scale_bytes;
}
__device__ __forceinline__ uint16_t ld_u16(const uint8_t * p) { return *reinterpret_cast<const uint16_t *>(p); }

// Eight consecutive elements (row, col .. col + 7) of a weight, col a multiple of 8: every block type holds them in
// 8 aligned payload bytes under one scale (float types: 16 bytes), so one load and one scale decode serve all
// eight. Loading and decoding are apart: Raw8 holds what the decode needs, load8 fetches it from the weight, and
// the tensor-core products build it from raw block bytes they copied into shared memory steps ahead (gemm.cu).
struct Raw8 {
    uint4 q;         // payload: 8 code bytes in q.x, q.y (IQ2_XXS: grid indices, sign word); float types: all 16
    uint32_t scale;  // the block's scale bits (Q2_K, Q4_K: d | dmin << 16)
    uint32_t aux;    // Q2_K: the sub-block scale byte; Q4_K: sub-block scale | min << 8
};

// IQ2_XXS's device sign word (kernels.h): the sign of value 8k + j of the group on bit 4j + k (j < 7), the scale on
// bits 28-31. iq2_signs puts the runs' eighth signs (their parities) where the scale was: folding the word's eight
// nibbles by XOR leaves on bit k the parity of run k's seven signs and scale bit k, which the XOR with the scale
// cancels. Then the signs of run k, shifted so that they sit on bit 2 of each nibble, make with the grid entry's
// level codes (Iq2Tables::sel) the selectors of one byte permute a four values (iq2_run).
__device__ __forceinline__ uint32_t iq2_scale(uint32_t word) { return word >> 28; }
__device__ __forceinline__ uint32_t iq2_signs(uint32_t word) {
    uint32_t y = word ^ (word >> 16);
    y ^= y >> 8;
    return (word & 0x0fffffffu) | ((y ^ (y >> 4) ^ (word >> 28)) << 28);
}
// The byte permute's register word for IQ2_XXS: levels 8, 25, 43 in bytes 0-2 (iq2_run).
constexpr uint32_t kIq2Levels = 0x002b1908u;

// The eight signed int8 values of run k (values 8k to 8k + 7 of the group, four a word): entry sel of
// Iq2Tables::sel with the run's signs on bit 2 of its nibbles selects, nibble e for value e, one byte of a byte
// permute over levels (kIq2Levels: 8, 25, 43 for selectors 0-2) and their negations (4-6). prmt itself, not
// __byte_perm, which masks each selector nibble to three bits first (an AND a permute). The SASS permute takes one
// word as an immediate and the other from a register: given the constant, ptxas under a 64-register bound moves it
// from a uniform register before every permute (an instruction a four values); given a word that each lane reads
// from its own shared-memory slot, it keeps it in a register.
__device__ __forceinline__ uint2 iq2_run(uint32_t sel, uint32_t signs, int k, uint32_t levels = kIq2Levels) {
    const uint32_t placed = k < 2 ? signs << (2 - k) : signs >> (k - 2);
    const uint32_t selector = sel | (placed & 0x44444444u);
    uint2 v;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v.x) : "r"(levels), "r"(0x00d5e7f8u), "r"(selector));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v.y) : "r"(levels), "r"(0x00d5e7f8u), "r"(selector >> 16));
    return v;
}

template <GgmlType T>
__device__ __forceinline__ Raw8 load8(const WeightRef & w, int64_t row, int64_t col) {
    Raw8 r{};
    if constexpr (T == GgmlType::F16 || T == GgmlType::BF16) {
        r.q = __ldg(reinterpret_cast<const uint4 *>(w.data + (row * w.ne0 + col) * 2));
    } else if constexpr (T == GgmlType::Q8_0) {
        const int64_t gb = row * (w.ne0 / 32) + col / 32;
        r.scale = ld_u16(split_scales(w, gb, 32, 2));
        const uint2 q = *reinterpret_cast<const uint2 *>(split_payload(w, gb, 32) + col % 32);
        r.q.x = q.x, r.q.y = q.y;
    } else if constexpr (T == GgmlType::MXFP4) {
        const int64_t gb = row * (w.ne0 / 32) + col / 32;
        const uint2 q = *reinterpret_cast<const uint2 *>(split_payload(w, gb, 16) + (col % 32 & 15));
        r.q.x = q.x, r.q.y = q.y;
        r.scale = *split_scales(w, gb, 16, 1);
    } else if constexpr (T == GgmlType::Q2_K) {
        // Element 128h + 32g + l sits in bits 2g of qs[32h + l]; its scale byte is element / 16.
        const int64_t gb = row * (w.ne0 / 256) + col / 256;
        const int i = int(col % 256), h = i / 128, l = i % 32;
        const uint8_t * p = split_payload(w, gb, 80);
        const uint8_t * sd = split_scales(w, gb, 80, 4);
        r.scale = *reinterpret_cast<const uint32_t *>(sd);
        r.aux = p[i / 16];
        const uint2 q = *reinterpret_cast<const uint2 *>(p + 16 + 32 * h + l);
        r.q.x = q.x, r.q.y = q.y;
    } else if constexpr (T == GgmlType::Q4_K) {
        const int64_t gb = row * (w.ne0 / 256) + col / 256;
        const int i = int(col % 256);
        const uint8_t * b = w.data + gb * 144;
        r.scale = *reinterpret_cast<const uint32_t *>(b);
        const uint8_t * sc = b + 4;
        const int j = i / 32;  // sub-block
        int s, m;
        q4k_scale_min(sc, j, s, m);
        r.aux = uint32_t(s) | uint32_t(m) << 8;
        const uint2 q = *reinterpret_cast<const uint2 *>(b + 16 + 32 * (j / 2) + i % 32);
        r.q.x = q.x, r.q.y = q.y;
    } else if constexpr (T == GgmlType::IQ2_XXS) {
        const int64_t gb = row * (w.ne0 / 256) + col / 256;
        const uint2 q = *reinterpret_cast<const uint2 *>(split_payload(w, gb, 64) + 8 * (col % 256 / 32));
        r.q.x = q.x, r.q.y = q.y;
        r.scale = ld_u16(split_scales(w, gb, 64, 2));
    }
    return r;
}

// The eight values of a Raw8 loaded at column col (quantized types; iq2_sel: Iq2Tables::sel, in any memory).
template <GgmlType T>
__device__ __forceinline__ void decode8(const Raw8 & r, int64_t col, const uint32_t * iq2_sel, float (&v)[8]) {
    const uint32_t q[2] = {r.q.x, r.q.y};
    if constexpr (T == GgmlType::Q8_0) {
        const float d = f16_bits_to_f32(uint16_t(r.scale));
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = float(int8_t(q[e / 4] >> (8 * (e % 4)))) * d;
    } else if constexpr (T == GgmlType::MXFP4) {
        const bool low = col % 32 < 16;
        const float scale = e8m0_half(uint8_t(r.scale));
        constexpr int8_t kTab[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const uint32_t byte = (q[e / 4] >> (8 * (e % 4))) & 255;
            v[e] = float(kTab[low ? (byte & 15) : (byte >> 4)]) * scale;
        }
    } else if constexpr (T == GgmlType::Q2_K) {
        const float d = f16_bits_to_f32(uint16_t(r.scale)), dmin = f16_bits_to_f32(uint16_t(r.scale >> 16));
        const int g = int(col % 128 / 32);
        const float mul = d * float(r.aux & 15), sub = dmin * float(r.aux >> 4);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = mul * float(int((q[e / 4] >> (8 * (e % 4) + 2 * g)) & 3)) - sub;
    } else if constexpr (T == GgmlType::Q4_K) {
        const float d = f16_bits_to_f32(uint16_t(r.scale)), dmin = f16_bits_to_f32(uint16_t(r.scale >> 16));
        const bool high = (col % 256 / 32) & 1;
        const float mul = d * float(r.aux & 255), sub = dmin * float(r.aux >> 8);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const uint32_t byte = (q[e / 4] >> (8 * (e % 4))) & 255;
            v[e] = mul * float(high ? byte >> 4 : byte & 15) - sub;
        }
    } else if constexpr (T == GgmlType::IQ2_XXS) {
        const int k = int(col % 32 / 8);
        const float db = f16_bits_to_f32(uint16_t(r.scale)) * (0.5f + float(iq2_scale(q[1]))) * 0.25f;
        const uint2 vals = iq2_run(iq2_sel[(q[0] >> (8 * k)) & 255], iq2_signs(q[1]), k);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = db * float(int8_t((e < 4 ? vals.x : vals.y) >> (8 * (e % 4))));
    }
}

template <GgmlType T>
__device__ __forceinline__ void decode8(const WeightRef & w, int64_t row, int64_t col, float (&v)[8]) {
    decode8<T>(load8<T>(w, row, col), col, w.iq2 ? w.iq2->sel : nullptr, v);
}

// Element (row, col) of a weight of any supported type (tables are in the upload layout).
__device__ __forceinline__ float weight_element(const WeightRef & w, int64_t row, int64_t col) {
    float v[8];
    switch (w.type) {
        case GgmlType::F32:
            return reinterpret_cast<const float *>(w.data)[row * w.ne0 + col];
        case GgmlType::F16:
            return f16_bits_to_f32(reinterpret_cast<const uint16_t *>(w.data)[row * w.ne0 + col]);
        case GgmlType::BF16:
            return bf16_bits_to_f32(reinterpret_cast<const uint16_t *>(w.data)[row * w.ne0 + col]);
        case GgmlType::Q8_0:
            decode8<GgmlType::Q8_0>(w, row, col & ~int64_t(7), v);
            break;
        case GgmlType::MXFP4:
            decode8<GgmlType::MXFP4>(w, row, col & ~int64_t(7), v);
            break;
        case GgmlType::Q2_K:
            decode8<GgmlType::Q2_K>(w, row, col & ~int64_t(7), v);
            break;
        case GgmlType::Q4_K:
            decode8<GgmlType::Q4_K>(w, row, col & ~int64_t(7), v);
            break;
        case GgmlType::IQ2_XXS:
            decode8<GgmlType::IQ2_XXS>(w, row, col & ~int64_t(7), v);
            break;
        default:
            return 0.0f;
    }
    return v[col & 7];
}

// ---------------------------------------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------------------------------------
// Turns the pair (v[0], v[1]) by pos·inv_freq (backwards when inverse). One expression for every kernel that
// rotates (rope, norm_rope, the compressors' finish, the attention's output), so their rotations agree bit for bit:
// its roundings are spelled out (a fused multiply-add of a rounded product), as nvcc would otherwise contract it
// differently depending on what surrounds it.
__device__ __forceinline__ void rope_pair(float * v, float pos, float inv_freq, bool inverse = false) {
    const float ang = pos * inv_freq;
    const float c = cosf(ang), s = inverse ? -sinf(ang) : sinf(ang);
    const float x0 = v[0], x1 = v[1];
    v[0] = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
    v[1] = __fmaf_rn(x0, s, __fmul_rn(x1, c));
}

// The trailing n_rot channels of a row in shared memory, by the block's threads; the caller synchronizes after.
// freq0 is inv_freq[threadIdx.x] (rope_freq0), which the caller reads before its PDL wait: the frequencies are
// weights, and a load after the row's norm is one more round trip in a decode step's chain.
__device__ __forceinline__ float rope_freq0(const float * inv_freq, int n_rot) {
    return int(threadIdx.x) < n_rot / 2 ? inv_freq[threadIdx.x] : 0.0f;
}
__device__ __forceinline__ void rope_row_shared(float * row, int64_t width, int n_rot, const float * inv_freq,
                                                float freq0, float pos) {
    for (int i = threadIdx.x; i < n_rot / 2; i += blockDim.x)
        rope_pair(row + (width - n_rot) + 2 * i, pos, i == int(threadIdx.x) ? freq0 : inv_freq[i]);
}

// ---------------------------------------------------------------------------------------------------------------------
// FP8 / FP4 round trips (quant.cpp's f32_to_e4m3, e4m3_to_f32, f32_to_e2m1, roundtrip, hadamard_inplace)
// ---------------------------------------------------------------------------------------------------------------------
__device__ inline float e4m3_decode(uint32_t bits) {
    const uint32_t sign = (bits & 0x80u) << 24;
    const uint32_t exp = (bits >> 3) & 15, man = bits & 7;
    if (exp == 15 && man == 7) return __uint_as_float(sign | 0x7fc00000u);
    if (exp == 0) return __uint_as_float(sign | __float_as_uint(float(man) * (1.0f / 512.0f)));
    return __uint_as_float(sign | (exp + 120) << 23 | man << 20);
}

__device__ inline uint32_t e4m3_encode(float x) {
    const uint32_t b = __float_as_uint(x);
    const uint32_t sign = (b >> 24) & 0x80u;
    const uint32_t a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;
    if (a >= 0x43e00000u) return sign | 0x7e;
    if (a < 0x3c800000u) return sign | uint32_t(__float2int_rn(__uint_as_float(a) * 512.0f));
    uint32_t code = ((a >> 23) - 120) << 3 | ((a >> 20) & 7);
    const uint32_t rem = a & 0xfffff;
    if (rem > 0x80000 || (rem == 0x80000 && (code & 1))) ++code;
    return sign | code;
}

__device__ inline float e2m1_decode(uint32_t code) {
    const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = kMag[code & 7];
    return code & 8 ? -v : v;
}

__device__ inline uint32_t e2m1_encode(float x) {
    const float a = fabsf(x);
    if (a != a) return 0;
    const uint32_t sign = signbit(x) ? 8 : 0;
    const float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    uint32_t code = 0;
#pragma unroll
    for (int k = 0; k < 7; ++k) code += (k & 1) ? (a >= kMid[k]) : (a > kMid[k]);
    return sign | code;
}

// One warp rounds one block of up to 64 values in place; `fp8` picks E4M3 (floor 1e-4) or E2M1 (floor 6·2^-126).
template <bool kFp8>
__device__ inline void roundtrip_block(float * x, int len) {
    const int lane = threadIdx.x & 31;
    float v[2];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int i = lane + 32 * j;
        v[j] = i < len ? x[i] : 0.0f;
        if (i < len) amax = fmaxf(amax, fabsf(v[j]));
    }
    amax = warp_max(amax);
    amax = fmaxf(amax, kFp8 ? 1e-4f : 6.0f * 1.17549435e-38f);
    const float inv_qmax = kFp8 ? 1.0f / 448.0f : 1.0f / 6.0f;
    const float s = pow2i(min(ceil_log2_exact(amax * inv_qmax), 127));
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int i = lane + 32 * j;
        if (i < len) x[i] = kFp8 ? s * e4m3_decode(e4m3_encode(v[j] / s)) : s * e2m1_decode(e2m1_encode(v[j] / s));
    }
}

// FP8 rounding of channels [0, n_dims) of a row by the block's warps: blocks of 64, a trailing partial block
// rounded as a block of its own.
__device__ inline void fp8_row_shared(float * row, int64_t n_dims) {
    const int64_t full = n_dims / 64, per_row = full + (n_dims > full * 64 ? 1 : 0);
    for (int64_t b = threadIdx.x / 32; b < per_row; b += blockDim.x / 32)
        roundtrip_block<true>(row + b * 64, b < full ? 64 : int(n_dims - full * 64));
    __syncthreads();
}

// Walsh-Hadamard (Sylvester order: butterflies at strides 1, 2, 4, ...), scaled by fp32(1/sqrt(width)), then
// E2M1 blocks of min(width, 32), on a row in shared memory, by the whole block (width a power of two).
__device__ inline void hadamard_fp4_shared(float * row, int64_t width) {
    for (int64_t h = 1; h < width; h *= 2) {
        for (int64_t p = threadIdx.x; p < width / 2; p += blockDim.x) {
            const int64_t i = (p / h) * 2 * h + p % h;
            const float a = row[i], b = row[i + h];
            row[i] = a + b;
            row[i + h] = a - b;
        }
        __syncthreads();
    }
    const float scale = float(1.0 / sqrt(double(width)));
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) row[i] *= scale;
    __syncthreads();
    const int block = int(std::min<int64_t>(width, 32));
    for (int64_t b = threadIdx.x / 32; b * block < width; b += blockDim.x / 32)
        roundtrip_block<false>(row + b * block, block);
    __syncthreads();
}

}  // namespace dsv4::cuda
