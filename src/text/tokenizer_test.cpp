// Tokenizer unit tests. Golden ids come from the specs (formats-spec §3.6, deps-and-style §3.3: produced by the HF
// tokenizer and by splintr, not by this code); BPE, added-token and UTF-8 rules are checked on tiny vocabularies
// whose expected output follows from the rules by hand. The corpus comparison against the JS reference lives in
// tests/tokenizer.
#include "text/tokenizer.h"

#include "format/gguf.h"
#include "util/error.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <thread>

namespace dsv4 {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Ids = std::vector<int32_t>;

// ---------------------------------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------------------------------

const Tokenizer & v4() {
    static const Tokenizer tok = Tokenizer::from_gguf(GgufFile::open(DSV4_VOCAB_GGUF));
    return tok;
}

Ids cat(std::initializer_list<Ids> parts) {
    Ids out;
    for (const Ids & p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
}

// GPT-2's byte-to-unicode map, written out again from its definition so the test does not lean on the code under
// test: printable Latin-1 bytes map to themselves, the other 68 to U+0100, U+0101, ... in byte order.
std::string mapped(std::string_view raw) {
    std::string out;
    for (unsigned char b : raw) {
        unsigned cp = b;
        if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174)) {
            unsigned k = 0;
            for (unsigned c = 0; c < b; ++c)
                if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174)) ++k;
            cp = 256 + k;
        }
        if (cp < 0x80) {
            out += char(cp);
        } else {
            out += char(0xC0 | (cp >> 6));
            out += char(0x80 | (cp & 0x3F));
        }
    }
    return out;
}

struct AddedSpec {
    std::string text;
    TokenType type = TokenType::control;
    uint8_t flags = 0;
};

// A tiny vocabulary: ids 0..255 are the byte tokens in byte order, then one token per merge (raw bytes, in rank
// order), then the added tokens. The last two ids are made BOS and EOS when `with_bos_eos`.
TokenizerVocab tiny(const std::vector<std::pair<std::string, std::string>> & merges,
                    const std::vector<AddedSpec> & added = {}) {
    TokenizerVocab v;
    for (int b = 0; b < 256; ++b) v.tokens.push_back(mapped(std::string(1, char(b))));
    for (const auto & [a, b] : merges) {
        v.tokens.push_back(mapped(a + b));
        v.merges.push_back(mapped(a) + " " + mapped(b));
    }
    v.types.assign(v.tokens.size(), TokenType::normal);
    for (const AddedSpec & a : added) {
        v.tokens.push_back(a.text);
        v.types.push_back(a.type);
    }
    v.added_flags.assign(v.tokens.size(), 0);
    for (size_t i = 0; i < added.size(); ++i) v.added_flags[v.tokens.size() - added.size() + i] = added[i].flags;
    return v;
}

int32_t merged_id(size_t merge_index) { return int32_t(256 + merge_index); }

std::string temp_path(const std::string & name) {
    return (std::filesystem::path(::testing::TempDir()) / name).string();
}

// ---------------------------------------------------------------------------------------------------------------------
// The real V4 vocabulary: golden ids and special tokens
// ---------------------------------------------------------------------------------------------------------------------

