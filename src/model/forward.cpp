#include "model/forward.h"

#include "model/layout.h"
#include "util/error.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

namespace dsv4 {

const char * numerics_name(Numerics n) { return n == Numerics::reference ? "reference" : "official"; }

GgmlType indexer_key_type(Numerics n) { return n == Numerics::official ? GgmlType::BF16 : GgmlType::F32; }

bool parse_numerics(std::string_view name, Numerics * out) {
    if (name == "reference") *out = Numerics::reference;
    else if (name == "official") *out = Numerics::official;
    else return false;
    return true;
}

// Scratch activations for one chunk of up to n_ubatch tokens (n below). Every op writes a full tensor, so
// nothing here needs clearing between chunks.
struct Model::Workspace {
    std::vector<std::unique_ptr<BackendBuffer>> buffers;

    Tensor tokens;     // I32 [n]
    Tensor positions;  // I32 [n]: absolute position of each token of the chunk
    Tensor streams;    // F32 [n, hc, D]: the hyper-connection state
    Tensor streams2;   // F32 [n, hc, D]: HCPost output, swapped with streams
    Tensor x;          // F32 [n, D]: embeddings; the head's collapsed streams
    Tensor xn;         // F32 [n, D]: normed sublayer input (HCPre output)
    Tensor out;        // F32 [n, D]: sublayer output
    Tensor post;       // F32 [n, hc]
    Tensor comb;       // F32 [n, hc, hc]
    Tensor cq;         // F32 [n, q_lora]: normed low-rank query (the indexer reuses it)
    Tensor q;          // F32 [n, H, d]
    Tensor kv;         // F32 [n, d]
    Tensor attn;       // F32 [n, H, d]: attention output
    Tensor o_low;      // F32 [n, G·o_lora]
    Tensor comp_kv;    // F32 [n, 2d]: compressor projections
    Tensor comp_score; // F32 [n, 2d]
    Tensor idx_q;      // F32 [n, H_I, d_I]
    Tensor idx_w;      // F32 [n, H_I]
    Tensor idx_kv;     // F32 [n, 2·d_I]
    Tensor idx_score;  // F32 [n, 2·d_I]
    Tensor selected;   // I32 [n, top_k]
    Tensor router;     // F32 [n, E]: router logits
    Tensor experts;    // I32 [n, k]
    Tensor weights;    // F32 [n, k]
    Tensor sh_gate;    // F32 [n, I]
    Tensor sh_up;      // F32 [n, I]
    Tensor logits;     // F32 [min(n, kHeadRows), V]
    Tensor candidates; // 32-bit words [min(n, kHeadRows), 2k + 4]: candidate_rows' views, k = n_candidates
    Tensor mtp_cat;    // F32 [n, hc, 2D]: [enorm(E[x]); hnorm(H_h)] for llama.cpp's fused MTP projection
    Tensor frontier_backup;  // F32 [frontier_bytes / 4]: a state's frontiers before a chunk that may stop

    Tensor inv_freq[3];  // F32 [n_rot / 2]: the RoPE frequencies of each LayerKind

    // Lays out every tensor for chunks of n tokens. With no backend nothing is allocated and only `bytes` counts:
    // the memory plan (Model::workspace_bytes) and the allocation are this one function.
    Workspace(const ModelConfig & c, int64_t n, bool with_mtp_cat, Backend * backend) : backend_(backend) {
        const int64_t D = c.n_embd, d = c.head_dim;
        for (Tensor & t : inv_freq) t = make(GgmlType::F32, 1, c.n_rot / 2);
        tokens = make(GgmlType::I32, n, 1);
        positions = make(GgmlType::I32, n, 1);
        streams = make(GgmlType::F32, n, D, c.hc);
        streams2 = make(GgmlType::F32, n, D, c.hc);
        x = make(GgmlType::F32, n, D);
        xn = make(GgmlType::F32, n, D);
        out = make(GgmlType::F32, n, D);
        post = make(GgmlType::F32, n, c.hc);
        comb = make(GgmlType::F32, n, c.hc, c.hc);
        cq = make(GgmlType::F32, n, c.q_lora_rank);
        q = make(GgmlType::F32, n, d, c.n_head);
        kv = make(GgmlType::F32, n, d);
        attn = make(GgmlType::F32, n, d, c.n_head);
        o_low = make(GgmlType::F32, n, c.o_groups * c.o_lora_rank);
        comp_kv = make(GgmlType::F32, n, 2 * d);
        comp_score = make(GgmlType::F32, n, 2 * d);
        if (c.indexer_dim > 0) {
            idx_q = make(GgmlType::F32, n, c.indexer_dim, c.indexer_heads);
            idx_w = make(GgmlType::F32, n, c.indexer_heads);
            idx_kv = make(GgmlType::F32, n, 2 * c.indexer_dim);
            idx_score = make(GgmlType::F32, n, 2 * c.indexer_dim);
            selected = make(GgmlType::I32, n, std::max<int64_t>(c.indexer_top_k, 1));
        }
        router = make(GgmlType::F32, n, c.n_expert);
        experts = make(GgmlType::I32, n, c.n_expert_used);
        weights = make(GgmlType::F32, n, c.n_expert_used);
        sh_gate = make(GgmlType::F32, n, c.expert_ff);
        sh_up = make(GgmlType::F32, n, c.expert_ff);
        logits = make(GgmlType::F32, std::min(n, kHeadRows), c.n_vocab);
        n_cand = std::min(kSampleCandidates, c.n_vocab);
        candidates = make(GgmlType::F32, std::min(n, kHeadRows), 2 * n_cand + 4);
        if (with_mtp_cat) mtp_cat = make(GgmlType::F32, n, 2 * D, c.hc);
        frontier_backup = make(GgmlType::F32, 1, std::max<int64_t>(int64_t(plan_kv(c, 1, 1).frontier_bytes / 4), 1));
    }

