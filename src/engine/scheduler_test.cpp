// The scheduler on a fake engine (DeepSeek's real vocabulary, scripted "model"): FIFO order, cancellation in the
// queue, during prefill and during decode, prefix reuse by tokens, by text and by alias, stop strings, limits, the
// disk cache across a restart, and shutdown. Built against dsv4_scheduler_test_hooks (scripted tokens available).
#include "engine/scheduler.h"

#include "format/gguf.h"
#include "text/chat.h"
#include "util/error.h"
#include "util/timer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

namespace dsv4 {
namespace {

const Tokenizer & vocab() {
    static const Tokenizer tok = Tokenizer::from_gguf(GgufFile::open(DSV4_VOCAB_GGUF));
    return tok;
}

// The "model": the next token as a function of the whole sequence; logits put +10 on it and -10 elsewhere.
using NextFn = std::function<int32_t(const std::vector<int32_t> &)>;

struct FakeLog {
    std::mutex mutex;
    std::vector<int32_t> first_tokens;  // tokens[0] of every eval call that starts a sequence (n_past 0)
    int64_t evaluated = 0;              // tokens evaluated in total
    int64_t chunks = 0;
    std::vector<size_t> steps;  // sessions of every decode_batch call
    std::string events;         // P: a prefill call's chunk (more than one token), D: a decode_batch call
    std::vector<size_t> prefills;  // tokens of every eval call of more than one token
};

class FakeSession final : public Session {
  public:
    FakeSession(int64_t n_ctx, NextFn next, FakeLog & log, int chunk, int chunk_ms)
        : n_ctx_(n_ctx), next_(std::move(next)), log_(log), chunk_(chunk), chunk_ms_(chunk_ms) {}

    int64_t n_ctx() const override { return n_ctx_; }
    int64_t n_past() const override { return int64_t(tokens_.size()); }
    const std::vector<int32_t> & tokens() const override { return tokens_; }
    std::span<const float> logits() const override { return logits_; }
    bool has_logits() const override { return !logits_.empty(); }
    SampledToken sample(Sampler & sampler) override { return sampler.sample(logits_); }
    void clear() override {
        tokens_.clear();
        logits_.clear();
    }

    bool eval(std::span<const int32_t> t, bool, const ProgressFn & progress) override {
        DSV4_CHECK(int64_t(tokens_.size() + t.size()) <= n_ctx_, "fake: context full");
        {
            std::lock_guard<std::mutex> lock(log_.mutex);
            if (tokens_.empty() && !t.empty()) log_.first_tokens.push_back(t[0]);
            if (t.size() > 1) log_.prefills.push_back(t.size());
        }
        for (size_t i = 0; i < t.size(); i += size_t(chunk_)) {
            const size_t n = std::min(t.size() - i, size_t(chunk_));
            if (chunk_ms_) std::this_thread::sleep_for(std::chrono::milliseconds(chunk_ms_));
            tokens_.insert(tokens_.end(), t.begin() + std::ptrdiff_t(i), t.begin() + std::ptrdiff_t(i + n));
            {
                std::lock_guard<std::mutex> lock(log_.mutex);
                log_.evaluated += int64_t(n);
                ++log_.chunks;
                if (t.size() > 1) log_.events += 'P';
            }
            if (progress && !progress(int64_t(i + n), int64_t(t.size()))) {
                logits_.clear();
                return false;
            }
        }
        logits_.assign(size_t(vocab().n_vocab()), -10.0f);
        logits_[size_t(next_(tokens_))] = 10.0f;
        return true;
    }
    int64_t sync(std::span<const int32_t>, const ProgressFn &) override { fail("fake: sync is not used"); }

