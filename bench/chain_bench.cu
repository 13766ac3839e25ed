// dsv4-chain-bench: a layer's dense one-token Q8_0 products (q_a + kv, q_b, o_a, o_b, the shared gate/up and down
// of DeepSeek V4 Flash, 140.4 MB) as one resident kernel, against the same products as one launch each. It measures
// the second milestone of docs/cuda.md's "What 70 % needs": whether dependent products streamed one after another
// inside one kernel, with no launch between them, reach the rate a product's streaming phase runs at alone (~4.17 TB/s,
// "Session 47"), and how many grid-wide dependent steps between products that stream hides.
//
// The kernel: one block a multiprocessor, sixteen consumer warps and one producer warp. The producer copies the
// block's rows of every product in turn (payload and f16 scales in dsv4's upload layout, which keeps each row's
// bytes contiguous) into a ring of 32 KB slots in shared memory with bulk copies, never waiting for anything but a
// free slot: weights do not depend on the activations, so their stream runs ahead across every dependency. The
// consumers, for each product, wait until its input is complete (three handshakes: kCounts, kWords, kBits below),
// quantize the slice of the input their rows read into shared memory (ds4's Q8A rule, as the engine's quantize
// kernel), take the slots as they fill and store their output rows. Two consumers: session 48's, which reads every
// 16-byte unit's activations and scales from shared memory, and the register consumer that dsv4's ring kernel
// (matvec.cu) took from it, whose lanes keep their activations in registers (session 49). `gaps` extra grid
// barriers after each product stand in for the small steps of a layer (norms, RoPE, attention), which the resident
// design would run between its products while the ring keeps filling.
//
// The products chain through four layers whose weights differ (562 MB a replay, over ten times the L2), so every
// replay reads cold weights. Outputs are checked against a host computation of the whole chain with the same
// quantization rule. Usage: dsv4-chain-bench [SLOTS] (ring slots in use, 1..6, default 6). Prints, for each consumer,
// µs a layer and the weight stream's rate for: one launch per product under PDL (as dsv4 runs them); the resident
// kernel with each handshake (the register consumer without the words), and with 1, 2 and 4 barriers between
// products; the resident kernel with its waits left out (wrong values), also with the consumers not computing (the
// ring's own rate) and with no weights copied (the consumers' own rate); then block 0's phases, product by product,
// in one replay of these.
#include "bench_cuda.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

const char * const kBenchName = "dsv4-chain-bench";

namespace {

constexpr int kConsumers = 512;            // sixteen warps
constexpr int kThreads = kConsumers + 32;  // and the producer warp
// A slot's payload: whole rows (K divides it), 2 KB for each consumer warp (below).
constexpr int kSlotBytes = 32 << 10;
constexpr int kSlotScaleBytes = kSlotBytes / 16;  // their f16 scales (2 bytes a block of 32)
constexpr int kMaxSlots = 6;
constexpr int kMaxSpan = 8192;    // input values a block's rows read (o_a's rows span at most two of its groups)
constexpr int kMaxRows = 256;     // rows of one product a block
constexpr int kMaxProducts = 32;  // in one launch
constexpr int kMaxParts = 4;      // warps a row: K / 2048 (o_b's 8192)
constexpr int kLayers = 4;

// One product y = W x of Q8_0 rows. Grouped products (o_a) multiply rows [g G, (g + 1) G) by x[g K, (g + 1) K).
struct Product {
    const int8_t * payload;   // [rows][k] codes
    const uint16_t * scales;  // [rows][k / 32] f16
    const void * x;           // [rows / group_rows * k] input, as y (a static input: words)
    void * y;                 // [rows] output: words (f32 bits, the replay's epoch in the high half) or f32 (kBits)
    int rows, k, group_rows;
    int input_from;  // the product whose y is x (whose count or words are waited on), or -1 for a static input
};

struct Chain {
    Product p[kMaxProducts];
    int count;
    unsigned * published;    // [kMaxProducts]: blocks that stored their rows of product i; then the gaps' counts
    const unsigned * epoch;  // the replay's number, raised by a kernel before each replay
    int handshake;           // kCounts, kWords or kBits
    int * timed_out;         // a poll that gave up (a block that never arrived would otherwise hang the GPU)
    long long * stamps;      // or null: block 0's clock at each phase of each product, [kMaxProducts][kStamps]
    int probe;               // 0; kNoCompute: the consumers only pass the slots on; kNoCopies: no weights move
};
constexpr int kNoCompute = 1, kNoCopies = 2;
// How the consumers take a chunk (a template parameter of the kernel, so that each gets its own register allocation):
// kUnitConsumer reads each 16-byte unit's activations and scales from shared memory with K read at run time;
// kRegisterConsumer keeps a lane's activations in registers, K a template parameter. The register consumer does not
// take the words handshake: with both, the words' eight registers a load made the kernel spill (at 96 registers,
// the most that seventeen warps get), and spilled values reload from L2 behind the weights' stream.
constexpr int kUnitConsumer = 0, kRegisterConsumer = 1;
// How a product's input is known to be complete. kCounts: every block publishes a count after storing its rows
// (release) and readers poll it (acquire), then read. kWords: each value is stored in one 8-byte word with the
// replay's epoch (as NCCL's low-latency protocol), so a reader spins on the words themselves and no fence or count
// stands between the last store and the first read.
// kBits: each f32 value carries the epoch's parity in its lowest bit (one unit in the last place of a value that is
// quantized to 8 bits next), so the input is read at 4 bytes a value rather than 8.
constexpr int kCounts = 0, kWords = 1, kBits = 2;
// Phases stamped: start, input published, input quantized, rows done, rows stored, count published, and the
// producer's last copy of the product issued.
constexpr int kStamps = 7;

__device__ __forceinline__ void stamp(const Chain & c, int i, int phase) {
    if (c.stamps != nullptr && blockIdx.x == 0) c.stamps[i * kStamps + phase] = clock64();
}

__device__ __forceinline__ int row_begin(int rows, int b, int blocks) { return int(int64_t(rows) * b / blocks); }

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

// After a barrier of the block's writers: the release orders their writes before the count (as CUTLASS's semaphores).
__device__ __forceinline__ void publish(unsigned * count) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
}

