// Matrix-vector products for every weight type, plain, grouped, several of one input in one launch
// (matmul_many) and per expert (MoE), and the MoE routing plumbing (grouping pairs by expert, the weighted combine).
//
// One kernel shape serves decode and prefill. Quantized weights multiply 8-bit activations (Q8A or Q8_K,
// bit-identical to format/quant's rules, so the integer dot products equal the CPU backend's
// quantize_activations mode up to float summation order). A block of 8 warps takes a tile of up to 4 tokens and
// each warp streams two weight rows at a time: every lane loads 16 payload bytes per row per step (the upload
// layout keeps payloads 16-byte aligned), so the rows' bytes are read once per token tile. The activation rows
// are quantized once per product by a small kernel; a one-token tile (decode) reads its row in place (L1 keeps
// it), larger tiles copy theirs to shared memory. (Session 7 measured the alternative, each decode block
// quantizing the row itself into shared memory: 3 % slower per token, as every block of an 8192-wide product
// repeats the work of the whole row.) Long rows at decode (float rows, 8192-wide Q8_0) and few rows (small
// projections) split K over the warps of a row group instead. Before waiting for the previous kernel
// (programmatic dependent launch), a block of a plain product prefetches its first weight rows into L2: weights
// never change, so their streaming overlaps the tail of whatever ran before. One token's large Q8_0 products take
// the ring kernel instead (below), whose blocks stream their rows into shared memory before that wait.
#include "backend/cuda/common.cuh"

#include <algorithm>
#include <climits>
#include <type_traits>

namespace dsv4::cuda {

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 2;
constexpr size_t kMaxActSmem = 160 * 1024;  // a tile's activation codes; less where the device allows less (sm_120)

// ---------------------------------------------------------------------------------------------------------------------
// Activation tiles in shared memory
// ---------------------------------------------------------------------------------------------------------------------
// Quantized codes are stored in 16-byte chunks, chunk i at position i ^ ((i >> 3) & 7): lanes that read
// chunks 4 or 8 apart (IQ2_XXS and Q2_K units) then hit different banks.
__device__ __forceinline__ int swz(int chunk) { return chunk ^ ((chunk >> 3) & 7); }
__device__ __forceinline__ int4 act_chunk(const int8_t * q, int chunk) {
    return *reinterpret_cast<const int4 *>(q + 16 * swz(chunk));
}

struct ActTile {
    int8_t * q;  // [NT][K] codes, swizzled chunks
    float * d;   // [NT][K/32] scale of each 32 codes (Q8_K: its 256-block scale, repeated)
    int * bsum;  // [NT][K/16] sums of each 16 codes (Q8_K)
};

enum class Act { q8a, q8k };

size_t act_smem_bytes(Act act, int nt, int64_t k) {
    size_t b = size_t(nt) * size_t(k) + size_t(nt) * size_t(k / 32) * 4;
    if (act == Act::q8k) b += size_t(nt) * size_t(k / 16) * 4;
    return b;
}

// Quantized activation rows in global memory, one per (token, group): codes [K] (swizzled chunks), scales
// [K/32] f32, and for Q8_K the 16-value sums [K/16] i32, contiguous. A tile's blocks copy them to shared memory;
// a one-token tile reads them in place (L1 keeps them).
__host__ __device__ constexpr int64_t act_row_bytes(Act act, int64_t k) {
    return (k + k / 8 + (act == Act::q8k ? k / 4 : 0) + 15) / 16 * 16;  // rows stay 16-byte aligned
}

// Where a block reads its activation values: x itself, or swiglu(x, up) element-wise (the shared expert's down
// projection takes its gate and up rows and applies the activation on the way in).
struct ActSource {
    const float * x;
    const float * up;  // null: plain x
    float limit;
    __device__ __forceinline__ float at(int64_t i) const { return up ? swiglu_one(x[i], up[i], limit) : x[i]; }
};

// ds4's Q8A rule (quantize_q8a_scalar) for one block of 32 by one warp: d = amax/127 in f32, q = nearest-even(x/d)
// clamped to ±127.
__device__ void quantize_block_q8a(const ActSource & x, int b, int k, uint8_t * row) {
    const int lane = threadIdx.x & 31;
    const float v = x.at(32 * b + lane);
    const float amax = warp_max(fmaxf(0.0f, fabsf(v)));
    const float d = amax / 127.0f;
    const int q = d != 0.0f ? round_clamp(v / d, -127, 127) : 0;
    const int e = 32 * b + lane;
    row[16 * swz(e >> 4) + (e & 15)] = uint8_t(int8_t(q));
    if (lane == 0) reinterpret_cast<float *>(row + k)[b] = d;
}

// ggml's Q8_K rule (quantize_q8_k_scalar) for one block of 256 by one warp: the scale comes from the signed
// element of largest magnitude (the first one on ties), which maps to exactly -127; 16-value sums for the
// K-quant minimum terms.
__device__ void quantize_block_q8k(const ActSource & x, int sb, int k, uint8_t * row) {
    const int lane = threadIdx.x & 31;
    float v[8];
    if (!x.up) {
        const float4 * xv = reinterpret_cast<const float4 *>(x.x + 256 * sb + 8 * lane);
        const float4 x0 = xv[0], x1 = xv[1];
        v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w, v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = x.at(256 * sb + 8 * lane + i);
    }
    float best = 0.0f, best_v = 0.0f;
    int best_i = INT_MAX;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float ax = fabsf(v[i]);
        if (ax > best) {
            best = ax;
            best_v = v[i];
            best_i = 8 * lane + i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(kFull, best, o);
        const float ov = __shfl_xor_sync(kFull, best_v, o);
        const int oi = __shfl_xor_sync(kFull, best_i, o);
        if (ob > best || (ob == best && oi < best_i)) {
            best = ob;
            best_v = ov;
            best_i = oi;
        }
    }
    int q[8];
    float d = 0.0f;
    if (best == 0.0f) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = 0;
    } else {
        const float iscale = -127.0f / best_v;
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = round_clamp(iscale * v[i], -128, 127);
        d = 1.0f / iscale;
    }
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += q[i];
    s += __shfl_xor_sync(kFull, s, 1);
    const uint32_t lo =
        uint32_t(q[0] & 255) | uint32_t(q[1] & 255) << 8 | uint32_t(q[2] & 255) << 16 | uint32_t(q[3] & 255) << 24;
    const uint32_t hi =
        uint32_t(q[4] & 255) | uint32_t(q[5] & 255) << 8 | uint32_t(q[6] & 255) << 16 | uint32_t(q[7] & 255) << 24;
    const int e = 256 * sb + 8 * lane;
    *reinterpret_cast<uint2 *>(row + 16 * swz(e >> 4) + (e & 15)) = make_uint2(lo, hi);
    if ((lane & 1) == 0) reinterpret_cast<int *>(row + k + k / 8)[16 * sb + lane / 2] = s;
    if (lane < 8) reinterpret_cast<float *>(row + k)[8 * sb + lane] = d;
}

// One warp per block of one (token, group) row; the blocks of job 1 follow those of job 0.
struct QuantizeLaunch {
    QuantizeJob job[kMaxQuantizeJobs];
    Act act[kMaxQuantizeJobs];
    int64_t first[kMaxQuantizeJobs];  // the job's first warp (one warp per quantization block)
    int n_jobs;
};

__global__ void quantize_rows_kernel(const QuantizeLaunch q) {
    pdl_begin();
    const int64_t blk = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const int j = q.n_jobs > 1 && blk >= q.first[1] ? 1 : 0;
    const QuantizeJob & job = q.job[j];
    const Act act = q.act[j];
    const int k = int(job.k);
    const int per_row = act == Act::q8a ? k / 32 : k / 256;
    const int64_t rows = job.n * job.groups, local = blk - q.first[j];
    if (local >= rows * per_row) return;
    const int64_t r = local / per_row;
    const int b = int(local % per_row);
    const int64_t off = (r / job.groups) * job.x_stride + (r % job.groups) * k;
    const ActSource src{job.x + off, job.x_up ? job.x_up + off : nullptr, job.x_limit};
    uint8_t * row = job.dst + r * act_row_bytes(act, k);
    if (act == Act::q8a)
        quantize_block_q8a(src, b, k, row);
    else
        quantize_block_q8k(src, b, k, row);
}

// ---------------------------------------------------------------------------------------------------------------------
// Weight units: 16 payload bytes of one row, loaded at once, and their dot product with one token's codes
// ---------------------------------------------------------------------------------------------------------------------
struct Tables {
    const uint32_t * sel;  // IQ2_XXS's level codes (Iq2Tables::sel), in shared memory
    uint32_t levels;       // kIq2Levels, read from a lane's own slot after the table (iq2_run says why)
};

// Weights are read once per step: the weights' L2 policy (l2_evict_first), and not kept in L1.
__device__ __forceinline__ int4 ldg16(const uint8_t * p) {
    int4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.s32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(l2_evict_first()));
    return v;
}
__device__ __forceinline__ int dp4(int4 w, int4 a, int s) {
    s = __dp4a(w.x, a.x, s);
    s = __dp4a(w.y, a.y, s);
    s = __dp4a(w.z, a.z, s);
    return __dp4a(w.w, a.w, s);
}

struct Q8_0Unit {
    static constexpr GgmlType kType = GgmlType::Q8_0;
    static constexpr bool kFloat = false;
    static constexpr Act kAct = Act::q8a;
    static constexpr int kUnitElems = 16;
    int4 q;
    uint16_t d;
    __device__ void load(const WeightRef & w, int64_t row, int u, int k) {
        const int64_t gb = row * (k / 32) + (u >> 1);
        q = ldg16(w.data + gb * 32 + (u & 1) * 16);
        d = __ldg(reinterpret_cast<const unsigned short *>(w.data + w.n_blocks * 32) + gb);
    }
    __device__ float dot(int u, const ActTile & a, int ti, int k, const Tables &) const {
        const int s = dp4(q, act_chunk(a.q + size_t(ti) * k, u), 0);
        return f16_bits_to_f32(d) * a.d[ti * (k / 32) + (u >> 1)] * float(s);
    }
};

struct Mxfp4Unit {
    static constexpr GgmlType kType = GgmlType::MXFP4;
    static constexpr bool kFloat = false;
    static constexpr Act kAct = Act::q8a;
    static constexpr int kUnitElems = 32;
    int4 q;
    uint8_t e;
    __device__ void load(const WeightRef & w, int64_t row, int u, int k) {
        const int64_t gb = row * (k / 32) + u;
        q = ldg16(w.data + gb * 16);
        e = __ldg(w.data + w.n_blocks * 16 + gb);
    }
    // Four E2M1 codes (one per byte) to the doubled values {0, 1, 2, 3, 4, 6, 8, 12} with sign bit 3.
    static __device__ __forceinline__ int lut(uint32_t codes) {
        const uint32_t idx = codes & 0x07070707u;
        const uint32_t sel = (idx & 7u) | ((idx >> 4) & 0x70u) | ((idx >> 8) & 0x700u) | ((idx >> 12) & 0x7000u);
        const uint32_t pos = __byte_perm(0x03020100u, 0x0c080604u, sel);
        const uint32_t neg = __byte_perm(0xfdfeff00u, 0xf4f8fafcu, sel);
        const uint32_t m = ((codes >> 3) & 0x01010101u) * 0xffu;
        return int((pos & ~m) | (neg & m));
    }
    __device__ float dot(int u, const ActTile & a, int ti, int k, const Tables &) const {
        const int8_t * aq = a.q + size_t(ti) * k;
        const int4 lo = act_chunk(aq, 2 * u), hi = act_chunk(aq, 2 * u + 1);
        int s = 0;
        s = __dp4a(lut(uint32_t(q.x)), lo.x, s);
        s = __dp4a(lut(uint32_t(q.y)), lo.y, s);
        s = __dp4a(lut(uint32_t(q.z)), lo.z, s);
        s = __dp4a(lut(uint32_t(q.w)), lo.w, s);
        s = __dp4a(lut(uint32_t(q.x) >> 4), hi.x, s);
        s = __dp4a(lut(uint32_t(q.y) >> 4), hi.y, s);
        s = __dp4a(lut(uint32_t(q.z) >> 4), hi.z, s);
        s = __dp4a(lut(uint32_t(q.w) >> 4), hi.w, s);
        return e8m0_half(e) * a.d[ti * (k / 32) + u] * float(s);
    }
};