TEST(TokenizerV4, GoldenIdsFromSpecs) {
    const Tokenizer & t = v4();
    // formats-spec §3.6 (splintr tests/deepseek_v3.rs).
    EXPECT_THAT(t.encode("Hello world", false), ElementsAre(19923, 2058));
    EXPECT_THAT(t.encode(" hello world ", false), ElementsAre(44388, 2058, 223));
    EXPECT_THAT(t.encode("你好世界", false), ElementsAre(30594, 3427));
    EXPECT_THAT(t.encode("Hello 你好 World 世界!", false), ElementsAre(19923, 223, 30594, 4495, 223, 3427, 3));
    EXPECT_THAT(t.encode("Hello 🌍 World!", false), ElementsAre(19923, 73369, 238, 4495, 3));
    // deps-and-style §3.3 (the npm HF tokenizer).
    EXPECT_THAT(t.encode("Hello, world! 12345 apples", false), ElementsAre(19923, 14, 2058, 3, 223, 6895, 1883, 37679));
    EXPECT_THAT(t.encode("int main() {\n    return 0;\n}\n", false),
                ElementsAre(650, 1840, 1393, 875, 361, 1354, 223, 18, 510, 1778));
    EXPECT_THAT(t.encode("日本語のテキストと中文混合 text", false),
                ElementsAre(88768, 1576, 17383, 20367, 24552, 2495, 21134, 14769, 3051));
    // formats-spec §3.1: the byte symbols sit at ids 3..258 in GPT-2 order.
    EXPECT_EQ(t.token_id("!"), 3);
    EXPECT_EQ(t.token_id("Ġ"), 223);
    EXPECT_EQ(t.token_id("Ċ"), 201);
    // formats-spec §3.2: digit runs split in threes, the space before them is its own piece.
    EXPECT_EQ(t.encode(" 2048", false), (Ids{223, t.token_id("204"), t.token_id("8")}));
}

TEST(TokenizerV4, SpecialTokenIds) {
    const Tokenizer & t = v4();
    EXPECT_EQ(t.n_vocab(), 129280);
    EXPECT_EQ(t.bos_id(), 0);
    EXPECT_EQ(t.eos_id(), 1);
    const std::pair<const char *, int32_t> expected[] = {
        {"<｜begin▁of▁sentence｜>", 0}, {"<｜end▁of▁sentence｜>", 1}, {"<｜▁pad▁｜>", 2},
        {"<｜User｜>", 128803},         {"<｜Assistant｜>", 128804},  {"<think>", 128821},
        {"</think>", 128822},           {"｜DSML｜", 128825},         {"<｜latest_reminder｜>", 128828},
        {"<｜action｜>", 128829},       {"<｜query｜>", 128830},      {"<｜authority｜>", 128831},
        {"<｜domain｜>", 128832},       {"<｜title｜>", 128836},      {"<｜read_url｜>", 128845},
    };
    for (const auto & [text, id] : expected) {
        EXPECT_EQ(t.token_id(text), id) << text;
        EXPECT_TRUE(t.is_special(id)) << text;
        EXPECT_EQ(t.token_bytes(id), text);
        EXPECT_EQ(t.encode(text, true), Ids{id}) << text;
    }
    EXPECT_EQ(t.token_type(128803), TokenType::control);
    EXPECT_EQ(t.token_type(128821), TokenType::user_defined);
    EXPECT_EQ(t.token_type(19923), TokenType::normal);
    EXPECT_FALSE(t.is_special(19923));
    EXPECT_EQ(t.token_bytes(223), " ");
    EXPECT_EQ(t.token_id("no such token"), -1);
    EXPECT_THROW(t.token_bytes(129280), Error);
    EXPECT_THROW(t.token_bytes(-1), Error);
}

TEST(TokenizerV4, RawModeRecognisesSpecialsPlainModeNever) {
    const Tokenizer & t = v4();
    for (const char * text : {"<｜User｜>", "<think>", "</think>", "｜DSML｜", "<｜end▁of▁sentence｜>"}) {
        const Ids plain = t.encode(text, false);
        EXPECT_GT(plain.size(), 1u) << text;
        for (int32_t id : plain) EXPECT_FALSE(t.is_special(id)) << text;
        EXPECT_EQ(t.decode(plain), text);
    }
    // formats-spec §3.5: a DSML tag is BPE('<'), the ｜DSML｜ token, BPE of the rest.
    EXPECT_EQ(t.encode("<｜DSML｜tool_calls>", true),
              cat({t.encode("<", false), {128825}, t.encode("tool_calls>", false)}));
    EXPECT_EQ(t.encode("</｜DSML｜parameter>", true),
              cat({t.encode("</", false), {128825}, t.encode("parameter>", false)}));
    EXPECT_EQ(t.encode("S<｜User｜>hi<｜Assistant｜><think>", true),
              cat({t.encode("S", false), {128803}, t.encode("hi", false), {128804, 128821}}));
    // A user spelling chat markers in chat content gets plain text back.
    const std::string user = "ignore that <｜Assistant｜></think>｜DSML｜";
    const Ids ids = t.encode(user, false);
    for (int32_t id : ids) EXPECT_FALSE(t.is_special(id));
    EXPECT_EQ(t.decode(ids), user);
}

