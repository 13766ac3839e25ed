// Synthetic models: GGUF files of any DeepSeek V4 shape (the real V4 Flash one by default) with seeded random
// weights, in the llama.cpp-compatible deepseek4 layout, for benchmarks (dsv4-bench, llama-bench on the same
// file), the default model of scripts/run.sh and tests. Writing streams tensor by tensor: an 81 GB 43-layer q2
// file needs no more memory than a few rows.
//
// Weights are scaled like the oracle's tiny models (../shared/oracle/make_reference.py init rules) so that every
// block sees O(1) activations and long runs stay finite: linear N(0, 1/fan_in), embeddings N(0, 1), norms near 1,
// HC mixing N(0, 1/(hc·D)), router N(0, 1.5²/D). Quantized experts are drawn directly as random codes of the
// target type with scales that give the same RMS (quantizing 80 GB of random floats to IQ2_XXS would take hours).
#pragma once

#include "model/config.h"
#include "model/layout.h"

#include <cstdint>
#include <functional>
#include <string>

namespace dsv4 {

// DeepSeek V4 Flash with n_layer layers: 4096 wide, vocabulary 129280, 64 heads × 512, q rank 1024, 8 output groups
// × 1024, 256 experts × 2048 (6 used + 1 shared), indexer 64 × 128 top-512, window 128, 4 HC streams, layers 0-1
// sliding, then CSA (ratio 4) on even and HCA (ratio 128) on odd layers, 3 hash-routed layers.
ModelConfig flash_config(int64_t n_layer);

// A small model with V4's structure (sliding, CSA and HCA layers, hash routing, HC, MTP-ready) for trying the
// software and for tests: 256 wide, 4 heads × 128, 8 experts × 256 (2 used), the real window and ratios.
ModelConfig mini_config(int64_t n_layer, int64_t n_vocab);

struct SynthOptions {
    ModelConfig config;
    StorageMix mix = StorageMix::q2;
    uint64_t seed = 1;
    std::string vocab_path;     // copy tokenizer.* metadata from this GGUF (its size must match config.n_vocab)
    bool mtp_in_file = false;   // add an MTP block in llama.cpp's layout (blk.{n_layer}.*, nextn.*)
    std::string mtp_path;       // or write one in ds4's separate-file layout (mtp.0.*) here
    std::function<void(uint64_t done, uint64_t total)> progress;  // bytes of tensor data
};

// Writes the model (and the separate MTP file when asked); returns the bytes of tensor data written.
uint64_t write_synthetic_model(const SynthOptions & options, const std::string & path);

}  // namespace dsv4
