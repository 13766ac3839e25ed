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

#include "dsv4/sampler.h"

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
    // Largest chunk evaluated at once (prefill; scratch is sized for it). 0: 256 on the CPU; on CUDA 2048, or
    // the 8192 that Engine::plan picks when the planned context fits with it (callers that plan pass its
    // n_ubatch on to Engine::open).
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

// The memory a model needs for a context, computed from the file's header before anything is loaded: what
// `dsv4 --plan` prints, and what the server and the chat check at start so that a context that cannot fit is
// refused then, with the largest one that would, rather than failing at the first long prompt.
struct MemoryPlan {
    std::string device;  // where it must fit: "gpu N (name)" or "host memory"
    int64_t n_ctx = 0;
    int64_t n_ubatch = 0;
    int n_sessions = 1;
    uint64_t weights = 0;  // the file's tensors (a GPU holds a copy; the CPU maps the file, which must stay resident)
    // One session's state: raw sliding-window rings, compressed rows, indexer keys, compressor frontiers, and the
    // last token's logits (kept beside the state for sampling).
    uint64_t kv_raw = 0, kv_compressed = 0, kv_indexer = 0, kv_frontier = 0, kv_logits = 0;
    uint64_t workspace = 0;  // the model's activations for one chunk of n_ubatch tokens
    uint64_t scratch = 0;    // the backend's own buffers (CUDA: MoE and attention scratch, upload staging)
    uint64_t available = 0;  // free GPU memory, or the host's MemAvailable
    uint64_t reserve = 0;    // kept free for the runtime, captured graphs, the process itself
    int64_t max_ctx = 0;     // largest context (a multiple of Engine::kContextStep) that fits n_sessions; 0: none

    uint64_t kv_per_session() const { return kv_raw + kv_compressed + kv_indexer + kv_frontier + kv_logits; }
    uint64_t total() const { return weights + uint64_t(n_sessions) * kv_per_session() + workspace + scratch; }
    bool fits() const { return total() + reserve <= available; }
    // A multi-line table of the above, for people.
    std::string describe() const;
    // Throws dsv4::Error naming what does not fit and the largest context that would, when !fits().
    void require_fit() const;
};

// Where loading the weights stands: bytes in backend memory (copied to the GPU, or mapped on the CPU) of all the
// file's tensor bytes, and the time since loading began.
struct LoadProgress {
    uint64_t bytes_done = 0;
    uint64_t bytes_total = 0;
    double seconds = 0;
    double fraction() const { return bytes_total ? double(bytes_done) / double(bytes_total) : 0.0; }
    double gb_per_s() const { return seconds > 0 ? double(bytes_done) / 1e9 / seconds : 0.0; }
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

    // [rows, n_vocab] of the last eval: every row after eval(all_logits), else the last token's. On a GPU the row
    // is read from the device on the first call after an eval (sample() usually makes that unnecessary).
    virtual std::span<const float> logits() const = 0;
    // Whether the state ends in logits to sample from (false after clear() or a cancelled eval).
    virtual bool has_logits() const = 0;
    // Draws the next token from the last token's logits. On a GPU only the kSampleCandidates largest logits reach
    // the host when they decide the draw (Sampler::sample(LogitCandidates)); the row is read otherwise.
    virtual SampledToken sample(Sampler & sampler) = 0;
    virtual void clear() = 0;

    // Snapshot of the state and its tokens; restore() validates it (checksum, model shape) before use.
    virtual std::string snapshot() const = 0;
    virtual void restore(std::string_view bytes) = 0;
};

class Engine {
  public:
    // Loads the model. `progress` (may be empty) is called as the weights load (after each tensor) and once at
    // the end with bytes_done = bytes_total.
    static std::unique_ptr<Engine> open(const EngineOptions & options,
                                        const std::function<void(const LoadProgress &)> & progress = {});
    virtual ~Engine() = default;

    virtual const ModelInfo & info() const = 0;
    // The model file's tokenizer, or null when the file carries none.
    virtual const Tokenizer * tokenizer() const = 0;
    virtual std::unique_ptr<Session> new_session(int64_t n_ctx) = 0;

    // Bytes one session of n_ctx tokens allocates (its KV state), for planning memory before creating it.
    virtual uint64_t session_bytes(int64_t n_ctx) const = 0;
    // One decode step of several sessions of this engine at once: tokens[i] is evaluated after sessions[i]'s tokens
    // with the logits sessions[i]->eval() of it alone would give, and each session then samples as usual. Throws
    // dsv4::Error, with no session changed, when a session appears twice, belongs to another engine or has no room
    // left, or a token is outside the vocabulary.
    virtual void decode_batch(std::span<Session * const> sessions, std::span<const int32_t> tokens) = 0;
    // Whether decode_batch() runs as one pass that reads the weights once for all the sessions (where reading the
    // weights bounds a decode step, as on a GPU, B sessions then take little more than one's time; a CPU bound by
    // its arithmetic gains nothing), or evaluates them one after another.
    virtual bool batched_decode() const = 0;
    // The most GPU memory the engine has held at once (weights, KV states, workspace, scratch); 0 on the CPU.
    virtual uint64_t peak_device_bytes() const = 0;
    // The memory plan of options' model with n_sessions sessions of n_ctx tokens on the backend the options pick
    // (n_ctx 0: the largest context). With options.n_ubatch 0 on a GPU, the plan's n_ubatch is 16384 or 8192
    // when that context fits with it, else 2048. Reads the file's header only; throws dsv4::Error for a bad file.
    static MemoryPlan plan(const EngineOptions & options, int64_t n_ctx, int n_sessions = 1);
    static constexpr int64_t kContextStep = 4096;  // the plan's largest context is a multiple of this
};

// "dsv4 <version> (<commit>)" and the backends compiled in.
std::string version_string();

}  // namespace dsv4