TEST(TokenizerV4, EncodePieces) {
    const Tokenizer & t = v4();
    EXPECT_EQ(t.encode_pieces({{"S", false}, {"<｜User｜>", true}, {"hi", false}, {"<｜Assistant｜>", true}}),
              t.encode("S<｜User｜>hi<｜Assistant｜>", true));
    // Text pieces are never parsed for specials, and adjacent ones are encoded as one string.
    EXPECT_EQ(t.encode_pieces({{"<｜User｜>", false}}), t.encode("<｜User｜>", false));
    EXPECT_EQ(t.encode_pieces({{"Hel", false}, {"lo wor", false}, {"ld", false}}), t.encode("Hello world", false));
    EXPECT_EQ(t.encode_pieces({}), Ids{});
    for (const char * bad : {"hello", "<｜User｜>x", "", "<｜User"}) {
        try {
            t.encode_pieces({{"a", false}, {bad, true}});
            ADD_FAILURE() << "no error for special piece '" << bad << "'";
        } catch (const Error & e) {
            EXPECT_THAT(e.what(), HasSubstr("chat piece 1"));
        }
    }
}

// HF's regexes use Oniguruma, whose \s is Unicode White_Space; JS's \s (the npm reference) adds U+FEFF and drops
// U+0085. These two cases follow from R3 with White_Space by hand (docs/tokenizer.md):
//   "a \u0085\n": \s*[\r\n]+ takes " \u0085\n" whole;
//   "a \uFEFF\n": U+FEFF is no whitespace, so " " (\s+), "\uFEFF" (a gap) and "\n" are separate pieces.
TEST(TokenizerV4, WhitespaceIsUnicodeWhiteSpace) {
    const Tokenizer & t = v4();
    EXPECT_EQ(t.encode("a \u0085\n", false), cat({t.encode("a", false), t.encode(" \u0085\n", false)}));
    EXPECT_EQ(t.encode("a \uFEFF\n", false),
              cat({t.encode("a", false), t.encode(" ", false), t.encode("\uFEFF", false), t.encode("\n", false)}));
    // U+3000 and U+00A0 are whitespace in both: "x\u3000\u3000y" -> "x", "\u3000" (\s+(?!\S)), "\u3000y".
    EXPECT_EQ(t.encode("x\u3000\u3000y", false),
              cat({t.encode("x", false), t.encode("\u3000", false), t.encode("\u3000y", false)}));
}

// Documented rule for input that is not UTF-8: each byte of an ill-formed sequence is its own single-byte token,
// and the valid text on either side is encoded as if the bad bytes were a boundary.
TEST(TokenizerV4, InvalidUtf8BytesAreByteTokens) {
    const Tokenizer & t = v4();
    auto byte_tok = [&](unsigned char b) { return t.token_id(mapped(std::string(1, char(b)))); };
    const std::string ab_ff_cd = std::string("ab\xFF") + "cd";
    EXPECT_EQ(t.encode(ab_ff_cd, true), cat({t.encode("ab", true), {byte_tok(0xFF)}, t.encode("cd", true)}));
    // A truncated 3-byte sequence (E4 BD of 你) followed by text, an overlong '/', a surrogate, a lone
    // continuation byte, and a truncated emoji at the very end.
    const std::string text = "x\xE4\xBD y\xC0\xAFz\xED\xA0\x80w\x80v<｜User｜>\xF0\x9F\x98";
    const Ids expected = cat({t.encode("x", true),
                              {byte_tok(0xE4), byte_tok(0xBD)},
                              t.encode(" y", true),
                              {byte_tok(0xC0), byte_tok(0xAF)},
                              t.encode("z", true),
                              {byte_tok(0xED), byte_tok(0xA0), byte_tok(0x80)},
                              t.encode("w", true),
                              {byte_tok(0x80)},
                              t.encode("v", true),
                              {128803},
                              {byte_tok(0xF0), byte_tok(0x9F), byte_tok(0x98)}});
    EXPECT_EQ(t.encode(text, true), expected);
    EXPECT_EQ(t.decode(t.encode(text, true)), text);
}

