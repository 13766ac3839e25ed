// Token sampling from a row of logits: temperature, top-k, top-p (nucleus), min-p, a seed, greedy decoding, and the
// top-N log-probabilities of each step.
//
// The defaults are DeepSeek's API defaults: temperature 1, top_p 1, plus min_p 0.05 (ds4's default, which cuts the long
// tail of a 129K vocabulary); top_k off. Order: logits / temperature, then min-p
// (relative to the most likely token, so it commutes with top-k), then top-k, then top-p over the renormalised
// survivors; one of what is left is drawn in proportion to its probability. Temperature 0 (or greedy) takes the argmax;
// ties go to the lowest id. Log-probabilities are always those of the model's own distribution (log-softmax of the raw
// logits), whatever the sampling settings, as OpenAI's `logprobs` reports them.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <vector>

namespace dsv4 {

struct SamplingParams {
    float temperature = 1.0f;      // 0: greedy
    float top_p = 1.0f;            // (0, 1]: keep the smallest set of tokens whose probability reaches top_p
    int32_t top_k = 0;             // 0: off
    float min_p = 0.05f;           // [0, 1): drop tokens less likely than min_p times the most likely one
    std::optional<uint64_t> seed;  // none: seeded from std::random_device
    bool greedy = false;           // argmax regardless of the other settings
    int32_t n_logprobs = 0;        // top-N alternatives reported per step (0..kMaxLogprobs)

    static constexpr int32_t kMaxLogprobs = 20;
    bool is_greedy() const { return greedy || temperature <= 0.0f; }
};

struct TokenLogprob {
    int32_t id = -1;
    float logprob = 0;  // natural log, model distribution
};

struct SampledToken {
    int32_t id = -1;
    float logprob = 0;              // of the chosen token
    std::vector<TokenLogprob> top;  // the n_logprobs most likely tokens, most likely first
};

// The largest logits of a row and what the rest contributes, as a GPU hands them over instead of the whole row
// (Session::sample, backend logit_candidates): every logit left out is below every candidate (so equal logits are
// both in or both out); there may be none. max, log_sum and argmax describe the whole row (log-sum-exp = max +
// log_sum), NaN counting as -inf.
struct LogitCandidates {
    std::vector<int32_t> ids;   // ascending
    std::vector<float> logits;  // logits[i] of token ids[i]
    float max = 0;              // largest logit of the row
    float log_sum = 0;          // log Σ exp(l − max) over the row
    int32_t argmax = 0;         // lowest id holding max
    int64_t n_vocab = 0;
};

class Sampler {
  public:
    // Throws dsv4::Error naming the field when a parameter is out of range (temperature < 0 or not finite, top_p
    // outside (0, 1], top_k < 0, min_p outside [0, 1), n_logprobs outside [0, kMaxLogprobs]).
    explicit Sampler(const SamplingParams & params);

    // Draws one token from logits [n_vocab] (f32). Non-finite logits never win: -inf and NaN count as impossible.
    SampledToken sample(std::span<const float> logits);
    // The same draw from candidates, when they decide it: every token the settings could draw or report is among
    // them (greedy decoding with at most as many log-probabilities as candidates; otherwise when the smallest
    // candidate is below the min-p cut). Returns nothing otherwise, having drawn no random number: the caller then
    // passes the whole row. Same seed, same token either way.
    std::optional<SampledToken> sample(const LogitCandidates & candidates);

    const SamplingParams & params() const { return params_; }

  private:
    template <class Row>
    SampledToken draw(const Row & row, float max, int32_t argmax, double lse);
    double uniform();  // [0, 1), 53 random bits: the same draws on every platform for a given seed

    SamplingParams params_;
    std::mt19937_64 rng_;
    std::vector<int32_t> ids_;  // scratch [n_vocab]: positions in the row of the tokens left to draw from
    std::vector<float> probs_;  // scratch [n_vocab]
};

}  // namespace dsv4
