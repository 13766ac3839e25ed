// The sampler (include/dsv4/sampler.h). One pass finds the maximum and the log-sum-exp; min-p then prunes in the
// same pass, so the common case (min_p 0.05, no top-k/top-p) never sorts the vocabulary. From a device's
// candidates the same draw runs over a few hundred logits instead of the vocabulary.
#include "dsv4/sampler.h"

#include "util/error.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace dsv4 {

namespace {

// NaN counts as -inf: a broken logit must never be chosen.
inline float clean(float x) { return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x; }

// A row of logits as the draw sees it: entries in ascending id order, NaN already -inf. Either the whole
// vocabulary or the candidates a device selected; the draw is the same code over both, so one seed gives one token.
struct FullRow {
    std::span<const float> logits;
    size_t size() const { return logits.size(); }
    int32_t id(size_t i) const { return int32_t(i); }
    float logit(size_t i) const { return clean(logits[i]); }
};
struct CandidateRow {
    const LogitCandidates & c;
    size_t size() const { return c.ids.size(); }
    int32_t id(size_t i) const { return c.ids[i]; }
    float logit(size_t i) const { return clean(c.logits[i]); }
};

}  // namespace

Sampler::Sampler(const SamplingParams & p) : params_(p) {
    DSV4_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "temperature: {} is not a number >= 0",
               p.temperature);
    DSV4_CHECK(std::isfinite(p.top_p) && p.top_p > 0 && p.top_p <= 1, "top_p: {} is not in (0, 1]", p.top_p);
    DSV4_CHECK(p.top_k >= 0, "top_k: {} is negative", p.top_k);
    DSV4_CHECK(std::isfinite(p.min_p) && p.min_p >= 0 && p.min_p < 1, "min_p: {} is not in [0, 1)", p.min_p);
    DSV4_CHECK(p.n_logprobs >= 0 && p.n_logprobs <= SamplingParams::kMaxLogprobs, "top_logprobs: {} is not in [0, {}]",
               p.n_logprobs, SamplingParams::kMaxLogprobs);
    if (p.seed) {
        rng_.seed(*p.seed);
    } else {
        std::random_device rd;
        rng_.seed((uint64_t(rd()) << 32) ^ rd());
    }
}

double Sampler::uniform() { return double(rng_() >> 11) * 0x1.0p-53; }

SampledToken Sampler::sample(std::span<const float> logits) {
    const size_t n = logits.size();
    DSV4_CHECK(n > 0, "sampler: empty logits");
    float max = -std::numeric_limits<float>::infinity();
    int32_t argmax = -1;
    for (size_t i = 0; i < n; ++i) {
        const float x = clean(logits[i]);
        if (x > max) max = x, argmax = int32_t(i);
    }
    DSV4_CHECK(argmax >= 0 && std::isfinite(max), "sampler: no finite logit among {}", n);
    double sum = 0;
    for (size_t i = 0; i < n; ++i) sum += std::exp(double(clean(logits[i]) - max));
    return draw(FullRow{logits}, max, argmax, double(max) + std::log(sum));
}

std::optional<SampledToken> Sampler::sample(const LogitCandidates & c) {
    DSV4_CHECK(
        c.ids.size() == c.logits.size() && int64_t(c.ids.size()) <= c.n_vocab && c.argmax >= 0 && c.argmax < c.n_vocab,
        "sampler: {} candidate ids, {} logits, argmax {}, vocabulary {}", c.ids.size(), c.logits.size(), c.argmax,
        c.n_vocab);
    DSV4_CHECK(std::isfinite(c.max), "sampler: no finite logit among {}", c.n_vocab);
    const CandidateRow row{c};
    if (int64_t(row.size()) < c.n_vocab) {
        // The top log-probabilities must all be candidates.
        if (size_t(params_.n_logprobs) > row.size()) return std::nullopt;
        if (!params_.is_greedy()) {
            // Tokens left out have logits below the lowest candidate's: if min-p cuts that one (or its
            // probability underflows to 0), it cuts them all.
            if (row.size() == 0) return std::nullopt;
            float lowest = std::numeric_limits<float>::infinity();
            for (size_t i = 0; i < row.size(); ++i) lowest = std::min(lowest, row.logit(i));
            const double q = std::exp(double(lowest - c.max) / double(params_.temperature));
            if (q > 0 && q >= double(params_.min_p)) return std::nullopt;
        }
    }
    return draw(row, c.max, c.argmax, double(c.max) + double(c.log_sum));
}

