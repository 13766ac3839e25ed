// DeepSeek V3/V4 byte-level BPE tokenizer. The pipeline follows HF `tokenizers` for DeepSeek's tokenizer.json:
//   1. (raw mode) added tokens are cut out of the text: leftmost-longest match, non-normalized tokens first, then
//      normalized ones in the gaps (the normalizer is empty, so both passes see the same text);
//   2. every remaining stretch is split by three regexes in sequence (Split, behavior Isolated: matches and the
//      gaps between them are both pieces, and each step re-splits every piece of the step before);
//   3. each piece is byte-mapped and BPE-merged (lowest merge rank first, leftmost on ties).
// docs/tokenizer.md records the sources of each rule and the few places we differ from the JS reference.
#include "text/tokenizer.h"

#include "format/gguf.h"
#include "util/error.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

namespace dsv4 {

namespace {

// ---------------------------------------------------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------------------------------------------------

enum class Utf8 { valid, invalid, incomplete };

// Classifies the sequence at p[0..n), n >= 1, by Unicode's table of well-formed sequences (no overlongs, no
// surrogates, nothing past U+10FFFF). valid: *len is its length. invalid: *len is the maximal ill-formed subpart
// (the longest prefix of some well-formed sequence, at least one byte). incomplete: a well-formed prefix that
// runs to the end of the buffer; *len = n.
Utf8 utf8_sequence(const uint8_t * p, size_t n, size_t * len) {
    const uint8_t b = p[0];
    if (b < 0x80) {
        *len = 1;
        return Utf8::valid;
    }
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF;  // the range of the second byte; later bytes are always 80..BF
    if (b >= 0xC2 && b <= 0xDF) {
        need = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
        need = 2;
        if (b == 0xE0) lo = 0xA0;  // overlong below U+0800
        if (b == 0xED) hi = 0x9F;  // surrogates U+D800..DFFF
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 3;
        if (b == 0xF0) lo = 0x90;  // overlong below U+10000
        if (b == 0xF4) hi = 0x8F;  // past U+10FFFF
    } else {
        *len = 1;  // 80..C1 (continuation or overlong lead) and F5..FF never start a sequence
        return Utf8::invalid;
    }
    for (size_t k = 1; k <= need; ++k) {
        if (k >= n) {
            *len = n;
            return Utf8::incomplete;
        }
        if (p[k] < lo || p[k] > hi) {
            *len = k;
            return Utf8::invalid;
        }
        lo = 0x80;
        hi = 0xBF;
    }
    *len = need + 1;
    return Utf8::valid;
}

// Decodes the code point at s[i] of valid UTF-8 and advances i.
uint32_t next_code_point(std::string_view s, size_t & i) {
    const auto * p = reinterpret_cast<const uint8_t *>(s.data());
    const uint8_t b = p[i];
    if (b < 0x80) return p[i++];
    const int n = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
    uint32_t cp = b & (0x7F >> n);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (p[i + k] & 0x3F);
    i += n;
    return cp;
}

// The code point that ends at s[end) of valid UTF-8; *start receives where it begins.
uint32_t prev_code_point(std::string_view s, size_t end, size_t * start) {
    size_t i = end - 1;
    while (i > 0 && (uint8_t(s[i]) & 0xC0) == 0x80) --i;
    *start = i;
    return next_code_point(s, i);
}

void append_utf8(std::string & out, uint32_t cp) {
    if (cp < 0x80) {
        out += char(cp);
    } else if (cp < 0x800) {
        out += char(0xC0 | (cp >> 6));
        out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += char(0xE0 | (cp >> 12));
        out += char(0x80 | ((cp >> 6) & 0x3F));
        out += char(0x80 | (cp & 0x3F));
    } else {
        out += char(0xF0 | (cp >> 18));
        out += char(0x80 | ((cp >> 12) & 0x3F));
        out += char(0x80 | ((cp >> 6) & 0x3F));
        out += char(0x80 | (cp & 0x3F));
    }
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Unicode's White_Space property: what Rust's char::is_whitespace (HF's added-token lstrip/rstrip) and Oniguruma's
// \s (HF's Split regexes) accept. The regexes below spell the same set as kWhiteSpaceClass.
bool is_white_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// ---------------------------------------------------------------------------------------------------------------------
// GPT-2 byte map: every byte is a printable code point, so BPE tokens are strings of those code points. Printable
// Latin-1 bytes (33..126, 161..172, 174..255) map to themselves; the other 68 get 256, 257, ... in byte order.
// ---------------------------------------------------------------------------------------------------------------------

struct ByteMap {
    std::array<uint32_t, 256> to_cp{};
    std::array<int16_t, 512> to_byte{};  // -1: not a mapped code point; every mapped code point is < 324

    ByteMap() {
        to_byte.fill(-1);
        uint32_t extra = 256;
        for (int b = 0; b < 256; ++b) {
            const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
            to_cp[b] = printable ? uint32_t(b) : extra++;
            to_byte[to_cp[b]] = int16_t(b);
        }
    }
};

const ByteMap & byte_map() {
    static const ByteMap map;
    return map;
}

// ---------------------------------------------------------------------------------------------------------------------
// Pre-tokenizer regexes (formats-spec §3.2; tokenizer.json pre_tokenizer.pretokenizers[0..2]). PCRE2's \s differs
// between versions and from Oniguruma's, so whitespace is spelled out as Unicode White_Space (what HF's Oniguruma
// matches). JS's \s (the npm reference) adds U+FEFF and drops U+0085; docs/tokenizer.md.
// ---------------------------------------------------------------------------------------------------------------------

#define DSV4_WS R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})"

constexpr const char * kSplitPatterns[] = {
    R"(\p{N}{1,3})",
    R"([\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+)",
    R"re([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+)re"
    R"re(|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+)re"
    R"re(| ?[\p{P}\p{S}]+[\r\n]*)re"
    R"re(|[)re" DSV4_WS R"re(]*[\r\n]+)re"
    R"re(|[)re" DSV4_WS R"re(]+(?![^)re" DSV4_WS R"re(]))re"
    R"re(|[)re" DSV4_WS R"re(]+)re",
};
constexpr int kNumSplits = 3;

#undef DSV4_WS

struct Pcre2CodeDeleter {
    void operator()(pcre2_code * c) const { pcre2_code_free(c); }
};
struct Pcre2MatchDataDeleter {
    void operator()(pcre2_match_data * m) const { pcre2_match_data_free(m); }
};
struct Pcre2MatchContextDeleter {
    void operator()(pcre2_match_context * m) const { pcre2_match_context_free(m); }
};
struct Pcre2JitStackDeleter {
    void operator()(pcre2_jit_stack * s) const { pcre2_jit_stack_free(s); }
};

struct SplitRegex {
    std::unique_ptr<pcre2_code, Pcre2CodeDeleter> code;
    bool jit = false;
};

SplitRegex compile_split(int index) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code * code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kSplitPatterns[index]), PCRE2_ZERO_TERMINATED,
                                      PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
    if (!code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof(msg));
        fail("tokenizer: pre-tokenizer regex {} does not compile at offset {}: {}", index, offset,
             reinterpret_cast<const char *>(msg));
    }
    SplitRegex r;
    r.code.reset(code);
    // Without JIT (a PCRE2 built without it) the interpreter gives the same splits, only slower.
    r.jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    return r;
}

// ---------------------------------------------------------------------------------------------------------------------
// Merge table: (left id, right id) -> (rank, merged id), open addressing. BPE spends most of its time here.
// ---------------------------------------------------------------------------------------------------------------------

class MergeTable {
  public:
    struct Entry {
        uint64_t key = kEmpty;
        int32_t rank = 0;
        int32_t id = 0;
    };

