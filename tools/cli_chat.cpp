// `dsv4 -m MODEL [-p TEXT | --prompt-file FILE]`: chat with the model from a terminal. With a prompt it answers once
// and exits; without, it reads one user message per line (interactive, or piped) and keeps the conversation, whose
// KV state the scheduler extends turn by turn (the same reuse as the server's). Commands: /think, /nothink,
// /think-max, /ctx N, /read FILE, /clear, /help, /quit. Ctrl+C stops the reply being generated, not the program.
//
// The answer goes to stdout, reasoning and everything else (progress, speed, warnings) to stderr, dimmed on a
// terminal, so `dsv4 -m M -p "…" > answer.txt` keeps just the answer.
#include "dsv4/engine.h"
#include "engine/scheduler.h"
#include "text/chat.h"
#include "text/dsml.h"
#include "tools/cli.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"
#include "util/timer.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <iostream>

namespace dsv4::cli {

namespace {

std::atomic<bool> g_interrupted{false};
void on_sigint(int) { g_interrupted.store(true); }

constexpr int64_t kDefaultContext = 32768;

class Chat {
  public:
    explicit Chat(const Options & opts) : opts_(opts), engine_(open_engine(opts)) {
        DSV4_CHECK(engine_->tokenizer(), "{}: the model file has no tokenizer; chat needs one", opts.model);
        version_ = parse_chat_template_version(engine_->info().chat_template);
        set_ctx(opts.ctx > 0 ? opts.ctx : kDefaultContext);
        set_think(opts.think);
        color_ = isatty(2);
    }

    // Refuses a context that cannot fit before loading gigabytes of weights; on a terminal, shows the load.
    static std::unique_ptr<Engine> open_engine(const Options & opts) {
        EngineOptions options = engine_options(opts);
        const MemoryPlan plan = Engine::plan(options, opts.ctx > 0 ? opts.ctx : kDefaultContext);
        plan.require_fit();
        options.n_ubatch = plan.n_ubatch;  // the plan's chunk size (it may pick the larger GPU chunk)
        int shown = -1;
        const bool tty = isatty(2);
        auto engine = Engine::open(options, [&](const LoadProgress & p) {
            const int percent = int(100 * p.fraction());
            if (!tty || percent == shown) return;
            shown = percent;
            std::fprintf(stderr, "\rloading %s: %3d%% (%.1f of %.1f GB, %.2f GB/s)", opts.model.c_str(), percent,
                         double(p.bytes_done) / 1e9, double(p.bytes_total) / 1e9, p.gb_per_s());
        });
        if (tty) std::fputc('\n', stderr);
        return engine;
    }

    void banner() const {
        const ModelInfo & mi = engine_->info();
        note(fmt::format("dsv4 chat: {} ({}), context {}, {}", mi.name, mi.backend, n_ctx_, think_name()));
        if (mi.random_weights)
            note(
                "this model has RANDOM WEIGHTS (dsv4-synth): the replies are gibberish; see "
                "./scripts/download-model.sh");
        note("commands: /think /nothink /think-max /ctx N /read FILE /clear /help /quit; Ctrl+C stops a reply");
    }

    void set_ctx(int64_t n) {
        DSV4_CHECK(n >= 16, "/ctx: {} is too small", n);
        scheduler_.reset();  // frees the old sessions first
        SchedulerOptions so;
        so.n_ctx = n;
        so.n_sessions = 1;
        scheduler_ = std::make_unique<Scheduler>(*engine_, so);
        n_ctx_ = n;
    }

    void set_think(const std::string & mode) {
        think_ = mode;
        if (mode == "max" && n_ctx_ < kThinkMaxMinContext)
            note(fmt::format("Think Max needs a context of {} tokens (now {}): replies use high effort until /ctx {}",
                             kThinkMaxMinContext, n_ctx_, kThinkMaxMinContext));
    }

    void clear() {
        messages_.clear();
        note("new conversation");
    }

