// dsv4-bench: prefill and decode speed of one model against context length, time to first token, concurrent
// streams, memory and the fraction of the weight-bandwidth roofline decode reaches.
//
// It loads the model once and walks a fixed text (bench/data/pride-and-prejudice.txt, repeated as needed) to
// growing context frontiers with incremental prefill. At each frontier it snapshots the session, decodes
// --gen-tokens greedy tokens, and restores the snapshot, so the next interval continues from the text. CSV goes
// to stdout (one row per measurement, with the median and spread over --repeat runs), a readable table to stderr.
#include "dsv4/engine.h"
#include "format/gguf.h"
#include "model/config.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"
#include "util/timer.h"

#include <CLI/CLI.hpp>

#include <sys/resource.h>
#include <algorithm>
#include <cstdio>
#include <map>

namespace {

using namespace dsv4;

struct Sample {
    std::vector<double> values;
    void add(double v) { values.push_back(v); }
    double median() const {
        std::vector<double> v = values;
        std::sort(v.begin(), v.end());
        return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    }
    double min() const { return values.empty() ? 0 : *std::min_element(values.begin(), values.end()); }
    double max() const { return values.empty() ? 0 : *std::max_element(values.begin(), values.end()); }
};

// Weight bytes one decoded token reads: every tensor of every layer once, except routed experts, of which only
// the k used of E are read; one embedding row; the whole LM head.
double decode_bytes_per_token(const GgufFile & f) {
    const ModelConfig c = load_config(f);
    double bytes = 0;
    for (const GgufTensorInfo & t : f.tensors()) {
        const std::string & n = t.name;
        if (n == "token_embd.weight") {
            bytes += double(t.n_bytes) / double(t.ne[1]);
        } else if (n.find("_exps.weight") != std::string::npos) {
            bytes += double(t.n_bytes) * double(c.n_expert_used) / double(c.n_expert);
        } else if (n.find("tid2eid") != std::string::npos) {
            bytes += double(t.n_bytes) / double(t.ne[1]);
        } else if (n.rfind("blk.", 0) == 0) {
            const int64_t layer = std::stoll(n.substr(4));
            if (layer < c.n_layer) bytes += double(t.n_bytes);  // an in-file MTP block is not run per token
        } else {
            bytes += double(t.n_bytes);
        }
    }
    return bytes;
}

// The greedy next token, drawn as the server draws (Session::sample: on a GPU from the device's candidates).
int32_t next_token(Session & s) {
    SamplingParams p;
    p.greedy = true;
    p.seed = 0;
    Sampler greedy(p);
    return s.sample(greedy).id;
}

// Greedy decode of n tokens; returns seconds.
double decode(Session & s, int64_t n) {
    Timer t;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t next = next_token(s);
        s.eval(std::span<const int32_t>(&next, 1));
    }
    return t.seconds();
}

long peak_rss_mb() {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024;
}

}  // namespace