    void reserve(size_t n) {
        size_t cap = 16;
        while (cap < n * 2) cap *= 2;
        slots_.assign(cap, Entry{});
        mask_ = cap - 1;
    }

    // A pair listed twice keeps its last rank, as HF's and the JS reference's maps do.
    void insert(int32_t left, int32_t right, int32_t rank, int32_t id) {
        const uint64_t key = pack(left, right);
        for (size_t i = hash(key);; i = (i + 1) & mask_) {
            if (slots_[i].key == kEmpty || slots_[i].key == key) {
                slots_[i] = Entry{key, rank, id};
                return;
            }
        }
    }

    const Entry * find(int32_t left, int32_t right) const {
        const uint64_t key = pack(left, right);
        for (size_t i = hash(key);; i = (i + 1) & mask_) {
            if (slots_[i].key == key) return &slots_[i];
            if (slots_[i].key == kEmpty) return nullptr;
        }
    }

  private:
    static constexpr uint64_t kEmpty = ~uint64_t(0);
    static uint64_t pack(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
    size_t hash(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> 32) & mask_; }

    std::vector<Entry> slots_;
    size_t mask_ = 0;
};

// ---------------------------------------------------------------------------------------------------------------------
// Token text -> id, open addressing over ids; each slot keeps 32 bits of the hash so that most probes are settled
// without touching the string. Loading a vocabulary does ~400k lookups, which a node-based map made slow.
// ---------------------------------------------------------------------------------------------------------------------

class TextIndex {
  public:
    // Indexes text[id] for every id with include[id]; returns -1, or the earlier id of a duplicate text.
    template <typename Include>
    int32_t build(const std::vector<std::string> & text, Include include, int32_t * dup) {
        text_ = &text;
        size_t cap = 16;
        while (cap < text.size() * 2) cap *= 2;
        slots_.assign(cap, Slot{});
        mask_ = cap - 1;
        for (size_t id = 0; id < text.size(); ++id) {
            if (!include(id)) continue;
            const uint64_t h = hash(text[id]);
            size_t i = size_t(h) & mask_;
            for (; slots_[i].id >= 0; i = (i + 1) & mask_) {
                if (slots_[i].tag == uint32_t(h >> 32) && text[size_t(slots_[i].id)] == text[id]) {
                    *dup = slots_[i].id;
                    return int32_t(id);
                }
            }
            slots_[i] = Slot{uint32_t(h >> 32), int32_t(id)};
        }
        return -1;
    }

