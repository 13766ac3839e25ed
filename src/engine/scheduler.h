// The scheduler: one inference thread that owns every session of an Engine and runs generation requests from a
// FIFO queue, up to one per session at once. Each loop it admits queued requests while sessions are free, evaluates
// one piece of a running prefill (an engine chunk, a slice of one while others decode, or up to the next snapshot
// point; prompts take turns), then steps every decoding request by one token in one Engine::decode_batch call: a
// short request's tokens come between a long one's, and a long prompt delays the others by one piece at a time.
//
// For each request it picks, among the sessions no running request holds, the one that saves the most prefill:
//   1. live, token prefix: a session whose tokens are a prefix of the prompt's tokens (extend it);
//   2. live, text prefix: a session whose decoded text, or its visible alias (below), is a byte prefix of the
//      rendered prompt: the session's own tokens are kept and only the rest of the prompt is tokenized, so a
//      history that re-tokenizes differently from what was sampled (BPE merges across the turn boundary) still hits,
//      and so does one whose reply was cut inside a character (the text compared as it streamed, with U+FFFD);
//   3. disk: the longest disk snapshot whose key text is a prefix of the prompt (KvDiskCache), restored into the
//      least recently used session;
//   4. cold: the least recently used session is cleared and the whole prompt is prefilled.
// A session about to be reused for something unrelated is first saved to disk when it is long enough. Disk
// snapshots are also written at a request's cache cut (a stable prefix, e.g. up to the last assistant marker),
// every `kv_cache_interval` tokens of a long prefill or generation, and for every session at shutdown.
//
// The compressed KV state cannot be rolled back, so a session is only ever extended; rewinding means restoring a
// snapshot or prefilling again.
//
// Generation streams text, not just tokens: the inference thread detokenizes (UTF-8 sequences split across tokens
// are held back) and applies stop strings (text that may still become a stop string is held back; generation
// ends before the first occurrence), so a stop ends decoding at exactly the right token. Cancellation (the client
// went away) is checked between prefill chunks and before every decoded token; it ends that request only.
#pragma once

#include "dsv4/engine.h"
#include "dsv4/sampler.h"
#include "engine/kv_cache.h"
#include "text/tokenizer.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dsv4 {

struct SchedulerOptions {
    int64_t n_ctx = 32768;    // tokens per session
    // Live KV timelines kept, and so the requests that run at once (each allocates Engine::session_bytes(n_ctx)).
    int n_sessions = 1;
    std::string kv_disk_dir;  // empty: no disk cache
    uint64_t kv_disk_budget = uint64_t(4096) << 20;
    int64_t kv_cache_min_tokens = 512;  // states shorter than this are not worth a file
    int64_t kv_cache_interval = 10240;  // snapshot every this many tokens of a long prefill/generation (0: never)
    // While other requests decode, a prompt is evaluated in slices of about this long (sized from the prefill speed
    // measured on the pieces before), so their tokens keep coming every slice rather than every engine chunk: a
    // chunk of 16384 tokens is ~2 s of the real model on an H200 and much longer on a GB10. Smaller slices prefill
    // more slowly. 0: whole chunks always.
    double prefill_slice_seconds = 0.5;
};

struct GenerationRequest {
    std::vector<int32_t> prompt;  // the prompt's tokens
    // The prompt as rendered chat pieces (their text is the decoding of `prompt`), for text-prefix reuse; empty for
    // raw prompts, which reuse by tokens only.
    std::vector<TextPiece> pieces;
    // Prompt tokens that form a prefix later requests are likely to share (the conversation up to the last
    // assistant marker): when at least kv_cache_min_tokens and not yet on disk, the state is saved there during
    // the prefill. 0: none.
    int64_t cache_cut = 0;
    SamplingParams sampling;
    int64_t max_tokens = 4096;      // clamped to the room the context leaves
    std::vector<std::string> stop;  // stop strings (not included in the output)
    // Called on the inference thread when generation ends at EOS, with the generated text: returns the text a
    // client will render for this state in its next request when that differs from the decoded tokens (thinking
    // mode drops past reasoning), or "". The session then also matches requests that start with it.
    std::function<std::string(std::string_view generated)> visible_alias;
    // Test builds only (DSV4_TEST_HOOKS): generate these tokens instead of sampling, then end as at EOS; and wait
    // this long before each decoded token. Ignored by production builds.
    std::vector<int32_t> scripted;
    int test_step_delay_ms = 0;
};

enum class FinishReason {
    eos,        // the model ended its turn (or a scripted sequence ended)
    stop,       // a stop string
    length,     // max_tokens or the end of the context
    cancelled,  // GenerationJob::cancel()
    shutdown,   // the scheduler shut down first
    error,      // see GenerationUpdate::error
};
const char * finish_reason_name(FinishReason reason);

struct GeneratedToken {
    int32_t id = -1;
    std::string text;               // UTF-8 text this token completed (may be empty while held back)
    float logprob = 0;              // natural log, the model's distribution (0 for scripted tokens)
    std::vector<TokenLogprob> top;  // sampling.n_logprobs alternatives
};

struct GenerationUsage {
    int64_t prompt_tokens = 0;  // tokens the model conditioned on
    int64_t cached_tokens = 0;  // of which reused from a live session or a disk snapshot
    int64_t completion_tokens = 0;
    std::string cache_source = "none";  // none, live, live-text, disk
    double queue_seconds = 0;
    double prefill_seconds = 0;
    double decode_seconds = 0;
};