int main(int argc, char ** argv) {
    EngineOptions eo;
    std::string text_path = DSV4_BENCH_TEXT;
    int64_t ctx_max = 8192, first_frontier = 2048, gen_tokens = 32, ttft_prompt = 2048;
    int repeat = 1;
    double peak_gbps = -1;
    std::vector<int> streams = {1, 2, 4, 8};
    bool no_streams = false;
    CLI::App app{"dsv4-bench: prefill and decode speed against context"};
    app.add_option("-m,--model", eo.model_path, "model GGUF (must carry a tokenizer)")->required();
    app.add_option("--backend", eo.backend, "cpu, cuda or auto");
    app.add_option("--gpu", eo.gpu, "CUDA device");
    app.add_option("-t,--threads", eo.n_threads, "CPU threads");
    app.add_option("--ubatch", eo.n_ubatch,
                   "prefill chunk (default: dsv4's and dsv4-server's choice for the largest context measured: on a "
                   "GPU 16384 or 8192 where it fits, else 2048; 256 on the CPU)");
    app.add_option("--numerics", eo.numerics, "official or reference");
    app.add_option("--ctx-max", ctx_max, "last context frontier (default 8192)");
    app.add_option("--first", first_frontier, "first frontier; later ones double (default 2048)");
    app.add_option("--gen-tokens", gen_tokens, "greedy tokens decoded at each frontier (default 32)");
    app.add_option("--ttft-prompt", ttft_prompt, "prompt length for time-to-first-token (default 2048)");
    app.add_option("--streams", streams, "concurrent decode streams to measure (default 1 2 4 8)");
    app.add_flag("--no-streams", no_streams, "skip the concurrent-stream measurement");
    app.add_option("--repeat", repeat, "repetitions; the CSV reports median, min and max")->check(CLI::Range(1, 100));
    app.add_option("--text", text_path, "text to walk (default: the committed book)");
    app.add_option("--peak-gbps", peak_gbps,
                   "memory bandwidth (GB/s) of the roofline; default 4300 (H200) on cuda, none on cpu");
    CLI11_PARSE(app, argc, argv);
    try {
        const GgufFile file = GgufFile::open(eo.model_path);
        const double token_bytes = decode_bytes_per_token(file);
        // Unless told, prefill in the chunks that dsv4 and dsv4-server take for this context (their memory plan picks
        // the larger GPU chunks where the context still fits), so that the figures are what those tools give.
        if (eo.n_ubatch == 0)
            eo.n_ubatch = Engine::plan(eo, std::max(ctx_max + gen_tokens + 1, ttft_prompt + 8)).n_ubatch;
        auto engine = Engine::open(eo);
        const ModelInfo & info = engine->info();
        const Tokenizer * tok = engine->tokenizer();
        DSV4_CHECK(tok, "{}: the model carries no tokenizer (make synthetic models with dsv4-synth --vocab)",
                   eo.model_path);
        const std::string text = read_file(text_path);
        std::vector<int32_t> ids = tok->encode(text, false);
        DSV4_CHECK(!ids.empty(), "{}: no tokens", text_path);
        const size_t book = ids.size();
        while (int64_t(ids.size()) < std::max(ctx_max, ttft_prompt) + 1)
            ids.insert(ids.end(), ids.begin(), ids.begin() + book);

        std::vector<int64_t> frontiers;
        for (int64_t f = first_frontier; f < ctx_max; f *= 2) frontiers.push_back(f);
        frontiers.push_back(ctx_max);

        std::printf(
            "model,backend,measure,context,tokens,seconds_median,tokens_per_s_median,tokens_per_s_min,"
            "tokens_per_s_max,kv_bytes,roofline_fraction\n");
        // Names go into CSV fields: commas and quotes become semicolons so every row has exactly 11 fields.
        auto field = [](std::string v) {
            std::replace_if(
                v.begin(), v.end(), [](char ch) { return ch == ',' || ch == '"'; }, ';');
            return v;
        };
        const std::string model_field = field(info.name), backend_field = field(info.backend);
        auto csv = [&](const char * what, int64_t ctx, int64_t n, const Sample & secs, double roofline) {
            Sample rate;
            for (double s : secs.values) rate.add(double(n) / s);
            std::printf("%s,%s,%s,%ld,%ld,%.4f,%.2f,%.2f,%.2f,%lu,%.4f\n", model_field.c_str(), backend_field.c_str(),
                        what, ctx, n, secs.median(), rate.median(), rate.min(), rate.max(),
                        (unsigned long)engine->session_bytes(ctx), roofline);
            std::fflush(stdout);
            std::fprintf(stderr, "  %-8s ctx %7ld  %6ld tokens  %9.2f tok/s  (%.2f-%.2f)%s\n", what, ctx, n,
                         rate.median(), rate.min(), rate.max(),
                         roofline > 0 ? fmt::format("  {:.1f} % of roofline", 100 * roofline).c_str() : "");
        };
        if (peak_gbps < 0) peak_gbps = info.backend.rfind("cuda", 0) == 0 ? 4300 : 0;
        std::fprintf(stderr, "%s: %s, %.2f GB read per decoded token, prefill chunks of %ld tokens\n",
                     info.path.c_str(), info.backend.c_str(), token_bytes / 1e9, long(eo.n_ubatch));

        // The process's first prefill and decode pay one-time costs (GPU kernels load at their first launch,
        // scratch grows to the chunk's size); an untimed pass over the first frontier takes them, as llama-bench's
        // warm-up run does.
        {
            Timer t;
            auto s = engine->new_session(frontiers.front() + 4);
            s->eval(std::span<const int32_t>(ids).first(size_t(frontiers.front())));
            decode(*s, 2);
            std::fprintf(stderr, "  warm-up: %ld-token prefill and 2 tokens in %.2f s (not counted)\n",
                         long(frontiers.front()), t.seconds());
        }

        // Prefill intervals and decode at each frontier.
        std::map<int64_t, Sample> prefill_s, decode_s;
        for (int r = 0; r < repeat; ++r) {
            auto s = engine->new_session(ctx_max + gen_tokens + 1);
            int64_t done = 0;
            for (int64_t f : frontiers) {
                Timer t;
                s->eval(std::span<const int32_t>(ids).subspan(size_t(done), size_t(f - done)));
                prefill_s[f].add(t.seconds());
                done = f;
                const std::string snap = s->snapshot();
                // Two untimed steps first: a GPU runs a state's first decode step at a context bound eagerly and
                // captures the second into a graph, one-time costs of a session that the timed steps would
                // otherwise carry.
                decode(*s, 2);
                s->restore(snap);
                decode_s[f].add(decode(*s, gen_tokens));
                s->restore(snap);
            }
        }
        int64_t prev = 0;
        for (int64_t f : frontiers) {
            csv("prefill", f, f - prev, prefill_s[f], 0);
            Sample d = decode_s[f];
            const double rate = double(gen_tokens) / d.median();
            csv("decode", f, gen_tokens, d, peak_gbps > 0 ? rate * token_bytes / (peak_gbps * 1e9) : 0);
            prev = f;
        }

        // Time to first token: cold (empty session) and warm (the prompt's prefix is already in a live session).
        Sample cold, warm;
        const std::span<const int32_t> prompt = std::span<const int32_t>(ids).first(size_t(ttft_prompt));
        for (int r = 0; r < repeat; ++r) {
            auto s = engine->new_session(ttft_prompt + 8);
            Timer t;
            s->eval(prompt);
            next_token(*s);
            cold.add(t.seconds());
            auto w = engine->new_session(ttft_prompt + 8);
            w->eval(prompt.first(prompt.size() - 16));
            Timer tw;
            w->sync(prompt);
            next_token(*w);
            warm.add(tw.seconds());
        }
        csv("ttft_cold", ttft_prompt, ttft_prompt, cold, 0);
        csv("ttft_warm", ttft_prompt, 16, warm, 0);

        // Concurrent streams: every round, each session draws its next token and one Engine::decode_batch step
        // evaluates them all (one pass that reads the weights once where the backend batches, else the sessions one
        // after another).
        if (!no_streams)
            for (int n : streams) {
                Sample agg;
                for (int r = 0; r < repeat; ++r) {
                    std::vector<std::unique_ptr<Session>> ss;
                    std::vector<Session *> step;
                    for (int i = 0; i < n; ++i) {
                        ss.push_back(engine->new_session(first_frontier + gen_tokens + 1));
                        ss.back()->eval(std::span<const int32_t>(ids).subspan(size_t(i), size_t(first_frontier)));
                        step.push_back(ss.back().get());
                    }
                    std::vector<int32_t> next(static_cast<size_t>(n));
                    Timer t;
                    for (int64_t k = 0; k < gen_tokens; ++k) {
                        for (int i = 0; i < n; ++i) next[size_t(i)] = next_token(*ss[size_t(i)]);
                        engine->decode_batch(step, next);
                    }
                    agg.add(t.seconds());
                }
                // Aggregate tokens/s over all streams (the CSV row); per stream it is this divided by the count.
                csv(fmt::format("streams_{}", n).c_str(), first_frontier, gen_tokens * n, agg, 0);
                std::fprintf(stderr, "           %ld streams: %.2f tok/s per stream (%s)\n", long(n),
                             double(gen_tokens * n) / agg.median() / double(n),
                             engine->batched_decode() ? "batched steps" : "one session after another");
            }
        // Device memory: what the backend held at most (0 on the CPU backend).
        const long peak_device_mb = long(engine->peak_device_bytes() >> 20);
        std::fprintf(stderr, "peak host memory: %ld MB, peak device memory: %ld MB\n", peak_rss_mb(), peak_device_mb);
        std::printf("%s,%s,peak_host_mb,0,0,0,%ld,0,0,0,0\n", model_field.c_str(), backend_field.c_str(),
                    peak_rss_mb());
        std::printf("%s,%s,peak_device_mb,0,0,0,%ld,0,0,0,0\n", model_field.c_str(), backend_field.c_str(),
                    peak_device_mb);
        return 0;
    } catch (const Error & e) {
        log_error("{}", e.what());
        return 1;
    }
}