__device__ __forceinline__ void poll(const unsigned * count, unsigned target, int * timed_out) {
    const long long start = clock64();
    unsigned seen = 0;
    do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
        if (clock64() - start > (1ll << 32)) {  // ~2 s
            *timed_out = 1;
            return;
        }
    } while (seen < target);
}

struct Shared {
    int4 slot[kMaxSlots][kSlotBytes / 16];              // payload
    int4 slot_scales[kMaxSlots][kSlotScaleBytes / 16];  // f16 scales
    int4 xq[kMaxSpan / 16];                             // the input slice's codes
    float xd[kMaxSpan / 32];                            // and scales
    float part[kMaxRows][kMaxParts];                    // the block's output rows, in parts of K
    uint64_t full[kMaxSlots], empty[kMaxSlots];
};

// The producer: the block's rows of products [first, last) into the ring, in order.
__device__ void produce(const Chain & c, int first, int last, int slots, Shared & s) {
    const int b = int(blockIdx.x), blocks = int(gridDim.x);
    RingPlace at;
    for (int i = first; i < last; ++i) {
        const Product & p = c.p[i];
        const int r0 = row_begin(p.rows, b, blocks), r1 = row_begin(p.rows, b + 1, blocks);
        const int k_shift = __ffs(p.k) - 1, per = kSlotBytes >> k_shift;
        for (int r = r0; r < r1; r += per, at.next(slots)) {
            const int slot = at.slot, n = min(per, r1 - r);
            if (at.reused) mbarrier_wait(&s.empty[slot], at.phase ^ 1u);
            const uint32_t payload = uint32_t(n) << k_shift, scales = uint32_t(n) << (k_shift - 4);
            if (c.probe == kNoCopies) {
                mbarrier_arrive(&s.full[slot]);
                continue;
            }
            mbarrier_expect_bytes(&s.full[slot], payload + scales);
            bulk_copy(s.slot[slot], p.payload + (size_t(r) << k_shift), payload, &s.full[slot]);
            bulk_copy(s.slot_scales[slot], p.scales + (size_t(r) << (k_shift - 5)), scales, &s.full[slot]);
        }
        stamp(c, i, 6);
    }
}

