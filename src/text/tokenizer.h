// The DeepSeek V3/V4 tokenizer: GPT-2 style byte-level BPE behind three regex pre-tokenizer splits, with the HF
// added-token table on top. It reproduces HF `tokenizers` (tokenizer.json of DeepSeek V3, which V4 shares up to its
// added-token table) id for id; docs/tokenizer.md lists the rules, the GGUF keys and where we differ on purpose.
//
// A Tokenizer is immutable after construction: encode/decode are const and safe to call from many threads at once
// (every call keeps its scratch state on its own stack).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

class GgufFile;

// llama.cpp's token types, as stored in tokenizer.ggml.token_type.
enum class TokenType : int32_t {
    normal = 1,        // a BPE token, stored byte-mapped (GPT-2 byte-to-unicode)
    control = 3,       // an added token marked special (or spelled like one): literal UTF-8
    user_defined = 4,  // an added token that is not special (<think>, ｜DSML｜ in V4): literal UTF-8
    unused = 5,        // an id no tokenizer.json entry names ([PAD<id>]): never produced by encode
};

// HF added-token flags (tokenizer.json added_tokens[].lstrip/rstrip/normalized), one byte per token id in the GGUF
// key dsv4.tokenizer.added_token_flags. single_word is not supported (dsv4-vocab refuses it; DeepSeek never sets it).
enum AddedTokenFlag : uint8_t {
    kAddedLstrip = 1,      // absorbs the whitespace before a match
    kAddedRstrip = 2,      // absorbs the whitespace after a match
    kAddedNormalized = 4,  // matched in HF's second pass, in the gaps the non-normalized tokens leave
};

// A vocabulary in memory: what the GGUF keys hold. Used by from_gguf, by unit tests and by dsv4-vocab.
struct TokenizerVocab {
    std::vector<std::string> tokens;   // [n_vocab] BPE tokens byte-mapped, added tokens literal UTF-8
    std::vector<TokenType> types;      // [n_vocab]
    std::vector<std::string> merges;   // [n_merges] "A B" (two byte-mapped tokens); rank = index, lower first
    std::vector<uint8_t> added_flags;  // [n_vocab] AddedTokenFlag bits, or empty (all zero)
    int32_t bos_id = -1;               // -1: none
    int32_t eos_id = -1;
};

// A piece of a rendered chat prompt: either plain text (never parsed for special tokens) or exactly the text of
// one special (control or user-defined) token.
struct TextPiece {
    std::string text;
    bool special = false;
};

// Work done by one encode call; tests bound these to prove the BPE is not quadratic.
struct EncodeStats {
    uint64_t pieces = 0;       // pre-tokenizer pieces sent to BPE (cache hits included)
    uint64_t regex_calls = 0;  // PCRE2 match calls
    uint64_t heap_ops = 0;     // BPE priority-queue pushes and pops
};

class Tokenizer {
  public:
    // Reads tokenizer.ggml.{model,pre,tokens,token_type,merges,bos_token_id,eos_token_id} and
    // dsv4.tokenizer.added_token_flags (optional) from a vocabulary-only or full model GGUF. Throws dsv4::Error
    // naming the file and the key on anything missing or inconsistent.
    static Tokenizer from_gguf(const GgufFile & file);
    // Builds from vectors; `source` names the vocabulary in error messages.
    static Tokenizer from_vocab(TokenizerVocab vocab, std::string source);

    Tokenizer(Tokenizer &&) noexcept;
    Tokenizer & operator=(Tokenizer &&) noexcept;
    ~Tokenizer();

    // parse_special = true is the raw rule (CLI --tokenize-file, /v1/completions prompts): added tokens spelled in
    // the text become their ids, as in HF. false: all of `text` is plain text (chat content). Never adds BOS.
    // Invalid UTF-8 bytes are emitted as their single-byte tokens; the valid stretches between them are encoded
    // on their own (docs/tokenizer.md).
    std::vector<int32_t> encode(std::string_view text, bool parse_special, EncodeStats * stats = nullptr) const;
    // Adjacent text pieces are joined and encoded with parse_special = false; a special piece must be exactly one
    // control or user-defined token's text (dsv4::Error otherwise).
    std::vector<int32_t> encode_pieces(const std::vector<TextPiece> & pieces) const;

    // The raw bytes of the tokens, concatenated (not necessarily valid UTF-8; see Utf8StreamDecoder).
    std::string decode(std::span<const int32_t> ids) const;
    std::string token_bytes(int32_t id) const;            // BPE tokens byte-decoded, added tokens literal
    std::string_view token_text(int32_t id) const;        // as stored in tokenizer.ggml.tokens
    int32_t token_id(std::string_view token_text) const;  // by stored text; -1 if none
    TokenType token_type(int32_t id) const;
    bool is_special(int32_t id) const;  // control or user-defined: literal text, recognised in raw mode

    int32_t bos_id() const;
    int32_t eos_id() const;
    int32_t n_vocab() const;

  private:
    struct Impl;
    explicit Tokenizer(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

// Streaming detokenization: push(id) returns the text that became complete. A UTF-8 sequence split across tokens is
// held back until its last byte arrives; invalid bytes become U+FFFD, one per maximal ill-formed subsequence (the
// Unicode / WHATWG rule); finish() flushes a held-back incomplete tail as one U+FFFD.
class Utf8StreamDecoder {
  public:
    explicit Utf8StreamDecoder(const Tokenizer & tokenizer) : tokenizer_(&tokenizer) {}

    std::string push(int32_t id);
    std::string push_bytes(std::string_view bytes);
    std::string finish();

  private:
    const Tokenizer * tokenizer_;
    std::string pending_;  // an incomplete but so far valid UTF-8 sequence (at most 3 bytes)
};

}  // namespace dsv4