    std::string snapshot() const override {
        std::string out(reinterpret_cast<const char *>(tokens_.data()), tokens_.size() * 4);
        out.append(reinterpret_cast<const char *>(logits_.data()), logits_.size() * 4);
        return std::to_string(tokens_.size()) + ":" + out;
    }
    void restore(std::string_view bytes) override {
        clear();
        const size_t colon = bytes.find(':');
        DSV4_CHECK(colon != std::string_view::npos, "fake: bad snapshot");
        const size_t n = std::stoul(std::string(bytes.substr(0, colon)));
        bytes.remove_prefix(colon + 1);
        tokens_.resize(n);
        std::memcpy(tokens_.data(), bytes.data(), n * 4);
        bytes.remove_prefix(n * 4);
        logits_.resize(bytes.size() / 4);
        std::memcpy(logits_.data(), bytes.data(), bytes.size());
    }

  private:
    int64_t n_ctx_;
    NextFn next_;
    FakeLog & log_;
    int chunk_, chunk_ms_;
    std::vector<int32_t> tokens_;
    std::vector<float> logits_;
};

class FakeEngine final : public Engine {
  public:
    explicit FakeEngine(NextFn next, int chunk = 64, int chunk_ms = 0)
        : next_(std::move(next)), chunk_(chunk), chunk_ms_(chunk_ms) {
        info_.name = "fake";
        info_.n_vocab = vocab().n_vocab();
        info_.fingerprint = 77;
    }
    const ModelInfo & info() const override { return info_; }
    void set_ubatch(int64_t n) { info_.n_ubatch = n; }  // the scheduler prefills in pieces of this many tokens
    const Tokenizer * tokenizer() const override { return &vocab(); }
    std::unique_ptr<Session> new_session(int64_t n_ctx) override {
        return std::make_unique<FakeSession>(n_ctx, next_, log, chunk_, chunk_ms_);
    }
    uint64_t session_bytes(int64_t n_ctx) const override { return uint64_t(n_ctx) * 1000; }
    uint64_t peak_device_bytes() const override { return 0; }
    void decode_batch(std::span<Session * const> sessions, std::span<const int32_t> tokens) override {
        {
            std::lock_guard<std::mutex> lock(log.mutex);
            log.steps.push_back(sessions.size());
            log.events += 'D';
        }
        for (size_t i = 0; i < sessions.size(); ++i) sessions[i]->eval(tokens.subspan(i, 1));
    }
    bool batched_decode() const override { return true; }

    FakeLog log;

  private:
    NextFn next_;
    int chunk_, chunk_ms_;
    ModelInfo info_;
};

// Generates `reply` (token ids) after any prompt, then EOS.
NextFn reply_with(std::vector<int32_t> reply, size_t prompt_len) {
    return [reply, prompt_len](const std::vector<int32_t> & t) {
        const size_t k = t.size() - prompt_len;
        return k < reply.size() ? reply[k] : vocab().eos_id();
    };
}

std::vector<int32_t> ids(std::string_view text) { return vocab().encode(text, false); }

struct Result {
    std::string text;
    std::vector<int32_t> tokens;
    GenerationUpdate last;
};

Result drain(GenerationJob & job, double timeout_s = 20) {
    Result r;
    Timer t;
    while (t.seconds() < timeout_s) {
        GenerationUpdate u = job.wait(0.5);
        for (const GeneratedToken & g : u.tokens) {
            r.text += g.text;
            r.tokens.push_back(g.id);
        }
        r.text += u.tail;
        if (u.finished) {
            r.last = u;
            return r;
        }
    }
    ADD_FAILURE() << "job did not finish";
    return r;
}

GenerationRequest greedy(std::vector<int32_t> prompt, int64_t max_tokens = 100) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.sampling.temperature = 0;
    r.max_tokens = max_tokens;
    return r;
}

TEST(Scheduler, GeneratesUntilEosAndReportsUsage) {
    const std::vector<int32_t> prompt = ids("Hello there");
    FakeEngine engine(reply_with(ids(" General Kenobi"), prompt.size()));
    Scheduler s(engine, {});
    Result r = drain(*s.submit(greedy(prompt)));
    EXPECT_EQ(r.text, " General Kenobi");
    EXPECT_EQ(r.last.finish, FinishReason::eos);
    EXPECT_EQ(r.last.usage.prompt_tokens, int64_t(prompt.size()));
    EXPECT_EQ(r.last.usage.completion_tokens, int64_t(ids(" General Kenobi").size()));
    EXPECT_EQ(r.last.usage.cached_tokens, 0);
    EXPECT_EQ(s.stats().requests, 1u);
}

TEST(Scheduler, MaxTokensAndTheContextEndGenerationWithLength) {
    const std::vector<int32_t> prompt = ids("count");
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("a"); });
    SchedulerOptions o;
    o.n_ctx = 64;
    Scheduler s(engine, o);
    Result r = drain(*s.submit(greedy(prompt, 5)));
    EXPECT_EQ(r.last.finish, FinishReason::length);
    EXPECT_EQ(r.text, "aaaaa");
    r = drain(*s.submit(greedy(prompt, 1000)));  // clamped to the room the context leaves
    EXPECT_EQ(r.last.finish, FinishReason::length);
    EXPECT_EQ(int64_t(r.tokens.size()), 64 - int64_t(prompt.size()));
    EXPECT_THROW(s.submit(greedy(std::vector<int32_t>(64, 5))), Error);  // no room for one token
    EXPECT_THROW(s.submit(greedy({})), Error);
    EXPECT_THROW(s.submit(greedy({vocab().n_vocab()})), Error);
}

