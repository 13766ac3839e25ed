// GGUF reader: parses the header, metadata and tensor infos of a mapped file, validating every field, and hands
// out views into the mapping. Tensor data is never read here, so opening a file of any size costs only its header.
#include "format/gguf.h"

#include "util/error.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

namespace dsv4 {

static_assert(std::endian::native == std::endian::little, "GGUF files are little-endian; dsv4 reads them in place");

// ---------------------------------------------------------------------------------------------------------------------
// Value types and in-memory values
// ---------------------------------------------------------------------------------------------------------------------

std::string_view gguf_type_name(GgufType type) {
    switch (type) {
        case GgufType::UINT8:
            return "UINT8";
        case GgufType::INT8:
            return "INT8";
        case GgufType::UINT16:
            return "UINT16";
        case GgufType::INT16:
            return "INT16";
        case GgufType::UINT32:
            return "UINT32";
        case GgufType::INT32:
            return "INT32";
        case GgufType::FLOAT32:
            return "FLOAT32";
        case GgufType::BOOL:
            return "BOOL";
        case GgufType::STRING:
            return "STRING";
        case GgufType::ARRAY:
            return "ARRAY";
        case GgufType::UINT64:
            return "UINT64";
        case GgufType::INT64:
            return "INT64";
        case GgufType::FLOAT64:
            return "FLOAT64";
    }
    return "?";
}

namespace {

bool is_unsigned(GgufType t) {
    return t == GgufType::UINT8 || t == GgufType::UINT16 || t == GgufType::UINT32 || t == GgufType::UINT64;
}
bool is_signed(GgufType t) {
    return t == GgufType::INT8 || t == GgufType::INT16 || t == GgufType::INT32 || t == GgufType::INT64;
}
bool is_float(GgufType t) { return t == GgufType::FLOAT32 || t == GgufType::FLOAT64; }

GgufValue scalar(GgufType type) {
    GgufValue v;
    v.type = type;
    return v;
}

// Smallest encoding of one element of each type: bounds how many elements the bytes left can hold, so that a
// forged count is refused before anything is allocated for it.
uint64_t min_encoded_size(GgufType t) {
    switch (t) {
        case GgufType::UINT8:
        case GgufType::INT8:
        case GgufType::BOOL:
            return 1;
        case GgufType::UINT16:
        case GgufType::INT16:
            return 2;
        case GgufType::UINT32:
        case GgufType::INT32:
        case GgufType::FLOAT32:
            return 4;
        case GgufType::UINT64:
        case GgufType::INT64:
        case GgufType::FLOAT64:
        case GgufType::STRING:
            return 8;  // u64 length
        case GgufType::ARRAY:
            return 12;  // u32 element type + u64 count
    }
    return 1;
}

}  // namespace

GgufValue GgufValue::make_u8(uint8_t v) {
    GgufValue r = scalar(GgufType::UINT8);
    r.u = v;
    return r;
}
GgufValue GgufValue::make_i8(int8_t v) {
    GgufValue r = scalar(GgufType::INT8);
    r.i = v;
    return r;
}
GgufValue GgufValue::make_u16(uint16_t v) {
    GgufValue r = scalar(GgufType::UINT16);
    r.u = v;
    return r;
}
GgufValue GgufValue::make_i16(int16_t v) {
    GgufValue r = scalar(GgufType::INT16);
    r.i = v;
    return r;
}
GgufValue GgufValue::make_u32(uint32_t v) {
    GgufValue r = scalar(GgufType::UINT32);
    r.u = v;
    return r;
}
GgufValue GgufValue::make_i32(int32_t v) {
    GgufValue r = scalar(GgufType::INT32);
    r.i = v;
    return r;
}
GgufValue GgufValue::make_u64(uint64_t v) {
    GgufValue r = scalar(GgufType::UINT64);
    r.u = v;
    return r;
}
GgufValue GgufValue::make_i64(int64_t v) {
    GgufValue r = scalar(GgufType::INT64);
    r.i = v;
    return r;
}
GgufValue GgufValue::make_f32(float v) {
    GgufValue r = scalar(GgufType::FLOAT32);
    r.f = v;
    return r;
}
GgufValue GgufValue::make_f64(double v) {
    GgufValue r = scalar(GgufType::FLOAT64);
    r.f = v;
    return r;
}
GgufValue GgufValue::make_bool(bool v) {
    GgufValue r = scalar(GgufType::BOOL);
    r.u = v ? 1 : 0;
    return r;
}
GgufValue GgufValue::make_string(std::string v) {
    GgufValue r = scalar(GgufType::STRING);
    r.owned = std::make_shared<std::string>(std::move(v));
    r.str = *r.owned;
    return r;
}
GgufValue GgufValue::make_array(GgufType elem_type, std::vector<GgufValue> elems) {
    for (size_t i = 0; i < elems.size(); ++i)
        if (elems[i].type != elem_type)
            fail("GGUF array of {}: element {} has type {}", gguf_type_name(elem_type), i,
                 gguf_type_name(elems[i].type));
    GgufValue r = scalar(GgufType::ARRAY);
    r.elem_type = elem_type;
    r.array = std::move(elems);
    return r;
}

// ---------------------------------------------------------------------------------------------------------------------
// Parser: a bounds-checked cursor over the mapped bytes. Every read names the field it was reading, so that any
// error says which key, array element or tensor was wrong.
// ---------------------------------------------------------------------------------------------------------------------

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32

class Cursor {
  public:
    Cursor(const uint8_t * data, size_t size, const std::string & file) : data_(data), size_(size), file_(file) {}

