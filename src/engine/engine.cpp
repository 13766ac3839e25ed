// The engine: implements include/dsv4/engine.h on top of the model layer. One Engine owns the mapped model
// file, the backend and the weights; sessions own their KV state.
#include "dsv4/engine.h"

#include "backend/backend.h"
#if DSV4_HAVE_CUDA
#include "backend/cuda.h"
#endif
#include "engine/build_info.h"
#include "format/gguf.h"
#include "model/forward.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"
#include "util/timer.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>

namespace dsv4 {

namespace {

class SessionImpl;

// auto: the GPU when there is one.
bool wants_gpu(const EngineOptions & o) {
    DSV4_CHECK(o.backend == "cpu" || o.backend == "cuda" || o.backend == "auto",
               "unknown backend '{}' (cpu, cuda or auto)", o.backend);
#if DSV4_HAVE_CUDA
    return o.backend == "cuda" || (o.backend == "auto" && cuda_device_count() > 0);
#else
    DSV4_CHECK(o.backend != "cuda", "backend 'cuda' is not available in this build ({})", build_backends());
    return false;
#endif
}

// The GPU's prefill products need large chunks to fill the tensor cores (a 256-token chunk leaves most of the
// machine idle in the narrow projections; with 8192 tokens a routed expert sees ~190 a chunk, one 128-token tile
// and half of another, each decoding the expert's weights); the CPU gains nothing past a few hundred tokens.
// Engine::plan picks the largest of the larger GPU chunks for which the context still fits.
constexpr int64_t kGpuUbatch = 2048;
constexpr int64_t kLargeGpuUbatches[] = {16384, 8192};
int64_t ubatch_for(const EngineOptions & o, bool on_gpu) {
    return o.n_ubatch > 0 ? o.n_ubatch : on_gpu ? kGpuUbatch : 256;
}

Numerics numerics_of(const EngineOptions & o) {
    Numerics numerics;
    DSV4_CHECK(parse_numerics(o.numerics, &numerics), "unknown numerics '{}' (official or reference)", o.numerics);
    return numerics;
}

class EngineImpl final : public Engine {
  public:
    explicit EngineImpl(const EngineOptions & options, const std::function<void(const LoadProgress &)> & progress) {
        const Numerics numerics = numerics_of(options);
        file_ = std::make_unique<GgufFile>(GgufFile::open(options.model_path));
        if (!options.mtp_path.empty()) mtp_file_ = std::make_unique<GgufFile>(GgufFile::open(options.mtp_path));
        const bool on_gpu = wants_gpu(options);
#if DSV4_HAVE_CUDA
        // The CUDA backend decodes with 8-bit activations (the CPU's default numerics), so quantize_activations
        // does not apply to it; its prefill runs on the tensor cores (f16 activations and attention) except under
        // reference numerics, which keep every product in f32 or on the 8-bit rules.
        if (on_gpu) {
            CudaBackendOptions cuda;
            cuda.device = options.gpu;
            cuda.tensor_cores = numerics != Numerics::reference;
            backend_ = make_cuda_backend(cuda);
        }
#endif
        if (!backend_) {
            CpuBackendOptions cpu;
            cpu.n_threads = options.n_threads;
            cpu.quantize_activations = options.quantize_activations;
            backend_ = make_cpu_backend(cpu);
        }
        const int64_t n_ubatch = ubatch_for(options, on_gpu);
        // A batched step is one pass over backend ops: checked bit for bit against single steps on the CPU, and
        // against the CPU on the GPU (cuda_model_test). DSV4_BATCHED_DECODE=0 steps the sessions one after another
        // (for comparisons).
        const char * batched = std::getenv("DSV4_BATCHED_DECODE");
        batched_decode_ = !(batched && std::string_view(batched) == "0");
        const Timer load;
        LoadProgress lp;
        auto report = [&](uint64_t done, uint64_t total) {
            lp.bytes_done = done;
            lp.bytes_total = total;
            lp.seconds = load.seconds();
            if (progress) progress(lp);
        };
        model_ = std::make_unique<Model>(*file_, *backend_, n_ubatch, numerics, mtp_file_.get(), report);
        backend_->synchronize();
        report(lp.bytes_total, lp.bytes_total);
        if (on_gpu)
            log_info("{}: {:.2f} GB of weights copied to the GPU in {:.1f} s ({:.2f} GB/s)", options.model_path,
                     double(lp.bytes_total) / 1e9, lp.seconds, lp.gb_per_s());

        const ModelConfig & c = model_->config();
        info_.name = c.name;
        info_.path = options.model_path;
        info_.backend = backend_->name();
        info_.numerics = numerics_name(numerics);
        info_.n_vocab = c.n_vocab;
        info_.n_layer = c.n_layer;
        info_.n_embd = c.n_embd;
        info_.n_ctx_train = c.n_ctx_train;
        info_.has_mtp = model_->weights().mtp.has_value();
        for (const GgufTensorInfo & t : file_->tensors()) info_.weight_bytes += t.n_bytes;
        info_.n_ubatch = n_ubatch;
        info_.description = std::string(file_->get_string_opt("general.description").value_or(""));
        info_.random_weights = info_.description.rfind("dsv4-synth:", 0) == 0;
        info_.chat_template = std::string(file_->get_string_opt("deepseek4.chat_template_version").value_or("v4"));
        info_.fingerprint = fingerprint(*file_, info_.numerics);
        if (file_->has("tokenizer.ggml.tokens")) {
            tokenizer_.emplace(Tokenizer::from_gguf(*file_));
            DSV4_CHECK(tokenizer_->n_vocab() == c.n_vocab, "{}: the tokenizer has {} tokens, the model {}",
                       options.model_path, tokenizer_->n_vocab(), c.n_vocab);
        }
    }