TEST(Scheduler, StopStringsEndBeforeTheMatchAndHoldBackPartialMatches) {
    const std::vector<int32_t> prompt = ids("q");
    FakeEngine engine(reply_with(ids("Hello wonderful world"), prompt.size()));
    Scheduler s(engine, {});
    GenerationRequest r = greedy(prompt);
    r.stop = {"world", "xyz"};
    Result out = drain(*s.submit(r));
    EXPECT_EQ(out.last.finish, FinishReason::stop);
    EXPECT_EQ(out.text, "Hello wonderful ");
    // "wo" of "wonderful" was held back until it could no longer be "world", then released.
    r.stop = {"Hello"};
    out = drain(*s.submit(r));
    EXPECT_EQ(out.text, "");
    EXPECT_EQ(out.last.finish, FinishReason::stop);
    r.stop = {"world!"};  // never completes: everything comes out by the end
    out = drain(*s.submit(r));
    EXPECT_EQ(out.text, "Hello wonderful world");
    EXPECT_EQ(out.last.finish, FinishReason::eos);
}

TEST(Scheduler, RunsJobsInArrivalOrder) {
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("x"); }, 4, 20);
    SchedulerOptions o;
    o.n_sessions = 2;
    Scheduler s(engine, o);
    std::vector<std::shared_ptr<GenerationJob>> jobs;
    for (int32_t first : {1000, 1001, 1002, 1003, 1004})
        jobs.push_back(s.submit(greedy({first, 7, 7, 7, 7, 7, 7, 7}, 3)));
    for (auto & j : jobs) EXPECT_EQ(drain(*j).last.finish, FinishReason::length);
    std::lock_guard<std::mutex> lock(engine.log.mutex);
    EXPECT_EQ(engine.log.first_tokens, (std::vector<int32_t>{1000, 1001, 1002, 1003, 1004}));
}