struct Iq2XxsUnit {
    static constexpr GgmlType kType = GgmlType::IQ2_XXS;
    static constexpr bool kFloat = false;
    static constexpr Act kAct = Act::q8k;
    static constexpr int kUnitElems = 64;  // two 32-value groups: (grid indices, sign word) twice
    int4 q;
    uint16_t d;
    __device__ void load(const WeightRef & w, int64_t row, int u, int k) {
        const int64_t gb = row * (k / 256) + (u >> 2);
        q = ldg16(w.data + gb * 64 + (u & 3) * 16);
        d = __ldg(reinterpret_cast<const unsigned short *>(w.data + w.n_blocks * 64) + gb);
    }
    // Sum over the 32 values of grid · sign · a: a byte permute a four values gives them signed (common.cuh), so
    // one dp4a a four, against two and a mask each when the grid held magnitudes (session 32's word).
    static __device__ __forceinline__ int group(uint32_t idx, uint32_t word, int4 a0, int4 a1, const Tables & t) {
        const uint32_t signs = iq2_signs(word);
        int sum = 0;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const uint2 v = iq2_run(t.sel[(idx >> (8 * kk)) & 255], signs, kk, t.levels);
            const int4 & a = kk < 2 ? a0 : a1;
            sum = __dp4a(int(v.x), (kk & 1) ? a.z : a.x, sum);
            sum = __dp4a(int(v.y), (kk & 1) ? a.w : a.y, sum);
        }
        return sum * int(2 * iq2_scale(word) + 1);
    }
    // A token's codes and scale for unit u, loaded once for all the rows a warp multiplies by them (the compiler
    // did not merge the rows' identical loads: 16 loads and their swizzled addresses a unit instead of 4).
    struct Acts {
        int4 c[4];
        float d;
    };
    static __device__ __forceinline__ Acts acts(int u, const ActTile & a, int ti, int k) {
        const int8_t * aq = a.q + size_t(ti) * k;
        return {{act_chunk(aq, 4 * u), act_chunk(aq, 4 * u + 1), act_chunk(aq, 4 * u + 2), act_chunk(aq, 4 * u + 3)},
                a.d[ti * (k / 32) + 2 * u]};
    }
    __device__ float dot(const Acts & x, const Tables & t) const {
        const int s = group(uint32_t(q.x), uint32_t(q.y), x.c[0], x.c[1], t) +
                      group(uint32_t(q.z), uint32_t(q.w), x.c[2], x.c[3], t);
        return f16_bits_to_f32(d) * x.d * 0.125f * float(s);
    }
};

// Units whose activations a warp loads once a unit for all its rows (U::Acts, U::acts, dot(Acts, Tables)).
template <class U, class = void>
struct HasActs : std::false_type {};
template <class U>
struct HasActs<U, std::void_t<typename U::Acts>> : std::true_type {};

struct Q2_KUnit {
    static constexpr GgmlType kType = GgmlType::Q2_K;
    static constexpr bool kFloat = false;
    static constexpr Act kAct = Act::q8k;
    static constexpr int kUnitElems = 64;  // 16 code bytes: 4 groups of 16 values at stride 32
    int4 q;
    uint2 sc;
    uint32_t dm;
    int u_in;  // unit index inside its block (h = u_in / 2, half = u_in % 2)
    __device__ void load(const WeightRef & w, int64_t row, int u, int k) {
        const int64_t gb = row * (k / 256) + (u >> 2);
        u_in = u & 3;
        const uint8_t * p = w.data + gb * 80;
        q = ldg16(p + 16 + 16 * u_in);
        sc = __ldg(reinterpret_cast<const uint2 *>(p + 8 * (u_in >> 1)));
        dm = __ldg(reinterpret_cast<const unsigned int *>(w.data + w.n_blocks * 80) + gb);
    }
    __device__ float dot(int u, const ActTile & a, int ti, int k, const Tables &) const {
        const int half = u_in & 1;
        const int e0 = (u >> 2) * 256 + 128 * (u_in >> 1) + 16 * half;
        const int8_t * aq = a.q + size_t(ti) * k;
        const int * bs = a.bsum + ti * (k / 16);
        int isum = 0, msum = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const int4 av = act_chunk(aq, (e0 + 32 * g) >> 4);
            int s = __dp4a(int((uint32_t(q.x) >> (2 * g)) & 0x03030303u), av.x, 0);
            s = __dp4a(int((uint32_t(q.y) >> (2 * g)) & 0x03030303u), av.y, s);
            s = __dp4a(int((uint32_t(q.z) >> (2 * g)) & 0x03030303u), av.z, s);
            s = __dp4a(int((uint32_t(q.w) >> (2 * g)) & 0x03030303u), av.w, s);
            const int b = 2 * g + half;
            const uint32_t scb = ((g < 2 ? sc.x : sc.y) >> (8 * (b & 3))) & 255u;
            isum += int(scb & 15) * s;
            msum += int(scb >> 4) * bs[(e0 + 32 * g) >> 4];
        }
        const float d = f16_bits_to_f32(uint16_t(dm)), dmin = f16_bits_to_f32(uint16_t(dm >> 16));
        return a.d[ti * (k / 32) + (e0 >> 5)] * (d * float(isum) - dmin * float(msum));
    }
};

struct Q4_KUnit {
    static constexpr GgmlType kType = GgmlType::Q4_K;
    static constexpr bool kFloat = false;
    static constexpr Act kAct = Act::q8k;
    static constexpr int kUnitElems = 32;  // 16 code bytes: 16 values of two sub-blocks (low and high nibbles)
    int4 hdr;                              // d, dmin, 12 scale bytes
    int4 q;
    int u_in;
    __device__ void load(const WeightRef & w, int64_t row, int u, int k) {
        const int64_t gb = row * (k / 256) + (u >> 3);
        u_in = u & 7;
        const uint8_t * p = w.data + gb * 144;
        hdr = ldg16(p);
        q = ldg16(p + 16 + 16 * u_in);
    }
    __device__ __forceinline__ int scale_byte(int i) const {
        const uint32_t word = i < 4 ? uint32_t(hdr.y) : i < 8 ? uint32_t(hdr.z) : uint32_t(hdr.w);
        return int((word >> (8 * (i & 3))) & 255u);
    }
    __device__ __forceinline__ void scale_min(int j, int & s, int & m) const {
        if (j < 4) {
            s = scale_byte(j) & 63;
            m = scale_byte(j + 4) & 63;
        } else {
            s = (scale_byte(j + 4) & 15) | ((scale_byte(j - 4) >> 6) << 4);
            m = (scale_byte(j + 4) >> 4) | ((scale_byte(j) >> 6) << 4);
        }
    }
    __device__ float dot(int u, const ActTile & a, int ti, int k, const Tables &) const {
        const int p = u_in >> 1, half = u_in & 1;
        const int e0 = (u >> 3) * 256 + 64 * p + 16 * half;
        const int8_t * aq = a.q + size_t(ti) * k;
        const int4 alo = act_chunk(aq, e0 >> 4), ahi = act_chunk(aq, (e0 + 32) >> 4);
        int slo = __dp4a(int(uint32_t(q.x) & 0x0f0f0f0fu), alo.x, 0);
        slo = __dp4a(int(uint32_t(q.y) & 0x0f0f0f0fu), alo.y, slo);
        slo = __dp4a(int(uint32_t(q.z) & 0x0f0f0f0fu), alo.z, slo);
        slo = __dp4a(int(uint32_t(q.w) & 0x0f0f0f0fu), alo.w, slo);
        int shi = __dp4a(int((uint32_t(q.x) >> 4) & 0x0f0f0f0fu), ahi.x, 0);
        shi = __dp4a(int((uint32_t(q.y) >> 4) & 0x0f0f0f0fu), ahi.y, shi);
        shi = __dp4a(int((uint32_t(q.z) >> 4) & 0x0f0f0f0fu), ahi.z, shi);
        shi = __dp4a(int((uint32_t(q.w) >> 4) & 0x0f0f0f0fu), ahi.w, shi);
        int s0, m0, s1, m1;
        scale_min(2 * p, s0, m0);
        scale_min(2 * p + 1, s1, m1);
        const int * bs = a.bsum + ti * (k / 16);
        const float d = f16_bits_to_f32(uint16_t(uint32_t(hdr.x))),
                    dmin = f16_bits_to_f32(uint16_t(uint32_t(hdr.x) >> 16));
        return a.d[ti * (k / 32) + (e0 >> 5)] *
               (d * float(s0 * slo + s1 * shi) - dmin * float(m0 * bs[e0 >> 4] + m1 * bs[(e0 + 32) >> 4]));
    }
};

// ---------------------------------------------------------------------------------------------------------------------
// Float weights: a "unit" tag (their rows multiply f32 activations read straight from global memory; L1 keeps a
// tile's rows). VEC: 16-byte loads (rows, activation rows and group offsets keep 16-byte alignment).
// ---------------------------------------------------------------------------------------------------------------------
template <GgmlType T, bool VEC>
struct FloatUnit {
    static constexpr GgmlType kType = T;
    static constexpr bool kFloat = true;
    static constexpr bool kVec = VEC;
};

template <GgmlType T>
__device__ __forceinline__ float load_float(const uint8_t * base, int64_t i) {
    if constexpr (T == GgmlType::F32)
        return __ldg(reinterpret_cast<const float *>(base) + i);
    else if constexpr (T == GgmlType::F16)
        return f16_bits_to_f32(__ldg(reinterpret_cast<const unsigned short *>(base) + i));
    else
        return bf16_bits_to_f32(__ldg(reinterpret_cast<const unsigned short *>(base) + i));
}

