// The scheduler (scheduler.h has the policy). Everything that touches a session runs on the one inference thread;
// submitters only see GenerationJob updates.
#include "engine/scheduler.h"

#include "text/chat.h"
#include "text/dsml.h"
#include "util/error.h"
#include "util/log.h"
#include "util/timer.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

namespace dsv4 {

const char * finish_reason_name(FinishReason reason) {
    switch (reason) {
        case FinishReason::eos:
            return "eos";
        case FinishReason::stop:
            return "stop";
        case FinishReason::length:
            return "length";
        case FinishReason::cancelled:
            return "cancelled";
        case FinishReason::shutdown:
            return "shutdown";
        case FinishReason::error:
            return "error";
    }
    return "unknown";
}

std::function<std::string(std::string_view)> dropped_reasoning_alias(std::string prompt_text) {
    if (prompt_text.size() < kThinkStartText.size() ||
        prompt_text.compare(prompt_text.size() - kThinkStartText.size(), kThinkStartText.size(), kThinkStartText) != 0)
        return {};
    prompt_text.resize(prompt_text.size() - kThinkStartText.size());
    return [prefix = std::move(prompt_text)](std::string_view generated) -> std::string {
        ParsedCompletion c = parse_completion(generated, true);
        if (!c.reasoning_closed || !c.tool_calls.empty()) return {};
        return prefix + std::string(kThinkEndText) + c.content;
    };
}

// ---------------------------------------------------------------------------------------------------------------------
// Jobs
// ---------------------------------------------------------------------------------------------------------------------

GenerationUpdate GenerationJob::wait(double timeout_s) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!news_ && !done_) cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return news_ || done_; });
    if (!news_ && done_) return final_;
    GenerationUpdate out = std::move(pending_);
    pending_ = GenerationUpdate{};
    pending_.started = out.started;
    pending_.prefill_done = out.prefill_done;
    pending_.prefill_total = out.prefill_total;
    news_ = false;
    if (out.finished) {
        final_ = out;
        final_.tokens.clear();
        final_.tail.clear();
    }
    return out;
}

void GenerationJob::publish(const std::function<void(GenerationUpdate &)> & change) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        change(pending_);
        news_ = true;
        if (pending_.finished) done_ = true;
    }
    cv_.notify_all();
}

namespace {

// Holds back generated text that may still turn into a stop string; reports the first complete one.
class StopMatcher {
  public:
    explicit StopMatcher(const std::vector<std::string> & stops) {
        for (const std::string & s : stops)
            if (!s.empty()) stops_.push_back(s);
    }

    // Returns the text that can be released; sets *matched when a stop string completed (the text before it is
    // returned, the rest dropped; matched() names the string).
    std::string push(std::string_view text, bool * matched) {
        held_ += text;
        if (stops_.empty()) return std::exchange(held_, {});
        size_t first = std::string::npos;
        for (const std::string & s : stops_) {
            const size_t at = held_.find(s);
            if (at < first) first = at, matched_ = s;
        }
        if (first != std::string::npos) {
            *matched = true;
            std::string out = held_.substr(0, first);
            held_.clear();
            return out;
        }
        // Keep the longest tail that is a proper prefix of a stop string.
        size_t keep = 0;
        for (const std::string & s : stops_) {
            for (size_t k = std::min(held_.size(), s.size() - 1); k > keep; --k) {
                if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
                    keep = k;
                    break;
                }
            }
        }
        std::string out = held_.substr(0, held_.size() - keep);
        held_.erase(0, held_.size() - keep);
        return out;
    }
    std::string finish() { return std::exchange(held_, {}); }
    const std::string & matched() const { return matched_; }

  private:
    std::vector<std::string> stops_;
    std::string held_;
    std::string matched_;
};

// The pieces that follow the first `offset` bytes of their text, or nullopt when the offset falls inside a
// special piece (its token cannot be split).
std::optional<std::vector<TextPiece>> pieces_after(const std::vector<TextPiece> & pieces, size_t offset) {
    std::vector<TextPiece> out;
    size_t pos = 0;
    for (const TextPiece & p : pieces) {
        const size_t end = pos + p.text.size();
        if (end <= offset) {
            pos = end;
            continue;
        }
        if (pos >= offset) {
            out.push_back(p);
        } else {
            if (p.special) return std::nullopt;
            out.push_back({p.text.substr(offset - pos), false});
        }
        pos = end;
    }
    if (pos < offset) return std::nullopt;
    return out;
}