// Up to --sessions requests run at once, each decode step one engine call for all of them; the others wait in the
// queue for a slot. Each reply is its own (the "model" answers from the prompt's first token), and cancelling one
// leaves the rest running.
TEST(Scheduler, RunsRequestsTogetherUpToTheSessions) {
    FakeEngine engine([](const std::vector<int32_t> & t) { return t[0] - 1000 + vocab().token_id("a"); });
    SchedulerOptions o;
    o.n_sessions = 3;
    Scheduler s(engine, o);
    std::vector<std::shared_ptr<GenerationJob>> jobs;
    for (int32_t first : {1000, 1001, 1002, 1003}) {
        GenerationRequest r = greedy({first, 7, 7}, 12);
        r.test_step_delay_ms = 5;
        jobs.push_back(s.submit(r));
    }
    GenerationRequest endless = greedy({1004, 7}, 100000);
    endless.test_step_delay_ms = 5;
    auto cancelled = s.submit(endless);
    for (int i = 0; i < 4; ++i) {
        const Result r = drain(*jobs[size_t(i)]);
        EXPECT_EQ(r.last.finish, FinishReason::length);
        EXPECT_EQ(r.tokens, std::vector<int32_t>(12, vocab().token_id("a") + i)) << "request " << i;
    }
    while (cancelled->wait(0.1).tokens.empty()) {
    }
    cancelled->cancel();
    EXPECT_EQ(drain(*cancelled).last.finish, FinishReason::cancelled);
    std::lock_guard<std::mutex> lock(engine.log.mutex);
    EXPECT_EQ(*std::max_element(engine.log.steps.begin(), engine.log.steps.end()), 3u);
    // The first three ran side by side: each is admitted and prefilled one loop after the one before, so the third's
    // 11 evaluated tokens (the 12th is not evaluated) take 9 steps of three when the queue filled at once.
    EXPECT_GE(std::count(engine.log.steps.begin(), engine.log.steps.end(), 3u), 5);
    EXPECT_EQ(engine.log.first_tokens, (std::vector<int32_t>{1000, 1001, 1002, 1003, 1004}));
    const SchedulerStats st = s.stats();
    EXPECT_EQ(st.cancelled, 1u);
    EXPECT_EQ(st.decode_steps, engine.log.steps.size());
    size_t tokens = 0;
    for (size_t n : engine.log.steps) tokens += n;
    EXPECT_EQ(st.decode_step_tokens, tokens);
}

// A long prompt is prefilled one engine chunk at a time, with a decode step of the running requests between
// pieces: their tokens keep coming while it prefills.
TEST(Scheduler, DecodingGoesOnBetweenThePiecesOfALongPrefill) {
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("x"); }, 16, 10);
    engine.set_ubatch(16);
    SchedulerOptions o;
    o.n_sessions = 2;
    Scheduler s(engine, o);
    GenerationRequest talker = greedy({1, 2}, 100000);
    talker.test_step_delay_ms = 2;
    auto a = s.submit(talker);
    while (a->wait(0.1).tokens.empty()) {
    }
    size_t mark = 0;
    {
        std::lock_guard<std::mutex> lock(engine.log.mutex);
        mark = engine.log.events.size();
    }
    auto b = s.submit(greedy(std::vector<int32_t>(160, 9), 1));
    EXPECT_EQ(drain(*b).last.finish, FinishReason::length);
    a->cancel();
    drain(*a);
    std::lock_guard<std::mutex> lock(engine.log.mutex);
    const std::string e = engine.log.events.substr(mark);
    ASSERT_EQ(std::count(e.begin(), e.end(), 'P'), 10) << e;
    const std::string prefill = e.substr(e.find('P'), e.rfind('P') - e.find('P') + 1);
    EXPECT_EQ(std::count(prefill.begin(), prefill.end(), 'D'), 9) << e;  // one step between every two pieces
}

