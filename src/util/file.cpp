#include "util/file.h"

#include "util/error.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace dsv4 {

static std::string errno_text() { return std::strerror(errno); }

MappedFile::MappedFile(const std::string & path) : path_(path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("{}: cannot open: {}", path, errno_text());
    struct stat st;
    if (::fstat(fd, &st) != 0) {
        std::string e = errno_text();
        ::close(fd);
        fail("{}: cannot stat: {}", path, e);
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        fail("{}: not a regular file", path);
    }
    size_ = size_t(st.st_size);
    if (size_ > 0) {
        void * p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            std::string e = errno_text();
            ::close(fd);
            fail("{}: cannot map {} bytes: {}", path, size_, e);
        }
        data_ = static_cast<const uint8_t *>(p);
    }
    ::close(fd);
}

MappedFile::~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t *>(data_), size_);
}

MappedFile::MappedFile(MappedFile && other) noexcept { *this = std::move(other); }

MappedFile & MappedFile::operator=(MappedFile && other) noexcept {
    if (this != &other) {
        if (data_) ::munmap(const_cast<uint8_t *>(data_), size_);
        path_ = std::move(other.path_);
        data_ = other.data_;
        size_ = other.size_;
        other.data_ = nullptr;
        other.size_ = 0;
    }
    return *this;
}

void MappedFile::prefetch(size_t offset, size_t bytes) const {
    if (!data_ || offset >= size_) return;
    bytes = std::min(bytes, size_ - offset);
    const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    size_t begin = offset / page * page;
    ::madvise(const_cast<uint8_t *>(data_) + begin, bytes + (offset - begin), MADV_WILLNEED);
}

uint64_t proc_field(const char * file, const char * key) {
    std::ifstream in(file);
    std::string line;
    const size_t n = std::strlen(key);
    while (std::getline(in, line)) {
        if (line.compare(0, n, key) != 0 || line.size() <= n || line[n] != ':') continue;
        const uint64_t v = std::strtoull(line.c_str() + n + 1, nullptr, 10);
        return line.find("kB") != std::string::npos ? v * 1024 : v;
    }
    return 0;
}

std::string read_file(const std::string & path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("{}: cannot open: {}", path, errno_text());
    std::string out;
    char buf[1 << 16];
    for (;;) {
        ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0) {
            if (errno == EINTR) continue;
            std::string e = errno_text();
            ::close(fd);
            fail("{}: read error: {}", path, e);
        }
        if (n == 0) break;
        out.append(buf, size_t(n));
    }
    ::close(fd);
    return out;
}

static constexpr size_t kWriteBuffer = size_t(8) << 20;

AtomicFileWriter::AtomicFileWriter(const std::string & path) : path_(path) {
    static std::atomic<unsigned> counter{0};
    tmp_path_ = fmt::format("{}.tmp.{}.{}", path, ::getpid(), counter++);
    fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("{}: cannot create: {}", tmp_path_, errno_text());
    buffer_.reserve(kWriteBuffer);
}

AtomicFileWriter::~AtomicFileWriter() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_path_.c_str());
}

void AtomicFileWriter::flush_buffer() {
    const char * p = buffer_.data();
    size_t left = buffer_.size();
    while (left > 0) {
        ssize_t n = ::write(fd_, p, left);
        if (n < 0) {
            if (errno == EINTR) continue;
            fail("{}: write error: {}", tmp_path_, errno_text());
        }
        p += n;
        left -= size_t(n);
    }
    buffer_.clear();
}

void AtomicFileWriter::write(const void * data, size_t bytes) {
    DSV4_CHECK(fd_ >= 0 && !committed_, "{}: write after commit", path_);
    const char * p = static_cast<const char *>(data);
    if (buffer_.size() + bytes > kWriteBuffer) flush_buffer();
    if (bytes >= kWriteBuffer) {
        buffer_.assign(p, bytes);  // large writes go straight through
        flush_buffer();
    } else {
        buffer_.append(p, bytes);
    }
    written_ += bytes;
}

void AtomicFileWriter::write_zeros(size_t bytes) {
    static const char zeros[4096] = {};
    while (bytes > 0) {
        size_t n = std::min(bytes, sizeof zeros);
        write(zeros, n);
        bytes -= n;
    }
}

void AtomicFileWriter::commit() {
    flush_buffer();
    if (::fsync(fd_) != 0) fail("{}: fsync failed: {}", tmp_path_, errno_text());
    if (::close(fd_) != 0) {
        fd_ = -1;
        fail("{}: close failed: {}", tmp_path_, errno_text());
    }
    fd_ = -1;
    if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) fail("{}: rename failed: {}", path_, errno_text());
    committed_ = true;
    // Make the rename itself durable.
    std::string dir = path_.find('/') == std::string::npos ? "." : path_.substr(0, path_.rfind('/') + 1);
    int dfd = ::open(dir.empty() ? "/" : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        ::fsync(dfd);
        ::close(dfd);
    }
}

void write_file_atomic(const std::string & path, std::string_view contents) {
    AtomicFileWriter w(path);
    w.write(contents);
    w.commit();
}

}  // namespace dsv4
