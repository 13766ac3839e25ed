// The `dsv4` command line: main() in dsv4.cpp parses the options and calls one of these commands.
// Each returns the process exit code; errors are dsv4::Error exceptions that main() prints.
#pragma once

#include "dsv4/engine.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4::cli {

struct Options {
    std::string model;                  // -m MODEL.gguf (a model or a vocabulary-only GGUF)
    std::string mtp;                    // --mtp MTP.gguf (ds4's separate MTP file)
    std::string backend = "auto";       // --backend cpu|cuda|auto
    int gpu = 0;                        // --gpu N
    int threads = 0;                    // --threads N (cpu)
    int64_t ubatch = 0;                 // --ubatch N: prefill chunk (1 = token by token; 0: the engine's default)
    int64_t ctx = 0;                    // --ctx N
    std::string numerics = "official";  // --numerics reference|official
    bool f32_activations = false;       // --f32-activations: no 8-bit activation quantization on cpu
    std::string tokens_file;            // --tokens-file T.json
    std::string dump_logits;            // --dump-logits OUT.f32
    std::string tokenize_file;          // --tokenize-file FILE: print ids (raw rules) as a JSON array
    std::string detokenize_file;        // --detokenize-file IDS.json: print the text
    std::string render_chat_file;       // --render-chat REQUEST.json: print the rendered prompt
    bool plan = false;                  // --plan: print the memory plan for --ctx (0: the largest that fits)

    // Chat (cli_chat.cpp): one-shot with -p / --prompt-file, interactive otherwise.
    std::string prompt;          // -p TEXT
    std::string prompt_file;     // --prompt-file FILE
    std::string system;          // --system TEXT
    int64_t max_tokens = 0;      // -n N: reply length cap (0: the context's room)
    float temperature = 1.0f;    // --temp
    float top_p = 1.0f;          // --top-p
    int32_t top_k = 0;           // --top-k
    float min_p = 0.05f;         // --min-p
    int64_t seed = -1;           // --seed (-1: random)
    std::string think = "high";  // --think (high), --think-max (max), --nothink (none)
};

EngineOptions engine_options(const Options & opts);  // cli_eval.cpp
int run_dump_logits(const Options & opts);           // cli_eval.cpp
int run_plan(const Options & opts);                  // cli_eval.cpp: exit 1 when the context does not fit
int run_tokenize(const Options & opts);              // cli_tokenize.cpp
int run_detokenize(const Options & opts);            // cli_tokenize.cpp
int run_render_chat(const Options & opts);           // cli_render.cpp
int run_chat(const Options & opts);                  // cli_chat.cpp

}  // namespace dsv4::cli