    int32_t find(std::string_view s) const {
        const uint64_t h = hash(s);
        for (size_t i = size_t(h) & mask_; slots_[i].id >= 0; i = (i + 1) & mask_)
            if (slots_[i].tag == uint32_t(h >> 32) && (*text_)[size_t(slots_[i].id)] == s) return slots_[i].id;
        return -1;
    }

  private:
    struct Slot {
        uint32_t tag = 0;
        int32_t id = -1;
    };
    static uint64_t hash(std::string_view s) { return std::hash<std::string_view>{}(s); }

    const std::vector<std::string> * text_ = nullptr;
    std::vector<Slot> slots_;
    size_t mask_ = 0;
};

// ---------------------------------------------------------------------------------------------------------------------
// Added-token trie: longest match at a position, over bytes.
// ---------------------------------------------------------------------------------------------------------------------

class AddedTrie {
  public:
    AddedTrie() : nodes_(1) { first_.fill(false); }

    bool empty() const { return nodes_.size() == 1; }

    void insert(std::string_view text, int32_t id) {
        first_[uint8_t(text[0])] = true;
        size_t node = 0;
        for (char ch : text) {
            const uint8_t c = uint8_t(ch);
            auto & kids = nodes_[node].children;
            auto it =
                std::lower_bound(kids.begin(), kids.end(), c, [](const auto & e, uint8_t v) { return e.first < v; });
            if (it != kids.end() && it->first == c) {
                node = it->second;
            } else {
                const uint32_t child = uint32_t(nodes_.size());
                kids.insert(it, {c, child});
                nodes_.emplace_back();  // may move `kids`; not used below
                node = child;
            }
        }
        nodes_[node].token = id;
    }

    // The longest token starting at s[pos]: its id and length, or {-1, 0}.
    std::pair<int32_t, size_t> longest(std::string_view s, size_t pos) const {
        if (!first_[uint8_t(s[pos])]) return {-1, 0};
        std::pair<int32_t, size_t> best{-1, 0};
        size_t node = 0;
        for (size_t i = pos; i < s.size(); ++i) {
            const uint8_t c = uint8_t(s[i]);
            const auto & kids = nodes_[node].children;
            auto it =
                std::lower_bound(kids.begin(), kids.end(), c, [](const auto & e, uint8_t v) { return e.first < v; });
            if (it == kids.end() || it->first != c) break;
            node = it->second;
            if (nodes_[node].token >= 0) best = {nodes_[node].token, i + 1 - pos};
        }
        return best;
    }

  private:
    struct Node {
        int32_t token = -1;
        std::vector<std::pair<uint8_t, uint32_t>> children;  // sorted by byte
    };
    std::vector<Node> nodes_;
    std::array<bool, 256> first_;  // bytes that start some token: most positions are rejected here
};

// Per-call memo of BPE results for short pieces (code and prose repeat their words): open addressing keyed by views
// into the text being encoded, so nothing is copied; it lives and dies with one encode call.
class PieceCache {
  public:
    static constexpr size_t kMaxPiece = 64;         // longer pieces are rare and cheap to recompute per byte
    static constexpr size_t kMaxEntries = 1 << 18;  // bounds the memory of one call on huge inputs

    // The cached ids of `piece` (hash `h`), or nullptr.
    const int32_t * find(std::string_view piece, uint64_t h, size_t * n) const {
        if (slots_.empty()) return nullptr;
        for (size_t i = size_t(h) & mask_; slots_[i].ptr; i = (i + 1) & mask_) {
            const Slot & e = slots_[i];
            if (e.tag == uint32_t(h >> 32) && e.len == piece.size() && std::memcmp(e.ptr, piece.data(), e.len) == 0) {
                *n = e.n;
                return ids_.data() + e.off;
            }
        }
        return nullptr;
    }

    void insert(std::string_view piece, uint64_t h, const int32_t * ids, size_t n) {
        if (used_ >= kMaxEntries) return;
        if ((used_ + 1) * 2 > slots_.size()) grow();
        size_t i = size_t(h) & mask_;
        while (slots_[i].ptr) i = (i + 1) & mask_;
        slots_[i] = Slot{piece.data(), uint32_t(piece.size()), uint32_t(h >> 32), uint32_t(ids_.size()), uint32_t(n)};
        ids_.insert(ids_.end(), ids, ids + n);
        ++used_;
    }

    static uint64_t hash(std::string_view piece) { return std::hash<std::string_view>{}(piece); }

