// dsv4-stream-bench: how fast one launch reads N MB of weights that are not in L2, by the two ways a decode product
// can stream them (docs/cuda-journal.md, "Decode, session 13"):
//   ldg  every thread loads 16-byte chunks into registers (the row-group kernel's way), grid-stride, 4 steps unrolled;
//   tma  a block per multiprocessor (or two) owns a contiguous range and one thread keeps S stages of B bytes in
//        flight with cp.async.bulk copies into shared memory, their arrival counted on mbarriers (the stream kernel's
//        way); with --touch 1 the block's threads also read every stage from shared memory.
// The consumers do almost no arithmetic: this measures the memory path alone. Launches rotate over buffers of more
// than 600 MB in all, so every launch reads cold data as a decode step does. Usage: dsv4-stream-bench [MB] (36: one
// 1024 x 32768 Q8_0 product; 560: the LM head).
#include "bench_cuda.cuh"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

const char * const kBenchName = "dsv4-stream-bench";

namespace {

// The XOR of everything read, stored only if it equals a value it never takes, so that the loads are not dropped.
__device__ __forceinline__ void keep(int acc, int * sink) {
    if (acc == 0x12345678) *sink = acc;
}

__global__ void ldg_kernel(const int4 * __restrict__ w, size_t n16, int * sink) {
    int acc = 0;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
#pragma unroll 4
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride) {
        acc ^= load_xor16(w + i);
    }
    keep(acc, sink);
}

// Block b streams [b·per, (b+1)·per) in stages of `stage` bytes, `depth` of them in flight.
__global__ void tma_kernel(const uint8_t * w, size_t per, int stage, int depth, int touch, int * sink) {
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ uint64_t full[16];
    const uint8_t * src = w + size_t(blockIdx.x) * per;
    const int n = int(per / size_t(stage));
    auto issue = [&](int s) {
        bulk_copy_to_shared(ring + size_t(s % depth) * stage, src + size_t(s) * stage, uint32_t(stage),
                            &full[s % depth]);
    };
    if (threadIdx.x == 0) {
        mbarriers_init(full, depth);
        for (int s = 0; s < depth && s < n; ++s) issue(s);
    }
    __syncthreads();
    int acc = 0;
    for (int s = 0; s < n; ++s) {
        mbarrier_wait(&full[s % depth], uint32_t(s / depth) & 1);
        if (touch) {
            const int4 * st = reinterpret_cast<const int4 *>(ring + size_t(s % depth) * stage);
            for (int i = int(threadIdx.x); i < stage / 16; i += int(blockDim.x)) {
                const int4 v = st[i];
                acc ^= v.x ^ v.y ^ v.z ^ v.w;
            }
        }
        __syncthreads();  // the stage is read: refill it
        if (threadIdx.x == 0 && s + depth < n) issue(s + depth);
    }
    keep(acc, sink);
}

}  // namespace

int main(int argc, char ** argv) {
    const long mb = argc > 1 ? std::atol(argv[1]) : 36;
    if (mb < 1 || mb > 4096) {
        std::fprintf(stderr, "usage: dsv4-stream-bench [MB, 1..4096]\n");
        return 2;
    }
    const size_t bytes = size_t(mb) << 20;
    const int n_buf = int((size_t(600) << 20) / bytes) + 1;
    std::vector<uint8_t *> buf(size_t(n_buf), nullptr);
    for (uint8_t *& b : buf) {
        check(cudaMalloc(&b, bytes), "cudaMalloc");
        check(cudaMemset(b, 1, bytes), "cudaMemset");
    }
    int * sink = nullptr;
    int sms = 0;
    check(cudaMalloc(&sink, 4), "cudaMalloc");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device attribute");
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    // Mean time of a launch over 4 rounds of all buffers, after one warm-up round.
    auto time_us = [&](auto launch) {
        for (int i = 0; i < n_buf; ++i) launch(buf[size_t(i)]);
        cudaEventRecord(e0);
        const int reps = 4 * n_buf;
        for (int i = 0; i < reps; ++i) launch(buf[size_t(i % n_buf)]);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        return double(ms) * 1000.0 / reps;
    };
    std::printf("%ld MB a launch, %d buffers, %d multiprocessors\n", mb, n_buf, sms);
    for (int per_sm : {4, 8})
        for (int threads : {256, 1024}) {
            if (per_sm * threads > 2048) continue;
            const double us = time_us([&](uint8_t * w) {
                ldg_kernel<<<sms * per_sm, threads>>>(reinterpret_cast<const int4 *>(w), bytes / 16, sink);
            });
            std::printf("ldg  blocks/SM %d threads %4d:                           %8.2f us  %5.0f GB/s\n", per_sm,
                        threads, us, double(bytes) / us / 1e3);
        }
    for (int touch : {0, 1})
        for (int threads : {256, 1024})
            for (int stage : {8192, 16384, 32768, 65536})
                for (int depth : {2, 4, 8})
                    for (int per_sm : {1, 2}) {
                        const size_t smem = size_t(stage) * size_t(depth);
                        if (smem * size_t(per_sm) > 220 * 1024) continue;
                        const int blocks = sms * per_sm;
                        const size_t per = bytes / size_t(blocks) / size_t(stage) * size_t(stage);
                        check(cudaFuncSetAttribute(tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                              "shared memory");
                        const double us = time_us([&](uint8_t * w) {
                            tma_kernel<<<blocks, threads, smem>>>(w, per, stage, depth, touch, sink);
                        });
                        std::printf("tma  touch %d threads %4d stage %5d x %d blocks/SM %d: %8.2f us  %5.0f GB/s\n",
                                    touch, threads, stage, depth, per_sm, us, double(per) * blocks / us / 1e3);
                    }
    check(cudaDeviceSynchronize(), "run");
    return 0;
}
