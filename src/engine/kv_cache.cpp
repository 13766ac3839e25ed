// The disk KV cache (kv_cache.h has the file layout and the policy).
#include "engine/kv_cache.h"

#include "util/error.h"
#include "util/file.h"
#include "util/log.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace dsv4 {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'D', 'S', 'V', '4', 'K', 'V', 'C', '1'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 64;
constexpr size_t kTrailerBytes = 8;
// A snapshot file's size: header, text, payload, trailer.
uint64_t file_bytes(uint64_t text_bytes, uint64_t payload_bytes) {
    return kHeaderBytes + text_bytes + payload_bytes + kTrailerBytes;
}
// A key text longer than this is refused when indexing (a corrupt length field must not allocate gigabytes).
constexpr uint64_t kMaxTextBytes = uint64_t(1) << 30;

struct Header {
    char magic[8];
    uint32_t version;
    uint32_t reason;
    uint64_t fingerprint;
    uint64_t n_tokens;
    uint64_t text_bytes;
    uint64_t payload_bytes;
    int64_t created;
    uint64_t checksum;  // xxh64 of the 56 bytes above and the text
};
static_assert(sizeof(Header) == kHeaderBytes);

uint64_t header_checksum(const Header & h, std::string_view text) {
    XXH64_state_t * s = XXH64_createState();
    XXH64_reset(s, 0);
    XXH64_update(s, &h, offsetof(Header, checksum));
    XXH64_update(s, text.data(), text.size());
    const uint64_t out = XXH64_digest(s);
    XXH64_freeState(s);
    return out;
}

int64_t mtime_ns(const std::string & path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return 0;
    return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// Recency lives in the file's mtime so that eviction order survives a restart. Saves set it too, from the same
// clock as a load's touch: the time the kernel stamps on a write is coarse (a scheduler tick, up to 10 ms), so a
// file written just after another was touched could otherwise look older than it.
void set_mtime_ns(const std::string & path, int64_t t) {
    const struct timespec times[2] = {{0, UTIME_OMIT}, {time_t(t / 1000000000), long(t % 1000000000)}};
    ::utimensat(AT_FDCWD, path.c_str(), times, 0);
}

}  // namespace

const char * kv_save_reason_name(KvSaveReason reason) {
    switch (reason) {
        case KvSaveReason::cold:
            return "cold";
        case KvSaveReason::interval:
            return "interval";
        case KvSaveReason::evict:
            return "evict";
        case KvSaveReason::shutdown:
            return "shutdown";
    }
    return "unknown";
}

KvDiskCache::KvDiskCache(std::string dir, uint64_t budget_bytes, uint64_t fingerprint)
    : dir_(std::move(dir)), budget_(budget_bytes), fingerprint_(fingerprint) {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    DSV4_CHECK(!ec && fs::is_directory(dir_), "--kv-disk-dir {}: cannot create the folder: {}", dir_, ec.message());
    scan();
    evict({});
}

// ---------------------------------------------------------------------------------------------------------------------
// Index
// ---------------------------------------------------------------------------------------------------------------------

void KvDiskCache::scan() {
    std::error_code ec;
    for (const fs::directory_entry & de : fs::directory_iterator(dir_, ec)) {
        const std::string path = de.path().string();
        const std::string name = de.path().filename().string();
        if (name.find(".kv.tmp.") != std::string::npos) {
            // A write that never committed (crash, power loss): never a valid snapshot.
            log_warn("kv cache: removing the unfinished write {}", path);
            fs::remove(de.path(), ec);
            continue;
        }
        if (de.path().extension() != ".kv" || !de.is_regular_file(ec)) continue;
        std::ifstream in(path, std::ios::binary);
        Header h{};
        const uint64_t size = de.file_size(ec);
        if (!in.read(reinterpret_cast<char *>(&h), sizeof h) || std::memcmp(h.magic, kMagic, 8) != 0) {
            if (size >= 8 && std::memcmp(h.magic, kMagic, 8) == 0) {
                log_warn("kv cache: {} is truncated inside its header; deleting it", path);
                fs::remove(de.path(), ec);
                ++stats_.rejected;
            } else {
                log_warn("kv cache: {} is not a dsv4 KV snapshot; ignoring it", path);
            }
            continue;
        }
        if (h.version != kVersion) {
            log_warn("kv cache: {} has format version {} (this build reads {}); ignoring it", path, h.version,
                     kVersion);
            continue;
        }
        if (h.fingerprint != fingerprint_) {
            log_warn("kv cache: {} was made with another model (fingerprint {:016x}); ignoring it", path,
                     h.fingerprint);
            continue;
        }
        const bool sizes_ok = h.text_bytes <= kMaxTextBytes && h.payload_bytes <= size &&
                              size == file_bytes(h.text_bytes, h.payload_bytes);
        std::string text;
        if (sizes_ok) {
            text.resize(size_t(h.text_bytes));
            in.read(text.data(), std::streamsize(text.size()));
        }
        if (!sizes_ok || !in || header_checksum(h, text) != h.checksum) {
            log_warn("kv cache: {} is truncated or corrupt ({} bytes); deleting it", path, size);
            fs::remove(de.path(), ec);
            ++stats_.rejected;
            continue;
        }
        entries_.push_back({path, std::move(text), int64_t(h.n_tokens), size, mtime_ns(path)});
        stats_.bytes += size;
    }
    stats_.files = entries_.size();
    if (!entries_.empty())
        log_info("kv cache: {} snapshots, {:.1f} MiB in {}", entries_.size(), double(stats_.bytes) / (1 << 20), dir_);
}