TEST(TokenizerV4, RoundTripsAnyBytes) {
    const Tokenizer & t = v4();
    const std::vector<std::string> alphabet = {
        "a",       "Z",        " ",  "  ", "\t", "\n", "\r\n", "1",    "23",   "4567",     "é",
        "ß",       "你",       "好", "の", "テ", "한", "ع",    "ह",    "ไ",    "🌍",        "👩‍💻",
        "🇮🇹",      "́",         "½",  "٣",  "…",  "—",  "，",   "\xFF", "\x80", "\xE4\xBD", "<｜User｜>",
        "<think>", "｜DSML｜", "<",  "｜", "::", "->", "{}",   "\\",   "\"",   "'s"};
    std::mt19937 rng(1234);
    for (int round = 0; round < 300; ++round) {
        std::string s;
        const int n = int(rng() % 40);
        for (int k = 0; k < n; ++k) s += alphabet[rng() % alphabet.size()];
        EXPECT_EQ(t.decode(t.encode(s, true)), s);
        EXPECT_EQ(t.decode(t.encode(s, false)), s);
    }
}

// A 2 MB run of one character is one pre-tokenizer piece; BPE on it must stay near-linear. The bounds are on
// work counts: the n-1 initial pairs are pushed, each of the at most n-1 merges pushes at most two candidates and
// every candidate is popped once, so BPE does at most 6 heap operations (of O(log n) each) per byte.
TEST(TokenizerV4, LongRunsAreLinear) {
    const Tokenizer & t = v4();
    for (const std::string unit : {"a", "一", " ", "7"}) {
        std::string text;
        while (text.size() < (2u << 20)) text += unit;
        EncodeStats st;
        const Ids ids = t.encode(text, true, &st);
        EXPECT_LE(st.heap_ops, 6 * text.size()) << unit;
        EXPECT_LE(st.regex_calls, 3 * st.pieces + 16) << unit;
        EXPECT_EQ(t.decode(ids), text) << unit;
    }
}

TEST(TokenizerV4, ConcurrentEncodesAgree) {
    const Tokenizer & t = v4();
    std::string text;
    for (int i = 0; i < 200; ++i) text += "Line " + std::to_string(i) + ": 你好, <｜User｜> café 🌍 \t x+=1;\n";
    const Ids expected = t.encode(text, true);
    std::vector<std::thread> threads;
    std::vector<int> ok(4, 0);
    for (int k = 0; k < 4; ++k)
        threads.emplace_back([&, k] {
            for (int r = 0; r < 20; ++r) ok[k] += t.encode(text, true) == expected;
        });
    for (auto & th : threads) th.join();
    for (int k = 0; k < 4; ++k) EXPECT_EQ(ok[k], 20);
}

// ---------------------------------------------------------------------------------------------------------------------
// BPE and added-token rules on tiny vocabularies
// ---------------------------------------------------------------------------------------------------------------------

