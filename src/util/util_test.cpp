#include "util/aligned.h"
#include "util/error.h"
#include "util/file.h"
#include "util/half.h"
#include "util/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <unistd.h>
#include <vector>

using namespace dsv4;

TEST(ThreadPool, EveryTaskRunsOnce) {
    for (int threads : {1, 2, 4}) {
        ThreadPool pool(threads);
        for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(1000)}) {
            std::vector<std::atomic<int>> hits(n);
            for (int rep = 0; rep < 50; ++rep) pool.run(n, [&](size_t i, int t) {
                ASSERT_GE(t, 0);
                ASSERT_LT(t, threads);
                hits[i]++;
            });
            for (size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 50);
        }
    }
}

TEST(ThreadPool, ParallelForCoversRangeAndNestsSerially) {
    ThreadPool pool(3);
    std::vector<int> seen(1001, 0);
    pool.parallel_for(seen.size(), 10, [&](size_t b, size_t e, int) {
        for (size_t i = b; i < e; ++i) seen[i]++;
        pool.run(2, [&](size_t, int) {});  // nested: must not deadlock
    });
    for (int v : seen) EXPECT_EQ(v, 1);
}

TEST(Half, F16RoundTripAndRounding) {
    for (uint32_t h = 0; h < 0x10000; ++h) {
        float f = f16_to_f32(uint16_t(h));
        if (std::isnan(f)) continue;
        EXPECT_EQ(f32_to_f16(f), uint16_t(h)) << h;
    }
    EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
    EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
    EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);                // rounds to inf
    EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
    EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
    EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);   // tie below the smallest subnormal -> even (0)
    EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -26)), 0x0001);
}

TEST(Half, Bf16) {
    EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
    EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
    EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f808000)), 0x3f80);  // tie to even
    EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f818000)), 0x3f82);
    EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(Files, AtomicWriteAndMap) {
    auto dir = std::filesystem::temp_directory_path() / ("dsv4_util_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    std::string path = (dir / "a.bin").string();
    {
        AtomicFileWriter w(path);
        w.write("hello ");
        w.write_zeros(3);
        EXPECT_FALSE(std::filesystem::exists(path));  // nothing under the final name before commit
        w.commit();
    }
    MappedFile m(path);
    ASSERT_EQ(m.size(), 9u);
    EXPECT_EQ(std::string(reinterpret_cast<const char *>(m.data()), 6), "hello ");
    {
        AtomicFileWriter w(path);
        w.write("abandoned");
    }
    EXPECT_EQ(read_file(path).size(), 9u);  // an uncommitted writer leaves the old file alone
    size_t files = 0;
    for (auto & e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
    EXPECT_EQ(files, 1u);  // and removes its temporary
    EXPECT_THROW(MappedFile((dir / "missing").string()), Error);
    std::filesystem::remove_all(dir);
}

TEST(Aligned, Alignment) {
    AlignedBuffer b(100);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
    b.reserve(50);
    EXPECT_EQ(b.size(), 100u);
}