    const ModelInfo & info() const override { return info_; }
    const Tokenizer * tokenizer() const override { return tokenizer_ ? &*tokenizer_ : nullptr; }
    std::unique_ptr<Session> new_session(int64_t n_ctx) override;
    uint64_t session_bytes(int64_t n_ctx) const override {
        return plan_kv(model_->config(), n_ctx, info_.n_ubatch, info_.has_mtp, indexer_key_type(model_->numerics()))
            .total();
    }
    uint64_t peak_device_bytes() const override { return backend_->peak_device_bytes(); }
    void decode_batch(std::span<Session * const> sessions, std::span<const int32_t> tokens) override;
    bool batched_decode() const override { return batched_decode_; }
    Model & model() { return *model_; }
    // The model's scratch is shared: one evaluation at a time across sessions.
    std::mutex & eval_mutex() { return eval_mutex_; }

  private:
    std::unique_ptr<GgufFile> file_;
    std::unique_ptr<GgufFile> mtp_file_;
    std::unique_ptr<Backend> backend_;
    std::unique_ptr<Model> model_;
    std::optional<Tokenizer> tokenizer_;
    ModelInfo info_;
    bool batched_decode_ = false;
    std::mutex eval_mutex_;

    // Hashing all weights would read the whole file (80+ GB); the tensor table, the size and 64 KiB from a few
    // tensors spread over the file tell checkpoints and quantizations apart just as well.
    static uint64_t fingerprint(const GgufFile & file, std::string_view numerics) {
        XXH64_state_t * h = XXH64_createState();
        XXH64_reset(h, 0x64737634);
        const uint64_t size = file.file_size();
        XXH64_update(h, &size, sizeof size);
        XXH64_update(h, numerics.data(), numerics.size());
        const auto & tensors = file.tensors();
        for (const GgufTensorInfo & t : tensors) {
            XXH64_update(h, t.name.data(), t.name.size());
            XXH64_update(h, &t.type, sizeof t.type);
            XXH64_update(h, t.ne, sizeof t.ne);
            XXH64_update(h, &t.offset, sizeof t.offset);
        }
        for (size_t k = 0; k < 4 && !tensors.empty(); ++k) {
            const GgufTensorInfo & t = tensors[k * (tensors.size() - 1) / 3];
            XXH64_update(h, file.tensor_data(t), std::min<uint64_t>(t.n_bytes, 65536));
        }
        const uint64_t out = XXH64_digest(h);
        XXH64_freeState(h);
        return out;
    }
};

class SessionImpl final : public Session {
  public:
    SessionImpl(EngineImpl & engine, int64_t n_ctx) : engine_(engine), state_(engine.model().new_state(n_ctx)) {}

