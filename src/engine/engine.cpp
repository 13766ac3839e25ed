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
#include "util/log.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>

namespace dsv4 {

namespace {

class SessionImpl;

class EngineImpl final : public Engine {
  public:
    explicit EngineImpl(const EngineOptions & options, const std::function<void(double)> & progress) {
        Numerics numerics;
        DSV4_CHECK(parse_numerics(options.numerics, &numerics), "unknown numerics '{}' (official or reference)",
                   options.numerics);
        file_ = std::make_unique<GgufFile>(GgufFile::open(options.model_path));
        if (!options.mtp_path.empty()) mtp_file_ = std::make_unique<GgufFile>(GgufFile::open(options.mtp_path));
        DSV4_CHECK(options.backend == "cpu" || options.backend == "cuda" || options.backend == "auto",
                   "unknown backend '{}' (cpu, cuda or auto)", options.backend);
        bool on_gpu = false;
#if DSV4_HAVE_CUDA
        // auto: the GPU when there is one. The CUDA backend decodes with 8-bit activations (the CPU's default
        // numerics), so quantize_activations does not apply to it; its prefill runs on the tensor cores (f16
        // activations and attention) except under reference numerics, which keep every product in f32 or on
        // the 8-bit rules.
        if (options.backend == "cuda" || (options.backend == "auto" && cuda_device_count() > 0)) {
            CudaBackendOptions cuda;
            cuda.device = options.gpu;
            cuda.tensor_cores = numerics != Numerics::reference;
            backend_ = make_cuda_backend(cuda);
            on_gpu = true;
            gpu_ = options.gpu;
        }
#else
        DSV4_CHECK(options.backend != "cuda", "backend 'cuda' is not available in this build ({})", build_backends());
#endif
        if (!backend_) {
            CpuBackendOptions cpu;
            cpu.n_threads = options.n_threads;
            cpu.quantize_activations = options.quantize_activations;
            backend_ = make_cpu_backend(cpu);
        }
        // The GPU's prefill products need large chunks to fill the tensor cores (a 256-token chunk leaves most of
        // the machine idle in the narrow projections); the CPU gains nothing past a few hundred tokens.
        const int64_t n_ubatch = options.n_ubatch > 0 ? options.n_ubatch : on_gpu ? 2048 : 256;
        if (progress) progress(0.0);
        model_ = std::make_unique<Model>(*file_, *backend_, n_ubatch, numerics, mtp_file_.get());
        if (progress) progress(1.0);

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
        return plan_kv(model_->config(), n_ctx, info_.n_ubatch, info_.has_mtp).total();
    }
    uint64_t peak_device_bytes() const override { return backend_->peak_device_bytes(); }
    uint64_t device_free_bytes() const override {
#if DSV4_HAVE_CUDA
        if (gpu_ >= 0) return cuda_memory_info(gpu_).free_bytes;
#endif
        return 0;
    }

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
    std::mutex eval_mutex_;
    int gpu_ = -1;  // the CUDA device the backend runs on; -1 on the CPU

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
    std::span<const float> logits() const override { return logits_; }

    bool eval(std::span<const int32_t> tokens, bool all_logits, const ProgressFn & progress) override {
        if (tokens.empty()) return true;
        const int64_t n_vocab = engine_.model().config().n_vocab;
        logits_.resize(size_t((all_logits ? int64_t(tokens.size()) : 1) * n_vocab));
        const int64_t before = state_->n_past();
        std::lock_guard<std::mutex> lock(engine_.eval_mutex());
        bool done = false;
        try {
            done =
                engine_.model().eval(*state_, tokens, all_logits ? LogitsMode::all : LogitsMode::last, logits_.data(),
                                     [&](int64_t n) { return !progress || progress(n, int64_t(tokens.size())); });
        } catch (...) {
            // A failed evaluation leaves the state at an unknown point inside the chunk: start over.
            clear();
            throw;
        }
        tokens_.insert(tokens_.end(), tokens.begin(), tokens.begin() + (state_->n_past() - before));
        if (!done) logits_.clear();
        return done;
    }

    int64_t sync(std::span<const int32_t> target, const ProgressFn & progress) override {
        const size_t common =
            size_t(std::mismatch(tokens_.begin(), tokens_.end(), target.begin(), target.end()).first - tokens_.begin());
        // The compressed state cannot be rolled back, so only an extension of what the state holds is reused. A state
        // whose last evaluation was cancelled has no logits: it can be extended, not used as it is.
        if (common > 0 && common == tokens_.size() && (common < target.size() || !logits_.empty())) {
            if (common < target.size()) eval(target.subspan(common), false, progress);
            return int64_t(common);
        }
        clear();
        eval(target, false, progress);
        return 0;
    }

    void clear() override {
        state_->clear();
        tokens_.clear();
        logits_.clear();
    }

    std::string snapshot() const override {
        std::string state = state_->snapshot();
        std::string out;
        const uint64_t n_tokens = tokens_.size(), n_logits = logits_.size();
        out.append(reinterpret_cast<const char *>(&n_tokens), 8);
        out.append(reinterpret_cast<const char *>(tokens_.data()), tokens_.size() * sizeof(int32_t));
        out.append(reinterpret_cast<const char *>(&n_logits), 8);
        out.append(reinterpret_cast<const char *>(logits_.data()), logits_.size() * sizeof(float));
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
    }

  private:
    EngineImpl & engine_;
    std::unique_ptr<KvState> state_;
    std::vector<int32_t> tokens_;
    std::vector<float> logits_;
};

std::unique_ptr<Session> EngineImpl::new_session(int64_t n_ctx) { return std::make_unique<SessionImpl>(*this, n_ctx); }

}  // namespace

int64_t Engine::plan_context(uint64_t memory_bytes, int n_sessions) const {
    const int64_t n = std::max(n_sessions, 1);
    const int64_t limit = info().n_ctx_train > 0 ? info().n_ctx_train : int64_t(1) << 20;
    auto fits = [&](int64_t ctx) { return uint64_t(n) * session_bytes(ctx) <= memory_bytes; };
    // The state grows monotonically with the context: binary search over multiples of the step.
    int64_t lo = 0, hi = limit / kContextStep;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (fits(mid * kContextStep))
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo * kContextStep;
}

std::unique_ptr<Engine> Engine::open(const EngineOptions & options, const std::function<void(double)> & progress) {
    return std::make_unique<EngineImpl>(options, progress);
}

std::string version_string() {
    std::string s = fmt::format("dsv4 {} ({}), backends: {}", build_version(), build_commit(), build_backends());
#if DSV4_HAVE_CUDA
    s += "\n" + cuda_device_summary();
#endif
    return s;
}

}  // namespace dsv4
