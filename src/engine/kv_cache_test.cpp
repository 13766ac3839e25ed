// The disk KV cache: lookups by text prefix, persistence across instances, atomic writes, corrupt / truncated /
// foreign files, and eviction within the budget.
#include "engine/kv_cache.h"

#include "util/file.h"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

class KvCacheTest : public ::testing::Test {
  protected:
    void SetUp() override {
        dir_ = fs::temp_directory_path() / ("dsv4_kv_cache_test_" + std::to_string(::getpid()) + "_" +
                                            ::testing::UnitTest::GetInstance()->current_test_info()->name());
        fs::remove_all(dir_);
    }
    void TearDown() override { fs::remove_all(dir_); }

    std::vector<fs::path> files() const {
        std::vector<fs::path> out;
        for (const auto & e : fs::directory_iterator(dir_)) out.push_back(e.path());
        std::sort(out.begin(), out.end());
        return out;
    }
    static std::string payload(size_t n, char c) { return std::string(n, c); }

    fs::path dir_;
};

constexpr uint64_t kFp = 0x1234;
constexpr uint64_t kBig = uint64_t(1) << 30;

TEST_F(KvCacheTest, FindsTheLongestPrefixAndLoadsItsPayload) {
    KvDiskCache cache(dir_.string(), kBig, kFp);
    EXPECT_FALSE(cache.find("anything"));
    EXPECT_EQ(cache.stats().misses, 1u);
    ASSERT_TRUE(cache.save("<bos>system", 3, payload(100, 'a'), KvSaveReason::cold));
    ASSERT_TRUE(cache.save("<bos>system<user>hello", 7, payload(200, 'b'), KvSaveReason::evict));
    ASSERT_TRUE(cache.save("<bos>other", 2, payload(50, 'c'), KvSaveReason::cold));

    auto m = cache.find("<bos>system<user>hello<assistant>");
    ASSERT_TRUE(m);
    EXPECT_EQ(m->text_bytes, std::string("<bos>system<user>hello").size());
    EXPECT_EQ(m->n_tokens, 7);
    EXPECT_EQ(cache.load(*m), payload(200, 'b'));

    m = cache.find("<bos>system<user>bye");
    ASSERT_TRUE(m);
    EXPECT_EQ(m->n_tokens, 3);
    EXPECT_EQ(cache.load(*m), payload(100, 'a'));

    EXPECT_FALSE(cache.find("<bos>syst"));  // a key longer than the text is no prefix of it
    EXPECT_TRUE(cache.contains("<bos>other"));
    EXPECT_FALSE(cache.contains("<bos>othe"));
    EXPECT_EQ(cache.stats().files, 3u);
    EXPECT_EQ(cache.stats().hits, 2u);
}

TEST_F(KvCacheTest, SurvivesARestartAndReplacesSameKey) {
    {
        KvDiskCache cache(dir_.string(), kBig, kFp);
        ASSERT_TRUE(cache.save("prefix", 4, payload(64, 'x'), KvSaveReason::shutdown));
        ASSERT_TRUE(cache.save("prefix", 5, payload(80, 'y'), KvSaveReason::shutdown));  // same key: replaced
        EXPECT_EQ(cache.stats().files, 1u);
    }
    KvDiskCache again(dir_.string(), kBig, kFp);
    EXPECT_EQ(again.stats().files, 1u);
    auto m = again.find("prefix and more");
    ASSERT_TRUE(m);
    EXPECT_EQ(m->n_tokens, 5);
    EXPECT_EQ(again.load(*m), payload(80, 'y'));
}

TEST_F(KvCacheTest, WritesAreAtomicAndUnfinishedWritesAreRemoved) {
    KvDiskCache cache(dir_.string(), kBig, kFp);
    ASSERT_TRUE(cache.save("text", 1, payload(1000, 'p'), KvSaveReason::cold));
    ASSERT_EQ(files().size(), 1u);  // no temporary file left behind
    EXPECT_EQ(files()[0].extension(), ".kv");
    // A crash mid-write leaves the temporary file of AtomicFileWriter, never a file under the final name.
    const fs::path tmp = files()[0].string() + ".tmp.999.0";
    fs::copy_file(files()[0], tmp);
    { std::ofstream(tmp, std::ios::binary | std::ios::app) << "partial"; }
    KvDiskCache again(dir_.string(), kBig, kFp);
    EXPECT_FALSE(fs::exists(tmp));
    EXPECT_EQ(again.stats().files, 1u);
}