// x[begin, begin + span) quantized into s.xq / s.xd: eight lanes a block of 32 values, four values a lane. Every
// load is issued before the first is used: the input comes from L2, one round trip for the whole slice. With
// `epoch` (not ~0u), values of an older replay are read again until they carry it. BITS: x holds f32 values whose
// lowest bit is the epoch's parity (kBits); else 8-byte words (kWords).
template <bool BITS>
__device__ void quantize_input(const void * x, int begin, int span, unsigned epoch, int * timed_out, Shared & s) {
    constexpr int kLoads = kMaxSpan / 4 / kConsumers, kWords32 = BITS ? 4 : 8;
    const int lane = int(threadIdx.x) & 31;
    auto load = [&](int i, uint32_t(&w)[kWords32]) {
        if constexpr (BITS) {
            const uint32_t * src = static_cast<const uint32_t *>(x) + begin + size_t(i) * 4;
            asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                         : "l"(src));
        } else {  // 8-byte loads: a word's value and epoch are read at once
            const uint64_t * src = static_cast<const uint64_t *>(x) + begin + size_t(i) * 4;
            uint64_t v[4];
            asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v[0]), "=l"(v[1]) : "l"(src));
            asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v[2]), "=l"(v[3]) : "l"(src + 2));
            for (int e = 0; e < 4; ++e) {
                w[2 * e] = uint32_t(v[e]);
                w[2 * e + 1] = uint32_t(v[e] >> 32);
            }
        }
    };
    auto value = [&](const uint32_t(&w)[kWords32], int e) { return __uint_as_float(w[BITS ? e : 2 * e]); };
    auto stale = [&](const uint32_t(&w)[kWords32]) {
        if (epoch == ~0u) return false;
        bool old = false;
        for (int e = 0; e < 4; ++e) old |= BITS ? (w[e] & 1u) != (epoch & 1u) : w[2 * e + 1] != epoch;
        return old;
    };
    uint32_t w[kLoads][kWords32];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
        const int i = int(threadIdx.x) + j * kConsumers;
        if (i < span / 4) load(i, w[j]);
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
        const int i = int(threadIdx.x) + j * kConsumers;
        if (i >= span / 4) break;  // span / 4 is a multiple of kConsumers: whole warps leave together
        const long long start = clock64();
        while (stale(w[j])) {
            if (clock64() - start > (1ll << 32)) {  // ~2 s
                *timed_out = 1;
                break;
            }
            load(i, w[j]);
        }
        const float4 v = make_float4(value(w[j], 0), value(w[j], 1), value(w[j], 2), value(w[j], 3));
        float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
        for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float d = amax / 127.0f;
        auto q = [&](float f) { return d == 0.0f ? 0u : uint32_t(min(127, max(-127, __float2int_rn(f / d)))) & 0xffu; };
        reinterpret_cast<uint32_t *>(s.xq)[i] = q(v.x) | q(v.y) << 8 | q(v.z) << 16 | q(v.w) << 24;
        if ((lane & 7) == 0) s.xd[i / 8] = d;
    }
}

constexpr int kWarpUnits = kSlotBytes / 16 / (kConsumers / 32);  // 16-byte units a warp takes of a full chunk
constexpr int kUnits = kWarpUnits / 32;                          // and a lane

// The consumers' place in the ring, across products: next() waits until the current chunk's slot has landed,
// release() gives it back and moves on.
struct Ring {
    int slots;
    RingPlace at;
    __device__ __forceinline__ int slot() const { return at.slot; }
    __device__ __forceinline__ void next(Shared & s) { mbarrier_wait(&s.full[at.slot], at.phase); }
    __device__ __forceinline__ void release(Shared & s) {
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbarrier_arrive(&s.empty[at.slot]);
        at.next(slots);
    }
};

// The block's rows [r0, r1) of p from the ring into s.part, K read at run time. A warp takes kWarpUnits consecutive
// 16-byte units of a chunk, a lane kUnits of them 32 apart: with k >= 2048 they lie in one part of one row (one
// reduction a warp and chunk); with k = 1024 in two rows. k is a power of two: rows and columns of units by shifts
// and masks. Each unit reads its activations and both scales from shared memory.
__device__ void rows_units(const Chain & c, const Product & p, int r0, int r1, int g0, Ring & ring, Shared & s) {
    const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
    const int units_per_row = p.k / 16, row_shift = __ffs(units_per_row) - 1;
    const int per = kSlotBytes / 16 >> row_shift;
    for (int r = r0; r < r1; r += per) {
        const int n = min(per, r1 - r);
        const int first_unit = warp * kWarpUnits;
        ring.next(s);
        if (first_unit < n * units_per_row && c.probe != kNoCompute) {
            const uint16_t * scales = reinterpret_cast<const uint16_t *>(s.slot_scales[ring.slot()]);
            const int row = first_unit >> row_shift;  // of the chunk; the first of two when k = 1024
            const int in = p.group_rows == p.rows ? 0 : (r + row) / p.group_rows - g0;
            float sum0 = 0.0f, sum1 = 0.0f;  // the first row's, the second's
#pragma unroll
            for (int j = 0; j < kUnits; ++j) {
                const int u = first_unit + lane + 32 * j, col = u & (units_per_row - 1);
                const int4 w = s.slot[ring.slot()][u];
                const int4 a = s.xq[in * units_per_row + col];
                int dot = __dp4a(w.x, a.x, 0);
                dot = __dp4a(w.y, a.y, dot);
                dot = __dp4a(w.z, a.z, dot);
                dot = __dp4a(w.w, a.w, dot);
                const int row_u = u >> row_shift;
                const float v = __half2float(__ushort_as_half(scales[row_u * (p.k / 32) + col / 2])) *
                                s.xd[in * (p.k / 32) + col / 2] * float(dot);
                if (row_u == row)
                    sum0 += v;
                else
                    sum1 += v;
            }
            for (int o = 16; o > 0; o >>= 1) {
                sum0 += __shfl_xor_sync(0xffffffffu, sum0, o);
                sum1 += __shfl_xor_sync(0xffffffffu, sum1, o);
            }
            if (lane == 0) {
                const int local = r - r0 + row, part = (first_unit & (units_per_row - 1)) / kWarpUnits;
                s.part[local][part] = sum0;
                if (units_per_row < kWarpUnits) s.part[local + 1][0] = sum1;
            }
        }
        ring.release(s);
    }
}

