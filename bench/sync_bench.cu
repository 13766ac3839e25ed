// dsv4-sync-bench: what one dependent step of a decode chain costs when the steps are kernels (as dsv4 runs them: a
// captured graph, with or without programmatic dependent launch) and when they are phases of one resident kernel
// separated by grid barriers (the persistent-kernel plan of docs/cuda.md, "What 70 % needs"). Every step of every
// variant does the same work: each block reads `bytes` of a buffer larger than L2 (cold weights) and one value that
// another block wrote in the step before (the dependency), and writes one value for the next step. One block a
// multiprocessor. Usage: dsv4-sync-bench [steps] (default 2000); prints µs a step for 0, 16 KB and 64 KB a block.
// Then a timeline of how far ahead programmatic dependent launch lets a chain's kernels in: one kernel that spins for
// 40 µs after its wait, followed by kernels that spin for 0 or 2 µs, each of every kernel's blocks releasing its
// successor before its own wait (as dsv4's kernels do); when each kernel's first block started and its last ended.
// The followers hold no shared memory, then 80 KB a block (two fit beside each other on a multiprocessor), then 80 KB
// with every kernel preferring the largest shared-memory carveout. Last, which blocks start beside another kernel's
// resident blocks: a kernel shaped like the ring kernel (a block a multiprocessor, 544 threads of ~75 registers, no
// or 205 KB of shared memory) spins for 40 µs and is followed by 16 blocks of 256 threads and 13 KB (the decode
// boundary's shape) of 17, 48 or 72 registers, as plain blocks or as one cluster of 16 (docs/cuda-journal.md, "Session
// 53": a block's warps are dealt over the multiprocessor's four register files, so the fullest file decides).
#include "bench_cuda.cuh"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

const char * const kBenchName = "dsv4-sync-bench";

namespace {

constexpr int kThreads = 256;
constexpr size_t kBufferBytes = size_t(1) << 30;  // cycled through so that each step's reads miss L2

struct Step {
    const int4 * w;    // the cold buffer
    size_t w16;        // its 16-byte units
    int bytes;         // read by each block a step
    float * values;    // [2][blocks]: step s writes values[s % 2][b] from values[(s + 1) % 2][(b + 1) % blocks]
    unsigned * count;  // the grid barrier's arrivals and generation
};

// One step of block b: its share of the cold reads, then the previous step's value of its neighbour.
__device__ __forceinline__ void step_body(const Step & a, int s) {
    const int b = int(blockIdx.x), blocks = int(gridDim.x);
    int acc = 0;
    const size_t per = size_t(a.bytes) / 16, base = (size_t(s) * blocks + b) * per % (a.w16 - per);
    for (size_t i = threadIdx.x; i < per; i += kThreads) acc ^= load_xor16(a.w + base + i);
    acc = block_xor<kThreads>(acc);
    if (threadIdx.x == 0) {
        const float prev = __ldcg(a.values + ((s + 1) % 2) * blocks + (b + 1) % blocks);
        __stcg(a.values + (s % 2) * blocks + b, prev + float(acc & 1));
    }
}

// A step as a kernel; with PDL it lets the next step's blocks in at once and waits for this one's predecessor.
template <bool PDL>
__global__ void __launch_bounds__(kThreads) step_kernel(Step a, int s) {
    if constexpr (PDL) {
        asm volatile("griddepcontrol.launch_dependents;");
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    step_body(a, s);
}

// Every step in one resident kernel (a cooperative launch: all blocks resident). After a step every block's thread 0
// arrives on the counter (a fence, then the atomic) and spins until the generation moves; the last to arrive resets
// the counter and moves it.
__global__ void __launch_bounds__(kThreads) persistent_kernel(Step a, int steps) {
    volatile unsigned * generation = a.count + 1;
    for (int s = 0; s < steps; ++s) {
        step_body(a, s);
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned gen = *generation;
            __threadfence();
            if (atomicAdd(a.count, 1u) == gridDim.x - 1) {
                a.count[0] = 0;
                __threadfence();
                atomicAdd(a.count + 1, 1u);
            } else {
                while (*generation == gen) {
                }
            }
            __threadfence();
        }
        __syncthreads();
    }
}

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Kernel k of the launch-depth probe: stamps its first block's start (before the wait) and its last block's end. Its
// dynamic shared memory is never touched: it only takes room on the multiprocessor.
__global__ void __launch_bounds__(kThreads)
    probe_kernel(unsigned long long * start, unsigned long long * end, int k, int spin_ns) {
    if (threadIdx.x == 0) atomicMin(start + k, now_ns());
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < static_cast<unsigned long long>(spin_ns)) {
    }
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(end + k, now_ns());
}