// While another request decodes, a long prompt is evaluated in slices sized to prefill_slice_seconds from the speed
// of the pieces before; alone, it takes whole engine chunks.
TEST(Scheduler, APromptIsSlicedWhileOthersDecode) {
    // 64 tokens take 5 ms: at most 12800 tokens/s, so a slice of 20 ms is the smallest, 256 tokens.
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("x"); }, 64, 5);
    engine.set_ubatch(1024);
    SchedulerOptions o;
    o.n_sessions = 2;
    o.kv_cache_interval = 0;
    o.prefill_slice_seconds = 0.02;
    Scheduler s(engine, o);
    auto prefills_of = [&](const std::vector<int32_t> & prompt) {
        size_t mark = 0, events = 0;
        {
            std::lock_guard<std::mutex> lock(engine.log.mutex);
            mark = engine.log.prefills.size();
            events = engine.log.events.size();
        }
        drain(*s.submit(greedy(prompt, 1)));
        std::lock_guard<std::mutex> lock(engine.log.mutex);
        return std::make_pair(
            std::vector<size_t>(engine.log.prefills.begin() + std::ptrdiff_t(mark), engine.log.prefills.end()),
            engine.log.events.substr(events));
    };
    EXPECT_EQ(prefills_of(std::vector<int32_t>(2048, 9)).first, std::vector<size_t>(2, 1024));
    GenerationRequest talker = greedy({1, 2}, 100000);
    talker.test_step_delay_ms = 1;
    auto a = s.submit(talker);
    while (a->wait(0.1).tokens.empty()) {
    }
    const auto [sliced, events] = prefills_of(std::vector<int32_t>(2048, 8));
    EXPECT_EQ(sliced, std::vector<size_t>(8, 256));
    EXPECT_EQ(events.substr(events.find('P'), 8 * 5 - 1), "PPPPDPPPPDPPPPDPPPPDPPPPDPPPPDPPPPDPPPP");
    a->cancel();
    drain(*a);
}

// Prompts being prefilled take turns: a short one submitted during a long prefill is answered before that prefill ends.
TEST(Scheduler, AShortPromptIsNotQueuedBehindALongPrefill) {
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("x"); }, 16, 10);
    engine.set_ubatch(16);
    SchedulerOptions o;
    o.n_sessions = 2;
    Scheduler s(engine, o);
    auto longer = s.submit(greedy(std::vector<int32_t>(320, 9), 1));  // 20 pieces of 10 ms
    auto shorter = s.submit(greedy(std::vector<int32_t>(16, 8), 1));
    EXPECT_EQ(drain(*shorter).last.finish, FinishReason::length);
    {
        std::lock_guard<std::mutex> lock(engine.log.mutex);
        EXPECT_LT(engine.log.evaluated, 320 + 16) << "the long prefill ended first";
    }
    EXPECT_EQ(drain(*longer).last.finish, FinishReason::length);
}

// A request cancelled while queued never holds a session, and the running count says so once it is dropped.
TEST(Scheduler, ACancelledRequestIsNotCountedAsRunning) {
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("x"); });
    Scheduler s(engine, {});
    GenerationRequest slow = greedy({1, 2}, 20);
    slow.test_step_delay_ms = 10;
    auto running = s.submit(slow);
    auto queued = s.submit(greedy({3, 4}, 5));
    queued->cancel();
    EXPECT_EQ(drain(*running).last.finish, FinishReason::length);
    EXPECT_EQ(drain(*queued).last.finish, FinishReason::cancelled);
    Timer t;
    while (s.stats().running != 0 && t.seconds() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(s.stats().running, 0);
}

TEST(Scheduler, CancelledQueuedJobNeverRuns) {
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("x"); }, 4, 30);
    Scheduler s(engine, {});
    auto a = s.submit(greedy({1000, 1, 1, 1, 1, 1, 1, 1}, 2));
    auto b = s.submit(greedy({2000, 1, 1}, 2));
    auto c = s.submit(greedy({3000, 1, 1}, 2));
    b->cancel();
    EXPECT_EQ(drain(*a).last.finish, FinishReason::length);
    EXPECT_EQ(drain(*b).last.finish, FinishReason::cancelled);
    EXPECT_EQ(drain(*c).last.finish, FinishReason::length);
    std::lock_guard<std::mutex> lock(engine.log.mutex);
    EXPECT_EQ(engine.log.first_tokens, (std::vector<int32_t>{1000, 3000}));
    EXPECT_EQ(s.stats().cancelled, 1u);
}

