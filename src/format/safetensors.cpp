// safetensors reader. A file is: u64 header length N (little-endian), N bytes of JSON naming each tensor's dtype,
// shape and [begin, end) byte range relative to the data section, then the data section. HF splits large
// checkpoints into shards listed by model.safetensors.index.json ({"weight_map": {tensor: shard file}}).
#include "format/safetensors.h"

#include "util/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

namespace dsv4 {

namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------------------------------------------------------------
// dtypes
// ---------------------------------------------------------------------------------------------------------------------

namespace {

struct DtypeInfo {
    StDtype dtype;
    std::string_view name;  // as the JSON header spells it
    size_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {StDtype::F64, "F64", 8},   {StDtype::F32, "F32", 4},         {StDtype::F16, "F16", 2},
    {StDtype::BF16, "BF16", 2}, {StDtype::F8_E4M3, "F8_E4M3", 1}, {StDtype::F8_E8M0, "F8_E8M0", 1},
    {StDtype::U8, "U8", 1},     {StDtype::I8, "I8", 1},           {StDtype::I16, "I16", 2},
    {StDtype::I32, "I32", 4},   {StDtype::I64, "I64", 8},         {StDtype::BOOL, "BOOL", 1},
};

const DtypeInfo * find_dtype(std::string_view name) {
    for (const DtypeInfo & d : kDtypes)
        if (d.name == name) return &d;
    return nullptr;
}

const DtypeInfo & dtype_info(StDtype dtype) {
    for (const DtypeInfo & d : kDtypes)
        if (d.dtype == dtype) return d;
    fail("unknown safetensors dtype {}", int(dtype));
}

// The safetensors reference implementation refuses headers over 100 MB; a real header is a few MB at most.
constexpr uint64_t kMaxHeader = 100'000'000;

// JSON non-negative integer as u64, or nullopt.
std::optional<uint64_t> json_u64(const json & j) {
    if (j.is_number_unsigned()) return j.get<uint64_t>();
    if (j.is_number_integer() && j.get<int64_t>() >= 0) return uint64_t(j.get<int64_t>());
    return std::nullopt;
}

}  // namespace

std::string_view st_dtype_name(StDtype dtype) { return dtype_info(dtype).name; }
size_t st_dtype_size(StDtype dtype) { return dtype_info(dtype).size; }

int64_t StTensor::n_elements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;  // validated on open: fits in 63 bits
    return n;
}

// ---------------------------------------------------------------------------------------------------------------------
// One file
// ---------------------------------------------------------------------------------------------------------------------

