// GGUF (versions 2 and 3): a validating, memory-mapped reader with zero-copy tensor views, and a streaming,
// atomic writer. Layout: ../shared/docs/formats-spec.md §1 and ggml's docs/gguf.md.
//
// Every defect in a file (bad magic or version, truncation, offsets or sizes past the end, overflowing
// dimension products, unknown types, duplicate keys or tensor names, misaligned data) raises dsv4::Error
// with a message that names the file and the field; nothing reads outside the mapping.
#pragma once

#include "format/types.h"
#include "util/file.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dsv4 {

enum class GgufType : uint32_t {
    UINT8 = 0,
    INT8 = 1,
    UINT16 = 2,
    INT16 = 3,
    UINT32 = 4,
    INT32 = 5,
    FLOAT32 = 6,
    BOOL = 7,
    STRING = 8,
    ARRAY = 9,
    UINT64 = 10,
    INT64 = 11,
    FLOAT64 = 12,
};

std::string_view gguf_type_name(GgufType type);

// One metadata value. Scalars are widened into u/i/f; strings point into the mapped file (or into `owned`
// for values built in memory); arrays hold their elements (nesting is allowed).
struct GgufValue {
    GgufType type = GgufType::UINT32;
    uint64_t u = 0;  // UINT*, BOOL
    int64_t i = 0;   // INT*
    double f = 0;    // FLOAT*
    std::string_view str;
    GgufType elem_type = GgufType::UINT8;  // ARRAY
    std::vector<GgufValue> array;
    std::shared_ptr<std::string> owned;  // backing store for strings made by the helpers below

    static GgufValue make_u8(uint8_t v);
    static GgufValue make_i8(int8_t v);
    static GgufValue make_u16(uint16_t v);
    static GgufValue make_i16(int16_t v);
    static GgufValue make_u32(uint32_t v);
    static GgufValue make_i32(int32_t v);
    static GgufValue make_u64(uint64_t v);
    static GgufValue make_i64(int64_t v);
    static GgufValue make_f32(float v);
    static GgufValue make_f64(double v);
    static GgufValue make_bool(bool v);
    static GgufValue make_string(std::string v);
    // Throws when an element's type is not `elem_type`.
    static GgufValue make_array(GgufType elem_type, std::vector<GgufValue> elems);
};

// Arrays may nest this deep (an array directly under a key is level 1); deeper files are rejected, so a
// crafted file cannot recurse without bound.
inline constexpr int kGgufMaxArrayDepth = 8;

struct GgufKv {
    std::string key;
    GgufValue value;
};

struct GgufTensorInfo {
    std::string name;
    GgmlType type = GgmlType::F32;
    int n_dims = 0;
    int64_t ne[4] = {1, 1, 1, 1};  // ggml order: ne[0] is the contiguous axis (a weight's input width)
    uint64_t offset = 0;           // relative to the start of the data section
    uint64_t n_bytes = 0;
    uint32_t split = 0;  // which file of a split model holds the data (0: the one opened)

    int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
};

class GgufFile {
  public:
    // Maps and validates a file. Throws dsv4::Error naming the file and the field on any defect.
    // A split model (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf with split.no/count/tensors.count keys, the
    // model metadata in the first file) is opened through its first file: the other files are found beside it,
    // validated, and their tensors join one table.
    static GgufFile open(const std::string & path);
    // Parses a buffer the caller keeps alive (fuzzing, tests). `name` is used in error messages.
    static GgufFile parse(const uint8_t * data, size_t size, std::string name);

    const std::string & path() const { return path_; }
    uint32_t version() const { return version_; }
    uint64_t alignment() const { return alignment_; }
    uint64_t data_offset() const { return data_offset_; }  // absolute offset of the data section
    size_t file_size() const { return size_; }

    const std::vector<GgufKv> & metadata() const { return kvs_; }
    const GgufValue * find(std::string_view key) const;
    bool has(std::string_view key) const { return find(key) != nullptr; }

    // Typed getters: throw dsv4::Error naming the file and key when the key is missing or its type cannot
    // represent the request (any integer type for integers, a value that fits; ints or floats for floats).
    uint64_t get_u64(std::string_view key) const;
    int64_t get_i64(std::string_view key) const;
    double get_f64(std::string_view key) const;
    bool get_bool(std::string_view key) const;
    std::string_view get_string(std::string_view key) const;
    std::vector<int64_t> get_int_array(std::string_view key) const;
    std::vector<double> get_f64_array(std::string_view key) const;
    std::vector<std::string_view> get_string_array(std::string_view key) const;
    // Optional forms: nullopt when missing, an error when present with the wrong type.
    std::optional<uint64_t> get_u64_opt(std::string_view key) const;
    std::optional<double> get_f64_opt(std::string_view key) const;
    std::optional<bool> get_bool_opt(std::string_view key) const;
    std::optional<std::string_view> get_string_opt(std::string_view key) const;

    const std::vector<GgufTensorInfo> & tensors() const { return tensors_; }
    const GgufTensorInfo * find_tensor(std::string_view name) const;
    const uint8_t * tensor_data(const GgufTensorInfo & info) const {
        const GgufFile & holder = info.split == 0 ? *this : splits_[info.split - 1];
        return holder.base_ + holder.data_offset_ + info.offset;
    }
    size_t n_splits() const { return 1 + splits_.size(); }
    const MappedFile * mapping() const { return file_.get(); }

  private:
    // Lets find()/find_tensor() look up a string_view without building a std::string.
    struct StringHash {
        using is_transparent = void;
        size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
    };
    using NameIndex = std::unordered_map<std::string, size_t, StringHash, std::equal_to<>>;

    static GgufFile open_one(const std::string & path);
    void parse_all();
    void open_splits();
    [[noreturn]] void key_error(std::string_view key, std::string_view problem) const;
    const GgufValue & require(std::string_view key) const;

    std::string path_;
    std::shared_ptr<MappedFile> file_;
    std::vector<GgufFile> splits_;  // the other files of a split model, in order
    const uint8_t * base_ = nullptr;
    size_t size_ = 0;
    uint32_t version_ = 0;
    uint64_t alignment_ = 32;
    uint64_t data_offset_ = 0;
    std::vector<GgufKv> kvs_;
    NameIndex kv_index_;
    std::vector<GgufTensorInfo> tensors_;
    NameIndex tensor_index_;
};

// Streaming, atomic GGUF v3 writer. Declare metadata and every tensor first, then write tensor data in
// declaration order, in as many pieces as convenient; nothing is held in memory but the header. The file
// appears under its name only after finish() (temporary file, fsync, rename).
class GgufWriter {
  public:
    explicit GgufWriter(const std::string & path, uint32_t alignment = 32);
    ~GgufWriter();

    void set(const std::string & key, GgufValue value);  // replaces an earlier value of the same key
    void add_tensor(const std::string & name, GgmlType type, std::vector<int64_t> ne);

    // Writes `bytes` more of the current tensor's data; moves to the next tensor once one is complete.
    void write_tensor_data(const void * data, size_t bytes);
    void finish();  // throws if a declared tensor is incomplete

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4