TEST(Scheduler, CancellationStopsPrefillBetweenChunks) {
    // 40 chunks of 50 ms: a full prefill would take 2 s (the bounds leave room for a loaded CI machine).
    FakeEngine engine([](const std::vector<int32_t> &) { return 5; }, 16, 50);
    Scheduler s(engine, {});
    auto job = s.submit(greedy(std::vector<int32_t>(640, 9), 10));
    Timer t;
    while (t.seconds() < 5) {
        GenerationUpdate u = job->wait(0.05);
        if (u.prefill_done > 0) break;
    }
    job->cancel();
    Result r = drain(*job);
    EXPECT_LT(t.seconds(), 1.0);
    EXPECT_EQ(r.last.finish, FinishReason::cancelled);
    EXPECT_TRUE(r.tokens.empty());
    std::lock_guard<std::mutex> lock(engine.log.mutex);
    EXPECT_LT(engine.log.chunks, 10);
}

TEST(Scheduler, CancellationStopsDecodingBeforeTheNextToken) {
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("z"); });
    Scheduler s(engine, {});
    GenerationRequest r = greedy({1, 2, 3}, 100000);
    r.test_step_delay_ms = 20;
    auto job = s.submit(r);
    size_t seen = 0;
    Timer t;
    while (seen < 3 && t.seconds() < 5) seen += job->wait(0.1).tokens.size();
    job->cancel();
    Timer after;
    Result rest = drain(*job);
    EXPECT_LT(after.seconds(), 1.0);
    EXPECT_EQ(rest.last.finish, FinishReason::cancelled);
    EXPECT_LT(seen + rest.tokens.size(), 10u);
}

TEST(Scheduler, ReusesALiveSessionByTokenPrefix) {
    const std::vector<int32_t> p1 = ids("The first question");
    const std::vector<int32_t> reply = ids(" and its answer");
    FakeEngine engine(reply_with(reply, p1.size()));
    Scheduler s(engine, {});
    drain(*s.submit(greedy(p1)));
    const int64_t before = engine.log.evaluated;
    std::vector<int32_t> p2 = p1;
    p2.insert(p2.end(), reply.begin(), reply.end());
    p2.push_back(vocab().eos_id());
    for (int32_t id : ids(" next")) p2.push_back(id);
    Result r = drain(*s.submit(greedy(p2, 1)));
    EXPECT_EQ(r.last.usage.cache_source, "live");
    // The session holds the prompt and every generated token but the last (nothing followed it).
    const int64_t held = int64_t(p1.size() + reply.size());
    EXPECT_EQ(r.last.usage.cached_tokens, held);
    EXPECT_EQ(engine.log.evaluated - before, int64_t(p2.size()) - held);
    EXPECT_EQ(s.stats().live_hits, 1u);
}

TEST(Scheduler, ReusesByRenderedTextWhenTheTokensDiffer) {
    // The model sampled " wor" + "ld"; the client's history re-tokenizes as " world": tokens differ, text does not.
    const std::vector<int32_t> p1 = ids("Hello");
    const std::vector<int32_t> sampled = {vocab().token_id("Ġwor"), vocab().token_id("ld")};
    ASSERT_GE(sampled[0], 0);
    ASSERT_GE(sampled[1], 0);
    ASSERT_NE(ids(" world"), sampled);
    FakeEngine engine(reply_with(sampled, p1.size()));
    Scheduler s(engine, {});
    GenerationRequest r1 = greedy(p1);
    r1.pieces = {{"Hello", false}};
    EXPECT_EQ(drain(*s.submit(r1)).text, " world");

    GenerationRequest r2 = greedy({}, 1);
    r2.pieces = {{"Hello world", false}, {std::string(kUserText), true}, {"more", false}};
    r2.prompt = vocab().encode_pieces(r2.pieces);
    Result out = drain(*s.submit(r2));
    EXPECT_EQ(out.last.usage.cache_source, "live-text");
    EXPECT_EQ(out.last.usage.cached_tokens, int64_t(p1.size() + 2));
}

