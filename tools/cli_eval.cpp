// `dsv4 --tokens-file T.json --dump-logits OUT.f32`: evaluates token ids and writes the logits of every position
// (little-endian float32, row-major [n_tokens, n_vocab]). A stable contract: regression checks depend on it.
// `dsv4 --plan -m MODEL [--ctx N]`: the memory plan (Engine::plan) without loading anything.
#include "dsv4/engine.h"
#include "tools/cli.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"
#include "util/timer.h"

#include <nlohmann/json.hpp>

#include <cstdio>

namespace dsv4::cli {

std::vector<int32_t> read_token_file(const std::string & path) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(read_file(path));
    } catch (const nlohmann::json::exception & e) {
        fail("{}: not valid JSON: {}", path, e.what());
    }
    const nlohmann::json * arr = &j;
    if (j.is_object()) {
        DSV4_CHECK(j.contains("tokens"), "{}: the object has no \"tokens\" array", path);
        arr = &j["tokens"];
    }
    DSV4_CHECK(arr->is_array(), "{}: expected a JSON array of token ids (or an object with \"tokens\")", path);
    std::vector<int32_t> ids;
    ids.reserve(arr->size());
    for (size_t i = 0; i < arr->size(); ++i) {
        const nlohmann::json & v = (*arr)[i];
        DSV4_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX,
                   "{}: element {} is not a token id", path, i);
        ids.push_back(int32_t(v.get<int64_t>()));
    }
    return ids;
}

EngineOptions engine_options(const Options & opts) {
    EngineOptions e;
    e.model_path = opts.model;
    e.mtp_path = opts.mtp;
    e.backend = opts.backend;
    e.gpu = opts.gpu;
    e.n_threads = opts.threads;
    e.n_ubatch = opts.ubatch;
    e.numerics = opts.numerics;
    e.quantize_activations = !opts.f32_activations;
    return e;
}

int run_plan(const Options & opts) {
    DSV4_CHECK(!opts.model.empty(), "--plan needs a model (-m)");
    const MemoryPlan p = Engine::plan(engine_options(opts), opts.ctx);
    std::printf("model       %s\n%s\n", opts.model.c_str(), p.describe().c_str());
    return p.fits() ? 0 : 1;
}

int run_dump_logits(const Options & opts) {
    DSV4_CHECK(!opts.model.empty(), "--dump-logits needs a model (-m)");
    const std::vector<int32_t> tokens = read_token_file(opts.tokens_file);
    DSV4_CHECK(!tokens.empty(), "{}: no tokens", opts.tokens_file);
    auto engine = Engine::open(engine_options(opts));
    const ModelInfo & info = engine->info();
    const int64_t n_ctx = opts.ctx > 0 ? opts.ctx : int64_t(tokens.size());
    auto session = engine->new_session(n_ctx);
    log_info("{}: {} layers, vocab {}, backend {}, numerics {}, ubatch {}", info.path, info.n_layer, info.n_vocab,
             info.backend, info.numerics, info.n_ubatch);

    // Chunks of ubatch tokens, each chunk's logits appended to the file: memory stays bounded for long inputs.
    AtomicFileWriter out(opts.dump_logits);
    Timer timer;
    const size_t step = size_t(std::max<int64_t>(info.n_ubatch, 1));
    for (size_t i = 0; i < tokens.size(); i += step) {
        const size_t n = std::min(step, tokens.size() - i);
        session->eval(std::span<const int32_t>(tokens).subspan(i, n), true);
        const auto logits = session->logits();
        out.write(logits.data(), logits.size() * sizeof(float));
    }
    out.commit();
    const double s = timer.seconds();
    log_info("{} tokens in {:.2f} s ({:.1f} tokens/s); logits [{}, {}] written to {}", tokens.size(), s,
             double(tokens.size()) / s, tokens.size(), info.n_vocab, opts.dump_logits);
    return 0;
}

}  // namespace dsv4::cli