// kLive values a thread keeps in registers (loaded from sink, changed, and finally used), so that a kernel holds
// about that many registers.
template <int kLive>
struct LiveValues {
    float v[kLive];
    __device__ __forceinline__ void load(const float * sink) {
#pragma unroll
        for (int i = 0; i < kLive; ++i) v[i] = sink[(threadIdx.x + i) % 64];
    }
    __device__ __forceinline__ void touch() {
#pragma unroll
        for (int i = 0; i < kLive; ++i) v[i] = v[i] * 0.999f + 1.0f;
    }
    __device__ __forceinline__ void keep(float * sink) const {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < kLive; ++i) acc += v[i] * float(i + 1);
        if (acc == 12345.0f) sink[threadIdx.x % 64] = acc;  // never true: only keeps the values
    }
};

// The cluster probe's first kernel: the ring kernel's shape (a block a multiprocessor, 17 warps, ~75 registers a
// thread), spinning after its wait.
constexpr int kRingThreads = 544;
__global__ void __launch_bounds__(kRingThreads, 1)
    ring_shaped_kernel(unsigned long long * start, unsigned long long * end, float * sink, int spin_ns) {
    if (threadIdx.x == 0) atomicMin(start, now_ns());
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    LiveValues<64> live;
    live.load(sink);
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < static_cast<unsigned long long>(spin_ns)) live.touch();
    live.keep(sink);
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(end, now_ns());
}

// Its follower, plain or one cluster (which then meets at a cluster barrier, as the boundary's blocks do), with
// kLive values live across its wait (the boundary's mixing weights, loaded before it).
template <bool kCluster, int kLive>
__global__ void __launch_bounds__(kThreads)
    follower_kernel(unsigned long long * start, unsigned long long * end, float * sink) {
    if (threadIdx.x == 0) atomicMin(start + 1, now_ns());
    LiveValues<kLive> live;
    live.load(sink);
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if constexpr (kCluster) {
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
        asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    }
    live.keep(sink);
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(end + 1, now_ns());
}

template <class Enqueue>
float time_ms(cudaStream_t stream, Enqueue && enqueue) {
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    enqueue();  // warm-up
    check(cudaStreamSynchronize(stream), "warm-up");
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    enqueue();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms;
}

