// The DeepSeek V4 forward pass, written once against the backend op set (backend/backend.h).
//
// Model::eval() runs a batch of tokens at the state's next positions through every layer, chunk by chunk
// (prefill), or one token (decode): the math is causal and streaming, so any chunking gives the same logits.
// ../shared/docs/model-spec.md has the official semantics, hf-reference.md what the HF oracle computes.
#pragma once

#include "backend/backend.h"
#include "format/gguf.h"
#include "model/config.h"
#include "model/kv_state.h"
#include "model/weights.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace dsv4 {

enum class Numerics {
    reference,  // exactly what transformers 5.17 computes: no quantization simulation
    official,   // plus DeepSeek's inference numerics: FP8 round trip of KV rows, Hadamard + FP4 in the indexer
};

const char * numerics_name(Numerics n);
bool parse_numerics(std::string_view name, Numerics * out);
// The type a state keeps the indexer's keys in: BF16 under the official numerics, whose keys leave FP4Sim as an E2M1
// value (one mantissa bit) times a power of two of at least 2^-126, which BF16 holds exactly, subnormals included,
// at half the bytes read by every indexer step; F32 under the reference numerics, whose keys are any f32.
GgmlType indexer_key_type(Numerics n);

enum class LogitsMode { none, last, all };

// Debugging and block-level tests: called with named activations as the forward computes them ("embed",
// "attn_in", "attn_out", "mlp_in", "mlp_out", "out", "compressed_kv", "indexer_kv", "indexer_topk",
// "router_idx", "router_w", "hc_head_out", "final_norm_out"); layer is -1 outside the layers. The tensor is in
// backend memory and valid only during the call.
using TraceFn = std::function<void(std::string_view name, int64_t layer, const Tensor & t)>;

// What a Model of this file keeps in backend memory besides its KV states, from the file's header alone (nothing is
// read or allocated): the memory plan made before loading.
struct ModelFootprint {
    uint64_t weights = 0;    // tensor bytes of the file(s): a device backend copies them, the CPU maps them
    uint64_t workspace = 0;  // activations for chunks of n_ubatch tokens
    bool has_mtp = false;    // the MTP block is loaded (its KV state has a raw ring more)
};
ModelFootprint model_footprint(const GgufFile & file, const ModelConfig & config, int64_t n_ubatch,
                               const GgufFile * mtp_file = nullptr);

class Model {
  public:
    // `n_ubatch`: the largest chunk eval() runs at once (longer inputs are split); scratch is sized for it.
    Model(const GgufFile & file, Backend & backend, int64_t n_ubatch, Numerics numerics,
          const GgufFile * mtp_file = nullptr, const LoadProgressFn & progress = {});
    ~Model();

    const ModelConfig & config() const { return config_; }
    const ModelWeights & weights() const { return weights_; }
    Backend & backend() { return backend_; }
    int64_t n_ubatch() const { return n_ubatch_; }
    Numerics numerics() const { return numerics_; }

    std::unique_ptr<KvState> new_state(int64_t n_ctx) const;
    // Bytes of the activations a Model allocates for chunks of n_ubatch tokens; with_mtp_cat when the MTP head uses
    // llama.cpp's fused projection.
    static uint64_t workspace_bytes(const ModelConfig & config, int64_t n_ubatch, bool with_mtp_cat);
    void set_trace(TraceFn trace) { trace_ = std::move(trace); }
    // Chunks of at least this many tokens also call `progress` between layers (kLayerCheckTokens; tests lower it).
    void set_layer_check_tokens(int64_t n) { layer_check_tokens_ = n; }
    // A whole chunk of 16384 would keep a cancelled request on a GB10 for a projected 15-30 s, a layer of it well
    // under one. A check costs a synchronize (the device idles while the next layer's first ops are issued), which
    // no prefill measured on the H200 shows: chunks of 512, 2048 and 16384 within 0.4 % with and without checks
    // (docs/cuda-journal.md, "Session 28"). A shorter chunk runs whole: under 0.3 s on the H200 for the real model.
    static constexpr int64_t kLayerCheckTokens = 512;
    // A CSA layer's indexer runs as a branch beside the query's product (Backend::begin_branch) once the context
    // bound reaches this many tokens (tests lower it). On the H200 the branch saved 13-31 µs an 8-layer step at
    // bounds of 8K to 32K (contexts from 4097 tokens); at the smallest bound, 4K, it was ahead in one call and behind
    // in another: the indexer's chain is short there and q_b streams slower beside it (docs/cuda-journal.md, "Session
    // 41").
    void set_indexer_branch_context(int64_t n) { indexer_branch_context_ = n; }
    static constexpr int64_t kIndexerBranchContext = 8192;

