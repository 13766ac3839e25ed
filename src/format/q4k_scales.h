// Q4_K's packed sub-block scales, one definition for the CPU decoders (format/quant.cpp) and the CUDA decoders
// (backend/cuda/common.cuh, gemm.cu). Not for quant_avx2.cpp (quant_impl.h says why).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DSV4_HOST_DEVICE __host__ __device__
#else
#define DSV4_HOST_DEVICE
#endif

namespace dsv4 {

// The 6-bit scale and min of sub-block j (of 8), packed in the block's 12 scale bytes sc.
DSV4_HOST_DEVICE inline void q4k_scale_min(const uint8_t * sc, int j, int & s, int & m) {
    if (j < 4) {
        s = sc[j] & 63;
        m = sc[j + 4] & 63;
    } else {
        s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

}  // namespace dsv4
