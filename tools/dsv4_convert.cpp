// dsv4-convert: HF checkpoint folder (config.json + safetensors) → GGUF in the llama.cpp-compatible deepseek4
// layout. See src/model/convert.h for the accepted inputs.
#include "model/convert.h"
#include "util/error.h"
#include "util/log.h"
#include "util/progress.h"

#include <CLI/CLI.hpp>


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
        ProgressLine progress;
        opts.progress = [&](uint64_t done, uint64_t total) { progress.update(done, total); };
        ConvertStats s = convert_checkpoint(input, output, opts);
        progress.finish();
        log_info("wrote {}: {} tensors, {:.1f} MB, {} stored wider than --type {} (rows not a block multiple), "
                 "{:.1f} s", output, s.n_tensors, double(s.bytes) / 1e6, s.n_fallbacks, type_name, progress.seconds());
        return 0;
    } catch (const Error & e) {
        log_error("{}", e.what());
        return 1;
    }
}