    // Evaluates `tokens` at positions state.n_past() onward and advances the state. logits (host memory; may be
    // null) gets n_vocab floats (mode last) or tokens.size()·n_vocab (mode all); the last token's row also stays in
    // state.last_logits() in either mode. `progress(done)` is called after each chunk with the number of tokens
    // done, and in chunks of layer_check_tokens or more also after each layer but the last with the tokens done so
    // far in proportion to the layers; when it returns false, eval stops there (the state covers the finished
    // chunks: a chunk stopped between layers is undone) and returns false. After the last chunk it cannot stop.
    // `hidden`, when given, receives the final hyper-connection streams of the same rows as the logits
    // ([rows, hc, D], before the HC head): what the MTP head continues from.
    bool eval(KvState & state, std::span<const int32_t> tokens, LogitsMode mode, float * logits,
              const std::function<bool(int64_t done)> & progress = {}, float * hidden = nullptr);

    // The most sequences decode_batch() runs in one step: one workspace row each, and one row of the head's logits.
    int64_t max_batch() const { return std::min(n_ubatch_, kHeadRows); }
    // One decode step of several sequences at once: tokens[i] at position states[i]->n_past() of states[i], which it
    // advances by one; each state's last_logits() then holds its row. Every per-token op (the projections, the
    // experts, the hyper-connections, the head) runs once over all rows, so the weights are read once for the whole
    // step; each state's own part (its compressors, indexer, raw ring and attention) runs on its rows. The result is
    // what eval() of each token alone gives (bit for bit on the CPU backend, whose per-row arithmetic does not depend
    // on the rows beside it). The states must be distinct, at most max_batch() of them, each with room for a token.
    void decode_batch(std::span<KvState * const> states, std::span<const int32_t> tokens);

    // What a sampler draws from, instead of the row (backend logit_candidates over state.last_logits()): up to
    // kSampleCandidates ids ascending and their logits into ids and values [n_candidates()], and stats [4] = (max,
    // log Σ exp(l − max), number of candidates, lowest id holding the max). A few kilobytes cross to the host; an
    // evaluation that ended with one row of logits and a batched step have computed them already (inside the
    // step's graph), and a batch's rows cross in one read.
    static constexpr int64_t kSampleCandidates = 1024;
    // Rows of logits the workspace holds: a chunk whose every row's logits are wanted (dump-logits, prompt logprobs)
    // runs the head in pieces of this many rows, each read out before the next. Sized for the chunk, the buffer
    // would be most of the workspace (n_ubatch × vocabulary floats: 4.2 GB for chunks of 8192).
    static constexpr int64_t kHeadRows = 256;
    int64_t n_candidates() const { return std::min(kSampleCandidates, config_.n_vocab); }
    void logit_candidates(const KvState & state, int32_t * ids, float * values, float * stats);
    // The whole row of state.last_logits() [n_vocab].
    void read_last_logits(const KvState & state, float * logits);

