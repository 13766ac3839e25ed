// Replays the GGUF fuzz corpus (tests/data/gguf/corpus) through the fuzz entry point in the normal build. The
// file name says what each seed must do: "valid-*" parses, "bad-*" is refused with a dsv4::Error naming the
// file, anything else (inputs the fuzzer found) only has to come back without crashing.
#include "format/gguf.h"
#include "fuzz/replay.h"
#include "util/error.h"

#include <string>
#include <vector>

namespace {

using dsv4::fuzz::corpus_files;

const std::string kCorpus = std::string(DSV4_TEST_DATA) + "/gguf/corpus";

bool starts_with(const std::string & s, std::string_view prefix) { return s.rfind(prefix, 0) == 0; }

TEST(GgufFuzzReplay, EveryCorpusFileComesBack) { dsv4::fuzz::replay_corpus(kCorpus, 50); }

TEST(GgufFuzzReplay, SeedsBehaveAsNamed) {
    int n_valid = 0, n_bad = 0;
    for (const auto & p : corpus_files(kCorpus)) {
        const std::string name = p.filename().string();
        SCOPED_TRACE(name);
        const std::string bytes = dsv4::read_file(p.string());
        const auto * data = reinterpret_cast<const uint8_t *>(bytes.data());
        if (starts_with(name, "valid-")) {
            ++n_valid;
            EXPECT_NO_THROW(dsv4::GgufFile::parse(data, bytes.size(), name));
        } else if (starts_with(name, "bad-")) {
            ++n_bad;
            try {
                dsv4::GgufFile::parse(data, bytes.size(), name);
                ADD_FAILURE() << "parsed without an error";
            } catch (const dsv4::Error & e) {
                EXPECT_NE(std::string(e.what()).find(name + ": "), std::string::npos) << e.what();
            }
        }
    }
    EXPECT_GE(n_valid, 3);
    EXPECT_GE(n_bad, 40);
}

TEST(GgufFuzzReplay, GgufPyFixture) {
    const std::string bytes = dsv4::read_file(std::string(DSV4_TEST_DATA) + "/gguf/tiny-deepseek4.gguf");
    std::vector<uint8_t> data(bytes.begin(), bytes.end());
    EXPECT_EQ(LLVMFuzzerTestOneInput(data.data(), data.size()), 0);
}

}  // namespace
