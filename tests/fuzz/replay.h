// Replaying a fuzz corpus in the normal build: each fuzzer's LLVMFuzzerTestOneInput is linked into a unit test
// that feeds it every file of its corpus under tests/data (seeds and past finds), so CI keeps them fixed without
// clang. A failed check inside the entry point traps, which fails the test.
#pragma once

#include "util/file.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);

namespace dsv4::fuzz {

inline std::vector<std::filesystem::path> corpus_files(const std::string & dir) {
    std::vector<std::filesystem::path> files;
    for (const auto & e : std::filesystem::directory_iterator(dir))
        if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    return files;
}

// Every file through the entry point, each from a buffer of exactly its size, so a read past the input is past
// the allocation.
inline void replay_corpus(const std::string & dir, size_t min_files) {
    const auto files = corpus_files(dir);
    ASSERT_GE(files.size(), min_files) << "the corpus at " << dir << " looks incomplete";
    for (const auto & p : files) {
        SCOPED_TRACE(p.filename().string());
        const std::string bytes = read_file(p.string());
        std::vector<uint8_t> data(bytes.begin(), bytes.end());
        EXPECT_EQ(LLVMFuzzerTestOneInput(data.data(), data.size()), 0);
    }
}

}  // namespace dsv4::fuzz