TEST_F(KvCacheTest, CorruptPayloadIsRejectedOnLoadAndDeleted) {
    KvDiskCache cache(dir_.string(), kBig, kFp);
    ASSERT_TRUE(cache.save("key text", 3, payload(4096, 'k'), KvSaveReason::cold));
    const fs::path file = files()[0];
    {
        std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
        f.seekp(64 + 8 + 2000);  // inside the payload
        f.put('!');
    }
    KvDiskCache again(dir_.string(), kBig, kFp);  // the header and text are fine: indexed
    auto m = again.find("key text, continued");
    ASSERT_TRUE(m);
    EXPECT_FALSE(again.load(*m));
    EXPECT_FALSE(fs::exists(file));
    EXPECT_EQ(again.stats().rejected, 1u);
    EXPECT_EQ(again.stats().files, 0u);
    EXPECT_FALSE(again.find("key text, continued"));
}

TEST_F(KvCacheTest, CorruptHeaderOrTextAndTruncatedFilesAreDeletedAtStartup) {
    {
        KvDiskCache cache(dir_.string(), kBig, kFp);
        ASSERT_TRUE(cache.save("aaaa", 1, payload(500, '1'), KvSaveReason::cold));
        ASSERT_TRUE(cache.save("bbbb", 1, payload(500, '2'), KvSaveReason::cold));
        ASSERT_TRUE(cache.save("cccc", 1, payload(500, '3'), KvSaveReason::cold));
    }
    std::vector<fs::path> f = files();
    ASSERT_EQ(f.size(), 3u);
    std::string a = read_file(f[0].string()), b = read_file(f[1].string());
    a[64 + 1] ^= 0x20;  // the key text
    write_file_atomic(f[0].string(), a);
    write_file_atomic(f[1].string(), b.substr(0, b.size() - 100));  // truncated
    fs::resize_file(f[2], 30);                                      // cut inside the header
    KvDiskCache again(dir_.string(), kBig, kFp);
    EXPECT_EQ(again.stats().files, 0u);
    EXPECT_EQ(again.stats().rejected, 3u);
    EXPECT_TRUE(files().empty());
}

TEST_F(KvCacheTest, ForeignAndUnrelatedFilesAreIgnoredNotDeleted) {
    {
        KvDiskCache other_model(dir_.string(), kBig, kFp + 1);
        ASSERT_TRUE(other_model.save("shared prefix", 2, payload(100, 'o'), KvSaveReason::cold));
    }
    { std::ofstream(dir_ / "notes.kv") << "not a snapshot at all, but long enough to hold a header ........."; }
    KvDiskCache cache(dir_.string(), kBig, kFp);
    EXPECT_EQ(cache.stats().files, 0u);
    EXPECT_EQ(cache.stats().rejected, 0u);
    EXPECT_FALSE(cache.find("shared prefix and more"));
    EXPECT_EQ(files().size(), 2u);
}

TEST_F(KvCacheTest, EvictsLeastRecentlyUsedWithinTheBudget) {
    // Each file: 64 header + 1 text + 1000 payload + 8 trailer = 1073 bytes; the budget holds two.
    const uint64_t budget = 2 * 1073 + 500;
    KvDiskCache cache(dir_.string(), budget, kFp);
    ASSERT_TRUE(cache.save("a", 1, payload(1000, 'a'), KvSaveReason::cold));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(cache.save("b", 1, payload(1000, 'b'), KvSaveReason::cold));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(cache.load(*cache.find("a...")));  // "a" is now the most recent
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(cache.save("c", 1, payload(1000, 'c'), KvSaveReason::cold));
    EXPECT_EQ(cache.stats().files, 2u);
    EXPECT_LE(cache.stats().bytes, budget);
    EXPECT_EQ(cache.stats().evictions, 1u);
    EXPECT_TRUE(cache.contains("a"));
    EXPECT_FALSE(cache.contains("b"));
    EXPECT_TRUE(cache.contains("c"));
    EXPECT_EQ(files().size(), 2u);

    // The order lives in the files: a restart with a smaller budget keeps the most recent.
    KvDiskCache smaller(dir_.string(), 1073 + 10, kFp);
    EXPECT_EQ(smaller.stats().files, 1u);
    EXPECT_TRUE(smaller.contains("c"));
}

