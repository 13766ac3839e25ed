// Files: read-only memory maps (model weights are used in place, never copied), whole-file reads, and
// atomic writes (temporary file in the same folder, fsync, rename, fsync of the folder) so that a crash
// or a full disk never leaves a half-written model or KV snapshot under the final name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dsv4 {

class MappedFile {
  public:
    MappedFile() = default;
    explicit MappedFile(const std::string & path);  // throws dsv4::Error naming the path
    ~MappedFile();
    MappedFile(MappedFile && other) noexcept;
    MappedFile & operator=(MappedFile && other) noexcept;
    MappedFile(const MappedFile &) = delete;
    MappedFile & operator=(const MappedFile &) = delete;

    const uint8_t * data() const { return data_; }
    size_t size() const { return size_; }
    const std::string & path() const { return path_; }

    // Hints that the range will be read soon (MADV_WILLNEED); harmless when the range is out of bounds.
    void prefetch(size_t offset, size_t bytes) const;

  private:
    std::string path_;
    const uint8_t * data_ = nullptr;
    size_t size_ = 0;
};

std::string read_file(const std::string & path);  // throws dsv4::Error naming the path

// A numeric field of a /proc file of "Key: value [kB]" lines (MemAvailable in /proc/meminfo, VmRSS in
// /proc/self/status), in bytes when the value is in kB; 0 when the file or the key is missing.
uint64_t proc_field(const char * file, const char * key);

// Writes a file atomically. Data goes to "<path>.tmp.<pid>.<n>" first; commit() flushes, fsyncs and
// renames it over `path`. Destroying an uncommitted writer removes the temporary file.
class AtomicFileWriter {
  public:
    explicit AtomicFileWriter(const std::string & path);
    ~AtomicFileWriter();
    AtomicFileWriter(const AtomicFileWriter &) = delete;
    AtomicFileWriter & operator=(const AtomicFileWriter &) = delete;

    void write(const void * data, size_t bytes);
    void write(std::string_view text) { write(text.data(), text.size()); }
    void write_zeros(size_t bytes);
    uint64_t bytes_written() const { return written_; }
    void commit();
    const std::string & path() const { return path_; }

  private:
    void flush_buffer();

    std::string path_;
    std::string tmp_path_;
    int fd_ = -1;
    uint64_t written_ = 0;
    std::string buffer_;  // coalesces small writes; flushed at 8 MiB
    bool committed_ = false;
};

void write_file_atomic(const std::string & path, std::string_view contents);

}  // namespace dsv4