// The same rows with K known at compile time, so that every index is a constant offset from the lane's first unit.
// A lane reads the same columns of every row its warp takes (units lane + 32 j of the warp's part of a row), so its
// activations and their scales stay in registers for the whole product (reloaded only where o_a's rows cross into
// the next group). A unit costs one shared load of weights and one of a scale: the scale of unit u is the slot's
// block u / 2, because chunks hold whole rows of whole blocks.
template <int K>
__device__ void rows_registers(const Chain & c, const Product & p, int r0, int r1, int g0, Ring & ring, Shared & s) {
    constexpr int kUnitsPerRow = K / 16, kPer = kSlotBytes / K;
    constexpr int kRows = kUnitsPerRow < kWarpUnits ? kWarpUnits / kUnitsPerRow : 1;  // rows a warp takes: 2 at 1024
    static_assert(kRows <= 2 && kUnitsPerRow % 32 == 0, "a warp's units span at most two rows, a lane's one row each");
    const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
    const int first_unit = warp * kWarpUnits;
    const int row = first_unit / kUnitsPerRow, base = first_unit % kUnitsPerRow;  // the warp's first row and column
    int4 a[kUnits];                                                               // the lane's activation codes, unit j
    float ad[kUnits];                                                             // and their scales
    int in = -1;                                                                  // the group they belong to
    for (int r = r0; r < r1; r += kPer) {
        ring.next(s);
        if (row < min(kPer, r1 - r) && c.probe != kNoCompute) {
            const int g = p.group_rows == p.rows ? 0 : (r + row) / p.group_rows - g0;
            if (g != in) {
                in = g;
#pragma unroll
                for (int j = 0; j < kUnits; ++j) {
                    const int col = (base + 32 * j) % kUnitsPerRow + lane;
                    a[j] = s.xq[in * kUnitsPerRow + col];
                    ad[j] = s.xd[(in * kUnitsPerRow + col) / 2];
                }
            }
            const int4 * w = &s.slot[ring.slot()][first_unit + lane];
            const uint16_t * scales =
                reinterpret_cast<const uint16_t *>(s.slot_scales[ring.slot()]) + (first_unit + lane) / 2;
            float sum[kRows] = {};
#pragma unroll
            for (int j = 0; j < kUnits; ++j) {
                const int4 wj = w[32 * j];
                int dot = __dp4a(wj.x, a[j].x, 0);
                dot = __dp4a(wj.y, a[j].y, dot);
                dot = __dp4a(wj.z, a[j].z, dot);
                dot = __dp4a(wj.w, a[j].w, dot);
                sum[(base + 32 * j) / kUnitsPerRow] +=
                    float(dot) * (ad[j] * __half2float(__ushort_as_half(scales[16 * j])));
            }
            // Two rows reduce in five shuffles: the first level trades halves, so that lanes 0-15 then hold the first
            // row's sums and lanes 16-31 the second's.
            float v = sum[0];
            if constexpr (kRows == 2) {
                const bool upper = (lane & 16) != 0;
                v = (upper ? sum[1] : sum[0]) + __shfl_xor_sync(0xffffffffu, upper ? sum[0] : sum[1], 16);
            }
            for (int o = kRows == 2 ? 8 : 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) s.part[r - r0 + row][base / kWarpUnits] = v;
            if (kRows == 2 && lane == 16) s.part[r - r0 + row + 1][0] = v;
        }
        ring.release(s);
    }
}

