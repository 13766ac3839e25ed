// dsv4-vocab: turns DeepSeek's HF tokenizer.json (+ tokenizer_config.json beside it, when present) into a
// vocabulary-only GGUF that dsv4 (and llama.cpp-style readers) load like the tokenizer keys of a model file.
//
//   dsv4-vocab path/to/tokenizer.json -o deepseek-v4-vocab.gguf          (V4 added-token table, the default)
//   dsv4-vocab path/to/dir --no-v4 -o deepseek-v3-vocab.gguf             (the input's table as is)
//
// V4 keeps V3's base vocabulary and merges; only the added-token table past id 128814 differs. Given V3's
// tokenizer.json (the only one published in a package), --v4 places V4's named tokens at their V4 ids and fills
// the other unnamed ids with placeholders; docs/tokenizer.md says which ids are verified and which are assumed.
#include "format/gguf.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <optional>

namespace dsv4 {
namespace {

using nlohmann::json;

constexpr int32_t kVocabSize = 129280;        // deepseek4.vocab_size: the embedding rows of V3 and V4
constexpr int32_t kV3LastAdded = 128814;      // V3's last added token (<｜tool▁sep｜>)
constexpr int32_t kPlaceholderBase = 128000;  // <｜place▁holder▁no▁N｜> has id 128000 + N in V3

// V4's named added tokens that V3 lacks (formats-spec §3.4; docs/tokenizer.md for how each was checked).
// `special` follows V3's table: role-like markers are special=false there, yet llama.cpp types them CONTROL
// because they look special; <think>, </think> and ｜DSML｜ do not, so they become USER_DEFINED.
struct NamedToken {
    int32_t id;
    const char * text;
};
constexpr NamedToken kV4Named[] = {
    {128821, "<think>"},         {128822, "</think>"},
    {128825, "｜DSML｜"},        {128828, "<｜latest_reminder｜>"},
    {128829, "<｜action｜>"},    {128830, "<｜query｜>"},
    {128831, "<｜authority｜>"}, {128832, "<｜domain｜>"},
    {128836, "<｜title｜>"},     {128845, "<｜read_url｜>"},
};

// The pre-tokenizer our Tokenizer implements, as tokenizer.json spells it.
constexpr const char * kSplitRegexes[] = {
    R"(\p{N}{1,3})",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    R"re([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^)re"
    "\r\n"
    R"re(\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[)re"
    "\r\n"
    R"re(]*|\s*[)re"
    "\r\n"
    R"re(]+|\s+(?!\S)|\s+)re",
};

struct Added {
    std::string text;
    bool special = false;
    bool lstrip = false;
    bool rstrip = false;
    bool normalized = false;
};

json read_json(const std::string & path) {
    try {
        return json::parse(read_file(path));
    } catch (const json::exception & e) {
        fail("{}: not valid JSON: {}", path, e.what());
    }
}

// A JSON member that must exist, with the path in the error.
const json & member(const json & obj, const char * key, const std::string & path, const std::string & where) {
    if (!obj.is_object() || !obj.contains(key)) fail("{}: {} has no \"{}\"", path, where, key);
    return obj[key];
}

bool opt_bool(const json & obj, const char * key, const std::string & path, const std::string & where) {
    if (!obj.contains(key) || obj[key].is_null()) return false;
    if (!obj[key].is_boolean()) fail("{}: {}.{} is not a boolean", path, where, key);
    return obj[key].get<bool>();
}

// llama.cpp's converter types an added token CONTROL when it is special or merely spelled like a control token.
bool looks_special(std::string_view t) {
    auto wrapped = [&](std::string_view open, std::string_view close) {
        return t.size() >= open.size() + close.size() && t.starts_with(open) && t.ends_with(close);
    };
    return wrapped("<|", "|>") || wrapped("<｜", "｜>");
}

void check_pipeline(const json & tj, const std::string & path) {
    const json & model = member(tj, "model", path, "the file");
    if (member(model, "type", path, "model") != "BPE") fail("{}: model.type is not \"BPE\"", path);
    if (opt_bool(model, "byte_fallback", path, "model") || opt_bool(model, "ignore_merges", path, "model"))
        fail("{}: model.byte_fallback / model.ignore_merges are set; DeepSeek's BPE uses neither", path);
    for (const char * k : {"continuing_subword_prefix", "end_of_word_suffix"})
        if (model.contains(k) && !model[k].is_null() && model[k] != "") fail("{}: model.{} is set", path, k);

    if (tj.contains("normalizer") && !tj["normalizer"].is_null()) {
        const json & n = tj["normalizer"];
        if (n.value("type", "") != "Sequence" || !n.contains("normalizers") || !n["normalizers"].empty())
            fail("{}: the normalizer is not empty; dsv4's tokenizer has no normalizer", path);
    }

    const json & pre = member(tj, "pre_tokenizer", path, "the file");
    const json & steps = member(pre, "pretokenizers", path, "pre_tokenizer");
    auto mismatch = [&](size_t i, std::string_view what) {
        fail(
            "{}: pre_tokenizer.pretokenizers[{}]: {}; dsv4 implements DeepSeek V3's three Split(Isolated) regexes "
            "followed by ByteLevel",
            path, i, what);
    };
    if (pre.value("type", "") != "Sequence" || !steps.is_array() || steps.size() != 4) mismatch(0, "not 4 steps");
    for (size_t i = 0; i < 3; ++i) {
        const json & s = steps[i];
        if (s.value("type", "") != "Split" || s.value("behavior", "") != "Isolated" || s.value("invert", true))
            mismatch(i, "not a Split with behavior Isolated, invert false");
        if (!s.contains("pattern") || s["pattern"].value("Regex", "") != kSplitRegexes[i]) mismatch(i, "another regex");
    }
    const json & bl = steps[3];
    if (bl.value("type", "") != "ByteLevel" || bl.value("add_prefix_space", true) || bl.value("use_regex", true))
        mismatch(3, "not ByteLevel(add_prefix_space=false, use_regex=false)");
}

// bos_token and friends are a string or an AddedToken object.
std::optional<std::string> config_token(const json & cfg, const char * key, const std::string & path) {
    if (!cfg.contains(key) || cfg[key].is_null()) return std::nullopt;
    const json & v = cfg[key];
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
    fail("{}: {} is neither a string nor an object with a \"content\" string", path, key);
}

struct Options {
    std::string input;
    std::string output;
    std::string name = "DeepSeek V4 vocabulary";
    bool v4 = true;
};

int run(const Options & opt) {
    namespace fs = std::filesystem;
    const fs::path in = fs::is_directory(opt.input) ? fs::path(opt.input) / "tokenizer.json" : fs::path(opt.input);
    const std::string path = in.string();
    const json tj = read_json(path);
    const fs::path cfg_path = in.parent_path() / "tokenizer_config.json";
    const json cfg = fs::exists(cfg_path) ? read_json(cfg_path.string()) : json::object();
    const std::string cfg_name = cfg_path.string();

    check_pipeline(tj, path);

    // ---- base vocabulary and merges ----
    std::vector<std::string> tokens(kVocabSize);
    std::vector<bool> filled(kVocabSize, false);
    const json & vocab = member(tj["model"], "vocab", path, "model");
    if (!vocab.is_object()) fail("{}: model.vocab is not an object", path);
    for (const auto & [text, idv] : vocab.items()) {
        if (!idv.is_number_integer()) fail("{}: model.vocab[\"{}\"] is not an integer", path, text);
        const int64_t id = idv.get<int64_t>();
        if (id < 0 || id >= kVocabSize)
            fail("{}: model.vocab[\"{}\"] = {} is outside 0..{}", path, text, id, kVocabSize - 1);
        if (filled[size_t(id)]) fail("{}: model.vocab id {} is used twice", path, id);
        tokens[size_t(id)] = text;
        filled[size_t(id)] = true;
    }

    const json & mj = member(tj["model"], "merges", path, "model");
    if (!mj.is_array()) fail("{}: model.merges is not an array", path);
    std::vector<std::string> merges;
    merges.reserve(mj.size());
    for (size_t i = 0; i < mj.size(); ++i) {
        const json & m = mj[i];
        if (m.is_string()) {
            merges.push_back(m.get<std::string>());
        } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
            merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());  // newer tokenizers' form
        } else {
            fail("{}: model.merges[{}] is neither \"A B\" nor [\"A\", \"B\"]", path, i);
        }
    }

