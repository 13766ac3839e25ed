// Replays the tokenizer fuzz corpus (tests/data/fuzz/tokenizer: seeds of every script and kind of byte the tokenizer
// meets, and the fuzzer's finds) through the fuzz entry point in the normal build.
#include "fuzz/replay.h"

#include <string>

namespace {

TEST(TokenizerFuzzReplay, EveryCorpusFileComesBack) {
    dsv4::fuzz::replay_corpus(std::string(DSV4_TEST_DATA) + "/fuzz/tokenizer", 8);
}

}  // namespace
