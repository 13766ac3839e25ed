// The engine's memory plan and load progress on a small synthetic model (CPU backend): the plan's KV bytes are
// what a session allocates, an impossible context is refused with the largest one that fits, and the progress
// callback counts every tensor byte once, ending at the total.
#include "dsv4/engine.h"
#include "dsv4/sampler.h"
#include "format/gguf.h"
#include "model/synth.h"
#include "util/error.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdio>
#include <filesystem>

namespace dsv4 {
namespace {

class EngineTest : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        path_ = (std::filesystem::temp_directory_path() / ("dsv4_engine_test_" + std::to_string(getpid()) + ".gguf"))
                    .string();
        SynthOptions o;
        o.config = mini_config(3, 512);
        o.mtp_in_file = true;  // the plan must count the MTP block's ring and fused projection
        write_synthetic_model(o, path_);
    }
    static void TearDownTestSuite() { std::remove(path_.c_str()); }

    static EngineOptions options() {
        EngineOptions e;
        e.model_path = path_;
        e.backend = "cpu";
        e.n_threads = 2;
        e.n_ubatch = 64;
        return e;
    }
    static inline std::string path_;
};

TEST_F(EngineTest, PlanMatchesWhatSessionsAllocate) {
    auto engine = Engine::open(options());
    for (int64_t ctx : {int64_t(16), int64_t(1000), int64_t(8192)}) {
        const MemoryPlan p = Engine::plan(options(), ctx, 2);
        EXPECT_EQ(p.n_ctx, ctx);
        EXPECT_EQ(p.n_ubatch, 64);
        EXPECT_EQ(p.kv_per_session(), engine->session_bytes(ctx)) << ctx;
        EXPECT_EQ(p.weights, engine->info().weight_bytes);
        // The workspace holds min(n_ubatch, Model::kHeadRows) rows of logits at least (here 64 × n_vocab floats).
        EXPECT_GE(p.workspace, uint64_t(64 * 512 * 4));
        EXPECT_EQ(p.total(), p.weights + 2 * p.kv_per_session() + p.workspace + p.scratch);
        EXPECT_TRUE(p.fits());
        EXPECT_NO_THROW(p.require_fit());
    }
    // n_ctx 0 plans the largest context; the trained context (mini: 1M) caps it.
    const MemoryPlan largest = Engine::plan(options(), 0);
    EXPECT_EQ(largest.n_ctx, largest.max_ctx);
    EXPECT_GT(largest.max_ctx, 0);
    EXPECT_EQ(largest.max_ctx % Engine::kContextStep, 0);
}

TEST_F(EngineTest, ImpossibleContextIsRefusedWithTheLargestThatFits) {
    const MemoryPlan p = Engine::plan(options(), int64_t(1) << 40, 1);
    EXPECT_FALSE(p.fits());
    try {
        p.require_fit();
        FAIL() << "a context of 2^40 tokens fit";
    } catch (const Error & e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("1099511627776 tokens"), std::string::npos) << m;
        EXPECT_NE(m.find("the largest context that fits is " + std::to_string(p.max_ctx)), std::string::npos) << m;
    }
    EXPECT_NE(p.describe().find("fits        NO"), std::string::npos);
}

TEST_F(EngineTest, LoadProgressCountsEveryTensorOnce) {
    uint64_t file_bytes = 0;
    const GgufFile file = GgufFile::open(path_);  // a range-for over a temporary's tensors() would read freed memory
    for (const GgufTensorInfo & t : file.tensors()) file_bytes += t.n_bytes;
    std::vector<LoadProgress> seen;
    auto engine = Engine::open(options(), [&](const LoadProgress & p) { seen.push_back(p); });
    ASSERT_GT(seen.size(), 10u);  // one call per tensor
    for (size_t i = 1; i < seen.size(); ++i) {
        EXPECT_GE(seen[i].bytes_done, seen[i - 1].bytes_done);
        EXPECT_GE(seen[i].seconds, seen[i - 1].seconds);
        EXPECT_EQ(seen[i].bytes_total, file_bytes);
    }
    EXPECT_EQ(seen.back().bytes_done, file_bytes);
    EXPECT_DOUBLE_EQ(seen.back().fraction(), 1.0);
    // The call before the final one: every tensor of the file is used by the model, so all bytes were counted.
    EXPECT_EQ(seen[seen.size() - 2].bytes_done, file_bytes);
}

TEST_F(EngineTest, SessionSamplesAsTheSamplerDoesOnTheRow) {
    // Session::sample goes through the backend's candidates; drawing from the whole row with a sampler of the same
    // seed must give the same tokens, through decoding, a snapshot and a restore.
    auto engine = Engine::open(options());
    auto session = engine->new_session(256);
    EXPECT_FALSE(session->has_logits());
    EXPECT_THROW(
        {
            SamplingParams p;
            p.seed = 1;
            Sampler s(p);
            session->sample(s);
        },
        Error);
    const std::vector<int32_t> prompt = {5, 17, 300, 2, 99, 410, 7, 8, 9, 10};
    session->eval(prompt);
    ASSERT_TRUE(session->has_logits());
    for (float temperature : {0.0f, 0.7f, 1.0f}) {
        SamplingParams p;
        p.temperature = temperature;
        p.n_logprobs = 3;
        p.seed = 42;
        Sampler on_session(p), on_row(p);
        for (int step = 0; step < 6; ++step) {
            const SampledToken a = session->sample(on_session);
            const SampledToken b = on_row.sample(session->logits());
            ASSERT_EQ(a.id, b.id) << "T " << temperature << " step " << step;
            EXPECT_NEAR(a.logprob, b.logprob, 1e-5);
            ASSERT_EQ(a.top.size(), 3u);
            for (size_t i = 0; i < 3; ++i) EXPECT_EQ(a.top[i].id, b.top[i].id);
            session->eval(std::vector<int32_t>{a.id});
        }
    }
    const std::string snap = session->snapshot();
    auto other = engine->new_session(256);
    other->restore(snap);
    ASSERT_TRUE(other->has_logits());
    SamplingParams p;
    p.greedy = true;
    p.seed = 1;
    Sampler g1(p), g2(p);
    EXPECT_EQ(other->sample(g1).id, session->sample(g2).id);
}

}  // namespace
}  // namespace dsv4