    // One exchange: the user's message, the streamed reply. Returns false when it failed (the message is dropped).
    bool turn(const std::string & user) {
        ChatPrompt prompt;
        if (!opts_.system.empty()) {
            ChatMessage sys;
            sys.role = ChatRole::system;
            sys.content = opts_.system;
            prompt.messages.push_back(std::move(sys));
        }
        prompt.messages.insert(prompt.messages.end(), messages_.begin(), messages_.end());
        ChatMessage user_message;
        user_message.role = ChatRole::user;
        user_message.content = user;
        prompt.messages.push_back(user_message);
        prompt.thinking = think_ == "none" ? ThinkingMode::chat : ThinkingMode::thinking;
        prompt.effort = think_ == "max" ? ReasoningEffort::max : ReasoningEffort::high;
        prompt.version = version_;
        prompt.context_length = n_ctx_;

        const Tokenizer & tok = *engine_->tokenizer();
        GenerationRequest g;
        g.pieces = render_chat(prompt);
        g.prompt = tok.encode_pieces(g.pieces);
        if (int64_t(g.prompt.size()) >= n_ctx_) {
            note(fmt::format("the conversation is {} tokens; the context holds {}: /ctx N for a larger one, or /clear",
                             g.prompt.size(), n_ctx_));
            return false;
        }
        const bool thinking = !g.pieces.empty() && g.pieces.back().special && g.pieces.back().text == kThinkStartText;
        const int32_t assistant = tok.token_id(kAssistantText);
        for (size_t i = g.prompt.size(); i-- > 0;)
            if (g.prompt[i] == assistant) {
                g.cache_cut = int64_t(i + 1);
                break;
            }
        if (thinking) g.visible_alias = dropped_reasoning_alias(pieces_text(g.pieces));
        g.sampling.temperature = opts_.temperature;
        g.sampling.top_p = opts_.top_p;
        g.sampling.top_k = opts_.top_k;
        g.sampling.min_p = opts_.min_p;
        if (opts_.seed >= 0) g.sampling.seed = uint64_t(opts_.seed);
        g.max_tokens = opts_.max_tokens > 0 ? opts_.max_tokens : n_ctx_;

        std::shared_ptr<GenerationJob> job = scheduler_->submit(std::move(g));
        DsmlStreamParser parser(thinking);
        ChatMessage reply;
        reply.role = ChatRole::assistant;
        bool in_reasoning = false, progress_shown = false, stopped = false;
        auto show = [&](const std::vector<DsmlEvent> & events) {
            for (const DsmlEvent & e : events) {
                if (e.kind == DsmlEvent::Kind::reasoning) {
                    if (!in_reasoning) std::fputs(color_ ? "\033[2m" : "[thinking] ", stderr);
                    in_reasoning = true;
                    std::fputs(e.text.c_str(), stderr);
                    reply.reasoning += e.text;
                    continue;
                }
                if (in_reasoning) {
                    std::fputs(color_ ? "\033[0m\n" : "\n[/thinking]\n", stderr);
                    in_reasoning = false;
                }
                if (e.kind == DsmlEvent::Kind::content) {
                    std::fputs(e.text.c_str(), stdout);
                    std::fflush(stdout);
                    reply.content += e.text;
                } else if (e.kind == DsmlEvent::Kind::tool_call_end) {
                    std::fprintf(stdout, "\n[tool call %s %s]\n", e.call.name.c_str(), e.call.arguments.c_str());
                    reply.tool_calls.push_back(e.call);
                }
            }
        };
        GenerationUpdate last;
        for (;;) {
            GenerationUpdate u = job->wait(0.1);
            if (g_interrupted.exchange(false)) {
                job->cancel();
                stopped = true;
            }
            if (u.prefill_total > 256 && u.tokens.empty() && !u.finished && isatty(2)) {
                std::fprintf(stderr, "\rprefill %lld/%lld (%.0f%%)", (long long)u.prefill_done,
                             (long long)u.prefill_total, 100.0 * double(u.prefill_done) / double(u.prefill_total));
                progress_shown = true;
            }
            if (progress_shown && (!u.tokens.empty() || u.finished)) {
                std::fputs("\r\033[K", stderr);
                progress_shown = false;
            }
            for (const GeneratedToken & t : u.tokens) show(parser.feed(t.text));
            show(parser.feed(u.tail));
            if (u.finished) {
                if (u.finish != FinishReason::cancelled && u.finish != FinishReason::error) show(parser.finish());
                last = std::move(u);
                break;
            }
        }
        if (in_reasoning) std::fputs(color_ ? "\033[0m" : "\n[/thinking]", stderr);
        std::fputc('\n', stdout);
        std::fflush(stdout);
        if (last.finish == FinishReason::error) {
            note("generation failed: " + last.error);
            return false;
        }
        const GenerationUsage & us = last.usage;
        const int64_t prefilled = us.prompt_tokens - us.cached_tokens;
        note(fmt::format(
            "{}prefill: {} tokens ({} reused) in {:.2f} s, {:.1f} t/s; decode: {} tokens in {:.2f} s, "
            "{:.1f} t/s{}",
            stopped ? "[stopped] " : "", us.prompt_tokens, us.cached_tokens, us.prefill_seconds,
            us.prefill_seconds > 0 ? double(prefilled) / us.prefill_seconds : 0.0, us.completion_tokens,
            us.decode_seconds, us.decode_seconds > 0 ? double(us.completion_tokens) / us.decode_seconds : 0.0,
            last.finish == FinishReason::length ? " (length limit)" : ""));
        messages_.push_back(std::move(user_message));
        messages_.push_back(std::move(reply));
        return true;
    }

