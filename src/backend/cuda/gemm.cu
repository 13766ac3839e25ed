// Tensor-core products for many tokens (prefill): the same MatvecArgs as matvec.cu (several targets, grouped
// projections, expert tiles, SwiGLU of gate and up, a SwiGLU activation, an addend), computed tile by tile with f16
// inputs and f32 accumulators: wgmma on sm_90a, mma.sync (m16n8k16) elsewhere and for small products. The
// activations are rounded to f16 once, by gemm_activations (with their SwiGLU when x_up is given).
//
// A block owns a tile of weight rows (256 or 128 with wgmma, 128 or 64 with mma.sync; with SwiGLU, half of them
// gate rows and the same rows of up) × 128 tokens (64 where an expert's tiles would be mostly empty), and walks K
// in steps of 64. Each step's inputs, the weight rows' raw block bytes (codes and scales, as stored) and the
// tokens' f16 activations, travel by cp.async into a ring of shared-memory slots kept up to three steps ahead, so
// that the memory latency (microseconds under load) hides behind the math of the steps in between. Each step
// decodes its raw bytes to an f16 weight tile (two, alternating, so one barrier per step suffices) and multiplies
// it with the activation tile on the tensor cores. Each weight byte is read once per 128 tokens instead of once per
// 8 with the integer dot products. Where the time goes: the copy, decode and barrier of each step (its latency,
// with 16 warps a multiprocessor), not memory bandwidth or the tensor cores.
//
// Numerics: f16 activations (11-bit significand) instead of matvec's 8-bit codes, so these products are closer
// to f32 activations than the decode path is; a weight decodes to the f16 nearest its exact value (for IQ2_XXS and
// Q2_K, to the f16 nearest the f32 product of its scales and code).
#include "backend/cuda/common.cuh"