    int64_t n_ctx() const override { return state_->n_ctx(); }
    int64_t n_past() const override { return state_->n_past(); }
    const std::vector<int32_t> & tokens() const override { return tokens_; }
    std::span<const float> logits() const override {
        if (where_ == LogitsAt::device) {
            std::lock_guard<std::mutex> lock(engine_.eval_mutex());
            logits_.resize(size_t(engine_.model().config().n_vocab));
            engine_.model().read_last_logits(*state_, logits_.data());
            where_ = LogitsAt::host;
        }
        return where_ == LogitsAt::none ? std::span<const float>() : std::span<const float>(logits_);
    }
    bool has_logits() const override { return where_ != LogitsAt::none; }

    SampledToken sample(Sampler & sampler) override {
        DSV4_CHECK(where_ != LogitsAt::none, "sample: the session has no logits (nothing evaluated, or cancelled)");
        Model & model = engine_.model();
        const int64_t n_vocab = model.config().n_vocab;
        if (where_ == LogitsAt::device) {
            LogitCandidates c;
            c.n_vocab = n_vocab;
            c.ids.resize(size_t(model.n_candidates()));
            c.logits.resize(c.ids.size());
            float stats[4];
            {
                std::lock_guard<std::mutex> lock(engine_.eval_mutex());
                model.logit_candidates(*state_, c.ids.data(), c.logits.data(), stats);
            }
            c.max = stats[0];
            c.log_sum = stats[1];
            // Counts and ids below 2^24 are exact in f32.
            DSV4_CHECK(stats[2] >= 0 && stats[2] <= float(c.ids.size()) && stats[3] >= 0 && stats[3] < float(n_vocab),
                       "sample: the backend returned {} candidates and argmax {}", stats[2], stats[3]);
            c.ids.resize(size_t(stats[2]));
            c.logits.resize(c.ids.size());
            c.argmax = int32_t(stats[3]);
            if (auto token = sampler.sample(c)) return *token;
        }
        return sampler.sample(logits().last(size_t(n_vocab)));
    }

    bool eval(std::span<const int32_t> tokens, bool all_logits, const ProgressFn & progress) override {
        if (tokens.empty()) return true;
        const int64_t n_vocab = engine_.model().config().n_vocab;
        // Only a request for every row's logits reads them here; the last row otherwise stays in the state's
        // device copy until sample() or logits() needs it.
        logits_.resize(all_logits ? tokens.size() * size_t(n_vocab) : 0);
        where_ = LogitsAt::none;
        const int64_t before = state_->n_past();
        std::lock_guard<std::mutex> lock(engine_.eval_mutex());
        bool done = false;
        // No progress function, no checks (a long chunk that may stop waits for each layer before the next).
        std::function<bool(int64_t)> model_progress;
        if (progress) model_progress = [&](int64_t n) { return progress(n, int64_t(tokens.size())); };
        try {
            done = engine_.model().eval(*state_, tokens, all_logits ? LogitsMode::all : LogitsMode::last,
                                        all_logits ? logits_.data() : nullptr, model_progress);
        } catch (...) {
            // A failed evaluation leaves the state at an unknown point inside the chunk: start over.
            clear();
            throw;
        }
        tokens_.insert(tokens_.end(), tokens.begin(), tokens.begin() + (state_->n_past() - before));
        if (done) where_ = all_logits ? LogitsAt::host : LogitsAt::device;
        return done;
    }

    int64_t sync(std::span<const int32_t> target, const ProgressFn & progress) override {
        const size_t common =
            size_t(std::mismatch(tokens_.begin(), tokens_.end(), target.begin(), target.end()).first - tokens_.begin());
        // The compressed state cannot be rolled back, so only an extension of what the state holds is reused. A state
        // whose last evaluation was cancelled has no logits: it can be extended, not used as it is.
        if (common > 0 && common == tokens_.size() && (common < target.size() || has_logits())) {
            if (common < target.size()) eval(target.subspan(common), false, progress);
            return int64_t(common);
        }
        clear();
        eval(target, false, progress);
        return 0;
    }

    EngineImpl & engine() const { return engine_; }
    KvState & state() { return *state_; }
    // After a batched step evaluated `token` here: the logits are in the state's device copy.
    void stepped(int32_t token) {
        tokens_.push_back(token);
        logits_.clear();
        where_ = LogitsAt::device;
    }
    void clear() override {
        state_->clear();
        tokens_.clear();
        logits_.clear();
        where_ = LogitsAt::none;
    }

