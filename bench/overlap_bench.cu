// dsv4-overlap-bench: what a big decode product costs after a chain of small dependent steps, run the way dsv4 runs
// it (the chain's kernels, then the product, one graph with programmatic dependent launch: the product's weights
// stream only once the chain is done) and the way the persistent-kernel plan of docs/cuda.md ("What 70 % needs") would
// (the product's blocks resident on a second stream from the chain's start, pulling their weights into shared memory
// while the chain runs and polling a count that the chain's last step raises). It measures the premise of that plan:
// how much of a product's time the idle DRAM of an attention chain can absorb.
//
// Each chain step is a kernel of one block a multiprocessor that reads 16 KB a block of cold data and a value its
// neighbour wrote in the step before (about 2 µs a step: dsv4-sync-bench). The product reads P MB of cold weights,
// a share a block, and the chain's last values. The graphs rotate over eight regions of the weights (at least 64 MB
// in all, more than the 50 MB of L2), so every replay reads data the others pushed out. Usage: dsv4-overlap-bench [MB
// [CHAIN_FIRST [DEPTH]]]: MB of the product (default 36: one 1024 x 32768 Q8_0 product such as q_b, o_a or o_b);
// CHAIN_FIRST 1 captures the chain's first step before the side kernel (the graph then starts it first); DEPTH the 16
// KB pieces a block keeps in flight while preloading (default 0: all).
#include "bench_cuda.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

const char * const kBenchName = "dsv4-overlap-bench";

namespace {

constexpr int kThreads = 256;
constexpr int kChainBytes = 16 << 10;  // read by each block of a chain step
constexpr int kRegions = 8;

struct Chain {
    const int4 * w;   // cold data, kChainBytes a block and step from `first`
    size_t first;     // 16-byte units: the region's start
    float * values;   // [2][blocks]: step s writes values[s % 2][b] from values[(s + 1) % 2][(b + 1) % blocks]
    unsigned * done;  // the last step's blocks count themselves here (release)
};

// One chain step under PDL. The last one releases a count per block for a product that polls rather than waits.
__global__ void __launch_bounds__(kThreads) chain_kernel(Chain a, int s, int last) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const int b = int(blockIdx.x), blocks = int(gridDim.x);
    const int4 * src = a.w + a.first + (size_t(s) * blocks + b) * (kChainBytes / 16);
    int acc = 0;
    for (int i = int(threadIdx.x); i < kChainBytes / 16; i += kThreads) acc ^= load_xor16(src + i);
    acc = block_xor<kThreads>(acc);
    if (threadIdx.x == 0) {
        const float prev = __ldcg(a.values + ((s + 1) % 2) * blocks + (b + 1) % blocks);
        __stcg(a.values + (s % 2) * blocks + b, prev + float(acc & 1));
        if (last) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.done) : "memory");
    }
}

struct Product {
    const uint8_t * w;  // the region's weights, `per` bytes a block
    size_t per;         // a multiple of 16
    size_t preload;     // bytes a block pulls into shared memory before the chain is done (a multiple of 16 KB)
    const float * act;  // the chain's last values [blocks]
    unsigned * done;    // the chain's count (preload variant): one a block of the chain's grid, which is this one's
    float * out;        // [blocks]
    int * timed_out;    // set when a poll gave up (a chain that never finished would otherwise hang the GPU)
};

__device__ __forceinline__ void finish(const Product & p, int acc) {
    acc = block_xor<kThreads>(acc);
    if (threadIdx.x == 0) p.out[blockIdx.x] = __ldcg(p.act + blockIdx.x) + float(acc & 1);
}

// As dsv4's products: launched early under PDL, its first 32 KB pulled into L2 before the wait, the rest after it.
__global__ void __launch_bounds__(kThreads) product_kernel(Product p) {
    const uint8_t * src = p.w + size_t(blockIdx.x) * p.per;
    const size_t ahead = p.per < size_t(32 << 10) ? p.per : size_t(32 << 10);
    for (size_t o = size_t(threadIdx.x) * 128; o < ahead; o += kThreads * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(src + o));
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const int4 * s16 = reinterpret_cast<const int4 *>(src);
    int acc = 0;
#pragma unroll 4
    for (size_t i = threadIdx.x; i < p.per / 16; i += kThreads) acc ^= load_xor16(s16 + i);
    finish(p, acc);
}