#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace dsv4::cuda {
namespace {

constexpr int kBK = 64;       // columns per step
constexpr int kLd = kBK + 8;  // halves per shared row: 144 bytes, so the 8 rows of an ldmatrix hit distinct banks

// ---------------------------------------------------------------------------------------------------------------------
// Raw weight bytes of one step
// ---------------------------------------------------------------------------------------------------------------------
// What one weight row contributes to a 64-column step (k0 a multiple of 64), as copied into its shared-memory row
// of `stride` bytes: `pieces` aligned pieces, the first `pieces16` of 16 bytes, the rest of 4. The strides
// (multiples of 16 for the 16-byte copies) are not multiples of 128, so that eight rows read at the same column fall
// on different banks.
//   F16, BF16  128 B: the 64 values
//   Q8_0        68 B: two blocks' payload (64 B, contiguous in the split layout), their two scales (one 4-byte word)
//   MXFP4       36 B: two blocks' payload (32 B), the aligned scale word holding their two exponents
//   Q2_K        40 B: the 32 code bytes holding the 64 columns, their 4 sub-block scale bytes, d and dmin
//   Q4_K        48 B: d, dmin and the 12 scale bytes, the 32 code bytes of the two sub-blocks (low and high nibbles)
//   IQ2_XXS     20 B: two 32-column groups (16 B), the aligned scale word holding the super-block's d
struct RawLayout {
    int stride, pieces, pieces16;
};
template <GgmlType T>
constexpr RawLayout raw_layout() {
    return T == GgmlType::F16 || T == GgmlType::BF16 ? RawLayout{144, 8, 8}
           : T == GgmlType::Q8_0                     ? RawLayout{80, 5, 4}
           : T == GgmlType::MXFP4                    ? RawLayout{48, 3, 2}
           : T == GgmlType::Q2_K                     ? RawLayout{48, 4, 2}
           : T == GgmlType::Q4_K                     ? RawLayout{48, 3, 3}
                                                     : RawLayout{48, 2, 1};  // IQ2_XXS
}
// Columns per block of the type's layout (what a row's block index counts).
template <GgmlType T>
constexpr int block_cols() {
    return T == GgmlType::Q8_0 || T == GgmlType::MXFP4 ? 32 : T == GgmlType::F16 || T == GgmlType::BF16 ? 1 : 256;
}

// A piece's source is its source at k0 = 0 (raw_piece_at0, computed once a thread) plus raw_piece_step (32-bit,
// the same for every row but for `phase`, the low bits of the row's first block index, which MXFP4's and IQ2_XXS's
// shared scale words depend on): the copies of a step then cost an add, not a row's 64-bit index arithmetic.
struct RawPiece {
    const uint8_t * src;
    int dst;  // byte offset in the row's raw bytes
};
template <GgmlType T>
__device__ __forceinline__ RawPiece raw_piece_at0(const WeightRef & w, int64_t row, int piece) {
    const int64_t gb = row * (w.ne0 / block_cols<T>());  // the row's first block
    if constexpr (T == GgmlType::F16 || T == GgmlType::BF16) {
        return {w.data + row * w.ne0 * 2 + 16 * piece, 16 * piece};
    } else if constexpr (T == GgmlType::Q8_0) {
        return piece < 4 ? RawPiece{split_payload(w, gb, 32) + 16 * piece, 16 * piece}
                         : RawPiece{split_scales(w, gb, 32, 2), 64};
    } else if constexpr (T == GgmlType::MXFP4) {
        return piece < 2 ? RawPiece{split_payload(w, gb, 16) + 16 * piece, 16 * piece}
                         : RawPiece{split_scales(w, gb & ~int64_t(3), 16, 1), 32};
    } else if constexpr (T == GgmlType::Q2_K) {
        const uint8_t * p = split_payload(w, gb, 80);
        return piece < 2    ? RawPiece{p + 16 + 16 * piece, 16 * piece}
               : piece == 2 ? RawPiece{p, 32}
                            : RawPiece{split_scales(w, gb, 80, 4), 36};
    } else if constexpr (T == GgmlType::Q4_K) {
        const uint8_t * b = w.data + gb * 144;
        return piece == 0 ? RawPiece{b, 0} : RawPiece{b + 16 + 16 * (piece - 1), 16 * piece};
    } else {  // IQ2_XXS
        return piece == 0 ? RawPiece{split_payload(w, gb, 64), 0}
                          : RawPiece{split_scales(w, gb & ~int64_t(1), 64, 2), 16};
    }
}
// What step k0 adds to a piece's source at k0 = 0 (k0 a multiple of 64).
template <GgmlType T>
__device__ __forceinline__ int raw_piece_step(int piece, int k0, int phase) {
    if constexpr (T == GgmlType::F16 || T == GgmlType::BF16) {
        return 2 * k0;
    } else if constexpr (T == GgmlType::Q8_0) {
        return piece < 4 ? k0 : k0 / 16;
    } else if constexpr (T == GgmlType::MXFP4) {
        return piece < 2 ? k0 / 2 : (phase + k0 / 32) & ~3;
    } else if constexpr (T == GgmlType::Q2_K) {
        const int super = k0 / 256, i0 = k0 % 256;
        return piece < 2 ? 80 * super + 32 * (i0 / 128) : piece == 2 ? 80 * super + i0 / 16 : 4 * super;
    } else if constexpr (T == GgmlType::Q4_K) {
        return 144 * (k0 / 256) + (piece == 0 ? 0 : 32 * (k0 % 256 / 64));
    } else {  // IQ2_XXS
        return piece == 0 ? k0 / 4 : 2 * (((phase & 1) + k0 / 256) & ~1);
    }
}

// Eight weights at column c (a multiple of 8) of a step, from the row's raw bytes rb, as load8 would load them.
// blk: the row's first block index plus the step's blocks, of which MXFP4 and IQ2_XXS use the low bits.
template <GgmlType T>
__device__ __forceinline__ Raw8 raw8_from_tile(const uint8_t * rb, int k0, int c, int blk) {
    Raw8 r{};
    if constexpr (T == GgmlType::F16 || T == GgmlType::BF16) {
        r.q = *reinterpret_cast<const uint4 *>(rb + 2 * c);
    } else {
        const uint2 * q = nullptr;
        if constexpr (T == GgmlType::Q8_0) {
            q = reinterpret_cast<const uint2 *>(rb + c);
            r.scale = *reinterpret_cast<const uint16_t *>(rb + 64 + 2 * (c / 32));
        } else if constexpr (T == GgmlType::MXFP4) {
            q = reinterpret_cast<const uint2 *>(rb + 16 * (c / 32) + (c % 16));
            r.scale = rb[32 + (blk & 3) + c / 32];
        } else if constexpr (T == GgmlType::Q2_K) {
            q = reinterpret_cast<const uint2 *>(rb + (k0 + c) % 32);
            r.aux = rb[32 + c / 16];
            r.scale = *reinterpret_cast<const uint32_t *>(rb + 36);
        } else if constexpr (T == GgmlType::Q4_K) {
            r.scale = *reinterpret_cast<const uint32_t *>(rb);
            const uint8_t * sc = rb + 4;
            int s, m;
            q4k_scale_min(sc, (k0 + c) % 256 / 32, s, m);
            r.aux = uint32_t(s) | uint32_t(m) << 8;
            q = reinterpret_cast<const uint2 *>(rb + 16 + c % 32);
        } else {  // IQ2_XXS
            q = reinterpret_cast<const uint2 *>(rb + 8 * (c / 32));
            r.scale = *reinterpret_cast<const uint16_t *>(rb + 16 + 2 * (blk & 1));
        }
        r.q.x = q->x, r.q.y = q->y;
    }
    return r;
}

// IQ2_XXS's grid in shared memory as level codes (Iq2Tables::sel, 1 KB); its random lookups conflict. A grid of f16
// halves (4 KB) took fewer instructions but 2.7 times the bank conflicts of the 2 KB grid of magnitude bytes, and
// the tiles waited on them (Nsight Compute, one 8192-token gate/up: 446 M against 167 M, 10.9 ms against 9.3).
struct Iq2TileTables {
    uint32_t sel[256];
};
__device__ __forceinline__ void fill_iq2_tile_tables(Iq2TileTables & tab, const Iq2Tables & src, int threads) {
    for (int i = threadIdx.x; i < 256; i += threads) tab.sel[i] = src.sel[i];
}

// Eight weights as eight f16 values (col: their column in the matrix), each the f16 nearest its exact value. The
// low-bit types decode in f16 arithmetic and byte permutes, without a conversion a weight: the decodes' instructions
// bound their tiles (one 8192-token IQ2_XXS gate/up: 4.7 G instructions and 11.1 ms with a float conversion and
// product a weight, 3.9 G and 9.3 ms so).
template <GgmlType T>
__device__ __forceinline__ uint4 raw8_to_f16(const Raw8 & r, int col, const Iq2TileTables * iq2) {
    uint4 packed;
    uint32_t * h = reinterpret_cast<uint32_t *>(&packed);
    if constexpr (T == GgmlType::F16) {
        return r.q;
    } else if constexpr (T == GgmlType::Q8_0) {
        // In f16 arithmetic: a code with its sign bit flipped, as the low byte of 0x6400 (1024), is 1152 + q
        // exactly; the product with the f16 scale is rounded once, as the f32 product (exact) rounded to f16.
        const half2 d = __half2half2(__ushort_as_half(uint16_t(r.scale)));
        const half2 bias = __half2half2(__ushort_as_half(uint16_t(0x6480)));  // 1152
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t biased =
                __byte_perm((j < 2 ? r.q.x : r.q.y) ^ 0x80808080u, 0x64646464u, j % 2 ? 0x4342 : 0x4140);
            const half2 v = __hmul2(__hsub2(*reinterpret_cast<const half2 *>(&biased), bias), d);
            h[j] = *reinterpret_cast<const uint32_t *>(&v);
        }
    } else if constexpr (T == GgmlType::IQ2_XXS) {
        // A signed value p (|p| ≤ 43, from the byte permute) times c = (2s + 1) / 8 (the sub-block scale
        // 0.25 (0.5 + s)) is at most 1333 / 8, exact in f16's 11 bits; as with Q8_0, p with its sign bit flipped is
        // the low byte of 1152 + p, and the fused (1152 + p) · c - 1152 · c gives p · c exactly. The product with
        // the f16 d then rounds once: the f16 nearest d · p · (0.5 + s) / 4.
        const int k = int(col % 32 / 8);
        const uint2 run = iq2_run(iq2->sel[(r.q.x >> (8 * k)) & 255], iq2_signs(r.q.y), k);
        const uint32_t vals[2] = {run.x ^ 0x80808080u, run.y ^ 0x80808080u};
        const float c = float(2 * iq2_scale(r.q.y) + 1) * 0.125f;
        const half2 c2 = __float2half2_rn(c), bias2 = __float2half2_rn(-1152.0f * c);
        const half2 d = __half2half2(__ushort_as_half(uint16_t(r.scale)));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t biased = __byte_perm(vals[j / 2], 0x64646464u, j % 2 ? 0x4342 : 0x4140);
            const half2 v = __hmul2(__hfma2(*reinterpret_cast<const half2 *>(&biased), c2, bias2), d);
            h[j] = *reinterpret_cast<const uint32_t *>(&v);
        }
    } else if constexpr (T == GgmlType::Q2_K) {
        // A 2-bit code takes one of four values under its sub-block's scale and min, each computed in f32 as
        // decode8 does (mul · q is exact, so one rounding) and rounded to f16; a byte permute picks each weight's
        // two bytes (selector nibbles 2q and 2q + 1: two codes at once, from their bytes times 0x22).
        const float d = f16_bits_to_f32(uint16_t(r.scale)), dmin = f16_bits_to_f32(uint16_t(r.scale >> 16));
        const float mul = d * float(r.aux & 15), sub = dmin * float(r.aux >> 4);
        const half2 v01 = __floats2half2_rn(-sub, mul - sub),
                    v23 = __floats2half2_rn(2.0f * mul - sub, 3.0f * mul - sub);
        const uint32_t lo = *reinterpret_cast<const uint32_t *>(&v01), hi = *reinterpret_cast<const uint32_t *>(&v23);
        const int g = int(col % 128 / 32);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const uint32_t codes = ((j == 0 ? r.q.x : r.q.y) >> (2 * g)) & 0x03030303u;
            h[2 * j] = __byte_perm(lo, hi, (codes & 0x0303u) * 0x22u + 0x1010u);
            h[2 * j + 1] = __byte_perm(lo, hi, (codes >> 16) * 0x22u + 0x1010u);
        }
    } else {
        float v[8];
        if constexpr (T == GgmlType::BF16) {
            const uint32_t word[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                v[2 * j] = bf16_bits_to_f32(uint16_t(word[j]));
                v[2 * j + 1] = bf16_bits_to_f32(uint16_t(word[j] >> 16));
            }
        } else {
            decode8<T>(r, col, nullptr, v);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const half2 pair = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
            h[j] = *reinterpret_cast<const uint32_t *>(&pair);
        }
    }
    return packed;
}