    uint64_t bytes = 0;
    int64_t n_cand = 0;  // candidates a row: min(kSampleCandidates, V)

    // The sampling candidates of `rows` rows (logit_candidates), packed at the start of one buffer so that one read
    // brings them all to the host: ids I32 [rows, k], then values F32 [rows, k], then stats F32 [rows, 4] (max,
    // log-sum, count, argmax).
    struct CandidateRows {
        Tensor ids, values, stats;
    };
    CandidateRows candidate_rows(int64_t rows) const {
        float * base = candidates.f32();
        return {make_tensor(GgmlType::I32, base, n_cand, rows),
                make_tensor(GgmlType::F32, base + rows * n_cand, n_cand, rows),
                make_tensor(GgmlType::F32, base + 2 * rows * n_cand, 4, rows)};
    }

  private:
    // A tensor [ne0, ne1, ne2, n_rows]; the token axis is always the outermost (ne[3]).
    Tensor make(GgmlType type, int64_t n_rows, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1) {
        const size_t n_bytes = std::max<size_t>(row_bytes(type, ne0) * size_t(ne1 * ne2 * n_rows), 4);
        bytes += n_bytes;
        if (!backend_) return make_tensor(type, nullptr, ne0, ne1, ne2, n_rows);
        buffers.push_back(backend_->alloc(n_bytes));
        return make_tensor(type, buffers.back()->data(), ne0, ne1, ne2, n_rows);
    }