void SafetensorsSet::add_file(const std::string & path) {
    auto file = std::make_unique<MappedFile>(path);
    const uint8_t * base = file->data();
    const uint64_t size = file->size();
    if (size < 8) fail("{}: header: file of {} bytes is too short for the 8-byte header length", path, size);
    uint64_t header_len = 0;
    std::memcpy(&header_len, base, 8);
    if (header_len > size - 8)
        fail("{}: header: length {} runs past the end of the file (size {})", path, header_len, size);
    if (header_len > kMaxHeader) fail("{}: header: length {} is over the {} byte limit", path, header_len, kMaxHeader);
    const uint8_t * data = base + 8 + header_len;
    const uint64_t data_size = size - 8 - header_len;

    // Duplicate keys are legal JSON but ambiguous here; nlohmann keeps the last silently, so catch them while
    // parsing.
    std::set<std::string, std::less<>> seen;
    std::string duplicate;
    json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json & parsed) {
        if (event == json::parse_event_t::key && depth == 1 && duplicate.empty() &&
            !seen.insert(parsed.get<std::string>()).second)
            duplicate = parsed.get<std::string>();
        return true;
    };
    json header;
    try {
        const char * h = reinterpret_cast<const char *>(base + 8);
        header = json::parse(h, h + header_len, on_event);
    } catch (const json::exception & e) {
        fail("{}: header: invalid JSON: {}", path, e.what());
    }
    if (!header.is_object()) fail("{}: header: expected a JSON object, found {}", path, header.type_name());
    if (!duplicate.empty()) fail("{}: tensor '{}': listed twice in the header", path, duplicate);

    file_names_.push_back(std::make_unique<std::string>(path));
    const std::string * file_name = file_names_.back().get();

    struct Range {
        uint64_t begin, end;
        std::string_view name;
    };
    std::vector<Range> ranges;
    std::vector<StTensor> added;
    for (const auto & [name, entry] : header.items()) {
        if (name == "__metadata__") {
            if (!entry.is_object()) fail("{}: __metadata__: expected an object, found {}", path, entry.type_name());
            for (const auto & [k, v] : entry.items()) {
                if (!v.is_string()) fail("{}: __metadata__['{}']: expected a string, found {}", path, k, v.type_name());
                metadata_.emplace(k, v.get<std::string>());
            }
            continue;
        }
        // Lambdas capture a reference, not the structured binding (clang before 16 refuses that capture).
        const std::string & tensor_name = name;
        auto bad = [&](std::string_view problem) { fail("{}: tensor '{}': {}", path, tensor_name, problem); };
        if (!entry.is_object()) bad(fmt::format("expected an object, found {}", entry.type_name()));

        StTensor t;
        t.name = name;
        t.file = file_name;
        const auto dtype_it = entry.find("dtype");
        if (dtype_it == entry.end() || !dtype_it->is_string()) bad("dtype: missing or not a string");
        const DtypeInfo * dtype = find_dtype(dtype_it->get_ref<const std::string &>());
        if (!dtype) bad(fmt::format("dtype: unknown dtype '{}'", dtype_it->get_ref<const std::string &>()));
        t.dtype = dtype->dtype;

        const auto shape_it = entry.find("shape");
        if (shape_it == entry.end() || !shape_it->is_array()) bad("shape: missing or not an array");
        uint64_t n_elements = 1;
        for (const json & d : *shape_it) {
            const auto v = json_u64(d);
            if (!v) bad(fmt::format("shape: {} is not a non-negative integer", d.dump()));
            if (__builtin_mul_overflow(n_elements, *v, &n_elements) ||
                n_elements > uint64_t(std::numeric_limits<int64_t>::max()))
                bad(fmt::format("shape: {} overflows 63 bits", shape_it->dump()));
            t.shape.push_back(int64_t(*v));
        }

        const auto offsets_it = entry.find("data_offsets");
        if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2)
            bad("data_offsets: missing or not a [begin, end] pair");
        const auto begin = json_u64((*offsets_it)[0]), end = json_u64((*offsets_it)[1]);
        if (!begin || !end || *begin > *end)
            bad(fmt::format("data_offsets: {} is not a range [begin, end)", offsets_it->dump()));
        if (*end > data_size)
            bad(fmt::format("data_offsets: [{}, {}) past the end of the data section ({} bytes)", *begin, *end,
                            data_size));
        uint64_t n_bytes = 0;
        if (__builtin_mul_overflow(n_elements, uint64_t(dtype->size), &n_bytes))
            bad(fmt::format("shape: {} of {} is over 2^64 bytes", shape_it->dump(), dtype->name));
        if (n_bytes != *end - *begin)
            bad(fmt::format("data_offsets: [{}, {}) holds {} bytes, shape {} of {} needs {}", *begin, *end,
                            *end - *begin, shape_it->dump(), dtype->name, n_bytes));
        t.data = data + *begin;
        t.n_bytes = size_t(n_bytes);
        ranges.push_back({*begin, *end, {}});
        added.push_back(std::move(t));
    }
    for (size_t i = 0; i < added.size(); ++i) ranges[i].name = added[i].name;
    std::sort(ranges.begin(), ranges.end(), [](const Range & a, const Range & b) { return a.begin < b.begin; });
    const Range * prev = nullptr;
    for (const Range & r : ranges) {
        if (r.begin == r.end) continue;  // empty tensors occupy no bytes
        if (prev && r.begin < prev->end)
            fail("{}: tensor '{}': data_offsets [{}, {}) overlap tensor '{}' at [{}, {})", path, r.name, r.begin, r.end,
                 prev->name, prev->begin, prev->end);
        prev = &r;
    }

    for (StTensor & t : added) {
        if (auto it = index_.find(t.name); it != index_.end())
            fail("{}: tensor '{}': also in {}", path, t.name, *tensors_[it->second].file);
        index_.emplace(t.name, tensors_.size());
        tensors_.push_back(std::move(t));
    }
    files_.push_back(std::move(file));
}