// The chain of kernels captured once as a graph, as a decode step replays it.
template <bool PDL>
float chain_ms(cudaStream_t stream, const Step & a, int blocks, int steps) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    for (int s = 0; s < steps; ++s) {
        check(launch_pdl(step_kernel<PDL>, blocks, kThreads, 0, PDL, stream, a, s), "cudaLaunchKernelEx");
    }
    check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    const float ms = time_ms(stream, [&] { check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch"); });
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return ms;
}

float persistent_ms(cudaStream_t stream, Step a, int blocks, int steps) {
    return time_ms(stream, [&] {
        void * args[] = {&a, &steps};
        check(cudaLaunchCooperativeKernel(reinterpret_cast<void *>(persistent_kernel), dim3(unsigned(blocks)),
                                          dim3(kThreads), args, 0, stream),
              "cudaLaunchCooperativeKernel");
    });
}

// The probe's graph: kernel 0 spins 40 µs, kernels 1.. spin `spin_ns` holding `smem` bytes a block; prints each
// kernel's start and end in µs from kernel 0's start (the second of two replays).
void probe_depth(cudaStream_t stream, int blocks, int kernels, int spin_ns, int smem, int carveout) {
    check(cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem");
    check(cudaFuncSetAttribute(probe_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout), "carveout");
    unsigned long long *start = nullptr, *end = nullptr;
    check(cudaMalloc(&start, size_t(kernels) * sizeof(unsigned long long)), "cudaMalloc(start)");
    check(cudaMalloc(&end, size_t(kernels) * sizeof(unsigned long long)), "cudaMalloc(end)");
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    check(cudaMemsetAsync(start, 0xff, size_t(kernels) * sizeof(unsigned long long), stream), "cudaMemsetAsync");
    check(cudaMemsetAsync(end, 0, size_t(kernels) * sizeof(unsigned long long), stream), "cudaMemsetAsync");
    for (int k = 0; k < kernels; ++k) {
        // the first kernel follows the memsets
        check(launch_pdl(probe_kernel, blocks, kThreads, k > 0 ? size_t(smem) : 0, k > 0, stream, start, end, k,
                         k == 0 ? 40000 : spin_ns),
              "cudaLaunchKernelEx");
    }
    check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    for (int replay = 0; replay < 2; ++replay) check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(cudaStreamSynchronize(stream), "probe");
    std::vector<unsigned long long> s(static_cast<size_t>(kernels)), e(static_cast<size_t>(kernels));
    check(cudaMemcpy(s.data(), start, s.size() * sizeof(s[0]), cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(cudaMemcpy(e.data(), end, e.size() * sizeof(e[0]), cudaMemcpyDeviceToHost), "cudaMemcpy");
    std::printf(
        "kernels after a 40 us one spinning %.1f us each, %d KB a block, carveout %d, %d blocks: start..end "
        "in us from the first's start\n",
        spin_ns / 1e3, smem >> 10, carveout, blocks);
    for (int k = 0; k < kernels; ++k)
        std::printf("  %d: %7.2f .. %7.2f\n", k, double(s[size_t(k)] - s[0]) / 1e3, double(e[size_t(k)] - s[0]) / 1e3);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(start);
    cudaFree(end);
}

// The cluster probe: the ring-shaped kernel holding `ring_smem` bytes a block for 40 µs, then 16 follower blocks of
// 13 KB, plain or one cluster, with few or many registers; prints when the followers started and ended (µs from the
// first kernel's start; it ends at ~40).
template <int kLive>
void probe_cluster(cudaStream_t stream, int blocks, int ring_smem, bool cluster, float * sink) {
    const int follower_smem = 13 << 10, followers = 16;
    check(cudaFuncSetAttribute(ring_shaped_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ring_smem), "smem");
    const auto follower = cluster ? follower_kernel<true, kLive> : follower_kernel<false, kLive>;
    check(cudaFuncSetAttribute(follower, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "cluster size");
    cudaFuncAttributes ring_attr, follower_attr;
    check(cudaFuncGetAttributes(&ring_attr, ring_shaped_kernel), "cudaFuncGetAttributes");
    check(cudaFuncGetAttributes(&follower_attr, follower), "cudaFuncGetAttributes");
    unsigned long long *start = nullptr, *end = nullptr;
    check(cudaMalloc(&start, 2 * sizeof(unsigned long long)), "cudaMalloc(start)");
    check(cudaMalloc(&end, 2 * sizeof(unsigned long long)), "cudaMalloc(end)");
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    check(cudaMemsetAsync(start, 0xff, 2 * sizeof(unsigned long long), stream), "cudaMemsetAsync");
    check(cudaMemsetAsync(end, 0, 2 * sizeof(unsigned long long), stream), "cudaMemsetAsync");
    check(
        launch_pdl(ring_shaped_kernel, blocks, kRingThreads, size_t(ring_smem), false, stream, start, end, sink, 40000),
        "cudaLaunchKernelEx");
    check(launch_pdl_cluster(follower, followers, kThreads, size_t(follower_smem), true,
                             cluster ? unsigned(followers) : 1u, stream, start, end, sink),
          "cudaLaunchKernelEx(follower)");
    check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    for (int replay = 0; replay < 2; ++replay) check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(cudaStreamSynchronize(stream), "cluster probe");
    unsigned long long s[2], e[2];
    check(cudaMemcpy(s, start, sizeof s, cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(cudaMemcpy(e, end, sizeof e, cudaMemcpyDeviceToHost), "cudaMemcpy");
    std::printf(
        "  %3d KB, %3d registers a ring-shaped thread; followers %s of %3d registers: %7.2f .. %7.2f; the "
        "first kernel ends %7.2f\n",
        ring_smem >> 10, ring_attr.numRegs, cluster ? "one cluster of 16" : "16 plain blocks  ", follower_attr.numRegs,
        double(s[1] - s[0]) / 1e3, double(e[1] - s[0]) / 1e3, double(e[0] - s[0]) / 1e3);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(start);
    cudaFree(end);
}

}  // namespace

int main(int argc, char ** argv) {
    const int steps = argc > 1 ? std::atoi(argv[1]) : 2000;
    if (steps <= 0) {
        std::fprintf(stderr, "usage: dsv4-sync-bench [steps > 0]\n");
        return 2;
    }
    int device_count = 0;
    if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
        std::fprintf(stderr, "dsv4-sync-bench: no CUDA device\n");
        return 77;
    }
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    const int blocks = prop.multiProcessorCount;
    cudaStream_t stream;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    Step a = {};
    void * w = nullptr;
    check(cudaMalloc(&w, kBufferBytes), "cudaMalloc(buffer)");
    check(cudaMemset(w, 1, kBufferBytes), "cudaMemset");
    a.w = static_cast<const int4 *>(w);
    a.w16 = kBufferBytes / 16;
    check(cudaMalloc(&a.values, size_t(2 * blocks) * sizeof(float)), "cudaMalloc(values)");
    check(cudaMemset(a.values, 0, size_t(2 * blocks) * sizeof(float)), "cudaMemset");
    check(cudaMalloc(&a.count, 2 * sizeof(unsigned)), "cudaMalloc(count)");
    check(cudaMemset(a.count, 0, 2 * sizeof(unsigned)), "cudaMemset");
    std::printf("%s, %d multiprocessors, %d blocks of %d threads, %d steps; us a step\n", prop.name, blocks, blocks,
                kThreads, steps);
    std::printf("%12s %12s %12s %12s %14s\n", "bytes/block", "MB/step", "graph", "graph+PDL", "grid barriers");
    for (int bytes : {0, 16 << 10, 64 << 10}) {
        a.bytes = bytes;
        const double us = 1e3 / steps;
        std::printf("%12d %12.2f %12.2f %12.2f %14.2f\n", bytes, double(bytes) * blocks / 1e6,
                    chain_ms<false>(stream, a, blocks, steps) * us, chain_ms<true>(stream, a, blocks, steps) * us,
                    persistent_ms(stream, a, blocks, steps) * us);
    }
    for (int smem : {0, 80 << 10})
        for (int spin_ns : {0, 2000}) probe_depth(stream, blocks, 8, spin_ns, smem, cudaSharedmemCarveoutDefault);
    for (int spin_ns : {0, 2000}) probe_depth(stream, blocks, 8, spin_ns, 80 << 10, cudaSharedmemCarveoutMaxShared);
    std::printf(
        "a cluster beside resident blocks: a ring-shaped kernel (%d blocks of %d threads) for 40 us, then 16 "
        "blocks of %d threads and 13 KB under PDL; us from its start\n",
        blocks, kRingThreads, kThreads);
    float * sink = nullptr;
    check(cudaMalloc(&sink, 64 * sizeof(float)), "cudaMalloc(sink)");
    check(cudaMemset(sink, 0, 64 * sizeof(float)), "cudaMemset");
    for (int ring_smem : {0, 205 << 10})
        for (bool cluster : {false, true}) {
            probe_cluster<8>(stream, blocks, ring_smem, cluster, sink);
            probe_cluster<40>(stream, blocks, ring_smem, cluster, sink);
            probe_cluster<72>(stream, blocks, ring_smem, cluster, sink);
        }
    return 0;
}