    // The MTP draft head (model-spec.md §8, vLLM's pairing): row i combines the final streams of position
    // pos0 + i (hidden, host F32 [n, hc, D]) with the embedding of the token that follows that position
    // (next_tokens[i]), runs the MTP block at position pos0 + i over its own sliding window (state.mtp(): rows of
    // earlier positions must have been written by earlier calls), and writes the draft logits [n, V] (a guess for
    // the token after next) and the block's output streams [n, hc, D] (the next draft step's hidden; may be null).
    void mtp_eval(KvState & state, int64_t pos0, std::span<const int32_t> next_tokens, const float * hidden,
                  float * logits, float * hidden_out);

  private:
    struct Workspace;
    // Consecutive workspace rows [row0, row0 + n) that are one sequence's positions [pos0, pos0 + n): a chunk of one
    // sequence is one run; a batched decode step is one run of one row per sequence. The ops of a state's own part
    // (compressors, indexer, raw ring, attention) run once per run; every other op once over all rows.
    struct SeqRun {
        KvState * state = nullptr;
        int64_t row0 = 0, pos0 = 0, n = 0;
    };
    // False when between_layers (given: called with the layers done) stopped the chunk; the state is then as before.
    bool eval_chunk(KvState & state, const int32_t * tokens, int64_t n, LogitsMode mode, float * logits, float * hidden,
                    const std::function<bool(int64_t layers)> & between_layers);
    // The embedding and every layer of the n rows whose tokens and positions are in the workspace, into the final
    // streams (w.streams). after_layer (may be empty) is called with the layers done after each layer but the last;
    // returning false stops there, and trunk returns false.
    bool trunk(std::span<const SeqRun> runs, int64_t n, const std::function<bool(int64_t layers)> & after_layer);
    // One transformer block on `streams` (its output lands in `streams`; `streams2` is scratch) for the n rows of
    // `runs`; il names the layer (c.n_layer: the MTP block, whose state is KvState::mtp()). The main layers and the
    // MTP block both run through here. The block's attention input (xn, post, comb) is already there: attn_pre made
    // it, or the block before, whose `next` this block was: then the last HCPost and the next block's HCPre run as
    // one op (Backend::hc_post_pre).
    void attn_pre(const LayerWeights & L, const Tensor & streams, int64_t n);
    void block(const LayerWeights & L, const LayerConfig & lc, std::span<const SeqRun> runs, int64_t il, int64_t n,
               Tensor & streams, Tensor & streams2, const LayerWeights * next);
    void attention(const LayerWeights & L, const LayerConfig & lc, std::span<const SeqRun> runs, int64_t il, int64_t n);
    void ffn(const LayerWeights & L, const LayerConfig & lc, int64_t il, int64_t n);
    void write_positions(std::span<const SeqRun> runs, int64_t n);
    // A sublayer's HCPre: its mixing weights and input norm with the model's Sinkhorn settings.
    HcPre hc_pre_of(const Tensor & fn, const Tensor & scale, const Tensor & base, const Tensor & norm) const;
    // HC head, final norm and LM head of `rows` rows of streams into logits F32 [rows, V].
    void head(const Tensor & streams, const Tensor & hc_fn, const Tensor & hc_scale, const Tensor & hc_base,
              const Tensor & norm, int64_t rows, const Tensor & logits);
    void trace(std::string_view name, int64_t layer, const Tensor & t) const {
        if (trace_) trace_(name, layer, t);
    }

    ModelConfig config_;
    Backend & backend_;
    int64_t n_ubatch_;
    Numerics numerics_;
    ModelWeights weights_;
    RopeSpec rope_[3];  // by LayerKind
    std::unique_ptr<Workspace> ws_;
    // The states whose last rows the workspace's candidates belong to, in row order: an evaluation that ends with
    // one row of logits (every decode step) and a batched step compute them in the same launch sequence, before the
    // sampler asks. candidates_host_: all of them once read (empty until the first state asks).
    std::vector<const KvState *> candidates_of_;
    std::vector<float> candidates_host_;
    void forget_candidates();
    TraceFn trace_;
    int64_t layer_check_tokens_ = kLayerCheckTokens;
    int64_t indexer_branch_context_ = kIndexerBranchContext;
};

}  // namespace dsv4