bool starts_with(std::string_view text, std::string_view prefix) {
    return !prefix.empty() && prefix.size() <= text.size() && text.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Construction and the queue
// ---------------------------------------------------------------------------------------------------------------------

struct Scheduler::Slot {
    std::unique_ptr<Session> session;
    std::string text;  // decoding of the session's first text_tokens tokens
    size_t text_tokens = 0;
    std::string alias;  // when set: what clients render for the same tokens (scheduler.h)
    uint64_t last_used = 0;
    int64_t saved_tokens = 0;  // the state of this many tokens is on disk already
    bool busy = false;         // a running request holds it
};

struct Scheduler::Plan {
    Slot * slot = nullptr;
    std::vector<int32_t> tokens;  // what the slot is synced to
    int64_t reused = 0;
    std::string source = "none";
};

namespace {
const Tokenizer & require_tokenizer(const Engine & engine) {
    const Tokenizer * t = engine.tokenizer();
    DSV4_CHECK(t, "{}: the model file has no tokenizer (tokenizer.ggml.* keys)", engine.info().path);
    return *t;
}
}  // namespace

Scheduler::Scheduler(Engine & engine, const SchedulerOptions & options)
    : engine_(engine), tokenizer_(require_tokenizer(engine)), options_(options) {
    DSV4_CHECK(options.n_ctx > 0, "context length {} must be positive", options.n_ctx);
    DSV4_CHECK(options.n_sessions >= 1, "sessions: {} must be at least 1", options.n_sessions);
    for (int i = 0; i < options.n_sessions; ++i) {
        auto slot = std::make_unique<Slot>();
        slot->session = engine.new_session(options.n_ctx);
        slots_.push_back(std::move(slot));
    }
    if (!options.kv_disk_dir.empty()) {
        disk_ = std::make_unique<KvDiskCache>(options.kv_disk_dir, options.kv_disk_budget, engine.info().fingerprint);
        stats_.disk_enabled = true;
    }
    thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() { shutdown(0); }

std::shared_ptr<GenerationJob> Scheduler::submit(GenerationRequest request) {
    DSV4_CHECK(!request.prompt.empty(), "the prompt is empty");
    DSV4_CHECK(int64_t(request.prompt.size()) < options_.n_ctx,
               "the prompt has {} tokens; the context holds {} (including the reply)", request.prompt.size(),
               options_.n_ctx);
    for (int32_t id : request.prompt)
        DSV4_CHECK(id >= 0 && id < tokenizer_.n_vocab(), "prompt token {} is outside the vocabulary ({})", id,
                   tokenizer_.n_vocab());
    Sampler check(request.sampling);  // validates the parameters before queueing
    auto job = std::make_shared<GenerationJob>();
    job->request_ = std::move(request);
    job->submitted_ = now_seconds();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        DSV4_CHECK(!stopping_, "the server is shutting down");
        queue_.push_back(job);
        stats_.queued = int64_t(queue_.size());
    }
    cv_.notify_all();
    return job;
}

void Scheduler::shutdown(double grace_seconds) {
    std::lock_guard<std::mutex> once(shutdown_mutex_);
    if (joined_) return;
    std::deque<std::shared_ptr<GenerationJob>> queued;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
        queued.swap(queue_);
        stats_.queued = 0;
    }
    cv_.notify_all();
    for (auto & job : queued) {
        job->publish([](GenerationUpdate & u) {
            u.finished = true;
            u.finish = FinishReason::shutdown;
        });
    }
    {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait_for(lock, std::chrono::duration<double>(std::max(grace_seconds, 0.0)),
                     [&] { return stats_.running == 0; });
        if (stats_.running > 0) abort_running_.store(true);
    }
    thread_.join();
    if (disk_) disk_->flush();  // the snapshots saved on the way out are on disk before shutdown returns
    joined_ = true;
}

SchedulerStats Scheduler::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    SchedulerStats s = stats_;
    if (disk_) s.disk = disk_->stats();
    return s;
}

// ---------------------------------------------------------------------------------------------------------------------
// Sessions: text, saving, choosing
// ---------------------------------------------------------------------------------------------------------------------