  private:
    struct Slot {
        const char * ptr = nullptr;  // nullptr: empty
        uint32_t len = 0;
        uint32_t tag = 0;  // high half of the hash
        uint32_t off = 0;  // into ids_
        uint32_t n = 0;
    };

    void grow() {
        std::vector<Slot> old = std::move(slots_);
        slots_.assign(old.empty() ? 1024 : old.size() * 2, Slot{});
        mask_ = slots_.size() - 1;
        for (const Slot & e : old) {
            if (!e.ptr) continue;
            size_t i = size_t(hash(std::string_view(e.ptr, e.len))) & mask_;
            while (slots_[i].ptr) i = (i + 1) & mask_;
            slots_[i] = e;
        }
    }

    std::vector<Slot> slots_;
    size_t mask_ = 0;
    size_t used_ = 0;
    std::vector<int32_t> ids_;
};

constexpr uint8_t kKnownFlags = kAddedLstrip | kAddedRstrip | kAddedNormalized;

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Tokenizer state
// ---------------------------------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
    std::string source;                     // the file (or name) the vocabulary came from, for error messages
    std::vector<std::string> text;          // [n_vocab] as stored
    std::vector<std::string> bytes;         // [n_vocab] raw bytes (byte-decoded BPE tokens, literal added tokens)
    std::vector<TokenType> types;           // [n_vocab]
    std::vector<uint8_t> flags;             // [n_vocab] AddedTokenFlag bits
    TextIndex by_text;                      // over `text`, all but unused tokens
    std::array<int32_t, 256> byte_token{};  // the single-byte BPE token of each byte
    MergeTable merges;
    AddedTrie added[2];  // [0]: non-normalized tokens (HF's first pass), [1]: normalized ones
    SplitRegex split[kNumSplits];
    int32_t bos = -1, eos = -1;

    // Per-call scratch: regex match state, BPE buffers and the piece cache. Nothing here is shared between
    // calls, which is what makes encode() thread-safe.
    struct Scratch {
        std::unique_ptr<pcre2_match_data, Pcre2MatchDataDeleter> match{pcre2_match_data_create(1, nullptr)};
        std::unique_ptr<pcre2_match_context, Pcre2MatchContextDeleter> context;
        std::unique_ptr<pcre2_jit_stack, Pcre2JitStackDeleter> jit_stack;
        struct Symbol {
            int32_t id;    // -1 once merged into its left neighbour
            int32_t prev;  // index of the previous live symbol, -1 at the start
            int32_t next;  // index of the next live symbol, -1 at the end
        };
        std::vector<Symbol> symbols;
        std::vector<uint64_t> heap;  // (rank << 32 | left symbol index), a min-heap
        PieceCache cache;
        EncodeStats stats;
    };

    int match(Scratch & s, int index, std::string_view subject, size_t start) const;
    template <typename Emit>
    void pre_tokenize(Scratch & s, int level, std::string_view text, Emit & emit) const;
    void bpe(Scratch & s, std::string_view piece, std::vector<int32_t> & out) const;
    void encode_plain(Scratch & s, std::string_view text, std::vector<int32_t> & out) const;
    void encode_added(Scratch & s, std::string_view text, int pass, std::vector<int32_t> & out) const;
    void encode_valid(Scratch & s, std::string_view text, bool parse_special, std::vector<int32_t> & out) const;

    void check_id(int32_t id, std::string_view what) const {
        if (id < 0 || size_t(id) >= text.size())
            fail("{}: {} {} is out of range (the vocabulary has {} tokens)", source, what, id, text.size());
    }
};