// ---------------------------------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------------------------------
// A block's tile: ROWS weight rows × BN tokens (128, or 64 where tiles would be mostly empty: experts with few
// tokens). With SwiGLU the rows are BM = ROWS / 2 gate rows then the same BM rows of up (SwiGLU applied when the
// tile is stored). Two ways to multiply a step's tiles (WG selects):
//   mma.sync (every architecture), ROWS 128 or 64: warps of 32 rows × 32 tokens, ROWS / 32 × BN / 32 of them
//     (16 for 128 × 128), operands loaded into registers by ldmatrix from rows padded to kLd halves;
//   wgmma (sm_90a), ROWS 256 or 128: four warpgroups (512 threads), warpgroup g on row block g % (ROWS / 64) (64
//     rows) and all BN tokens, over its share of each step's four 16-column slices (all four for 256 rows; two
//     for 128, the two shares summed when the tile is stored). Both operands are read from shared memory
//     asynchronously, so the decode of the next step runs while the tensor cores work, and without ldmatrix
//     copies. 256 rows halve the activation bytes per multiply-add of 128-row tiles: what the copies into shared
//     memory move per step (weights 20 B a row for IQ2_XXS, 68 for Q8_0; activations 128 B a token) bounds these
//     tiles once the multiply-adds are asynchronous.
template <bool GLU, int ROWS>
constexpr int gemm_bm() {
    return GLU ? ROWS / 2 : ROWS;
}
template <int ROWS, int BN, bool WG>
constexpr int gemm_threads() {
    return WG ? 512 : ROWS / 32 * (BN / 32) * 32;
}
// Halves per weight or activation row of a decoded tile: padded for ldmatrix, packed for wgmma.
template <bool WG>
constexpr int tile_ld() {
    return WG ? kBK : kLd;
}
// Where the 8 halves at row r, columns c .. c + 7 (c a multiple of 8) of a decoded tile go, in halves. wgmma reads
// its operands in the no-swizzle canonical layout: 8 × 8 "core matrices" of 128 contiguous bytes (8 rows of 16),
// core (r / 8, c / 8) at ((r / 8) · 8 + c / 8) · 128 bytes.
template <bool WG>
__device__ __forceinline__ int tile_at(int r, int c) {
    return WG ? ((r / 8) * (kBK / 8) + c / 8) * 64 + (r % 8) * 8 : r * kLd + c;
}

// Dynamic shared memory, bytes: during the K loop the ring (per slot: raw weight rows, activations [BN][64] f16)
// and two decoded weight tiles [ROWS][64] (f16); after it, the output tile [BN][ROWS + 4] (f32). The ring has 4
// slots (loads run three steps ahead) when 16 warps per multiprocessor still fit in sm_90's 227 KB, else 3;
// STAGES, when given, overrides that (3 for the 64 × 128 tiles on sm_120/121, whose blocks have 99 KB).
template <GgmlType T, int ROWS, int BN, bool WG, int STAGES = 0>
struct GemmSmem {
    static constexpr int raw = ROWS * raw_layout<T>().stride;
    static constexpr int slot = raw + BN * tile_ld<WG>() * 2;
    static constexpr int tile = ROWS * tile_ld<WG>() * 2;
    static constexpr int out = BN * (ROWS + 4) * 4;
    static constexpr int bytes_for(int stages) {
        return stages * slot + 2 * tile > out ? stages * slot + 2 * tile : out;
    }
    static constexpr int rule_stages = bytes_for(4) * (512 / gemm_threads<ROWS, BN, WG>()) <= 220 * 1024 ? 4 : 3;
    static constexpr int stages = STAGES ? STAGES : rule_stages;
    static constexpr size_t bytes = size_t(bytes_for(stages));
};