// The consumers: for each product, its input (once the handshake says it is complete), the block's rows from the
// ring, its output (and count); then `gaps` grid barriers.
template <bool WAIT, int CONSUMER>
__device__ void consume(const Chain & c, int first, int last, int slots, int gaps, Shared & s) {
    const int b = int(blockIdx.x), blocks = int(gridDim.x), t = int(threadIdx.x);
    unsigned * gap_counts = c.published + kMaxProducts;
    unsigned epoch;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(epoch) : "l"(c.epoch));
    Ring ring{slots};
    for (int i = first; i < last; ++i) {
        const Product & p = c.p[i];
        const int r0 = row_begin(p.rows, b, blocks), r1 = row_begin(p.rows, b + 1, blocks);
        if (t == 0) stamp(c, i, 0);
        const bool chained = WAIT && p.input_from >= 0;  // a static input, or a no-wait probe, reads as it is
        if (chained && c.handshake == kCounts && p.input_from >= first && t == 0)
            poll(c.published + p.input_from, unsigned(blocks), c.timed_out);
        consumers_sync();
        if (t == 0) stamp(c, i, 1);
        const int g0 = r0 / p.group_rows, g1 = (r1 - 1) / p.group_rows;
        // A static input is held as f32 values (read with no check); the chain's values as the handshake writes them.
        const unsigned check = chained && c.handshake != kCounts ? epoch : ~0u;
        if (CONSUMER == kRegisterConsumer || c.handshake == kBits || p.input_from < 0)
            quantize_input<true>(p.x, g0 * p.k, (g1 - g0 + 1) * p.k, check, c.timed_out, s);
        else
            quantize_input<false>(p.x, g0 * p.k, (g1 - g0 + 1) * p.k, check, c.timed_out, s);
        consumers_sync();
        if (t == 0) stamp(c, i, 2);
        if constexpr (CONSUMER == kRegisterConsumer) {
            switch (p.k) {
                case 1024:
                    rows_registers<1024>(c, p, r0, r1, g0, ring, s);
                    break;
                case 2048:
                    rows_registers<2048>(c, p, r0, r1, g0, ring, s);
                    break;
                case 4096:
                    rows_registers<4096>(c, p, r0, r1, g0, ring, s);
                    break;
                default:
                    rows_registers<8192>(c, p, r0, r1, g0, ring, s);
                    break;
            }
        } else {
            rows_units(c, p, r0, r1, g0, ring, s);
        }
        const int parts = max(1, p.k / 16 / kWarpUnits);
        if (t == 0) stamp(c, i, 3);
        consumers_sync();
        for (int r = r0 + t; r < r1; r += kConsumers) {
            float y = 0.0f;
            for (int q = 0; q < parts; ++q) y += s.part[r - r0][q];
            if (c.handshake == kBits || CONSUMER == kRegisterConsumer) {  // f32, the epoch's parity read under kBits
                const uint32_t bits = (__float_as_uint(y) & ~1u) | (epoch & 1u);
                asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(static_cast<uint32_t *>(p.y) + r), "r"(bits)
                             : "memory");
            } else {
                const uint64_t word = uint64_t(epoch) << 32 | __float_as_uint(y);
                asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(static_cast<uint64_t *>(p.y) + r), "l"(word)
                             : "memory");
            }
        }
        consumers_sync();
        if (t == 0) {
            stamp(c, i, 4);
            if (c.handshake == kCounts) publish(c.published + i);
            stamp(c, i, 5);
        }
        for (int g = 0; g < gaps; ++g) {
            unsigned * count = gap_counts + i * 4 + g;
            if (t == 0) {
                publish(count);
                poll(count, unsigned(blocks), c.timed_out);
            }
            consumers_sync();
        }
    }
}

__global__ void bump_epoch(unsigned * epoch) { *epoch += 1; }

// Products [first, last) of the chain. Launched once for the whole chain (resident), or once a product under PDL.
template <bool WAIT, int CONSUMER>
__global__ void __launch_bounds__(kThreads, 1)
    chain_kernel(const __grid_constant__ Chain c, int first, int last, int slots, int gaps) {
    extern __shared__ __align__(128) uint8_t raw[];
    Shared & s = *reinterpret_cast<Shared *>(raw);
    if (threadIdx.x == 0) {
        mbarriers_init(s.full, slots);                    // the producer's arrival with the copies' bytes
        mbarriers_init(s.empty, slots, kConsumers / 32);  // each consumer warp's
    }
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;");
    if (threadIdx.x >= kConsumers) {
        if (threadIdx.x == kConsumers) produce(c, first, last, slots, s);  // weights need no wait
        return;
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    consume<WAIT, CONSUMER>(c, first, last, slots, gaps, s);
}

// ---------------------------------------------------------------------------------------------------------------------
// Host: the chain's weights, its reference, the timed variants
// ---------------------------------------------------------------------------------------------------------------------
struct HostProduct {
    int rows, k, group_rows;
    std::vector<int8_t> payload;
    std::vector<uint16_t> scales;
};

float half_bits_to_float(uint16_t bits) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
}

// ds4's Q8A rule over blocks of 32, then each row's integer dots times both scales, summed in f64.
std::vector<float> host_product(const HostProduct & p, const std::vector<float> & x) {
    std::vector<int8_t> xq(x.size());
    std::vector<float> xd(x.size() / 32);
    for (size_t blk = 0; blk < xd.size(); ++blk) {
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[blk * 32 + j]));
        const float d = amax / 127.0f;
        xd[blk] = d;
        for (int j = 0; j < 32; ++j)
            xq[blk * 32 + j] = d == 0.0f ? 0 : int8_t(std::clamp(int(std::nearbyint(x[blk * 32 + j] / d)), -127, 127));
    }
    std::vector<float> y(size_t(p.rows));
    for (int r = 0; r < p.rows; ++r) {
        const size_t in = size_t(r / p.group_rows) * p.k;
        double sum = 0;
        for (int blk = 0; blk < p.k / 32; ++blk) {
            int dot = 0;
            for (int j = 0; j < 32; ++j)
                dot += int(p.payload[size_t(r) * p.k + blk * 32 + j]) * int(xq[in + blk * 32 + j]);
            sum += double(half_bits_to_float(p.scales[size_t(r) * (p.k / 32) + blk])) *
                   double(xd[(in + blk * 32) / 32]) * double(dot);
        }
        y[size_t(r)] = float(sum);
    }
    return y;
}

