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
        cv_.wait_for(lock, std::chrono::duration<double>(std::max(grace_seconds, 0.0)), [&] { return !running_; });
        if (running_) abort_running_.store(true);
    }
    thread_.join();
    joined_ = true;
}

SchedulerStats Scheduler::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    SchedulerStats s = stats_;
    if (disk_) s.disk = disk_->stats();
    return s;
}

void Scheduler::run() {
    for (;;) {
        std::shared_ptr<GenerationJob> job;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) break;  // stopping, nothing left
            job = queue_.front();
            queue_.pop_front();
            running_ = job;
            stats_.queued = int64_t(queue_.size());
            stats_.running = 1;
        }
        if (job->cancelled()) {
            {
                std::lock_guard<std::mutex> lock(mutex_);
                ++stats_.requests;
                ++stats_.cancelled;
            }
            job->publish([](GenerationUpdate & u) {
                u.finished = true;
                u.finish = FinishReason::cancelled;
            });
        } else {
            process(*job);
        }
        std::lock_guard<std::mutex> lock(mutex_);
        running_.reset();
        stats_.running = 0;
        cv_.notify_all();
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
    if (disk_->save(key, n, slot.session->snapshot(), reason)) slot.saved_tokens = n;
}

void Scheduler::save_slot(Slot & slot, KvSaveReason reason) {
    const int64_t n = int64_t(slot.session->tokens().size());
    if (!disk_ || n < options_.kv_cache_min_tokens || n <= slot.saved_tokens) return;
    save_state(slot, reason);
}

Scheduler::Slot & Scheduler::victim() {
    Slot * best = nullptr;
    for (auto & s : slots_) {
        const bool empty = s->session->tokens().empty();
        if (!best || (empty && !best->session->tokens().empty()) ||
            (empty == best->session->tokens().empty() && s->last_used < best->last_used))
            best = s.get();
    }
    return *best;
}

