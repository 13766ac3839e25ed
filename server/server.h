// dsv4-server: OpenAI (chat completions, completions, Responses) and Anthropic (messages) compatible HTTP server on
// one model. docs/server.md is the user's page; this header is what main() needs.
//
// Threads: cpp-httplib's worker pool (one per open connection; a streaming request holds its worker until it ends),
// the scheduler's inference thread (scheduler.h), a loader thread while the model loads (GET /health answers 503
// with the progress meanwhile) and a signal thread. SIGINT/SIGTERM: stop accepting, give running generations
// `shutdown_grace` seconds to finish, end the others with a proper error event, save the live KV state to the disk
// cache, exit 0.
#pragma once

#include "dsv4/engine.h"

#include <cstdint>
#include <string>

namespace dsv4 {

struct ServerOptions {
    EngineOptions engine;
    std::string host = "127.0.0.1";
    int port = 8000;
    int64_t n_ctx = 32768;    // 0: the largest the memory plan allows (Engine::plan)
    int sessions = 2;         // live KV timelines
    std::string model_id;     // what /v1/models lists; default from the model
    int64_t max_output = 0;   // default and cap of a reply (0: whatever the context leaves)
    std::string api_key;      // required on every route but /health when set
    std::string cors_origin;  // Access-Control-Allow-Origin when set
    std::string kv_disk_dir;
    int64_t kv_disk_space_mb = 4096;
    int64_t kv_cache_min_tokens = 512;
    int64_t kv_cache_interval = 10240;
    int prefill_slice_ms = 500;  // SchedulerOptions::prefill_slice_seconds
    int http_threads = 64;
    int64_t max_body_mb = 64;
    double sse_keepalive_s = 5;  // comment lines while a stream has nothing to say (long prefills)
    double shutdown_grace_s = 10;
    int io_timeout_s = 60;       // socket read/write timeout
    int test_load_delay_ms = 0;  // DSV4_TEST_HOOKS builds: hold the loading state this long (tests /health)
};

// Binds, loads the model in the background, serves until SIGINT/SIGTERM. Returns the process exit code: 0 after a
// clean shutdown, 1 when the port cannot be bound or the model cannot be loaded.
int run_server(const ServerOptions & options);

}  // namespace dsv4