// Mean µs of one replay of `graph` over 20 replays after 2 warm-up ones.
double replay_us(cudaStream_t stream, cudaGraphExec_t exec) {
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "cudaEventCreate");
    check(cudaEventCreate(&e1), "cudaEventCreate");
    for (int i = 0; i < 2; ++i) check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(cudaEventRecord(e0, stream), "cudaEventRecord");
    for (int i = 0; i < 20; ++i) check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(cudaEventRecord(e1, stream), "cudaEventRecord");
    check(cudaEventSynchronize(e1), "run");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return double(ms) * 1e3 / 20;
}

}  // namespace

int main(int argc, char ** argv) {
    const int slots = argc > 1 ? std::atoi(argv[1]) : kMaxSlots;
    if (slots < 1 || slots > kMaxSlots) {
        std::fprintf(stderr, "usage: dsv4-chain-bench [SLOTS, 1..%d]\n", kMaxSlots);
        return 2;
    }
    int device_count = 0;
    if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
        std::fprintf(stderr, "dsv4-chain-bench: no CUDA device\n");
        return 77;
    }
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    const int blocks = prop.multiProcessorCount;
    if (size_t(prop.sharedMemPerBlockOptin) < sizeof(Shared)) {
        std::fprintf(stderr, "dsv4-chain-bench: needs %zu bytes of shared memory a block\n", sizeof(Shared));
        return 77;
    }

    // A layer's dense products at V4 Flash's shapes; each reads the one before (the next layer's q_a + kv the
    // shared down's output; q_b the q_a part of q_a + kv, the shared down the gate part of gate/up).
    struct Shape {
        const char * name;
        int rows, k, group_rows;
    };
    const Shape shapes[] = {{"q_a+kv", 1536, 4096, 1536}, {"q_b", 32768, 1024, 32768},   {"o_a", 8192, 4096, 1024},
                            {"o_b", 4096, 8192, 4096},    {"gate/up", 4096, 4096, 4096}, {"down", 4096, 2048, 4096}};
    constexpr int kPerLayer = 6;
    std::mt19937 rng(7);
    std::vector<HostProduct> host;
    Chain chain = {};
    chain.count = kLayers * kPerLayer;
    size_t bytes_per_layer = 0;
    std::vector<void *> buffers;
    auto device_copy = [&](const void * src, size_t bytes) {
        void * d = nullptr;
        check(cudaMalloc(&d, bytes), "cudaMalloc");
        check(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
        buffers.push_back(d);
        return d;
    };
    std::vector<float> x0(4096);
    std::normal_distribution<float> normal;
    for (float & v : x0) v = normal(rng);
    const float * x_first = static_cast<const float *>(device_copy(x0.data(), x0.size() * 4));
    for (int l = 0; l < kLayers; ++l)
        for (int j = 0; j < kPerLayer; ++j) {
            const Shape & sh = shapes[j];
            const int i = l * kPerLayer + j;
            HostProduct hp{sh.rows, sh.k, sh.group_rows, std::vector<int8_t>(size_t(sh.rows) * sh.k),
                           std::vector<uint16_t>(size_t(sh.rows) * sh.k / 32)};
            std::uniform_int_distribution<int> code(-127, 127);
            std::uniform_real_distribution<float> spread(0.5f, 1.5f);
            for (int8_t & v : hp.payload) v = int8_t(code(rng));
            const float d = 1.0f / std::sqrt(float(sh.k) * 127.0f * 127.0f / 3.0f);  // outputs of unit variance
            for (uint16_t & v : hp.scales) v = __half_raw(__float2half(d * spread(rng))).x;
            Product & p = chain.p[i];
            p.payload = static_cast<const int8_t *>(device_copy(hp.payload.data(), hp.payload.size()));
            p.scales = static_cast<const uint16_t *>(device_copy(hp.scales.data(), hp.scales.size() * 2));
            uint64_t * y = nullptr;
            check(cudaMalloc(&y, size_t(sh.rows) * 8), "cudaMalloc");
            check(cudaMemset(y, 0, size_t(sh.rows) * 8), "cudaMemset");
            buffers.push_back(y);
            p.y = y;
            p.rows = sh.rows;
            p.k = sh.k;
            p.group_rows = sh.group_rows;
            p.input_from = i - 1;
            p.x = i == 0 ? x_first : chain.p[i - 1].y;
            if (i == 0) p.input_from = -1;
            if (l == 0) bytes_per_layer += hp.payload.size() + hp.scales.size() * 2;
            if (l == 0 && (sh.rows / blocks + 1 > kMaxRows || kSlotBytes % sh.k != 0 || sh.k < 1024 ||
                           sh.k / 16 / kWarpUnits > kMaxParts || (sh.k & (sh.k - 1)) != 0)) {
                std::fprintf(stderr, "dsv4-chain-bench: %s does not fit the kernel's bounds\n", sh.name);
                return 1;
            }
            host.push_back(std::move(hp));
        }
    check(cudaMalloc(&chain.published, kMaxProducts * 5 * sizeof(unsigned)), "cudaMalloc");
    check(cudaMalloc(&chain.timed_out, sizeof(int)), "cudaMalloc");
    unsigned * epoch = nullptr;
    check(cudaMalloc(&epoch, sizeof(unsigned)), "cudaMalloc");
    check(cudaMemset(epoch, 0, sizeof(unsigned)), "cudaMemset");  // the words start at 0: the first replay is 1
    chain.epoch = epoch;
    check(cudaMemset(chain.timed_out, 0, sizeof(int)), "cudaMemset");
    for (auto kernel : {chain_kernel<true, kUnitConsumer>, chain_kernel<false, kUnitConsumer>,
                        chain_kernel<true, kRegisterConsumer>, chain_kernel<false, kRegisterConsumer>})
        check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(Shared))),
              "shared memory");

    // The reference: the whole chain on the host.
    std::vector<float> ref = x0;
    for (const HostProduct & hp : host) {
        std::vector<float> in = ref;
        in.resize(size_t(hp.rows / hp.group_rows) * hp.k);
        ref = host_product(hp, in);
    }

    cudaStream_t stream;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    auto capture = [&](auto && body) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
        check(cudaMemsetAsync(chain.published, 0, kMaxProducts * 5 * sizeof(unsigned), stream), "cudaMemsetAsync");
        bump_epoch<<<1, 1, 0, stream>>>(epoch);
        check(cudaGetLastError(), "bump_epoch");
        body();
        check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
        check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
        cudaGraphDestroy(graph);
        return exec;
    };
    // The resident kernel's blocks wait on each other, so all must be resident at once: one a multiprocessor, which
    // its shared memory allows and nothing else on the GPU competes for (a poll gives up after ~2 s otherwise).
    int per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chain_kernel<true, kUnitConsumer>, kThreads,
                                                        sizeof(Shared)),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    if (per_sm < 1) {
        std::fprintf(stderr, "dsv4-chain-bench: the kernel does not fit a multiprocessor\n");
        return 1;
    }
    int consumer = kUnitConsumer;
    auto kernel = [&](bool wait) {
        if (consumer == kRegisterConsumer)
            return wait ? chain_kernel<true, kRegisterConsumer> : chain_kernel<false, kRegisterConsumer>;
        return wait ? chain_kernel<true, kUnitConsumer> : chain_kernel<false, kUnitConsumer>;
    };
    auto resident = [&](bool wait, int gaps) {
        check(launch_pdl(kernel(wait), blocks, kThreads, sizeof(Shared), false, stream, chain, 0, chain.count, slots,
                         gaps),
              "cudaLaunchKernelEx");
    };
    // Outputs left by another handshake's layout must not pass for the next replay's: words of 0 carry no epoch (the
    // first replay is 1), and f32 values get the lowest bit of the replay before the next one (epochs rise by one a
    // replay, so the next replay's parity differs).
    auto use_handshake = [&](int handshake) {
        unsigned last = 0;
        check(cudaStreamSynchronize(stream), "run");
        check(cudaMemcpy(&last, epoch, sizeof(unsigned), cudaMemcpyDeviceToHost), "cudaMemcpy");
        for (int i = 0; i < chain.count; ++i)
            check(cudaMemset(chain.p[i].y, handshake == kBits ? int(last & 1u) : 0, size_t(chain.p[i].rows) * 8),
                  "cudaMemset");
        chain.handshake = handshake;
    };
    // Outputs are f32 values under kBits and from the register consumer, else 8-byte words.
    auto f32_values = [&] { return chain.handshake == kBits || consumer == kRegisterConsumer; };
    auto check_output = [&](const char * what) {
        std::vector<uint64_t> words(ref.size());
        check(cudaMemcpy(words.data(), chain.p[chain.count - 1].y, words.size() * 8, cudaMemcpyDeviceToHost),
              "cudaMemcpy");
        std::vector<float> y(ref.size());
        for (size_t i = 0; i < y.size(); ++i) {
            const uint32_t bits =
                f32_values() ? reinterpret_cast<const uint32_t *>(words.data())[i] : uint32_t(words[i]);
            std::memcpy(&y[i], &bits, 4);
        }
        double err = 0, norm = 0;
        for (size_t i = 0; i < y.size(); ++i) {
            err += double(y[i] - ref[i]) * double(y[i] - ref[i]);
            norm += double(ref[i]) * double(ref[i]);
        }
        const double rel = std::sqrt(err / std::max(norm, 1e-30));
        std::printf("    %-34s output vs host: relative RMS error %.2e\n", what, rel);
        return rel < 2e-2;  // a quantization boundary may round differently after float reordering; a wrong row
                            // or a missed dependency gives errors of order 1
    };

    const double mb = double(bytes_per_layer) / 1e6;
    std::printf(
        "%s, %d multiprocessors; %d layers of %d dense Q8_0 products, %.1f MB a layer; %d ring slots of %d KB\n",
        prop.name, blocks, kLayers, kPerLayer, mb, slots, kSlotBytes >> 10);
    std::printf("  %-48s %12s %10s\n", "variant", "us a layer", "TB/s");
    bool ok = true;
    auto report = [&](const char * what, cudaGraphExec_t exec, bool checked) {
        const double us = replay_us(stream, exec) / kLayers;
        std::printf("  %-48s %12.2f %10.2f\n", what, us, mb / us);
        if (checked) ok = check_output(what) && ok;
        cudaGraphExecDestroy(exec);
    };
    const char * consumer_names[] = {"unit consumer", "register consumer"};
    for (int which : {kUnitConsumer, kRegisterConsumer}) {
        consumer = which;
        std::printf("%s:\n", consumer_names[consumer]);
        // No count to publish: each launch waits for the one before (PDL). The register consumer reads f32 values.
        use_handshake(consumer == kRegisterConsumer ? kBits : kWords);
        report("one launch a product (PDL)", capture([&] {
                   for (int i = 0; i < chain.count; ++i)
                       check(launch_pdl(kernel(false), blocks, kThreads, sizeof(Shared), true, stream, chain, i, i + 1,
                                        slots, 0),
                             "cudaLaunchKernelEx");
               }),
               true);
        use_handshake(kCounts);
        report("resident, counts, 0 barriers between products", capture([&] { resident(true, 0); }), true);
        if (consumer == kUnitConsumer) {
            use_handshake(kWords);
            report("resident, words, 0 barriers between products", capture([&] { resident(true, 0); }), true);
        }
        use_handshake(kBits);
        for (int gaps : {0, 1, 2, 4}) {
            char what[64];
            std::snprintf(what, sizeof what, "resident, bits, %d barrier%s between products", gaps,
                          gaps == 1 ? "" : "s");
            report(what, capture([&] { resident(true, gaps); }), true);
        }
        report("resident, no waits (wrong values)", capture([&] { resident(false, 0); }), false);
        chain.probe = kNoCompute;
        report("  the same, weights not computed on", capture([&] { resident(false, 0); }), false);
        chain.probe = kNoCopies;
        report("  the same, no weights copied", capture([&] { resident(false, 0); }), false);
        chain.probe = 0;

        // Block 0's phases in one replay of the resident kernel, µs from the product's start (thread 0's view; the
        // producer's stamp is when it issued the product's last copy).
        check(cudaMalloc(&chain.stamps, kMaxProducts * kStamps * sizeof(long long)), "cudaMalloc");
        const char * runs[] = {"resident, counts", "resident, words", "resident, bits", "no waits, no weights copied"};
        for (int run = 0; run < 4; ++run) {
            if (run == 1 && consumer == kRegisterConsumer) continue;
            use_handshake(run == 0 ? kCounts : run == 1 ? kWords : kBits);
            chain.probe = run == 3 ? kNoCopies : 0;
            cudaGraphExec_t exec = capture([&] { resident(run < 3, 0); });
            check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
            check(cudaStreamSynchronize(stream), "run");
            cudaGraphExecDestroy(exec);
            std::vector<long long> st(size_t(kMaxProducts) * kStamps);
            check(cudaMemcpy(st.data(), chain.stamps, st.size() * sizeof(long long), cudaMemcpyDeviceToHost),
                  "cudaMemcpy");
            int khz = 0;
            check(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0), "cudaDeviceGetAttribute");
            const double per_us = double(khz) * 1e-3;  // cycles a µs at the reported clock
            std::printf("block 0's phases, %s, layer 2 (µs; the start is the previous product's publish):\n",
                        runs[run]);
            std::printf("  %-8s %8s %8s %8s %8s %8s %8s %14s\n", "product", "start", "input", "quant", "rows", "stored",
                        "published", "last copy");
            for (int i = kPerLayer; i < 2 * kPerLayer; ++i) {
                const long long * r = &st[size_t(i) * kStamps];
                std::printf("  %-8s", shapes[i % kPerLayer].name);
                for (int ph = 0; ph < 6; ++ph)
                    std::printf(" %8.2f", double(r[ph] - st[size_t(i - 1) * kStamps + 5]) / per_us);
                std::printf(" %14.2f\n", double(r[6] - st[size_t(i - 1) * kStamps + 5]) / per_us);
            }
        }
        cudaFree(chain.stamps);
        chain.stamps = nullptr;
        chain.probe = 0;
    }

    int gave_up = 0;
    check(cudaMemcpy(&gave_up, chain.timed_out, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (void * p : buffers) cudaFree(p);
    if (gave_up) {
        std::fprintf(stderr, "dsv4-chain-bench: a poll gave up: a block never published\n");
        return 1;
    }
    if (!ok) {
        std::fprintf(stderr, "dsv4-chain-bench: an output differs from the host's\n");
        return 1;
    }
    return 0;
}
