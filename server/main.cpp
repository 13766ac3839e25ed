// dsv4-server: command-line options → ServerOptions (server.h). docs/server.md documents every flag.
#include "dsv4/engine.h"
#include "server/server.h"
#include "util/error.h"
#include "util/log.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>

int main(int argc, char ** argv) {
    using namespace dsv4;
    ServerOptions o;
    std::string ctx = std::to_string(o.n_ctx);
    std::string cors;
    bool cors_flag = false;
    std::string log_level;
    CLI::App app{"dsv4-server: OpenAI- and Anthropic-compatible server for DeepSeek V4 Flash"};
    app.add_option("-m,--model", o.engine.model_path, "model GGUF")->required();
    app.add_option("--mtp", o.engine.mtp_path, "ds4's separate MTP GGUF (loaded; no decode path uses it yet)");
    app.add_option("--host", o.host, "address to listen on (default 127.0.0.1: this machine only)");
    app.add_option("--port", o.port, "port (default 8000)")->check(CLI::Range(0, 65535));
    app.add_option("-c,--ctx", ctx, "context length per session, or 'auto' (the memory plan); default 32768");
    app.add_option("--sessions", o.sessions, "requests that run at once, each with its live KV session (default 2)")
        ->check(CLI::Range(1, 64));
    app.add_option("-t,--threads", o.engine.n_threads, "CPU threads (default: all)");
    app.add_option("--ubatch", o.engine.n_ubatch,
                   "prefill chunk (default on a GPU 16384 or 8192 when the context fits with it, else 2048; 256 on "
                   "the CPU)")
        ->check(CLI::Range(1, 1 << 20));
    app.add_option("--numerics", o.engine.numerics, "official (DeepSeek's KV/indexer rounding) or reference");
    app.add_option("--backend", o.engine.backend, "cpu, cuda or auto (cuda when a GPU is present)");
    app.add_option("--gpu", o.engine.gpu, "CUDA device index");
    app.add_option("--alias", o.model_id, "model id in /v1/models and responses");
    app.add_option("-n,--max-tokens", o.max_output, "default and largest reply length (default: the context's room)")
        ->check(CLI::Range(int64_t(0), int64_t(1) << 31));
    app.add_option("--api-key", o.api_key, "require this key (Authorization: Bearer or x-api-key); also DSV4_API_KEY");
    app.add_flag("--cors", cors_flag, "allow browsers from any origin (Access-Control-Allow-Origin: *)");
    app.add_option("--cors-origin", cors, "allow browsers from this origin only");
    app.add_option("--kv-disk-dir", o.kv_disk_dir, "keep KV snapshots in this folder (disk KV cache)");
    app.add_option("--kv-disk-space-mb", o.kv_disk_space_mb, "disk KV cache budget in MiB (default 4096)")
        ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
    app.add_option("--kv-cache-min-tokens", o.kv_cache_min_tokens, "smallest state worth a snapshot (default 512)");
    app.add_option("--kv-cache-interval", o.kv_cache_interval,
                   "snapshot every N tokens of a long prefill or generation (default 10240, 0: never)");
    app.add_option("--prefill-slice-ms", o.prefill_slice_ms,
                   "while other requests decode, prefill a prompt in slices of about this long (default 500, 0: "
                   "whole --ubatch chunks)")
        ->check(CLI::Range(0, 3600000));
    app.add_option("--http-threads", o.http_threads, "HTTP worker threads = open connections served (default 64)")
        ->check(CLI::Range(4, 4096));
    app.add_option("--max-body-mb", o.max_body_mb, "largest request body (default 64)")->check(CLI::Range(1, 4096));
    app.add_option("--sse-keepalive", o.sse_keepalive_s, "seconds between keepalive comments of a silent stream (5)")
        ->check(CLI::Range(0.05, 3600.0));
    app.add_option("--shutdown-grace", o.shutdown_grace_s,
                   "seconds running generations may continue after SIGTERM (default 10)")
        ->check(CLI::Range(0.0, 86400.0));
    app.add_option("--timeout", o.io_timeout_s, "socket read/write timeout in seconds (default 60)")
        ->check(CLI::Range(1, 86400));
    app.add_option("--log-level", log_level, "error, warn, info (default) or debug");
#ifdef DSV4_TEST_HOOKS
    app.add_option("--test-load-delay-ms", o.test_load_delay_ms, "test builds: stay in the loading state this long");
#endif
    app.set_version_flag("--version", version_string(), "print version, commit and backends");
    CLI11_PARSE(app, argc, argv);
    if (!log_level.empty()) {
        LogLevel level;
        if (!parse_log_level(log_level, &level)) {
            std::fprintf(stderr, "--log-level: unknown level '%s'\n", log_level.c_str());
            return 2;
        }
        set_log_level(level);
    }
    if (ctx == "auto") {
        o.n_ctx = 0;
    } else {
        char * end = nullptr;
        o.n_ctx = std::strtoll(ctx.c_str(), &end, 10);
        if (end == ctx.c_str() || *end || o.n_ctx < 16) {
            std::fprintf(stderr, "--ctx: expected a number of tokens (>= 16) or 'auto', got '%s'\n", ctx.c_str());
            return 2;
        }
    }
    if (o.api_key.empty())
        if (const char * key = std::getenv("DSV4_API_KEY")) o.api_key = key;
    o.cors_origin = !cors.empty() ? cors : cors_flag ? "*" : "";
    return run_server(o);
}