void Scheduler::refresh_text(Slot & slot) {
    const std::vector<int32_t> & tokens = slot.session->tokens();
    if (tokens.size() < slot.text_tokens) {  // cleared or restored since
        slot.text.clear();
        slot.alias.clear();
        slot.text_tokens = 0;
    }
    if (tokens.size() > slot.text_tokens) {
        const std::string added = tokenizer_.decode(std::span<const int32_t>(tokens).subspan(slot.text_tokens));
        slot.text += added;
        if (!slot.alias.empty()) slot.alias += added;
        slot.text_tokens = tokens.size();
    }
}

void Scheduler::save_state(Slot & slot, KvSaveReason reason) {
    if (!disk_) return;
    refresh_text(slot);
    const int64_t n = int64_t(slot.session->tokens().size());
    const std::string & key = slot.alias.empty() ? slot.text : slot.alias;
    if (n == 0 || disk_->contains(key)) {
        slot.saved_tokens = std::max(slot.saved_tokens, n);
        return;
    }
    // Only the copy of the state waits here; the writer thread writes the file while generation goes on.
    if (disk_->save_queued(key, n, slot.session->snapshot(), reason)) slot.saved_tokens = n;
}

void Scheduler::save_slot(Slot & slot, KvSaveReason reason) {
    const int64_t n = int64_t(slot.session->tokens().size());
    if (!disk_ || n < options_.kv_cache_min_tokens || n <= slot.saved_tokens) return;
    save_state(slot, reason);
}

Scheduler::Slot & Scheduler::victim() {
    Slot * best = nullptr;
    for (auto & s : slots_) {
        if (s->busy) continue;
        const bool empty = s->session->tokens().empty();
        if (!best || (empty && !best->session->tokens().empty()) ||
            (empty == best->session->tokens().empty() && s->last_used < best->last_used))
            best = s.get();
    }
    // Admission takes no more requests than there are free sessions, so one is always left here.
    DSV4_CHECK(best, "scheduler: no free session for a request");
    return *best;
}