TEST(Scheduler, ReusesByTextWhenTheReplyWasCutInsideACharacter) {
    // The length limit cuts the reply inside "中" (E4 B8 AD), sampled as single bytes: the client saw U+FFFD for the
    // unfinished character (the stream's rule) and sends that back in its history, while the session holds the byte
    // E4 (every sampled token but the last was evaluated). Before the text was compared as streamed, nothing of the
    // session could serve the next prompt.
    const std::vector<int32_t> p1 = ids("Hello");
    std::vector<int32_t> sampled = ids(" caf");
    for (std::string_view byte_char : {"\xC3\xA4", "\xC2\xB8"}) {  // the bytes E4, B8 in the byte-level alphabet
        sampled.push_back(vocab().token_id(byte_char));
        ASSERT_GE(sampled.back(), 0);
    }
    ASSERT_EQ(vocab().token_bytes(sampled[sampled.size() - 2]), "\xE4");
    FakeEngine engine(reply_with(sampled, p1.size()));
    Scheduler s(engine, {});
    GenerationRequest r1 = greedy(p1, int64_t(sampled.size()));
    r1.pieces = {{"Hello", false}};
    const Result first = drain(*s.submit(r1));
    EXPECT_EQ(first.text, " caf\xEF\xBF\xBD");
    EXPECT_EQ(first.last.finish, FinishReason::length);

    GenerationRequest r2 = greedy({}, 1);
    r2.pieces = {
        {"Hello" + first.text, false}, {std::string(kEosText), true}, {std::string(kUserText), true}, {"more", false}};
    r2.prompt = vocab().encode_pieces(r2.pieces);
    Result out = drain(*s.submit(r2));
    EXPECT_EQ(out.last.usage.cache_source, "live-text");
    EXPECT_EQ(out.last.usage.cached_tokens, int64_t(p1.size() + sampled.size() - 1));

    // The session went on from the U+FFFD: its text as streamed is the second prompt's (not the cut bytes followed by
    // a second U+FFFD), so the next turn extends all of it.
    GenerationRequest r3 = greedy({}, 1);
    r3.pieces = r2.pieces;
    r3.pieces.push_back({" again", false});
    r3.prompt = vocab().encode_pieces(r3.pieces);
    Result again = drain(*s.submit(r3));
    EXPECT_EQ(again.last.usage.cached_tokens, out.last.usage.prompt_tokens);
}

TEST(Scheduler, VisibleAliasServesTheClientsRenderingOfTheSameState) {
    const std::vector<int32_t> p1 = ids("Q1");
    FakeEngine engine(reply_with(ids("hidden reasoning then answer"), p1.size()));
    Scheduler s(engine, {});
    GenerationRequest r1 = greedy(p1);
    r1.pieces = {{"Q1", false}};
    std::string seen;
    r1.visible_alias = [&](std::string_view generated) {
        seen = std::string(generated);
        return std::string("Q1 answer");  // what the client will render for this state
    };
    drain(*s.submit(r1));
    EXPECT_EQ(seen, "hidden reasoning then answer");

    GenerationRequest r2 = greedy({}, 1);
    r2.pieces = {{"Q1 answer", false}, {std::string(kEosText), true}, {"Q2", false}};
    r2.prompt = vocab().encode_pieces(r2.pieces);
    Result out = drain(*s.submit(r2));
    EXPECT_EQ(out.last.usage.cache_source, "live-text");
    EXPECT_EQ(out.last.usage.cached_tokens, int64_t(p1.size() + ids("hidden reasoning then answer").size()));
}

