// Launch attributes for cudaLaunchKernelEx: programmatic dependent launch and thread-block clusters (sm_90 and
// later). One copy for the CUDA backend's launches (common.cuh) and the CUDA microbenchmarks (bench/bench_cuda.cuh);
// global namespace and no other dsv4 header, so that the benchmarks build on it alone.
#pragma once

#include <cuda_runtime.h>

// Lets the kernel start before the previous kernel of its stream ends; the kernel then waits for it itself.
inline cudaLaunchAttribute pdl_attr() {
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    return attr;
}

// Groups a grid's blocks into clusters of x blocks along x.
inline cudaLaunchAttribute cluster_dim_attr(unsigned x) {
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = x;
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    return attr;
}