Scheduler::Plan Scheduler::plan(const GenerationRequest & req) {
    const std::vector<int32_t> & prompt = req.prompt;
    Plan best;
    // A state can serve a prompt it covers completely only if it still has the logits of its last token.
    auto usable = [](const Session & s, size_t target) { return s.tokens().size() < target || s.has_logits(); };

    for (auto & slot : slots_) {  // 1. token prefix
        if (slot->busy) continue;
        const std::vector<int32_t> & t = slot->session->tokens();
        if (t.empty() || t.size() > prompt.size() || int64_t(t.size()) <= best.reused) continue;
        if (!std::equal(t.begin(), t.end(), prompt.begin()) || !usable(*slot->session, prompt.size())) continue;
        best = {slot.get(), prompt, int64_t(t.size()), "live"};
    }

    std::string prompt_text;
    if (!req.pieces.empty()) {
        for (const TextPiece & p : req.pieces) prompt_text += p.text;
        for (auto & slot : slots_) {  // 2. text prefix (the decoded tokens or the visible alias)
            if (slot->busy) continue;
            refresh_text(*slot);
            const std::vector<int32_t> & t = slot->session->tokens();
            if (int64_t(t.size()) <= best.reused) continue;
            for (const std::string * raw : {&slot->text, &slot->alias}) {
                // Bytes that are not UTF-8 (a reply cut inside a character) reached the client as U+FFFD, and the
                // history it sends back holds that: compare as streamed when the bytes themselves do not match.
                if (raw->empty()) continue;
                std::string streamed;
                const std::string * key = raw;
                const size_t same =
                    size_t(std::mismatch(raw->begin(), raw->end(), prompt_text.begin(), prompt_text.end()).first -
                           raw->begin());
                if (same < raw->size()) {
                    // The stream differs from the bytes only from where a non-ASCII byte starts a U+FFFD (EF BF BD),
                    // so a prompt that follows the stream leaves the bytes within three of such a byte: without one
                    // there, the slot's whole text need not be decoded.
                    bool near_non_ascii = false;
                    for (size_t i = same >= 3 ? same - 3 : 0; i <= same; ++i)
                        near_non_ascii = near_non_ascii || uint8_t((*raw)[i]) >= 0x80;
                    if (!near_non_ascii) continue;
                    Utf8StreamDecoder utf8(tokenizer_);
                    streamed = utf8.push_bytes(*raw);
                    streamed += utf8.finish();  // after the bytes: an unfinished character at the end is U+FFFD
                    if (streamed == *raw || !starts_with(prompt_text, streamed)) continue;
                    key = &streamed;
                }
                std::optional<std::vector<TextPiece>> rest = pieces_after(req.pieces, key->size());
                if (!rest) continue;
                std::vector<int32_t> tokens = t;
                const std::vector<int32_t> tail = tokenizer_.encode_pieces(*rest);
                tokens.insert(tokens.end(), tail.begin(), tail.end());
                if (!usable(*slot->session, tokens.size())) continue;
                best = {slot.get(), std::move(tokens), int64_t(t.size()), "live-text"};
                break;
            }
        }
    } else {
        prompt_text = tokenizer_.decode(prompt);
    }

    // 3. disk: the longest snapshot that beats the live candidates; a file that turns out corrupt is dropped from
    // the index, so the next lookup finds the next best.
    for (int attempt = 0; disk_ && attempt < 4; ++attempt) {
        std::optional<KvDiskCache::Match> m = disk_->find(prompt_text);
        if (!m || m->n_tokens <= best.reused) break;
        Slot & slot = victim();
        save_slot(slot, KvSaveReason::evict);
        std::optional<std::string> bytes = disk_->load(*m);
        if (!bytes) continue;
        slot.text.clear();  // the session changes wholesale
        slot.alias.clear();
        slot.text_tokens = 0;
        if (&slot == best.slot) best = Plan{};  // the live state it would have extended is gone
        try {
            slot.session->restore(*bytes);
        } catch (const Error & e) {
            log_warn("kv cache: {} does not restore ({}); prefilling instead", m->path, e.what());
            slot.session->clear();
            break;
        }
        refresh_text(slot);
        const std::string key = prompt_text.substr(0, m->text_bytes);
        if (key != slot.text) slot.alias = key;
        slot.saved_tokens = int64_t(slot.session->tokens().size());
        const std::vector<int32_t> & t = slot.session->tokens();
        std::vector<int32_t> tokens;
        if (!req.pieces.empty()) {
            if (std::optional<std::vector<TextPiece>> rest = pieces_after(req.pieces, m->text_bytes)) {
                tokens = t;
                const std::vector<int32_t> tail = tokenizer_.encode_pieces(*rest);
                tokens.insert(tokens.end(), tail.begin(), tail.end());
            }
        } else if (t.size() <= prompt.size() && std::equal(t.begin(), t.end(), prompt.begin())) {
            tokens = prompt;
        }
        if (!tokens.empty() && usable(*slot.session, tokens.size())) {
            log_info("kv cache: restored {} tokens from {}", t.size(), m->path);
            std::lock_guard<std::mutex> lock(mutex_);
            ++stats_.disk_hits;
            return {&slot, std::move(tokens), int64_t(t.size()), "disk"};
        }
        slot.session->clear();
        break;
    }
    if (best.slot) return best;

    Slot & slot = victim();  // 4. cold
    save_slot(slot, KvSaveReason::evict);
    slot.session->clear();
    slot.text.clear();
    slot.alias.clear();
    slot.text_tokens = 0;
    slot.saved_tokens = 0;
    return {&slot, prompt, 0, "none"};
}

// ---------------------------------------------------------------------------------------------------------------------
// Running requests: admission, prefill pieces, batched decode steps
// ---------------------------------------------------------------------------------------------------------------------

// A request that holds a slot: prefilling its prompt, then decoding.
struct Scheduler::Active {
    std::shared_ptr<GenerationJob> job;
    Slot * slot = nullptr;
    std::vector<int32_t> tokens;  // the prompt as the slot's session will hold it
    std::vector<int64_t> cuts;  // prefill ends a piece at each (disk snapshots), the last is n_prompt
    int64_t prefill_first = 0;  // the session's tokens when the prefill began
    int64_t pieces = 0;         // prefill pieces evaluated
    Timer prefill_timer;
    GenerationUsage usage;
    // Decoding (after the prefill; begin_decode sets these up):
    std::optional<Sampler> sampler;
    std::optional<Utf8StreamDecoder> utf8;
    std::optional<StopMatcher> stops;
    int64_t limit = 0;  // tokens it may generate
    std::vector<int32_t> generated;
    Timer decode_timer;
    size_t script_pos = 0;
    bool finished = false;

    int64_t n_prompt() const { return int64_t(tokens.size()); }
    bool decoding() const { return sampler.has_value(); }
    bool stopped(const std::atomic<bool> & abort) const { return job->cancelled() || abort.load(); }
};