template <GgmlType T>
__device__ __forceinline__ void unpack16(int4 v, float (&f)[16 / (T == GgmlType::F32 ? 4 : 2)]) {
    if constexpr (T == GgmlType::F32) {
        f[0] = __int_as_float(v.x);
        f[1] = __int_as_float(v.y);
        f[2] = __int_as_float(v.z);
        f[3] = __int_as_float(v.w);
    } else {
        const uint32_t w[4] = {uint32_t(v.x), uint32_t(v.y), uint32_t(v.z), uint32_t(v.w)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if constexpr (T == GgmlType::F16) {
                f[2 * j] = f16_bits_to_f32(uint16_t(w[j]));
                f[2 * j + 1] = f16_bits_to_f32(uint16_t(w[j] >> 16));
            } else {
                f[2 * j] = bf16_bits_to_f32(uint16_t(w[j]));
                f[2 * j + 1] = bf16_bits_to_f32(uint16_t(w[j] >> 16));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// The kernels
// ---------------------------------------------------------------------------------------------------------------------
// Token tile of this block: activation rows, output rows and the weight row offset (expert / group).
template <int NT>
struct Tile {
    int n_tok = 0;
    int64_t src[NT];
    int64_t dst[NT];
    int64_t row_off = 0;
};

// by: the block's tile (blockIdx.y in a product's own launch).
template <int NT>
__device__ __forceinline__ bool load_tile(const MatvecArgs & a, const MatvecTarget & t, Tile<NT> & tile, int by) {
    if (a.pair_experts) {
        const int e = a.pair_experts[by];
        if (e < 0 || e >= a.n_expert) return false;
        tile.n_tok = 1;
        tile.row_off = int64_t(e) * t.rows;
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            tile.src[i] = int64_t(by) / a.src_div;
            tile.dst[i] = by;
        }
    } else if (a.tiles) {
        if (int(by) >= *a.n_tiles) return false;
        const int32_t * tl = a.tiles + 3 * by;
        tile.n_tok = tl[2];
        tile.row_off = int64_t(tl[0]) * t.rows;
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            const int64_t p = i < tile.n_tok ? a.pairs[tl[1] + i] : 0;
            tile.src[i] = p / a.src_div;
            tile.dst[i] = p;
        }
    } else {
        const int64_t t0 = int64_t(by) * NT;
        tile.n_tok = int(min(int64_t(NT), a.n - t0));
#pragma unroll
        for (int i = 0; i < NT; ++i) tile.src[i] = tile.dst[i] = t0 + i;
    }
    tile.row_off += int64_t(blockIdx.z) * t.rows;
    return tile.n_tok > 0;
}

// Reduces each row's partial sums over the lanes and, when a.split warps share a row group (split K), over those
// warps in a fixed order; stores (after SwiGLU of gate and up, or plus the addend). Every warp of the block must
// call it.
template <int NT, bool GLU>
__device__ __forceinline__ void store_rows(const MatvecArgs & a, const MatvecTarget & t, const Tile<NT> & tile,
                                           int64_t row0, float (&acc)[GLU ? 2 : 1][kRowsPerWarp][NT]) {
    constexpr int kM = GLU ? 2 : 1;
    __shared__ float red[kWarps][kM][kRowsPerWarp][NT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int split = a.split, slice = warp % split;
    const int64_t ycol = int64_t(blockIdx.z) * t.rows;
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
            for (int i = 0; i < NT; ++i) acc[m][r][i] = warp_sum(acc[m][r][i]);
    if (split > 1) {
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < kM; ++m)
#pragma unroll
                for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
                    for (int i = 0; i < NT; ++i) red[warp][m][r][i] = acc[m][r][i];
        __syncthreads();
        if (slice == 0)
#pragma unroll
            for (int m = 0; m < kM; ++m)
#pragma unroll
                for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
                    for (int i = 0; i < NT; ++i) {
                        float sum = 0.0f;
                        for (int w = 0; w < split; ++w) sum += red[warp + w][m][r][i];
                        acc[m][r][i] = sum;
                    }
        __syncthreads();
        if (slice != 0) return;
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            float v = acc[0][r][i];
            if constexpr (GLU) v = swiglu_one(v, acc[1][r][i], a.limit);
            if (lane == 0 && i < tile.n_tok && row0 + r < t.rows) {
                const int64_t at = tile.dst[i] * t.y_stride + ycol + row0 + r;
                t.y[at] = t.add ? t.add[at] + v : v;
            }
        }
}

// xq: the quantized activation rows of U's kind (a.xq's, or a block's own in shared memory).
template <class U, int NT, bool GLU>
__device__ __forceinline__ void quant_rows(const MatvecArgs & a, const MatvecTarget & t, const Tile<NT> & tile, int bx,
                                           uint8_t * smem, const uint8_t * xq) {
    const int k = int(t.w.ne0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // Shared memory: the IQ2 grid's level codes (a static array: its address is a constant, so that a lookup is one
    // load at an offset, not an address sum and a load), then in dynamic memory the tile's codes, scales, sums.
    uint8_t * p = smem;
    Tables tab{nullptr, 0};
    if constexpr (std::is_same_v<U, Iq2XxsUnit>) {
        __shared__ uint32_t sel[256 + 32];
        for (int i = threadIdx.x; i < 256 + 32; i += kThreads) sel[i] = i < 256 ? t.w.iq2->sel[i] : kIq2Levels;
        tab.sel = sel;
    }
    ActTile act;
    const int64_t arb = act_row_bytes(U::kAct, k);
    if constexpr (NT == 1) {
        const uint8_t * row = xq + (tile.src[0] * a.groups + blockIdx.z) * arb;
        act.q = const_cast<int8_t *>(reinterpret_cast<const int8_t *>(row));
        act.d = const_cast<float *>(reinterpret_cast<const float *>(row + k));
        act.bsum = const_cast<int *>(reinterpret_cast<const int *>(row + k + k / 8));
    } else {
        act.q = reinterpret_cast<int8_t *>(p);
        act.d = reinterpret_cast<float *>(p + size_t(NT) * k);
        act.bsum = reinterpret_cast<int *>(p + size_t(NT) * k + size_t(NT) * (k / 32) * 4);
        for (int i = 0; i < tile.n_tok; ++i) {
            const uint8_t * row = xq + (tile.src[i] * a.groups + blockIdx.z) * arb;
            for (int j = threadIdx.x; j < k / 16; j += kThreads)
                reinterpret_cast<int4 *>(act.q + size_t(i) * k)[j] = reinterpret_cast<const int4 *>(row)[j];
            for (int j = threadIdx.x; j < k / 32; j += kThreads)
                act.d[i * (k / 32) + j] = reinterpret_cast<const float *>(row + k)[j];
            if constexpr (U::kAct == Act::q8k)
                for (int j = threadIdx.x; j < k / 16; j += kThreads)
                    act.bsum[i * (k / 16) + j] = reinterpret_cast<const int *>(row + k + k / 8)[j];
        }
    }
    __syncthreads();
    if constexpr (std::is_same_v<U, Iq2XxsUnit>) tab.levels = tab.sel[256 + lane];

    const int units = k / U::kUnitElems;
    const int split = a.split, slice = warp % split;
    const int64_t rows_per_block = int64_t(kWarps / split) * kRowsPerWarp;
    for (int64_t rb = bx; rb * rows_per_block < t.rows; rb += t.blocks) {
        const int64_t row0 = rb * rows_per_block + int64_t(warp / split) * kRowsPerWarp;
        float acc[GLU ? 2 : 1][kRowsPerWarp][NT];
#pragma unroll
        for (int m = 0; m < (GLU ? 2 : 1); ++m)
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
                for (int i = 0; i < NT; ++i) acc[m][r][i] = 0.0f;
        const auto unit = [&](int u) {
            U wu[GLU ? 2 : 1][kRowsPerWarp];
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r) {
                const int64_t row = tile.row_off + min(row0 + r, t.rows - 1);
                wu[0][r].load(t.w, row, u, k);
                if constexpr (GLU) wu[1][r].load(t.w_up, row, u, k);
            }
#pragma unroll
            for (int i = 0; i < NT; ++i) {
                if (i >= tile.n_tok) break;
                if constexpr (HasActs<U>::value) {
                    const typename U::Acts x = U::acts(u, act, i, k);
#pragma unroll
                    for (int m = 0; m < (GLU ? 2 : 1); ++m)
#pragma unroll
                        for (int r = 0; r < kRowsPerWarp; ++r) acc[m][r][i] += wu[m][r].dot(x, tab);
                } else {
#pragma unroll
                    for (int m = 0; m < (GLU ? 2 : 1); ++m)
#pragma unroll
                        for (int r = 0; r < kRowsPerWarp; ++r) acc[m][r][i] += wu[m][r].dot(u, act, i, k, tab);
                }
            }
        };
        // A lane's units: u ≡ lane (mod 32). The routed IQ2_XXS gate/up gives a lane one or two a row group (V4's
        // 4096-wide input: two), which `#pragma unroll 4` ran in its remainder loop, one unit's loads at a time; as
        // straight code moe_shared takes ~7 % less time in the decode graph (session 34). The Q8_0 and Q2_K products
        // lost more than that on the same path (their kernels' registers and instructions grew), so they keep the
        // loop.
        const int step = 32 * split, first = lane + 32 * slice, trips = (units - first + step - 1) / step;
        if (std::is_same_v<U, Iq2XxsUnit> && GLU && trips == 2) {
            unit(first);
            unit(first + step);
        } else if (std::is_same_v<U, Iq2XxsUnit> && GLU && trips == 1) {
            unit(first);
        } else {
#pragma unroll 4
            for (int u = first; u < units; u += step) unit(u);
        }
        store_rows<NT, GLU>(a, t, tile, row0, acc);
    }
}

// Four activation values starting at i (16-byte aligned), through the fused SwiGLU when x_up is given.
__device__ __forceinline__ float4 load_act4(const float * x, const float * up, float limit, int64_t i) {
    float4 f = __ldg(reinterpret_cast<const float4 *>(x + i));
    if (up) {
        const float4 g = __ldg(reinterpret_cast<const float4 *>(up + i));
        f = make_float4(swiglu_one(f.x, g.x, limit), swiglu_one(f.y, g.y, limit), swiglu_one(f.z, g.z, limit),
                        swiglu_one(f.w, g.w, limit));
    }
    return f;
}

template <class U, int NT, bool GLU>
__device__ __forceinline__ void float_rows(const MatvecArgs & a, const MatvecTarget & t, const Tile<NT> & tile,
                                           int bx) {
    constexpr GgmlType T = U::kType;
    const int64_t k = t.w.ne0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int kEsz = T == GgmlType::F32 ? 4 : 2;
    constexpr int kEpu = 16 / kEsz;
    const float * xr[NT];
    const float * ur[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        const int64_t off = tile.src[i] * a.x_stride + int64_t(blockIdx.z) * k;
        xr[i] = a.x + off;
        ur[i] = a.x_up ? a.x_up + off : nullptr;
    }
    const int split = a.split, slice = warp % split;
    const int64_t rows_per_block = int64_t(kWarps / split) * kRowsPerWarp;
    for (int64_t rb = bx; rb * rows_per_block < t.rows; rb += t.blocks) {
        const int64_t row0 = rb * rows_per_block + int64_t(warp / split) * kRowsPerWarp;
        float acc[GLU ? 2 : 1][kRowsPerWarp][NT];
#pragma unroll
        for (int m = 0; m < (GLU ? 2 : 1); ++m)
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
                for (int i = 0; i < NT; ++i) acc[m][r][i] = 0.0f;
        const uint8_t * wr[GLU ? 2 : 1][kRowsPerWarp];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
            const int64_t row = tile.row_off + min(row0 + r, t.rows - 1);
            wr[0][r] = t.w.data + row * k * kEsz;
            if constexpr (GLU) wr[1][r] = t.w_up.data + row * k * kEsz;
        }
        if constexpr (U::kVec) {
#pragma unroll 2
            for (int64_t u = lane + 32 * slice; u < k / kEpu; u += 32 * split) {
                float wf[GLU ? 2 : 1][kRowsPerWarp][kEpu];
#pragma unroll
                for (int m = 0; m < (GLU ? 2 : 1); ++m)
#pragma unroll
                    for (int r = 0; r < kRowsPerWarp; ++r) unpack16<T>(ldg16(wr[m][r] + u * 16), wf[m][r]);
#pragma unroll
                for (int i = 0; i < NT; ++i) {
                    if (i >= tile.n_tok) break;
                    float xv[kEpu];
#pragma unroll
                    for (int j = 0; j < kEpu; j += 4) {
                        const float4 f = load_act4(xr[i], ur[i], a.x_limit, u * kEpu + j);
                        xv[j] = f.x;
                        xv[j + 1] = f.y;
                        xv[j + 2] = f.z;
                        xv[j + 3] = f.w;
                    }
#pragma unroll
                    for (int m = 0; m < (GLU ? 2 : 1); ++m)
#pragma unroll
                        for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
                            for (int j = 0; j < kEpu; ++j) acc[m][r][i] = fmaf(wf[m][r][j], xv[j], acc[m][r][i]);
                }
            }
        } else {
            for (int64_t c = lane + 32 * slice; c < k; c += 32 * split) {
#pragma unroll
                for (int i = 0; i < NT; ++i) {
                    if (i >= tile.n_tok) break;
                    const float xv = ActSource{xr[i], ur[i], a.x_limit}.at(c);
#pragma unroll
                    for (int m = 0; m < (GLU ? 2 : 1); ++m)
#pragma unroll
                        for (int r = 0; r < kRowsPerWarp; ++r) acc[m][r][i] += load_float<T>(wr[m][r], c) * xv;
                }
            }
        }
        store_rows<NT, GLU>(a, t, tile, row0, acc);
    }
}

// L2 prefetch of rows [row, row + count) of a weight (at most kPrefetchBytes per array, so that a large
// product's first wave does not push its own later rows out).
constexpr int64_t kPrefetchBytes = 32 * 1024;

__device__ void prefetch_weight_rows(const WeightRef & w, int64_t row, int64_t count) {
    int be = 0, pb = 0, sb = 0;  // block elements, payload and scale bytes of the split layouts
    switch (w.type) {
        case GgmlType::Q8_0:
            be = 32, pb = 32, sb = 2;
            break;
        case GgmlType::MXFP4:
            be = 32, pb = 16, sb = 1;
            break;
        case GgmlType::IQ2_XXS:
            be = 256, pb = 64, sb = 2;
            break;
        case GgmlType::Q2_K:
            be = 256, pb = 80, sb = 4;
            break;
        case GgmlType::Q4_K: {
            const int64_t rb = w.ne0 / 256 * 144;
            prefetch_l2(w.data + row * rb, min(count * rb, kPrefetchBytes));
            return;
        }
        case GgmlType::F32:
        case GgmlType::F16:
        case GgmlType::BF16: {
            const int64_t rb = w.ne0 * (w.type == GgmlType::F32 ? 4 : 2);
            prefetch_l2(w.data + row * rb, min(count * rb, kPrefetchBytes));
            return;
        }
        default:
            return;
    }
    const int64_t bpr = w.ne0 / be;
    prefetch_l2(w.data + row * bpr * pb, min(count * bpr * pb, kPrefetchBytes));
    prefetch_l2(w.data + w.n_blocks * pb + row * bpr * sb, min(count * bpr * sb, kPrefetchBytes));
}

// One launch over up to kMaxTargets targets; Us are the weight kinds it is compiled for (one, or the Q8_0 + F16
// mix of matmul_many); each block runs the kind of its target.
template <int NT, bool GLU, class... Us>
__global__ void __launch_bounds__(kThreads) matvec_kernel(const MatvecArgs a) {
    extern __shared__ __align__(16) uint8_t smem[];
    MatvecTarget t = a.t[0];
#pragma unroll
    for (int i = 1; i < kMaxTargets; ++i)
        if (i < a.n_targets && int(blockIdx.x) >= a.t[i].first_block) t = a.t[i];
    const int bx = int(blockIdx.x) - t.first_block;
    // Expert tiles come from the previous kernel; a plain product's rows are known before it ends.
    if (!a.tiles && !a.pair_experts) {
        const int64_t rows_per_block = int64_t(kWarps / a.split) * kRowsPerWarp, row0 = int64_t(bx) * rows_per_block;
        if (row0 < t.rows) {
            const int64_t first = int64_t(blockIdx.z) * t.rows + row0, count = min(rows_per_block, t.rows - row0);
            prefetch_weight_rows(t.w, first, count);
            if (GLU) prefetch_weight_rows(t.w_up, first, count);
        }
    }
    pdl_begin();
    Tile<NT> tile;
    if (!load_tile(a, t, tile, int(blockIdx.y))) return;
    auto run = [&](auto unit) {
        using U = decltype(unit);
        if (t.w.type != U::kType) return false;
        if constexpr (U::kFloat)
            float_rows<U, NT, GLU>(a, t, tile, bx);
        else
            quant_rows<U, NT, GLU>(a, t, tile, bx, smem, a.xq[int(U::kAct)]);
        return true;
    };
    (run(Us{}) || ...);
}

// ---------------------------------------------------------------------------------------------------------------------
// One token's large products through a ring of shared-memory slots (decode)
// ---------------------------------------------------------------------------------------------------------------------
// One block a multiprocessor. Its producer thread copies the block's rows (whole rows a slot: Q8_0 payload and f16
// scales, or f16 rows) into a ring of 32 KB slots with bulk copies from the kernel's first instruction: weights
// never change, so under PDL they stream while the kernel before still runs, and a slot's copy never waits on a load
// a warp issues. Sixteen consumer warps wait for the kernel before, load the activations their lanes multiply into
// registers (a lane reads the same columns of every row its warp takes, so K is a template parameter and every
// index a constant offset), take the slots as they land and leave each row's partial sums in shared memory; the
// block stores its rows at the end. A launch takes up to kMaxTargets products of one input one after another
// (segments: the Q8_0 ones, then the F16 ones, each split over all blocks, so every block streams about the same
// bytes): the attention's projections of a compressed layer and the FFN's router and shared gate/up stream as one.
// dsv4-chain-bench measured the design on a layer's dense products ("Session 49" of docs/cuda-journal.md): a chain of
// them launched this way streams at 2.6 TB/s against 2.2-2.3 for session 48's consumer. sm_90 and up (bulk copies,
// transaction-counted mbarriers) with a 227 KB carveout; elsewhere matvec_kernel runs.
namespace ring {

constexpr int kConsumers = 512;            // sixteen warps
constexpr int kThreads = kConsumers + 32;  // and the producer's warp
constexpr int kMaxSlots = 6;
constexpr int kSlotBytes = 32 << 10;                             // whole rows: a row's bytes divide it
constexpr int kSlotScaleBytes = kSlotBytes / 16;                 // Q8_0 rows' f16 scales, 2 bytes a block of 32
constexpr int kWarpUnits = kSlotBytes / 16 / (kConsumers / 32);  // 16-byte units a warp takes of a full slot
constexpr int kUnits = kWarpUnits / 32;                          // and a lane

// Warps that share one row of K values of `row_bytes` bytes (their partial sums a row).
__host__ __device__ constexpr int parts(int row_bytes) {
    return row_bytes / 16 > kWarpUnits ? row_bytes / 16 / kWarpUnits : 1;
}

// Dynamic shared memory of `slots` slots: payloads, then scales, then each slot's full and empty barriers, then
// float part[the block's rows of every segment][parts], each row's sums by the warps that share it.
__host__ __device__ constexpr int scales_at(int slots) { return slots * kSlotBytes; }
__host__ __device__ constexpr int barriers_at(int slots) { return slots * (kSlotBytes + kSlotScaleBytes); }
__host__ __device__ constexpr int part_at(int slots) { return barriers_at(slots) + 2 * kMaxSlots * 8; }

}  // namespace ring

struct RingSegment {
    const uint8_t * payload;  // Q8_0: [rows][K] codes (the upload layout's payload); F16: [rows][K] f16
    const uint16_t * scales;  // Q8_0: [rows][K / 32] f16; F16: null
    float * y;                // [rows]: y = add + W x, a grouped product's groups one after another
    const float * add;        // or null
    int rows;
};

struct RingArgs {
    RingSegment seg[kMaxTargets];  // the Q8_0 products [0, n_q8), then the F16 ones [n_q8, n_seg)
    int n_q8, n_seg;
    const uint8_t * xq;  // Q8A activation rows, one per group (act_row_bytes(q8a, K) apart): codes, then scales
    const float * x;     // [K] f32 activations (F16 products; one group)
    int group_rows;      // a grouped product's rows of one group (it is one Q8_0 segment), else 0
    int slots;           // 1..ring::kMaxSlots
};

template <int K>
__global__ void __launch_bounds__(ring::kThreads, 1) ring_matvec_kernel(const RingArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using namespace ring;
    extern __shared__ __align__(128) uint8_t smem_raw[];
    const int slots = a.slots;
    int4 * slot_payload = reinterpret_cast<int4 *>(smem_raw);                       // [slots][kSlotBytes / 16]
    int4 * slot_scales = reinterpret_cast<int4 *>(smem_raw + scales_at(slots));     // [slots][kSlotScaleBytes / 16]
    uint64_t * full = reinterpret_cast<uint64_t *>(smem_raw + barriers_at(slots));  // [slots]
    uint64_t * empty = full + kMaxSlots;                                            // [slots]
    float * part = reinterpret_cast<float *>(smem_raw + part_at(slots));
    const int b = int(blockIdx.x), blocks = int(gridDim.x);
    // The block's rows of segment s: [first_row(s, b), first_row(s, b + 1)).
    auto first_row = [&](int s, int block) { return int(int64_t(a.seg[s].rows) * block / blocks); };
    if (threadIdx.x == 0) {
        mbarriers_init(full, slots);                    // the producer's arrival with the copies' bytes
        mbarriers_init(empty, slots, kConsumers / 32);  // each consumer warp's
    }
    __syncthreads();
    if (threadIdx.x >= kConsumers) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        if (threadIdx.x != kConsumers) return;
        RingPlace at;
        for (int s = 0; s < a.n_seg; ++s) {
            const bool q8 = s < a.n_q8;
            const int row_bytes = q8 ? K : 2 * K, per = q8 ? kSlotBytes / K : kSlotBytes / (2 * K);
            const int r1 = first_row(s, b + 1);
            for (int r = first_row(s, b); r < r1; r += per, at.next(slots)) {
                if (at.reused) mbarrier_wait(&empty[at.slot], at.phase ^ 1u);
                const uint32_t n = uint32_t(min(per, r1 - r)), payload = n * row_bytes, scales = q8 ? n * (K / 16) : 0;
                mbarrier_expect_bytes(&full[at.slot], payload + scales);
                bulk_copy(slot_payload + at.slot * (kSlotBytes / 16), a.seg[s].payload + size_t(r) * row_bytes, payload,
                          &full[at.slot]);
                if (q8)
                    bulk_copy(slot_scales + at.slot * (kSlotScaleBytes / 16), a.seg[s].scales + size_t(r) * (K / 32),
                              scales, &full[at.slot]);
            }
        }
        return;
    }
    pdl_begin();
    const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
    const int first_unit = warp * kWarpUnits;
    RingPlace at;
    int part_off = 0;  // where the segment's rows begin in part (floats)
    {
        // Q8_0 rows: 16 codes a unit, a warp's units within one row or, at K = 1024, two.
        constexpr int kUnitsPerRow = K / 16, kPer = kSlotBytes / K, kParts = parts(K);
        constexpr int kRowsPerWarp = kUnitsPerRow < kWarpUnits ? kWarpUnits / kUnitsPerRow : 1;  // 2 at K = 1024
        static_assert(kRowsPerWarp <= 2 && kUnitsPerRow % 32 == 0, "a lane's units lie in one row");
        const int row = first_unit / kUnitsPerRow, base = first_unit % kUnitsPerRow;  // the warp's place in a slot
        int4 x[kUnits];    // the lane's codes: unit j is column (base + 32 j) % kUnitsPerRow + lane of its row
        float xd[kUnits];  // and their scales
        int group = -1;    // the group they are of
        for (int s = 0; s < a.n_q8; ++s) {
            const int r0 = first_row(s, b), r1 = first_row(s, b + 1);
            for (int r = r0; r < r1; r += kPer, at.next(slots)) {
                const int slot = at.slot, n = min(kPer, r1 - r);
                mbarrier_wait(&full[slot], at.phase);
                if (row < n) {
                    const int g = a.group_rows ? (r + row) / a.group_rows : 0;  // one group at K = 1024
                    if (g != group) {
                        group = g;
                        const uint8_t * xrow = a.xq + size_t(g) * act_row_bytes(Act::q8a, K);
#pragma unroll
                        for (int j = 0; j < kUnits; ++j) {
                            const int col = (base + 32 * j) % kUnitsPerRow + lane;
                            x[j] = act_chunk(reinterpret_cast<const int8_t *>(xrow), col);
                            xd[j] = reinterpret_cast<const float *>(xrow + K)[col >> 1];
                        }
                    }
                    // Unit u of the slot holds columns of block u / 2 of the slot's rows, whose scale is the slot's
                    // u / 2.
                    const int4 * w = slot_payload + slot * (kSlotBytes / 16) + first_unit + lane;
                    const uint16_t * wd =
                        reinterpret_cast<const uint16_t *>(slot_scales + slot * (kSlotScaleBytes / 16)) +
                        (first_unit + lane) / 2;
                    float sum[kRowsPerWarp] = {};
#pragma unroll
                    for (int j = 0; j < kUnits; ++j)
                        sum[(base + 32 * j) / kUnitsPerRow] +=
                            float(dp4(w[32 * j], x[j], 0)) * (xd[j] * f16_bits_to_f32(wd[16 * j]));
                    // Two rows reduce in five shuffles: the first level trades halves, so that lanes 0-15 then hold
                    // the first row's sums and lanes 16-31 the second's.
                    float v = sum[0];
                    if constexpr (kRowsPerWarp == 2) {
                        const bool upper = (lane & 16) != 0;
                        v = (upper ? sum[1] : sum[0]) + __shfl_xor_sync(kFull, upper ? sum[0] : sum[1], 16);
                    }
#pragma unroll
                    for (int o = kRowsPerWarp == 2 ? 8 : 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
                    float * row_part = part + part_off + (r - r0 + row) * kParts;
                    if (lane == 0) row_part[base / kWarpUnits] = v;
                    if (kRowsPerWarp == 2 && lane == 16 && row + 1 < n) row_part[1] = v;  // not the next segment's
                }
                __syncwarp();
                if (lane == 0) mbarrier_arrive(&empty[slot]);
            }
            part_off += (r1 - r0) * kParts;
        }
    }
    if (a.n_q8 < a.n_seg) {
        // F16 rows: 8 values a unit, every warp's units within one row (K >= 1024); their activations in f32.
        constexpr int kUnitsPerRow = K / 8, kPer = kSlotBytes / (2 * K), kParts = parts(2 * K);
        const int row = first_unit / kUnitsPerRow, base = first_unit % kUnitsPerRow;
        float x[kUnits][8];  // the lane's activations: unit j is columns 8 (base + 32 j + lane) + [0, 8)
        bool loaded = false;
        for (int s = a.n_q8; s < a.n_seg; ++s) {
            const int r0 = first_row(s, b), r1 = first_row(s, b + 1);
            for (int r = r0; r < r1; r += kPer, at.next(slots)) {
                const int slot = at.slot;
                mbarrier_wait(&full[slot], at.phase);
                if (row < min(kPer, r1 - r)) {
                    if (!loaded) {
                        loaded = true;
#pragma unroll
                        for (int j = 0; j < kUnits; ++j) {
                            const float4 * xv = reinterpret_cast<const float4 *>(a.x) + 2 * (base + 32 * j + lane);
                            const float4 lo = xv[0], hi = xv[1];
                            x[j][0] = lo.x, x[j][1] = lo.y, x[j][2] = lo.z, x[j][3] = lo.w;
                            x[j][4] = hi.x, x[j][5] = hi.y, x[j][6] = hi.z, x[j][7] = hi.w;
                        }
                    }
                    const int4 * w = slot_payload + slot * (kSlotBytes / 16) + first_unit + lane;
                    float v = 0.0f;
#pragma unroll
                    for (int j = 0; j < kUnits; ++j) {
                        float f[8];
                        unpack16<GgmlType::F16>(w[32 * j], f);
#pragma unroll
                        for (int e = 0; e < 8; ++e) v += f[e] * x[j][e];
                    }
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
                    if (lane == 0) part[part_off + (r - r0 + row) * kParts + base / kWarpUnits] = v;
                }
                __syncwarp();
                if (lane == 0) mbarrier_arrive(&empty[slot]);
            }
            part_off += (r1 - r0) * kParts;
        }
    }
    asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");  // the consumers' rows are all in part
    part_off = 0;
    for (int s = 0; s < a.n_seg; ++s) {
        const int r0 = first_row(s, b), r1 = first_row(s, b + 1), np = parts(s < a.n_q8 ? K : 2 * K);
        const RingSegment & g = a.seg[s];
        for (int i = int(threadIdx.x); i < r1 - r0; i += kConsumers) {
            float v = 0.0f;
            for (int q = 0; q < np; ++q) v += part[part_off + i * np + q];
            g.y[r0 + i] = g.add ? g.add[r0 + i] + v : v;
        }
        part_off += (r1 - r0) * np;
    }
#endif
}

// ---------------------------------------------------------------------------------------------------------------------
// A batch's large Q8_0 products through the ring, on the tensor cores (a batched decode step's tokens, up to 8)
// ---------------------------------------------------------------------------------------------------------------------
// The ring kernel above multiplies a slot by one token with dp4a; a batch of b tokens would issue b times its
// instructions, which at 4 tokens is more than the slot's bytes take to arrive. Here one warp takes a whole slot
// (`slots` warps compute at once and no partial sums cross warps) and multiplies it by all tokens with
// mma.sync.m16n8k32 (s8 × s8 → s32): 16 weight rows of the slot as M, the batch's tokens as N (zero columns past the
// batch), one Q8_0 block of 32 as K. Each result is then one block's exact integer dot product, scaled by the row's
// f16 and the token's f32 scale as the other kernels do (their sums run over half-blocks, so the values agree up to
// float rounding). Slot q's fills all go to warp q, which so sees each of the slot's phases in turn (a warp that
// skipped fills could find a slot two phases on, whose parity reads as done). The k positions a lane feeds are
// permuted alike in both operands (lane t's logical k 4t..4t+3 and 16+4t..16+4t+3 take the block's bytes 8t..8t+7),
// so each operand is one 8-byte load. The tokens' activation rows (codes and scales) are copied into shared memory
// once, after the wait for the kernel that wrote them: from L2 each block's loads would wait ~0.5 µs and a slot's
// warp would not keep up with its slot. Weight rows land in their slot at a stride of K + 32 bytes (one bulk copy a
// row) and token rows at their length + 32, so that the four rows of a load phase start in different banks.
namespace ring {

constexpr int kBatchRowPad = 32;
constexpr int kMaxBatchTokens = 8;
__host__ __device__ constexpr int batch_slot_bytes(int k) { return (kSlotBytes / k) * (k + kBatchRowPad); }
__host__ __device__ constexpr int batch_scales_at(int k, int slots) { return slots * batch_slot_bytes(k); }
__host__ __device__ constexpr int batch_barriers_at(int k, int slots) {
    return slots * (batch_slot_bytes(k) + kSlotScaleBytes);
}
__host__ __device__ constexpr int batch_acts_at(int k, int slots) {
    return batch_barriers_at(k, slots) + 2 * kMaxSlots * 8;
}
// A token's activation row in shared memory: act_row_bytes(q8a, K) and the pad.
__host__ __device__ constexpr int batch_act_stride(int k) { return int(act_row_bytes(Act::q8a, k)) + kBatchRowPad; }
__host__ __device__ constexpr int batch_smem(int k, int slots, int n) {
    return batch_acts_at(k, slots) + n * batch_act_stride(k);
}

}  // namespace ring

struct RingBatchArgs {
    RingSegment seg[kMaxTargets];   // Q8_0 products, one after another
    int64_t y_stride[kMaxTargets];  // floats between two tokens' rows of seg[i].y (and add)
    int n_seg;
    const uint8_t * xq;  // Q8A activation rows, one a token (act_row_bytes(q8a, K) apart)
    int n;               // tokens, 3..kMaxBatchTokens (ring_batch_applies)
    int slots;           // 1..ring::kMaxSlots
};

__device__ __forceinline__ void mma_s8(const uint32_t (&a)[4], const uint32_t (&b)[2], int (&d)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, "
        "%10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
}

template <int K>
__global__ void __launch_bounds__(ring::kThreads, 1) ring_batch_kernel(const RingBatchArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using namespace ring;
    constexpr int kPer = kSlotBytes / K, kStride = K + kBatchRowPad, kBlocks = K / 32, kActStride = batch_act_stride(K);
    constexpr int kActRow = int(act_row_bytes(Act::q8a, K));
    static_assert(kBlocks % 8 == 0, "scales are read 8 blocks at a time");
    extern __shared__ __align__(128) uint8_t smem_raw[];
    const int slots = a.slots;
    uint8_t * slot_payload = smem_raw;  // [slots][kPer][kStride]
    const uint16_t * slot_scales =
        reinterpret_cast<const uint16_t *>(smem_raw + batch_scales_at(K, slots));  // [slots][kPer][kBlocks]
    uint64_t * full = reinterpret_cast<uint64_t *>(smem_raw + batch_barriers_at(K, slots));
    uint64_t * empty = full + kMaxSlots;
    uint8_t * acts = smem_raw + batch_acts_at(K, slots);  // [n][kActStride]: codes (swizzled chunks), then scales
    const int b = int(blockIdx.x), blocks = int(gridDim.x);
    auto first_row = [&](int s, int block) { return int(int64_t(a.seg[s].rows) * block / blocks); };
    if (threadIdx.x == 0) {
        mbarriers_init(full, slots);
        mbarriers_init(empty, slots, 1);  // the slot's one warp
    }
    __syncthreads();
    if (threadIdx.x >= kConsumers) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        if (threadIdx.x != kConsumers) return;
        RingPlace at;
        for (int s = 0; s < a.n_seg; ++s) {
            const int r1 = first_row(s, b + 1);
            for (int r = first_row(s, b); r < r1; r += kPer, at.next(slots)) {
                if (at.reused) mbarrier_wait(&empty[at.slot], at.phase ^ 1u);
                const int n = min(kPer, r1 - r);
                mbarrier_expect_bytes(&full[at.slot], uint32_t(n * K + n * (K / 16)));
                for (int i = 0; i < n; ++i)
                    bulk_copy(slot_payload + at.slot * batch_slot_bytes(K) + i * kStride,
                              a.seg[s].payload + size_t(r + i) * K, K, &full[at.slot]);
                bulk_copy(const_cast<uint16_t *>(slot_scales) + at.slot * (kSlotScaleBytes / 2),
                          a.seg[s].scales + size_t(r) * kBlocks, uint32_t(n * (K / 16)), &full[at.slot]);
            }
        }
        return;
    }
    // The consumers copy the tokens' rows in (16-byte units), then all but `slots` warps leave.
    pdl_begin();
    for (int i = int(threadIdx.x); i < a.n * (kActRow / 16); i += kConsumers) {
        const int tok = i / (kActRow / 16), u = i % (kActRow / 16);
        *reinterpret_cast<int4 *>(acts + tok * kActStride + 16 * u) =
            __ldg(reinterpret_cast<const int4 *>(a.xq + int64_t(tok) * kActRow) + u);
    }
    asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
    const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31, g = lane >> 2, t = lane & 3;
    if (warp >= slots) return;
    // B: the lane's token g (zero past the batch); C: tokens 2t and 2t + 1.
    const uint8_t * xcode = g < a.n ? acts + g * kActStride : nullptr;
    const float * xs0 = 2 * t < a.n ? reinterpret_cast<const float *>(acts + 2 * t * kActStride + K) : nullptr;
    const float * xs1 =
        2 * t + 1 < a.n ? reinterpret_cast<const float *>(acts + (2 * t + 1) * kActStride + K) : nullptr;
    int fill = 0;  // the block's fills so far, in the producer's order
    for (int s = 0; s < a.n_seg; ++s) {
        const RingSegment & seg = a.seg[s];
        const int r0 = first_row(s, b), r1 = first_row(s, b + 1);
        for (int r = r0; r < r1; r += kPer, ++fill) {
            if (fill % slots != warp) continue;
            const int slot = fill % slots, n_rows = min(kPer, r1 - r);
            mbarrier_wait(&full[slot], uint32_t(fill / slots) & 1u);
            const uint8_t * rows = slot_payload + slot * batch_slot_bytes(K);
            const uint16_t * scales = slot_scales + slot * (kSlotScaleBytes / 2);
            for (int m0 = 0; m0 < n_rows; m0 += 16) {
                const int ra = m0 + g, rb = m0 + g + 8;  // the lane's A rows (slot rows)
                const bool va = ra < n_rows, vb = rb < n_rows;
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int kb0 = 0; kb0 < kBlocks; kb0 += 8) {
                    uint4 wa = make_uint4(0, 0, 0, 0), wb = make_uint4(0, 0, 0, 0);
                    if (va) wa = *reinterpret_cast<const uint4 *>(scales + ra * kBlocks + kb0);
                    if (vb) wb = *reinterpret_cast<const uint4 *>(scales + rb * kBlocks + kb0);
                    float x0[8] = {}, x1[8] = {};
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        if (xs0) x0[j] = xs0[kb0 + j];
                        if (xs1) x1[j] = xs1[kb0 + j];
                    }
                    const uint32_t wsa[4] = {wa.x, wa.y, wa.z, wa.w}, wsb[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const int kb = kb0 + j;
                        uint2 lo_a = make_uint2(0, 0), lo_b = make_uint2(0, 0), bx = make_uint2(0, 0);
                        if (va) lo_a = *reinterpret_cast<const uint2 *>(rows + ra * kStride + kb * 32 + 8 * t);
                        if (vb) lo_b = *reinterpret_cast<const uint2 *>(rows + rb * kStride + kb * 32 + 8 * t);
                        if (xcode)
                            bx = *reinterpret_cast<const uint2 *>(xcode + 16 * swz(2 * kb + (t >> 1)) + 8 * (t & 1));
                        const uint32_t am[4] = {lo_a.x, lo_b.x, lo_a.y, lo_b.y}, bm[2] = {bx.x, bx.y};
                        int d[4];
                        mma_s8(am, bm, d);
                        const float sa = f16_bits_to_f32(uint16_t(wsa[j / 2] >> (16 * (j & 1)))),
                                    sb = f16_bits_to_f32(uint16_t(wsb[j / 2] >> (16 * (j & 1))));
                        acc[0] += float(d[0]) * (x0[j] * sa);
                        acc[1] += float(d[1]) * (x1[j] * sa);
                        acc[2] += float(d[2]) * (x0[j] * sb);
                        acc[3] += float(d[3]) * (x1[j] * sb);
                    }
                }
                // C: rows ra (acc 0, 1) and rb (acc 2, 3) of tokens 2t and 2t + 1.
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = i < 2 ? ra : rb, tok = 2 * t + (i & 1);
                    if ((i < 2 ? va : vb) && tok < a.n) {
                        const int64_t at_y = tok * a.y_stride[s] + (r + row);
                        seg.y[at_y] = seg.add ? seg.add[at_y] + acc[i] : acc[i];
                    }
                }
            }
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&empty[slot]);
        }
    }