// Beside the chain: bulk copies of the block's first `preload` bytes into shared memory in 16 KB pieces, at most
// `depth` in flight (warp 1 issues them, a piece's mbarrier each: fewer in flight leave the chain more of DRAM),
// while warp 0 polls the chain's count; then the shared bytes and the rest of the share from global memory.
constexpr int kPiece = 16 << 10, kMaxPieces = 16;

__global__ void __launch_bounds__(kThreads) preload_kernel(Product p, int depth) {
    extern __shared__ __align__(128) int4 staged[];
    __shared__ uint64_t full[kMaxPieces];
    const uint8_t * src = p.w + size_t(blockIdx.x) * p.per;
    const int pieces = int(p.preload / kPiece);
    if (threadIdx.x == 0) mbarriers_init(full, pieces);
    __syncthreads();
    if (threadIdx.x == 32) {
        const int ahead = depth > 0 ? depth : pieces;
        for (int i = 0; i < pieces; ++i) {
            if (i >= ahead) mbarrier_wait(&full[i - ahead], 0);
            bulk_copy_to_shared(reinterpret_cast<uint8_t *>(staged) + size_t(i) * kPiece, src + size_t(i) * kPiece,
                                kPiece, &full[i]);
        }
    }
    if (threadIdx.x == 0) {
        const long long start = clock64();
        unsigned seen = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(p.done) : "memory");
            if (clock64() - start > (1ll << 32)) {  // ~2 s
                *p.timed_out = 1;
                break;
            }
        } while (seen < gridDim.x);
    }
    __syncthreads();
    int acc = 0;
    for (int i = 0; i < pieces; ++i) mbarrier_wait(&full[i], 0);
    for (size_t i = threadIdx.x; i < p.preload / 16; i += kThreads) {
        const int4 v = staged[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    const int4 * s16 = reinterpret_cast<const int4 *>(src);
#pragma unroll 4
    for (size_t i = p.preload / 16 + threadIdx.x; i < p.per / 16; i += kThreads) acc ^= load_xor16(s16 + i);
    finish(p, acc);
}

// Mean µs of one replay, over 4 rounds of the regions' graphs after one warm-up round.
template <class Build>
double replay_us(cudaStream_t stream, Build && build) {
    std::vector<cudaGraphExec_t> execs;
    for (int r = 0; r < kRegions; ++r) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
        build(r);
        check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
        check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
        cudaGraphDestroy(graph);
        execs.push_back(exec);
    }
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "cudaEventCreate");
    check(cudaEventCreate(&e1), "cudaEventCreate");
    for (cudaGraphExec_t e : execs) check(cudaGraphLaunch(e, stream), "cudaGraphLaunch");
    check(cudaEventRecord(e0, stream), "cudaEventRecord");
    for (int i = 0; i < 4 * kRegions; ++i)
        check(cudaGraphLaunch(execs[size_t(i % kRegions)], stream), "cudaGraphLaunch");
    check(cudaEventRecord(e1, stream), "cudaEventRecord");
    check(cudaEventSynchronize(e1), "run");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return double(ms) * 1e3 / (4 * kRegions);
}

}  // namespace