    void note(const std::string & text) const {
        std::fprintf(stderr, "%s%s%s\n", color_ ? "\033[36m" : "", text.c_str(), color_ ? "\033[0m" : "");
    }
    std::string think_name() const {
        return think_ == "none" ? "no thinking" : think_ == "max" ? "Think Max" : "thinking";
    }

  private:
    const Options & opts_;
    std::unique_ptr<Engine> engine_;
    std::unique_ptr<Scheduler> scheduler_;
    ChatTemplateVersion version_ = ChatTemplateVersion::v4;
    std::vector<ChatMessage> messages_;  // the conversation without the system prompt
    int64_t n_ctx_ = 0;
    std::string think_ = "high";
    bool color_ = false;
};

std::string trim(std::string s) {
    const size_t a = s.find_first_not_of(" \t\r\n");
    const size_t b = s.find_last_not_of(" \t\r\n");
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

// The REPL. Returns the exit code.
int interactive(Chat & chat) {
    chat.banner();
    const bool tty = isatty(0);
    for (;;) {
        if (tty) std::fputs("> ", stderr);
        std::string line;
        errno = 0;
        if (!std::getline(std::cin, line)) {
            if (g_interrupted.exchange(false) || errno == EINTR) {
                std::cin.clear();
                std::fputc('\n', stderr);
                chat.note("(Ctrl+C stops a reply; /quit or Ctrl+D leaves)");
                continue;
            }
            break;  // end of input
        }
        line = trim(line);
        if (line.empty()) continue;
        if (line[0] != '/') {
            chat.turn(line);
            continue;
        }
        const size_t sp = line.find(' ');
        const std::string cmd = line.substr(0, sp);
        const std::string arg = sp == std::string::npos ? std::string() : trim(line.substr(sp + 1));
        try {
            if (cmd == "/quit" || cmd == "/exit") {
                break;
            } else if (cmd == "/think" || cmd == "/nothink" || cmd == "/think-max") {
                chat.set_think(cmd == "/think" ? "high" : cmd == "/nothink" ? "none" : "max");
                chat.note("mode: " + chat.think_name());
            } else if (cmd == "/ctx") {
                char * end = nullptr;
                const long long n = std::strtoll(arg.c_str(), &end, 10);
                if (arg.empty() || *end) throw Error("/ctx needs a number of tokens");
                chat.set_ctx(n);
                chat.note(fmt::format("context {} (the next reply prefills the conversation again)", n));
            } else if (cmd == "/read") {
                if (arg.empty()) throw Error("/read needs a file name");
                chat.turn(read_file(arg));
            } else if (cmd == "/clear") {
                chat.clear();
            } else if (cmd == "/help") {
                chat.note(
                    "/think, /nothink, /think-max: reasoning mode for the next replies\n"
                    "/ctx N: a new context of N tokens (keeps the conversation)\n"
                    "/read FILE: send the file's text as your message\n"
                    "/clear: start a new conversation\n"
                    "/quit: leave (Ctrl+D too); Ctrl+C stops the reply being written");
            } else {
                chat.note("unknown command " + cmd + " (/help lists them)");
            }
        } catch (const Error & e) {
            chat.note(e.what());
        }
    }
    return 0;
}

}  // namespace

int run_chat(const Options & opts) {
    DSV4_CHECK(opts.think == "none" || opts.think == "high" || opts.think == "max", "unknown thinking mode {}",
               opts.think);
    // No SA_RESTART: a Ctrl+C at the prompt interrupts the read, so the REPL can say how to leave.
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);

    Chat chat(opts);
    std::string prompt = opts.prompt;
    if (!opts.prompt_file.empty()) prompt = read_file(opts.prompt_file);
    if (!prompt.empty()) return chat.turn(prompt) ? 0 : 1;
    return interactive(chat);
}

}  // namespace dsv4::cli