    size_t pos() const { return pos_; }
    uint64_t left() const { return size_ - pos_; }

    // What is being read, for error messages: "header", "key 'x'", "tensor 'y'"; array element indices are
    // appended while inside arrays.
    void set_context(std::string context) {
        context_ = std::move(context);
        elems_.clear();
    }
    void push_elem(uint64_t i) { elems_.push_back(i); }
    void set_elem(uint64_t i) { elems_.back() = i; }
    void pop_elem() { elems_.pop_back(); }

    template <typename... Args>
    [[noreturn]] void error(fmt::format_string<Args...> format, Args &&... args) const {
        std::string where = context_;
        for (uint64_t i : elems_) where += fmt::format("[{}]", i);
        fail("{}: {}: {}", file_, where, fmt::format(format, std::forward<Args>(args)...));
    }

    template <typename T>
    T read(std::string_view what) {
        need(sizeof(T), what);
        T v;
        std::memcpy(&v, data_ + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }

    std::string_view read_string(std::string_view what) {
        const uint64_t len = read<uint64_t>(what);
        if (len > left())
            error("{} of {} bytes at offset {} runs past the end of the file (size {})", what, len, pos_, size_);
        std::string_view s(reinterpret_cast<const char *>(data_ + pos_), size_t(len));
        pos_ += size_t(len);
        return s;
    }

  private:
    void need(size_t n, std::string_view what) const {
        if (n > left()) error("file truncated: {} needs {} bytes at offset {}, file size is {}", what, n, pos_, size_);
    }

    const uint8_t * data_;
    size_t size_;
    size_t pos_ = 0;
    const std::string & file_;
    std::string context_;
    std::vector<uint64_t> elems_;
};

GgufType read_value_type(Cursor & c, std::string_view what) {
    const uint32_t t = c.read<uint32_t>(what);
    if (t > uint32_t(GgufType::FLOAT64)) c.error("unknown {} {} (GGUF defines 0..12)", what, t);
    return GgufType(t);
}

// `depth` counts the arrays enclosing this value.
GgufValue read_value(Cursor & c, GgufType type, int depth) {
    GgufValue v = scalar(type);
    switch (type) {
        case GgufType::UINT8:
            v.u = c.read<uint8_t>("UINT8 value");
            break;
        case GgufType::INT8:
            v.i = c.read<int8_t>("INT8 value");
            break;
        case GgufType::UINT16:
            v.u = c.read<uint16_t>("UINT16 value");
            break;
        case GgufType::INT16:
            v.i = c.read<int16_t>("INT16 value");
            break;
        case GgufType::UINT32:
            v.u = c.read<uint32_t>("UINT32 value");
            break;
        case GgufType::INT32:
            v.i = c.read<int32_t>("INT32 value");
            break;
        case GgufType::UINT64:
            v.u = c.read<uint64_t>("UINT64 value");
            break;
        case GgufType::INT64:
            v.i = c.read<int64_t>("INT64 value");
            break;
        case GgufType::FLOAT32:
            v.f = c.read<float>("FLOAT32 value");
            break;
        case GgufType::FLOAT64:
            v.f = c.read<double>("FLOAT64 value");
            break;
        case GgufType::BOOL: {
            const uint8_t b = c.read<uint8_t>("BOOL value");
            if (b > 1) c.error("BOOL value is {}, not 0 or 1", b);
            v.u = b;
            break;
        }
        case GgufType::STRING:
            v.str = c.read_string("string");
            break;
        case GgufType::ARRAY: {
            if (depth >= kGgufMaxArrayDepth) c.error("arrays nested more than {} deep", kGgufMaxArrayDepth);
            v.elem_type = read_value_type(c, "array element type");
            const uint64_t n = c.read<uint64_t>("array length");
            const uint64_t per = min_encoded_size(v.elem_type);
            if (n > c.left() / per)
                c.error("array of {} {} elements cannot fit in the {} bytes left in the file", n,
                        gguf_type_name(v.elem_type), c.left());
            v.array.reserve(size_t(n));
            c.push_elem(0);
            for (uint64_t i = 0; i < n; ++i) {
                c.set_elem(i);
                v.array.push_back(read_value(c, v.elem_type, depth + 1));
            }
            c.pop_elem();
            break;
        }
    }
    return v;
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t * out) { return __builtin_mul_overflow(a, b, out); }

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// GgufFile
// ---------------------------------------------------------------------------------------------------------------------

GgufFile GgufFile::open(const std::string & path) {
    GgufFile f = open_one(path);
    if (f.has("split.count")) f.open_splits();
    return f;
}

GgufFile GgufFile::open_one(const std::string & path) {
    GgufFile f;
    f.path_ = path;
    f.file_ = std::make_shared<MappedFile>(path);
    f.base_ = f.file_->data();
    f.size_ = f.file_->size();
    f.parse_all();
    return f;
}

void GgufFile::open_splits() {
    const uint64_t count = get_u64("split.count");
    const uint64_t no = get_u64("split.no");
    if (count <= 1) return;
    DSV4_CHECK(no == 0, "{}: split.no = {}: open the first file of a split model (…-00001-of-{:05}.gguf)", path_, no,
               count);
    DSV4_CHECK(count <= 4096, "{}: split.count = {} is not a plausible number of files", path_, count);
    // gguf-split names the files PREFIX-%05d-of-%05d.gguf, counting from 1.
    const std::string suffix = fmt::format("-00001-of-{:05}.gguf", count);
    DSV4_CHECK(path_.size() > suffix.size() && path_.compare(path_.size() - suffix.size(), suffix.size(), suffix) == 0,
               "{}: a split model of {} files must be named …{}", path_, count, suffix);
    const std::string prefix = path_.substr(0, path_.size() - suffix.size());
    for (uint64_t k = 1; k < count; ++k) {
        GgufFile part = open_one(fmt::format("{}-{:05}-of-{:05}.gguf", prefix, k + 1, count));
        DSV4_CHECK(part.get_u64("split.no") == k && part.get_u64("split.count") == count,
                   "{}: split.no / split.count say {} of {}, expected {} of {}", part.path(), part.get_u64("split.no"),
                   part.get_u64("split.count"), k, count);
        for (GgufTensorInfo t : part.tensors()) {
            t.split = uint32_t(k);
            DSV4_CHECK(tensor_index_.emplace(t.name, tensors_.size()).second, "{}: tensor '{}' is also in {}",
                       part.path(), t.name, path_);
            tensors_.push_back(std::move(t));
        }
        splits_.push_back(std::move(part));
    }
    if (has("split.tensors.count"))
        DSV4_CHECK(get_i64("split.tensors.count") == int64_t(tensors_.size()),
                   "{}: split.tensors.count says {} tensors, the {} files hold {}", path_,
                   get_i64("split.tensors.count"), count, tensors_.size());
}

GgufFile GgufFile::parse(const uint8_t * data, size_t size, std::string name) {
    GgufFile f;
    f.path_ = std::move(name);
    f.base_ = data;
    f.size_ = size;
    f.parse_all();
    return f;
}

void GgufFile::parse_all() {
    Cursor c(base_, size_, path_);

    // ---- header ----
    c.set_context("header");
    const uint32_t magic = c.read<uint32_t>("magic");
    if (magic != kMagic) {
        c.error("bad magic {:02x} {:02x} {:02x} {:02x} (expected 47 47 55 46, \"GGUF\"): not a GGUF file", magic & 0xff,
                (magic >> 8) & 0xff, (magic >> 16) & 0xff, magic >> 24);
    }
    version_ = c.read<uint32_t>("version");
    if (version_ == 1) c.error("GGUF version 1 (32-bit counts) is not supported; re-convert the file (versions 2, 3)");
    if (version_ != 2 && version_ != 3) {
        const uint32_t swapped = __builtin_bswap32(version_);
        c.error("unsupported GGUF version {}{} (dsv4 reads versions 2 and 3)", version_,
                swapped >= 1 && swapped <= 3 ? " (a big-endian file?)" : "");
    }
    // Version 2 and 3 share the layout (3 only allows big-endian files, which are refused above).
    const uint64_t n_tensors = c.read<uint64_t>("tensor_count");
    const uint64_t n_kv = c.read<uint64_t>("kv_count");
    // A key is at least a length, a type and a one-byte value; a tensor info at least a name length, n_dims,
    // one dim, a type and an offset.
    if (n_kv > c.left() / 13) c.error("kv_count {} cannot fit in the {} bytes left in the file", n_kv, c.left());
    if (n_tensors > c.left() / 32)
        c.error("tensor_count {} cannot fit in the {} bytes left in the file", n_tensors, c.left());

    // ---- metadata ----
    kvs_.reserve(size_t(n_kv));
    kv_index_.reserve(size_t(n_kv));
    for (uint64_t i = 0; i < n_kv; ++i) {
        c.set_context(fmt::format("metadata entry {}", i));
        const std::string_view key = c.read_string("key");
        if (key.empty()) c.error("empty key");
        c.set_context(fmt::format("key '{}'", key));
        const GgufType type = read_value_type(c, "value type");
        GgufValue value = read_value(c, type, 0);
        if (!kv_index_.emplace(std::string(key), kvs_.size()).second) c.error("duplicate key");
        kvs_.push_back(GgufKv{std::string(key), std::move(value)});
    }

    alignment_ = 32;
    if (const GgufValue * a = find("general.alignment")) {
        c.set_context("key 'general.alignment'");
        if (a->type != GgufType::UINT32) c.error("type is {}, expected UINT32", gguf_type_name(a->type));
        if (a->u == 0 || !std::has_single_bit(a->u)) c.error("alignment {} is not a nonzero power of two", a->u);
        alignment_ = a->u;
    }

    // ---- tensor infos ----
    tensors_.reserve(size_t(n_tensors));
    tensor_index_.reserve(size_t(n_tensors));
    for (uint64_t i = 0; i < n_tensors; ++i) {
        c.set_context(fmt::format("tensor {}", i));
        GgufTensorInfo t;
        const std::string_view name = c.read_string("name");
        if (name.empty()) c.error("empty tensor name");
        t.name = std::string(name);
        c.set_context(fmt::format("tensor '{}'", name));
        const uint32_t n_dims = c.read<uint32_t>("n_dims");
        if (n_dims == 0 || n_dims > 4) c.error("n_dims is {}, expected 1 to 4", n_dims);
        t.n_dims = int(n_dims);
        for (uint32_t d = 0; d < n_dims; ++d) {
            const int64_t ne = int64_t(c.read<uint64_t>("ne"));  // stored as u64; > INT64_MAX reads as negative
            if (ne <= 0) c.error("ne[{}] is {}, expected a positive size", d, ne);
            t.ne[d] = ne;
        }
        const uint32_t type_id = c.read<uint32_t>("type");
        const TypeTraits * traits = type_traits(type_id);
        if (!traits) c.error("unknown ggml type id {}", type_id);
        t.type = GgmlType(type_id);
        t.offset = c.read<uint64_t>("offset");

        uint64_t n_elements = 1;
        for (int d = 0; d < 4; ++d)
            if (mul_overflows(n_elements, uint64_t(t.ne[d]), &n_elements) ||
                n_elements > uint64_t(std::numeric_limits<int64_t>::max()))
                c.error("element count of shape [{}] overflows 63 bits", fmt::join(t.ne, t.ne + n_dims, ", "));
        if (t.ne[0] % traits->block_elems != 0)
            c.error("ne[0] = {} is not a multiple of the {} block size {}", t.ne[0], traits->name, traits->block_elems);
        uint64_t n_bytes = uint64_t(t.ne[0] / traits->block_elems);
        if (mul_overflows(n_bytes, traits->block_bytes, &n_bytes) ||
            mul_overflows(n_bytes, uint64_t(t.ne[1]) * uint64_t(t.ne[2]) * uint64_t(t.ne[3]), &n_bytes))
            c.error("byte size of shape [{}] overflows 64 bits", fmt::join(t.ne, t.ne + n_dims, ", "));
        t.n_bytes = n_bytes;

        if (!tensor_index_.emplace(t.name, tensors_.size()).second) c.error("duplicate tensor name");
        tensors_.push_back(std::move(t));
    }

    // ---- data section: aligned start, every tensor inside the file, no two overlapping ----
    const uint64_t end_of_infos = c.pos();
    data_offset_ = (end_of_infos + alignment_ - 1) / alignment_ * alignment_;
    struct Range {
        uint64_t begin, end;
        size_t index;
    };
    std::vector<Range> ranges;
    ranges.reserve(tensors_.size());
    for (size_t i = 0; i < tensors_.size(); ++i) {
        const GgufTensorInfo & t = tensors_[i];
        c.set_context(fmt::format("tensor '{}'", t.name));
        if (t.offset % alignment_ != 0)
            c.error("data offset {} is not a multiple of the alignment {}", t.offset, alignment_);
        uint64_t begin = 0, end = 0;
        if (__builtin_add_overflow(data_offset_, t.offset, &begin) || __builtin_add_overflow(begin, t.n_bytes, &end))
            c.error("data offset {} + {} bytes overflows 64 bits", t.offset, t.n_bytes);
        if (end > size_) c.error("data range [{}, {}) past end of file (size {})", begin, end, size_);
        ranges.push_back({begin, end, i});
    }
    std::sort(ranges.begin(), ranges.end(), [](const Range & a, const Range & b) { return a.begin < b.begin; });
    for (size_t i = 1; i < ranges.size(); ++i) {
        if (ranges[i].begin < ranges[i - 1].end) {
            c.set_context(fmt::format("tensor '{}'", tensors_[ranges[i].index].name));
            c.error("data range [{}, {}) overlaps tensor '{}' at [{}, {})", ranges[i].begin, ranges[i].end,
                    tensors_[ranges[i - 1].index].name, ranges[i - 1].begin, ranges[i - 1].end);
        }
    }
}

const GgufValue * GgufFile::find(std::string_view key) const {
    auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kvs_[it->second].value;
}

const GgufTensorInfo * GgufFile::find_tensor(std::string_view name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

// ---------------------------------------------------------------------------------------------------------------------
// Typed getters
// ---------------------------------------------------------------------------------------------------------------------

void GgufFile::key_error(std::string_view key, std::string_view problem) const {
    fail("{}: metadata key '{}': {}", path_, key, problem);
}

const GgufValue & GgufFile::require(std::string_view key) const {
    const GgufValue * v = find(key);
    if (!v) key_error(key, "missing");
    return *v;
}

namespace {

std::string describe_type(const GgufValue & v) {
    if (v.type != GgufType::ARRAY) return std::string(gguf_type_name(v.type));
    return fmt::format("ARRAY of {}", gguf_type_name(v.elem_type));
}

// An integer of any width as int64; nullopt when the type is not an integer or the value does not fit.
std::optional<int64_t> as_i64(const GgufValue & v) {
    if (is_signed(v.type)) return v.i;
    if (is_unsigned(v.type) && v.u <= uint64_t(std::numeric_limits<int64_t>::max())) return int64_t(v.u);
    return std::nullopt;
}

std::optional<double> as_f64(const GgufValue & v) {
    if (is_float(v.type)) return v.f;
    if (is_signed(v.type)) return double(v.i);
    if (is_unsigned(v.type)) return double(v.u);
    return std::nullopt;
}

}  // namespace

uint64_t GgufFile::get_u64(std::string_view key) const {
    const GgufValue & v = require(key);
    if (is_unsigned(v.type)) return v.u;
    if (is_signed(v.type)) {
        if (v.i < 0) key_error(key, fmt::format("value {} is negative, expected an unsigned integer", v.i));
        return uint64_t(v.i);
    }
    key_error(key, fmt::format("type is {}, expected an integer", describe_type(v)));
}

int64_t GgufFile::get_i64(std::string_view key) const {
    const GgufValue & v = require(key);
    if (auto r = as_i64(v)) return *r;
    if (is_unsigned(v.type)) key_error(key, fmt::format("value {} does not fit a signed 64-bit integer", v.u));
    key_error(key, fmt::format("type is {}, expected an integer", describe_type(v)));
}

double GgufFile::get_f64(std::string_view key) const {
    const GgufValue & v = require(key);
    if (auto r = as_f64(v)) return *r;
    key_error(key, fmt::format("type is {}, expected a number", describe_type(v)));
}

bool GgufFile::get_bool(std::string_view key) const {
    const GgufValue & v = require(key);
    if (v.type != GgufType::BOOL) key_error(key, fmt::format("type is {}, expected BOOL", describe_type(v)));
    return v.u != 0;
}

std::string_view GgufFile::get_string(std::string_view key) const {
    const GgufValue & v = require(key);
    if (v.type != GgufType::STRING) key_error(key, fmt::format("type is {}, expected STRING", describe_type(v)));
    return v.str;
}

std::vector<int64_t> GgufFile::get_int_array(std::string_view key) const {
    const GgufValue & v = require(key);
    if (v.type != GgufType::ARRAY || !(is_signed(v.elem_type) || is_unsigned(v.elem_type)))
        key_error(key, fmt::format("type is {}, expected an ARRAY of integers", describe_type(v)));
    std::vector<int64_t> out;
    out.reserve(v.array.size());
    for (size_t i = 0; i < v.array.size(); ++i) {
        auto r = as_i64(v.array[i]);
        if (!r) key_error(key, fmt::format("element {} = {} does not fit a signed 64-bit integer", i, v.array[i].u));
        out.push_back(*r);
    }
    return out;
}

std::vector<double> GgufFile::get_f64_array(std::string_view key) const {
    const GgufValue & v = require(key);
    if (v.type != GgufType::ARRAY || !(is_float(v.elem_type) || is_signed(v.elem_type) || is_unsigned(v.elem_type)))
        key_error(key, fmt::format("type is {}, expected an ARRAY of numbers", describe_type(v)));
    std::vector<double> out;
    out.reserve(v.array.size());
    for (const GgufValue & e : v.array) out.push_back(*as_f64(e));
    return out;
}

std::vector<std::string_view> GgufFile::get_string_array(std::string_view key) const {
    const GgufValue & v = require(key);
    if (v.type != GgufType::ARRAY || v.elem_type != GgufType::STRING)
        key_error(key, fmt::format("type is {}, expected an ARRAY of STRING", describe_type(v)));
    std::vector<std::string_view> out;
    out.reserve(v.array.size());
    for (const GgufValue & e : v.array) out.push_back(e.str);
    return out;
}

std::optional<uint64_t> GgufFile::get_u64_opt(std::string_view key) const {
    return has(key) ? std::optional<uint64_t>(get_u64(key)) : std::nullopt;
}
std::optional<double> GgufFile::get_f64_opt(std::string_view key) const {
    return has(key) ? std::optional<double>(get_f64(key)) : std::nullopt;
}
std::optional<bool> GgufFile::get_bool_opt(std::string_view key) const {
    return has(key) ? std::optional<bool>(get_bool(key)) : std::nullopt;
}
std::optional<std::string_view> GgufFile::get_string_opt(std::string_view key) const {
    return has(key) ? std::optional<std::string_view>(get_string(key)) : std::nullopt;
}

}  // namespace dsv4
