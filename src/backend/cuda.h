// The CUDA backend: every op of backend.h on one NVIDIA GPU (sm_90 H100/H200, sm_120, sm_121 GB10).
// Design, memory plan and measured numbers: docs/cuda.md.
#pragma once

#include "backend/backend.h"

#include <cstdint>
#include <memory>
#include <string>

namespace dsv4 {

struct CudaBackendOptions {
    int device = 0;      // CUDA device index (--gpu)
    bool graphs = true;  // replay run_captured() sequences as CUDA graphs (false: always eager)
    // Products of many tokens (prefill) on the tensor cores with f16 activations, and the indexer's scores (prefill
    // and decode) from f16 queries and keys; false: every product on the integer dot products with 8-bit
    // activations, the CPU backend's quantized arithmetic, and the indexer in f32. The engine turns it on with the
    // official numerics, whose FP4-rounded indexer values f16 holds exactly.
    bool tensor_cores = true;
    // After copying each piece of a weight, give the source pages back to the kernel (MADV_PAGEOUT on the mapped
    // file), so the weights are not held twice. Always on for an integrated GPU (GB10: device memory and the page
    // cache share the same 128 GB); tests turn it on elsewhere.
    bool release_host_pages = false;
};

// Number of usable CUDA devices; 0 when the driver or runtime is missing or reports none (never throws).
int cuda_device_count();

// Throws dsv4::Error when the device does not exist or cannot be initialised.
std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions & options = {});

// For `dsv4 --version`: runtime and driver versions and one line per GPU (name, compute capability, memory),
// or a line saying why there is none.
std::string cuda_device_summary();

// Whether a CUDA backend with tensor_cores on runs a product of n tokens (weights of this type, rows of width k)
// on the tensor cores rather than on the integer dot products; the same for an expert layer of n_pairs
// (token, expert) pairs, and for attention over n tokens with heads of head_dim channels and up to `keys` keys a
// token (the window plus the selected or stored compressed rows; f16 queries, keys and probabilities instead of
// f32). Tests choose their reference by it.
bool cuda_tensor_core_product(GgmlType type, int64_t k, int64_t n);
bool cuda_tensor_core_moe(GgmlType gate, GgmlType down, int64_t dim, int64_t inner, int64_t n_pairs, int64_t n_expert);
bool cuda_tensor_core_attention(int64_t head_dim, int64_t n, int64_t keys);

// Free and total memory of a device in bytes; {0, 0} when it cannot be queried. A discrete GPU's are its own
// (cudaMemGetInfo). An integrated GPU's memory is the host's (GB10), where cudaMemGetInfo counts the page cache as
// used (NVIDIA's DGX Spark known issues): right after a model file is read, most of the 128 GB would look taken,
// and on GB10 the call can fail outright. There free is the host's MemAvailable and total the device's
// totalGlobalMem.
struct CudaMemoryInfo {
    uint64_t free_bytes = 0;
    uint64_t total_bytes = 0;
    bool integrated = false;  // device memory is host memory, shared with the OS and the process's CPU side
};
CudaMemoryInfo cuda_memory_info(int device);

// Bytes of device scratch the CUDA backend allocates beside the model's own buffers for chunks of n_ubatch
// tokens (MoE gather buffers, attention split partials, indexer scores over n_ctx / ratio rows, a prefill
// product's weight or a batch of routed experts decoded to f16 for cuBLAS) and the weight upload's device staging: what
// a memory plan adds to the weights, the KV state and the model's workspace.
struct CudaScratchShape {
    int64_t n_ubatch = 1, n_ctx = 0, n_embd = 0, expert_ff = 0, n_expert = 0, n_expert_used = 0, n_head = 0,
            head_dim = 0, min_ratio = 0;
    int64_t dense_weight = 0;  // values of the largest dense (non-expert) projection weight but the output head
    int64_t lanes = 1;         // sequences that decode together (the sessions): a batched step's lanes
};
uint64_t cuda_scratch_bytes(const CudaScratchShape & s);

}  // namespace dsv4