#endif
}

// A count from the environment variable `name`: `fallback` when it is unset, not a number or outside [1, most].
int64_t env_count(const char * name, int64_t fallback, int64_t most) {
    const char * e = std::getenv(name);
    const int64_t v = e ? std::atoll(e) : 0;
    return v >= 1 && v <= most ? v : fallback;
}

// Slots of the ring: DSV4_CUDA_RING_SLOTS (1 to 6, default 6).
int ring_slots() {
    static const int slots = int(env_count("DSV4_CUDA_RING_SLOTS", ring::kMaxSlots, ring::kMaxSlots));
    return slots;
}

// Bytes of weights a launch must stream to take the ring: DSV4_CUDA_RING_MIN_MB (default 16). Smaller launches keep
// matvec_kernel, whose blocks fit beside the kernels around them.
int64_t ring_min_bytes() {
    static const int64_t bytes = env_count("DSV4_CUDA_RING_MIN_MB", 16, INT64_MAX >> 20) << 20;
    return bytes;
}

// The ring kernel's dynamic shared memory for the targets' rows split over `blocks`.
size_t ring_smem(const MatvecArgs & a, int blocks, int slots) {
    const int64_t k = a.t[0].w.ne0;
    int64_t floats = 0;
    for (int i = 0; i < a.n_targets; ++i) {
        const int64_t rows = a.t[i].rows * a.groups;
        floats += ((rows + blocks - 1) / blocks) * ring::parts(int(a.t[i].w.type == GgmlType::Q8_0 ? k : 2 * k));
    }
    return size_t(ring::part_at(slots)) + size_t(floats) * sizeof(float);
}