    Backend * backend_;
};

namespace {

// Tokens [t0, t0 + n) of a workspace tensor, whose token axis is the outermost (ne[3]).
Tensor token_rows(const Tensor & t, int64_t t0, int64_t n) {
    Tensor v = t;
    v.data = static_cast<char *>(t.data) + size_t(t0) * (t.n_bytes() / size_t(t.ne[3]));
    v.ne[3] = n;
    return v;
}

// The first n tokens of a scratch tensor sized for n_ubatch tokens.
Tensor first(const Tensor & t, int64_t n) { return token_rows(t, 0, n); }

// The context a chunk that ends before token `end` attends over, rounded up to a power of two (at least 4096
// tokens). Attention and the indexer get a state's compressed rows and indexer keys up to this bound, not up to
// its capacity: a GPU's decode grids and kernel choices follow the rows they are given (the indexer's slices and
// split top-k, the HCA attention's tiles), and a state holding 1M tokens decoded ~8 % slower at 2K than one holding
// the depth (docs/cuda-journal.md, "Session 38"). A decode step's graph is captured once per bound.
int64_t context_bound(int64_t end) { return std::max<int64_t>(4096, int64_t(std::bit_ceil(uint64_t(end)))); }

// The first rows of a compressed store that a context of `bound` tokens can see at ratio R.
Tensor visible_rows(const Tensor & store, int64_t bound, int64_t R) {
    return row_view(store, 0, std::min(store.rows(), bound / R));
}

}  // namespace

Model::Model(const GgufFile & file, Backend & backend, int64_t n_ubatch, Numerics numerics, const GgufFile * mtp_file,
             const LoadProgressFn & progress)
    : config_(load_config(file)), backend_(backend), n_ubatch_(n_ubatch), numerics_(numerics) {
    DSV4_CHECK(n_ubatch >= 1, "batch size must be at least 1 (got {})", n_ubatch);
    weights_ = load_weights(file, config_, backend, mtp_file, progress);
    const ModelConfig & c = config_;

    // llama.cpp's MTP layout projects [enorm(E[x]); hnorm(H_h)] with one fused matrix, which needs the concatenation.
    ws_ = std::make_unique<Workspace>(c, n_ubatch, weights_.mtp && weights_.mtp->eh_proj, &backend);
    for (LayerKind kind : {LayerKind::sliding, LayerKind::csa, LayerKind::hca}) {
        const std::vector<float> f = rope_inv_freq(c, kind);
        RopeSpec & r = rope_[int(kind)];
        r.n_rot = int(c.n_rot);
        r.inv_freq = ws_->inv_freq[int(kind)];
        backend.write(r.inv_freq, f.data(), f.size() * sizeof(float));
    }
}

Model::~Model() = default;

ModelFootprint model_footprint(const GgufFile & file, const ModelConfig & c, int64_t n_ubatch,
                               const GgufFile * mtp_file) {
    ModelFootprint f;
    for (const GgufTensorInfo & t : file.tensors()) f.weights += t.n_bytes;
    if (mtp_file)
        for (const GgufTensorInfo & t : mtp_file->tensors()) f.weights += t.n_bytes;
    // As load_weights decides: llama.cpp's extra block (fused e/h projection) or ds4's separate file.
    const bool fused_mtp =
        file.find_tensor("blk." + std::to_string(c.n_layer) + "." + slot_suffix(Slot::mtp_eh_proj)) != nullptr;
    f.has_mtp = fused_mtp || mtp_file;
    f.workspace = Model::workspace_bytes(c, n_ubatch, fused_mtp);
    return f;
}

uint64_t Model::workspace_bytes(const ModelConfig & config, int64_t n_ubatch, bool with_mtp_cat) {
    return Workspace(config, n_ubatch, with_mtp_cat, nullptr).bytes;
}

std::unique_ptr<KvState> Model::new_state(int64_t n_ctx) const {
    return std::make_unique<KvState>(config_, backend_, n_ctx, n_ubatch_, weights_.mtp.has_value(),
                                     indexer_key_type(numerics_));
}

bool Model::eval(KvState & state, std::span<const int32_t> tokens, LogitsMode mode, float * logits,
                 const std::function<bool(int64_t)> & progress, float * hidden) {
    const int64_t n_total = int64_t(tokens.size());
    DSV4_CHECK(state.n_past() + n_total <= state.n_ctx(), "{} tokens after {} exceed the context of {}", n_total,
               state.n_past(), state.n_ctx());
    for (int32_t t : tokens)
        DSV4_CHECK(t >= 0 && t < config_.n_vocab, "token id {} outside the vocabulary [0, {})", t, config_.n_vocab);
    for (int64_t done = 0; done < n_total;) {
        const int64_t n = std::min(n_ubatch_, n_total - done);
        std::function<bool(int64_t)> between_layers;
        if (progress && n >= layer_check_tokens_)
            between_layers = [&](int64_t layers) { return progress(done + n * layers / config_.n_layer); };
        const bool last_chunk = done + n == n_total;
        const LogitsMode chunk_mode = mode == LogitsMode::all ? LogitsMode::all
                                      : last_chunk             ? mode
                                                               : LogitsMode::none;
        float * chunk_logits = mode == LogitsMode::all ? logits + done * config_.n_vocab : logits;
        float * chunk_hidden = hidden && mode == LogitsMode::all ? hidden + done * config_.hc * config_.n_embd : hidden;
        if (!eval_chunk(state, tokens.data() + done, n, chunk_mode, chunk_logits,
                        chunk_mode == LogitsMode::none ? nullptr : chunk_hidden, between_layers))
            return false;
        done += n;
        // Each chunk ends with its work finished (a device backend's ops are asynchronous): a device error surfaces
        // here, inside the evaluation that caused it, and callers may time an eval without a read after it.
        backend_.synchronize();
        if (progress && !progress(done) && !last_chunk) return false;
    }
    return true;
}

bool Model::eval_chunk(KvState & state, const int32_t * tokens, int64_t n, LogitsMode mode, float * logits,
                       float * hidden, const std::function<bool(int64_t layers)> & between_layers) {
    const ModelConfig & c = config_;
    const ModelWeights & W = weights_;
    Workspace & w = *ws_;
    Backend & b = backend_;
    const int64_t pos0 = state.n_past();
    const SeqRun run{&state, 0, pos0, n};

    b.write(first(w.tokens, n), tokens, size_t(n) * sizeof(int32_t));
    write_positions({&run, 1}, n);
    // Only the rows whose logits are wanted go through the head (the LM head is the largest matrix), at most
    // kHeadRows at once (the logits buffer's rows).
    const int64_t first_row = mode == LogitsMode::last ? n - 1 : 0;
    const int64_t rows = mode == LogitsMode::none ? 0 : n - first_row;
    const int64_t head_rows = w.logits.ne[3];
    const size_t row_bytes = size_t(c.n_vocab) * sizeof(float);
    // Each block swaps the two stream buffers twice, so the final streams are always in w.streams.
    auto final_rows = [&](int64_t r0, int64_t m) {
        return make_tensor(GgmlType::F32, w.streams.f32() + (first_row + r0) * c.hc * c.n_embd, c.n_embd, c.hc, 1, m);
    };
    auto run_head = [&](int64_t r0, int64_t m, const Tensor & out) {
        head(final_rows(r0, m), W.output_hc_fn, W.output_hc_scale, W.output_hc_base, W.output_norm, m, out);
    };

    // A chunk that may stop between layers waits for each layer before issuing the next (the caller's answer
    // must come while there is work left to skip); its frontiers are saved first (KvState::save_frontiers).
    const bool checked = between_layers && n > 1;
    if (checked) state.save_frontiers(w.frontier_backup);
    bool stopped = false;
    auto body = [&] {
        std::function<bool(int64_t)> after_layer;
        if (checked)
            after_layer = [&](int64_t layers) {
                b.synchronize();
                return between_layers(layers);
            };
        if (!trunk({&run, 1}, n, after_layer)) {
            stopped = true;
            return;
        }
        if (rows == 1) {
            // One row (a decode step, a prompt's end): straight into the state's copy, and the sampler's candidates
            // from it, inside a decode step's graph rather than launches after it.
            run_head(0, 1, state.last_logits());
            const Workspace::CandidateRows cand = w.candidate_rows(1);
            b.logit_candidates(state.last_logits(), cand.ids, cand.values, cand.stats);
        } else if (rows > 0 && rows <= head_rows) {
            run_head(0, rows, first(w.logits, rows));
            b.copy(state.last_logits(), w.logits, row_bytes, 0, size_t(rows - 1) * row_bytes);
        }
    };
    forget_candidates();
    // A decode step is the same op sequence at every position of a state below one context bound: a device backend
    // replays a capture per state, logits mode and bound.
    if (n == 1 && !trace_)
        b.run_captured((std::hash<const void *>()(&state) * 31 + uint64_t(mode)) * 64 +
                           uint64_t(std::countr_zero(uint64_t(context_bound(pos0 + n)))),
                       body);
    else
        body();
    if (stopped) {
        state.restore_frontiers(w.frontier_backup);
        b.synchronize();
        return false;
    }
    state.set_n_past(pos0 + n);
    if (rows == 1) candidates_of_ = {&state};
    if (rows == 0) return true;
    if (rows <= head_rows) {
        if (logits) b.read(rows == 1 ? state.last_logits() : first(w.logits, rows), logits, size_t(rows) * row_bytes);
    } else {
        int64_t in_buffer = 0;  // rows of logits in the buffer now
        for (int64_t r0 = 0; r0 < rows; r0 += head_rows) {
            in_buffer = std::min(head_rows, rows - r0);
            run_head(r0, in_buffer, first(w.logits, in_buffer));
            if (logits) b.read(first(w.logits, in_buffer), logits + r0 * c.n_vocab, size_t(in_buffer) * row_bytes);
        }
        b.copy(state.last_logits(), w.logits, row_bytes, 0, size_t(in_buffer - 1) * row_bytes);
    }
    if (hidden) {
        const Tensor final_streams = final_rows(0, rows);
        b.read(final_streams, hidden, final_streams.n_bytes());
    }
    return true;
}

bool Model::trunk(std::span<const SeqRun> runs, int64_t n, const std::function<bool(int64_t layers)> & after_layer) {
    const ModelConfig & c = config_;
    const ModelWeights & W = weights_;
    Workspace & w = *ws_;
    Tensor streams = first(w.streams, n), streams2 = first(w.streams2, n);
    Tensor x = first(w.x, n);
    backend_.get_rows(W.token_embd, first(w.tokens, n), x);
    trace("embed", -1, x);
    backend_.hc_expand(x, streams);
    attn_pre(W.layers[0], streams, n);
    for (int64_t il = 0; il < c.n_layer; ++il) {
        block(W.layers[size_t(il)], c.layers[size_t(il)], runs, il, n, streams, streams2,
              il + 1 < c.n_layer ? &W.layers[size_t(il + 1)] : nullptr);
        if (after_layer && il + 1 < c.n_layer && !after_layer(il + 1)) return false;
    }
    return true;
}

void Model::decode_batch(std::span<KvState * const> states, std::span<const int32_t> tokens) {
    const int64_t n = int64_t(states.size());
    DSV4_CHECK(n >= 1 && n <= max_batch(), "a batched step runs 1 to {} sequences (got {})", max_batch(), n);
    DSV4_CHECK(tokens.size() == states.size(), "a batched step got {} tokens for {} sequences", tokens.size(), n);
    std::vector<SeqRun> runs;
    for (int64_t i = 0; i < n; ++i) {
        KvState * s = states[size_t(i)];
        DSV4_CHECK(s->n_past() + 1 <= s->n_ctx(), "1 token after {} exceeds the context of {}", s->n_past(),
                   s->n_ctx());
        DSV4_CHECK(tokens[size_t(i)] >= 0 && tokens[size_t(i)] < config_.n_vocab,
                   "token id {} outside the vocabulary [0, {})", tokens[size_t(i)], config_.n_vocab);
        for (const SeqRun & r : runs) DSV4_CHECK(r.state != s, "a batched step names one sequence twice");
        runs.push_back({s, i, s->n_past(), 1});
    }
    Workspace & w = *ws_;
    Backend & b = backend_;
    b.write(first(w.tokens, n), tokens.data(), size_t(n) * sizeof(int32_t));
    write_positions(runs, n);
    forget_candidates();
    auto body = [&] {
        trunk(runs, n, {});
        Tensor logits = first(w.logits, n);
        head(make_tensor(GgmlType::F32, w.streams.data, config_.n_embd, config_.hc, 1, n), weights_.output_hc_fn,
             weights_.output_hc_scale, weights_.output_hc_base, weights_.output_norm, n, logits);
        const size_t row_bytes = size_t(config_.n_vocab) * sizeof(float);
        for (int64_t i = 0; i < n; ++i)
            b.copy(states[size_t(i)]->last_logits(), logits, row_bytes, 0, size_t(i) * row_bytes);
        // Every row's sampling candidates inside the step, as a single step computes its own: asked for one row at a
        // time afterwards, each was three launches and a read between steps (the batch's GPU then idled ~0.25 ms of
        // a 4-stream step on an H100).
        const Workspace::CandidateRows cand = w.candidate_rows(n);
        b.logit_candidates(logits, cand.ids, cand.values, cand.stats);
    };
    // Like a single decode step, a batch is the same op sequence at every step while its states and their context
    // bounds stay the same (a server's streams decode together for hundreds of steps): a device backend replays a
    // capture per such set. The key's odd seed keeps it apart from single steps' keys.
    if (!trace_) {
        uint64_t key = 0x9e3779b97f4a7c15ull;
        for (const SeqRun & r : runs)
            key = (key ^ (std::hash<const void *>()(r.state) * 64 +
                          uint64_t(std::countr_zero(uint64_t(context_bound(r.pos0 + 1)))))) *
                  0x100000001b3ull;
        b.run_captured(key, body);
    } else {
        body();
    }
    for (KvState * s : states) s->set_n_past(s->n_past() + 1);
    candidates_of_.assign(states.begin(), states.end());
    b.synchronize();
}

void Model::forget_candidates() {
    candidates_of_.clear();
    candidates_host_.clear();
}

void Model::logit_candidates(const KvState & state, int32_t * ids, float * values, float * stats) {
    Workspace & w = *ws_;
    auto it = std::find(candidates_of_.begin(), candidates_of_.end(), &state);
    if (it == candidates_of_.end()) {
        const Workspace::CandidateRows cand = w.candidate_rows(1);
        backend_.logit_candidates(state.last_logits(), cand.ids, cand.values, cand.stats);
        forget_candidates();
        candidates_of_ = {&state};
        it = candidates_of_.begin();
    }
    // The first state asked for brings every row's candidates to the host in one read; the others are then copies.
    // The host copy is laid out as the device buffer, so the views the step wrote locate each row in it.
    const Workspace::CandidateRows cand = w.candidate_rows(int64_t(candidates_of_.size()));
    const size_t row = size_t(it - candidates_of_.begin());
    auto offset = [&](const Tensor & view) {  // bytes from the buffer's start
        return size_t(static_cast<const uint8_t *>(view.data) - static_cast<const uint8_t *>(w.candidates.data));
    };
    if (candidates_host_.empty()) {
        candidates_host_.resize((offset(cand.stats) + cand.stats.n_bytes()) / sizeof(float));
        backend_.read(w.candidates, candidates_host_.data(), candidates_host_.size() * sizeof(float));
    }
    auto copy_row = [&](const Tensor & view, void * out) {
        const uint8_t * host = reinterpret_cast<const uint8_t *>(candidates_host_.data());
        std::memcpy(out, host + offset(view) + row * view.row_bytes(), view.row_bytes());
    };
    copy_row(cand.ids, ids);
    copy_row(cand.values, values);
    copy_row(cand.stats, stats);
}

void Model::read_last_logits(const KvState & state, float * logits) {
    backend_.read(state.last_logits(), logits, state.last_logits().n_bytes());
}

void Model::write_positions(std::span<const SeqRun> runs, int64_t n) {
    std::vector<int32_t> pos(static_cast<size_t>(n));
    for (const SeqRun & r : runs)
        for (int64_t t = 0; t < r.n; ++t) pos[size_t(r.row0 + t)] = int32_t(r.pos0 + t);
    backend_.write(first(ws_->positions, n), pos.data(), pos.size() * sizeof(int32_t));
}

void Model::head(const Tensor & streams, const Tensor & hc_fn, const Tensor & hc_scale, const Tensor & hc_base,
                 const Tensor & norm, int64_t rows, const Tensor & logits) {
    const ModelConfig & c = config_;
    Backend & b = backend_;
    Tensor z = first(ws_->x, rows);
    b.hc_head(streams, hc_fn, hc_scale, hc_base, c.hc_eps, c.norm_eps, z);
    trace("hc_head_out", -1, z);
    b.rms_norm(z, norm, z, c.norm_eps);
    trace("final_norm_out", -1, z);
    b.matmul(weights_.output, z, logits);
}

void Model::mtp_eval(KvState & state, int64_t pos0, std::span<const int32_t> next_tokens, const float * hidden,
                     float * logits, float * hidden_out) {
    DSV4_CHECK(weights_.mtp && state.has_mtp(), "the model has no MTP block");
    const int64_t n = int64_t(next_tokens.size());
    const int64_t most = std::min(n_ubatch_, kHeadRows);
    DSV4_CHECK(n >= 1 && n <= most, "MTP evaluates 1 to {} rows at once (got {})", most, n);
    DSV4_CHECK(pos0 >= 0 && pos0 + n <= state.n_ctx(), "MTP positions [{}, {}) outside the context of {}", pos0,
               pos0 + n, state.n_ctx());
    for (int32_t t : next_tokens)
        DSV4_CHECK(t >= 0 && t < config_.n_vocab, "token id {} outside the vocabulary [0, {})", t, config_.n_vocab);
    const ModelConfig & c = config_;
    const MtpWeights & M = *weights_.mtp;
    Workspace & w = *ws_;
    Backend & b = backend_;
    const int64_t D = c.n_embd;

    const SeqRun run{&state, 0, pos0, n};
    Tensor tok = first(w.tokens, n);
    b.write(tok, next_tokens.data(), size_t(n) * sizeof(int32_t));
    write_positions({&run, 1}, n);
    Tensor e = first(w.x, n), en = first(w.xn, n);
    b.get_rows(weights_.token_embd, tok, e);
    b.rms_norm(e, M.enorm, en, c.norm_eps);
    Tensor streams = first(w.streams, n), streams2 = first(w.streams2, n);
    b.write(streams, hidden, streams.n_bytes());
    Tensor hn = reshape(streams2, D, c.hc * n);
    b.rms_norm(reshape(streams, D, c.hc * n), M.hnorm, hn, c.norm_eps);
    // X0_h = e_proj·enorm(E[x]) + h_proj·hnorm(H_h) for each stream h.
    if (M.eh_proj) {
        // llama.cpp fuses the two projections: eh_proj · [enorm(E[x]); hnorm(H_h)].
        Tensor cat = first(w.mtp_cat, n);
        for (int64_t t = 0; t < n; ++t)
            for (int64_t h = 0; h < c.hc; ++h) {
                const size_t row = size_t(t * c.hc + h) * 2 * size_t(D) * sizeof(float);
                b.copy(cat, en, size_t(D) * sizeof(float), row, size_t(t * D) * sizeof(float));
                b.copy(cat, hn, size_t(D) * sizeof(float), row + size_t(D) * sizeof(float),
                       size_t((t * c.hc + h) * D) * sizeof(float));
            }
        b.matmul(M.eh_proj, cat, reshape(streams, D, c.hc * n));
    } else {
        Tensor ep = first(w.out, n);
        b.matmul(M.e_proj, en, ep);
        b.matmul(M.h_proj, hn, reshape(streams, D, c.hc * n));
        b.hc_expand(ep, streams2);
        b.add(streams, streams2, streams);
    }
    attn_pre(M.block, streams, n);
    block(M.block, M.config, {&run, 1}, c.n_layer, n, streams, streams2, nullptr);
    if (hidden_out) b.read(streams, hidden_out, streams.n_bytes());
    head(streams, M.hc_head_fn, M.hc_head_scale, M.hc_head_base, M.norm, n, first(w.logits, n));
    b.read(first(w.logits, n), logits, size_t(n * c.n_vocab) * sizeof(float));
}

HcPre Model::hc_pre_of(const Tensor & fn, const Tensor & scale, const Tensor & base, const Tensor & norm) const {
    return {fn, scale, base, norm, int(config_.hc_iters), config_.hc_eps, config_.norm_eps};
}

void Model::attn_pre(const LayerWeights & L, const Tensor & streams, int64_t n) {
    Workspace & w = *ws_;
    backend_.hc_pre(streams, hc_pre_of(L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base, L.attn_norm), first(w.xn, n),
                    first(w.post, n), first(w.comb, n));
}

void Model::block(const LayerWeights & L, const LayerConfig & lc, std::span<const SeqRun> runs, int64_t il, int64_t n,
                  Tensor & streams, Tensor & streams2, const LayerWeights * next) {
    Workspace & w = *ws_;
    Backend & b = backend_;
    Tensor xn = first(w.xn, n), out = first(w.out, n);
    Tensor post = first(w.post, n), comb = first(w.comb, n);
    // Attention sublayer: HCPre mixed the streams into one input (normed in the same op); HCPost writes the output
    // back into all streams (there is no other residual path), fused with the FFN's HCPre.
    trace("attn_in", il, xn);
    attention(L, lc, runs, il, n);
    trace("attn_out", il, out);
    b.hc_post_pre(streams, out, post, comb, streams2, hc_pre_of(L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, L.ffn_norm),
                  xn);
    std::swap(streams, streams2);

    trace("mlp_in", il, xn);
    ffn(L, lc, il, n);
    trace("mlp_out", il, out);
    if (next)
        b.hc_post_pre(streams, out, post, comb, streams2,
                      hc_pre_of(next->hc_attn_fn, next->hc_attn_scale, next->hc_attn_base, next->attn_norm), xn);
    else
        b.hc_post(streams, out, post, comb, streams2);
    std::swap(streams, streams2);
    trace("out", il, streams);
}

void Model::attention(const LayerWeights & L, const LayerConfig & lc, std::span<const SeqRun> runs, int64_t il,
                      int64_t n) {
    const ModelConfig & c = config_;
    Workspace & w = *ws_;
    Backend & b = backend_;
    const RopeSpec & rope = rope_[int(lc.kind)];
    const bool official = numerics_ == Numerics::official;
    const int64_t d = c.head_dim;
    Tensor xn = first(w.xn, n);

    const Tensor pos = first(w.positions, n);
    const bool compressed = lc.kind != LayerKind::sliding, csa = lc.kind == LayerKind::csa;
    const int64_t R = lc.compress_ratio;
    const int64_t width = (csa ? 2 : 1) * d;  // compressor projections: two overlapping halves on CSA layers
    const int64_t dI = c.indexer_dim, HI = c.indexer_heads;
    auto state_of = [&](const SeqRun & r) -> LayerState & {
        return il < c.n_layer ? r.state->layer(il) : r.state->mtp();
    };
    // A run's rows of a workspace activation (token axis ne[3]).
    auto rows_of = [](const Tensor & t, const SeqRun & r) { return token_rows(t, r.row0, r.n); };

    // Every projection of the normed input at once: the low-rank query, the K=V row, the compressor's values and
    // gate scores and, on CSA layers, the indexer compressor's and the indexer head weights.
    Tensor cq = first(w.cq, n), kv = first(w.kv, n);
    Tensor ckv = make_tensor(GgmlType::F32, w.comp_kv.data, width, n);
    Tensor cscore = make_tensor(GgmlType::F32, w.comp_score.data, width, n);
    Tensor ikv, iscore, iw;
    std::vector<MatmulTarget> proj = {{L.q_a, cq}, {L.kv, kv}};
    if (compressed) proj.insert(proj.end(), {{L.comp_kv, ckv}, {L.comp_gate, cscore}});
    if (csa) {
        ikv = first(w.idx_kv, n), iscore = first(w.idx_score, n), iw = first(w.idx_w, n);
        proj.insert(proj.end(), {{L.idx_comp_kv, ikv}, {L.idx_comp_gate, iscore}, {L.idx_proj, iw}});
    }
    b.matmul_many(xn, proj);

    // Query: the low-rank vector normed (the indexer reuses it), expanded to H heads, each head RMS-normed and
    // rotated; the indexer's queries come from the same normed vector, unnormalised, rotated likewise.
    b.rms_norm(cq, L.q_a_norm, cq, c.norm_eps);
    Tensor q = first(w.q, n);
    // Each run attends over its own state up to its own context bound.
    auto bound_of = [](const SeqRun & r) { return context_bound(r.pos0 + r.n); };
    const int64_t bound = bound_of(runs.front());

    // A CSA layer's indexer picks the compressed rows each token attends to: its own compressor, query product and
    // scores, needed only by the attention. After its query's product, the rest may run as a branch beside the
    // query's product and norm: a decode step's indexer is a chain of small latency-bound kernels, long enough to
    // gain from it at long contexts (the bound is part of a captured sequence's key, so the choice is stable).
    const bool batch = runs.size() > 1;
    const bool branch = csa && !batch && bound >= indexer_branch_context_;
    Tensor iq, sel;
    if (csa) {
        iq = first(w.idx_q, n);
        if (c.indexer_top_k > 0) sel = first(w.selected, n);
        b.matmul(L.idx_q_b, cq, reshape(iq, HI * dI, n));
        if (branch) b.begin_branch(n);
        b.rope(iq, rope, pos, false);
        if (official) b.hadamard_fp4_roundtrip(reshape(iq, dI, HI * n));
    }
    // A run's indexer: its compressor, then its top-k of the visible rows.
    const CompressedRowFinish ifinish{L.idx_comp_norm, c.norm_eps, rope,
                                      official ? RowRounding::hadamard_fp4 : RowRounding::none, 0};
    auto index = [&](const SeqRun & r) {
        LayerState & S = state_of(r);
        b.compressor_update(rows_of(ikv, r), rows_of(iscore, r), L.idx_comp_ape, S.idx_kv, S.idx_score, rows_of(pos, r),
                            R, true, ifinish, S.idx_keys);
        // score = Σ_h w_h·H_I^-1/2 · relu(q_h·k)·d_I^-1/2: both scales fold into one constant.
        if (c.indexer_top_k > 0)
            b.indexer_select(rows_of(iq, r), rows_of(iw, r), visible_rows(S.idx_keys, bound_of(r), R), rows_of(pos, r),
                             R, 1.0f / std::sqrt(float(dI) * float(HI)), rows_of(sel, r));
    };
    if (csa && !batch) index(runs.front());
    if (branch) b.end_branch();

    b.matmul(L.q_b, cq, reshape(q, c.q_dim(), n));
    // A compressed row is normed and rotated at its block's first position b·R, then rounded.
    const CompressedRowFinish finish{L.comp_norm, c.norm_eps, rope, official ? RowRounding::fp8 : RowRounding::none,
                                     d - c.n_rot};
    Tensor attn = first(w.attn, n);
    // A run's attention: the query heads (no weight) and its one K=V row per token, normed, rotated like the queries,
    // FP8-rounded in the official numerics and written into the raw ring before attending, so that a token sees
    // itself and the earlier tokens of its chunk; its compressor; then attention over its own state up to its own
    // context bound. Values carry the rotation of their own positions; turning the output back by the query's angle
    // leaves relative phase only.
    auto attend = [&](const SeqRun & r, bool join) {
        LayerState & S = state_of(r);
        const NormRopeTarget heads[] = {
            {rows_of(q, r), Tensor{}, 0, Tensor{}},
            {reshape(rows_of(kv, r), d, 1, r.n), L.kv_norm, official ? d - c.n_rot : 0, S.raw}};
        b.norm_rope(heads, c.norm_eps, rope, rows_of(pos, r));
        if (compressed)
            b.compressor_update(row_view(ckv, r.row0, r.n), row_view(cscore, r.row0, r.n), L.comp_ape, S.comp_kv,
                                S.comp_score, rows_of(pos, r), R, csa, finish, S.comp);
        if (join) b.join_branch();
        CompressedRows comp;
        if (compressed && !(csa && c.indexer_top_k == 0)) {  // with top_k 0 no compressed row is ever selected
            comp.rows = visible_rows(S.comp, bound_of(r), R);
            comp.ratio = R;
            if (csa) comp.selected = rows_of(sel, r);
        }
        b.attention(rows_of(q, r), S.raw, rows_of(pos, r), c.window, comp, L.sinks, 1.0f / std::sqrt(float(d)),
                    rows_of(attn, r), &rope);
    };
    if (batch) {
        // Each sequence's own ops (its indexer and attention: a chain of small kernels a layer) in a lane of its own.
        b.begin_lanes(int(runs.size()));
        for (size_t i = 0; i < runs.size(); ++i) {
            b.lane(int(i));
            if (csa) index(runs[i]);
            attend(runs[i], false);
        }
        b.end_lanes();
    } else {
        const SeqRun & r = runs.front();
        attend(r, branch);
        if (compressed) {
            const int64_t b0 = r.pos0 / R, m = (r.pos0 + r.n) / R - b0;  // rows completed by this chunk (traces only)
            if (m > 0) trace("compressed_kv", il, row_view(state_of(r).comp, b0, m));
            if (csa && m > 0) trace("indexer_kv", il, row_view(state_of(r).idx_keys, b0, m));
        }
    }
    if (csa && c.indexer_top_k > 0) trace("indexer_topk", il, sel);

    Tensor o_low = first(w.o_low, n);
    b.matmul_grouped(L.o_a, reshape(attn, c.q_dim(), n), o_low, c.o_groups);
    b.matmul(L.o_b, o_low, first(w.out, n));
}

void Model::ffn(const LayerWeights & L, const LayerConfig & lc, int64_t il, int64_t n) {
    const ModelConfig & c = config_;
    Workspace & w = *ws_;
    Backend & b = backend_;
    Tensor xn = first(w.xn, n);

    MoeFfn f;
    f.gate_inp = L.gate_inp;
    if (lc.hash_routed) {
        f.tid2eid = L.tid2eid;
        f.tokens = first(w.tokens, n);
    } else {
        f.bias = L.exp_probs_b;
    }
    f.route_scale = c.route_scale;
    f.gate_sh = L.gate_shexp;
    f.up_sh = L.up_shexp;
    f.down_sh = L.down_shexp;
    f.limit_sh = lc.swiglu_limit_shared;
    f.gate = L.gate_exps;
    f.up = L.up_exps;
    f.down = L.down_exps;
    f.limit = lc.swiglu_limit;
    f.logits = first(w.router, n);
    f.g = first(w.sh_gate, n);
    f.u = first(w.sh_up, n);
    f.experts = first(w.experts, n);
    f.weights = first(w.weights, n);
    b.moe_ffn(xn, f, first(w.out, n));
    trace("router_idx", il, f.experts);
    trace("router_w", il, f.weights);
}

}  // namespace dsv4