// ---------------------------------------------------------------------------------------------------------------------
// Construction and validation
// ---------------------------------------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer &&) noexcept = default;
Tokenizer & Tokenizer::operator=(Tokenizer &&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_vocab(TokenizerVocab vocab, std::string source) {
    auto m = std::make_unique<Impl>();
    m->source = std::move(source);
    const std::string & src = m->source;
    const size_t n = vocab.tokens.size();
    if (n < 256 || n > size_t(std::numeric_limits<int32_t>::max()))
        fail("{}: tokenizer.ggml.tokens has {} entries; a byte-level vocabulary needs at least 256", src, n);
    if (vocab.types.size() != n)
        fail("{}: tokenizer.ggml.token_type has {} entries, tokenizer.ggml.tokens has {}", src, vocab.types.size(), n);
    if (!vocab.added_flags.empty() && vocab.added_flags.size() != n)
        fail("{}: dsv4.tokenizer.added_token_flags has {} entries, tokenizer.ggml.tokens has {}", src,
             vocab.added_flags.size(), n);

    const ByteMap & bm = byte_map();
    m->text = std::move(vocab.tokens);
    m->types = std::move(vocab.types);
    m->flags = vocab.added_flags.empty() ? std::vector<uint8_t>(n, 0) : std::move(vocab.added_flags);
    m->bytes.resize(n);
    for (size_t id = 0; id < n; ++id) {
        const std::string & t = m->text[id];
        const TokenType type = m->types[id];
        if (type != TokenType::normal && type != TokenType::control && type != TokenType::user_defined &&
            type != TokenType::unused)
            fail(
                "{}: tokenizer.ggml.token_type[{}] is {}; a gpt2 vocabulary uses 1 (normal), 3 (control), "
                "4 (user-defined) and 5 (unused)",
                src, id, int32_t(type));
        if (t.empty()) fail("{}: tokenizer.ggml.tokens[{}] is empty", src, id);
        const uint8_t flags = m->flags[id];
        if (flags & ~kKnownFlags)
            fail(
                "{}: dsv4.tokenizer.added_token_flags[{}] = {:#x} has unknown bits (known: lstrip 1, rstrip 2, "
                "normalized 4)",
                src, id, flags);
        if (flags && (type == TokenType::normal || type == TokenType::unused))
            fail("{}: dsv4.tokenizer.added_token_flags[{}] is set on a token that is not an added token", src, id);
        if (type == TokenType::normal) {
            // Byte-mapped: every code point must be one of the 256 the byte map produces.
            std::string raw;
            size_t i = 0, len = 0;
            while (i < t.size()) {
                if (utf8_sequence(reinterpret_cast<const uint8_t *>(t.data()) + i, t.size() - i, &len) != Utf8::valid)
                    fail("{}: tokenizer.ggml.tokens[{}] is not valid UTF-8", src, id);
                const uint32_t cp = next_code_point(t, i);
                if (cp >= bm.to_byte.size() || bm.to_byte[cp] < 0)
                    fail(
                        "{}: tokenizer.ggml.tokens[{}] ('{}') is a normal token but U+{:04X} is not a byte-mapped "
                        "code point",
                        src, id, t, cp);
                raw += char(bm.to_byte[cp]);
            }
            m->bytes[id] = std::move(raw);
        } else {
            m->bytes[id] = t;
        }
    }
    int32_t first = -1;
    const int32_t dup = m->by_text.build(
        m->text, [&](size_t id) { return m->types[id] != TokenType::unused; }, &first);
    if (dup >= 0)
        fail("{}: tokenizer.ggml.tokens[{}] and [{}] are both '{}'; token texts must be unique", src, first, dup,
             m->text[size_t(dup)]);

    // Every byte needs its single-byte BPE token, or some input could not be encoded.
    for (int b = 0; b < 256; ++b) {
        std::string s;
        append_utf8(s, bm.to_cp[b]);
        const int32_t id = m->by_text.find(s);
        if (id < 0 || m->types[size_t(id)] != TokenType::normal)
            fail("{}: no normal token for byte 0x{:02X} ('{}'): not a byte-level BPE vocabulary", src, b, s);
        m->byte_token[b] = id;
    }

    if (vocab.merges.size() > size_t(std::numeric_limits<int32_t>::max()))
        fail("{}: tokenizer.ggml.merges has {} entries, more than ids can number", src, vocab.merges.size());
    m->merges.reserve(vocab.merges.size());
    for (size_t r = 0; r < vocab.merges.size(); ++r) {
        const std::string & line = vocab.merges[r];
        const size_t sp = line.find(' ');
        if (sp == std::string::npos || sp == 0 || sp + 1 >= line.size() || line.find(' ', sp + 1) != std::string::npos)
            fail("{}: tokenizer.ggml.merges[{}] = '{}' is not two tokens joined by one space", src, r, line);
        const std::string_view left(line.data(), sp), right(line.data() + sp + 1, line.size() - sp - 1);
        auto lookup = [&](std::string_view tok) {
            const int32_t id = m->by_text.find(tok);
            if (id < 0 || m->types[size_t(id)] != TokenType::normal)
                fail("{}: tokenizer.ggml.merges[{}] = '{}': '{}' is not a normal token", src, r, line, tok);
            return id;
        };
        const int32_t a = lookup(left), b = lookup(right);
        const int32_t ab = lookup(std::string(left) + std::string(right));
        m->merges.insert(a, b, int32_t(r), ab);
    }

    // Added tokens: control and user-defined, in HF's two passes.
    for (size_t id = 0; id < n; ++id)
        if (m->types[id] == TokenType::control || m->types[id] == TokenType::user_defined)
            m->added[(m->flags[id] & kAddedNormalized) ? 1 : 0].insert(m->text[id], int32_t(id));

    auto check_special = [&](int32_t id, std::string_view key) {
        if (id < 0) return;
        if (size_t(id) >= n) fail("{}: {} = {} is out of range (vocabulary of {})", src, key, id, n);
        if (m->types[id] != TokenType::control)
            fail("{}: {} = {} ('{}') is not a control token", src, key, id, m->text[id]);
    };
    check_special(vocab.bos_id, "tokenizer.ggml.bos_token_id");
    check_special(vocab.eos_id, "tokenizer.ggml.eos_token_id");
    m->bos = vocab.bos_id;
    m->eos = vocab.eos_id;

    for (int i = 0; i < kNumSplits; ++i) m->split[i] = compile_split(i);
    return Tokenizer(std::move(m));
}

Tokenizer Tokenizer::from_gguf(const GgufFile & file) {
    const std::string & path = file.path();
    const std::string_view model = file.get_string("tokenizer.ggml.model");
    if (model != "gpt2")
        fail("{}: tokenizer.ggml.model is '{}'; dsv4 reads DeepSeek's byte-level BPE ('gpt2') only", path, model);
    // Both names select DeepSeek V3's three Split regexes (llama.cpp names V4's vocabulary "joyai-llm" after the
    // model whose test-text fingerprint it matches).
    const std::optional<std::string_view> pre = file.get_string_opt("tokenizer.ggml.pre");
    if (!pre) fail("{}: tokenizer.ggml.pre is missing (expected 'joyai-llm' or 'deepseek-v3')", path);
    if (*pre != "joyai-llm" && *pre != "deepseek-v3")
        fail("{}: tokenizer.ggml.pre is '{}'; dsv4 implements 'joyai-llm' and 'deepseek-v3' (the same splits)", path,
             *pre);

    TokenizerVocab v;
    const std::vector<std::string_view> tokens = file.get_string_array("tokenizer.ggml.tokens");
    v.tokens.assign(tokens.begin(), tokens.end());

    const std::vector<int64_t> types = file.get_int_array("tokenizer.ggml.token_type");
    v.types.reserve(types.size());
    for (size_t i = 0; i < types.size(); ++i) {
        if (types[i] < 0 || types[i] > 6)
            fail("{}: tokenizer.ggml.token_type[{}] = {} is not a llama.cpp token type", path, i, types[i]);
        v.types.push_back(TokenType(int32_t(types[i])));
    }

    const std::vector<std::string_view> merges = file.get_string_array("tokenizer.ggml.merges");
    v.merges.assign(merges.begin(), merges.end());

    if (file.has("dsv4.tokenizer.added_token_flags")) {
        const std::vector<int64_t> flags = file.get_int_array("dsv4.tokenizer.added_token_flags");
        v.added_flags.reserve(flags.size());
        for (size_t i = 0; i < flags.size(); ++i) {
            if (flags[i] < 0 || flags[i] > 255)
                fail("{}: dsv4.tokenizer.added_token_flags[{}] = {} is not a byte", path, i, flags[i]);
            v.added_flags.push_back(uint8_t(flags[i]));
        }
    }

    auto special_id = [&](std::string_view key) {
        const uint64_t id = file.get_u64(key);
        if (id >= tokens.size()) fail("{}: {} = {} is out of range (vocabulary of {})", path, key, id, tokens.size());
        return int32_t(id);
    };
    v.bos_id = special_id("tokenizer.ggml.bos_token_id");
    v.eos_id = special_id("tokenizer.ggml.eos_token_id");
    if (file.has("tokenizer.ggml.padding_token_id")) special_id("tokenizer.ggml.padding_token_id");

    if (const std::optional<std::string_view> arch = file.get_string_opt("general.architecture")) {
        const std::string key = std::string(*arch) + ".vocab_size";
        if (const std::optional<uint64_t> n = file.get_u64_opt(key); n && *n != tokens.size())
            fail("{}: {} is {} but tokenizer.ggml.tokens has {} entries", path, key, *n, tokens.size());
    }
    return from_vocab(std::move(v), path);
}

// ---------------------------------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------------------------------

int Tokenizer::Impl::match(Scratch & s, int index, std::string_view subject, size_t start) const {
    const SplitRegex & re = split[index];
    const auto * subj = reinterpret_cast<PCRE2_SPTR>(subject.data());
    for (;;) {
        ++s.stats.regex_calls;
        // The subject was validated as UTF-8 by the caller; the JIT entry point never re-checks it.
        const int rc =
            re.jit ? pcre2_jit_match(re.code.get(), subj, subject.size(), start, 0, s.match.get(), s.context.get())
                   : pcre2_match(re.code.get(), subj, subject.size(), start, PCRE2_NO_UTF_CHECK, s.match.get(),
                                 s.context.get());
        if (rc >= 0 || rc == PCRE2_ERROR_NOMATCH) return rc;
        // The default JIT stack (32 KiB) is enough for these patterns in all inputs we tried; a larger one is
        // made on demand rather than paid for by every call.
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !s.jit_stack) {
            s.jit_stack.reset(pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr));
            s.context.reset(pcre2_match_context_create(nullptr));
            if (!s.jit_stack || !s.context) fail("tokenizer: out of memory for the regex JIT stack");
            pcre2_jit_stack_assign(s.context.get(), nullptr, s.jit_stack.get());
            continue;
        }
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        fail("tokenizer: pre-tokenizer regex {} failed on a piece of {} bytes: {}", index, subject.size(),
             reinterpret_cast<const char *>(msg));
    }
}