void Scheduler::run() {
    std::vector<std::unique_ptr<Active>> active;
    for (;;) {
        // Admission: queued requests take free slots in arrival order.
        std::vector<std::shared_ptr<GenerationJob>> admitted;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            if (active.empty()) cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (active.empty() && queue_.empty()) break;  // stopping, nothing left
            while (!queue_.empty() && active.size() + admitted.size() < slots_.size()) {
                admitted.push_back(queue_.front());
                queue_.pop_front();
            }
            stats_.queued = int64_t(queue_.size());
            stats_.running += int64_t(admitted.size());  // each leaves the count as it is finished
        }
        for (auto & job : admitted) {
            auto a = std::make_unique<Active>();
            a->job = job;
            start(*a);
            if (!a->finished) active.push_back(std::move(a));
        }
        // One piece of a prefill, then one step of every decoding request: a long prompt delays the others' next
        // tokens by one piece at a time (a slice while they decode), not by its whole prefill. Prompts take turns
        // (the one with the fewest pieces, the oldest of those), so a short prompt that arrives during a long one is
        // not queued behind it.
        Active * next = nullptr;
        bool others_decoding = false;
        for (auto & a : active) {
            if (!a->decoding() && (!next || a->pieces < next->pieces)) next = a.get();
            others_decoding = others_decoding || a->decoding();
        }
        if (next) prefill_piece(*next, others_decoding);
        decode_step(active);
        std::erase_if(active, [](const std::unique_ptr<Active> & a) { return a->finished; });
    }
    // Shutdown: keep every live state worth keeping.
    for (auto & slot : slots_) {
        try {
            save_slot(*slot, KvSaveReason::shutdown);
        } catch (const std::exception & e) {
            log_warn("kv cache: shutdown save failed: {}", e.what());
        }
    }
}

void Scheduler::finish(Active & a, FinishReason reason, std::string error, std::string tail, std::string stop_string) {
    a.finished = true;
    if (a.slot) a.slot->busy = false;
    {
        // Counted before the submitter hears of it: stats read after a finished job include it.
        std::lock_guard<std::mutex> lock(mutex_);
        --stats_.running;
        ++stats_.requests;
        if (reason == FinishReason::cancelled) ++stats_.cancelled;
        if (reason == FinishReason::error) ++stats_.errors;
        stats_.prompt_tokens += uint64_t(a.usage.prompt_tokens);
        stats_.cached_tokens += uint64_t(a.usage.cached_tokens);
        stats_.generated_tokens += uint64_t(a.usage.completion_tokens);
    }
    cv_.notify_all();  // shutdown() waits for the running count
    a.job->publish([&](GenerationUpdate & u) {
        u.finished = true;
        u.finish = reason;
        u.error = std::move(error);
        u.tail = std::move(tail);
        u.stop_string = std::move(stop_string);
        u.usage = a.usage;
    });
}

void Scheduler::fail(Active & a, const std::exception & e) {
    log_warn("generation failed: {}", e.what());
    finish(a, FinishReason::error, e.what(), {}, {});
}

void Scheduler::interrupt(Active & a) {
    finish(a, a.job->cancelled() ? FinishReason::cancelled : FinishReason::shutdown, {}, {}, {});
}