TEST_F(KvCacheTest, ASnapshotLargerThanTheBudgetIsNotWritten) {
    KvDiskCache cache(dir_.string(), 2000, kFp);
    EXPECT_FALSE(cache.save("huge", 9, payload(5000, 'h'), KvSaveReason::cold));
    EXPECT_FALSE(cache.save_queued("huge", 9, payload(5000, 'h'), KvSaveReason::cold));
    cache.flush();
    EXPECT_EQ(cache.stats().files, 0u);
    EXPECT_TRUE(files().empty());
}

// Queued snapshots: found and loaded at once (the newest of a key wins, queued or written), written by the writer
// thread, and written before the cache is destroyed.
TEST_F(KvCacheTest, QueuedSnapshotsAreServedAtOnceAndWritten) {
    {
        KvDiskCache cache(dir_.string(), kBig, kFp);
        ASSERT_TRUE(cache.save_queued("prefix", 4, payload(64, 'x'), KvSaveReason::interval));
        ASSERT_TRUE(cache.save_queued("prefix", 5, payload(80, 'y'), KvSaveReason::interval));
        ASSERT_TRUE(cache.save_queued("other", 2, payload(16, 'o'), KvSaveReason::evict));
        for (int i = 0; i < 3; ++i) {  // before, during and after the writes
            EXPECT_TRUE(cache.contains("prefix"));
            auto m = cache.find("prefix and more");
            ASSERT_TRUE(m);
            EXPECT_EQ(m->n_tokens, 5);
            EXPECT_EQ(cache.load(*m), payload(80, 'y'));
            if (i == 1) cache.flush();
        }
        const KvCacheStats s = cache.stats();
        EXPECT_EQ(s.queued, 0u);
        EXPECT_EQ(s.writes, 3u);
        EXPECT_EQ(s.files, 2u);
        ASSERT_TRUE(cache.save_queued("last", 1, payload(8, 'l'), KvSaveReason::shutdown));
    }  // destroyed with "last" perhaps still queued
    KvDiskCache again(dir_.string(), kBig, kFp);
    EXPECT_EQ(again.stats().files, 3u);
    auto m = again.find("prefix");
    ASSERT_TRUE(m);
    EXPECT_EQ(again.load(*m), payload(80, 'y'));
    m = again.find("last");
    ASSERT_TRUE(m);
    EXPECT_EQ(again.load(*m), payload(8, 'l'));
}

// Lookups while the writer works: every load returns the payload of the key it found, whether the snapshot is still
// queued, being written or written.
TEST_F(KvCacheTest, LookupsDuringWritesSeeWholeSnapshots) {
    KvDiskCache cache(dir_.string(), kBig, kFp);
    constexpr int kKeys = 40;
    auto key = [](int i) { return "key " + std::to_string(i) + ";"; };
    std::atomic<bool> produced{false};
    std::thread producer([&] {
        for (int i = 0; i < kKeys; ++i)
            cache.save_queued(key(i), i + 1, payload(size_t(4096 + i), char('a' + i % 26)), KvSaveReason::interval);
        produced = true;
    });
    int checked = 0;
    for (bool last = false; !last;) {
        last = produced.load();  // one more round after the last snapshot was queued
        for (int i = 0; i < kKeys; ++i)
            if (auto m = cache.find(key(i) + " more")) {
                ASSERT_EQ(m->n_tokens, i + 1);
                const std::optional<std::string> bytes = cache.load(*m);
                ASSERT_TRUE(bytes);
                ASSERT_EQ(*bytes, payload(size_t(4096 + i), char('a' + i % 26))) << key(i);
                ++checked;
            }
    }
    producer.join();
    cache.flush();
    EXPECT_GT(checked, 0);
    EXPECT_EQ(cache.stats().files, uint64_t(kKeys));
    EXPECT_EQ(files().size(), size_t(kKeys));
}

}  // namespace
}  // namespace dsv4
