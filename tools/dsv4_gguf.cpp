// dsv4-gguf: prints a GGUF file's header, metadata and tensor table (in the spirit of llama.cpp's gguf_dump),
// after the same validation the engine applies on load. The output is plain text in a fixed layout so that
// scripts and tests can compare it; long arrays and strings are cut unless --all is given.
#include "format/gguf.h"
#include "util/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

namespace dsv4 {
namespace {

constexpr size_t kArrayHead = 8;     // elements shown of a cut array
constexpr size_t kStringHead = 120;  // bytes shown of a cut string

// Length of the valid UTF-8 sequence starting at s[i], or 0 when the bytes there are not one.
size_t utf8_length(std::string_view s, size_t i) {
    const auto b = [&](size_t k) { return uint8_t(s[k]); };
    const uint8_t c = b(i);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return 0;
    for (size_t k = 1; k < n; ++k)
        if ((b(i + k) & 0xc0) != 0x80) return 0;
    if (n == 2 && c < 0xc2) return 0;                                                             // overlong
    if (n == 3 && ((c == 0xe0 && b(i + 1) < 0xa0) || (c == 0xed && b(i + 1) >= 0xa0))) return 0;  // overlong, surrogate
    if (n == 4 && ((c == 0xf0 && b(i + 1) < 0x90) || c > 0xf4 || (c == 0xf4 && b(i + 1) >= 0x90))) return 0;
    return n;
}

// A double-quoted string: valid UTF-8 passes through, control characters and bytes that are not UTF-8 (GGUF
// token strings may hold any bytes) are escaped, so every line stays one line of valid text.
std::string quote(std::string_view s, bool all) {
    std::string out = "\"";
    const size_t limit = all ? s.size() : std::min(s.size(), kStringHead);
    size_t i = 0;
    while (i < limit) {
        const uint8_t c = uint8_t(s[i]);
        const size_t n = utf8_length(s, i);
        if (c == '"' || c == '\\') {
            out += '\\';
            out += char(c);
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\t') {
            out += "\\t";
        } else if (c == '\r') {
            out += "\\r";
        } else if (n == 0 || c < 0x20 || c == 0x7f) {
            out += fmt::format("\\x{:02x}", c);
        } else {
            out.append(s.substr(i, n));
            i += n;
            continue;
        }
        ++i;
    }
    out += '"';
    if (i < s.size()) out += fmt::format("... ({} bytes)", s.size());
    return out;
}

std::string type_string(const GgufValue & v) {
    if (v.type != GgufType::ARRAY) return std::string(gguf_type_name(v.type));
    return fmt::format("ARRAY[{}; {}]", gguf_type_name(v.elem_type), v.array.size());
}

std::string value_string(const GgufValue & v, bool all) {
    switch (v.type) {
        case GgufType::UINT8:
        case GgufType::UINT16:
        case GgufType::UINT32:
        case GgufType::UINT64:
            return fmt::format("{}", v.u);
        case GgufType::INT8:
        case GgufType::INT16:
        case GgufType::INT32:
        case GgufType::INT64:
            return fmt::format("{}", v.i);
        case GgufType::FLOAT32:
            return fmt::format("{}", float(v.f));  // shortest text that reads back as the f32
        case GgufType::FLOAT64:
            return fmt::format("{}", v.f);
        case GgufType::BOOL:
            return v.u ? "true" : "false";
        case GgufType::STRING:
            return quote(v.str, all);
        case GgufType::ARRAY: {
            const size_t n = all ? v.array.size() : std::min(v.array.size(), kArrayHead);
            std::string out = "[";
            for (size_t i = 0; i < n; ++i) {
                if (i) out += ", ";
                out += value_string(v.array[i], all);
            }
            if (n < v.array.size()) out += fmt::format(", ... ({} more)", v.array.size() - n);
            return out + "]";
        }
    }
    return "?";
}

void print_file(const GgufFile & f, bool all) {
    fmt::print("file: {}\n", f.path());
    fmt::print("version: {}\n", f.version());
    fmt::print("alignment: {}\n", f.alignment());
    fmt::print("kv_count: {}\n", f.metadata().size());
    fmt::print("tensor_count: {}\n", f.tensors().size());
    fmt::print("data_offset: {}\n", f.data_offset());
    fmt::print("file_size: {}\n", f.file_size());
    if (f.n_splits() > 1)
        fmt::print("split_files: {} (offsets below read FILE:OFFSET, FILE counting from 1)\n", f.n_splits());

    fmt::print("\nmetadata:\n");
    for (const GgufKv & kv : f.metadata())
        fmt::print("  {}: {} = {}\n", kv.key, type_string(kv.value), value_string(kv.value, all));

    // Offsets are relative to data_offset, as stored in the file.
    fmt::print("\ntensors:\n");
    fmt::print("  {:>5}  {:<40}  {:<7}  {:<26}  {:>12}  {:>12}\n", "index", "name", "type", "shape", "offset", "bytes");
    for (size_t i = 0; i < f.tensors().size(); ++i) {
        const GgufTensorInfo & t = f.tensors()[i];
        const std::string shape = fmt::format("[{}]", fmt::join(t.ne, t.ne + t.n_dims, ", "));
        const std::string offset =
            f.n_splits() > 1 ? fmt::format("{}:{}", t.split + 1, t.offset) : fmt::format("{}", t.offset);
        fmt::print("  {:>5}  {:<40}  {:<7}  {:<26}  {:>12}  {:>12}\n", i, t.name, type_name(t.type), shape, offset,
                   t.n_bytes);
    }
}

}  // namespace
}  // namespace dsv4

int main(int argc, char ** argv) {
    CLI::App app{"Print a GGUF file's header, metadata and tensor table."};
    std::string path;
    bool all = false;
    app.add_option("file", path, "GGUF file")->required();
    app.add_flag("--all", all, "print arrays and strings whole instead of their first elements");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError & e) {
        return app.exit(e) == 0 ? 0 : 1;
    }
    try {
        const dsv4::GgufFile f = dsv4::GgufFile::open(path);
        dsv4::print_file(f, all);
    } catch (const std::exception & e) {  // dsv4::Error for any defect in the file; bad_alloc
        std::fflush(stdout);
        fmt::print(stderr, "dsv4-gguf: {}\n", e.what());
        return 1;
    }
    return 0;
}