Scheduler::Plan Scheduler::plan(const GenerationRequest & req) {
    const std::vector<int32_t> & prompt = req.prompt;
    Plan best;
    // A state can serve a prompt it covers completely only if it still has the logits of its last token.
    auto usable = [](const Session & s, size_t target) { return s.tokens().size() < target || s.has_logits(); };

    for (auto & slot : slots_) {  // 1. token prefix
        const std::vector<int32_t> & t = slot->session->tokens();
        if (t.empty() || t.size() > prompt.size() || int64_t(t.size()) <= best.reused) continue;
        if (!std::equal(t.begin(), t.end(), prompt.begin()) || !usable(*slot->session, prompt.size())) continue;
        best = {slot.get(), prompt, int64_t(t.size()), "live"};
    }

    std::string prompt_text;
    if (!req.pieces.empty()) {
        for (const TextPiece & p : req.pieces) prompt_text += p.text;
        for (auto & slot : slots_) {  // 2. text prefix (the decoded tokens or the visible alias)
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
// One request
// ---------------------------------------------------------------------------------------------------------------------

void Scheduler::process(GenerationJob & job) {
    const GenerationRequest & req = job.request_;
    GenerationUsage usage;
    usage.queue_seconds = now_seconds() - job.submitted_;
    auto stopped = [&] { return job.cancelled() || abort_running_.load(); };
    std::string matched_stop;
    auto finish = [&](FinishReason reason, std::string error, std::string tail) {
        {
            // Counted before the submitter hears of it: stats read after a finished job include it.
            std::lock_guard<std::mutex> lock(mutex_);
            ++stats_.requests;
            if (reason == FinishReason::cancelled) ++stats_.cancelled;
            if (reason == FinishReason::error) ++stats_.errors;
            stats_.prompt_tokens += uint64_t(usage.prompt_tokens);
            stats_.cached_tokens += uint64_t(usage.cached_tokens);
            stats_.generated_tokens += uint64_t(usage.completion_tokens);
        }
        job.publish([&](GenerationUpdate & u) {
            u.finished = true;
            u.finish = reason;
            u.error = std::move(error);
            u.tail = std::move(tail);
            u.stop_string = matched_stop;
            u.usage = usage;
        });
    };
    auto stop_reason = [&] { return job.cancelled() ? FinishReason::cancelled : FinishReason::shutdown; };

    try {
        Plan p = plan(req);
        Slot & slot = *p.slot;
        slot.last_used = ++tick_;
        Session & session = *slot.session;
        const int64_t n_prompt = int64_t(p.tokens.size());
        usage.prompt_tokens = n_prompt;
        usage.cached_tokens = p.reused;
        usage.cache_source = p.source;
        if (p.reused > 0 && p.source != "disk") {
            std::lock_guard<std::mutex> lock(mutex_);
            ++stats_.live_hits;
        }
        if (n_prompt >= options_.n_ctx) {
            finish(FinishReason::error,
                   fmt::format("the prompt has {} tokens; the context holds {}", n_prompt, options_.n_ctx), {});
            return;
        }
        job.publish([&](GenerationUpdate & u) {
            u.started = true;
            u.prefill_done = p.reused;
            u.prefill_total = n_prompt;
            u.usage = usage;
        });

        // Prefill, in segments that end where a disk snapshot is due.
        std::vector<int64_t> cuts;
        if (disk_) {
            if (req.cache_cut > p.reused && req.cache_cut < n_prompt && req.cache_cut >= options_.kv_cache_min_tokens)
                cuts.push_back(req.cache_cut);
            if (options_.kv_cache_interval > 0)
                for (int64_t c = (p.reused / options_.kv_cache_interval + 1) * options_.kv_cache_interval; c < n_prompt;
                     c += options_.kv_cache_interval)
                    cuts.push_back(c);
            std::sort(cuts.begin(), cuts.end());
        }
        cuts.push_back(n_prompt);
        Timer prefill_timer;
        const int64_t first = int64_t(session.tokens().size());
        bool prefilled = true;
        for (int64_t cut : cuts) {
            const int64_t at = int64_t(session.tokens().size());
            if (cut <= at) continue;
            const bool done = session.eval(std::span<const int32_t>(p.tokens).subspan(size_t(at), size_t(cut - at)),
                                           false, [&](int64_t d, int64_t) {
                                               job.publish([&](GenerationUpdate & u) { u.prefill_done = at + d; });
                                               return !stopped();
                                           });
            if (!done || stopped()) {
                prefilled = false;
                break;
            }
            if (cut < n_prompt) save_state(slot, cut == req.cache_cut ? KvSaveReason::cold : KvSaveReason::interval);
        }
        usage.prefill_seconds = prefill_timer.seconds();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            const int64_t n = int64_t(session.tokens().size()) - first;
            stats_.prefill_tokens += uint64_t(n);
            stats_.prefill_seconds += usage.prefill_seconds;
            if (prefilled && n > 0 && usage.prefill_seconds > 0)
                stats_.last_prefill_tps = double(n) / usage.prefill_seconds;
        }
        if (!prefilled) {
            finish(stop_reason(), {}, {});
            return;
        }

        // Decode.
        Sampler sampler(req.sampling);
        Utf8StreamDecoder utf8(tokenizer_);
        StopMatcher stops(req.stop);
        const int64_t limit = std::min<int64_t>(std::max<int64_t>(req.max_tokens, 1), options_.n_ctx - n_prompt);
        std::vector<int32_t> generated;
        Timer decode_timer;
        FinishReason reason = FinishReason::length;
        bool interrupted = false;
#ifdef DSV4_TEST_HOOKS
        size_t script_pos = 0;
#endif
        for (int64_t step = 0; step < limit; ++step) {
#ifdef DSV4_TEST_HOOKS
            for (int w = 0; w < req.test_step_delay_ms && !stopped(); w += 5)
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
#endif
            if (stopped()) {
                interrupted = true;
                break;
            }
            SampledToken tok;
#ifdef DSV4_TEST_HOOKS
            if (!req.scripted.empty())
                tok.id = script_pos < req.scripted.size() ? req.scripted[script_pos++] : tokenizer_.eos_id();
            else
#endif
                tok = session.sample(sampler);
            if (tok.id == tokenizer_.eos_id()) {
                reason = FinishReason::eos;
                break;
            }
            ++usage.completion_tokens;
            generated.push_back(tok.id);
            bool matched = false;
            GeneratedToken out{tok.id, stops.push(utf8.push(tok.id), &matched), tok.logprob, std::move(tok.top)};
            job.publish([&](GenerationUpdate & u) { u.tokens.push_back(std::move(out)); });
            if (matched) {
                reason = FinishReason::stop;
                break;
            }
            if (step + 1 == limit) break;  // nothing follows this token: no need to evaluate it
            session.eval(std::span<const int32_t>(&generated.back(), 1));
            if (disk_ && options_.kv_cache_interval > 0 && session.n_past() % options_.kv_cache_interval == 0)
                save_state(slot, KvSaveReason::interval);
        }
        usage.decode_seconds = decode_timer.seconds();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stats_.decode_seconds += usage.decode_seconds;
            if (usage.completion_tokens > 0 && usage.decode_seconds > 0)
                stats_.last_decode_tps = double(usage.completion_tokens) / usage.decode_seconds;
        }
        if (interrupted) {
            finish(stop_reason(), {}, {});
            return;
        }
        std::string tail;
        if (reason != FinishReason::stop) {
            bool matched = false;
            tail = stops.push(utf8.finish(), &matched);
            if (matched)
                reason = FinishReason::stop;
            else
                tail += stops.finish();
        }
        if (reason == FinishReason::stop) matched_stop = stops.matched();
        if (reason == FinishReason::eos && req.visible_alias) {
            // Every generated token was evaluated (EOS itself is not): the alias covers exactly the session.
            refresh_text(slot);
            slot.alias = req.visible_alias(tokenizer_.decode(generated));
        }
        finish(reason, {}, std::move(tail));
    } catch (const std::exception & e) {
        log_warn("generation failed: {}", e.what());
        finish(FinishReason::error, e.what(), {});
    }
}

}  // namespace dsv4