    std::string snapshot() const override {
        std::string state = state_->snapshot();
        std::string out;
        // The last token's logits only: a restored session samples from them.
        const std::span<const float> row =
            has_logits() ? logits().last(size_t(engine_.model().config().n_vocab)) : std::span<const float>();
        const uint64_t n_tokens = tokens_.size(), n_logits = row.size();
        out.append(reinterpret_cast<const char *>(&n_tokens), 8);
        out.append(reinterpret_cast<const char *>(tokens_.data()), tokens_.size() * sizeof(int32_t));
        out.append(reinterpret_cast<const char *>(&n_logits), 8);
        out.append(reinterpret_cast<const char *>(row.data()), row.size() * sizeof(float));
        out += state;
        return out;
    }

    void restore(std::string_view bytes) override {
        clear();
        auto take = [&](void * dst, size_t n) {
            DSV4_CHECK(bytes.size() >= n, "session snapshot truncated");
            std::memcpy(dst, bytes.data(), n);
            bytes.remove_prefix(n);
        };
        uint64_t n_tokens = 0, n_logits = 0;
        take(&n_tokens, 8);
        DSV4_CHECK(n_tokens <= uint64_t(state_->n_ctx()), "session snapshot holds {} tokens, context is {}", n_tokens,
                   state_->n_ctx());
        std::vector<int32_t> tokens(static_cast<size_t>(n_tokens));
        take(tokens.data(), tokens.size() * sizeof(int32_t));
        take(&n_logits, 8);
        DSV4_CHECK(n_logits == 0 || n_logits == uint64_t(engine_.model().config().n_vocab),
                   "session snapshot has {} logits, the vocabulary is {}", n_logits, engine_.model().config().n_vocab);
        std::vector<float> logits(static_cast<size_t>(n_logits));
        take(logits.data(), logits.size() * sizeof(float));
        state_->restore(bytes);
        DSV4_CHECK(uint64_t(state_->n_past()) == n_tokens, "session snapshot: {} tokens but a state of {}", n_tokens,
                   state_->n_past());
        tokens_ = std::move(tokens);
        logits_ = std::move(logits);
        where_ = logits_.empty() ? LogitsAt::none : LogitsAt::host;
    }