// Whether the device runs ring_matvec_kernel at all: sm_90 or later with room for its slots (not sm_120/121's 99 KB).
bool ring_device() {
    return device_attribute<cudaDevAttrComputeCapabilityMajor>(0, 0) >= 9 &&
           size_t(ring::part_at(ring_slots())) <= device_smem_optin();
}

// The K the ring kernels are instantiated for (with_ring_k).
bool ring_k(int64_t k) { return k == 1024 || k == 2048 || k == 4096 || k == 8192; }

// Whether a launch runs on ring_matvec_kernel: one token, Q8_0 and F16 targets of at least ring_min_bytes together,
// K of 1024 to 8192, Q8_0's activations quantized and F16's in f32 (no fused swiglu) and 16-byte aligned; one Q8_0
// target when grouped (not at K = 1024: a warp's two rows must share a group); on sm_90 or later with the carveout,
// where the caller allows it (MatvecArgs::ring).
bool ring_applies(const MatvecArgs & a, int64_t max_tiles) {
    if (!a.ring || max_tiles != 1 || a.n != 1 || a.tiles || a.pair_experts || a.glu) return false;
    const int64_t k = a.t[0].w.ne0;
    if (!ring_k(k) || (a.groups != 1 && (a.n_targets != 1 || k == 1024))) return false;
    auto aligned = [](const void * p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    int64_t bytes = 0;
    for (int i = 0; i < a.n_targets; ++i) {
        const MatvecTarget & t = a.t[i];
        const int64_t rows = t.rows * a.groups;
        if (t.w.ne0 != k || rows > INT_MAX) return false;
        if (t.w.type == GgmlType::Q8_0) {
            if (!a.xq[0]) return false;
            bytes += rows * k;
        } else if (t.w.type == GgmlType::F16) {
            if (a.groups != 1 || !a.x || a.x_up || !aligned(a.x) || !aligned(t.w.data)) return false;
            bytes += rows * k * 2;
        } else {
            return false;
        }
    }
    return bytes >= ring_min_bytes() && ring_device() &&
           ring_smem(a, device_sms(), ring_slots()) <= device_smem_optin();
}

// Calls f with std::integral_constant<int, K> for a K that ring_k admits.
template <typename F>
void with_ring_k(int64_t k, F && f) {
    switch (k) {
        case 1024:
            return f(std::integral_constant<int, 1024>{});
        case 2048:
            return f(std::integral_constant<int, 2048>{});
        case 4096:
            return f(std::integral_constant<int, 4096>{});
        default:
            return f(std::integral_constant<int, 8192>{});
    }
}

void ring_matvec(const MatvecArgs & a, cudaStream_t s) {
    const int64_t k = a.t[0].w.ne0;
    RingArgs r{};
    for (const bool q8 : {true, false})
        for (int i = 0; i < a.n_targets; ++i) {
            const MatvecTarget & t = a.t[i];
            if ((t.w.type == GgmlType::Q8_0) != q8) continue;
            r.seg[r.n_seg++] = {t.w.data,
                                q8 ? reinterpret_cast<const uint16_t *>(t.w.data + t.w.n_blocks * 32) : nullptr, t.y,
                                t.add, int(t.rows * a.groups)};
            r.n_q8 += q8;
        }
    r.xq = a.xq[0];
    r.x = a.x;
    r.group_rows = a.groups > 1 ? int(a.t[0].rows) : 0;
    r.slots = ring_slots();
    const int blocks = device_sms();
    const size_t smem = ring_smem(a, blocks, r.slots);
    const dim3 grid{unsigned(blocks)}, block{unsigned(ring::kThreads)};
    with_ring_k(k, [&](auto kc) { launch(ring_matvec_kernel<kc()>, grid, block, smem, s, r); });
}

// The batch ring's slots for n tokens of K: as many as ring_slots() allows that fit beside the tokens' rows (0: none).
int ring_batch_slots(int64_t k, int64_t n) {
    for (int slots = ring_slots(); slots >= 1; --slots)
        if (size_t(ring::batch_smem(int(k), slots, int(n))) <= device_smem_optin()) return slots;
    return 0;
}

// Whether a launch runs on ring_batch_kernel: 3 and 5 to 8 tokens, Q8_0 targets only (F16 rows would need each
// token's f32 activations beside them) and no groups (o_a's eight groups' activation rows would not fit beside the
// slots), at least ring_min_bytes together, where the caller allows the ring and DSV4_CUDA_RING_BATCH is not 0.
// 2 and 4 tokens stay on the tiles, which hold them in one tile of their width: the batched steps of an 8-layer
// q2 file (H100, docs/perf-data/h100-s61.txt) ran 5 % slower at 2 streams on the ring and 1 % slower at 4, and
// 5-10 % faster at 3 and 5 to 8.
bool ring_batch_applies(const MatvecArgs & a) {
    static const bool enabled = env_switch("DSV4_CUDA_RING_BATCH", true);
    if (!enabled || !a.ring || a.n < 3 || a.n == 4 || a.n > ring::kMaxBatchTokens || a.tiles || a.pair_experts ||
        a.glu || !a.xq[0] || a.groups != 1)
        return false;
    const int64_t k = a.t[0].w.ne0;
    if (!ring_k(k)) return false;
    int64_t bytes = 0;
    for (int i = 0; i < a.n_targets; ++i) {
        const MatvecTarget & t = a.t[i];
        if (t.w.ne0 != k || t.rows > INT_MAX || t.w.type != GgmlType::Q8_0) return false;
        bytes += t.rows * k;
    }
    return bytes >= ring_min_bytes() && ring_device() && ring_batch_slots(k, a.n) > 0;
}

void ring_batch_matvec(const MatvecArgs & a, cudaStream_t s) {
    const int64_t k = a.t[0].w.ne0;
    RingBatchArgs r{};
    for (int i = 0; i < a.n_targets; ++i) {
        const MatvecTarget & t = a.t[i];
        r.seg[r.n_seg] = {t.w.data, reinterpret_cast<const uint16_t *>(t.w.data + t.w.n_blocks * 32), t.y, t.add,
                          int(t.rows)};
        r.y_stride[r.n_seg++] = t.y_stride;
    }
    r.xq = a.xq[0];
    r.n = int(a.n);
    r.slots = ring_batch_slots(k, a.n);
    const size_t smem = size_t(ring::batch_smem(int(k), r.slots, r.n));
    const dim3 grid{unsigned(device_sms())}, block{unsigned(ring::kThreads)};
    with_ring_k(k, [&](auto kc) { launch(ring_batch_kernel<kc()>, grid, block, smem, s, r); });
}

// A decode step's IQ2_XXS routed gate/up products and the shared expert's Q8_0 down projection in one launch
// (moe_shared), for each of shared.n tokens. Grid rows [0, shared.n) run token y's shared rows; row y >= shared.n
// runs routed pair y - shared.n as matvec_kernel would (pair p of token p / k). A shared block quantizes its token's
// swiglu(gate, up) into shared memory itself (2 KB of codes for V4's 2048-wide rows), so its input needs no launch
// of its own either; the tokens' shared rows read one matrix, whose bytes the blocks of the later tokens find in L2.
// At most 64 registers, as the routed product's own kernel: the two bodies together took 74, which left 3 blocks
// per multiprocessor instead of 4 and the routed pairs a third round.
__global__ void __launch_bounds__(kThreads, 4) moe_shared_kernel(const MatvecArgs routed, const MatvecArgs shared) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int bx = int(blockIdx.x), n_shared = int(shared.n);
    if (int(blockIdx.y) < n_shared) {
        const int token = int(blockIdx.y);
        const MatvecTarget & t = shared.t[0];
        if (bx >= t.blocks) return;
        const int64_t rows_per_block = int64_t(kWarps / shared.split) * kRowsPerWarp,
                      row0 = int64_t(bx) * rows_per_block;
        if (row0 < t.rows) prefetch_weight_rows(t.w, row0, min(rows_per_block, t.rows - row0));
        pdl_begin();
        const int k = int(t.w.ne0);
        const int64_t off = int64_t(token) * shared.x_stride;
        const ActSource src{shared.x + off, shared.x_up + off, shared.x_limit};
        for (int b = int(threadIdx.x >> 5); b < k / 32; b += kWarps) quantize_block_q8a(src, b, k, smem);
        __syncthreads();
        Tile<1> tile;
        tile.n_tok = 1;
        tile.src[0] = 0;  // the block's activation row is the only one at smem
        tile.dst[0] = token;
        quant_rows<Q8_0Unit, 1, false>(shared, t, tile, bx, smem, smem);
        return;
    }
    const MatvecTarget & t = routed.t[0];
    if (bx >= t.blocks) return;
    pdl_begin();
    Tile<1> tile;
    if (!load_tile(routed, t, tile, int(blockIdx.y) - n_shared)) return;
    quant_rows<Iq2XxsUnit, 1, true>(routed, t, tile, bx, smem, routed.xq[int(Act::q8k)]);
}