    // ---- added tokens ----
    std::map<int32_t, Added> added;
    const json & aj = member(tj, "added_tokens", path, "the file");
    if (!aj.is_array()) fail("{}: added_tokens is not an array", path);
    for (size_t i = 0; i < aj.size(); ++i) {
        const json & a = aj[i];
        const std::string where = fmt::format("added_tokens[{}]", i);
        const json & idv = member(a, "id", path, where);
        const json & content = member(a, "content", path, where);
        if (!idv.is_number_integer() || !content.is_string())
            fail("{}: {} needs an integer id and a string content", path, where);
        const int64_t id = idv.get<int64_t>();
        if (id < 0 || id >= kVocabSize) fail("{}: {}.id = {} is outside 0..{}", path, where, id, kVocabSize - 1);
        if (opt_bool(a, "single_word", path, where))
            fail("{}: {} ('{}') sets single_word, which dsv4's tokenizer does not implement", path, where,
                 content.get<std::string>());
        Added t{content.get<std::string>(), opt_bool(a, "special", path, where), opt_bool(a, "lstrip", path, where),
                opt_bool(a, "rstrip", path, where), opt_bool(a, "normalized", path, where)};
        if (t.text.empty()) fail("{}: {} has empty content", path, where);
        if (filled[size_t(id)] && !added.count(int32_t(id)) && tokens[size_t(id)] != t.text)
            fail("{}: {} ('{}') reuses vocabulary id {} ('{}')", path, where, t.text, id, tokens[size_t(id)]);
        if (!added.emplace(int32_t(id), t).second) fail("{}: {}: id {} is added twice", path, where, id);
    }

