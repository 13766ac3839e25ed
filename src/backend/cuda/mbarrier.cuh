// Shared-memory addresses, mbarriers and bulk copies into shared memory (sm_90 and later): one copy for the CUDA
// backend (the ring kernel, matvec.cu) and the CUDA microbenchmarks (bench/bench_cuda.cuh). Global namespace and
// no other dsv4 header, so that the benchmarks build on it alone.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

__device__ __forceinline__ uint32_t smem_addr(const void * p) { return uint32_t(__cvta_generic_to_shared(p)); }

// mbarriers [0, n), each completing a phase after `arrivals` arrivals, visible to the bulk copies once this returns.
__device__ __forceinline__ void mbarriers_init(uint64_t * bars, int n, uint32_t arrivals = 1) {
    for (int i = 0; i < n; ++i)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&bars[i])), "r"(arrivals) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival on bar that also makes its phase wait for `bytes` more of bulk copies.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t * bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// A plain arrival on bar.
__device__ __forceinline__ void mbarrier_arrive(uint64_t * bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// The L2 policy of weights, read once a step: first in line for eviction, so that the activations, streams and KV
// rows the small kernels read between the products stay in L2 (bulk_copy here, matvec.cu's ldg16 loads).
__device__ __forceinline__ uint64_t l2_evict_first() {
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// Copies bytes from global memory to dst in shared memory, counted on bar (whose phase must expect them), with the
// weights' L2 policy.
__device__ __forceinline__ void bulk_copy(void * dst, const void * src, uint32_t bytes, uint64_t * bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
            "r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(l2_evict_first())
        : "memory");
}

// Copies bytes from global memory to dst in shared memory; bar completes its phase when they have landed.
__device__ __forceinline__ void bulk_copy_to_shared(void * dst, const void * src, uint32_t bytes, uint64_t * bar) {
    mbarrier_expect_bytes(bar, bytes);
    bulk_copy(dst, src, bytes, bar);
}

// Spins until bar's phase of the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t * bar, uint32_t parity) {
    uint32_t done = 0;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    } while (!done);
}

// A place in a ring of `slots` shared-memory slots, each with a full and an empty mbarrier: the slot, the parity of
// its current phase, and whether the ring has wrapped (a producer then waits for the slot's consumers first). No
// division a step: a producer thread issues every copy on a scheduler it shares with consumer warps.
struct RingPlace {
    int slot = 0;
    uint32_t phase = 0;
    bool reused = false;
    __device__ __forceinline__ void next(int slots) {
        if (++slot == slots) {
            slot = 0;
            phase ^= 1u;
            reused = true;
        }
    }
};
