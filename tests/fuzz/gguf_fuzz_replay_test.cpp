// Replays the GGUF fuzz corpus (tests/data/gguf/corpus) through the fuzz entry point in the normal build. The
// file name says what each seed must do: "valid-*" parses, "bad-*" is refused with a dsv4::Error naming the
// file, anything else (inputs the fuzzer found) only has to come back without crashing.
#include "format/gguf.h"
#include "util/error.h"
#include "util/file.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);

namespace {

namespace fs = std::filesystem;

const std::string kCorpus = std::string(DSV4_TEST_DATA) + "/gguf/corpus";

std::vector<fs::path> corpus_files() {
    std::vector<fs::path> files;
    for (const auto & e : fs::directory_iterator(kCorpus))
        if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    return files;
}

bool starts_with(const std::string & s, std::string_view prefix) { return s.rfind(prefix, 0) == 0; }

TEST(GgufFuzzReplay, EveryCorpusFileComesBack) {
    const auto files = corpus_files();
    ASSERT_GE(files.size(), 50u) << "the corpus at " << kCorpus << " looks incomplete";
    for (const fs::path & p : files) {
        SCOPED_TRACE(p.filename().string());
        const std::string bytes = dsv4::read_file(p.string());
        // A copy in a buffer of exactly the file's size, so any read past the end is past the allocation.
        std::vector<uint8_t> data(bytes.begin(), bytes.end());
        EXPECT_EQ(LLVMFuzzerTestOneInput(data.data(), data.size()), 0);
    }
}

TEST(GgufFuzzReplay, SeedsBehaveAsNamed) {
    int n_valid = 0, n_bad = 0;
    for (const fs::path & p : corpus_files()) {
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
