// dsv4 --tokenize-file / --detokenize-file: the tokenizer from the command line, for reference tests and debugging.
// Tokenizing uses the raw rule (special tokens written in the file are recognised, as in /v1/completions prompts)
// and never adds BOS. Detokenizing prints the tokens' raw bytes, so the two commands round-trip any file exactly.
#include "format/gguf.h"
#include "text/tokenizer.h"
#include "tools/cli.h"
#include "util/error.h"
#include "util/file.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>

namespace dsv4::cli {

namespace {

Tokenizer load_tokenizer(const Options & opts) {
    if (opts.model.empty()) fail("-m MODEL.gguf is required (a model or a vocabulary-only GGUF)");
    return Tokenizer::from_gguf(GgufFile::open(opts.model));
}

void write_stdout(std::string_view s) {
    if (std::fwrite(s.data(), 1, s.size(), stdout) != s.size() || std::fflush(stdout) != 0)
        fail("cannot write to standard output");
}

}  // namespace

int run_tokenize(const Options & opts) {
    const Tokenizer tok = load_tokenizer(opts);
    const std::vector<int32_t> ids = tok.encode(read_file(opts.tokenize_file), true);
    std::string out = "[";
    for (size_t i = 0; i < ids.size(); ++i) fmt::format_to(std::back_inserter(out), "{}{}", i ? "," : "", ids[i]);
    out += "]\n";
    write_stdout(out);
    return 0;
}

int run_detokenize(const Options & opts) {
    const Tokenizer tok = load_tokenizer(opts);
    const std::string & path = opts.detokenize_file;
    nlohmann::json doc;
    try {
        doc = nlohmann::json::parse(read_file(path));
    } catch (const nlohmann::json::exception & e) {
        fail("{}: not valid JSON: {}", path, e.what());
    }
    const bool wrapped = doc.is_object();
    if (wrapped) {
        if (!doc.contains("tokens")) fail("{}: the object has no \"tokens\" array", path);
        doc = doc["tokens"];
    }
    const char * where = wrapped ? "tokens" : "the array";
    if (!doc.is_array()) fail("{}: expected a JSON array of token ids or an object with a \"tokens\" array", path);
    std::vector<int32_t> ids;
    ids.reserve(doc.size());
    for (size_t i = 0; i < doc.size(); ++i) {
        const nlohmann::json & v = doc[i];
        if (!v.is_number_integer()) fail("{}: {}[{}] = {} is not an integer token id", path, where, i, v.dump());
        const int64_t id = v.get<int64_t>();
        if (id < 0 || id >= tok.n_vocab())
            fail("{}: {}[{}] = {} is out of range (the vocabulary has {} tokens)", path, where, i, id, tok.n_vocab());
        ids.push_back(int32_t(id));
    }
    write_stdout(tok.decode(ids));
    return 0;
}

}  // namespace dsv4::cli
