// dsv4: the command-line front end. Parses options and dispatches to the commands declared in cli.h.
#include "dsv4/engine.h"
#include "tools/cli.h"
#include "util/error.h"
#include "util/log.h"

#include <CLI/CLI.hpp>

#include <cstdio>

int main(int argc, char ** argv) {
    using namespace dsv4;
    cli::Options opts;
    CLI::App app{"dsv4: DeepSeek V4 inference engine. `dsv4 -m MODEL` chats; -p answers one prompt."};
    app.add_option("-m,--model", opts.model, "model or vocabulary GGUF");
    app.add_option("--mtp", opts.mtp, "ds4's separate MTP GGUF (loaded; no decode path uses it yet)");
    app.add_option("--backend", opts.backend, "cpu, cuda or auto (cuda when a GPU is present)");
    app.add_option("--gpu", opts.gpu, "CUDA device index");
    app.add_option("-t,--threads", opts.threads, "CPU threads (default: all)");
    app.add_option("--ubatch", opts.ubatch,
                   "prefill chunk size (1: token by token; default on a GPU 16384 or 8192 when the context fits with "
                   "it, else 2048; 256 on the CPU)")
        ->check(CLI::Range(1, 1 << 20));
    app.add_option("-c,--ctx", opts.ctx, "context length");
    app.add_flag("--plan", opts.plan, "print the memory needed for --ctx (weights, KV state, scratch) and exit");
    app.add_option("--numerics", opts.numerics, "official (DeepSeek's KV/indexer rounding) or reference (exact HF)");
    app.add_flag("--f32-activations", opts.f32_activations, "multiply quantized weights with f32 activations");
    app.add_option("--tokens-file", opts.tokens_file, "token ids to evaluate (JSON array or {\"tokens\": [...]})");
    app.add_option("--dump-logits", opts.dump_logits, "write every position's logits (f32 [n, vocab]) here");
    bool version = false;
    app.add_flag("--version", version, "print version, commit, backends and devices");
    app.add_option("--tokenize-file", opts.tokenize_file, "print the token ids of the file's text (JSON array)");
    app.add_option("--detokenize-file", opts.detokenize_file, "print the text of a JSON array of token ids");
    app.add_option("--render-chat", opts.render_chat_file, "print the rendered prompt of an OpenAI-style request");
    app.add_option("-p,--prompt", opts.prompt, "chat: answer this and exit (no prompt: interactive chat)");
    app.add_option("--prompt-file", opts.prompt_file, "chat: answer this file's text and exit");
    app.add_option("--system", opts.system, "chat: system prompt");
    app.add_option("-n,--max-tokens", opts.max_tokens, "chat: longest reply (default: the context's room)")
        ->check(CLI::Range(int64_t(0), int64_t(1) << 31));
    app.add_option("--temp", opts.temperature, "chat: temperature (default 1; 0 = greedy)");
    app.add_option("--top-p", opts.top_p, "chat: nucleus sampling (default 1)");
    app.add_option("--top-k", opts.top_k, "chat: top-k sampling (default 0 = off)");
    app.add_option("--min-p", opts.min_p, "chat: min-p sampling (default 0.05)");
    app.add_option("--seed", opts.seed, "chat: sampling seed (default: random)");
    app.add_flag_callback(
        "--think", [&] { opts.think = "high"; }, "chat: thinking mode, high effort (default)");
    app.add_flag_callback(
        "--think-max", [&] { opts.think = "max"; }, "chat: Think Max (needs --ctx >= 393216)");
    app.add_flag_callback(
        "--nothink", [&] { opts.think = "none"; }, "chat: answer without thinking");
    CLI11_PARSE(app, argc, argv);
    try {
        if (version) {
            std::printf("%s\n", version_string().c_str());
            return 0;
        }
        if (opts.plan) return cli::run_plan(opts);
        if (!opts.dump_logits.empty()) return cli::run_dump_logits(opts);
        if (!opts.tokenize_file.empty()) return cli::run_tokenize(opts);
        if (!opts.detokenize_file.empty()) return cli::run_detokenize(opts);
        if (!opts.render_chat_file.empty()) return cli::run_render_chat(opts);
        if (!opts.model.empty()) return cli::run_chat(opts);
        std::fputs(app.help().c_str(), stderr);
        return 2;
    } catch (const Error & e) {
        log_error("{}", e.what());
        return 1;
    }
}
