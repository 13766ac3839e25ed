// HF checkpoint → GGUF conversion (the `dsv4-convert` tool).
//
// Reads a checkpoint folder (config.json plus model.safetensors or shards) in either naming:
//   - transformers' `deepseek_v4` (model.layers.N.self_attn.q_a_proj.weight, experts.gate_up_proj [E, 2I, D], ...)
//   - DeepSeek's official inference checkpoint (layers.N.attn.wq_a.weight, FP8 E4M3 weights with 128×128 E8M0
//     block scales, routed experts as packed FP4 E2M1 with an E8M0 scale per 32 values, ModelArgs config)
// and writes a GGUF in the llama.cpp-compatible `deepseek4` layout (tensor names, metadata keys, I32 token→expert
// tables), streaming tensor by tensor so that a checkpoint of any size converts in bounded memory.
#pragma once

#include "model/layout.h"

#include <functional>
#include <string>

namespace dsv4 {

struct ConvertOptions {
    StorageMix mix = StorageMix::f32;  // q2: ds4's mix (IQ2_XXS gate/up, Q2_K down); q4: Q4_K experts
    std::string vocab_path;  // a GGUF whose tokenizer.* metadata is copied (empty: none)
    std::string name;        // general.name (empty: the folder's name)
    // Called with (bytes written so far, total bytes) while tensor data is written.
    std::function<void(uint64_t, uint64_t)> progress;
};

struct ConvertStats {
    size_t n_tensors = 0;
    uint64_t bytes = 0;
    size_t n_fallbacks = 0;  // tensors stored in a wider type because their rows do not fit the chosen blocks
};

// A layout slot's tensor name in transformers' naming and in DeepSeek's (without the "model.layers.N." /
// "layers.N." prefix of layer tensors); null for the routed experts (stacked in transformers, one matrix per expert
// in DeepSeek's files: layers.N.ffn.experts.E.w1/w2/w3) and MTP slots.
std::pair<const char *, const char *> checkpoint_tensor_names(Slot slot);

ConvertStats convert_checkpoint(const std::string & input_dir, const std::string & output_path,
                                const ConvertOptions & options);

}  // namespace dsv4
