// Pieces the CUDA microbenchmarks share (dsv4-stream-bench, dsv4-sync-bench, dsv4-overlap-bench, dsv4-chain-bench):
// a fatal check of CUDA calls, cold 16-byte loads whose values are XOR-folded so that they are not dropped, and
// launches under programmatic dependent launch; the launch attributes, bulk copies and mbarriers come from the
// backend's launch_attrs.cuh and mbarrier.cuh.
#pragma once

#include "backend/cuda/launch_attrs.cuh"
#include "backend/cuda/mbarrier.cuh"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

// The benchmark's name in its error messages (each one defines it).
extern const char * const kBenchName;

// Exits with a message naming the call when a CUDA call failed.
inline void check(cudaError_t e, const char * what) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "%s: %s: %s\n", kBenchName, what, cudaGetErrorString(e));
        std::exit(1);
    }
}

// blocks × threads of kernel on s with smem bytes of dynamic shared memory; with pdl, under programmatic dependent
// launch (the kernel may start before its predecessor ends and must wait for it itself); with cluster > 1, in
// thread-block clusters of that many blocks.
template <typename... Params, typename... Args>
cudaError_t launch_pdl_cluster(void (*kernel)(Params...), int blocks, int threads, size_t smem, bool pdl,
                               unsigned cluster, cudaStream_t s, Args... args) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(unsigned(blocks));
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = smem;
    config.stream = s;
    cudaLaunchAttribute attributes[2] = {};
    unsigned n = 0;
    if (pdl) attributes[n++] = pdl_attr();
    if (cluster > 1) attributes[n++] = cluster_dim_attr(cluster);
    config.attrs = attributes;
    config.numAttrs = n;
    return cudaLaunchKernelEx(&config, kernel, args...);
}
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), int blocks, int threads, size_t smem, bool pdl, cudaStream_t s,
                       Args... args) {
    return launch_pdl_cluster(kernel, blocks, threads, smem, pdl, 1, s, args...);
}

// 16 bytes read past L1 (weights are read once), folded into one int.
__device__ __forceinline__ int load_xor16(const int4 * p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v.x ^ v.y ^ v.z ^ v.w;
}

// The XOR of every thread's acc, in thread 0 (THREADS threads a block, every one calling).
template <int THREADS>
__device__ int block_xor(int acc) {
    __shared__ int part[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < THREADS / 32; ++w) acc ^= part[w];
    return acc;
}