    if (opt.v4) {
        // A V3 table gets V4's names; a table that already has them (a real V4 tokenizer.json) must agree.
        for (const NamedToken & nt : kV4Named) {
            auto it = added.find(nt.id);
            if (it != added.end()) {
                if (it->second.text != nt.text)
                    fail("{}: id {} is '{}', but V4 has '{}' there", path, nt.id, it->second.text, nt.text);
                continue;
            }
            if (nt.id <= kV3LastAdded || filled[size_t(nt.id)])
                fail("{}: id {} is taken; cannot place V4's '{}'", path, nt.id, nt.text);
            for (const auto & [id, a] : added)
                if (a.text == nt.text) fail("{}: '{}' is id {} here but {} in V4", path, nt.text, id, nt.id);
            // Non-special and normalized, like V3's role markers (<｜User｜>, <｜Assistant｜>).
            added.emplace(nt.id, Added{nt.text, false, false, false, true});
        }
        for (int32_t id = kV3LastAdded + 1; id < kVocabSize; ++id)
            if (!added.count(id) && !filled[size_t(id)])
                added.emplace(id, Added{fmt::format("<｜place▁holder▁no▁{}｜>", id - kPlaceholderBase), true, false,
                                        false, false});
    }

    // ---- token table ----
    std::vector<TokenType> types(kVocabSize, TokenType::normal);
    std::vector<uint8_t> flags(kVocabSize, 0);
    for (int32_t id = 0; id < kVocabSize; ++id) {
        auto it = added.find(id);
        if (it != added.end()) {
            const Added & a = it->second;
            tokens[size_t(id)] = a.text;
            types[size_t(id)] = a.special || looks_special(a.text) ? TokenType::control : TokenType::user_defined;
            flags[size_t(id)] = uint8_t((a.lstrip ? kAddedLstrip : 0) | (a.rstrip ? kAddedRstrip : 0) |
                                        (a.normalized ? kAddedNormalized : 0));
        } else if (!filled[size_t(id)]) {
            tokens[size_t(id)] = fmt::format("[PAD{}]", id);  // what llama.cpp's converter writes for a hole
            types[size_t(id)] = TokenType::unused;
        }
    }