// A decode step's Q2_K routed down products (moe_ffn), each block quantizing its pair's hidden row (Q8_K, 8 blocks of
// 256 for V4's 2048-wide rows, a warp each) into shared memory first: no quantize launch between gate/up and down.
// Its blocks pull their expert's rows into L2 before the wait (moe_shared before it leaves about two thirds of the
// DRAM bandwidth idle): the router, two launches back, has usually written the expert ids by the time moe_down starts.
// When it has not (pdl_begin lets a chain start early), the ids read are the previous step's: a prefetch of rows
// that are not needed, never a wrong result (the ids are range-checked here and read again after the wait).
__global__ void __launch_bounds__(kThreads) moe_down_kernel(const MatvecArgs a) {
    extern __shared__ __align__(16) uint8_t smem[];
    const MatvecTarget & t = a.t[0];
    const int e = __ldcg(a.pair_experts + blockIdx.y);
    if (e >= 0 && e < a.n_expert) {
        const int64_t per_block = int64_t(kWarps / a.split) * kRowsPerWarp;
        for (int64_t rb = blockIdx.x; rb * per_block < t.rows; rb += t.blocks)
            prefetch_weight_rows(t.w, int64_t(e) * t.rows + rb * per_block, min(per_block, t.rows - rb * per_block));
    }
    pdl_begin();
    Tile<1> tile;
    if (!load_tile(a, t, tile, int(blockIdx.y))) return;
    const int k = int(t.w.ne0);
    const ActSource src{a.x + tile.src[0] * a.x_stride, nullptr, 0.0f};
    for (int b = int(threadIdx.x >> 5); b < k / 256; b += kWarps) quantize_block_q8k(src, b, k, smem);
    tile.src[0] = 0;  // the block's activation row is now the first (only) one at smem
    __syncthreads();
    quant_rows<Q2_KUnit, 1, false>(a, t, tile, int(blockIdx.x), smem, smem);
}