void Scheduler::start(Active & a) {
    const GenerationRequest & req = a.job->request_;
    if (a.job->cancelled()) {  // while queued: it never takes a session
        finish(a, FinishReason::cancelled, {}, {}, {});
        return;
    }
    a.usage.queue_seconds = now_seconds() - a.job->submitted_;
    try {
        Plan p = plan(req);
        a.slot = p.slot;
        a.slot->busy = true;
        a.slot->last_used = ++tick_;
        a.tokens = std::move(p.tokens);
        a.usage.prompt_tokens = a.n_prompt();
        a.usage.cached_tokens = p.reused;
        a.usage.cache_source = p.source;
        if (p.reused > 0 && p.source != "disk") {
            std::lock_guard<std::mutex> lock(mutex_);
            ++stats_.live_hits;
        }
        if (a.n_prompt() >= options_.n_ctx) {
            finish(a, FinishReason::error,
                   fmt::format("the prompt has {} tokens; the context holds {}", a.n_prompt(), options_.n_ctx), {}, {});
            return;
        }
        a.job->publish([&](GenerationUpdate & u) {
            u.started = true;
            u.prefill_done = p.reused;
            u.prefill_total = a.n_prompt();
            u.usage = a.usage;
        });
        // The prefill's pieces end where a disk snapshot is due.
        if (disk_) {
            if (req.cache_cut > p.reused && req.cache_cut < a.n_prompt() &&
                req.cache_cut >= options_.kv_cache_min_tokens)
                a.cuts.push_back(req.cache_cut);
            if (options_.kv_cache_interval > 0)
                for (int64_t c = (p.reused / options_.kv_cache_interval + 1) * options_.kv_cache_interval;
                     c < a.n_prompt(); c += options_.kv_cache_interval)
                    a.cuts.push_back(c);
            std::sort(a.cuts.begin(), a.cuts.end());
        }
        a.cuts.push_back(a.n_prompt());
        a.prefill_first = int64_t(a.slot->session->tokens().size());
        a.prefill_timer = Timer();
        if (a.prefill_first == a.n_prompt()) begin_decode(a);  // the whole prompt was cached
    } catch (const std::exception & e) {
        fail(a, e);
    }
}

int64_t Scheduler::slice_tokens(int64_t chunk) const {
    // Below a few hundred tokens a GPU's prefill products lose most of their speed; the first slice, before any
    // speed is known, is that smallest one.
    const int64_t smallest = std::min<int64_t>(chunk, kSmallestSlice);
    return std::clamp(int64_t(prefill_rate_ * options_.prefill_slice_seconds), smallest, chunk);
}

void Scheduler::prefill_piece(Active & a, bool sliced) {
    const GenerationRequest & req = a.job->request_;
    Session & session = *a.slot->session;
    ++a.pieces;
    try {
        const int64_t at = int64_t(session.tokens().size());
        const int64_t cut = *std::upper_bound(a.cuts.begin(), a.cuts.end(), at);
        // A piece is one of the engine's chunks, or a slice of one while others decode.
        int64_t piece = engine_.info().n_ubatch > 0 ? engine_.info().n_ubatch : cut - at;
        if (sliced && options_.prefill_slice_seconds > 0) piece = slice_tokens(piece);
        const int64_t end = std::min(cut, at + piece);
        const Timer timer;
        const bool done = session.eval(std::span<const int32_t>(a.tokens).subspan(size_t(at), size_t(end - at)), false,
                                       [&](int64_t d, int64_t) {
                                           a.job->publish([&](GenerationUpdate & u) { u.prefill_done = at + d; });
                                           return !a.stopped(abort_running_);
                                       });
        // A short piece (a prompt's last few tokens) measures its fixed costs more than the prefill's speed.
        if (done && end - at >= std::min(engine_.info().n_ubatch, kSmallestSlice) && timer.seconds() > 0) {
            const double rate = double(end - at) / timer.seconds();
            prefill_rate_ = prefill_rate_ > 0 ? (prefill_rate_ + rate) / 2 : rate;
        }
        // Asked once: a cancellation arriving between two asks would make the piece both complete and stopped.
        const bool stopped = !done || a.stopped(abort_running_);
        const bool complete = !stopped && end == a.n_prompt();
        if (stopped || complete) {
            a.usage.prefill_seconds = a.prefill_timer.seconds();
            std::lock_guard<std::mutex> lock(mutex_);
            const int64_t n = int64_t(session.tokens().size()) - a.prefill_first;
            stats_.prefill_tokens += uint64_t(n);
            stats_.prefill_seconds += a.usage.prefill_seconds;
            if (complete && n > 0 && a.usage.prefill_seconds > 0)
                stats_.last_prefill_tps = double(n) / a.usage.prefill_seconds;
        }
        if (stopped) {
            interrupt(a);
            return;
        }
        if (end == cut && cut < a.n_prompt())
            save_state(*a.slot, cut == req.cache_cut ? KvSaveReason::cold : KvSaveReason::interval);
        if (complete) begin_decode(a);
    } catch (const std::exception & e) {
        fail(a, e);
    }
}

void Scheduler::begin_decode(Active & a) {
    const GenerationRequest & req = a.job->request_;
    a.sampler.emplace(req.sampling);
    a.utf8.emplace(tokenizer_);
    a.stops.emplace(req.stop);
    a.limit = std::min<int64_t>(std::max<int64_t>(req.max_tokens, 1), options_.n_ctx - a.n_prompt());
    a.decode_timer = Timer();
}