// wgmma (sm_90a only; elsewhere these trap, and gemm() never picks the path there).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSV4_WGMMA 1
#endif
// Shared-memory matrix descriptor of a K-major operand in tile_at<true>'s layout: start address, the distance
// between core matrices along K (128 bytes) and between 8-row groups (kBK / 8 · 128 bytes), no swizzle.
__device__ __forceinline__ uint64_t wgmma_desc(const half * p) {
    return uint64_t((smem_addr(p) & 0x3FFFF) >> 4) | uint64_t(128 >> 4) << 16 | uint64_t(kBK / 8 * 128 >> 4) << 32;
}
// Makes this thread's shared-memory writes (stores and arrived cp.async bytes) visible to wgmma's operand reads.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef DSV4_WGMMA
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#ifdef DSV4_WGMMA
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef DSV4_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int pending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef DSV4_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(pending) : "memory");
#endif
}
#define DSV4_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define DSV4_ACC16(i) DSV4_ACC4(i), DSV4_ACC4(i + 4), DSV4_ACC4(i + 8), DSV4_ACC4(i + 12)
// d (64 rows × N tokens, f32, the mma accumulator layout per warp) += a (64 × 16) · b (N × 16)ᵀ, both f16 and
// K-major in shared memory. Issued asynchronously: d must not be touched before wgmma_wait.
template <int N>
__device__ __forceinline__ void wgmma_f16(float (&d)[N / 2], uint64_t a, uint64_t b) {
#ifdef DSV4_WGMMA
    if constexpr (N == 128) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
            "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "
            "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
            "%62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
            : DSV4_ACC16(0), DSV4_ACC16(16), DSV4_ACC16(32), DSV4_ACC16(48)
            : "l"(a), "l"(b), "r"(1));
    } else {
        static_assert(N == 64);
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
            "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
            : DSV4_ACC16(0), DSV4_ACC16(16)
            : "l"(a), "l"(b), "r"(1));
    }
#else
    __trap();
#endif
}
#undef DSV4_ACC16
#undef DSV4_ACC4