// Split(Isolated) applied at `level` and below: matches and the gaps between them are pieces; each goes on to the
// next regex, and pieces past the last regex go to `emit`.
template <typename Emit>
void Tokenizer::Impl::pre_tokenize(Scratch & s, int level, std::string_view text, Emit & emit) const {
    if (level == kNumSplits) {
        emit(text);
        return;
    }
    size_t start = 0, pos = 0;
    while (pos < text.size()) {
        if (match(s, level, text, pos) == PCRE2_ERROR_NOMATCH) break;
        const PCRE2_SIZE * ov = pcre2_get_ovector_pointer(s.match.get());
        const size_t ms = ov[0], me = ov[1];
        if (me == ms) {  // no pattern here can match empty; step over one character to be safe
            next_code_point(text, pos);
            continue;
        }
        if (ms > start) pre_tokenize(s, level + 1, text.substr(start, ms - start), emit);
        pre_tokenize(s, level + 1, text.substr(ms, me - ms), emit);
        start = pos = me;
    }
    if (start < text.size()) pre_tokenize(s, level + 1, text.substr(start), emit);
}

// BPE over one piece: a doubly linked list of symbols and a min-heap of candidate merges keyed by (rank, position),
// so a piece of n bytes costs O(n log n) whatever its content. Stale heap entries are skipped when popped: an
// entry is live iff the symbols now at its position still form a pair of that rank.
void Tokenizer::Impl::bpe(Scratch & s, std::string_view piece, std::vector<int32_t> & out) const {
    ++s.stats.pieces;
    const size_t n = piece.size();
    if (n == 1) {
        out.push_back(byte_token[uint8_t(piece[0])]);
        return;
    }
    const bool cacheable = n <= PieceCache::kMaxPiece;
    const uint64_t h = cacheable ? PieceCache::hash(piece) : 0;
    if (cacheable) {
        size_t cached = 0;
        if (const int32_t * ids = s.cache.find(piece, h, &cached)) {
            out.insert(out.end(), ids, ids + cached);
            return;
        }
    }
    if (n > size_t(std::numeric_limits<int32_t>::max())) fail("tokenizer: a piece of {} bytes is too long", n);

    auto & sym = s.symbols;
    sym.resize(n);
    for (size_t i = 0; i < n; ++i)
        sym[i] = {byte_token[uint8_t(piece[i])], int32_t(i) - 1, i + 1 < n ? int32_t(i + 1) : -1};

    auto & heap = s.heap;
    heap.clear();
    const auto greater = std::greater<uint64_t>();
    auto push = [&](int32_t pos) {
        const int32_t next = sym[pos].next;
        if (next < 0) return;
        if (const MergeTable::Entry * e = merges.find(sym[pos].id, sym[next].id)) {
            heap.push_back((uint64_t(uint32_t(e->rank)) << 32) | uint32_t(pos));
            std::push_heap(heap.begin(), heap.end(), greater);
            ++s.stats.heap_ops;
        }
    };
    for (size_t i = 0; i + 1 < n; ++i) push(int32_t(i));

    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), greater);
        const uint64_t top = heap.back();
        heap.pop_back();
        ++s.stats.heap_ops;
        const int32_t rank = int32_t(top >> 32), pos = int32_t(uint32_t(top));
        auto & a = sym[pos];
        if (a.id < 0 || a.next < 0) continue;
        const MergeTable::Entry * e = merges.find(a.id, sym[a.next].id);
        if (!e || e->rank != rank) continue;
        auto & b = sym[a.next];
        a.id = e->id;
        a.next = b.next;
        if (b.next >= 0) sym[b.next].prev = pos;
        b.id = -1;
        if (a.prev >= 0) push(a.prev);
        push(pos);
    }

    const size_t first = out.size();
    for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
    if (cacheable) s.cache.insert(piece, h, out.data() + first, out.size() - first);
}

