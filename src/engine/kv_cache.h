// The disk KV cache: session snapshots kept in a folder across requests and restarts, keyed by the rendered text
// they cover, so a request whose prompt starts with that text restores the state instead of prefilling it.
//
// One file per snapshot, named by a hash of its key text (xxh64, hex) + ".kv". Layout, little-endian:
//
//   header   64 bytes   magic "DSV4KVC1", u32 version, u32 reason, u64 model fingerprint, u64 tokens,
//                       u64 text bytes, u64 payload bytes, i64 created (unix seconds), u64 xxh64(header[0:56] + text)
//   text     the key text (the rendered prompt prefix), readable with `head -c`
//   payload  Session::snapshot() bytes (tokens, next-token logits, the KV state with its own checksum)
//   trailer  u64 xxh64 of everything before it
//
// Startup reads the headers and texts only (the index); the whole-file checksum is checked when a snapshot is
// loaded. save_queued() hands a snapshot to a writer thread, so the inference thread does not wait for the disk; the
// entry is found, and loaded from memory, while it waits. Writes are atomic (AtomicFileWriter: temporary file, fsync,
// rename). Files whose header or size is wrong, or whose checksum fails on load, are deleted with a warning; files of
// another model (fingerprint) or format version are left alone and ignored. The total size of our files stays within
// the budget by evicting the least recently used (file mtime, refreshed on every hit, so the order survives restarts).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace dsv4 {

// Why a snapshot was written (stored in the file; shown in logs).
enum class KvSaveReason : uint32_t { cold = 1, interval = 2, evict = 3, shutdown = 4 };
const char * kv_save_reason_name(KvSaveReason reason);

struct KvCacheStats {
    uint64_t files = 0;
    uint64_t bytes = 0;
    uint64_t hits = 0;    // snapshots restored
    uint64_t misses = 0;  // lookups that found nothing
    uint64_t writes = 0;
    uint64_t evictions = 0;
    uint64_t rejected = 0;  // files found corrupt or truncated (deleted)
    uint64_t queued = 0;    // snapshots waiting for the writer thread
};

class KvDiskCache {
  public:
    // Creates `dir` if needed and indexes it. budget_bytes bounds the files this cache writes.
    KvDiskCache(std::string dir, uint64_t budget_bytes, uint64_t fingerprint);
    ~KvDiskCache();  // writes what is queued first

    struct Match {
        std::string path;
        size_t text_bytes = 0;  // the entry's key is text[0:text_bytes] of the looked-up text
        int64_t n_tokens = 0;
    };
    // The entry with the longest key that is a prefix of `text` (ties: most recent); counts a miss when none.
    std::optional<Match> find(std::string_view text);
    // Reads and verifies the entry's payload; a bad file is deleted with a warning and nullopt returned. A hit
    // refreshes the entry's recency.
    std::optional<std::string> load(const Match & match);
    bool contains(std::string_view text) const;  // an entry with exactly this key
    // Writes (or replaces) the entry for `text`; then evicts least recently used entries, never this one, until
    // the budget holds. A snapshot larger than the whole budget is not written. Returns false when not written
    // (too large, or an I/O error, which is logged: the cache is an optimisation, never a reason to fail a request).
    bool save(std::string_view text, int64_t n_tokens, std::string_view payload, KvSaveReason reason);
    // save() on the writer thread: returns once the snapshot is queued. While queued it is found, contains() it, and
    // load() returns it from memory. Queued snapshots hold at most kMaxQueuedBytes, or one of any size: past that,
    // this waits for the writer (the memory stays bounded when the disk is slower than the snapshots). False when the
    // snapshot is larger than the whole budget (not queued).
    bool save_queued(std::string text, int64_t n_tokens, std::string payload, KvSaveReason reason);
    static constexpr uint64_t kMaxQueuedBytes = uint64_t(1) << 30;
    // Waits until every queued snapshot has been written (or has failed, which is logged).
    void flush();

    KvCacheStats stats() const;
    const std::string & dir() const { return dir_; }
    uint64_t budget() const { return budget_; }

  private:
    struct Entry {
        std::string path;
        std::string text;
        int64_t n_tokens = 0;
        uint64_t bytes = 0;
        int64_t last_used = 0;  // mtime, nanoseconds
    };
    // A snapshot waiting for the writer thread. The writer reads the front one without the lock while it writes
    // it (nothing changes a queued snapshot) and pops it once it is an entry.
    struct Queued {
        std::string path;
        std::string text;
        int64_t n_tokens = 0;
        std::string payload;
        KvSaveReason reason = KvSaveReason::cold;
        int64_t queued_at = 0;  // nanoseconds, its recency until written
    };
    void scan();
    void evict(const std::string & keep);
    void drop(size_t index, bool count_rejected);
    std::string path_of(std::string_view text) const;
    // save() with `lock` (of mutex_) not held on entry: writes the file without it, then takes it to add the entry and
    // returns holding it.
    bool store(std::string_view text, int64_t n_tokens, std::string_view payload, KvSaveReason reason,
               std::unique_lock<std::mutex> & lock);
    void write_queued();

    std::string dir_;
    uint64_t budget_;
    uint64_t fingerprint_;
    mutable std::mutex mutex_;
    std::vector<Entry> entries_;
    KvCacheStats stats_;
    std::deque<Queued> queue_;  // std::deque: appending keeps the front in place while the writer reads it
    uint64_t queued_bytes_ = 0;
    bool stopping_ = false;
    std::condition_variable queue_cv_;
    std::thread writer_;
};

}  // namespace dsv4