void KvDiskCache::drop(size_t index, bool count_rejected) {
    std::error_code ec;
    fs::remove(entries_[index].path, ec);
    stats_.bytes -= entries_[index].bytes;
    entries_.erase(entries_.begin() + std::ptrdiff_t(index));
    stats_.files = entries_.size();
    if (count_rejected) ++stats_.rejected;
}

void KvDiskCache::evict(const std::string & keep) {
    while (stats_.bytes > budget_) {
        size_t victim = entries_.size();
        for (size_t i = 0; i < entries_.size(); ++i) {
            if (entries_[i].path == keep) continue;
            if (victim == entries_.size() || entries_[i].last_used < entries_[victim].last_used) victim = i;
        }
        if (victim == entries_.size()) break;
        log_info("kv cache: evicting {} ({} tokens, {:.1f} MiB)", entries_[victim].path, entries_[victim].n_tokens,
                 double(entries_[victim].bytes) / (1 << 20));
        drop(victim, false);
        ++stats_.evictions;
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Lookup, load, save
// ---------------------------------------------------------------------------------------------------------------------

std::optional<KvDiskCache::Match> KvDiskCache::find(std::string_view text) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::optional<Match> best;
    int64_t best_used = 0;
    auto consider = [&](const std::string & path, const std::string & key, int64_t n_tokens, int64_t used) {
        if (key.size() > text.size() || text.compare(0, key.size(), key) != 0) return;
        if (!best || key.size() > best->text_bytes || (key.size() == best->text_bytes && used > best_used)) {
            best = Match{path, key.size(), n_tokens};
            best_used = used;
        }
    };
    // A queued snapshot replaces the file of the same key (what load() returns): the file is not a candidate then.
    for (const Entry & e : entries_)
        if (std::none_of(queue_.begin(), queue_.end(), [&](const Queued & q) { return q.path == e.path; }))
            consider(e.path, e.text, e.n_tokens, e.last_used);
    for (const Queued & q : queue_) consider(q.path, q.text, q.n_tokens, q.queued_at);
    if (!best) ++stats_.misses;
    return best;
}

std::optional<std::string> KvDiskCache::load(const Match & match) {
    std::lock_guard<std::mutex> lock(mutex_);
    // A queued snapshot is newer than a file of the same key: the latest queued one, from memory.
    for (auto q = queue_.rbegin(); q != queue_.rend(); ++q)
        if (q->path == match.path) {
            ++stats_.hits;
            return q->payload;
        }
    auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry & e) { return e.path == match.path; });
    if (it == entries_.end()) return std::nullopt;
    const size_t index = size_t(it - entries_.begin());
    std::string bytes;
    try {
        bytes = read_file(match.path);
    } catch (const Error & e) {
        log_warn("kv cache: {}; dropping the entry", e.what());
        drop(index, true);
        return std::nullopt;
    }
    Header h{};
    bool ok = bytes.size() >= kHeaderBytes + kTrailerBytes;
    if (ok) {
        std::memcpy(&h, bytes.data(), sizeof h);
        uint64_t stored = 0;
        std::memcpy(&stored, bytes.data() + bytes.size() - kTrailerBytes, 8);
        ok = std::memcmp(h.magic, kMagic, 8) == 0 && h.fingerprint == fingerprint_ &&
             bytes.size() == file_bytes(h.text_bytes, h.payload_bytes) &&
             XXH64(bytes.data(), bytes.size() - kTrailerBytes, 0) == stored &&
             std::string_view(bytes).substr(kHeaderBytes, size_t(h.text_bytes)) == it->text;
    }
    if (!ok) {
        log_warn("kv cache: {} is corrupt (checksum or size mismatch); deleting it", match.path);
        drop(index, true);
        return std::nullopt;
    }
    ++stats_.hits;
    const int64_t now = now_ns();
    set_mtime_ns(match.path, now);
    it->last_used = now;
    return bytes.substr(kHeaderBytes + size_t(h.text_bytes), size_t(h.payload_bytes));
}