// Registers: at most 128 per thread (512 / threads blocks per multiprocessor), so that 16 warps fit.
template <GgmlType T, bool GLU, int ROWS, int BN, bool WG, int STAGES = 0>
__global__ void __launch_bounds__(gemm_threads<ROWS, BN, WG>(), 512 / gemm_threads<ROWS, BN, WG>())
    gemm_kernel(const MatvecArgs a) {
    using Smem = GemmSmem<T, ROWS, BN, WG, STAGES>;
    constexpr int BM = gemm_bm<GLU, ROWS>(), kThreads = gemm_threads<ROWS, BN, WG>(), kLdOut = ROWS + 4;
    constexpr int kStride = raw_layout<T>().stride, kPieces = raw_layout<T>().pieces, kStages = Smem::stages;
    constexpr int kTile = ROWS * tile_ld<WG>();                              // halves per decoded tile
    constexpr int kGroups = ROWS * (kBK / 8) / kThreads;                     // weight groups of 8 a thread decodes
    constexpr int kPieceTasks = (ROWS * kPieces + kThreads - 1) / kThreads;  // raw pieces a thread copies
    constexpr int kTokenTasks = BN * (kBK / 8) / kThreads;                   // 16-byte activation pieces
    extern __shared__ __align__(128) uint8_t smem[];  // ring [kStages][Smem::slot], tiles [2][kTile]
    __shared__ int64_t src[BN], dst[BN];
    __shared__ int n_tok_shared;
    __shared__ std::conditional_t<T == GgmlType::IQ2_XXS, Iq2TileTables, char> iq2;
    half * const tiles = reinterpret_cast<half *>(smem + kStages * Smem::slot);
    float * const out = reinterpret_cast<float *>(smem);  // [BN][kLdOut] after the K loop

    MatvecTarget t = a.t[0];
#pragma unroll
    for (int i = 1; i < kMaxTargets; ++i)
        if (i < a.n_targets && int(blockIdx.x) >= a.t[i].first_block) t = a.t[i];
    const int64_t row0 = int64_t(int(blockIdx.x) - t.first_block) * BM;
    const int64_t k = t.w.ne0, group = blockIdx.z;
    const Iq2TileTables * iq2_tables = nullptr;
    if constexpr (T == GgmlType::IQ2_XXS) {
        fill_iq2_tile_tables(iq2, *t.w.iq2, kThreads);
        iq2_tables = &iq2;
    }
    pdl_begin();

    // The block's tokens: a plain range, or one expert's pairs.
    int64_t row_off = group * t.rows;
    if (a.tiles) {
        if (int(blockIdx.y) >= *a.n_tiles) return;
        const int32_t * tl = a.tiles + 3 * blockIdx.y;
        row_off += int64_t(tl[0]) * t.rows;
        if (threadIdx.x < BN) {
            const int64_t p = int(threadIdx.x) < tl[2] ? a.pairs[tl[1] + threadIdx.x] : 0;
            src[threadIdx.x] = p / a.src_div;
            dst[threadIdx.x] = p;
        }
        if (threadIdx.x == 0) n_tok_shared = tl[2];
    } else {
        const int64_t t0 = int64_t(blockIdx.y) * BN;
        if (threadIdx.x < BN) src[threadIdx.x] = dst[threadIdx.x] = t0 + threadIdx.x;
        if (threadIdx.x == 0) n_tok_shared = int(min(int64_t(BN), a.n - t0));
    }
    __syncthreads();
    const int n_tok = n_tok_shared;
    const int steps = int(k / kBK);

    // 16-byte piece g of a step's activations: token g / 8, columns (g % 8) · 8 for mma.sync; for wgmma eight
    // consecutive pieces are one column group of eight tokens (one core matrix: its stores hit distinct banks).
    auto token_piece = [](int g, int & i, int & c) {
        i = WG ? (g / 64) * 8 + g % 8 : g / (kBK / 8);
        c = WG ? (g / 8) % 8 * 8 : g % (kBK / 8) * 8;
    };
    // This thread's copies, fixed over the steps but for what raw_piece_step adds: raw pieces (source at k0 = 0,
    // destination in a slot, size) and activation pieces (source at k0 = 0, destination, size). Every row's 16-byte
    // pieces come before the 4-byte ones, so that a warp's copies have one size. A row past the weight's end and a
    // token past the tile's end copy no bytes (cp.async fills their destinations with zeros, which decode to zero
    // weights): the copies and the decodes take no branch a row.
    constexpr int kPieces16 = raw_layout<T>().pieces16, kPieces4 = kPieces - kPieces16;
    const uint8_t * piece_src[kPieceTasks];
    int piece_dst[kPieceTasks], piece_bits[kPieceTasks];  // piece | phase << 4 | bytes << 8 | 1 << 13 (0: none)
#pragma unroll
    for (int j = 0; j < kPieceTasks; ++j) {
        const int task = int(threadIdx.x) + j * kThreads, small = task - ROWS * kPieces16;
        int r = task / kPieces16, piece = task % kPieces16;
        if constexpr (kPieces4 > 0) {
            if (small >= 0) {
                r = small / kPieces4;
                piece = kPieces16 + small % kPieces4;
            }
        }
        piece_src[j] = nullptr, piece_dst[j] = 0, piece_bits[j] = 0;
        if (task < ROWS * kPieces) {
            // Tile row r's weight: gate and up differ only in their data.
            WeightRef w = t.w;
            if (GLU && r >= BM) w.data = t.w_up.data;
            const bool in_rows = row0 + r % BM < t.rows;
            const int64_t row = row_off + row0 + (in_rows ? r % BM : 0);
            const RawPiece p = raw_piece_at0<T>(w, row, piece);
            const int phase = int(row * (w.ne0 / block_cols<T>()) & 3);
            piece_src[j] = p.src;
            piece_dst[j] = r * kStride + p.dst;
            piece_bits[j] = piece | phase << 4 | (in_rows ? (piece < kPieces16 ? 16 : 4) : 0) << 8 | 1 << 13;
        }
    }
    const uint16_t * token_src[kTokenTasks];
    int token_dst[kTokenTasks], token_bytes[kTokenTasks];
#pragma unroll
    for (int j = 0; j < kTokenTasks; ++j) {
        int i, c;
        token_piece(int(threadIdx.x) + j * kThreads, i, c);
        token_src[j] = a.x_f16 + (i < n_tok ? src[i] * a.x_stride + group * k + c : 0);
        token_dst[j] = tile_at<WG>(i, c);
        token_bytes[j] = i < n_tok ? 16 : 0;
    }
    // One commit group per step: the raw bytes of the tile's rows and the tokens' activations into ring slot
    // step % kStages. Steps past the end commit an empty group, so that the wait counts stay uniform.
    auto load_step = [&](int step) {
        if (step < steps) {
            uint8_t * slot = smem + (step % kStages) * Smem::slot;
            const int k0 = step * kBK;
#pragma unroll
            for (int j = 0; j < kPieceTasks; ++j) {
                const int bits = piece_bits[j];
                if (bits == 0) continue;  // past the last piece: whole warps
                const uint8_t * from = piece_src[j] + raw_piece_step<T>(bits & 15, k0, bits >> 4 & 15);
                if ((bits & 15) < kPieces16)
                    cp_async16(slot + piece_dst[j], from, bits >> 8 & 31);
                else
                    cp_async4(slot + piece_dst[j], from, bits >> 8 & 31);
            }
            half * xs = reinterpret_cast<half *>(slot + Smem::raw);
#pragma unroll
            for (int j = 0; j < kTokenTasks; ++j) cp_async16(xs + token_dst[j], token_src[j] + k0, token_bytes[j]);
        }
        cp_async_commit();
    };
    // The raw bytes of a step (arrived, and visible to the block) decoded to f16 into tile step % 2. This
    // thread's groups: mma.sync, tile rows threadIdx.x / 8 + i · (kThreads / 8), columns c8 .. c8 + 7 (a warp
    // reads rows whole); wgmma, rows threadIdx.x % 8 + 8 · (threadIdx.x / 64 + 8i) (a warp's stores fill core
    // matrices whole).
    const int c8 = WG ? (threadIdx.x / 8) % 8 * 8 : (threadIdx.x % 8) * 8;
    auto row_of = [&](int i) {
        return WG ? int(threadIdx.x) % 8 + 8 * (int(threadIdx.x) / 64 + 8 * i)
                  : int(threadIdx.x) / 8 + i * (kThreads / 8);
    };
    int group_phase[kGroups];  // the low bits of each group's row's first block index (MXFP4, IQ2_XXS)
#pragma unroll
    for (int i = 0; i < kGroups; ++i)
        group_phase[i] = int((row_off + row0 + row_of(i) % BM) * (t.w.ne0 / block_cols<T>()) & 3);
    auto decode_step = [&](int step) {
        const uint8_t * slot = smem + (step % kStages) * Smem::slot;
        half * ws = tiles + (step % 2) * kTile;
        const int k0 = step * kBK;
        // Two groups decoded before either is stored: the compiler cannot tell the tile's stores from the ring's
        // loads, so a store between them would serialize the groups' load latencies (and four at once spill).
        constexpr int kBatch = kGroups < 2 ? kGroups : 2;
#pragma unroll
        for (int i0 = 0; i0 < kGroups; i0 += kBatch) {
            uint4 h[kBatch];
#pragma unroll
            for (int i = 0; i < kBatch; ++i)
                h[i] = raw8_to_f16<T>(raw8_from_tile<T>(slot + row_of(i0 + i) * kStride, k0, c8,
                                                        group_phase[i0 + i] + k0 / block_cols<T>()),
                                      k0 + c8, iq2_tables);
#pragma unroll
            for (int i = 0; i < kBatch; ++i) *reinterpret_cast<uint4 *>(ws + tile_at<WG>(row_of(i0 + i), c8)) = h[i];
        }
    };

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // wgmma: warpgroup g takes rows 64 · rb .. + 63 and this step's 16-column slices ks · kSub .. + kSub - 1.
    static_assert(!WG || ROWS == 128 || ROWS == 256, "wgmma tiles: 64 rows per warpgroup, at most two K shares");
    constexpr int kRowBlocks = ROWS / 64, kSplit = WG ? 4 / kRowBlocks : 1, kSub = 4 / kSplit;
    const int rb = (warp / 4) % kRowBlocks, ks = (warp / 4) / kRowBlocks;
    // mma.sync: the warp's 32 rows and 32 tokens.
    const int wr = (warp / (BN / 32)) * 32, wc = (warp % (BN / 32)) * 32;
    const bool warp_has_tokens = wc < n_tok;  // a partial tile's empty token columns skip the multiply-adds
    // wgmma accumulators: rows 64 rb + 16 (warp % 4) + lane / 4 (+ 8), tokens 8j + 2 (lane % 4) (+ 1).
    float acc_wg[WG ? BN / 2 : 1] = {};
    // mma.sync accumulators [i][j]: rows wr + 16i .. +15, tokens wc + 8j .. +7, in mma.sync's accumulator layout.
    float acc[WG ? 1 : 2][4][4] = {};

    for (int s = 0; s < kStages - 1; ++s) load_step(s);
    cp_async_wait<kStages - 2>();
    __syncthreads();
    decode_step(0);
    for (int s = 0; s < steps; ++s) {
        // Step s + 1 has arrived for every thread, tile s % 2 is decoded and visible (wgmma: to the async proxy
        // too), and step s - 1 is finished everywhere (wgmma: each warpgroup waited for its own products), so its
        // ring slot and tile may be overwritten.
        cp_async_wait<kStages - 3>();
        if constexpr (WG) {
            wgmma_wait<0>();
            fence_proxy_async();
        }
        __syncthreads();
        load_step(s + kStages - 1);
        const half * ws = tiles + (s % 2) * kTile;
        const half * xs = reinterpret_cast<const half *>(smem + (s % kStages) * Smem::slot + Smem::raw);
        if constexpr (WG) {
            wgmma_fence();
#pragma unroll
            for (int sub = 0; sub < kSub; ++sub) {
                // A 16-column slice: two core matrices along K. (ks, 0 for 256 rows, is left out of the index
                // there: otherwise ptxas serializes the wgmma, C7515.)
                const int kk = ((kSplit == 1 ? 0 : ks * kSub) + sub) * 16;
                wgmma_f16<BN>(acc_wg, wgmma_desc(ws + rb * 64 * kBK + kk * 8), wgmma_desc(xs + kk * 8));
            }
            wgmma_commit();
        } else if (warp_has_tokens) {
#pragma unroll
            for (int kk = 0; kk < kBK; kk += 16) {
                // Activations [token][k] are the column-major K × N operand, weights the row-major A.
                uint32_t b[2][4];
#pragma unroll
                for (int j = 0; j < 2; ++j) ldmatrix_b2(b[j], xs + (wc + 16 * j) * kLd + kk, kLd, lane);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    uint32_t af[4];
                    ldmatrix_a(af, ws + (wr + 16 * i) * kLd + kk, kLd, lane);
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        mma_16816(acc[i][j], af, b[j / 2][2 * (j % 2)], b[j / 2][2 * (j % 2) + 1]);
                }
            }
        }
        if (s + 1 < steps) decode_step(s + 1);
    }
    if constexpr (WG) wgmma_wait<0>();
    cp_async_wait<0>();
    __syncthreads();

    // The tile staged as [token][row] so that consecutive threads store consecutive output rows of a token; wgmma's
    // K shares summed in a fixed order (the same result every run).
    if constexpr (WG) {
        for (int round = 0; round < kSplit; ++round) {
            if (ks == round)
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float & o = out[(8 * j + 2 * (lane % 4) + (e & 1)) * kLdOut + 64 * rb + 16 * (warp % 4) +
                                        lane / 4 + (e >= 2 ? 8 : 0)];
                        o = round == 0 ? acc_wg[4 * j + e] : o + acc_wg[4 * j + e];
                    }
            __syncthreads();
        }
    } else {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    out[(wc + 8 * j + 2 * (lane % 4) + (e & 1)) * kLdOut + wr + 16 * i + lane / 4 + (e >= 2 ? 8 : 0)] =
                        acc[i][j][e];
        __syncthreads();
    }
    const int64_t ycol = group * t.rows;
    for (int idx = threadIdx.x; idx < BN * BM; idx += kThreads) {
        const int i = idx / BM, r = idx % BM;
        if (i >= n_tok || row0 + r >= t.rows) continue;
        float v = out[i * kLdOut + r];
        if constexpr (GLU) v = swiglu_one(v, out[i * kLdOut + BM + r], a.limit);
        const int64_t at = dst[i] * t.y_stride + ycol + row0 + r;
        t.y[at] = t.add ? t.add[at] + v : v;
    }
}