// ---------------------------------------------------------------------------------------------------------------------
// A file or a folder (sharded through an index, or one model.safetensors)
// ---------------------------------------------------------------------------------------------------------------------

SafetensorsSet SafetensorsSet::open(const std::string & path) {
    SafetensorsSet set;
    std::error_code ec;
    if (!fs::is_directory(path, ec)) {
        set.add_file(path);
        return set;
    }
    const fs::path dir(path);
    const fs::path index_path = dir / "model.safetensors.index.json";
    if (!fs::exists(index_path, ec)) {
        const fs::path single = dir / "model.safetensors";
        if (!fs::exists(single, ec))
            fail("{}: no model.safetensors.index.json or model.safetensors in this folder", path);
        set.add_file(single.string());
        return set;
    }

    const std::string index_name = index_path.string();
    json index;
    try {
        index = json::parse(read_file(index_name));
    } catch (const json::exception & e) {
        fail("{}: invalid JSON: {}", index_name, e.what());
    }
    if (!index.is_object()) fail("{}: expected a JSON object, found {}", index_name, index.type_name());
    const auto map_it = index.find("weight_map");
    if (map_it == index.end() || !map_it->is_object()) fail("{}: weight_map: missing or not an object", index_name);

    // Shards in order of first mention, so tensors() follows the index.
    std::vector<std::string> shards;
    std::set<std::string, std::less<>> shard_set;
    for (const auto & [tensor, shard] : map_it->items()) {
        if (!shard.is_string()) fail("{}: weight_map['{}']: expected a shard file name", index_name, tensor);
        const std::string & s = shard.get_ref<const std::string &>();
        if (s.empty() || s.find('/') != std::string::npos || s == "." || s == "..")
            fail("{}: weight_map['{}']: shard '{}' is not a file name in the same folder", index_name, tensor, s);
        if (shard_set.insert(s).second) {
            if (!fs::is_regular_file(dir / s, ec))
                fail("{}: weight_map['{}']: shard '{}' is missing", index_name, tensor, s);
            shards.push_back(s);
        }
    }
    for (const std::string & s : shards) set.add_file((dir / s).string());

    // The index and the shards must agree both ways.
    for (const auto & [tensor, shard] : map_it->items()) {
        const StTensor * t = set.find(tensor);
        const std::string expected = (dir / shard.get<std::string>()).string();
        if (!t)
            fail("{}: weight_map['{}']: tensor not found in shard '{}'", index_name, tensor, shard.get<std::string>());
        if (*t->file != expected)
            fail("{}: weight_map['{}']: tensor is in {}, not in shard '{}'", index_name, tensor, *t->file,
                 shard.get<std::string>());
    }
    for (const StTensor & t : set.tensors_)
        if (!map_it->contains(t.name)) fail("{}: tensor '{}': not listed in {}", *t.file, t.name, index_name);

    if (const auto meta = index.find("metadata"); meta != index.end() && meta->is_object())
        for (const auto & [k, v] : meta->items())
            set.metadata_.emplace(k, v.is_string() ? v.get<std::string>() : v.dump());
    return set;
}

const StTensor * SafetensorsSet::find(std::string_view name) const {
    auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
}

const StTensor & SafetensorsSet::get(std::string_view name) const {
    const StTensor * t = find(name);
    if (!t) {
        if (file_names_.size() == 1) fail("{}: tensor '{}' not found", *file_names_[0], name);
        fail("tensor '{}' not found in the {} shards {}, ...", name, file_names_.size(),
             file_names_.empty() ? std::string() : *file_names_[0]);
    }
    return *t;
}

}  // namespace dsv4