// ---------------------------------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------------------------------
bool is_float(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

Act act_of(GgmlType t) { return t == GgmlType::Q8_0 || t == GgmlType::MXFP4 ? Act::q8a : Act::q8k; }

// Dynamic shared memory of a block that multiplies weights of type t: the activation tile of several tokens.
size_t quant_smem(GgmlType t, int nt, int64_t k) {
    if (is_float(t)) return 0;
    return nt > 1 ? act_smem_bytes(act_of(t), nt, k) : 0;
}

// Row groups of a target of `rows` rows: a block's warps take kRowsPerWarp rows each, split warps sharing one.
int64_t row_blocks(int64_t rows, int split) {
    const int64_t per_block = int64_t(kWarps / split) * kRowsPerWarp;
    return (rows + per_block - 1) / per_block;
}

// Blocks per multiprocessor of a kernel (registers and shared memory), asked once per kernel and process (its GPUs
// are of one kind; a kernel's shared memory is fixed by the model's widths).
template <auto Kernel>
int blocks_per_sm(size_t smem) {
    static const int per_sm = [&] {
        int b = 0;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, kThreads, smem);
        return std::max(b, 1);
    }();
    return per_sm;
}

// A decode step's experts (a block per row group and (token, expert) pair, one target) run in one wave: t.blocks
// (grid x) is set so that each block loops over the fewest row groups that let all of them, and `reserved` other
// blocks of the launch, be resident at once. (Row blocks capped at 8 per multiprocessor left the IQ2_XXS gate/up at
// 1.45 waves and the Q2_K down at 2.7; one wave of two and four row groups a block took the 8-layer file from 491
// to 501-506 tok/s.)
void size_pairs(MatvecTarget & t, int split, int64_t pairs, int per_sm, int64_t reserved) {
    const int64_t resident = std::max<int64_t>(int64_t(per_sm) * device_sms() - reserved, pairs);
    const int64_t groups = row_blocks(t.rows, split);
    int64_t rounds = 1;
    while (rounds < groups && (groups + rounds - 1) / rounds * pairs > resident) ++rounds;
    t.blocks = int((groups + rounds - 1) / rounds);
}

template <int NT, bool GLU, class... Us>
void launch_kernel(MatvecArgs a, dim3 grid, size_t smem, cudaStream_t s) {
    constexpr auto kernel = matvec_kernel<NT, GLU, Us...>;
    if (a.pair_experts) {
        size_pairs(a.t[0], a.split, grid.y, blocks_per_sm<kernel>(smem), 0);
        grid.x = unsigned(a.t[0].blocks);
    }
    launch(kernel, grid, dim3(kThreads), smem, s, a);
}

using F16Vec = FloatUnit<GgmlType::F16, true>;

template <int NT, bool GLU>
void launch_type(const MatvecArgs & a, GgmlType type, bool vec, bool mixed, dim3 grid, size_t smem, cudaStream_t s) {
    if constexpr (!GLU)
        if (mixed) return launch_kernel<NT, false, Q8_0Unit, F16Vec>(a, grid, smem, s);
    switch (type) {
        case GgmlType::Q8_0:
            return launch_kernel<NT, GLU, Q8_0Unit>(a, grid, smem, s);
        case GgmlType::MXFP4:
            return launch_kernel<NT, GLU, Mxfp4Unit>(a, grid, smem, s);
        case GgmlType::IQ2_XXS:
            return launch_kernel<NT, GLU, Iq2XxsUnit>(a, grid, smem, s);
        case GgmlType::Q2_K:
            return launch_kernel<NT, GLU, Q2_KUnit>(a, grid, smem, s);
        case GgmlType::Q4_K:
            return launch_kernel<NT, GLU, Q4_KUnit>(a, grid, smem, s);
        case GgmlType::F32:
            return vec ? launch_kernel<NT, GLU, FloatUnit<GgmlType::F32, true>>(a, grid, smem, s)
                       : launch_kernel<NT, GLU, FloatUnit<GgmlType::F32, false>>(a, grid, smem, s);
        case GgmlType::F16:
            return vec ? launch_kernel<NT, GLU, F16Vec>(a, grid, smem, s)
                       : launch_kernel<NT, GLU, FloatUnit<GgmlType::F16, false>>(a, grid, smem, s);
        case GgmlType::BF16:
            return vec ? launch_kernel<NT, GLU, FloatUnit<GgmlType::BF16, true>>(a, grid, smem, s)
                       : launch_kernel<NT, GLU, FloatUnit<GgmlType::BF16, false>>(a, grid, smem, s);
        default:
            return;
    }
}

template <int NT>
void launch_nt(const MatvecArgs & a, GgmlType type, bool vec, bool mixed, dim3 grid, size_t smem, cudaStream_t s) {
    if (a.glu)
        launch_type<NT, true>(a, type, vec, mixed, grid, smem, s);
    else
        launch_type<NT, false>(a, type, vec, mixed, grid, smem, s);
}

// Float targets load 16 bytes at once when rows, activation rows and group offsets keep 16-byte alignment.
bool float_vec_ok(const MatvecArgs & a, const MatvecTarget & t) {
    const int64_t k = t.w.ne0;
    const int esz = t.w.type == GgmlType::F32 ? 4 : 2;
    auto aligned = [](const void * p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    return k % (16 / esz) == 0 && k % 4 == 0 && a.x_stride % 4 == 0 && aligned(a.x) && (!a.x_up || aligned(a.x_up)) &&
           aligned(t.w.data) && (!a.glu || aligned(t.w_up.data));
}

// Weight units a row has (a lane loads one per step): 16 bytes of payload, or one value for unaligned floats.
int64_t row_units(GgmlType type, int64_t k, bool vec) {
    switch (type) {
        case GgmlType::Q8_0:
            return k / Q8_0Unit::kUnitElems;
        case GgmlType::MXFP4:
            return k / Mxfp4Unit::kUnitElems;
        case GgmlType::IQ2_XXS:
            return k / Iq2XxsUnit::kUnitElems;
        case GgmlType::Q2_K:
            return k / Q2_KUnit::kUnitElems;
        case GgmlType::Q4_K:
            return k / Q4_KUnit::kUnitElems;
        default:
            return vec ? k * (type == GgmlType::F32 ? 4 : 2) / 16 : k;
    }
}

// Warps that share a row group, each over a slice of K (split), where a one-token launch would otherwise wait for
// its longest rows: until a lane has at most two batches of unrolled steps (8 quantized units, 4 float ones).
// A decode launch is one wave, so its time is its slowest warp's chain of loads, and a float row of 4096 (the
// router, the compressors) has four times a Q8_0 row's steps. One split serves the whole launch (a split per
// target cost the kernels registers: the IQ2_XXS gate/up went from 64 to 100 and lost half its blocks per
// multiprocessor). Then, for few rows (small projections at decode), the split grows until the launch has
// about two blocks per multiprocessor.
int launch_split(const MatvecArgs & a, bool vec, int64_t max_tiles, int nt) {
    auto total_blocks = [&](int split) {
        int64_t b = 0;
        for (int i = 0; i < a.n_targets; ++i) b += row_blocks(a.t[i].rows, split);
        return b;
    };
    int split = 1;
    for (int i = 0; i < a.n_targets && nt == 1; ++i) {
        const int64_t units = row_units(a.t[i].w.type, a.t[i].w.ne0, vec), most = is_float(a.t[i].w.type) ? 4 : 8;
        while (split < kWarps && units > most * 32 * split) split *= 2;
    }
    while (split < kWarps && total_blocks(split) * max_tiles * a.groups < 2 * device_sms()) split *= 2;
    return split;
}

// One launch over a.t[0, n_targets) (one weight type, or the Q8_0 + F16 mix).
void launch_set(MatvecArgs a, int64_t max_tiles, int nt, bool mixed, cudaStream_t s) {
    const int64_t sms = device_sms();
    bool vec = true;
    for (int i = 0; i < a.n_targets; ++i)
        if (is_float(a.t[i].w.type)) vec = vec && float_vec_ok(a, a.t[i]);
    a.split = launch_split(a, vec, max_tiles, nt);
    // Enough blocks to fill the GPU a few times over; each block loops over its rows, so a tile of several tokens
    // is copied to shared memory once for many rows.
    const int64_t per_tile = std::max<int64_t>(1, sms * 8 / (max_tiles * a.groups));
    int first = 0;
    size_t smem = 0;
    for (int i = 0; i < a.n_targets; ++i) {
        MatvecTarget & t = a.t[i];
        t.first_block = first;
        t.blocks = int(std::max<int64_t>(1, std::min(row_blocks(t.rows, a.split), per_tile)));
        first += t.blocks;
        if (!is_float(t.w.type)) smem = std::max(smem, quant_smem(t.w.type, nt, t.w.ne0));
    }
    const GgmlType type = a.t[0].w.type;
    const dim3 grid(unsigned(first), unsigned(max_tiles), unsigned(a.groups));
    static_assert(kMaxTileTokens == 4, "tiles of 1, 2 and 4 tokens are instantiated below");
    switch (nt) {
        case 1:
            return launch_nt<1>(a, type, vec, mixed, grid, smem, s);
        case 2:
            return launch_nt<2>(a, type, vec, mixed, grid, smem, s);
        default:
            return launch_nt<4>(a, type, vec, mixed, grid, smem, s);
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// MoE plumbing
// ---------------------------------------------------------------------------------------------------------------------
// Exclusive scan of v[0, n) in place by one warp (n is the expert count: hundreds); returns the total.
__device__ int warp_exclusive_scan(int * v, int n) {
    const int lane = threadIdx.x & 31;
    const int per = (n + 31) / 32;
    const int b = min(n, lane * per), e = min(n, b + per);
    int local = 0;
    for (int i = b; i < e; ++i) local += v[i];
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += t;
    }
    int run = incl - local;
    for (int i = b; i < e; ++i) {
        const int c = v[i];
        v[i] = run;
        run += c;
    }
    return __shfl_sync(kFull, incl, 31);
}

__global__ void moe_plan_kernel(const int32_t * experts, int n_pairs, int n_expert, int nt, int32_t * pairs,
                                int32_t * tiles, int32_t * n_tiles) {
    pdl_begin();
    extern __shared__ int sm[];
    int * cnt = sm;                  // [E] pairs per expert
    int * off = sm + n_expert;       // [E] first sorted slot
    int * toff = sm + 2 * n_expert;  // [E] first tile
    int * cur = sm + 3 * n_expert;   // [E] fill cursor
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) cnt[e] = cur[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int e = experts[p];
        if (e >= 0 && e < n_expert) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        for (int e = threadIdx.x; e < n_expert; e += 32) {
            off[e] = cnt[e];
            toff[e] = (cnt[e] + nt - 1) / nt;
        }
        __syncwarp();
        warp_exclusive_scan(off, n_expert);
        const int total_tiles = warp_exclusive_scan(toff, n_expert);
        if (threadIdx.x == 0) *n_tiles = total_tiles;
    }
    __syncthreads();
    // Order inside an expert follows the atomics; every pair's result is computed alone, so it does not matter.
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int e = experts[p];
        if (e >= 0 && e < n_expert) pairs[off[e] + atomicAdd(&cur[e], 1)] = p;
    }
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x)
        for (int i = 0; i * nt < cnt[e]; ++i) {
            int32_t * t = tiles + 3 * (toff[e] + i);
            t[0] = e;
            t[1] = off[e] + i * nt;
            t[2] = min(nt, cnt[e] - i * nt);
        }
}

