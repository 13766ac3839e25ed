// dsv4's public engine API: load a model once, then run sessions (KV timelines) on it.
//
// A Session is one sequence: it evaluates tokens, keeps the logits of the last one, can be synced to a token sequence
// (reusing what it holds when the sequence extends it), snapshotted to bytes and restored. The compressed KV state
// cannot be rolled back: rewinding a session means restoring an earlier snapshot or evaluating again. Sessions of one
// Engine share its weights; a session is used by one thread at a time. No tensor or backend type appears here.
//
// Around it: dsv4/sampler.h draws tokens from the logits; engine/scheduler.h (one inference thread owning every
// session, prefix reuse, the disk KV cache, streaming text) is what the server and the chat command line run on.
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
    std::string model_path;        // GGUF model file
    std::string mtp_path;          // optional: ds4's separate MTP GGUF
    std::string backend = "auto";  // cpu, cuda, auto (cuda when a GPU is present)
    int gpu = 0;                   // device index for cuda
    int n_threads = 0;             // cpu threads (0: all)
    // Largest chunk evaluated at once (prefill; scratch is sized for it). 0: 2048 on CUDA, 256 on the CPU.
    int64_t n_ubatch = 0;
    std::string numerics = "official";  // "official" (DeepSeek's KV/indexer rounding) or "reference" (HF, exact)
    bool quantize_activations = true;   // cpu: 8-bit activations for quantized weights (faster)
};

struct ModelInfo {
    std::string name;
    std::string path;
    std::string backend;  // e.g. "cpu (avx2)"
    std::string numerics;
    int64_t n_vocab = 0;
    int64_t n_layer = 0;
    int64_t n_embd = 0;
    int64_t n_ctx_train = 0;
    bool has_mtp = false;
    uint64_t weight_bytes = 0;
    int64_t n_ubatch = 0;
    std::string description;      // general.description
    bool random_weights = false;  // a dsv4-synth model: real shapes and vocabulary, untrained weights
    std::string chat_template;    // deepseek4.chat_template_version: "v4" (default) or "v4-0731"
    // Identifies the model for KV snapshots kept across runs: the tensor table, the file size, samples of the
    // weights and the numerics. A snapshot made under another fingerprint is foreign and never restored.
    uint64_t fingerprint = 0;
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

    // Brings the state to exactly `tokens`: when they extend what the state holds, evaluates only the rest; otherwise
    // starts over. Returns the number of tokens reused. Logits are those of the last token.
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

    // Bytes one session of n_ctx tokens allocates (its KV state), for planning memory before creating it.
    virtual uint64_t session_bytes(int64_t n_ctx) const = 0;
    // The most GPU memory the engine has held at once (weights, KV states, workspace, scratch); 0 on the CPU.
    virtual uint64_t peak_device_bytes() const = 0;
    // Free GPU memory now (the weights and the workspace already allocated): where new sessions' KV states go.
    // 0 on the CPU backend, whose sessions live in host memory.
    virtual uint64_t device_free_bytes() const = 0;
    // The largest context (a multiple of kContextStep, at most the trained context when the file names one) for
    // which n_sessions sessions fit in memory_bytes; 0 when not even kContextStep fits.
    int64_t plan_context(uint64_t memory_bytes, int n_sessions) const;
    static constexpr int64_t kContextStep = 4096;
};

// "dsv4 <version> (<commit>)" and the backends compiled in.
std::string version_string();

}  // namespace dsv4