void Tokenizer::Impl::encode_plain(Scratch & s, std::string_view text, std::vector<int32_t> & out) const {
    auto emit = [&](std::string_view piece) { bpe(s, piece, out); };
    pre_tokenize(s, 0, text, emit);
}

// One of HF's added-token passes over valid UTF-8: leftmost-longest matches become their ids (with lstrip/rstrip
// absorbing neighbouring whitespace); the gaps go to the next pass, or to the pre-tokenizer after the last.
void Tokenizer::Impl::encode_added(Scratch & s, std::string_view text, int pass, std::vector<int32_t> & out) const {
    if (pass == 2) {
        encode_plain(s, text, out);
        return;
    }
    const AddedTrie & trie = added[pass];
    if (trie.empty()) {
        encode_added(s, text, pass + 1, out);
        return;
    }
    size_t done = 0, pos = 0;  // text[0, done) is emitted
    while (pos < text.size()) {
        const auto [id, len] = trie.longest(text, pos);
        if (id < 0) {
            ++pos;
            continue;
        }
        size_t ms = pos, me = pos + len;
        if (flags[id] & kAddedLstrip) {
            size_t start = 0;
            while (ms > done && is_white_space(prev_code_point(text, ms, &start))) ms = start;
        }
        if (flags[id] & kAddedRstrip) {
            size_t next = me;
            while (me < text.size() && is_white_space(next_code_point(text, next))) me = next;
        }
        if (ms > done) encode_added(s, text.substr(done, ms - done), pass + 1, out);
        out.push_back(id);
        done = pos = me;
    }
    if (done < text.size()) encode_added(s, text.substr(done), pass + 1, out);
}