    auto id_of = [&](const std::string & text, const std::string & what) -> int32_t {
        for (const auto & [id, a] : added)
            if (a.text == text) return id;
        fail("{}: {} '{}' is not an added token of {}", cfg.empty() ? path : cfg_name, what, text, path);
    };
    const int32_t bos =
        id_of(config_token(cfg, "bos_token", cfg_name).value_or("<｜begin▁of▁sentence｜>"), "bos_token");
    const int32_t eos = id_of(config_token(cfg, "eos_token", cfg_name).value_or("<｜end▁of▁sentence｜>"), "eos_token");
    const std::optional<std::string> pad_text = config_token(cfg, "pad_token", cfg_name);
    const int32_t pad = pad_text ? id_of(*pad_text, "pad_token") : -1;

    // The tokenizer validates everything it will rely on (byte tokens, every merge, the special ids).
    TokenizerVocab tv{tokens, types, merges, flags, bos, eos};
    const Tokenizer check = Tokenizer::from_vocab(tv, path);

    // ---- GGUF ----
    GgufWriter w(opt.output);
    w.set("general.architecture", GgufValue::make_string("deepseek4"));
    w.set("general.name", GgufValue::make_string(opt.name));
    w.set("deepseek4.vocab_size", GgufValue::make_u32(uint32_t(kVocabSize)));
    w.set("tokenizer.ggml.model", GgufValue::make_string("gpt2"));
    w.set("tokenizer.ggml.pre", GgufValue::make_string(opt.v4 ? "joyai-llm" : "deepseek-v3"));
    std::vector<GgufValue> tok_values, type_values, merge_values, flag_values;
    tok_values.reserve(tokens.size());
    for (const std::string & t : tokens) tok_values.push_back(GgufValue::make_string(t));
    for (TokenType t : types) type_values.push_back(GgufValue::make_i32(int32_t(t)));
    merge_values.reserve(merges.size());
    for (const std::string & m : merges) merge_values.push_back(GgufValue::make_string(m));
    for (uint8_t f : flags) flag_values.push_back(GgufValue::make_u8(f));
    w.set("tokenizer.ggml.tokens", GgufValue::make_array(GgufType::STRING, std::move(tok_values)));
    w.set("tokenizer.ggml.token_type", GgufValue::make_array(GgufType::INT32, std::move(type_values)));
    w.set("tokenizer.ggml.merges", GgufValue::make_array(GgufType::STRING, std::move(merge_values)));
    w.set("tokenizer.ggml.bos_token_id", GgufValue::make_u32(uint32_t(bos)));
    w.set("tokenizer.ggml.eos_token_id", GgufValue::make_u32(uint32_t(eos)));
    if (pad >= 0) w.set("tokenizer.ggml.padding_token_id", GgufValue::make_u32(uint32_t(pad)));
    for (const char * key : {"add_bos_token", "add_eos_token"}) {
        if (!cfg.contains(key) || cfg[key].is_null()) continue;
        if (!cfg[key].is_boolean()) fail("{}: {} is not a boolean", cfg_name, key);
        w.set(fmt::format("tokenizer.ggml.{}", key), GgufValue::make_bool(cfg[key].get<bool>()));
    }
    w.set("dsv4.tokenizer.added_token_flags", GgufValue::make_array(GgufType::UINT8, std::move(flag_values)));
    w.finish();

    int counts[6] = {};
    for (TokenType t : types) ++counts[int(t)];
    log_info("{}: {} tokens ({} normal, {} control, {} user-defined, {} unused), {} merges, bos {} eos {}", opt.output,
             tokens.size(), counts[1], counts[3], counts[4], counts[5], merges.size(), bos, eos);
    return 0;
}

}  // namespace
}  // namespace dsv4

int main(int argc, char ** argv) {
    using namespace dsv4;
    Options opt;
    CLI::App app{"dsv4-vocab: DeepSeek HF tokenizer.json -> vocabulary-only GGUF"};
    app.add_option("input", opt.input,
                   "tokenizer.json, or a folder holding it (tokenizer_config.json is read beside it)")
        ->required();
    app.add_option("-o,--output", opt.output, "the GGUF to write")->required();
    app.add_option("--name", opt.name, "general.name");
    app.add_flag("--v4,!--no-v4", opt.v4, "apply DeepSeek V4's added-token table (default); --no-v4 keeps the input's");
    CLI11_PARSE(app, argc, argv);
    try {
        return run(opt);
    } catch (const Error & e) {
        log_error("{}", e.what());
        return 1;
    }
}
