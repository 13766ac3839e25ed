// Sampler: distributions against the closed-form probabilities, seeds, and the edges of every filter.
#include "dsv4/sampler.h"

#include "util/error.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>

namespace dsv4 {
namespace {

// Logits whose softmax is exactly `probs`.
std::vector<float> logits_of(const std::vector<double> & probs) {
    std::vector<float> l;
    for (double p : probs) l.push_back(p > 0 ? float(std::log(p)) : -std::numeric_limits<float>::infinity());
    return l;
}

std::vector<double> frequencies(Sampler & s, const std::vector<float> & logits, int n) {
    std::vector<double> f(logits.size(), 0.0);
    for (int i = 0; i < n; ++i) f[size_t(s.sample(logits).id)] += 1.0 / n;
    return f;
}

SamplingParams plain(uint64_t seed = 7) {
    SamplingParams p;
    p.min_p = 0;
    p.seed = seed;
    return p;
}

// 40000 draws: the standard error of a frequency is at most 0.0025, so 0.012 is about five of them.
constexpr int kDraws = 40000;
constexpr double kTol = 0.012;

TEST(Sampler, DefaultsAreDeepSeeksApiDefaults) {
    SamplingParams p;
    EXPECT_EQ(p.temperature, 1.0f);
    EXPECT_EQ(p.top_p, 1.0f);
    EXPECT_EQ(p.top_k, 0);
    EXPECT_FLOAT_EQ(p.min_p, 0.05f);
    EXPECT_FALSE(p.is_greedy());
}

TEST(Sampler, MatchesTheSoftmaxDistribution) {
    const std::vector<double> probs = {0.5, 0.25, 0.15, 0.1};
    Sampler s(plain());
    const std::vector<double> f = frequencies(s, logits_of(probs), kDraws);
    for (size_t i = 0; i < probs.size(); ++i) EXPECT_NEAR(f[i], probs[i], kTol) << "token " << i;
}

TEST(Sampler, TemperatureReshapes) {
    const std::vector<double> probs = {0.6, 0.3, 0.1};
    for (float t : {0.5f, 2.0f}) {
        SamplingParams p = plain();
        p.temperature = t;
        Sampler s(p);
        // p_i^(1/T) renormalised.
        std::vector<double> expect;
        double z = 0;
        for (double q : probs) z += std::pow(q, 1.0 / t);
        for (double q : probs) expect.push_back(std::pow(q, 1.0 / t) / z);
        const std::vector<double> f = frequencies(s, logits_of(probs), kDraws);
        for (size_t i = 0; i < probs.size(); ++i) EXPECT_NEAR(f[i], expect[i], kTol) << "T " << t << " token " << i;
    }
}

TEST(Sampler, GreedyTakesTheArgmaxAndTiesGoToTheLowestId) {
    SamplingParams p;
    p.temperature = 0;
    Sampler s(p);
    EXPECT_EQ(s.sample(std::vector<float>{0.1f, 3.0f, -2.0f, 3.0f}).id, 1);
    SamplingParams g;
    g.greedy = true;
    g.temperature = 5;  // ignored
    Sampler s2(g);
    for (int i = 0; i < 50; ++i) EXPECT_EQ(s2.sample(std::vector<float>{1, 2, 1.9f}).id, 1);
}

TEST(Sampler, NonFiniteLogitsNeverWin) {
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    SamplingParams p = plain();
    Sampler s(p);
    for (int i = 0; i < 200; ++i) {
        const int32_t id = s.sample(std::vector<float>{nan, -inf, 0.0f, nan, 0.0f}).id;
        EXPECT_TRUE(id == 2 || id == 4) << id;
    }
    EXPECT_THROW(s.sample(std::vector<float>{nan, -inf}), Error);
    EXPECT_THROW(s.sample(std::vector<float>{}), Error);
}

TEST(Sampler, SameSeedSameDrawsOtherSeedOtherDraws) {
    std::mt19937 gen(1);
    std::normal_distribution<float> nd;
    std::vector<float> logits(1000);
    for (float & x : logits) x = nd(gen);
    auto run = [&](uint64_t seed) {
        Sampler s(plain(seed));
        std::vector<int32_t> ids;
        for (int i = 0; i < 64; ++i) ids.push_back(s.sample(logits).id);
        return ids;
    };
    EXPECT_EQ(run(42), run(42));
    EXPECT_NE(run(42), run(43));
    // Unseeded samplers draw from std::random_device: two of them agreeing on 64 draws would be a broken seed.
    SamplingParams unseeded;
    unseeded.min_p = 0;
    Sampler a(unseeded), b(unseeded);
    std::vector<int32_t> da, db;
    for (int i = 0; i < 64; ++i) da.push_back(a.sample(logits).id), db.push_back(b.sample(logits).id);
    EXPECT_NE(da, db);
}

TEST(Sampler, TopK) {
    const std::vector<double> probs = {0.4, 0.3, 0.2, 0.1};
    SamplingParams p = plain();
    p.top_k = 2;
    Sampler s(p);
    const std::vector<double> f = frequencies(s, logits_of(probs), kDraws);
    EXPECT_NEAR(f[0], 0.4 / 0.7, kTol);
    EXPECT_NEAR(f[1], 0.3 / 0.7, kTol);
    EXPECT_EQ(f[2] + f[3], 0.0);

    p.top_k = 1;  // = greedy
    Sampler one(p);
    for (int i = 0; i < 100; ++i) EXPECT_EQ(one.sample(logits_of(probs)).id, 0);
    p.top_k = 100;  // more than the vocabulary: no filter
    Sampler all(p);
    const std::vector<double> g = frequencies(all, logits_of(probs), kDraws);
    for (size_t i = 0; i < probs.size(); ++i) EXPECT_NEAR(g[i], probs[i], kTol);
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
    const std::vector<double> probs = {0.5, 0.3, 0.15, 0.05};
    SamplingParams p = plain();
    p.top_p = 0.79f;  // 0.5 is short of it, 0.5 + 0.3 reaches it: two tokens
    Sampler s(p);
    std::vector<double> f = frequencies(s, logits_of(probs), kDraws);
    EXPECT_NEAR(f[0], 0.5 / 0.8, kTol);
    EXPECT_NEAR(f[1], 0.3 / 0.8, kTol);
    EXPECT_EQ(f[2] + f[3], 0.0);

    p.top_p = 0.81f;  // needs the third
    Sampler s3(p);
    f = frequencies(s3, logits_of(probs), kDraws);
    EXPECT_NEAR(f[2], 0.15 / 0.95, kTol);
    EXPECT_EQ(f[3], 0.0);

    p.top_p = 0.01f;  // below the top token's mass: the top token alone
    Sampler s1(p);
    for (int i = 0; i < 100; ++i) EXPECT_EQ(s1.sample(logits_of(probs)).id, 0);
}

TEST(Sampler, MinPIsRelativeToTheTopToken) {
    const std::vector<double> probs = {0.5, 0.3, 0.15, 0.05};
    SamplingParams p = plain();
    p.min_p = 0.2f;  // keeps p >= 0.1: tokens 0, 1, 2
    Sampler s(p);
    std::vector<double> f = frequencies(s, logits_of(probs), kDraws);
    EXPECT_NEAR(f[2], 0.15 / 0.95, kTol);
    EXPECT_EQ(f[3], 0.0);

    // Just above the threshold (0.5 * 0.5 = 0.25) stays, just below goes.
    SamplingParams q = plain();
    q.min_p = 0.5f;
    Sampler at(q);
    f = frequencies(at, logits_of({0.5, 0.255, 0.245}), kDraws);
    EXPECT_NEAR(f[1], 0.255 / 0.755, kTol);
    EXPECT_EQ(f[2], 0.0);

    // The default 0.05 cuts the long tail of a flat-ish large vocabulary but never the top token.
    std::vector<float> logits(129280, -10.0f);
    logits[5] = 0.0f;
    SamplingParams d;
    d.seed = 3;
    Sampler def(d);
    for (int i = 0; i < 50; ++i) EXPECT_EQ(def.sample(logits).id, 5);
}

TEST(Sampler, FiltersCombine) {
    // min-p drops token 4, top-k keeps 3 of the rest, top-p 0.75 of those keeps 2.
    const std::vector<double> probs = {0.4, 0.3, 0.15, 0.13, 0.02};
    SamplingParams p = plain();
    p.min_p = 0.1f;
    p.top_k = 3;
    p.top_p = 0.75f;
    Sampler s(p);
    std::vector<double> f = frequencies(s, logits_of(probs), kDraws);
    EXPECT_NEAR(f[0], 0.4 / 0.7, kTol);
    EXPECT_NEAR(f[1], 0.3 / 0.7, kTol);
    EXPECT_EQ(f[2] + f[3] + f[4], 0.0);
}

TEST(Sampler, LogprobsAreTheModelsDistribution) {
    const std::vector<double> probs = {0.1, 0.6, 0.2, 0.1};
    SamplingParams p = plain();
    p.temperature = 0.3f;  // does not change the reported log-probabilities
    p.top_k = 1;
    p.n_logprobs = 3;
    Sampler s(p);
    const SampledToken t = s.sample(logits_of(probs));
    EXPECT_EQ(t.id, 1);
    EXPECT_NEAR(t.logprob, std::log(0.6), 1e-5);
    ASSERT_EQ(t.top.size(), 3u);
    EXPECT_EQ(t.top[0].id, 1);
    EXPECT_EQ(t.top[1].id, 2);
    EXPECT_EQ(t.top[2].id, 0);  // ties (0.1, 0.1): the lower id first
    EXPECT_NEAR(t.top[1].logprob, std::log(0.2), 1e-5);
    EXPECT_NEAR(t.top[2].logprob, std::log(0.1), 1e-5);

    p.n_logprobs = 20;  // more than the vocabulary: all of it
    Sampler all(p);
    EXPECT_EQ(all.sample(logits_of(probs)).top.size(), 4u);
}

TEST(Sampler, RejectsParametersOutOfRange) {
    auto bad = [](auto change) {
        SamplingParams p;
        change(p);
        EXPECT_THROW(Sampler{p}, Error);
    };
    bad([](SamplingParams & p) { p.temperature = -0.1f; });
    bad([](SamplingParams & p) { p.temperature = std::numeric_limits<float>::infinity(); });
    bad([](SamplingParams & p) { p.top_p = 0; });
    bad([](SamplingParams & p) { p.top_p = 1.5f; });
    bad([](SamplingParams & p) { p.top_p = std::numeric_limits<float>::quiet_NaN(); });
    bad([](SamplingParams & p) { p.top_k = -1; });
    bad([](SamplingParams & p) { p.min_p = 1; });
    bad([](SamplingParams & p) { p.min_p = -0.5f; });
    bad([](SamplingParams & p) { p.n_logprobs = 21; });
    bad([](SamplingParams & p) { p.n_logprobs = -1; });
}

TEST(Sampler, FullVocabularyTopPStaysCorrect) {
    // The sorting path over a whole 129K vocabulary: every draw must come from the nucleus.
    std::mt19937 gen(5);
    std::normal_distribution<float> nd(0, 3);
    std::vector<float> logits(129280);
    for (float & x : logits) x = nd(gen);
    std::vector<std::pair<float, int32_t>> order;
    double z = 0;
    const float mx = *std::max_element(logits.begin(), logits.end());
    for (size_t i = 0; i < logits.size(); ++i) {
        order.push_back({logits[i], int32_t(i)});
        z += std::exp(double(logits[i] - mx));
    }
    std::sort(order.begin(), order.end(), [](auto a, auto b) { return a.first > b.first; });
    std::map<int32_t, bool> nucleus;
    double acc = 0;
    for (auto [l, id] : order) {
        nucleus[id] = true;
        acc += std::exp(double(l - mx)) / z;
        if (acc >= 0.5) break;
    }
    SamplingParams p = plain();
    p.top_p = 0.5f;
    Sampler s(p);
    for (int i = 0; i < 30; ++i) EXPECT_TRUE(nucleus.count(s.sample(logits).id));
}

// What a device hands over (backend logit_candidates): as many of the top 1/32-nat bins below the maximum as fit
// in k, ascending by id.
LogitCandidates candidates_of(const std::vector<float> & logits, size_t k) {
    auto clean = [](float x) { return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x; };
    LogitCandidates c;
    c.n_vocab = int64_t(logits.size());
    c.max = -std::numeric_limits<float>::infinity();
    for (size_t i = 0; i < logits.size(); ++i)
        if (clean(logits[i]) > c.max) c.max = clean(logits[i]), c.argmax = int32_t(i);
    double sum = 0;
    std::vector<size_t> hist(1024, 0);
    std::vector<int> bin(logits.size(), 1024);
    for (size_t i = 0; i < logits.size(); ++i) {
        if (clean(logits[i]) == -std::numeric_limits<float>::infinity()) continue;
        sum += std::exp(double(clean(logits[i]) - c.max));
        const float d = (c.max - clean(logits[i])) * 32.0f;
        if (d < 1024.0f) ++hist[size_t(bin[i] = int(d))];
    }
    c.log_sum = float(std::log(sum));
    size_t kept = 0, count = 0;
    while (kept < 1024 && count + hist[kept] <= k) count += hist[kept++];
    for (size_t i = 0; i < logits.size(); ++i)
        if (size_t(bin[i]) < kept) {
            c.ids.push_back(int32_t(i));
            c.logits.push_back(clean(logits[i]));
        }
    return c;
}

TEST(Sampler, CandidatesDrawWhatTheWholeRowDraws) {
    // Two samplers with one seed, one given the row and one the candidates (the row only when they cannot decide):
    // the same tokens, the same log-probabilities, for every setting; peaked rows are decided by the candidates.
    std::mt19937 gen(11);
    std::normal_distribution<float> nd(0, 1);
    const size_t V = 5000, k = 64;
    struct Case {
        float temperature, top_p, min_p;
        int32_t top_k, n_logprobs;
        bool greedy;
    };
    const Case cases[] = {{1, 1, 0.05f, 0, 0, false},      {0.6f, 0.9f, 0.05f, 0, 5, false}, {1, 1, 0.05f, 8, 3, false},
                          {1, 1, 0, 0, 0, false},          {0, 1, 0.05f, 0, 20, false},      {1, 1, 0.05f, 0, 2, true},
                          {1.5f, 0.5f, 0.2f, 40, 1, false}};
    for (const Case & cs : cases) {
        SamplingParams p;
        p.temperature = cs.temperature;
        p.top_p = cs.top_p;
        p.min_p = cs.min_p;
        p.top_k = cs.top_k;
        p.n_logprobs = cs.n_logprobs;
        p.greedy = cs.greedy;
        p.seed = 99;
        Sampler full(p), cand(p);
        int decided = 0;
        for (int step = 0; step < 200; ++step) {
            // Peaked rows (a few tokens far above the rest), flat ones, and ties with NaN and -inf around.
            std::vector<float> logits(V);
            const float spread = step % 3 == 0 ? 0.2f : 1.0f;
            for (float & x : logits) x = spread * nd(gen);
            if (step % 3 != 0)
                for (int j = 0; j < 6; ++j) logits[size_t(gen() % V)] = 8.0f + float(j % 3);
            if (step % 5 == 0) logits[size_t(gen() % V)] = std::numeric_limits<float>::quiet_NaN();
            if (step % 7 == 0) logits[size_t(gen() % V)] = -std::numeric_limits<float>::infinity();
            const SampledToken a = full.sample(logits);
            std::optional<SampledToken> b = cand.sample(candidates_of(logits, k));
            decided += b.has_value();
            if (!b) b = cand.sample(logits);
            ASSERT_EQ(a.id, b->id) << "step " << step << " T " << cs.temperature;
            EXPECT_NEAR(a.logprob, b->logprob, 1e-5);
            ASSERT_EQ(a.top.size(), b->top.size());
            for (size_t i = 0; i < a.top.size(); ++i) {
                EXPECT_EQ(a.top[i].id, b->top[i].id);
                EXPECT_NEAR(a.top[i].logprob, b->top[i].logprob, 1e-5);
            }
        }
        if (cs.greedy || cs.temperature == 0)
            EXPECT_GE(decided, 100);  // flat rows with 20 logprobs may need it
        else if (cs.min_p > 0)
            EXPECT_GE(decided, 100);  // the peaked two thirds at least
        else
            EXPECT_EQ(decided, 0);  // min_p 0: any token could be drawn, so the row is always needed
    }
}

TEST(Sampler, CandidatesCoveringTheVocabularyAlwaysDecide) {
    const std::vector<float> logits = {0.5f, 0.5f, -1, 2, 1};  // all finite: every one is a candidate
    SamplingParams p = plain(3);
    Sampler full(p), cand(p);
    for (int i = 0; i < 50; ++i) {
        const std::optional<SampledToken> b = cand.sample(candidates_of(logits, logits.size()));
        ASSERT_TRUE(b.has_value());
        EXPECT_EQ(full.sample(logits).id, b->id);
    }
    LogitCandidates bad = candidates_of(logits, 2);
    bad.logits.push_back(1.0f);
    EXPECT_THROW(cand.sample(bad), Error);
    // No candidates (more logits than fit share the top bin): greedy still decides, by the row's argmax.
    SamplingParams g = plain(3);
    g.greedy = true;
    Sampler greedy(g);
    const std::vector<float> flat(100, 0.5f);
    const std::optional<SampledToken> t = greedy.sample(candidates_of(flat, 10));
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->id, 0);
    EXPECT_NEAR(t->logprob, -std::log(100.0), 1e-6);
    EXPECT_FALSE(cand.sample(candidates_of(flat, 10)).has_value());
}

}  // namespace
}  // namespace dsv4
