// dsv4-convert: HF checkpoint folder (config.json + safetensors) → GGUF in the llama.cpp-compatible deepseek4
// layout. See src/model/convert.h for the accepted inputs.
#include "model/convert.h"
#include "util/error.h"
#include "util/log.h"
#include "util/timer.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <unistd.h>

int main(int argc, char ** argv) {
    using namespace dsv4;
    std::string input, output, type_name = "f32";
    ConvertOptions opts;
    CLI::App app{"dsv4-convert: HF safetensors checkpoint to GGUF"};
    app.add_option("input", input, "checkpoint folder (config.json and model.safetensors or shards)")->required();
    app.add_option("output", output, "GGUF file to write")->required();
    app.add_option("--type", type_name, "f32, f16, bf16, q8_0, q2 (IQ2_XXS/Q2_K experts) or q4 (Q4_K experts)");
    app.add_option("--vocab", opts.vocab_path, "GGUF whose tokenizer metadata is copied into the output");
    app.add_option("--name", opts.name, "general.name (default: the folder name)");
    CLI11_PARSE(app, argc, argv);
    try {
        if (!parse_storage_mix(type_name, &opts.mix)) fail("--type: unknown type '{}'", type_name);
        const bool tty = isatty(2);
        Timer timer;
        double last = -1;
        opts.progress = [&](uint64_t done, uint64_t total) {
            const double t = timer.seconds();
            if (t - last < 1.0 && done != total) return;
            last = t;
            std::fprintf(stderr, "%s%5.1f%%  %.2f of %.2f GB  %.0f MB/s%s", tty ? "\r" : "",
                         total ? 100.0 * double(done) / double(total) : 100.0, double(done) / 1e9,
                         double(total) / 1e9, double(done) / 1e6 / std::max(t, 1e-3), tty ? "" : "\n");
        };
        ConvertStats s = convert_checkpoint(input, output, opts);
        if (tty) std::fputc('\n', stderr);
        log_info("wrote {}: {} tensors, {:.1f} MB, {} stored wider than --type {} (rows not a block multiple), "
                 "{:.1f} s", output, s.n_tensors, double(s.bytes) / 1e6, s.n_fallbacks, type_name, timer.seconds());
        return 0;
    } catch (const Error & e) {
        log_error("{}", e.what());
        return 1;
    }
}