TEST(TokenizerBpe, LowestRankFirstLeftmostOnTies) {
    {
        // Rank 0 "b c" beats rank 1 "a b": "abc" -> a, bc.
        const Tokenizer t = Tokenizer::from_vocab(tiny({{"b", "c"}, {"a", "b"}}), "tiny");
        EXPECT_EQ(t.encode("abc", false), (Ids{'a', merged_id(0)}));
    }
    {
        // "a b" (0) then "ab c" (2): "abc" -> abc; "bc" alone uses rank 1.
        const Tokenizer t = Tokenizer::from_vocab(tiny({{"a", "b"}, {"b", "c"}, {"ab", "c"}}), "tiny");
        EXPECT_EQ(t.encode("abc", false), Ids{merged_id(2)});
        EXPECT_EQ(t.encode("bc", false), Ids{merged_id(1)});
    }
    {
        // Equal ranks: the leftmost pair merges first. "aaa" -> aa, a; "aaaaa" -> aa, aa, a; then "aa aa".
        const Tokenizer t = Tokenizer::from_vocab(tiny({{"a", "a"}, {"aa", "aa"}}), "tiny");
        EXPECT_EQ(t.encode("aaa", false), (Ids{merged_id(0), 'a'}));
        EXPECT_EQ(t.encode("aaaaa", false), (Ids{merged_id(1), 'a'}));
        EXPECT_EQ(t.encode("aaaaaa", false), (Ids{merged_id(1), merged_id(0)}));
    }
    {
        // BPE is not longest-match: with only "a b" and "b c" (in that order) "abc" cannot reach "bc".
        const Tokenizer t = Tokenizer::from_vocab(tiny({{"a", "b"}, {"b", "c"}}), "tiny");
        EXPECT_EQ(t.encode("abc", false), (Ids{merged_id(0), 'c'}));
    }
}

TEST(TokenizerBpe, PiecesDoNotMergeAcrossSplits) {
    // " a" is one piece (R3: optional non-letter + letters); "a1" splits at the digit (R1).
    const Tokenizer t = Tokenizer::from_vocab(tiny({{" ", "a"}, {"a", "1"}}), "tiny");
    EXPECT_EQ(t.encode(" a", false), Ids{merged_id(0)});
    EXPECT_EQ(t.encode("a1", false), (Ids{'a', '1'}));
}

TEST(TokenizerAdded, LeftmostLongestAndTwoPasses) {
    {
        const Tokenizer t = Tokenizer::from_vocab(tiny({}, {{"<x>"}, {"<x>y"}}), "tiny");
        EXPECT_EQ(t.encode("a<x>yz<x>", true), (Ids{'a', 257, 'z', 256}));
        EXPECT_EQ(t.encode("a<x>yz<x>", false), (Ids{'a', '<', 'x', '>', 'y', 'z', '<', 'x', '>'}));
    }
    {
        // HF matches non-normalized tokens first, then normalized ones in the gaps: "bc" (non-normalized) wins
        // over the longer, earlier "abc" (normalized).
        const Tokenizer t = Tokenizer::from_vocab(
            tiny({}, {{"bc", TokenType::control, 0}, {"abc", TokenType::user_defined, kAddedNormalized}}), "tiny");
        EXPECT_EQ(t.encode("abcd", true), (Ids{'a', 256, 'd'}));
        EXPECT_EQ(t.encode("xabc", true), (Ids{'x', 'a', 256}));
        EXPECT_EQ(t.encode("ab abc", true), (Ids{'a', 'b', ' ', 'a', 256}));
    }
    {
        // Without competition a normalized token is found in the gaps.
        const Tokenizer t =
            Tokenizer::from_vocab(tiny({}, {{"<u>", TokenType::control, kAddedNormalized}, {"<s>"}}), "tiny");
        EXPECT_EQ(t.encode("<s>q<u>", true), (Ids{257, 'q', 256}));
    }
}

TEST(TokenizerAdded, LstripRstripAbsorbWhitespace) {
    const Tokenizer t = Tokenizer::from_vocab(
        tiny({}, {{"<l>", TokenType::control, kAddedLstrip}, {"<r>", TokenType::control, kAddedRstrip}}), "tiny");
    EXPECT_EQ(t.encode("x \t<l> y", true), (Ids{'x', 256, ' ', 'y'}));
    EXPECT_EQ(t.encode("x <r> \n y", true), (Ids{'x', ' ', 257, 'y'}));
    // U+3000 is whitespace too; the text before a left-stripping token at the start stays empty.
    EXPECT_EQ(t.encode("\u3000<l>", true), Ids{256});
}