// What GenerationJob::wait() returns: everything that happened since the previous call.
struct GenerationUpdate {
    bool started = false;      // prefill has begun (the job left the queue)
    int64_t prefill_done = 0;  // latest prefill progress, in prompt tokens
    int64_t prefill_total = 0;
    std::vector<GeneratedToken> tokens;
    std::string tail;  // text released at the end (held-back bytes); final update only
    bool finished = false;
    FinishReason finish = FinishReason::eos;
    std::string stop_string;  // FinishReason::stop: the stop string that matched
    std::string error;
    GenerationUsage usage;  // from the start: prompt and cache; at the end: everything
};

// GenerationRequest::visible_alias for a thinking-mode turn whose reasoning the chat template drops once the
// conversation moves on (docs/chat-format.md §1): the next request renders this turn as the prompt without its final
// "<think>", then "</think>" and the answer. `prompt_text` is the rendered prompt, ending with "<think>". The alias is
// empty (no alias) when the reasoning never closed or the reply holds tool calls.
std::function<std::string(std::string_view)> dropped_reasoning_alias(std::string prompt_text);

class Scheduler;

// A submitted request. The submitter waits for updates and may cancel; the inference thread produces them.
class GenerationJob {
  public:
    // Blocks until something new happened or timeout_s passed; once finished, every later call returns the final
    // update again (finished = true, no tokens).
    GenerationUpdate wait(double timeout_s);
    void cancel() { cancelled_.store(true); }
    bool cancelled() const { return cancelled_.load(); }

  private:
    friend class Scheduler;
    void publish(const std::function<void(GenerationUpdate &)> & change);

    GenerationRequest request_;
    double submitted_ = 0;
    std::atomic<bool> cancelled_{false};
    std::mutex mutex_;
    std::condition_variable cv_;
    GenerationUpdate pending_;  // accumulated since the last wait()
    bool news_ = false;
    bool done_ = false;
    GenerationUpdate final_;
};

struct SchedulerStats {
    int64_t queued = 0;
    int64_t running = 0;
    uint64_t requests = 0;  // finished, any reason
    uint64_t cancelled = 0;
    uint64_t errors = 0;
    uint64_t prompt_tokens = 0;
    uint64_t cached_tokens = 0;
    uint64_t prefill_tokens = 0;  // actually evaluated
    uint64_t generated_tokens = 0;
    uint64_t decode_steps = 0;        // Engine::decode_batch calls
    uint64_t decode_step_tokens = 0;  // tokens they evaluated (÷ decode_steps: the mean batch)
    uint64_t live_hits = 0;
    uint64_t disk_hits = 0;
    double prefill_seconds = 0;
    double decode_seconds = 0;
    double last_prefill_tps = 0;
    double last_decode_tps = 0;
    bool disk_enabled = false;
    KvCacheStats disk;
};

class Scheduler {
  public:
    // Allocates the sessions (throws dsv4::Error when the engine has no tokenizer or a session cannot be made).
    Scheduler(Engine & engine, const SchedulerOptions & options);
    ~Scheduler();  // shutdown(0) if still running

    // Queues a request. Throws dsv4::Error when shut down, or when the prompt is empty or does not leave room for
    // one generated token in the context.
    std::shared_ptr<GenerationJob> submit(GenerationRequest request);

    // Stops taking requests, finishes queued ones with FinishReason::shutdown, lets the running one go on for up
    // to grace_seconds and then stops it the same way, saves every live session worth keeping to the disk cache,
    // and joins the thread. Idempotent.
    void shutdown(double grace_seconds);

    SchedulerStats stats() const;
    const SchedulerOptions & options() const { return options_; }
    Engine & engine() { return engine_; }
    const Tokenizer & tokenizer() const { return tokenizer_; }

  private:
    struct Slot;
    struct Plan;
    struct Active;
    void run();
    // A running request's stages, each on the inference thread: take a slot and plan the prefill; evaluate one
    // piece of the prompt; set up sampling; one token of every decoding request (one batched engine step); end.
    void start(Active & a);
    // sliced: other requests are decoding, so the piece is one slice (SchedulerOptions::prefill_slice_seconds).
    void prefill_piece(Active & a, bool sliced);
    int64_t slice_tokens(int64_t chunk) const;
    static constexpr int64_t kSmallestSlice = 256;
    void begin_decode(Active & a);
    void decode_step(std::vector<std::unique_ptr<Active>> & active);
    void end_decode(Active & a, std::optional<FinishReason> how);  // nullopt: cancelled or shut down
    void finish(Active & a, FinishReason reason, std::string error, std::string tail, std::string stop_string);
    void fail(Active & a, const std::exception & e);
    void interrupt(Active & a);
    Plan plan(const GenerationRequest & request);
    Slot & victim();
    void save_slot(Slot & slot, KvSaveReason reason);
    void save_state(Slot & slot, KvSaveReason reason);
    void refresh_text(Slot & slot);

    Engine & engine_;
    const Tokenizer & tokenizer_;
    SchedulerOptions options_;
    std::vector<std::unique_ptr<Slot>> slots_;
    std::unique_ptr<KvDiskCache> disk_;
    uint64_t tick_ = 0;
    double prefill_rate_ = 0;  // tokens/s of the last prefill pieces (a running mean); 0: none measured yet

    mutable std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<std::shared_ptr<GenerationJob>> queue_;
    bool stopping_ = false;
    std::atomic<bool> abort_running_{false};
    SchedulerStats stats_;
    std::thread thread_;
    std::mutex shutdown_mutex_;
    bool joined_ = false;
};

}  // namespace dsv4
