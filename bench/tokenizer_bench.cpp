// Tokenizer throughput on one thread (docs/tokenizer.md records the numbers and the command).
//
//   build/bin/dsv4-tokenizer-bench [--benchmark_filter=...] [VOCAB.gguf]
//
// Inputs are ~10 MB built from the reference corpus (tests/tokenizer/corpus): "varied" mutates a third of the words
// (letters swapped, digits appended) so that most pieces are new to the per-call cache, a pessimistic mix;
// "repeated" concatenates the corpus files as they are, closer to real text where words recur.
#include "format/gguf.h"
#include "text/tokenizer.h"

#include <benchmark/benchmark.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace {

constexpr size_t kInputBytes = 10 << 20;
std::string g_vocab = DSV4_VOCAB_GGUF;

const dsv4::Tokenizer & tokenizer() {
    static const dsv4::Tokenizer tok = dsv4::Tokenizer::from_gguf(dsv4::GgufFile::open(g_vocab));
    return tok;
}

std::vector<std::string> corpus_files() {
    std::vector<std::filesystem::path> paths;
    for (const auto & e : std::filesystem::directory_iterator(DSV4_TOKENIZER_CORPUS))
        if (e.path().extension() == ".txt" && e.path().filename().string().rfind("invalid_", 0) != 0)
            paths.push_back(e.path());
    std::sort(paths.begin(), paths.end());
    std::vector<std::string> texts;
    for (const auto & p : paths) {
        std::ifstream in(p, std::ios::binary);
        std::stringstream ss;
        ss << in.rdbuf();
        texts.push_back(ss.str());
    }
    return texts;
}

const std::string & repeated_input() {
    static const std::string text = [] {
        const std::vector<std::string> files = corpus_files();
        std::string out;
        while (out.size() < kInputBytes)
            for (const std::string & f : files) out += f;
        out.resize(kInputBytes);
        // Never end inside a UTF-8 sequence: the cut would be two or three byte tokens, not text.
        while (!out.empty() && (uint8_t(out.back()) & 0xC0) == 0x80) out.pop_back();
        if (!out.empty() && uint8_t(out.back()) >= 0xC0) out.pop_back();
        return out;
    }();
    return text;
}

const std::string & varied_input() {
    static const std::string text = [] {
        std::vector<std::string> words;
        for (const std::string & f : corpus_files()) {
            std::string w;
            for (char c : f) {
                w += c;
                if (c == ' ' || c == '\n') words.push_back(std::move(w)), w.clear();
            }
            if (!w.empty()) words.push_back(w);
        }
        std::mt19937 rng(42);
        std::string out;
        while (out.size() < kInputBytes) {
            std::string w = words[rng() % words.size()];
            if (rng() % 3 == 0) {
                for (char & c : w)
                    if (c >= 'a' && c <= 'z' && rng() % 4 == 0) c = char('a' + rng() % 26);
                if (rng() % 2 == 0) w.insert(0, std::to_string(rng() % 100000));
            }
            out += w;
        }
        return out;
    }();
    return text;
}

void run(benchmark::State & state, const std::string & text, bool parse_special) {
    const dsv4::Tokenizer & tok = tokenizer();
    size_t n_tokens = 0;
    for (auto _ : state) {
        const std::vector<int32_t> ids = tok.encode(text, parse_special);
        n_tokens = ids.size();
        benchmark::DoNotOptimize(ids.data());
    }
    state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
    state.counters["tokens"] = double(n_tokens);
    state.counters["bytes_per_token"] = double(text.size()) / double(n_tokens);
}

void BM_EncodeVaried(benchmark::State & state) { run(state, varied_input(), true); }
void BM_EncodeRepeated(benchmark::State & state) { run(state, repeated_input(), true); }
void BM_EncodeVariedPlain(benchmark::State & state) { run(state, varied_input(), false); }

void BM_Decode(benchmark::State & state) {
    const dsv4::Tokenizer & tok = tokenizer();
    const std::vector<int32_t> ids = tok.encode(varied_input(), true);
    for (auto _ : state) benchmark::DoNotOptimize(tok.decode(ids).size());
    state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(varied_input().size()));
}

BENCHMARK(BM_EncodeVaried)->Unit(benchmark::kMillisecond)->MinTime(3.0);
BENCHMARK(BM_EncodeRepeated)->Unit(benchmark::kMillisecond)->MinTime(3.0);
BENCHMARK(BM_EncodeVariedPlain)->Unit(benchmark::kMillisecond)->MinTime(3.0);
BENCHMARK(BM_Decode)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char ** argv) {
    benchmark::Initialize(&argc, argv);
    if (argc > 1) g_vocab = argv[1];
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
}