// Activations to f16, once per product: rows × width values, x_stride floats apart (swiglu of x and x_up when x_up
// is given), written densely.
__global__ void activations_f16_kernel(const float * x, const float * x_up, float limit, int64_t n, int64_t width,
                                       int64_t x_stride, half * dst) {
    pdl_begin();
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    // Dense rows (every product's input but the routed experts' strided gate | up) skip the 64-bit division.
    const int64_t at = x_stride == width ? i : i / width * x_stride + i % width;
    const float4 x0 = *reinterpret_cast<const float4 *>(x + at), x1 = *reinterpret_cast<const float4 *>(x + at + 4);
    float v[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    if (x_up) {
        const float4 u0 = *reinterpret_cast<const float4 *>(x_up + at);
        const float4 u1 = *reinterpret_cast<const float4 *>(x_up + at + 4);
        const float u[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = swiglu_one(v[e], u[e], limit);
    }
    store_f16x8(dst + i, make_float4(v[0], v[1], v[2], v[3]), make_float4(v[4], v[5], v[6], v[7]));
}

// Rows of a weight as f16, row-major, each value the one the tiles multiply (load8 + raw8_to_f16): a dense product
// on these and the f16 activations sums the same terms as the tiles, in another order. Output row r of block b =
// r / span (span = rows, or 2·rows when w2 is given) is row first + b·rows + r % span of w, or of w2 for the second
// half of a span (an expert's gate and up as one [2·rows][K] matrix). A block's threads share an output row (the
// row arithmetic, 32-bit, once a row: 64-bit divisions a group of 8 took several times the decode's instructions),
// and a grid of a few blocks a multiprocessor fills IQ2_XXS's tables once a block.
template <GgmlType T>
__global__ void weights_f16_kernel(const WeightRef w, const WeightRef w2, int64_t first, int rows, int out_rows,
                                   half * dst) {
    __shared__ std::conditional_t<T == GgmlType::IQ2_XXS, Iq2TileTables, char> iq2;
    const Iq2TileTables * iq2_tables = nullptr;
    if constexpr (T == GgmlType::IQ2_XXS) {
        fill_iq2_tile_tables(iq2, *w.iq2, blockDim.x);
        __syncthreads();
        iq2_tables = &iq2;
    }
    pdl_begin();
    const int span = w2.data ? 2 * rows : rows;
    for (int r = blockIdx.x; r < out_rows; r += gridDim.x) {
        const int block = r / span, in_span = r - block * span;
        const bool second = in_span >= rows;
        const WeightRef src = second ? w2 : w;
        const int64_t row = first + int64_t(block) * rows + (second ? in_span - rows : in_span);
        half * out = dst + int64_t(r) * w.ne0;
        for (int64_t col = threadIdx.x * 8; col < w.ne0; col += blockDim.x * 8)
            *reinterpret_cast<uint4 *>(out + col) = raw8_to_f16<T>(load8<T>(src, row, col), int(col), iq2_tables);
    }
}

// Static shared memory of a block, at most: src and dst (128 tokens), the IQ2_XXS tables, and 256 bytes for the
// token count and what ptxas adds (ptxas -v: 2176 bytes at 128 tokens, 4352 with the IQ2_XXS tables).
template <GgmlType T>
constexpr size_t static_smem() {
    return 2 * 128 * sizeof(int64_t) + 256 + (T == GgmlType::IQ2_XXS ? sizeof(Iq2TileTables) : 0);
}

// Whether a block of type T's tiles with this much dynamic shared memory fits the device.
template <GgmlType T>
bool block_fits(size_t dynamic_smem) {
    return dynamic_smem + static_smem<T>() <= device_smem_optin();
}
// Whether a 64-row × 128-token mma.sync tile takes a ring of 3 steps, not 4: where 4 do not fit a block's shared
// memory (sm_120 and sm_121, 99 KB: 87 KB for Q8_0 with 3, 110 with 4).
template <GgmlType T>
bool narrow_ring() {
    return !block_fits<T>(GemmSmem<T, 64, 128, false>::bytes);
}
// The dynamic shared memory a launch of these tiles takes on this device, and whether they fit it.
template <GgmlType T, int ROWS, int BN, bool WG>
size_t gemm_smem() {
    if constexpr (ROWS == 64 && BN == 128 && !WG)
        if (narrow_ring<T>()) return GemmSmem<T, 64, 128, false, 3>::bytes;
    return GemmSmem<T, ROWS, BN, WG>::bytes;
}
template <GgmlType T, int ROWS, int BN, bool WG>
bool tile_fits() {
    return block_fits<T>(gemm_smem<T, ROWS, BN, WG>());
}

template <GgmlType T, bool GLU, int ROWS, int BN, bool WG>
void launch_gemm(const MatvecArgs & a, dim3 grid, cudaStream_t s) {
    if constexpr (ROWS == 64 && BN == 128 && !WG)
        if (narrow_ring<T>())
            return launch(gemm_kernel<T, GLU, 64, 128, false, 3>, grid, dim3(gemm_threads<64, 128, false>()),
                          gemm_smem<T, 64, 128, false>(), s, a);
    launch(gemm_kernel<T, GLU, ROWS, BN, WG>, grid, dim3(gemm_threads<ROWS, BN, WG>()), gemm_smem<T, ROWS, BN, WG>(), s,
           a);
}
template <GgmlType T, int ROWS, int BN, bool WG>
void launch_gemm(const MatvecArgs & a, dim3 grid, cudaStream_t s) {
    a.glu ? launch_gemm<T, true, ROWS, BN, WG>(a, grid, s) : launch_gemm<T, false, ROWS, BN, WG>(a, grid, s);
}

// The wgmma tiles run where the build has sm_90a code (DSV4_CUDA_SM90A, set by CMake when DSV4_CUDA_ARCHITECTURES
// names 90a) and the device is compute capability 9.0. DSV4_CUDA_WGMMA=0 keeps the mma.sync tiles there too: the
// tests run both, and A/B runs compare them.
bool use_wgmma() {
#ifdef DSV4_CUDA_SM90A
    static const bool allowed = [] {
        const char * e = std::getenv("DSV4_CUDA_WGMMA");
        return !e || std::strcmp(e, "0") != 0;
    }();
    return allowed && device_attribute<cudaDevAttrComputeCapabilityMajor>(0, 0) == 9 &&
           device_attribute<cudaDevAttrComputeCapabilityMinor>(0, 0) == 0;
#else
    return false;
#endif
}

// Whether ROWS-row tiles give the GPU at least two waves of blocks and fit its shared memory.
template <GgmlType T, int ROWS, bool WG>
bool tiles_fit(const MatvecArgs & a, int64_t rows, int64_t max_tiles, int tile_tokens) {
    const int64_t bm = a.glu ? ROWS / 2 : ROWS;
    return rows / bm * max_tiles * a.groups * tile_tokens / 128 >= 2 * device_sms() &&
           (tile_tokens == 128 ? tile_fits<T, ROWS, 128, WG>() : tile_fits<T, ROWS, 64, WG>());
}

template <GgmlType T, int ROWS, bool WG>
void launch_tiles(MatvecArgs a, int64_t max_tiles, int tile_tokens, cudaStream_t s) {
    const int64_t bm = a.glu ? ROWS / 2 : ROWS;
    int first = 0;
    for (int i = 0; i < a.n_targets; ++i) {
        a.t[i].first_block = first;
        a.t[i].blocks = int((a.t[i].rows + bm - 1) / bm);
        first += a.t[i].blocks;
    }
    const dim3 grid(unsigned(first), unsigned(max_tiles), unsigned(a.groups));
    tile_tokens == 128 ? launch_gemm<T, ROWS, 128, WG>(a, grid, s) : launch_gemm<T, ROWS, 64, WG>(a, grid, s);
}

// One launch over targets of one weight type, on the largest row tiles that keep two waves of blocks: each
// activation tile is then read the fewest times (the activations' bytes, f16, outweigh the weights' in every
// step). wgmma tiles have 256 or 128 rows; below that, 64-row mma.sync tiles (small products, and the 99 KB
// shared memories of sm_120/121), which beat 64-row wgmma tiles of 512 threads.
template <GgmlType T>
void gemm_one_type(const MatvecArgs & a, int64_t max_tiles, int tile_tokens, bool wgmma, cudaStream_t s) {
    int64_t rows = 0;
    for (int i = 0; i < a.n_targets; ++i) rows += a.t[i].rows;
    if (wgmma && tiles_fit<T, 256, true>(a, rows, max_tiles, tile_tokens))
        launch_tiles<T, 256, true>(a, max_tiles, tile_tokens, s);
    else if (wgmma && tiles_fit<T, 128, true>(a, rows, max_tiles, tile_tokens))
        launch_tiles<T, 128, true>(a, max_tiles, tile_tokens, s);
    else if (tiles_fit<T, 128, false>(a, rows, max_tiles, tile_tokens))
        launch_tiles<T, 128, false>(a, max_tiles, tile_tokens, s);
    else
        launch_tiles<T, 64, false>(a, max_tiles, tile_tokens, s);
}

// Calls fn(std::integral_constant<GgmlType, T>) for the gemm types T (returns false for the others).
template <class Fn>
bool with_gemm_type(GgmlType type, Fn && fn) {
    switch (type) {
        case GgmlType::F16:
            return fn(std::integral_constant<GgmlType, GgmlType::F16>()), true;
        case GgmlType::BF16:
            return fn(std::integral_constant<GgmlType, GgmlType::BF16>()), true;
        case GgmlType::Q8_0:
            return fn(std::integral_constant<GgmlType, GgmlType::Q8_0>()), true;
        case GgmlType::MXFP4:
            return fn(std::integral_constant<GgmlType, GgmlType::MXFP4>()), true;
        case GgmlType::Q2_K:
            return fn(std::integral_constant<GgmlType, GgmlType::Q2_K>()), true;
        case GgmlType::Q4_K:
            return fn(std::integral_constant<GgmlType, GgmlType::Q4_K>()), true;
        case GgmlType::IQ2_XXS:
            return fn(std::integral_constant<GgmlType, GgmlType::IQ2_XXS>()), true;
        default:  // F32 weights (the oracle fixtures) keep their exact f32 products
            return false;
    }
}

bool aligned16(const void * p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool gemm_supported(GgmlType w, int64_t k) {
    bool fits = false;
    // Where the 64-token tiles fit; the 128-token ones only where gemm_tile_tokens finds them fitting too (sm_120/121
    // keep F16 and BF16 at 64 tokens: their 64 × 128 tiles need 101 KB with a ring of 3).
    return with_gemm_type(w, [&](auto type) { fits = tile_fits<decltype(type)::value, 64, 64, false>(); }) && fits &&
           k % kBK == 0;
}

bool gemm_inputs_aligned(const MatvecArgs & a) {
    return aligned16(a.x) && (!a.x_up || aligned16(a.x_up)) && a.x_stride % 8 == 0;
}

void gemm_activations(const float * x, const float * x_up, float limit, int64_t rows, int64_t width, int64_t x_stride,
                      uint16_t * dst, cudaStream_t s) {
    const int64_t n = rows * width, threads = 256;
    if (n > 0)
        launch(activations_f16_kernel, dim3(unsigned((n / 8 + threads - 1) / threads)), dim3(threads), 0, s, x, x_up,
               limit, n, width, x_stride, reinterpret_cast<half *>(dst));
}

bool weights_f16_supported(GgmlType w, int64_t k) {
    return k % 8 == 0 && with_gemm_type(w, [](auto) {});
}

void weights_f16(const WeightRef & w, const WeightRef * w2, int64_t first, int64_t rows, int64_t n_blocks,
                 uint16_t * dst, cudaStream_t s) {
    const int64_t out_rows = n_blocks * (w2 ? 2 : 1) * rows;
    if (out_rows <= 0) return;
    const int64_t blocks = std::min<int64_t>(out_rows, 16 * device_sms());
    with_gemm_type(w.type, [&](auto type) {
        launch(weights_f16_kernel<decltype(type)::value>, dim3(unsigned(blocks)), dim3(128), 0, s, w,
               w2 ? *w2 : WeightRef{}, first, int(rows), int(out_rows), reinterpret_cast<half *>(dst));
    });
}

int gemm_tile_tokens(int64_t tokens_per_matrix, GgmlType w) {
    bool wide = false;
    with_gemm_type(w, [&](auto type) { wide = tile_fits<decltype(type)::value, 64, 128, false>(); });
    return tokens_per_matrix >= 96 && wide ? 128 : 64;
}

void gemm(const MatvecArgs & args, int64_t max_tiles, int tile_tokens, cudaStream_t s) {
    if (max_tiles <= 0 || args.n_targets <= 0) return;
    const bool wgmma = use_wgmma();
    for_each_weight_type(args, [&](const MatvecArgs & sub) {
        with_gemm_type(sub.t[0].w.type,
                       [&](auto type) { gemm_one_type<decltype(type)::value>(sub, max_tiles, tile_tokens, wgmma, s); });
    });
}

}  // namespace dsv4::cuda
