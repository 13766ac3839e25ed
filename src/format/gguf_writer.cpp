// GGUF v3 writer. The header (metadata and tensor infos, with every tensor's offset) is fixed before the first
// tensor byte is written, so tensor data can stream straight from a converter to disk: only the header is ever
// held in memory, whatever the size of the model.
#include "format/gguf.h"

#include "util/error.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <unordered_set>

namespace dsv4 {

namespace {

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

class HeaderBuffer {
  public:
    explicit HeaderBuffer(const std::string & path) : path_(path) {}

    template <typename T>
    void put(T v) {
        char b[sizeof(T)];
        std::memcpy(b, &v, sizeof(T));
        bytes.append(b, sizeof(T));
    }
    void put_string(std::string_view s) {
        put<uint64_t>(s.size());
        bytes.append(s);
    }

    // Encodes a value, refusing what a reader could not read back (a scalar out of its type's range, nesting
    // deeper than the reader accepts); `key` names it in errors.
    void put_value(const GgufValue & v, std::string_view key, int depth) {
        auto range = [&](bool ok) {
            if (!ok) fail("{}: key '{}': value out of range for {}", path_, key, gguf_type_name(v.type));
        };
        switch (v.type) {
            case GgufType::UINT8:
                range(v.u <= 0xff);
                put<uint8_t>(uint8_t(v.u));
                break;
            case GgufType::INT8:
                range(v.i >= -128 && v.i <= 127);
                put<int8_t>(int8_t(v.i));
                break;
            case GgufType::UINT16:
                range(v.u <= 0xffff);
                put<uint16_t>(uint16_t(v.u));
                break;
            case GgufType::INT16:
                range(v.i >= -32768 && v.i <= 32767);
                put<int16_t>(int16_t(v.i));
                break;
            case GgufType::UINT32:
                range(v.u <= 0xffffffffu);
                put<uint32_t>(uint32_t(v.u));
                break;
            case GgufType::INT32:
                range(v.i >= std::numeric_limits<int32_t>::min() && v.i <= std::numeric_limits<int32_t>::max());
                put<int32_t>(int32_t(v.i));
                break;
            case GgufType::UINT64:
                put<uint64_t>(v.u);
                break;
            case GgufType::INT64:
                put<int64_t>(v.i);
                break;
            case GgufType::FLOAT32:
                put<float>(float(v.f));
                break;
            case GgufType::FLOAT64:
                put<double>(v.f);
                break;
            case GgufType::BOOL:
                range(v.u <= 1);
                put<uint8_t>(uint8_t(v.u));
                break;
            case GgufType::STRING:
                put_string(v.str);
                break;
            case GgufType::ARRAY:
                if (depth >= kGgufMaxArrayDepth)
                    fail("{}: key '{}': arrays nested more than {} deep", path_, key, kGgufMaxArrayDepth);
                if (uint32_t(v.elem_type) > uint32_t(GgufType::FLOAT64))
                    fail("{}: key '{}': unknown array element type {}", path_, key, uint32_t(v.elem_type));
                put<uint32_t>(uint32_t(v.elem_type));
                put<uint64_t>(v.array.size());
                for (size_t i = 0; i < v.array.size(); ++i) {
                    if (v.array[i].type != v.elem_type)
                        fail("{}: key '{}': element {} has type {} in an array of {}", path_, key, i,
                             gguf_type_name(v.array[i].type), gguf_type_name(v.elem_type));
                    put_value(v.array[i], key, depth + 1);
                }
                break;
            default:
                fail("{}: key '{}': unknown value type {}", path_, key, uint32_t(v.type));
        }
    }

    std::string bytes;

  private:
    const std::string & path_;
};

}  // namespace

struct GgufWriter::Impl {
    struct Tensor {
        std::string name;
        GgmlType type;
        std::vector<int64_t> ne;  // ggml order
        uint64_t offset;          // relative to the data section, a multiple of the alignment
        uint64_t n_bytes;
    };

    std::string path;
    uint64_t alignment;
    std::vector<GgufKv> kvs;
    std::vector<Tensor> tensors;
    std::unordered_set<std::string> tensor_names;
    uint64_t data_size = 0;  // the data section so far, padded
    AtomicFileWriter out;
    bool header_written = false;
    bool finished = false;
    size_t current = 0;        // the tensor receiving data
    uint64_t current_got = 0;  // bytes it has received

    Impl(const std::string & p, uint64_t a) : path(p), alignment(a), out(p) {}

    void check_open(std::string_view what) const {
        if (finished) fail("{}: {} after finish()", path, what);
        if (header_written) fail("{}: {} after tensor data was started", path, what);
    }

    void write_header() {
        // Non-default alignments must be recorded so readers (ours, ggml's) find the tensors.
        bool has_alignment = false;
        for (const GgufKv & kv : kvs) has_alignment |= kv.key == "general.alignment";
        if (!has_alignment && alignment != 32)
            kvs.push_back({"general.alignment", GgufValue::make_u32(uint32_t(alignment))});

        HeaderBuffer h(path);
        h.put<uint32_t>(0x46554747);  // "GGUF"
        h.put<uint32_t>(3);
        h.put<uint64_t>(tensors.size());
        h.put<uint64_t>(kvs.size());
        for (const GgufKv & kv : kvs) {
            h.put_string(kv.key);
            h.put<uint32_t>(uint32_t(kv.value.type));
            h.put_value(kv.value, kv.key, 0);
        }
        for (const Tensor & t : tensors) {
            h.put_string(t.name);
            h.put<uint32_t>(uint32_t(t.ne.size()));
            for (int64_t n : t.ne) h.put<uint64_t>(uint64_t(n));
            h.put<uint32_t>(uint32_t(t.type));
            h.put<uint64_t>(t.offset);
        }
        h.bytes.resize(size_t(align_up(h.bytes.size(), alignment)), '\0');
        out.write(h.bytes);
        header_written = true;
    }

