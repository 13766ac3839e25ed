// libFuzzer entry point for the V4 tokenizer (the committed vocabulary, data/vocab) on arbitrary bytes: a prompt of
// /v1/completions or the command line reaches encode() raw, invalid UTF-8 included. What must hold, or the run traps:
//   - decode(encode(x)) == x, with special tokens recognised (the raw rule) and without (chat text);
//   - the work stays linear: at most 6 BPE heap operations per byte and 3 regex calls per pre-tokenizer piece
//     (tokenizer_test's LongRunsAreLinear bound);
//   - streaming the ids through Utf8StreamDecoder gives valid UTF-8, and gives x itself when x is valid UTF-8.
#include "format/gguf.h"
#include "fuzz/fuzz_check.h"
#include "text/tokenizer.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace dsv4;

const Tokenizer & vocabulary() {
    static const Tokenizer tok = Tokenizer::from_gguf(GgufFile::open(DSV4_VOCAB_GGUF));
    return tok;
}

// Well-formed UTF-8 (RFC 3629: no overlongs, no surrogates, nothing past U+10FFFF).
bool valid_utf8(std::string_view s) {
    for (size_t i = 0; i < s.size();) {
        const uint8_t c = uint8_t(s[i]);
        size_t n;
        uint32_t cp;
        if (c < 0x80) {
            ++i;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            n = 2, cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 3, cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 4, cp = c & 0x07;
        } else {
            return false;
        }
        if (i + n > s.size()) return false;
        for (size_t k = 1; k < n; ++k) {
            const uint8_t b = uint8_t(s[i + k]);
            if ((b & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (b & 0x3F);
        }
        if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += n;
    }
    return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const Tokenizer & tok = vocabulary();
    const std::string_view text(reinterpret_cast<const char *>(data), size);
    for (const bool parse_special : {true, false}) {
        EncodeStats st;
        const std::vector<int32_t> ids = tok.encode(text, parse_special, &st);
        FUZZ_CHECK(tok.decode(ids) == text);
        FUZZ_CHECK(st.heap_ops <= 6 * size);
        FUZZ_CHECK(st.regex_calls <= 3 * st.pieces + 16);

        Utf8StreamDecoder decoder(tok);
        std::string streamed;
        for (int32_t id : ids) streamed += decoder.push(id);
        streamed += decoder.finish();
        FUZZ_CHECK(valid_utf8(streamed));
        if (valid_utf8(text)) FUZZ_CHECK(streamed == text);
    }
    return 0;
}
