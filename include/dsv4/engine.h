// dsv4's public engine API: load a model once, then run sessions (KV timelines) on it.
//
// A Session is one sequence: it evaluates tokens, keeps the logits of the last one, and can be synced to any
// token prefix (reusing what it already holds), snapshotted to bytes and restored. Sessions of one Engine share
// its weights; a session is used by one thread at a time. No tensor or backend type appears here.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

class Tokenizer;

struct EngineOptions {
    std::string model_path;          // GGUF model file
    std::string mtp_path;            // optional: ds4's separate MTP GGUF
    std::string backend = "auto";    // cpu, cuda, auto (cuda when a GPU is present)
    int gpu = 0;                     // device index for cuda
    int n_threads = 0;               // cpu threads (0: all)
    int64_t n_ubatch = 256;          // largest chunk evaluated at once (prefill); scratch is sized for it
    std::string numerics = "official";  // "official" (DeepSeek's KV/indexer rounding) or "reference" (HF, exact)
    bool quantize_activations = true;   // cpu: 8-bit activations for quantized weights (faster)
};

struct ModelInfo {
    std::string name;
    std::string path;
    std::string backend;   // e.g. "cpu (avx2)"
    std::string numerics;
    int64_t n_vocab = 0;
    int64_t n_layer = 0;
    int64_t n_embd = 0;
    int64_t n_ctx_train = 0;
    bool has_mtp = false;
    uint64_t weight_bytes = 0;
};

// Receives (tokens done, tokens total) during long evaluations; returning false cancels.
using ProgressFn = std::function<bool(int64_t done, int64_t total)>;

class Session {
  public:
    virtual ~Session() = default;

    virtual int64_t n_ctx() const = 0;
    virtual int64_t n_past() const = 0;
    virtual const std::vector<int32_t> & tokens() const = 0;  // the tokens the state covers

    // Evaluates tokens after the current ones. With all_logits, logits() then holds one row per token of this
    // call; otherwise the last token's row. Returns false when cancelled by `progress` (the state then covers
    // the chunks that finished). Throws dsv4::Error on bad input (ids outside the vocabulary, context full).
    virtual bool eval(std::span<const int32_t> tokens, bool all_logits = false, const ProgressFn & progress = {}) = 0;

    // Brings the state to exactly `tokens`: keeps the longest common prefix it can reuse and evaluates the rest.
    // Returns the number of tokens reused. Logits are those of the last token.
    virtual int64_t sync(std::span<const int32_t> tokens, const ProgressFn & progress = {}) = 0;

    virtual std::span<const float> logits() const = 0;  // [rows, n_vocab] of the last eval
    virtual void clear() = 0;

    // Snapshot of the state and its tokens; restore() validates it (checksum, model shape) before use.
    virtual std::string snapshot() const = 0;
    virtual void restore(std::string_view bytes) = 0;
};

class Engine {
  public:
    // Loads the model. `progress` (may be empty) gets load progress in [0, 1].
    static std::unique_ptr<Engine> open(const EngineOptions & options,
                                        const std::function<void(double)> & progress = {});
    virtual ~Engine() = default;

    virtual const ModelInfo & info() const = 0;
    // The model file's tokenizer, or null when the file carries none.
    virtual const Tokenizer * tokenizer() const = 0;
    virtual std::unique_ptr<Session> new_session(int64_t n_ctx) = 0;
};

// "dsv4 <version> (<commit>)" and the backends compiled in.
std::string version_string();

}  // namespace dsv4
