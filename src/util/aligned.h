// An owning, 64-byte aligned, uninitialised byte buffer (cache-line and AVX-512 aligned).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <utility>

namespace dsv4 {

class AlignedBuffer {
  public:
    static constexpr size_t kAlign = 64;

    AlignedBuffer() = default;
    explicit AlignedBuffer(size_t bytes) { resize(bytes); }
    ~AlignedBuffer() { std::free(data_); }
    AlignedBuffer(AlignedBuffer && o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
    AlignedBuffer & operator=(AlignedBuffer && o) noexcept {
        std::swap(data_, o.data_);
        std::swap(size_, o.size_);
        return *this;
    }
    AlignedBuffer(const AlignedBuffer &) = delete;
    AlignedBuffer & operator=(const AlignedBuffer &) = delete;

    // Discards the contents when the size changes.
    void resize(size_t bytes) {
        if (bytes == size_) return;
        std::free(data_);
        data_ = nullptr;
        size_ = 0;
        if (bytes == 0) return;
        data_ = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
        if (!data_) throw std::bad_alloc();
        size_ = bytes;
    }
    // Grows (never shrinks) to at least `bytes`.
    void reserve(size_t bytes) {
        if (bytes > size_) resize(bytes);
    }

    void * data() { return data_; }
    const void * data() const { return data_; }
    template <typename T> T * as() { return static_cast<T *>(data_); }
    template <typename T> const T * as() const { return static_cast<const T *>(data_); }
    size_t size() const { return size_; }

  private:
    void * data_ = nullptr;
    size_t size_ = 0;
};

}  // namespace dsv4