bool KvDiskCache::contains(std::string_view text) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::any_of(entries_.begin(), entries_.end(), [&](const Entry & e) { return e.text == text; }) ||
           std::any_of(queue_.begin(), queue_.end(), [&](const Queued & q) { return q.text == text; });
}

std::string KvDiskCache::path_of(std::string_view text) const {
    return fmt::format("{}/{:016x}.kv", dir_, XXH64(text.data(), text.size(), 0));
}

bool KvDiskCache::save(std::string_view text, int64_t n_tokens, std::string_view payload, KvSaveReason reason) {
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    return store(text, n_tokens, payload, reason, lock);
}

bool KvDiskCache::store(std::string_view text, int64_t n_tokens, std::string_view payload, KvSaveReason reason,
                        std::unique_lock<std::mutex> & lock) {
    const uint64_t bytes = file_bytes(text.size(), payload.size());
    if (bytes > budget_) {
        log_info("kv cache: a {} snapshot of {} tokens ({:.1f} MiB) exceeds --kv-disk-space-mb; not saved",
                 kv_save_reason_name(reason), n_tokens, double(bytes) / (1 << 20));
        lock.lock();
        return false;
    }
    const std::string path = path_of(text);
    Header h{};
    std::memcpy(h.magic, kMagic, 8);
    h.version = kVersion;
    h.reason = uint32_t(reason);
    h.fingerprint = fingerprint_;
    h.n_tokens = uint64_t(n_tokens);
    h.text_bytes = text.size();
    h.payload_bytes = payload.size();
    h.created = now_ns() / 1000000000;
    h.checksum = header_checksum(h, text);
    try {
        AtomicFileWriter out(path);
        XXH64_state_t * s = XXH64_createState();
        XXH64_reset(s, 0);
        auto put = [&](const void * p, size_t n) {
            out.write(p, n);
            XXH64_update(s, p, n);
        };
        put(&h, sizeof h);
        put(text.data(), text.size());
        put(payload.data(), payload.size());
        const uint64_t sum = XXH64_digest(s);
        XXH64_freeState(s);
        out.write(&sum, sizeof sum);
        out.commit();
        set_mtime_ns(path, now_ns());
    } catch (const Error & e) {
        log_warn("kv cache: cannot save a snapshot: {}", e.what());
        lock.lock();
        return false;
    }
    lock.lock();
    auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry & e) { return e.path == path; });
    if (it != entries_.end()) {
        stats_.bytes -= it->bytes;
        entries_.erase(it);
    }
    entries_.push_back({path, std::string(text), n_tokens, bytes, mtime_ns(path)});
    stats_.bytes += bytes;
    stats_.files = entries_.size();
    ++stats_.writes;
    log_info("kv cache: saved {} ({} snapshot, {} tokens, {:.1f} MiB)", path, kv_save_reason_name(reason), n_tokens,
             double(bytes) / (1 << 20));
    evict(path);
    return true;
}

bool KvDiskCache::save_queued(std::string text, int64_t n_tokens, std::string payload, KvSaveReason reason) {
    const uint64_t bytes = file_bytes(text.size(), payload.size());
    if (bytes > budget_) return save(text, n_tokens, payload, reason);  // refused there, with the log line
    std::unique_lock<std::mutex> lock(mutex_);
    queue_cv_.wait(lock, [&] { return queue_.empty() || queued_bytes_ + bytes <= kMaxQueuedBytes; });
    std::string path = path_of(text);
    queue_.push_back({std::move(path), std::move(text), n_tokens, std::move(payload), reason, now_ns()});
    queued_bytes_ += bytes;
    if (!writer_.joinable()) writer_ = std::thread([this] { write_queued(); });
    queue_cv_.notify_all();
    return true;
}

void KvDiskCache::write_queued() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, everything written
        const Queued & q = queue_.front();
        lock.unlock();
        // Failures are logged. store() takes the lock back to add the entry, and the snapshot leaves the queue under
        // the same hold: a lookup finds it queued until it is an entry (or gone, when the write failed).
        store(q.text, q.n_tokens, q.payload, q.reason, lock);
        queued_bytes_ -= file_bytes(q.text.size(), q.payload.size());
        queue_.pop_front();
        queue_cv_.notify_all();
    }
}

void KvDiskCache::flush() {
    std::unique_lock<std::mutex> lock(mutex_);
    queue_cv_.wait(lock, [&] { return queue_.empty(); });
}

KvDiskCache::~KvDiskCache() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    queue_cv_.notify_all();
    if (writer_.joinable()) writer_.join();
}

KvCacheStats KvDiskCache::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    KvCacheStats s = stats_;
    s.queued = queue_.size();
    return s;
}

}  // namespace dsv4