__global__ void moe_combine_kernel(const float * ybuf, const int32_t * row_of, const int32_t * experts,
                                   const float * weights, int64_t n, int k, int n_expert, int64_t width,
                                   const float * add, float * out) {
    pdl_begin();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n * width) return;
    const int64_t t = i / width, c = i % width;
    // kBatch choices' rows loaded together (a loop waited for each: its loads hung on the expert id's test), then
    // added in choice order.
    constexpr int kBatch = 8;
    float s = 0.0f;
    for (int j0 = 0; j0 < k; j0 += kBatch) {
        float w[kBatch], y[kBatch];
        bool used[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
            const int e = j0 + j < k ? experts[t * k + j0 + j] : -1;
            used[j] = e >= 0 && e < n_expert;
            w[j] = used[j] ? weights[t * k + j0 + j] : 0.0f;
            const int64_t pair = t * k + j0 + j;
            y[j] = used[j] ? ybuf[(row_of ? row_of[pair] : pair) * width + c] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j)
            if (used[j]) s += w[j] * y[j];
    }
    out[i] = add ? s + add[i] : s;
}

// A block's threads share a row (one division a row, not a group of 8).
__global__ void moe_gather_f16_kernel(const float * x, int width, const int32_t * pairs, int src_div,
                                      const int32_t * experts, const int32_t * row_base, int n_rows, half * dst,
                                      int32_t * row_of) {
    pdl_begin();
    for (int j = blockIdx.x; j < n_rows; j += gridDim.x) {
        const int32_t pair = pairs[j], row = j + row_base[experts[pair]];
        if (threadIdx.x == 0) row_of[pair] = row;
        const float * src = x + int64_t(pair / src_div) * width;
        for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
            const float4 x0 = *reinterpret_cast<const float4 *>(src + c);
            const float4 x1 = *reinterpret_cast<const float4 *>(src + c + 4);
            store_f16x8(dst + int64_t(row) * width + c, x0, x1);
        }
    }
}

}  // namespace

bool matvec_needs_quantized(GgmlType w) { return !is_float(w); }

int matvec_act_kind(GgmlType w) { return int(act_of(w)); }

int64_t matvec_act_bytes(GgmlType w, int64_t k, int64_t rows) {
    return is_float(w) ? 0 : rows * act_row_bytes(act_of(w), k);
}

void matvec_quantize(const QuantizeJob * jobs, int n_jobs, cudaStream_t s) {
    QuantizeLaunch q{};
    int64_t warps = 0;
    for (int i = 0; i < n_jobs; ++i) {
        const QuantizeJob & j = jobs[i];
        if (is_float(j.w) || j.n <= 0) continue;
        if (q.n_jobs == kMaxQuantizeJobs) {  // a full launch: the rest in the next one
            matvec_quantize(jobs + i, n_jobs - i, s);
            break;
        }
        q.job[q.n_jobs] = j;
        q.act[q.n_jobs] = act_of(j.w);
        q.first[q.n_jobs] = warps;
        warps += j.n * j.groups * (act_of(j.w) == Act::q8a ? j.k / 32 : j.k / 256);
        ++q.n_jobs;
    }
    if (q.n_jobs == 0) return;
    // A multiprocessor changes its split of L1 and shared memory only while idle (session 53's probe), so the first
    // block it takes sets it. In a decode step this kernel runs right before each ring launch: left to the default,
    // its blocks set the multiprocessors they start on to little shared memory, and a ring block (~210 KB) waits
    // there until they leave. Preferring the largest carveout lets the ring's copies start beside them (session 54:
    // 1-2 us a layer). Where no ring runs, the products after it keep their L1.
    if (ring_device())
        cudaFuncSetAttribute(quantize_rows_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
    launch(quantize_rows_kernel, dim3(unsigned((warps + kWarps - 1) / kWarps)), dim3(kThreads), 0, s, q);
}

int matvec_tile_tokens(GgmlType w, int64_t k, int64_t n) {
    int nt = n >= 4 ? 4 : n >= 2 ? 2 : 1;
    if (!is_float(w))
        while (nt > 1 && quant_smem(w, nt, k) > std::min(kMaxActSmem, device_smem_optin() - 4096)) nt /= 2;
    return nt;
}

void matvec(const MatvecArgs & args, int64_t max_tiles, int nt, cudaStream_t s) {
    if (max_tiles <= 0 || args.n_targets <= 0) return;
    if (ring_applies(args, max_tiles)) return ring_matvec(args, s);
    if (ring_batch_applies(args)) return ring_batch_matvec(args, s);
    // One launch when every target has one type, or for the quantized files' Q8_0 + F16 mix (float rows then
    // need 16-byte loads); otherwise one launch per type.
    bool one_type = true, mix = !args.glu, has_q8 = false, has_f16 = false;
    for (int i = 0; i < args.n_targets; ++i) {
        const GgmlType t = args.t[i].w.type;
        one_type = one_type && t == args.t[0].w.type;
        has_q8 = has_q8 || t == GgmlType::Q8_0;
        has_f16 = has_f16 || t == GgmlType::F16;
        mix = mix && (t == GgmlType::Q8_0 || (t == GgmlType::F16 && float_vec_ok(args, args.t[i])));
    }
    if (one_type) return launch_set(args, max_tiles, nt, false, s);
    if (mix && has_q8 && has_f16) return launch_set(args, max_tiles, nt, true, s);
    for_each_weight_type(args, [&](const MatvecArgs & sub) { launch_set(sub, max_tiles, nt, false, s); });
}

bool moe_ffn_fused_supported(GgmlType gate, GgmlType down, GgmlType shared_down, int64_t inner, int64_t shared_inner) {
    return gate == GgmlType::IQ2_XXS && down == GgmlType::Q2_K && shared_down == GgmlType::Q8_0 && inner % 256 == 0 &&
           shared_inner % 32 == 0 && act_row_bytes(Act::q8k, inner) <= 48 * 1024 &&
           act_row_bytes(Act::q8a, shared_inner) <= 48 * 1024;
}

// Every block resident at once, as launch_kernel sizes a decode step's experts.
void moe_shared(MatvecArgs routed, int pairs, MatvecArgs shared, cudaStream_t s) {
    const size_t smem = size_t(act_row_bytes(Act::q8a, shared.t[0].w.ne0));
    // Each part splits its rows as its own launch would (so its sums are the same); the shared rows take about one
    // block per multiprocessor over all tokens (each loops over its row groups; 66 ran as fast as 132 for one token,
    // 33 made them the launch's tail), the routed pairs the fewest rounds of row groups that fit beside them.
    routed.split = launch_split(routed, true, pairs, 1);
    shared.split = launch_split(shared, true, 1, 1);
    const int64_t per_token = (device_sms() + shared.n - 1) / shared.n;
    shared.t[0].blocks = int(std::min<int64_t>(row_blocks(shared.t[0].rows, shared.split), per_token));
    size_pairs(routed.t[0], routed.split, pairs, blocks_per_sm<moe_shared_kernel>(smem), shared.t[0].blocks * shared.n);
    const dim3 grid(unsigned(std::max(routed.t[0].blocks, shared.t[0].blocks)), unsigned(pairs + shared.n));
    launch(moe_shared_kernel, grid, dim3(kThreads), smem, s, routed, shared);
}

void moe_down(MatvecArgs a, int pairs, cudaStream_t s) {
    const size_t smem = size_t(act_row_bytes(Act::q8k, a.t[0].w.ne0));
    a.split = launch_split(a, true, pairs, 1);
    size_pairs(a.t[0], a.split, pairs, blocks_per_sm<moe_down_kernel>(smem), 0);
    launch(moe_down_kernel, dim3(unsigned(a.t[0].blocks), unsigned(pairs)), dim3(kThreads), smem, s, a);
}

void moe_plan(const int32_t * experts, int64_t n_pairs, int64_t n_expert, int tile_tokens, int32_t * pairs,
              int32_t * tiles, int32_t * n_tiles, cudaStream_t s) {
    const size_t smem = size_t(4 * n_expert) * sizeof(int);
    launch(moe_plan_kernel, dim3(1), dim3(1024), smem, s, experts, int(n_pairs), int(n_expert), tile_tokens, pairs,
           tiles, n_tiles);
}

void moe_combine(const float * ybuf, const int32_t * row_of, const int32_t * experts, const float * weights, int64_t n,
                 int64_t k, int64_t n_expert, int64_t width, const float * add, float * out, cudaStream_t s) {
    const int64_t total = n * width;
    launch(moe_combine_kernel, dim3(unsigned((total + 255) / 256)), dim3(256), 0, s, ybuf, row_of, experts, weights, n,
           int(k), int(n_expert), width, add, out);
}

void moe_gather_f16(const float * x, int64_t width, const int32_t * pairs, int src_div, const int32_t * experts,
                    const int32_t * row_base, int64_t n_rows, uint16_t * dst, int32_t * row_of, cudaStream_t s) {
    if (n_rows > 0)
        launch(moe_gather_f16_kernel, dim3(unsigned(std::min<int64_t>(n_rows, 16 * device_sms()))), dim3(128), 0, s, x,
               int(width), pairs, src_div, experts, row_base, int(n_rows), reinterpret_cast<half *>(dst), row_of);
}

}  // namespace dsv4::cuda