  private:
    EngineImpl & engine_;
    std::unique_ptr<KvState> state_;
    std::vector<int32_t> tokens_;
    // Where the last eval's logits are: nowhere (cleared, cancelled), in logits_ (every row was asked for, a
    // restored snapshot, or the row was read), or only in the state's device copy (state_->last_logits()).
    enum class LogitsAt { none, host, device };
    mutable LogitsAt where_ = LogitsAt::none;
    mutable std::vector<float> logits_;
};

std::unique_ptr<Session> EngineImpl::new_session(int64_t n_ctx) { return std::make_unique<SessionImpl>(*this, n_ctx); }

void EngineImpl::decode_batch(std::span<Session * const> sessions, std::span<const int32_t> tokens) {
    DSV4_CHECK(sessions.size() == tokens.size(), "decode_batch: {} tokens for {} sessions", tokens.size(),
               sessions.size());
    std::vector<SessionImpl *> impl;
    for (size_t i = 0; i < sessions.size(); ++i) {
        auto * s = dynamic_cast<SessionImpl *>(sessions[i]);
        DSV4_CHECK(s && &s->engine() == this, "decode_batch: session {} belongs to another engine", i);
        DSV4_CHECK(std::find(impl.begin(), impl.end(), s) == impl.end(), "decode_batch: session {} appears twice", i);
        DSV4_CHECK(s->n_past() < s->n_ctx(), "decode_batch: session {} is full ({} tokens)", i, s->n_ctx());
        DSV4_CHECK(tokens[i] >= 0 && tokens[i] < info_.n_vocab,
                   "decode_batch: token id {} outside the vocabulary [0, {})", tokens[i], info_.n_vocab);
        impl.push_back(s);
    }
    // One session steps alone: its own captured step also computes the sampler's candidates inside the graph.
    if (!batched_decode_ || impl.size() == 1) {
        for (size_t i = 0; i < impl.size(); ++i) impl[i]->eval(tokens.subspan(i, 1), false, {});
        return;
    }
    const size_t most = size_t(model_->max_batch());
    for (size_t i0 = 0; i0 < impl.size(); i0 += most) {
        const size_t n = std::min(most, impl.size() - i0);
        std::vector<KvState *> states;
        for (size_t i = i0; i < i0 + n; ++i) states.push_back(&impl[i]->state());
        std::lock_guard<std::mutex> lock(eval_mutex_);
        try {
            model_->decode_batch(states, tokens.subspan(i0, n));
        } catch (...) {
            // As in Session::eval: a step that failed part way leaves the states at unknown points.
            for (size_t i = i0; i < i0 + n; ++i) impl[i]->clear();
            throw;
        }
        for (size_t i = i0; i < i0 + n; ++i) impl[i]->stepped(tokens[i]);
    }
}

}  // namespace

MemoryPlan Engine::plan(const EngineOptions & options, int64_t n_ctx, int n_sessions) {
    const GgufFile file = GgufFile::open(options.model_path);
    std::optional<GgufFile> mtp_file;
    if (!options.mtp_path.empty()) mtp_file.emplace(GgufFile::open(options.mtp_path));
    const ModelConfig c = load_config(file);
    const bool on_gpu = wants_gpu(options);
    const Numerics numerics = numerics_of(options);

    MemoryPlan base;
    base.n_sessions = std::max(n_sessions, 1);
    // Host memory is shared with the OS and everything else the machine runs: a tenth of it stays free.
    const uint64_t host_reserve = std::max<uint64_t>(uint64_t(1) << 30, proc_field("/proc/meminfo", "MemTotal") / 10);
    if (on_gpu) {
#if DSV4_HAVE_CUDA
        const CudaMemoryInfo m = cuda_memory_info(options.gpu);
        DSV4_CHECK(m.total_bytes > 0, "cuda: cannot query the memory of gpu {}", options.gpu);
        base.available = m.free_bytes;
        if (m.integrated) {  // GB10: device allocations come out of host memory
            base.device = fmt::format("gpu {} (integrated: host memory)", options.gpu);
            base.reserve = host_reserve;
        } else {
            base.device = fmt::format("gpu {}", options.gpu);
            base.reserve = uint64_t(1) << 30;  // the runtime's own allocations and the captured graphs
        }
#endif
    } else {
        base.device = "host memory";
        base.available = proc_field("/proc/meminfo", "MemAvailable");
        base.reserve = host_reserve;
    }
    ModelFootprint f;
    auto fill = [&](MemoryPlan & q, int64_t ctx) {
        q.n_ctx = ctx;
        const KvPlan kv = plan_kv(c, ctx, q.n_ubatch, f.has_mtp, indexer_key_type(numerics));
        q.kv_raw = kv.raw_bytes;
        q.kv_compressed = kv.compressed_bytes;
        q.kv_indexer = kv.indexer_bytes;
        q.kv_frontier = kv.frontier_bytes;
        q.kv_logits = kv.logits_bytes;
        q.scratch = 0;
#if DSV4_HAVE_CUDA
        if (on_gpu) {
            CudaScratchShape s;
            s.n_ubatch = q.n_ubatch;
            s.n_ctx = ctx;
            s.n_embd = c.n_embd;
            s.expert_ff = c.expert_ff;
            s.n_expert = c.n_expert;
            s.n_expert_used = c.n_expert_used;
            s.n_head = c.n_head;
            s.head_dim = c.head_dim;
            s.lanes = q.n_sessions;
            // q_b, o_a, o_b, the shared expert's matrices, MTP's projection of [embedding, hidden]
            s.dense_weight =
                std::max({c.q_dim() * c.q_lora_rank, c.q_dim() * c.o_lora_rank, c.n_embd * c.o_groups * c.o_lora_rank,
                          c.n_embd * c.expert_ff * std::max<int64_t>(c.n_expert_shared, 1), 2 * c.n_embd * c.n_embd});
            for (const LayerConfig & l : c.layers)
                if (l.compress_ratio > 0)
                    s.min_ratio = s.min_ratio ? std::min(s.min_ratio, l.compress_ratio) : l.compress_ratio;
            q.scratch = cuda_scratch_bytes(s);
        }
#endif
    };
    // The plan for chunks of n_ubatch tokens and a context of ctx (0: the largest that fits). Every part grows
    // with the context: binary search over multiples of the step, up to the trained context.
    auto plan_for = [&](int64_t n_ubatch, int64_t ctx) {
        MemoryPlan p = base;
        p.n_ubatch = n_ubatch;
        f = model_footprint(file, c, n_ubatch, mtp_file ? &*mtp_file : nullptr);
        p.weights = f.weights;
        p.workspace = f.workspace;
        const int64_t limit = c.n_ctx_train > 0 ? c.n_ctx_train : int64_t(1) << 20;
        int64_t lo = 0, hi = limit / kContextStep;
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            MemoryPlan q = p;
            fill(q, mid * kContextStep);
            if (q.fits())
                lo = mid;
            else
                hi = mid - 1;
        }
        p.max_ctx = lo * kContextStep;
        fill(p, ctx > 0 ? ctx : p.max_ctx);
        return p;
    };
    const MemoryPlan p = plan_for(ubatch_for(options, on_gpu), n_ctx);
    // Left to the engine, a GPU prefills in chunks of 16384 or 8192 when the same context still fits with them (on
    // an H200 8192 prefills about 1.5x as fast as 2048 and 16384 a 64K prompt 4 % faster again, each for a larger
    // workspace and scratch and a raw ring longer by the chunk per session: docs/performance.md); where memory is
    // short, the context wins.
    if (on_gpu && options.n_ubatch == 0 && p.n_ctx > 0)
        for (const int64_t n_ubatch : kLargeGpuUbatches) {
            MemoryPlan large = plan_for(n_ubatch, p.n_ctx);
            if (large.fits()) return large;
        }
    return p;
}