int main(int argc, char ** argv) {
    const long mb = argc > 1 ? std::atol(argv[1]) : 36;
    const bool chain_first = argc > 2 && std::atoi(argv[2]) != 0;
    const int depth = argc > 3 ? std::atoi(argv[3]) : 0;  // pieces in flight a block; 0: all at once
    if (mb < 8 || mb > 256 || depth < 0) {
        std::fprintf(stderr, "usage: dsv4-overlap-bench [MB, 8..256 [CHAIN_FIRST 0|1 [DEPTH >= 0]]]\n");
        return 2;
    }
    int device_count = 0;
    if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
        std::fprintf(stderr, "dsv4-overlap-bench: no CUDA device\n");
        return 77;
    }
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    const int blocks = prop.multiProcessorCount;
    const size_t per = (size_t(mb) << 20) / size_t(blocks) / 16 * 16;
    const int max_steps = 16;
    const size_t chain_region = size_t(max_steps) * blocks * kChainBytes;

    cudaStream_t stream, side;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaEvent_t fork, join;
    check(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "cudaEventCreate");
    uint8_t *chain_w = nullptr, *product_w = nullptr;
    check(cudaMalloc(&chain_w, chain_region * kRegions), "cudaMalloc(chain)");
    check(cudaMalloc(&product_w, per * blocks * kRegions), "cudaMalloc(product)");
    check(cudaMemset(chain_w, 1, chain_region * kRegions), "cudaMemset");
    check(cudaMemset(product_w, 1, per * blocks * kRegions), "cudaMemset");
    float *values = nullptr, *out = nullptr;
    unsigned * done = nullptr;
    int * timed_out = nullptr;
    check(cudaMalloc(&values, size_t(2 * blocks) * sizeof(float)), "cudaMalloc");
    check(cudaMalloc(&out, size_t(blocks) * sizeof(float)), "cudaMalloc");
    check(cudaMalloc(&done, sizeof(unsigned)), "cudaMalloc");
    check(cudaMalloc(&timed_out, sizeof(int)), "cudaMalloc");
    check(cudaMemset(values, 0, size_t(2 * blocks) * sizeof(float)), "cudaMemset");
    check(cudaMemset(timed_out, 0, sizeof(int)), "cudaMemset");
    const size_t smem_room = size_t(prop.sharedMemPerBlockOptin) - (8 << 10);
    check(cudaFuncSetAttribute(preload_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_room)),
          "shared memory");

    std::printf(
        "%s, %d multiprocessors; a chain step: %d KB a block; the product: %.1f MB (%zu KB a block); us a "
        "replay\n",
        prop.name, blocks, kChainBytes >> 10, double(per * blocks) / 1e6, per >> 10);
    std::printf("%6s %10s %16s %s\n", "steps", "chain", "then product",
                "product beside the chain, preloading 0 / 64 / 128 / 192 KB a block");
    for (int steps : {4, 10, 16}) {
        auto chain = [&](int r, bool count) {
            Chain a{reinterpret_cast<const int4 *>(chain_w), size_t(r) * chain_region / 16, values, done};
            for (int s = 0; s < steps; ++s)
                check(launch_pdl(chain_kernel, blocks, kThreads, 0, true, stream, a, s, count && s == steps - 1),
                      "cudaLaunchKernelEx");
        };
        auto product = [&](int r, size_t preload) {
            return Product{product_w + size_t(r) * per * blocks,
                           per,
                           preload,
                           values + ((steps - 1) % 2) * blocks,
                           done,
                           out,
                           timed_out};
        };
        const double chain_us = replay_us(stream, [&](int r) { chain(r, false); });
        const double then_us = replay_us(stream, [&](int r) {
            chain(r, false);
            check(launch_pdl(product_kernel, blocks, kThreads, 0, true, stream, product(r, 0)), "cudaLaunchKernelEx");
        });
        std::printf("%6d %10.2f %16.2f", steps, chain_us, then_us);
        for (size_t kb : {0, 64, 128, 192}) {
            const size_t preload = std::min(std::min(kb << 10, per), smem_room) / kPiece * kPiece;
            const double us = replay_us(stream, [&](int r) {
                check(cudaMemsetAsync(done, 0, sizeof(unsigned), stream), "cudaMemsetAsync");
                check(cudaEventRecord(fork, stream), "cudaEventRecord");
                check(cudaStreamWaitEvent(side, fork), "cudaStreamWaitEvent");
                if (chain_first) chain(r, true);
                preload_kernel<<<blocks, kThreads, preload, side>>>(product(r, preload), depth);
                check(cudaGetLastError(), "preload_kernel");
                check(cudaEventRecord(join, side), "cudaEventRecord");
                if (!chain_first) chain(r, true);
                check(cudaStreamWaitEvent(stream, join), "cudaStreamWaitEvent");
            });
            std::printf(" %8.2f", us);
        }
        std::printf("\n");
    }
    int gave_up = 0;
    check(cudaMemcpy(&gave_up, timed_out, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
    if (gave_up) {
        std::fprintf(stderr, "dsv4-overlap-bench: a product's poll gave up: its chain never finished\n");
        return 1;
    }
    return 0;
}
