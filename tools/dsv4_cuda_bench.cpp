// dsv4-cuda-bench: speed of the CUDA backend (docs/cuda.md).
//   dsv4-cuda-bench MODEL [--depth 2048,32768] [--decode 64] [--ubatch 2048] [--warmup N] [--layer-checks]
//                         [--ctx N] [--indexer-branch B]                       prefill to each depth, then decode
//   dsv4-cuda-bench --kernels                                                  single ops at V4 Flash shapes
// Decode timings include the per-token host work of the engine's path: Model::eval (the token's and position's
// writes, the graph's launch) and the greedy token from the device's candidates (Model::logit_candidates).
#include "backend/cuda.h"
#include "format/gguf.h"
#include "model/forward.h"
#include "util/error.h"
#include "util/log.h"
#include "util/timer.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <set>
#include <sstream>

using namespace dsv4;

namespace {

constexpr double kRooflineBytesPerSecond = 4.3e12;  // H200, measured device-to-device copy (docs/cuda.md)

// libdsv4_ktrace.so's PM sampler (tools/dsv4_ktrace.cpp), when the library is preloaded with DSV4_PMSAMPLE set:
// it samples each depth's timed decode steps (the GPU idle at both ends); without the library nothing changes.
void pm_window(Backend & backend, int device, bool open) {
    using Hook = int (*)(int, int);
    static const Hook hook = reinterpret_cast<Hook>(dlsym(RTLD_DEFAULT, "dsv4_ktrace_pm"));
    if (!hook) return;
    backend.synchronize();
    hook(device, open ? 1 : 0);
}

// Bytes of weights one decoded token reads: every tensor except the routed experts (k of E) and the embedding
// table (one row).
double weight_bytes_per_token(const GgufFile & file, const ModelConfig & c) {
    double b = 0;
    for (const GgufTensorInfo & t : file.tensors()) {
        if (t.name.find("_exps") != std::string::npos)
            b += double(t.n_bytes) * double(c.n_expert_used) / double(c.n_expert);
        else if (t.name == "token_embd.weight")
            b += double(t.n_bytes) / double(c.n_vocab);
        else if (t.name.find("tid2eid") == std::string::npos)
            b += double(t.n_bytes);
    }
    return b;
}

// What a model run measures (the command line's options; main documents each).
struct ModelRun {
    std::string path;
    std::vector<int64_t> depths;
    int64_t n_decode = 32, n_ubatch = 2048, n_warmup = 0, n_ctx = 0;
    int64_t indexer_branch = Model::kIndexerBranchContext;
    bool layer_checks = false;
    Numerics numerics = Numerics::official;
};

int run_model(const ModelRun & run, const CudaBackendOptions & options) {
    Timer load;
    const GgufFile file = GgufFile::open(run.path);
    auto backend = make_cuda_backend(options);
    Model model(file, *backend, run.n_ubatch, run.numerics);
    model.set_indexer_branch_context(run.indexer_branch);
    backend->synchronize();
    const ModelConfig & c = model.config();
    double file_bytes = 0;
    for (const GgufTensorInfo & t : file.tensors()) file_bytes += double(t.n_bytes);
    std::printf("%s on %s: %ld layers, %.2f GB loaded in %.1f s (%.2f GB/s), %s numerics\n", run.path.c_str(),
                backend->name().c_str(), c.n_layer, file_bytes / 1e9, load.seconds(), file_bytes / 1e9 / load.seconds(),
                numerics_name(run.numerics));
    const double wb = weight_bytes_per_token(file, c);
    std::printf("weights read per decoded token: %.3f GB (roofline %.1f us at %.1f TB/s)\n", wb / 1e9,
                wb / kRooflineBytesPerSecond * 1e6, kRooflineBytesPerSecond / 1e12);
    std::mt19937 rng(7);
    for (int64_t depth : run.depths) {
        // The state holds the depth and the decoded tokens, or --ctx tokens (a server's session holds its whole
        // context whatever the conversation's length).
        auto state = model.new_state(std::max(depth + run.n_decode + 4, run.n_ctx));
        std::vector<int32_t> prompt(static_cast<size_t>(std::max<int64_t>(depth, 1)));
        for (auto & t : prompt) t = int32_t(rng() % uint32_t(c.n_vocab));
        // The first prefill of a process pays one-time costs (kernels load at their first launch, scratch grows to
        // the chunk's size): a throwaway state takes them, then the timed one runs warm. --warmup shortens the
        // throwaway prompt (a 1M prefill takes minutes); its state still has the depth's capacity.
        Timer first;
        const size_t n_first = run.n_warmup > 0 ? std::min(prompt.size(), size_t(run.n_warmup)) : prompt.size();
        model.eval(*model.new_state(depth + 1), std::span<const int32_t>(prompt.data(), n_first), LogitsMode::last,
                   nullptr);
        const double first_s = first.seconds();
        // As the server's and the chat's prefills do, a progress function lets chunks of kLayerCheckTokens or more
        // stop between layers (each layer then waits for the one before).
        const std::function<bool(int64_t)> keep_going = [](int64_t) { return true; };
        Timer pf;
        model.eval(*state, prompt, LogitsMode::last, nullptr, run.layer_checks ? keep_going : nullptr);
        const double pf_s = pf.seconds();
        // Two warm-up steps (the first runs eagerly, the second captures the graph), then timed greedy steps that
        // take their token as the engine's sampler does: from the device's candidates (their argmax), not from
        // the whole row of logits.
        int32_t tok = int32_t(rng() % uint32_t(c.n_vocab));
        for (int i = 0; i < 2; ++i) model.eval(*state, std::span<const int32_t>(&tok, 1), LogitsMode::last, nullptr);
        std::vector<int32_t> cand_ids(size_t(model.n_candidates()));
        std::vector<float> cand_values(cand_ids.size());
        float stats[4];
        pm_window(*backend, options.device, true);
        Timer dec;
        for (int64_t i = 0; i < run.n_decode; ++i) {
            model.logit_candidates(*state, cand_ids.data(), cand_values.data(), stats);
            tok = int32_t(stats[3]);
            model.eval(*state, std::span<const int32_t>(&tok, 1), LogitsMode::last, nullptr);
        }
        const double per_token = dec.seconds() / double(run.n_decode);
        pm_window(*backend, options.device, false);
        std::printf(
            "depth %6ld: prefill %7.1f tok/s (%.2f s, ubatch %ld, ctx %ld; first %.2f s) | decode %.3f ms/token = "
            "%.1f tok/s, %.1f %% of the weight roofline\n",
            depth, double(prompt.size()) / pf_s, pf_s, run.n_ubatch, state->n_ctx(), first_s, per_token * 1e3,
            1.0 / per_token, 100.0 * wb / kRooflineBytesPerSecond / per_token);
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------------------------------
// Single ops at the real shapes, on random codes (timing only)
// ---------------------------------------------------------------------------------------------------------------------
struct Bench {
    Backend & b;
    std::vector<std::unique_ptr<BackendBuffer>> keep;
    std::mt19937_64 rng;

    Tensor weight(GgmlType type, int64_t ne0, int64_t ne1, int64_t ne2 = 1) {
        Tensor t = make_tensor(type, nullptr, ne0, ne1, ne2);
        std::vector<uint64_t> host((t.n_bytes() + 7) / 8);
        for (auto & v : host) v = rng() & 0x3bff3bff3bff3bffull;  // keeps f16 scale fields finite
        t.data = host.data();
        std::unique_ptr<BackendBuffer> storage;
        Tensor g = b.upload_weight(t, &storage);
        keep.push_back(std::move(storage));
        b.synchronize();
        return g;
    }
    Tensor act(int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1, int64_t ne3 = 1, GgmlType type = GgmlType::F32) {
        Tensor t = make_tensor(type, nullptr, ne0, ne1, ne2, ne3);
        keep.push_back(b.alloc(size_t(t.n_elements()) * 4));
        t.data = keep.back()->data();
        if (type == GgmlType::F32) {
            std::normal_distribution<float> d;
            std::vector<float> v(size_t(t.n_elements()));
            for (auto & x : v) x = d(rng);
            b.write(t, v.data(), v.size() * 4);
        }
        return t;
    }
    // Median of 7 runs of `reps` calls, in microseconds per call.
    double time(const std::function<void()> & fn, int reps = 50) {
        fn();
        b.synchronize();
        std::vector<double> runs;
        for (int r = 0; r < 7; ++r) {
            Timer t;
            for (int i = 0; i < reps; ++i) fn();
            b.synchronize();
            runs.push_back(t.seconds() / reps * 1e6);
        }
        std::sort(runs.begin(), runs.end());
        return runs[3];
    }
};

int run_kernels(const CudaBackendOptions & options) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // whole lines: the backend's log lines on stderr fall between them
    auto backend = make_cuda_backend(options);
    Bench B{*backend, {}, std::mt19937_64{3}};
    std::printf("%s\n", backend->name().c_str());
    {
        // hc_pre at V4's shape (4 streams of 4096, 24 mixing rows in F16): a decode step and an 8K prefill chunk.
        const int64_t D = 4096, hc = 4, mix = (2 + hc) * hc;
        const Tensor fn = B.weight(GgmlType::F16, hc * D, mix), scale = B.act(3), base = B.act(mix);
        for (int64_t n : {1, 8192}) {
            const Tensor streams = B.act(D, hc, 1, n), y = B.act(D, n), post = B.act(hc, n), comb = B.act(hc, hc, 1, n);
            const double us = B.time(
                [&] {
                    B.b.hc_pre(streams, HcPre{fn, scale, base, Tensor{}, 20, 1e-6f, 1e-6f}, y, post, comb);
                },
                n > 1 ? 5 : 50);
            std::printf("hc_pre 4 x 4096, 24 mixing rows n=%-4ld %9.1f us  %7.1f GB/s of streams\n", n, us,
                        double(n * hc * D * 4) / us / 1e3);
        }
    }
    struct Mat {
        const char * name;
        GgmlType type;
        int64_t in, out;
    };
    for (const Mat & m :
         {Mat{"q_b", GgmlType::Q8_0, 1024, 32768}, Mat{"o_b", GgmlType::Q8_0, 8192, 4096},
          Mat{"q_a", GgmlType::Q8_0, 4096, 1024}, Mat{"shared gate", GgmlType::Q8_0, 4096, 2048},
          Mat{"lm head", GgmlType::Q8_0, 4096, 129280}, Mat{"compressor kv", GgmlType::F16, 4096, 1024},
          Mat{"indexer q_b", GgmlType::F16, 1024, 8192}, Mat{"expert gate", GgmlType::IQ2_XXS, 4096, 2048},
          Mat{"expert down", GgmlType::Q2_K, 2048, 4096}, Mat{"q4 expert", GgmlType::Q4_K, 4096, 2048}}) {
        const Tensor w = B.weight(m.type, m.in, m.out);
        for (int64_t n : {1, 8, 512, 4096}) {
            const Tensor x = B.act(m.in, n), y = B.act(m.out, n);
            const double us = B.time([&] { B.b.matmul(w, x, y); }, n > 8 ? 3 : 50);
            std::printf("matmul %-14s %-8s [%5ld -> %6ld] n=%-4ld %9.1f us  %7.1f GB/s of weights  %8.2f TFLOP/s\n",
                        m.name, std::string(type_name(m.type)).c_str(), m.in, m.out, n, us,
                        double(w.n_bytes()) / us / 1e3, 2.0 * double(m.in * m.out * n) / us / 1e6);
        }
    }
    {
        // The attention's seven projections of one normed input (CSA layer), one call against one call each.
        const std::vector<Mat> proj = {
            {"q_a", GgmlType::Q8_0, 4096, 1024},       {"kv", GgmlType::Q8_0, 4096, 512},
            {"comp kv", GgmlType::F16, 4096, 1024},    {"comp gate", GgmlType::F16, 4096, 1024},
            {"idx comp kv", GgmlType::F16, 4096, 256}, {"idx comp gate", GgmlType::F16, 4096, 256},
            {"idx proj", GgmlType::F16, 4096, 64}};
        std::vector<MatmulTarget> targets;
        double bytes = 0;
        const Tensor x = B.act(4096, 1);
        for (const Mat & m : proj) {
            targets.push_back({B.weight(m.type, m.in, m.out), B.act(m.out, 1)});
            bytes += double(targets.back().w.n_bytes());
        }
        const double many = B.time([&] { B.b.matmul_many(x, targets); });
        const double each = B.time([&] {
            for (const MatmulTarget & t : targets) B.b.matmul(t.w, x, t.y);
        });
        std::printf("matmul_many attention projections n=1   %9.1f us  %7.1f GB/s (one call each: %.1f us)\n", many,
                    bytes / many / 1e3, each);
    }
    {
        // Sampling candidates of one row of the real vocabulary: normal logits, then all equal (ties everywhere).
        const int64_t V = 129280;
        const Tensor logits = B.act(V, 1), stats = B.act(4, 1), values = B.act(1024, 1);
        const Tensor ids = B.act(1024, 1, 1, 1, GgmlType::I32);
        const double us = B.time([&] { B.b.logit_candidates(logits, ids, values, stats); });
        B.b.fill(logits, 0.5f);
        const double flat = B.time([&] { B.b.logit_candidates(logits, ids, values, stats); });
        std::printf("logit_candidates of %ld        %9.1f us (all logits equal: %.1f us)\n", V, us, flat);
    }
    {
        // The real expert count: a chunk of n tokens spreads its 6n pairs over up to 256 experts.
        const int64_t E = 256, D = 4096, I = 2048, k = 6;
        const Tensor gate = B.weight(GgmlType::IQ2_XXS, D, I, E), up = B.weight(GgmlType::IQ2_XXS, D, I, E);
        const Tensor down = B.weight(GgmlType::Q2_K, I, D, E);
        for (int64_t n : {1, 4, 16, 64, 256, 2048, 8192}) {
            const Tensor x = B.act(D, n), out = B.act(D, n), w = B.act(k, n);
            const Tensor ex = B.act(k, n, 1, 1, GgmlType::I32);
            std::vector<int32_t> ids(size_t(k * n));
            std::mt19937 pick{unsigned(n)};
            for (int64_t t = 0; t < n; ++t)  // k distinct experts per token
                for (int64_t j = 0; j < k; ++j) ids[size_t(t * k + j)] = int32_t((pick() % (E / k)) * k + j);
            B.b.write(ex, ids.data(), ids.size() * 4);
            const double us = B.time([&] { B.b.moe(x, ex, w, gate, up, down, 10.0f, out); }, n > 64 ? 3 : 20);
            std::set<int32_t> used(ids.begin(), ids.end());
            const double bytes =
                double(gate.n_bytes() + up.n_bytes() + down.n_bytes()) / double(E) * double(used.size());
            std::printf(
                "moe iq2_xxs/q2_K 6 of %ld experts n=%-4ld %9.1f us  %7.1f GB/s of %zu selected experts  %6.2f "
                "TFLOP/s (%s)\n",
                E, n, us, bytes / us / 1e3, used.size(), 6.0 * double(n * k * D * I) / us / 1e6,
                cuda_tensor_core_moe(GgmlType::IQ2_XXS, GgmlType::Q2_K, D, I, n * k, E) ? "tensor cores" : "integer");
        }
        // One token's whole FFN sublayer (router, shared expert, routed experts), one call against its composition.
        MoeFfn f;
        f.gate_inp = B.weight(GgmlType::F16, D, E);
        f.bias = B.act(E, 1);
        f.gate_sh = B.weight(GgmlType::Q8_0, D, I);
        f.up_sh = B.weight(GgmlType::Q8_0, D, I);
        f.down_sh = B.weight(GgmlType::Q8_0, I, D);
        f.gate = gate;
        f.up = up;
        f.down = down;
        f.limit = f.limit_sh = 10.0f;
        f.logits = B.act(E, 1);
        f.g = B.act(I, 1);
        f.u = B.act(I, 1);
        f.experts = B.act(k, 1, 1, 1, GgmlType::I32);
        f.weights = B.act(k, 1);
        const Tensor x = B.act(D, 1), out = B.act(D, 1);
        const double one = B.time([&] { B.b.moe_ffn(x, f, out); });
        const double parts = B.time([&] { B.b.Backend::moe_ffn(x, f, out); });
        std::printf("moe_ffn iq2_xxs/q2_K + shared q8_0 n=1 %9.1f us (its composition: %.1f us)\n", one, parts);
    }
    return 0;
}

std::vector<int64_t> parse_list(const std::string & s) {
    std::vector<int64_t> v;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
    return v;
}

}  // namespace

int main(int argc, char ** argv) {
    ModelRun run;
    std::string depths = "1,2048", numerics_arg = "official";
    int gpu = 0;
    bool kernels = false, profile = false, no_tensor_cores = false;
    CLI::App app{"dsv4-cuda-bench: CUDA backend speed"};
    app.add_option("model", run.path, "GGUF model (synthetic: dsv4-synth)");
    app.add_option("--depth", depths, "comma-separated prompt lengths to decode after (default 1,2048)");
    app.add_option("--decode", run.n_decode, "decode steps timed at each depth (default 32)");
    app.add_option("--ubatch", run.n_ubatch, "prefill chunk (default 2048)");
    app.add_option("--warmup", run.n_warmup, "tokens of the untimed first prefill at each depth (default: the depth)");
    app.add_option("--ctx", run.n_ctx, "tokens the decoded state holds (default: the depth and the decoded tokens)");
    app.add_option("--gpu", gpu, "CUDA device (default 0)");
    app.add_option("--indexer-branch", run.indexer_branch,
                   fmt::format("context bound from which a CSA layer's indexer runs beside the query's product "
                               "(default {}, the forward pass's)",
                               Model::kIndexerBranchContext));
    app.add_flag("--layer-checks", run.layer_checks,
                 "time the prefill with a progress function, as the server runs it (long chunks wait between layers)");
    app.add_flag("--kernels", kernels, "time single ops at V4 Flash shapes (no model)");
    app.add_flag("--profile", profile, "time every op (eager launches; totals print at exit)");
    app.add_flag("--no-tensor-cores", no_tensor_cores,
                 "every product on the integer path (8-bit activations), the indexer's scores in f32");
    app.add_option("--numerics", numerics_arg,
                   "official (default, as dsv4 runs: FP8 KV rows, Hadamard + FP4 indexer) or reference; the tensor "
                   "cores stay on either way unless --no-tensor-cores");
    CLI11_PARSE(app, argc, argv);
    if (!parse_numerics(numerics_arg, &run.numerics)) {
        log_error("--numerics: '{}' is neither official nor reference", numerics_arg);
        return 2;
    }
    CudaBackendOptions options;
    options.device = gpu;
    options.tensor_cores = !no_tensor_cores;
    try {
        if (profile) setenv("DSV4_CUDA_PROFILE", "1", 1);
        std::printf("%s\n", cuda_device_summary().c_str());
        if (kernels) return run_kernels(options);
        DSV4_CHECK(!run.path.empty(), "a model file is needed (or --kernels)");
        run.depths = parse_list(depths);
        return run_model(run, options);
    } catch (const Error & e) {
        log_error("{}", e.what());
        return 1;
    }
}