void Tokenizer::Impl::encode_valid(Scratch & s, std::string_view text, bool parse_special,
                                   std::vector<int32_t> & out) const {
    if (text.empty()) return;
    if (parse_special)
        encode_added(s, text, 0, out);
    else
        encode_plain(s, text, out);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special, EncodeStats * stats) const {
    Impl::Scratch s;
    if (!s.match) fail("tokenizer: out of memory for regex match data");
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 16);
    // Split at invalid UTF-8: each byte of an ill-formed sequence becomes its single-byte token, and the valid
    // stretches around it are encoded on their own (PCRE2 only ever sees validated text).
    const auto * p = reinterpret_cast<const uint8_t *>(text.data());
    const size_t n = text.size();
    size_t start = 0, i = 0;
    while (i < n) {
        if (p[i] < 0x80) {
            ++i;
            continue;
        }
        size_t len = 0;
        if (utf8_sequence(p + i, n - i, &len) == Utf8::valid) {
            i += len;
            continue;
        }
        impl_->encode_valid(s, text.substr(start, i - start), parse_special, out);
        for (size_t k = i; k < i + len; ++k) out.push_back(impl_->byte_token[p[k]]);
        i += len;
        start = i;
    }
    impl_->encode_valid(s, text.substr(start), parse_special, out);
    if (stats) *stats = s.stats;
    return out;
}

std::vector<int32_t> Tokenizer::encode_pieces(const std::vector<TextPiece> & pieces) const {
    std::vector<int32_t> out;
    std::string run;  // adjacent text pieces, encoded together as HF would see them in the rendered string
    auto flush = [&] {
        if (run.empty()) return;
        const std::vector<int32_t> ids = encode(run, false);
        out.insert(out.end(), ids.begin(), ids.end());
        run.clear();
    };
    for (size_t i = 0; i < pieces.size(); ++i) {
        const TextPiece & piece = pieces[i];
        if (!piece.special) {
            run += piece.text;
            continue;
        }
        const int32_t id = token_id(piece.text);
        if (id < 0 || !is_special(id))
            fail("tokenizer ({}): chat piece {} ('{}') is marked special but is not the text of a special token",
                 impl_->source, i, piece.text);
        flush();
        out.push_back(id);
    }
    flush();
    return out;
}

// ---------------------------------------------------------------------------------------------------------------------
// Lookups and decoding
// ---------------------------------------------------------------------------------------------------------------------

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
    std::string out;
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= n_vocab())
            fail("tokenizer ({}): token id {} at index {} is out of range (the vocabulary has {} tokens)",
                 impl_->source, ids[i], i, n_vocab());
        out += impl_->bytes[size_t(ids[i])];
    }
    return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
    impl_->check_id(id, "token id");
    return impl_->bytes[size_t(id)];
}

std::string_view Tokenizer::token_text(int32_t id) const {
    impl_->check_id(id, "token id");
    return impl_->text[size_t(id)];
}

int32_t Tokenizer::token_id(std::string_view token_text) const { return impl_->by_text.find(token_text); }

TokenType Tokenizer::token_type(int32_t id) const {
    impl_->check_id(id, "token id");
    return impl_->types[size_t(id)];
}

bool Tokenizer::is_special(int32_t id) const {
    const TokenType t = token_type(id);
    return t == TokenType::control || t == TokenType::user_defined;
}

int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::n_vocab() const { return int32_t(impl_->text.size()); }

std::string Utf8StreamDecoder::push(int32_t id) { return push_bytes(tokenizer_->token_bytes(id)); }

std::string Utf8StreamDecoder::push_bytes(std::string_view bytes) {
    pending_ += bytes;
    std::string out;
    const auto * p = reinterpret_cast<const uint8_t *>(pending_.data());
    const size_t n = pending_.size();
    size_t i = 0;
    while (i < n) {
        size_t len = 0;
        const Utf8 st = utf8_sequence(p + i, n - i, &len);
        if (st == Utf8::incomplete) break;
        if (st == Utf8::valid)
            out.append(pending_, i, len);
        else
            out += kReplacement;
        i += len;
    }
    pending_.erase(0, i);
    return out;
}

std::string Utf8StreamDecoder::finish() {
    std::string out = pending_.empty() ? std::string() : std::string(kReplacement);
    pending_.clear();
    return out;
}

}  // namespace dsv4