void Scheduler::decode_step(std::vector<std::unique_ptr<Active>> & active) {
    std::vector<Active *> decoding;
    for (auto & a : active)
        if (a->decoding() && !a->finished) decoding.push_back(a.get());
    if (decoding.empty()) return;
#ifdef DSV4_TEST_HOOKS
    int delay_ms = 0;
    for (Active * a : decoding) delay_ms = std::max(delay_ms, a->job->request_.test_step_delay_ms);
    auto any_stopped = [&] {
        return std::any_of(decoding.begin(), decoding.end(), [&](Active * a) { return a->stopped(abort_running_); });
    };
    for (int w = 0; w < delay_ms && !any_stopped(); w += 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
#endif
    // Each request draws its token from its own logits; those that go on are evaluated together.
    std::vector<Active *> stepping;
    std::vector<Session *> sessions;
    std::vector<int32_t> next;
    for (Active * a : decoding) {
        if (a->stopped(abort_running_)) {
            end_decode(*a, std::nullopt);
            continue;
        }
        try {
            SampledToken tok;
#ifdef DSV4_TEST_HOOKS
            const std::vector<int32_t> & scripted = a->job->request_.scripted;
            if (!scripted.empty())
                tok.id = a->script_pos < scripted.size() ? scripted[a->script_pos++] : tokenizer_.eos_id();
            else
#endif
                tok = a->slot->session->sample(*a->sampler);
            if (tok.id == tokenizer_.eos_id()) {
                end_decode(*a, FinishReason::eos);
                continue;
            }
            ++a->usage.completion_tokens;
            a->generated.push_back(tok.id);
            bool matched = false;
            GeneratedToken out{tok.id, a->stops->push(a->utf8->push(tok.id), &matched), tok.logprob,
                               std::move(tok.top)};
            a->job->publish([&](GenerationUpdate & u) { u.tokens.push_back(std::move(out)); });
            if (matched) {
                end_decode(*a, FinishReason::stop);
                continue;
            }
            if (int64_t(a->generated.size()) == a->limit) {  // nothing follows this token: no need to evaluate it
                end_decode(*a, FinishReason::length);
                continue;
            }
        } catch (const std::exception & e) {
            fail(*a, e);
            continue;
        }
        stepping.push_back(a);
        sessions.push_back(a->slot->session.get());
        next.push_back(a->generated.back());
    }
    if (stepping.empty()) return;
    try {
        engine_.decode_batch(sessions, next);
    } catch (const std::exception & e) {
        for (Active * a : stepping) fail(*a, e);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mutex_);
        ++stats_.decode_steps;
        stats_.decode_step_tokens += next.size();
    }
    for (Active * a : stepping) {
        const Session & session = *a->slot->session;
        if (disk_ && options_.kv_cache_interval > 0 && session.n_past() % options_.kv_cache_interval == 0) {
            try {
                save_state(*a->slot, KvSaveReason::interval);
            } catch (const std::exception & e) {
                fail(*a, e);
            }
        }
    }
}

void Scheduler::end_decode(Active & a, std::optional<FinishReason> how) {
    a.usage.decode_seconds = a.decode_timer.seconds();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stats_.decode_seconds += a.usage.decode_seconds;
        if (a.usage.completion_tokens > 0 && a.usage.decode_seconds > 0)
            stats_.last_decode_tps = double(a.usage.completion_tokens) / a.usage.decode_seconds;
    }
    if (!how) {  // cancelled or shut down
        interrupt(a);
        return;
    }
    FinishReason reason = *how;
    std::string tail;
    try {
        if (reason != FinishReason::stop) {
            bool matched = false;
            tail = a.stops->push(a.utf8->finish(), &matched);
            if (matched)
                reason = FinishReason::stop;
            else
                tail += a.stops->finish();
        }
        const GenerationRequest & req = a.job->request_;
        if (reason == FinishReason::eos && req.visible_alias) {
            // Every generated token was evaluated (EOS itself is not): the alias covers exactly the session.
            refresh_text(*a.slot);
            a.slot->alias = req.visible_alias(tokenizer_.decode(a.generated));
        }
    } catch (const std::exception & e) {
        fail(a, e);
        return;
    }
    finish(a, reason, {}, std::move(tail), reason == FinishReason::stop ? a.stops->matched() : std::string());
}

}  // namespace dsv4