    // Pads a completed tensor to the alignment and moves on to the next.
    void complete_current() {
        const Tensor & t = tensors[current];
        out.write_zeros(size_t(align_up(t.n_bytes, alignment) - t.n_bytes));
        ++current;
        current_got = 0;
    }
};

GgufWriter::GgufWriter(const std::string & path, uint32_t alignment) {
    if (alignment == 0 || !std::has_single_bit(alignment))
        fail("{}: GGUF alignment {} is not a nonzero power of two", path, alignment);
    impl_ = std::make_unique<Impl>(path, alignment);
}

// Destroying an unfinished writer drops the temporary file (AtomicFileWriter), so no partial file is left.
GgufWriter::~GgufWriter() = default;

void GgufWriter::set(const std::string & key, GgufValue value) {
    Impl & m = *impl_;
    m.check_open("metadata set");
    if (key.empty()) fail("{}: empty metadata key", m.path);
    if (key == "general.alignment" && (value.type != GgufType::UINT32 || value.u != m.alignment))
        fail("{}: general.alignment must be the writer's alignment {} as UINT32", m.path, m.alignment);
    // Encode once now, so a bad value is reported by the call that set it.
    HeaderBuffer check(m.path);
    check.put_value(value, key, 0);
    for (GgufKv & kv : m.kvs) {
        if (kv.key == key) {
            kv.value = std::move(value);
            return;
        }
    }
    m.kvs.push_back({key, std::move(value)});
}

void GgufWriter::add_tensor(const std::string & name, GgmlType type, std::vector<int64_t> ne) {
    Impl & m = *impl_;
    m.check_open("tensor added");
    if (name.empty()) fail("{}: empty tensor name", m.path);
    if (m.tensor_names.count(name)) fail("{}: tensor '{}': duplicate name", m.path, name);
    const TypeTraits * traits = type_traits(uint32_t(type));
    if (!traits) fail("{}: tensor '{}': unknown ggml type id {}", m.path, name, uint32_t(type));
    if (ne.empty() || ne.size() > 4) fail("{}: tensor '{}': {} dims, expected 1 to 4", m.path, name, ne.size());
    // A tensor's dims are stored up to its last one above 1 (ggml's n_dims): a norm is [D], a matrix [K, N], an
    // expert stack [K, N, E]. Readers that check a tensor's dim count (ds4 does) reject a matrix stored as [K, N, 1].
    while (ne.size() > 1 && ne.back() == 1) ne.pop_back();
    uint64_t rows = 1;
    for (size_t d = 0; d < ne.size(); ++d) {
        if (ne[d] <= 0) fail("{}: tensor '{}': ne[{}] is {}, expected a positive size", m.path, name, d, ne[d]);
        if (d > 0 && __builtin_mul_overflow(rows, uint64_t(ne[d]), &rows))
            fail("{}: tensor '{}': shape overflows", m.path, name);
    }
    if (ne[0] % traits->block_elems != 0)
        fail("{}: tensor '{}': ne[0] = {} is not a multiple of the {} block size {}", m.path, name, ne[0], traits->name,
             traits->block_elems);
    uint64_t n_bytes = 0;
    if (__builtin_mul_overflow(uint64_t(ne[0] / traits->block_elems) * traits->block_bytes, rows, &n_bytes) ||
        n_bytes > (uint64_t(1) << 62))
        fail("{}: tensor '{}': byte size overflows", m.path, name);
    m.tensors.push_back({name, type, std::move(ne), m.data_size, n_bytes});
    m.tensor_names.insert(name);
    m.data_size += align_up(n_bytes, m.alignment);
}

void GgufWriter::write_tensor_data(const void * data, size_t bytes) {
    Impl & m = *impl_;
    if (m.finished) fail("{}: tensor data written after finish()", m.path);
    if (!m.header_written) m.write_header();
    const uint8_t * p = static_cast<const uint8_t *>(data);
    while (bytes > 0) {
        if (m.current >= m.tensors.size())
            fail("{}: {} bytes of tensor data beyond the {} declared tensors", m.path, bytes, m.tensors.size());
        const Impl::Tensor & t = m.tensors[m.current];
        // At most 4 MiB per write: AtomicFileWriter copies a write larger than its 8 MiB buffer whole, and a
        // caller may hand over a multi-GB expert tensor in one call.
        const size_t n = size_t(std::min<uint64_t>({bytes, t.n_bytes - m.current_got, uint64_t(4) << 20}));
        m.out.write(p, n);
        p += n;
        bytes -= n;
        m.current_got += n;
        if (m.current_got == t.n_bytes) m.complete_current();
    }
}

void GgufWriter::finish() {
    Impl & m = *impl_;
    if (m.finished) fail("{}: finish() called twice", m.path);
    if (!m.header_written) m.write_header();
    if (m.current < m.tensors.size()) {
        const Impl::Tensor & t = m.tensors[m.current];
        fail("{}: tensor '{}' received {} of its {} bytes ({} of {} tensors complete)", m.path, t.name, m.current_got,
             t.n_bytes, m.current, m.tensors.size());
    }
    m.out.commit();
    m.finished = true;
}

}  // namespace dsv4