std::string MemoryPlan::describe() const {
    const double G = double(1ull << 30);
    std::string s;
    s += fmt::format("weights     {:9.3f} GiB\n", double(weights) / G);
    s += fmt::format(
        "kv state    {:9.3f} GiB  ({} session(s) of {} tokens: raw {:.3f}, compressed {:.3f}, indexer "
        "{:.3f}, frontiers {:.3f})\n",
        double(n_sessions) * double(kv_per_session()) / G, n_sessions, n_ctx, double(kv_raw) / G,
        double(kv_compressed) / G, double(kv_indexer) / G, double(kv_frontier) / G);
    s += fmt::format("workspace   {:9.3f} GiB  (chunks of {} tokens)\n", double(workspace) / G, n_ubatch);
    s += fmt::format("scratch     {:9.3f} GiB\n", double(scratch) / G);
    s += fmt::format("total       {:9.3f} GiB + {:.1f} GiB reserve, of {:.3f} GiB available in {}\n",
                     double(total()) / G, double(reserve) / G, double(available) / G, device);
    s += fmt::format("fits        {}; largest context that fits: {}", fits() ? "yes" : "NO", max_ctx);
    return s;
}

void MemoryPlan::require_fit() const {
    const double G = double(1ull << 30);
    DSV4_CHECK(
        fits(),
        "a context of {} tokens ({} session(s)) needs {:.2f} GiB ({:.2f} of weights, {:.2f} of KV state, {:.2f} of "
        "workspace and scratch) plus a {:.1f} GiB reserve, but {} has {:.2f} GiB available; {}",
        n_ctx, n_sessions, double(total()) / G, double(weights) / G, double(n_sessions) * double(kv_per_session()) / G,
        double(workspace + scratch) / G, double(reserve) / G, device, double(available) / G,
        max_ctx > 0 ? fmt::format("the largest context that fits is {} (--ctx {})", max_ctx, max_ctx)
                    : std::string("no context fits: the weights alone do not (try a smaller quantization, "
                                  "a smaller --ubatch or fewer sessions)"));
}

std::unique_ptr<Engine> Engine::open(const EngineOptions & options,
                                     const std::function<void(const LoadProgress &)> & progress) {
    return std::make_unique<EngineImpl>(options, progress);
}

std::string version_string() {
    std::string s = fmt::format("dsv4 {} ({}), backends: {}", build_version(), build_commit(), build_backends());
#if DSV4_HAVE_CUDA
    s += '\n';
    s += cuda_device_summary();
#endif
    return s;
}

}  // namespace dsv4