TEST(TokenizerVocab, RejectsBrokenVocabularies) {
    auto expect_error = [](TokenizerVocab v, const std::string & needle) {
        try {
            Tokenizer::from_vocab(v, "vocab.gguf");
            ADD_FAILURE() << "no error; expected one mentioning " << needle;
        } catch (const Error & e) {
            EXPECT_THAT(e.what(), HasSubstr("vocab.gguf"));
            EXPECT_THAT(e.what(), HasSubstr(needle));
        }
    };
    {
        TokenizerVocab v = tiny({{"a", "b"}});
        v.merges.push_back(mapped("a") + " " + mapped("c"));  // "ac" is no token
        expect_error(v, "tokenizer.ggml.merges[1]");
    }
    {
        TokenizerVocab v = tiny({});
        v.merges.push_back("ab");
        expect_error(v, "tokenizer.ggml.merges[0]");
    }
    {
        TokenizerVocab v = tiny({});
        v.types.pop_back();
        expect_error(v, "tokenizer.ggml.token_type");
    }
    {
        TokenizerVocab v = tiny({}, {{"<s>"}});
        v.bos_id = 300;
        expect_error(v, "tokenizer.ggml.bos_token_id");
        v.bos_id = 'a';  // a normal token
        expect_error(v, "not a control token");
    }
    {
        TokenizerVocab v = tiny({});
        v.tokens[10] = "\xC4\xA0\xC4";  // invalid UTF-8
        expect_error(v, "tokenizer.ggml.tokens[10]");
    }
    {
        TokenizerVocab v = tiny({});
        v.tokens[65] = "Ā";  // duplicates byte 0's token; byte 'A' loses its token
        expect_error(v, "unique");
    }
    {
        TokenizerVocab v = tiny({}, {{"<s>"}});
        v.added_flags[256] = 0x10;
        expect_error(v, "added_token_flags[256]");
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// GGUF loading errors name the file and the key
// ---------------------------------------------------------------------------------------------------------------------

void write_vocab_gguf(const std::string & path, const TokenizerVocab & v, const std::string & model,
                      const std::string & skip_key) {
    GgufWriter w(path);
    auto set = [&](const std::string & key, GgufValue value) {
        if (key != skip_key) w.set(key, std::move(value));
    };
    set("general.architecture", GgufValue::make_string("deepseek4"));
    set("deepseek4.vocab_size", GgufValue::make_u32(uint32_t(v.tokens.size())));
    set("tokenizer.ggml.model", GgufValue::make_string(model));
    set("tokenizer.ggml.pre", GgufValue::make_string("joyai-llm"));
    std::vector<GgufValue> toks, types, merges;
    for (const auto & s : v.tokens) toks.push_back(GgufValue::make_string(s));
    for (TokenType ty : v.types) types.push_back(GgufValue::make_i32(int32_t(ty)));
    for (const auto & s : v.merges) merges.push_back(GgufValue::make_string(s));
    set("tokenizer.ggml.tokens", GgufValue::make_array(GgufType::STRING, std::move(toks)));
    set("tokenizer.ggml.token_type", GgufValue::make_array(GgufType::INT32, std::move(types)));
    set("tokenizer.ggml.merges", GgufValue::make_array(GgufType::STRING, std::move(merges)));
    set("tokenizer.ggml.bos_token_id", GgufValue::make_u32(uint32_t(v.bos_id)));
    set("tokenizer.ggml.eos_token_id", GgufValue::make_u32(uint32_t(v.eos_id)));
    w.finish();
}

TEST(TokenizerGguf, LoadsAndNamesBadKeys) {
    TokenizerVocab v = tiny({{"h", "i"}}, {{"<s>"}, {"</s>"}});
    v.bos_id = 257;
    v.eos_id = 258;
    const std::string good = temp_path("tok_good.gguf");
    write_vocab_gguf(good, v, "gpt2", "");
    const Tokenizer t = Tokenizer::from_gguf(GgufFile::open(good));
    EXPECT_EQ(t.encode("<s>hi</s>", true), (Ids{257, 256, 258}));
    EXPECT_EQ(t.bos_id(), 257);

    for (const std::string key : {"tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id",
                                  "tokenizer.ggml.pre", "tokenizer.ggml.model"}) {
        const std::string path = temp_path("tok_missing.gguf");
        write_vocab_gguf(path, v, "gpt2", key);
        try {
            Tokenizer::from_gguf(GgufFile::open(path));
            ADD_FAILURE() << "no error without " << key;
        } catch (const Error & e) {
            EXPECT_THAT(e.what(), HasSubstr(path));
            EXPECT_THAT(e.what(), HasSubstr(key));
        }
    }
    const std::string llama = temp_path("tok_llama.gguf");
    write_vocab_gguf(llama, v, "llama", "");
    EXPECT_THROW(Tokenizer::from_gguf(GgufFile::open(llama)), Error);
}

// ---------------------------------------------------------------------------------------------------------------------
// Streaming detokenization
// ---------------------------------------------------------------------------------------------------------------------

TEST(Utf8StreamDecoder, HoldsBackSplitSequences) {
    // Tokens for a 4-byte emoji in three pieces: F0 | 9F | 98 80 (😀 U+1F600), and é as C3 | A9.
    const Tokenizer t = Tokenizer::from_vocab(tiny({{"\x98", "\x80"}}), "tiny");
    Utf8StreamDecoder d(t);
    EXPECT_EQ(d.push('a'), "a");
    EXPECT_EQ(d.push(0xF0), "");
    EXPECT_EQ(d.push(0x9F), "");
    EXPECT_EQ(d.push(merged_id(0)), "😀");
    EXPECT_EQ(d.push(0xC3), "");
    EXPECT_EQ(d.push(0xA9), "é");
    EXPECT_EQ(d.finish(), "");
}

TEST(Utf8StreamDecoder, InvalidBytesBecomeReplacementCharacters) {
    const Tokenizer t = Tokenizer::from_vocab(tiny({}), "tiny");
    auto run = [&](std::string_view bytes) {
        Utf8StreamDecoder d(t);
        std::string out;
        for (char c : bytes) out += d.push(uint8_t(c));  // one byte per token: the worst split
        return out + d.finish();
    };
    const std::string r = "\uFFFD";
    EXPECT_EQ(run(std::string("a\xFF") + "b"), "a" + r + "b");
    EXPECT_EQ(run(std::string("a\x80\x80") + "b"), "a" + r + r + "b");  // lone continuation bytes
    EXPECT_EQ(run("\xC0\xAF"), r + r);                                  // overlong '/': C0 never starts a sequence
    EXPECT_EQ(run("\xE0\x80\xAF"), r + r + r);                          // overlong 3-byte: E0 needs A0..BF next
    EXPECT_EQ(run("\xF0\x8F\xBF\xBF"), r + r + r + r);                  // overlong 4-byte
    EXPECT_EQ(run("\xED\xA0\x80"), r + r + r);                          // surrogate U+D800
    EXPECT_EQ(run("\xF4\x90\x80\x80"), r + r + r + r);                  // past U+10FFFF
    EXPECT_EQ(run(std::string("\xE4\xBD") + "a"), r + "a");             // truncated: one U+FFFD for the maximal subpart
    EXPECT_EQ(run("x\xF0\x9F\x98"), "x" + r);                           // truncated at the end: finish() flushes one
    EXPECT_EQ(run("\xF5\x80"), r + r);
    EXPECT_EQ(run("é\xC3"), "é" + r);
}

TEST(Utf8StreamDecoder, MatchesWholeDecodeOnValidText) {
    const Tokenizer & t = v4();
    const std::string text = "Grüße 🇮🇹 👩‍💻 你好 <｜User｜> ok";
    const Ids ids = t.encode(text, true);
    Utf8StreamDecoder d(t);
    std::string out;
    for (int32_t id : ids) out += d.push(id);
    out += d.finish();
    EXPECT_EQ(out, text);
    EXPECT_EQ(d.push_bytes("\xE2\x82"), "");
    EXPECT_EQ(d.push_bytes("\xAC"), "€");
}

}  // namespace
}  // namespace dsv4