TEST(Scheduler, DiskCacheRestoresAfterARestart) {
    const auto dir = std::filesystem::temp_directory_path() / ("dsv4_sched_disk_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::vector<int32_t> prompt;
    for (int i = 0; i < 40; ++i) prompt.push_back(1000 + i);
    SchedulerOptions o;
    o.kv_disk_dir = dir.string();
    o.kv_cache_min_tokens = 16;
    o.kv_cache_interval = 0;
    {
        FakeEngine engine(reply_with(ids(" ok"), prompt.size()));
        Scheduler s(engine, o);
        drain(*s.submit(greedy(prompt)));
        s.shutdown(1);  // saves the live session
        EXPECT_EQ(s.stats().disk.writes, 1u);
    }
    FakeEngine engine(reply_with(ids(" ok"), prompt.size()));
    Scheduler s(engine, o);
    std::vector<int32_t> longer = prompt;
    for (int32_t id : ids(" ok")) longer.push_back(id);
    longer.push_back(77);
    Result r = drain(*s.submit(greedy(longer, 1)));
    EXPECT_EQ(r.last.usage.cache_source, "disk");
    EXPECT_EQ(r.last.usage.cached_tokens, int64_t(prompt.size() + ids(" ok").size()));
    EXPECT_EQ(engine.log.evaluated, 1);
    EXPECT_EQ(s.stats().disk_hits, 1u);
    s.shutdown(1);
    std::filesystem::remove_all(dir);
}

TEST(Scheduler, ColdSnapshotAtTheCacheCutAndEvictionSave) {
    const auto dir = std::filesystem::temp_directory_path() / ("dsv4_sched_cut_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    SchedulerOptions o;
    o.kv_disk_dir = dir.string();
    o.kv_cache_min_tokens = 8;
    o.kv_cache_interval = 0;
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().eos_id(); });
    Scheduler s(engine, o);
    GenerationRequest a = greedy(std::vector<int32_t>(30, 1000));
    a.cache_cut = 20;
    // Snapshots are written by the cache's writer thread: the counts are those of the snapshots handed to it.
    auto saved = [&] {
        const KvCacheStats d = s.stats().disk;  // one reading: a snapshot is never counted in both
        return d.writes + d.queued;
    };
    drain(*s.submit(a));
    EXPECT_EQ(saved(), 1u);                                    // at the cut
    drain(*s.submit(greedy(std::vector<int32_t>(12, 2000))));  // unrelated: the 30-token state is saved first
    EXPECT_EQ(saved(), 2u);
    GenerationRequest back = greedy(std::vector<int32_t>(25, 1000));  // shares the cut's 20 tokens
    Result r = drain(*s.submit(back));
    EXPECT_EQ(r.last.usage.cache_source, "disk");
    EXPECT_EQ(r.last.usage.cached_tokens, 20);
    s.shutdown(1);
    std::filesystem::remove_all(dir);
}

TEST(Scheduler, ScriptedTokensReplaceSampling) {
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("q"); });
    Scheduler s(engine, {});
    GenerationRequest r = greedy(ids("x"));
    r.scripted = ids("scripted reply");
    Result out = drain(*s.submit(r));
    EXPECT_EQ(out.text, "scripted reply");
    EXPECT_EQ(out.last.finish, FinishReason::eos);
}

TEST(Scheduler, ShutdownFinishesQueuedJobsAndStopsTheRunningOne) {
    FakeEngine engine([](const std::vector<int32_t> &) { return vocab().token_id("z"); });
    Scheduler s(engine, {});
    GenerationRequest slow = greedy({1, 2}, 100000);
    slow.test_step_delay_ms = 10;
    auto running = s.submit(slow);
    auto queued = s.submit(greedy({3, 4}, 5));
    while (running->wait(0.1).tokens.empty()) {
    }
    Timer t;
    s.shutdown(0.2);
    EXPECT_LT(t.seconds(), 2.0);
    EXPECT_EQ(drain(*running).last.finish, FinishReason::shutdown);
    EXPECT_EQ(drain(*queued).last.finish, FinishReason::shutdown);
    EXPECT_THROW(s.submit(greedy({5})), Error);
}

}  // namespace
}  // namespace dsv4
