// dsv4-server (server.h): HTTP routes, the life cycle (loading, serving, shutdown), and the generation driver that
// turns scheduler updates into API events through api::Writer.
#include "server/server.h"

#include "engine/build_info.h"
#include "engine/scheduler.h"
#include "server/api.h"
#include "text/chat.h"
#include "text/dsml.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"
#include "util/timer.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <map>
#include <optional>
#include <thread>
#include <unordered_map>

namespace dsv4 {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;
using api::ApiError;
using api::Style;

std::string dump(const ojson & j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

// ---------------------------------------------------------------------------------------------------------------------
// The client's socket
// ---------------------------------------------------------------------------------------------------------------------

// cpp-httplib 0.11 neither exposes a request's socket nor notices a closed client before a write fails, and a
// prefill can run for minutes before the first byte is due. So the socket is found by its address pair among our
// descriptors, and polled for a hang-up while the request waits.
std::string address_text(const sockaddr_storage & a, int * port) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (a.ss_family == AF_INET) {
        const auto * in = reinterpret_cast<const sockaddr_in *>(&a);
        inet_ntop(AF_INET, &in->sin_addr, buf, sizeof buf);
        *port = ntohs(in->sin_port);
    } else if (a.ss_family == AF_INET6) {
        const auto * in = reinterpret_cast<const sockaddr_in6 *>(&a);
        inet_ntop(AF_INET6, &in->sin6_addr, buf, sizeof buf);
        *port = ntohs(in->sin6_port);
    }
    return buf;
}

int find_socket(const httplib::Request & req) {
    DIR * dir = ::opendir("/proc/self/fd");
    if (!dir) return -1;
    int found = -1;
    while (dirent * e = ::readdir(dir)) {
        const int fd = std::atoi(e->d_name);
        struct stat st {};
        if (fd <= 2 || ::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
        sockaddr_storage local{}, peer{};
        socklen_t ll = sizeof local, pl = sizeof peer;
        if (::getsockname(fd, reinterpret_cast<sockaddr *>(&local), &ll) != 0 ||
            ::getpeername(fd, reinterpret_cast<sockaddr *>(&peer), &pl) != 0)
            continue;
        int local_port = -1, peer_port = -1;
        address_text(local, &local_port);
        const std::string peer_addr = address_text(peer, &peer_port);
        if (local_port == req.local_port && peer_port == req.remote_port && peer_addr == req.remote_addr) {
            found = fd;
            break;
        }
    }
    ::closedir(dir);
    return found;
}

// The peer hung up (or half-closed: no HTTP client sends a request and then stops writing while waiting for it).
bool peer_closed(int fd) {
    if (fd < 0) return false;
    pollfd p{fd, POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// ---------------------------------------------------------------------------------------------------------------------
// Tool-call memory: id → the exact sampled DSML, so a client's JSON history re-renders byte for byte
// ---------------------------------------------------------------------------------------------------------------------

class ToolMemory {
  public:
    static constexpr size_t kCapacity = 100000;

    void remember(const std::string & id, const std::string & raw_dsml) {
        if (id.empty() || raw_dsml.empty()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        if (map_.emplace(id, raw_dsml).second) order_.push_back(id);
        while (order_.size() > kCapacity) {
            map_.erase(order_.front());
            order_.pop_front();
        }
    }
    void fill(ChatPrompt & prompt) const {
        std::lock_guard<std::mutex> lock(mutex_);
        for (ChatMessage & m : prompt.messages)
            for (ToolCall & c : m.tool_calls)
                if (auto it = map_.find(c.id); it != map_.end()) c.raw_dsml = it->second;
    }
    // Kept beside the disk cache so that histories written before a restart still render as sampled.
    void load(const std::string & path) {
        std::string text;
        try {
            text = read_file(path);
        } catch (const Error &) {
            return;  // none yet
        }
        json j = json::parse(text, nullptr, false);
        if (!j.is_object()) {
            log_warn("{}: not a JSON object; tool-call memory starts empty", path);
            return;
        }
        for (auto & [id, raw] : j.items())
            if (raw.is_string()) remember(id, raw.get<std::string>());
        log_info("tool-call memory: {} ids from {}", j.size(), path);
    }
    void save(const std::string & path) const {
        ojson j = ojson::object();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (const std::string & id : order_) j[id] = map_.at(id);
        }
        try {
            write_file_atomic(path, dump(j));
        } catch (const Error & e) {
            log_warn("tool-call memory not saved: {}", e.what());
        }
    }

  private:
    mutable std::mutex mutex_;
    std::unordered_map<std::string, std::string> map_;
    std::deque<std::string> order_;
};

// ---------------------------------------------------------------------------------------------------------------------
// Request authentication
// ---------------------------------------------------------------------------------------------------------------------

bool constant_time_equal(std::string_view a, std::string_view b) {
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    for (size_t i = 0; i < a.size(); ++i) diff |= uint8_t(a[i]) ^ uint8_t(b.empty() ? 0 : b[i % b.size()]);
    return diff == 0;
}

#ifdef DSV4_TEST_HOOKS
std::string base64_decode(std::string_view in) {
    auto value = [](char c) -> int {
        if (c >= 'A' && c <= 'Z') return c - 'A';
        if (c >= 'a' && c <= 'z') return c - 'a' + 26;
        if (c >= '0' && c <= '9') return c - '0' + 52;
        if (c == '+' || c == '-') return 62;
        if (c == '/' || c == '_') return 63;
        return -1;
    };
    std::string out;
    uint32_t acc = 0;
    int bits = 0;
    for (char c : in) {
        const int v = value(c);
        if (v < 0) continue;
        acc = (acc << 6) | uint32_t(v);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out += char((acc >> bits) & 0xff);
        }
    }
    return out;
}
#endif

enum class Endpoint { chat, completion, messages, responses };

// ---------------------------------------------------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------------------------------------------------

class HttpServer {
  public:
    explicit HttpServer(const ServerOptions & o) : opt_(o) {}
    int run();
    void request_shutdown();

  private:
    enum class State { loading, ready, failed, stopping };
    struct Plan;
    class Runner;

    void load();
    void routes();
    bool ready(httplib::Response & res, Style style);
    void reply_error(httplib::Response & res, Style style, const ApiError & e);
    void generate(const httplib::Request & req, httplib::Response & res, Endpoint endpoint);
    Plan plan(api::Prepared & p, const httplib::Request & req);
    std::string metrics() const;
    ojson props() const;
    ojson model_entry() const;
    std::string created_at() const {
        const std::time_t t = std::time_t(started_at_);
        std::tm tm{};
        gmtime_r(&t, &tm);
        char buf[32];
        std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
        return buf;
    }

    ServerOptions opt_;
    httplib::Server svr_;
    std::atomic<State> state_{State::loading};
    std::atomic<double> progress_{0};       // of the weights' bytes
    std::atomic<double> load_gb_per_s_{0};  // weight loading rate so far
    std::atomic<uint64_t> loaded_bytes_{0};
    std::unique_ptr<Engine> engine_;
    std::unique_ptr<Scheduler> scheduler_;
    api::ServerInfo info_;
    ToolMemory tools_;
    std::thread loader_;
    std::once_flag shutdown_once_;
    std::thread shutdown_;
    std::atomic<bool> listen_returned_{false};
    std::atomic<bool> loaded_{false};  // engine_, scheduler_ and info_ are set
    std::atomic<int> exit_code_{0};
    int64_t started_at_ = int64_t(std::time(nullptr));

    mutable std::mutex metrics_mutex_;
    std::map<std::pair<std::string, int>, uint64_t> http_requests_;  // (path, status) → count
};

void HttpServer::load() {
    try {
#ifdef DSV4_TEST_HOOKS
        for (int waited = 0; waited < opt_.test_load_delay_ms && state_.load() == State::loading; waited += 10) {
            progress_.store(0.5 * waited / opt_.test_load_delay_ms);
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
#endif
        // The memory plan comes first: a context that cannot fit is refused before gigabytes are loaded, with
        // the largest one that would; --ctx auto takes that one.
        const MemoryPlan plan = Engine::plan(opt_.engine, opt_.n_ctx, opt_.sessions);
        int64_t n_ctx = opt_.n_ctx;
        if (n_ctx == 0) {
            DSV4_CHECK(plan.max_ctx > 0,
                       "--ctx auto: no context fits ({:.1f} GiB of weights, {:.1f} GiB available in {})",
                       double(plan.weights) / (1 << 30), double(plan.available) / (1 << 30), plan.device);
            n_ctx = plan.max_ctx;
        } else {
            plan.require_fit();
        }
        log_info(
            "memory plan: context {}, {} session(s) of {:.2f} GiB, {:.1f} GiB of weights, {:.1f} GiB in all of "
            "{:.1f} GiB available in {} (largest context that fits: {}; prefill chunks of {} tokens)",
            n_ctx, opt_.sessions, double(plan.kv_per_session()) / (1 << 30), double(plan.weights) / (1 << 30),
            double(plan.total()) / (1 << 30), double(plan.available) / (1 << 30), plan.device, plan.max_ctx,
            plan.n_ubatch);
        EngineOptions engine_options = opt_.engine;
        engine_options.n_ubatch = plan.n_ubatch;  // the plan's chunk size (it may pick the larger GPU chunk)
        engine_ = Engine::open(engine_options, [&](const LoadProgress & p) {
            progress_.store(p.fraction());
            load_gb_per_s_.store(p.gb_per_s());
            loaded_bytes_.store(p.bytes_done);
        });
        const ModelInfo & mi = engine_->info();
        DSV4_CHECK(engine_->tokenizer(), "{}: the model file carries no tokenizer; the server needs one", mi.path);
        SchedulerOptions so;
        so.n_ctx = n_ctx;
        so.n_sessions = opt_.sessions;
        so.kv_disk_dir = opt_.kv_disk_dir;
        so.kv_disk_budget = uint64_t(std::max<int64_t>(opt_.kv_disk_space_mb, 0)) << 20;
        so.kv_cache_min_tokens = opt_.kv_cache_min_tokens;
        so.kv_cache_interval = opt_.kv_cache_interval;
        so.prefill_slice_seconds = opt_.prefill_slice_ms / 1000.0;
        scheduler_ = std::make_unique<Scheduler>(*engine_, so);
        if (!opt_.kv_disk_dir.empty()) tools_.load(opt_.kv_disk_dir + "/tool-calls.json");

        info_.n_ctx = n_ctx;
        info_.max_output = opt_.max_output;
        info_.model_id = !opt_.model_id.empty() ? opt_.model_id
                         : mi.random_weights    ? "dsv4-random-weights"
                                                : "deepseek-v4-flash";
        loaded_.store(true);
        State expected = State::loading;
        state_.compare_exchange_strong(expected, State::ready);
        log_info("model ready: {} ({}), context {}, {} session(s), {} on {}", info_.model_id, mi.name, n_ctx,
                 opt_.sessions, mi.backend, mi.numerics);
        if (mi.random_weights)
            log_warn(
                "{} has RANDOM WEIGHTS (made by dsv4-synth): it runs the whole software path but its replies are "
                "gibberish; download a real model with ./scripts/download-model.sh",
                mi.path);
    } catch (const std::exception & e) {
        log_error("cannot load the model: {}", e.what());
        state_.store(State::failed);
        exit_code_.store(1);
        request_shutdown();
    }
}

void HttpServer::request_shutdown() {
    std::call_once(shutdown_once_, [&] {
        // Its own thread: the caller may be the loader, which this joins, or the signal thread.
        shutdown_ = std::thread([this] {
            if (state_.load() != State::failed) state_.store(State::stopping);
            log_info("shutting down: no new connections; running generations get {:.0f} s", opt_.shutdown_grace_s);
            // httplib's stop() does nothing before listen has started (a model that fails to load at once can get
            // here first): repeat it until listen has returned.
            std::thread stopper([this] {
                while (!listen_returned_.load()) {
                    svr_.stop();
                    std::this_thread::sleep_for(std::chrono::milliseconds(50));
                }
            });
            if (loader_.joinable()) loader_.join();
            if (scheduler_) scheduler_->shutdown(opt_.shutdown_grace_s);
            if (!opt_.kv_disk_dir.empty() && scheduler_) tools_.save(opt_.kv_disk_dir + "/tool-calls.json");
            stopper.join();
        });
    });
}

bool HttpServer::ready(httplib::Response & res, Style style) {
    const State s = state_.load();
    if (s == State::ready) return true;
    const std::string message = s == State::loading
                                    ? fmt::format("the model is loading ({:.0f}%)", 100 * progress_.load())
                                : s == State::failed ? std::string("the model failed to load")
                                                     : std::string("the server is shutting down");
    res.set_header("Retry-After", "5");
    reply_error(res, style, ApiError(503, message, api::default_error_type(style, 503)));
    return false;
}

void HttpServer::reply_error(httplib::Response & res, Style style, const ApiError & e) {
    res.status = e.status;
    res.set_content(api::error_body(style, e.status, e.what(), e.type, e.param, e.code), "application/json");
}

// ---------------------------------------------------------------------------------------------------------------------
// Generation
// ---------------------------------------------------------------------------------------------------------------------

struct HttpServer::Plan {
    GenerationRequest gen;
    bool thinking = false;  // the completion starts inside reasoning
    std::string forced;     // assistant markup the server prefilled (a forced tool call), parsed before the output
};

HttpServer::Plan HttpServer::plan(api::Prepared & p, const httplib::Request & req) {
    const Tokenizer & tok = *engine_->tokenizer();
    Plan out;
    GenerationRequest & g = out.gen;
    if (p.chat) {
        ChatPrompt & prompt = p.request.prompt;
        prompt.version = parse_chat_template_version(engine_->info().chat_template);
        prompt.context_length = info_.n_ctx;
        tools_.fill(prompt);
        RenderedChatRequest rendered = render_chat_request(p.request);
        g.pieces = std::move(rendered.pieces);
        out.thinking = rendered.thinking;
        out.forced = std::move(rendered.forced);
        g.prompt = tok.encode_pieces(g.pieces);
        // Later turns share the conversation up to the last assistant marker.
        const int32_t assistant = tok.token_id(kAssistantText);
        for (size_t i = g.prompt.size(); i-- > 0;)
            if (g.prompt[i] == assistant) {
                g.cache_cut = int64_t(i + 1);
                break;
            }
        const bool any_tools = std::any_of(prompt.messages.begin(), prompt.messages.end(),
                                           [](const ChatMessage & m) { return !m.tools.empty(); });
        if (out.thinking && out.forced.empty() && prompt.drop_thinking && !any_tools) {
            // Thinking mode drops past reasoning: the next request renders this turn as "</think>" + answer while
            // the KV holds the reasoning too. Name that rendering so the next turn still reuses the state.
            g.visible_alias = dropped_reasoning_alias(pieces_text(g.pieces));
        }
    } else if (!p.raw_tokens.empty()) {
        g.prompt = p.raw_tokens;
    } else {
        // Raw text is the user's whole prompt, written with special tokens as text; BOS is added when missing.
        g.prompt = tok.encode(p.raw_prompt, true);
        if (g.prompt.empty() || g.prompt.front() != tok.bos_id()) g.prompt.insert(g.prompt.begin(), tok.bos_id());
    }
    const int64_t n = int64_t(g.prompt.size());
    if (n >= info_.n_ctx)
        throw ApiError(400,
                       fmt::format("the prompt has {} tokens; this server's context is {} tokens (prompt and reply "
                                   "together)",
                                   n, info_.n_ctx),
                       "invalid_request_error", p.chat ? "messages" : "prompt", "context_length_exceeded");
    const int64_t room = info_.n_ctx - n;
    int64_t max_tokens = p.max_tokens > 0 ? p.max_tokens : (info_.max_output > 0 ? info_.max_output : room);
    if (info_.max_output > 0) max_tokens = std::min(max_tokens, info_.max_output);
    g.max_tokens = std::min(max_tokens, room);
    g.sampling = p.sampling;
    g.stop = p.stop;
#ifdef DSV4_TEST_HOOKS
    if (req.has_header("x-dsv4-test-script"))
        g.scripted = tok.encode(base64_decode(req.get_header_value("x-dsv4-test-script")), true);
    if (req.has_header("x-dsv4-test-delay-ms"))
        g.test_step_delay_ms = std::atoi(req.get_header_value("x-dsv4-test-delay-ms").c_str());
#else
    (void)req;
#endif
    return out;
}

// Turns a job's updates into the Writer's events and the final Outcome.
class HttpServer::Runner {
  public:
    Runner(HttpServer & server, api::Prepared p, Plan plan, std::shared_ptr<GenerationJob> job, int fd,
           std::string path)
        : server_(server),
          p_(std::move(p)),
          plan_(std::move(plan)),
          job_(std::move(job)),
          fd_(fd),
          path_(std::move(path)),
          tok_(*server.engine_->tokenizer()) {
        think_end_ = tok_.token_id(kThinkEndText);
        in_reasoning_ = plan_.thinking;
    }

    enum class Start { started, finished, gone };
    // Waits while the job is queued.
    Start wait_start() {
        for (;;) {
            GenerationUpdate u = job_->wait(0.1);
            if (u.started || u.finished) {
                first_ = std::move(u);
                return first_->started ? Start::started : Start::finished;
            }
            if (peer_closed(fd_)) {
                job_->cancel();
                return Start::gone;
            }
        }
    }
    const GenerationUpdate & first() const { return *first_; }

    // Runs to the end. emit == nullptr: not streaming (Writer events are not produced; response() builds the body).
    // Returns false when the client went away.
    bool run(const std::function<bool(const std::string &)> * emit) {
        streaming_ = emit != nullptr;
        reply_.emplace(*p_.writer, streaming_, p_.chat, plan_.thinking,
                       [this](const ToolCall & call) { server_.tools_.remember(call.id, call.raw_dsml); });
        std::string out;
        const GenerationUsage & u0 = first_->usage;
        if (streaming_) out = p_.writer->start(u0.prompt_tokens, u0.cached_tokens);
        out += reply_->text(plan_.forced);
        process(*first_, out);
        double last_write = now_seconds();
        for (;;) {
            if (streaming_) {
                if (!out.empty()) {
                    if (!(*emit)(out)) return gone();
                    out.clear();
                    last_write = now_seconds();
                } else if (now_seconds() - last_write >= server_.opt_.sse_keepalive_s) {
                    if (!(*emit)(": keepalive\n\n")) return gone();
                    last_write = now_seconds();
                }
            }
            if (final_) break;
            GenerationUpdate u = job_->wait(0.1);
            if (peer_closed(fd_)) return gone();
            process(u, out);
        }
        log_summary();
        return final_->finish != FinishReason::cancelled;
    }

    const std::optional<GenerationUpdate> & final_update() const { return final_; }
    void cancel() { job_->cancel(); }
    const api::Outcome & outcome() { return reply_->outcome(); }
    api::Writer & writer() { return *p_.writer; }

  private:
    bool gone() {
        job_->cancel();
        log_info("{}: client went away; generation cancelled", path_);
        return false;
    }

    void process(GenerationUpdate & u, std::string & out) {
        api::Outcome & outcome = reply_->outcome();
        const bool logprobs = p_.writer->wants_logprobs();
        for (const GeneratedToken & t : u.tokens) {
            if (in_reasoning_) {
                ++outcome.reasoning_tokens;
                if (t.id == think_end_) in_reasoning_ = false;
            }
            out += reply_->text(t.text);
            if (logprobs) outcome.tokens.push_back(t);
        }
        if (logprobs && streaming_ && !u.tokens.empty()) out += p_.writer->logprobs(u.tokens);
        out += reply_->text(u.tail);
        if (!u.finished) return;
        final_ = u;
        outcome.finish = u.finish;
        outcome.stop_string = u.stop_string;
        outcome.usage = u.usage;
        switch (u.finish) {
            case FinishReason::eos:
            case FinishReason::stop:
            case FinishReason::length:
                out += reply_->finish();
                break;
            case FinishReason::error:
                if (streaming_) out += p_.writer->error_event(ApiError(500, u.error, "server_error"));
                break;
            case FinishReason::shutdown:
                if (streaming_)
                    out += p_.writer->error_event(ApiError(503, "the server is shutting down; the reply was cut short",
                                                           api::default_error_type(p_.writer->style(), 503)));
                break;
            case FinishReason::cancelled:
                break;
        }
    }

    void log_summary() const {
        const GenerationUsage & u = final_->usage;
        const double tps = u.decode_seconds > 0 ? double(u.completion_tokens) / u.decode_seconds : 0;
        log_info(
            "{}: {} prompt tokens ({} cached, {}), {} generated, prefill {:.2f} s, decode {:.2f} s ({:.1f} t/s), "
            "queue {:.2f} s, finish {}",
            path_, u.prompt_tokens, u.cached_tokens, u.cache_source, u.completion_tokens, u.prefill_seconds,
            u.decode_seconds, tps, u.queue_seconds, finish_reason_name(final_->finish));
    }

    HttpServer & server_;
    api::Prepared p_;
    Plan plan_;
    std::shared_ptr<GenerationJob> job_;
    int fd_;
    std::string path_;
    const Tokenizer & tok_;
    int32_t think_end_ = -1;
    bool in_reasoning_ = false;
    bool streaming_ = false;
    std::optional<GenerationUpdate> first_;
    std::optional<GenerationUpdate> final_;
    std::optional<api::ReplyBuilder> reply_;  // made when run() knows whether it streams
};

void HttpServer::generate(const httplib::Request & req, httplib::Response & res, Endpoint endpoint) {
    const Style style = endpoint == Endpoint::messages ? Style::anthropic : Style::openai;
    if (!ready(res, style)) return;
    try {
        const Tokenizer & tok = *engine_->tokenizer();
        api::Prepared p = endpoint == Endpoint::chat         ? api::prepare_openai_chat(req.body, info_, tok)
                          : endpoint == Endpoint::completion ? api::prepare_openai_completion(req.body, info_, tok)
                          : endpoint == Endpoint::messages   ? api::prepare_anthropic_messages(req.body, info_, tok)
                                                             : api::prepare_responses(req.body, info_, tok);
        Plan plan = this->plan(p, req);
        std::shared_ptr<GenerationJob> job;
        try {
            job = scheduler_->submit(plan.gen);
        } catch (const Error & e) {
            throw ApiError(state_.load() == State::ready ? 400 : 503, e.what());
        }
        const bool stream = p.stream;
        auto runner =
            std::make_shared<Runner>(*this, std::move(p), std::move(plan), std::move(job), find_socket(req), req.path);
        switch (runner->wait_start()) {
            case Runner::Start::gone:
                res.status = 499;
                return;
            case Runner::Start::finished: {
                const GenerationUpdate & u = runner->first();
                if (u.finish == FinishReason::shutdown) throw ApiError(503, "the server is shutting down");
                if (u.finish == FinishReason::cancelled) {
                    res.status = 499;
                    return;
                }
                throw ApiError(u.error.find("context") != std::string::npos ? 400 : 500, u.error);
            }
            case Runner::Start::started:
                break;
        }
        if (stream) {
            res.set_header("Cache-Control", "no-cache");
            res.set_header("X-Accel-Buffering", "no");
            res.set_chunked_content_provider("text/event-stream", [runner](size_t, httplib::DataSink & sink) {
                const std::function<bool(const std::string &)> emit = [&](const std::string & bytes) {
                    return sink.write(bytes.data(), bytes.size());
                };
                try {
                    if (!runner->run(&emit)) return false;
                } catch (const std::exception & e) {
                    // Nothing sensible can follow half a stream: end the connection (the job is cancelled).
                    log_error("stream failed: {}", e.what());
                    runner->cancel();
                    return false;
                }
                sink.done();
                return true;
            });
            return;
        }
        const bool completed = runner->run(nullptr);
        if (!completed) {
            res.status = 499;
            return;
        }
        const GenerationUpdate & u = *runner->final_update();
        if (u.finish == FinishReason::error) throw ApiError(500, u.error, "server_error");
        if (u.finish == FinishReason::shutdown) throw ApiError(503, "the server is shutting down");
        res.set_content(runner->writer().response(runner->outcome()), "application/json");
    } catch (const ApiError & e) {
        reply_error(res, style, e);
    } catch (const Error & e) {
        reply_error(res, style, ApiError(400, e.what()));
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Information routes
// ---------------------------------------------------------------------------------------------------------------------

ojson HttpServer::model_entry() const {
    const ModelInfo & mi = engine_->info();
    return {{"id", info_.model_id},
            {"object", "model"},
            {"type", "model"},
            {"created", started_at_},
            {"created_at", created_at()},
            {"owned_by", "dsv4"},
            {"display_name", mi.random_weights ? mi.name + " (RANDOM WEIGHTS: for trying the software)" : mi.name},
            {"random_weights", mi.random_weights},
            {"context_length", info_.n_ctx},
            {"max_completion_tokens", info_.max_output > 0 ? info_.max_output : info_.n_ctx},
            {"supported_parameters",
             {"tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
              "logprobs", "top_logprobs", "reasoning_effort"}}};
}

ojson HttpServer::props() const {
    const ModelInfo & mi = engine_->info();
    const SchedulerStats st = scheduler_->stats();
    ojson kv = nullptr;
    if (st.disk_enabled)
        kv = {{"dir", opt_.kv_disk_dir},
              {"space_mb", opt_.kv_disk_space_mb},
              {"files", st.disk.files},
              {"bytes", st.disk.bytes}};
    return {{"model", info_.model_id},
            {"model_name", mi.name},
            {"model_path", mi.path},
            {"description", mi.description},
            {"random_weights", mi.random_weights},
            {"chat_template", mi.chat_template},
            {"context_length", info_.n_ctx},
            {"n_ctx_train", mi.n_ctx_train},
            {"sessions", opt_.sessions},
            {"prefill_slice_ms", opt_.prefill_slice_ms},
            {"batched_decode", engine_->batched_decode()},
            {"max_output_tokens", info_.max_output},
            {"backend", mi.backend},
            {"numerics", mi.numerics},
            {"n_layer", mi.n_layer},
            {"n_embd", mi.n_embd},
            {"n_vocab", mi.n_vocab},
            {"weight_bytes", mi.weight_bytes},
            {"mtp", mi.has_mtp},
            {"build", {{"version", build_version()}, {"commit", build_commit()}, {"backends", build_backends()}}},
            {"kv_disk_cache", std::move(kv)},
            {"sampling_defaults", {{"temperature", 1.0}, {"top_p", 1.0}, {"top_k", 0}, {"min_p", 0.05}}},
            {"auth", !opt_.api_key.empty()}};
}

std::string HttpServer::metrics() const {
    std::string out;
    auto metric = [&](const char * name, const char * type, const char * help, double value) {
        out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n{0} {3}\n", name, help, type, value);
    };
    const bool loaded = loaded_.load();
    metric("dsv4_model_loaded", "gauge", "1 once the model is loaded.", loaded ? 1 : 0);
    metric("dsv4_load_progress", "gauge", "Model load progress in [0, 1].", progress_.load());
    {
        std::lock_guard<std::mutex> lock(metrics_mutex_);
        out +=
            "# HELP dsv4_http_requests_total HTTP requests by path and status.\n"
            "# TYPE dsv4_http_requests_total counter\n";
        for (const auto & [key, n] : http_requests_)
            out += fmt::format("dsv4_http_requests_total{{path=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, n);
    }
    if (loaded) {
        const SchedulerStats s = scheduler_->stats();
        metric("dsv4_context_length", "gauge", "Tokens per session.", double(info_.n_ctx));
        metric("dsv4_queue_length", "gauge", "Generations waiting for the inference thread.", double(s.queued));
        metric("dsv4_running", "gauge", "Generations holding a session (at most --sessions).", double(s.running));
        metric("dsv4_generations_total", "counter", "Generations finished, any reason.", double(s.requests));
        metric("dsv4_generations_cancelled_total", "counter", "Generations stopped because the client went away.",
               double(s.cancelled));
        metric("dsv4_generations_failed_total", "counter", "Generations that failed.", double(s.errors));
        metric("dsv4_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
               double(s.prompt_tokens));
        metric("dsv4_cached_prompt_tokens_total", "counter", "Prompt tokens reused from a live session or the disk.",
               double(s.cached_tokens));
        metric("dsv4_prefill_tokens_total", "counter", "Prompt tokens evaluated.", double(s.prefill_tokens));
        metric("dsv4_generated_tokens_total", "counter", "Tokens generated.", double(s.generated_tokens));
        metric("dsv4_decode_steps_total", "counter", "Decode steps (one token of every generation decoding then).",
               double(s.decode_steps));
        metric("dsv4_decode_step_tokens_total", "counter", "Tokens the decode steps evaluated.",
               double(s.decode_step_tokens));
        metric("dsv4_prefill_seconds_total", "counter", "Time spent in prefill.", s.prefill_seconds);
        metric("dsv4_decode_seconds_total", "counter", "Time spent decoding.", s.decode_seconds);
        metric("dsv4_prefill_tokens_per_second", "gauge", "Prefill speed of the last generation.", s.last_prefill_tps);
        metric("dsv4_decode_tokens_per_second", "gauge", "Decode speed of the last generation.", s.last_decode_tps);
        out +=
            "# HELP dsv4_cache_hits_total Generations that reused KV state, by source.\n"
            "# TYPE dsv4_cache_hits_total counter\n";
        out += fmt::format("dsv4_cache_hits_total{{source=\"live\"}} {}\n", s.live_hits);
        out += fmt::format("dsv4_cache_hits_total{{source=\"disk\"}} {}\n", s.disk_hits);
        if (s.disk_enabled) {
            metric("dsv4_kv_disk_files", "gauge", "Snapshots in the disk KV cache.", double(s.disk.files));
            metric("dsv4_kv_disk_bytes", "gauge", "Bytes of the disk KV cache.", double(s.disk.bytes));
            metric("dsv4_kv_disk_writes_total", "counter", "Snapshots written.", double(s.disk.writes));
            metric("dsv4_kv_disk_evictions_total", "counter", "Snapshots evicted for space.", double(s.disk.evictions));
            metric("dsv4_kv_disk_rejected_total", "counter", "Corrupt or truncated snapshots deleted.",
                   double(s.disk.rejected));
            metric("dsv4_kv_disk_misses_total", "counter", "Disk lookups that found nothing.", double(s.disk.misses));
        }
    }
    metric("process_resident_memory_bytes", "gauge", "Resident memory.",
           double(proc_field("/proc/self/status", "VmRSS")));
    metric("process_threads", "gauge", "Threads of the process.", double(proc_field("/proc/self/status", "Threads")));
    return out;
}

// ---------------------------------------------------------------------------------------------------------------------
// Routes and the life cycle
// ---------------------------------------------------------------------------------------------------------------------

Style style_of(const std::string & path) {
    return path.rfind("/v1/messages", 0) == 0 ? Style::anthropic : Style::openai;
}

void HttpServer::routes() {
    svr_.set_pre_routing_handler([this](const httplib::Request & req, httplib::Response & res) {
        if (!opt_.cors_origin.empty()) {
            res.set_header("Access-Control-Allow-Origin", opt_.cors_origin);
            res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
            res.set_header("Access-Control-Allow-Headers",
                           req.has_header("Access-Control-Request-Headers")
                               ? req.get_header_value("Access-Control-Request-Headers")
                               : "Authorization, Content-Type, X-Api-Key, Anthropic-Version");
            res.set_header("Access-Control-Max-Age", "86400");
        }
        if (req.method == "OPTIONS") {
            res.status = 204;
            return httplib::Server::HandlerResponse::Handled;
        }
        if (!opt_.api_key.empty() && req.path != "/health") {
            std::string key = req.get_header_value("x-api-key");
            const std::string auth = req.get_header_value("Authorization");
            if (auth.rfind("Bearer ", 0) == 0) key = auth.substr(7);
            if (!constant_time_equal(key, opt_.api_key)) {
                reply_error(res, style_of(req.path),
                            ApiError(401, "invalid or missing API key (Authorization: Bearer KEY or x-api-key: KEY)",
                                     api::default_error_type(style_of(req.path), 401), {}, "invalid_api_key"));
                return httplib::Server::HandlerResponse::Handled;
            }
        }
        return httplib::Server::HandlerResponse::Unhandled;
    });
    svr_.set_error_handler(
        httplib::Server::HandlerWithResponse([this](const httplib::Request & req, httplib::Response & res) {
            if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
            const Style style = style_of(req.path);
            std::string message = res.status == 404   ? fmt::format("no route for {} {}", req.method, req.path)
                                  : res.status == 413 ? fmt::format("the request body exceeds {} MiB", opt_.max_body_mb)
                                                      : fmt::format("HTTP {}", res.status);
            res.set_content(api::error_body(style, res.status, message), "application/json");
            return httplib::Server::HandlerResponse::Handled;
        }));
    svr_.set_exception_handler([this](const httplib::Request & req, httplib::Response & res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
            std::rethrow_exception(ep);
        } catch (const std::exception & e) {
            what = e.what();
        } catch (...) {
        }
        log_error("{} {}: {}", req.method, req.path, what);
        reply_error(res, style_of(req.path), ApiError(500, what, "server_error"));
    });
    svr_.set_logger([this](const httplib::Request & req, const httplib::Response & res) {
        std::lock_guard<std::mutex> lock(metrics_mutex_);
        const bool known =
            req.path == "/health" || req.path == "/props" || req.path == "/metrics" || req.path.rfind("/v1/", 0) == 0;
        ++http_requests_[{known ? req.path : std::string("other"), res.status}];
        if (res.status >= 400 && res.status != 499) log_info("{} {} {}", req.method, req.path, res.status);
    });

    svr_.Get("/health", [this](const httplib::Request &, httplib::Response & res) {
        const State s = state_.load();
        if (s == State::ready) {
            res.set_content(R"({"status":"ok"})", "application/json");
            return;
        }
        res.status = 503;
        const char * status = s == State::loading ? "loading" : s == State::failed ? "failed" : "shutting_down";
        res.set_content(dump({{"status", status},
                              {"progress", progress_.load()},
                              {"loaded_bytes", loaded_bytes_.load()},
                              {"load_gb_per_s", load_gb_per_s_.load()}}),
                        "application/json");
    });
    svr_.Get("/metrics", [this](const httplib::Request &, httplib::Response & res) {
        res.set_content(metrics(), "text/plain; version=0.0.4");
    });
    svr_.Get("/props", [this](const httplib::Request &, httplib::Response & res) {
        if (ready(res, Style::openai)) res.set_content(dump(props()), "application/json");
    });
    svr_.Get("/v1/models", [this](const httplib::Request &, httplib::Response & res) {
        if (!ready(res, Style::openai)) return;
        const ojson e = model_entry();
        res.set_content(dump({{"object", "list"},
                              {"data", ojson::array({e})},
                              {"has_more", false},
                              {"first_id", e["id"]},
                              {"last_id", e["id"]}}),
                        "application/json");
    });
    svr_.Get(R"(/v1/models/(.+))", [this](const httplib::Request & req, httplib::Response & res) {
        if (!ready(res, Style::openai)) return;
        if (req.matches[1] != info_.model_id) {
            reply_error(res, Style::openai,
                        ApiError(404,
                                 fmt::format("no model '{}' (this server has '{}')", std::string(req.matches[1]),
                                             info_.model_id),
                                 "invalid_request_error", {}, "model_not_found"));
            return;
        }
        res.set_content(dump(model_entry()), "application/json");
    });
    svr_.Post("/v1/chat/completions",
              [this](const httplib::Request & req, httplib::Response & res) { generate(req, res, Endpoint::chat); });
    svr_.Post("/v1/completions", [this](const httplib::Request & req, httplib::Response & res) {
        generate(req, res, Endpoint::completion);
    });
    svr_.Post("/v1/messages", [this](const httplib::Request & req, httplib::Response & res) {
        generate(req, res, Endpoint::messages);
    });
    svr_.Post("/v1/responses", [this](const httplib::Request & req, httplib::Response & res) {
        generate(req, res, Endpoint::responses);
    });
    svr_.Post("/v1/messages/count_tokens", [this](const httplib::Request & req, httplib::Response & res) {
        if (!ready(res, Style::anthropic)) return;
        try {
            ChatRequest r = api::parse_anthropic_count_tokens(req.body);
            r.prompt.version = parse_chat_template_version(engine_->info().chat_template);
            r.prompt.context_length = info_.n_ctx;
            tools_.fill(r.prompt);
            const size_t n = engine_->tokenizer()->encode_pieces(render_chat(r.prompt)).size();
            res.set_content(dump({{"input_tokens", n}}), "application/json");
        } catch (const ApiError & e) {
            reply_error(res, Style::anthropic, e);
        }
    });
}

int HttpServer::run() {
    svr_.new_task_queue = [n = std::max(opt_.http_threads, 4)] { return new httplib::ThreadPool(size_t(n)); };
    svr_.set_payload_max_length(size_t(std::max<int64_t>(opt_.max_body_mb, 1)) << 20);
    svr_.set_read_timeout(opt_.io_timeout_s, 0);
    svr_.set_write_timeout(opt_.io_timeout_s, 0);
    svr_.set_keep_alive_max_count(1000);
    // Short: an idle keep-alive connection holds a worker thread, and shutdown waits for it.
    svr_.set_keep_alive_timeout(2);
    svr_.set_tcp_nodelay(true);
    routes();
    // Port 0: any free port (tests); the log line names it.
    const int port =
        opt_.port == 0 ? svr_.bind_to_any_port(opt_.host) : (svr_.bind_to_port(opt_.host, opt_.port) ? opt_.port : -1);
    if (port <= 0) {
        log_error("cannot listen on {}:{} (address in use, or not an address of this machine)", opt_.host, opt_.port);
        return 1;
    }
    log_info("listening on http://{}:{} (loading {})", opt_.host, port, opt_.engine.model_path);
    loader_ = std::thread([this] { load(); });
    svr_.listen_after_bind();
    listen_returned_.store(true);
    // listen returns after stop() once every connection's worker has finished; the shutdown thread may still be
    // saving the KV state.
    request_shutdown();
    shutdown_.join();
    log_info("stopped");
    return exit_code_.load();
}

}  // namespace

namespace {
volatile sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }
}  // namespace

int run_server(const ServerOptions & options) {
    // Signals go to one thread that asks the server to stop; every other thread (httplib's workers, the inference
    // thread) inherits the blocked mask. A thread we did not create may not have it (the CUDA driver starts its
    // own), so the signals also get a handler that only records them: with the default action, SIGTERM arriving
    // on such a thread would kill the process instead of shutting it down. The handler also replaces SIG_IGN, with
    // which a shell starts background jobs for SIGINT (an ignored signal is never delivered, not even to sigwait).
    struct sigaction stop_action = {};
    stop_action.sa_handler = on_stop_signal;
    sigemptyset(&stop_action.sa_mask);
    stop_action.sa_flags = SA_RESTART;  // the interrupted thread's system call resumes
    ::sigaction(SIGINT, &stop_action, nullptr);
    ::sigaction(SIGTERM, &stop_action, nullptr);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    ::signal(SIGPIPE, SIG_IGN);

    HttpServer server(options);
    std::atomic<bool> done{false};
    std::thread signals([&] {
        while (!done.load()) {
            timespec timeout{0, 200 * 1000 * 1000};
            int sig = sigtimedwait(&set, nullptr, &timeout);
            if (sig != SIGINT && sig != SIGTERM && g_stop_signal) {
                sig = g_stop_signal;
                g_stop_signal = 0;
            }
            if (sig == SIGINT || sig == SIGTERM) {
                log_info("received {}", sig == SIGINT ? "SIGINT" : "SIGTERM");
                server.request_shutdown();
            }
        }
    });
    const int code = server.run();
    done.store(true);
    signals.join();
    return code;
}

}  // namespace dsv4
