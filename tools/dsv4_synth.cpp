// dsv4-synth: writes a GGUF of DeepSeek V4's structure with seeded random weights (src/model/synth.h), in the
// llama.cpp-compatible deepseek4 layout, for benchmarks and for trying the software.
#include "model/synth.h"
#include "util/error.h"
#include "util/log.h"
#include "util/progress.h"

#include <CLI/CLI.hpp>

#include <algorithm>

int main(int argc, char ** argv) {
    using namespace dsv4;
    std::string output, shape = "flash", mix_name = "q2", vocab, mtp_file;
    int64_t layers = 4, n_vocab = 0;
    uint64_t seed = 1;
    bool mtp_in_file = false;
    CLI::App app{"dsv4-synth: synthetic DeepSeek V4 GGUF with random weights"};
    app.add_option("output", output, "GGUF file to write")->required();
    app.add_option("--shape", shape, "flash (the real V4 Flash shapes) or mini (256 wide, for trying the software)");
    app.add_option("--layers", layers, "number of layers (default 4)")->check(CLI::Range(1, 1000));
    app.add_option("--mix", mix_name, "q2 (IQ2_XXS/Q2_K experts), q4 (Q4_K experts), q8_0, f16, bf16 or f32");
    app.add_option("--vocab", vocab, "GGUF whose tokenizer is copied in (its size becomes the vocabulary)");
    app.add_option("--vocab-size", n_vocab, "vocabulary size without a tokenizer (default: the shape's)");
    app.add_option("--seed", seed, "random seed (default 1)");
    app.add_flag("--mtp", mtp_in_file, "add an MTP block in llama.cpp's layout (blk.N.nextn.*)");
    app.add_option("--mtp-file", mtp_file, "write an MTP block in ds4's separate-file layout (mtp.0.*) here");
    CLI11_PARSE(app, argc, argv);
    try {
        SynthOptions o;
        DSV4_CHECK(parse_storage_mix(mix_name, &o.mix), "--mix: unknown mix '{}'", mix_name);
        DSV4_CHECK(shape == "flash" || shape == "mini", "--shape: unknown shape '{}' (flash or mini)", shape);
        if (!vocab.empty()) {
            // The vocabulary size comes from the tokenizer file.
            const GgufFile v = GgufFile::open(vocab);
            n_vocab = int64_t(v.get_string_array("tokenizer.ggml.tokens").size());
        }
        o.config = shape == "flash" ? flash_config(layers) : mini_config(layers, 129280);
        if (n_vocab > 0) o.config.n_vocab = n_vocab;
        o.seed = seed;
        o.vocab_path = vocab;
        o.mtp_in_file = mtp_in_file;
        o.mtp_path = mtp_file;
        ProgressLine progress;
        o.progress = [&](uint64_t done, uint64_t total) { progress.update(done, total); };
        const uint64_t bytes = write_synthetic_model(o, output);
        progress.finish();
        log_info("wrote {}: {} layers of {} shape, mix {}, {:.2f} GB of weights in {:.1f} s", output, layers, shape,
                 mix_name, double(bytes) / 1e9, progress.seconds());
        return 0;
    } catch (const Error & e) {
        log_error("{}", e.what());
        return 1;
    }
}