template <class Row>
SampledToken Sampler::draw(const Row & row, float max, int32_t argmax, double lse) {
    const size_t n = row.size();
    SampledToken out;
    if (params_.n_logprobs > 0) {
        // The N largest logits, by a bounded min-heap (N <= 20): O(n log N). Entries are row positions.
        const size_t k = std::min<size_t>(size_t(params_.n_logprobs), n);
        auto worse = [&](size_t a, size_t b) {  // heap order: the weakest candidate on top
            const float la = row.logit(a), lb = row.logit(b);
            return la > lb || (la == lb && row.id(a) < row.id(b));
        };
        std::vector<size_t> heap;
        heap.reserve(k + 1);
        for (size_t i = 0; i < n; ++i) {
            if (heap.size() == k && !worse(i, heap.front())) continue;
            heap.push_back(i);
            std::push_heap(heap.begin(), heap.end(), worse);
            if (heap.size() > k) {
                std::pop_heap(heap.begin(), heap.end(), worse);
                heap.pop_back();
            }
        }
        std::sort_heap(heap.begin(), heap.end(), worse);
        for (size_t i : heap) out.top.push_back({row.id(i), float(double(row.logit(i)) - lse)});
    }

    out.id = argmax;
    out.logprob = float(double(max) - lse);
    if (!params_.is_greedy()) {
        // Probabilities relative to the most likely token: q_i = exp((l_i - max) / T), so q_max = 1 and min-p keeps
        // q_i >= min_p. ids_ holds row positions, which ascend with the token ids.
        const double inv_t = 1.0 / double(params_.temperature);
        ids_.clear();
        probs_.clear();
        for (size_t i = 0; i < n; ++i) {
            const double q = std::exp(double(row.logit(i) - max) * inv_t);
            if (q > 0 && q >= double(params_.min_p)) {
                ids_.push_back(int32_t(i));
                probs_.push_back(float(q));
            }
        }
        size_t m = ids_.size();
        const bool top_k = params_.top_k > 0 && size_t(params_.top_k) < m;
        const bool top_p = params_.top_p < 1.0f;
        if (top_k || top_p) {
            // Sort the survivors (by probability, then id, so the result does not depend on the sort) and cut.
            std::vector<int32_t> order(m);
            std::iota(order.begin(), order.end(), 0);
            auto better = [&](int32_t a, int32_t b) {
                return probs_[size_t(a)] > probs_[size_t(b)] ||
                       (probs_[size_t(a)] == probs_[size_t(b)] && ids_[size_t(a)] < ids_[size_t(b)]);
            };
            if (top_k) {
                std::nth_element(order.begin(), order.begin() + params_.top_k, order.end(), better);
                order.resize(size_t(params_.top_k));
            }
            std::sort(order.begin(), order.end(), better);
            if (top_p) {
                double total = 0;
                for (int32_t o : order) total += probs_[size_t(o)];
                double acc = 0;
                size_t keep = 0;
                while (keep < order.size()) {
                    acc += probs_[size_t(order[keep++])];
                    if (acc >= double(params_.top_p) * total) break;
                }
                order.resize(keep);
            }
            std::vector<int32_t> ids;
            std::vector<float> probs;
            for (int32_t o : order) {
                ids.push_back(ids_[size_t(o)]);
                probs.push_back(probs_[size_t(o)]);
            }
            ids_.swap(ids);
            probs_.swap(probs);
            m = ids_.size();
        }
        double total = 0;
        for (size_t i = 0; i < m; ++i) total += probs_[i];
        const double target = uniform() * total;
        double acc = 0;
        size_t chosen = size_t(ids_[m - 1]);  // rounding: a draw past the last cumulative sum takes the last survivor
        for (size_t i = 0; i < m; ++i) {
            acc += probs_[i];
            if (target < acc) {
                chosen = size_t(ids_[i]);
                break;
            }
        }
        out.id = row.id(chosen);
        out.logprob = float(double(row.logit(chosen)) - lse);
    }
    return out;
}

}  // namespace dsv4
