// GGUF reader and writer: a file written by llama.cpp's gguf-py checked against gguf-py's own dump, round trips
// through GgufWriter (every value type, nested arrays, every tensor type, alignment 64, v2, chunked streaming),
// every validation error on hand-made bytes (message names the file and the field), and the open-time cost of
// huge files and of a full-size vocabulary.
#include "format/gguf.h"
#include "util/error.h"
#include "util/file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

using namespace dsv4;
using ::testing::HasSubstr;

namespace {

namespace fs = std::filesystem;

const std::string kData = std::string(DSV4_TEST_DATA) + "/gguf";

// ---------------------------------------------------------------------------------------------------------------------
// Helpers: a scratch folder per test, hand-made GGUF bytes, error capture
// ---------------------------------------------------------------------------------------------------------------------

class GgufTest : public ::testing::Test {
  protected:
    void SetUp() override {
        const auto * info = ::testing::UnitTest::GetInstance()->current_test_info();
        dir_ = fs::temp_directory_path() / fmt::format("dsv4-gguf-test-{}-{}", ::getpid(), info->name());
        fs::remove_all(dir_);
        fs::create_directories(dir_);
    }
    void TearDown() override { fs::remove_all(dir_); }
    std::string path(const std::string & name) const { return (dir_ / name).string(); }
    std::string write(const std::string & name, const std::string & bytes) const {
        std::ofstream(path(name), std::ios::binary) << bytes;
        return path(name);
    }

    fs::path dir_;
};

// Little-endian GGUF pieces, written field by field so tests can build any file, valid or not.
struct Bytes {
    std::string b;

    template <typename T>
    Bytes & put(T v) {
        char c[sizeof(T)];
        std::memcpy(c, &v, sizeof(T));
        b.append(c, sizeof(T));
        return *this;
    }
    Bytes & u32(uint32_t v) { return put(v); }
    Bytes & u64(uint64_t v) { return put(v); }
    Bytes & str(std::string_view s) {
        u64(s.size());
        b.append(s);
        return *this;
    }
    Bytes & header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
        b.append("GGUF");
        return u32(version).u64(n_tensors).u64(n_kv);
    }
    Bytes & kv_u32(std::string_view key, uint32_t v) { return str(key).u32(uint32_t(GgufType::UINT32)).u32(v); }
    Bytes & kv_type(std::string_view key, GgufType t) { return str(key).u32(uint32_t(t)); }
    Bytes & tensor(std::string_view name, std::vector<int64_t> ne, uint32_t type, uint64_t offset) {
        str(name).u32(uint32_t(ne.size()));
        for (int64_t n : ne) u64(uint64_t(n));
        return u32(type).u64(offset);
    }
    Bytes & pad(size_t alignment = 32) {
        b.resize((b.size() + alignment - 1) / alignment * alignment, '\0');
        return *this;
    }
    Bytes & zeros(size_t n) {
        b.append(n, '\0');
        return *this;
    }
};

// The message of the dsv4::Error that `f` throws, or "" with a test failure when it throws nothing.
template <typename F>
std::string error_of(F && f) {
    try {
        f();
    } catch (const Error & e) {
        return e.what();
    }
    ADD_FAILURE() << "no dsv4::Error thrown";
    return "";
}

std::string parse_error(const std::string & bytes, const std::string & name) {
    return error_of([&] { GgufFile::parse(reinterpret_cast<const uint8_t *>(bytes.data()), bytes.size(), name); });
}

GgufFile parse_bytes(const std::string & bytes, const std::string & name = "mem.gguf") {
    return GgufFile::parse(reinterpret_cast<const uint8_t *>(bytes.data()), bytes.size(), name);
}

std::string trim(std::string s) {
    const auto b = s.find_first_not_of(' ');
    const auto e = s.find_last_not_of(' ');
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    for (std::string part; std::getline(ss, part, sep);) out.push_back(part);
    return out;
}

std::string upper(std::string_view s) {
    std::string r(s);
    for (char & c : r) c = char(std::toupper(uint8_t(c)));
    return r;
}

// ---------------------------------------------------------------------------------------------------------------------
// A file written by llama.cpp's gguf-py, checked against gguf-py's own dump of it
// ---------------------------------------------------------------------------------------------------------------------

// gguf-py's way of naming a value's type: "UINT32", "[INT32]", "[[STRING]]" (nested arrays by their first element).
std::string gguf_py_type(const GgufValue & v) {
    int depth = 0;
    const GgufValue * cur = &v;
    GgufType leaf = v.type;
    while (cur->type == GgufType::ARRAY) {
        ++depth;
        leaf = cur->elem_type;
        if (cur->elem_type != GgufType::ARRAY || cur->array.empty()) break;
        cur = &cur->array[0];
    }
    return std::string(depth, '[') + std::string(gguf_type_name(leaf)) + std::string(depth, ']');
}

// gguf-py's element count: the scalars (or strings) at the leaves.
size_t leaf_count(const GgufValue & v) {
    if (v.type != GgufType::ARRAY) return 1;
    if (v.elem_type != GgufType::ARRAY) return v.array.size();
    size_t n = 0;
    for (const GgufValue & e : v.array) n += leaf_count(e);
    return n;
}

size_t utf8_chars(std::string_view s) {
    return size_t(std::count_if(s.begin(), s.end(), [](char c) { return (uint8_t(c) & 0xc0) != 0x80; }));
}

TEST(GgufPy, ReaderAgreesWithGgufPyDump) {
    const GgufFile f = GgufFile::open(kData + "/tiny-deepseek4.gguf");
    std::ifstream dump(kData + "/tiny-deepseek4.gguf-py-dump.txt");
    ASSERT_TRUE(dump) << "missing gguf-py dump";

    enum { kNone, kKeys, kTensors } section = kNone;
    size_t n_keys = 0, n_tensors = 0;
    for (std::string line; std::getline(dump, line);) {
        if (line.rfind("* Dumping", 0) == 0) {
            section = line.find("key/value") != std::string::npos ? kKeys : kTensors;
            continue;
        }
        const auto cells = split(line, '|');
        if (section == kKeys && cells.size() == 3) {
            // "    N: TYPE       |        1 | key = value"
            const std::string type = trim(cells[0].substr(cells[0].find(':') + 1));
            const size_t count = std::stoul(trim(cells[1]));
            std::string key = trim(cells[2]), value;
            if (auto eq = key.find(" = "); eq != std::string::npos) {
                value = key.substr(eq + 3);
                key = key.substr(0, eq);
            }
            SCOPED_TRACE(key);
            if (key == "GGUF.version") {
                EXPECT_EQ(value, std::to_string(f.version()));
                continue;
            }
            if (key == "GGUF.tensor_count") {
                EXPECT_EQ(value, std::to_string(f.tensors().size()));
                continue;
            }
            if (key == "GGUF.kv_count") {
                EXPECT_EQ(value, std::to_string(f.metadata().size()));
                continue;
            }
            ASSERT_LT(n_keys, f.metadata().size());
            const GgufKv & kv = f.metadata()[n_keys++];  // same order as in the file
            EXPECT_EQ(kv.key, key);
            EXPECT_EQ(gguf_py_type(kv.value), type);
            EXPECT_EQ(leaf_count(kv.value), count);
            const GgufValue & v = kv.value;
            if (value.empty()) continue;  // gguf-py prints no value for arrays
            switch (v.type) {
                case GgufType::UINT8:
                case GgufType::UINT16:
                case GgufType::UINT32:
                case GgufType::UINT64:
                    EXPECT_EQ(value, std::to_string(v.u));
                    break;
                case GgufType::INT8:
                case GgufType::INT16:
                case GgufType::INT32:
                case GgufType::INT64:
                    EXPECT_EQ(value, std::to_string(v.i));
                    break;
                case GgufType::FLOAT32:
                case GgufType::FLOAT64:
                    EXPECT_EQ(std::strtod(value.c_str(), nullptr), v.f) << value;
                    break;
                case GgufType::BOOL:
                    EXPECT_EQ(value, v.u ? "True" : "False");
                    break;
                case GgufType::STRING: {
                    // Python's repr of the first 60 characters; compare when it needed no escapes.
                    ASSERT_GE(value.size(), 2u);
                    const std::string inner = value.substr(1, value.size() - 2);
                    if (inner.find('\\') != std::string::npos) break;
                    EXPECT_EQ(v.str.substr(0, inner.size()), inner);
                    if (utf8_chars(v.str) <= 60) {
                        EXPECT_EQ(v.str, inner);
                    }
                    break;
                }
                default:
                    ADD_FAILURE() << "unexpected type " << gguf_type_name(v.type);
            }
        } else if (section == kTensors && cells.size() == 4) {
            // "    N:    n_elements |    d0,    d1,    d2,    d3 | TYPE    | name"
            ASSERT_LT(n_tensors, f.tensors().size());
            const GgufTensorInfo & t = f.tensors()[n_tensors++];
            EXPECT_EQ(t.name, trim(cells[3]));
            SCOPED_TRACE(t.name);
            EXPECT_EQ(std::to_string(t.n_elements()), trim(cells[0].substr(cells[0].find(':') + 1)));
            const auto dims = split(cells[1], ',');
            ASSERT_EQ(dims.size(), 4u);
            for (int d = 0; d < 4; ++d) EXPECT_EQ(std::to_string(t.ne[d]), trim(dims[d])) << "dim " << d;
            EXPECT_EQ(upper(type_name(t.type)), trim(cells[2]));
        }
    }
    EXPECT_EQ(n_keys, f.metadata().size());
    EXPECT_EQ(n_tensors, f.tensors().size());
    EXPECT_EQ(n_tensors, 92u);
}

TEST(GgufPy, OffsetsAgreeWithGgufPyMarkdownDump) {
    const GgufFile f = GgufFile::open(kData + "/tiny-deepseek4.gguf");
    std::ifstream dump(kData + "/tiny-deepseek4.gguf-py-dump.md");
    ASSERT_TRUE(dump) << "missing gguf-py markdown dump";
    bool in_table = false;
    size_t rows = 0;
    for (std::string line; std::getline(dump, line);) {
        if (line.rfind("### Tensor Data Offset", 0) == 0) in_table = true;
        if (!in_table) continue;
        if (line.rfind("### ", 0) == 0 && line.find("Tensor Data Offset") == std::string::npos) break;
        // "|    0 | token_embd.weight |  0x23c0 |  0x1000 |": absolute data offset and size
        const auto cells = split(line, '|');
        if (cells.size() != 5 || trim(cells[3]).rfind("0x", 0) != 0) continue;
        const size_t index = std::stoul(trim(cells[1]));
        ASSERT_LT(index, f.tensors().size());
        const GgufTensorInfo & t = f.tensors()[index];
        EXPECT_EQ(t.name, trim(cells[2]));
        EXPECT_EQ(f.data_offset() + t.offset, std::stoull(trim(cells[3]), nullptr, 16)) << t.name;
        EXPECT_EQ(t.n_bytes, std::stoull(trim(cells[4]), nullptr, 16)) << t.name;
        EXPECT_EQ(f.tensor_data(t), f.mapping()->data() + f.data_offset() + t.offset);
        ++rows;
    }
    EXPECT_EQ(rows, f.tensors().size());
}

// Values as make_tiny_deepseek4.py wrote them, through the typed getters.
TEST(GgufPy, TypedGetters) {
    const GgufFile f = GgufFile::open(kData + "/tiny-deepseek4.gguf");
    EXPECT_EQ(f.version(), 3u);
    EXPECT_EQ(f.alignment(), 32u);
    EXPECT_EQ(f.get_string("general.architecture"), "deepseek4");
    EXPECT_EQ(f.get_u64("deepseek4.block_count"), 3u);
    EXPECT_EQ(f.get_i64("deepseek4.embedding_length"), 64);
    EXPECT_EQ(f.get_f64("deepseek4.expert_weights_scale"), 1.5);
    EXPECT_FLOAT_EQ(float(f.get_f64("deepseek4.attention.layer_norm_rms_epsilon")), 1e-6f);
    EXPECT_EQ(f.get_f64("deepseek4.embedding_length"), 64.0);  // integers read as floats too
    EXPECT_TRUE(f.get_bool("deepseek4.expert_weights_norm"));
    EXPECT_FALSE(f.get_bool("test.false"));
    EXPECT_EQ(f.get_int_array("deepseek4.attention.compress_ratios"), (std::vector<int64_t>{0, 4, 128}));
    EXPECT_EQ(f.get_f64_array("deepseek4.swiglu_clamp_exp"), (std::vector<double>{10, 10, 10}));
    EXPECT_EQ(f.get_f64_array("deepseek4.attention.compress_ratios"), (std::vector<double>{0, 4, 128}));
    const auto tokens = f.get_string_array("tokenizer.ggml.tokens");
    ASSERT_EQ(tokens.size(), 32u);
    EXPECT_EQ(tokens[0], "<｜begin▁of▁sentence｜>");
    EXPECT_EQ(tokens[8], "中文");
    EXPECT_EQ(tokens[9], "\n");
    EXPECT_EQ(tokens[31], "u");
    EXPECT_EQ(f.get_u64("test.u8"), 200u);
    EXPECT_EQ(f.get_i64("test.i8"), -100);
    EXPECT_EQ(f.get_u64("test.u16"), 60000u);
    EXPECT_EQ(f.get_i64("test.i16"), -30000);
    EXPECT_EQ(f.get_u64("test.u64"), uint64_t(1) << 40);
    EXPECT_EQ(f.get_i64("test.i64"), -(int64_t(1) << 40));
    EXPECT_EQ(f.get_f64("test.f64"), 0.1);
    const GgufValue * nested = f.find("test.nested");
    ASSERT_TRUE(nested);
    ASSERT_EQ(nested->elem_type, GgufType::ARRAY);
    ASSERT_EQ(nested->array.size(), 3u);
    EXPECT_EQ(nested->array[1].array.size(), 3u);
    EXPECT_EQ(nested->array[1].array[2].i, 5);
    EXPECT_EQ(f.find("test.nested_str")->array[1].array[0].str, "zzz");

    const GgufTensorInfo * q = f.find_tensor("blk.1.ffn_gate_exps.weight");
    ASSERT_TRUE(q);
    EXPECT_EQ(q->type, GgmlType::Q8_0);
    EXPECT_EQ(q->n_dims, 3);
    EXPECT_EQ(q->n_bytes, 64u / 32 * 34 * 32 * 4);
    const GgufTensorInfo * tid = f.find_tensor("blk.0.ffn_gate_tid2eid.weight");
    ASSERT_TRUE(tid);
    EXPECT_EQ(tid->type, GgmlType::I32);
    // tid2eid holds expert ids drawn from [0, 4) by the generator.
    for (int64_t i = 0; i < tid->n_elements(); ++i) {
        int32_t e;
        std::memcpy(&e, f.tensor_data(*tid) + 4 * i, 4);
        ASSERT_TRUE(e >= 0 && e < 4) << e;
    }
    EXPECT_EQ(f.find_tensor("blk.2.ffn_gate_inp.weight")->type, GgmlType::BF16);
    // Compress ratios [0, 4, 128]: no compressor in layer 0, an indexer only in the ratio-4 layer 1.
    EXPECT_EQ(f.find_tensor("blk.0.attn_compressor_ape.weight"), nullptr);
    EXPECT_NE(f.find_tensor("blk.1.indexer.proj.weight"), nullptr);
    EXPECT_EQ(f.find_tensor("blk.2.indexer.proj.weight"), nullptr);
    EXPECT_EQ(f.find_tensor("blk.2.attn_compressor_ape.weight")->ne[1], 128);
}

// ---------------------------------------------------------------------------------------------------------------------
// Round trips through GgufWriter
// ---------------------------------------------------------------------------------------------------------------------

// A byte pattern that differs between tensors and positions, so misplaced data is caught.
uint8_t pattern(size_t tensor, uint64_t i) { return uint8_t((tensor * 131 + i * 7 + (i >> 8)) & 0xff); }

std::vector<GgmlType> all_known_types() {
    std::vector<GgmlType> types;
    for (uint32_t id = 0; id < 64; ++id)
        if (type_traits(id)) types.push_back(GgmlType(id));
    return types;
}

TEST_F(GgufTest, RoundTripEveryValueTypeAndTensorType) {
    const std::string file = path("round.gguf");
    const std::string not_utf8("\xff\xfe\0x", 4);
    const auto types = all_known_types();
    ASSERT_GE(types.size(), 30u);
    {
        GgufWriter w(file);
        w.set("general.architecture", GgufValue::make_string("deepseek4"));
        w.set("v.u8", GgufValue::make_u8(255));
        w.set("v.i8", GgufValue::make_i8(-128));
        w.set("v.u16", GgufValue::make_u16(65535));
        w.set("v.i16", GgufValue::make_i16(-32768));
        w.set("v.u32", GgufValue::make_u32(4294967295u));
        w.set("v.i32", GgufValue::make_i32(-2147483647 - 1));
        w.set("v.u64", GgufValue::make_u64(~uint64_t(0)));
        w.set("v.i64", GgufValue::make_i64(INT64_MIN));
        w.set("v.f32", GgufValue::make_f32(-0.1f));
        w.set("v.f64", GgufValue::make_f64(1e300));
        w.set("v.bool", GgufValue::make_bool(true));
        w.set("v.str", GgufValue::make_string("héllo"));
        w.set("v.empty_str", GgufValue::make_string(""));
        w.set("v.bytes", GgufValue::make_string(not_utf8));
        w.set("v.replaced", GgufValue::make_u32(1));
        w.set("v.replaced", GgufValue::make_string("second"));  // replaces, keeps its place
        w.set("v.i32s", GgufValue::make_array(GgufType::INT32, {GgufValue::make_i32(0), GgufValue::make_i32(-4)}));
        w.set("v.f32s", GgufValue::make_array(GgufType::FLOAT32, {GgufValue::make_f32(10), GgufValue::make_f32(0.5f)}));
        w.set("v.strs",
              GgufValue::make_array(GgufType::STRING, {GgufValue::make_string("a"), GgufValue::make_string(not_utf8)}));
        w.set("v.empty", GgufValue::make_array(GgufType::UINT64, {}));
        GgufValue inner = GgufValue::make_array(GgufType::UINT16, {GgufValue::make_u16(7)});
        GgufValue mid = GgufValue::make_array(GgufType::ARRAY, {inner, GgufValue::make_array(GgufType::UINT16, {})});
        GgufValue mixed = GgufValue::make_array(GgufType::STRING, {GgufValue::make_string("s")});
        w.set("v.nested", GgufValue::make_array(GgufType::ARRAY, {mid, mixed}));
        for (size_t i = 0; i < types.size(); ++i) {
            const TypeTraits & t = type_traits(types[i]);
            w.add_tensor(fmt::format("t.{}", t.name), types[i], {2 * t.block_elems, 3});
        }
        w.add_tensor("t.4d", GgmlType::F32, {2, 3, 4, 5});
        for (size_t i = 0; i <= types.size(); ++i) {
            const size_t n = i < types.size() ? row_bytes(types[i], 2 * type_traits(types[i]).block_elems) * 3 : 480;
            std::vector<uint8_t> data(n);
            for (size_t k = 0; k < n; ++k) data[k] = pattern(i, k);
            w.write_tensor_data(data.data(), data.size());
        }
        w.finish();
    }

    const GgufFile f = GgufFile::open(file);
    EXPECT_EQ(f.version(), 3u);
    EXPECT_EQ(f.alignment(), 32u);
    EXPECT_FALSE(f.has("general.alignment"));  // the default is not written
    EXPECT_EQ(f.metadata().size(), 21u);
    EXPECT_EQ(f.get_u64("v.u8"), 255u);
    EXPECT_EQ(f.find("v.u8")->type, GgufType::UINT8);
    EXPECT_EQ(f.get_i64("v.i8"), -128);
    EXPECT_EQ(f.find("v.i8")->type, GgufType::INT8);
    EXPECT_EQ(f.get_u64("v.u16"), 65535u);
    EXPECT_EQ(f.get_i64("v.i16"), -32768);
    EXPECT_EQ(f.get_u64("v.u32"), 4294967295u);
    EXPECT_EQ(f.get_i64("v.i32"), -2147483648LL);
    EXPECT_EQ(f.get_u64("v.u64"), ~uint64_t(0));
    EXPECT_EQ(f.get_i64("v.i64"), INT64_MIN);
    EXPECT_EQ(f.find("v.f32")->type, GgufType::FLOAT32);
    EXPECT_EQ(f.get_f64("v.f32"), double(-0.1f));
    EXPECT_EQ(f.get_f64("v.f64"), 1e300);
    EXPECT_TRUE(f.get_bool("v.bool"));
    EXPECT_EQ(f.get_string("v.str"), "héllo");
    EXPECT_EQ(f.get_string("v.empty_str"), "");
    EXPECT_EQ(f.get_string("v.bytes"), not_utf8);  // any bytes, an embedded NUL included
    EXPECT_EQ(f.get_string("v.replaced"), "second");
    EXPECT_EQ(f.metadata()[15].key, "v.replaced");
    EXPECT_EQ(f.get_int_array("v.i32s"), (std::vector<int64_t>{0, -4}));
    EXPECT_EQ(f.get_f64_array("v.f32s"), (std::vector<double>{10, 0.5}));
    EXPECT_EQ(f.get_string_array("v.strs"), (std::vector<std::string_view>{"a", not_utf8}));
    EXPECT_EQ(f.find("v.empty")->elem_type, GgufType::UINT64);
    EXPECT_TRUE(f.get_int_array("v.empty").empty());
    const GgufValue & n = *f.find("v.nested");
    ASSERT_EQ(n.elem_type, GgufType::ARRAY);
    ASSERT_EQ(n.array.size(), 2u);
    ASSERT_EQ(n.array[0].elem_type, GgufType::ARRAY);
    ASSERT_EQ(n.array[0].array.size(), 2u);
    EXPECT_EQ(n.array[0].array[0].elem_type, GgufType::UINT16);
    EXPECT_EQ(n.array[0].array[0].array.at(0).u, 7u);
    EXPECT_TRUE(n.array[0].array[1].array.empty());
    EXPECT_EQ(n.array[1].elem_type, GgufType::STRING);
    EXPECT_EQ(n.array[1].array.at(0).str, "s");

    ASSERT_EQ(f.tensors().size(), types.size() + 1);
    uint64_t expected_offset = 0;
    for (size_t i = 0; i < f.tensors().size(); ++i) {
        const GgufTensorInfo & t = f.tensors()[i];
        SCOPED_TRACE(t.name);
        if (i < types.size()) {
            const TypeTraits & tr = type_traits(types[i]);
            EXPECT_EQ(t.type, types[i]);
            EXPECT_EQ(t.n_dims, 2);
            EXPECT_EQ(t.ne[0], 2 * tr.block_elems);
            EXPECT_EQ(t.ne[1], 3);
            EXPECT_EQ(t.n_bytes, 2 * tr.block_bytes * 3);  // from ggml's block sizes, not from the reader
        } else {
            EXPECT_EQ(t.n_dims, 4);
            EXPECT_EQ(t.n_elements(), 120);
            EXPECT_EQ(t.n_bytes, 480u);
        }
        EXPECT_EQ(t.offset, expected_offset);
        expected_offset += (t.n_bytes + 31) / 32 * 32;
        for (uint64_t k = 0; k < t.n_bytes; ++k) ASSERT_EQ(f.tensor_data(t)[k], pattern(i, k)) << k;
        for (uint64_t k = t.n_bytes; k % 32 != 0; ++k) ASSERT_EQ(f.tensor_data(t)[k], 0) << "padding " << k;
    }
    EXPECT_EQ(f.data_offset() % 32, 0u);
    EXPECT_EQ(f.file_size(), f.data_offset() + expected_offset);
}

TEST_F(GgufTest, Alignment64) {
    const std::string file = path("a64.gguf");
    {
        GgufWriter w(file, 64);
        w.set("k", GgufValue::make_string("x"));
        w.add_tensor("a", GgmlType::F32, {3});  // 12 bytes, padded to 64
        w.add_tensor("b", GgmlType::Q8_0, {32, 1});
        w.add_tensor("c", GgmlType::F16, {5});
        uint8_t buf[34] = {};
        w.write_tensor_data(buf, 12);
        w.write_tensor_data(buf, 34);
        w.write_tensor_data(buf, 10);
        w.finish();
    }
    const GgufFile f = GgufFile::open(file);
    EXPECT_EQ(f.alignment(), 64u);
    EXPECT_EQ(f.find("general.alignment")->type, GgufType::UINT32);
    EXPECT_EQ(f.get_u64("general.alignment"), 64u);
    EXPECT_EQ(f.data_offset() % 64, 0u);
    EXPECT_EQ(f.tensors()[0].offset, 0u);
    EXPECT_EQ(f.tensors()[1].offset, 64u);
    EXPECT_EQ(f.tensors()[2].offset, 128u);
    EXPECT_EQ(f.file_size(), f.data_offset() + 192);

    // The same tensor infos under alignment 32 are refused by a reader that is told 64 ... and accepted at 32.
    Bytes b;
    b.header(1, 1).kv_u32("general.alignment", 64).tensor("w", {8}, 0, 32).pad(64).zeros(64);
    EXPECT_THAT(parse_error(b.b, "a64-bad.gguf"), HasSubstr("tensor 'w': data offset 32 is not a multiple of the "
                                                            "alignment 64"));
    Bytes ok;
    ok.header(1, 1).kv_u32("general.alignment", 32).tensor("w", {8}, 0, 32).pad(32).zeros(64);
    EXPECT_EQ(parse_bytes(ok.b).tensors()[0].offset, 32u);
}

// Dims are stored up to the last one above 1, as ggml writes them: ds4's loader refuses a matrix stored as
// [K, N, 1] (it compares the dim count), and every model writer here passes three dims.
TEST_F(GgufTest, TrailingUnitDimsAreNotStored) {
    const std::string file = path("dims.gguf");
    {
        GgufWriter w(file);
        w.add_tensor("norm", GgmlType::F32, {8, 1, 1});
        w.add_tensor("matrix", GgmlType::F32, {8, 3, 1});
        w.add_tensor("experts", GgmlType::F32, {8, 3, 2});
        w.add_tensor("scalar", GgmlType::F32, {1, 1, 1});
        w.add_tensor("inner_unit", GgmlType::F32, {8, 1, 2, 1});
        const std::vector<uint8_t> zeros(8 * 3 * 2 * 4);
        for (size_t n : {8, 24, 48, 1, 16}) w.write_tensor_data(zeros.data(), n * 4);
        w.finish();
    }
    const GgufFile f = GgufFile::open(file);
    const std::pair<const char *, int> expected[] = {
        {"norm", 1}, {"matrix", 2}, {"experts", 3}, {"scalar", 1}, {"inner_unit", 3}};
    for (const auto & [name, n_dims] : expected) {
        const GgufTensorInfo * t = f.find_tensor(name);
        ASSERT_TRUE(t) << name;
        EXPECT_EQ(t->n_dims, n_dims) << name;
    }
    EXPECT_EQ(f.find_tensor("experts")->n_elements(), 48);
    EXPECT_EQ(f.find_tensor("inner_unit")->ne[2], 2);
}

TEST_F(GgufTest, Version2ReadsLikeVersion3AndVersion1IsRefused) {
    const std::string file = path("v3.gguf");
    {
        GgufWriter w(file);
        w.set("general.architecture", GgufValue::make_string("deepseek4"));
        w.set("n", GgufValue::make_u64(5));
        w.add_tensor("w", GgmlType::F16, {4, 2});
        uint16_t data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        w.write_tensor_data(data, sizeof data);
        w.finish();
    }
    std::string bytes = read_file(file);
    ASSERT_EQ(bytes[4], 3);
    bytes[4] = 2;
    const std::string v2 = write("v2.gguf", bytes);
    const GgufFile f = GgufFile::open(v2);
    EXPECT_EQ(f.version(), 2u);
    EXPECT_EQ(f.get_string("general.architecture"), "deepseek4");
    EXPECT_EQ(f.get_u64("n"), 5u);
    ASSERT_EQ(f.tensors().size(), 1u);
    EXPECT_EQ(f.tensors()[0].ne[0], 4);
    EXPECT_EQ(f.tensor_data(f.tensors()[0])[2], 2);

    bytes[4] = 1;
    const std::string v1 = write("v1.gguf", bytes);
    const std::string e = error_of([&] { GgufFile::open(v1); });
    EXPECT_THAT(e, HasSubstr("v1.gguf: header: GGUF version 1"));
    EXPECT_THAT(e, HasSubstr("not supported"));
}

TEST_F(GgufTest, StreamsInManySmallChunks) {
    // Chunks of 1, 7 and 1000 bytes that straddle tensor boundaries, and one call covering several tensors.
    const std::vector<std::pair<GgmlType, std::vector<int64_t>>> decl = {{GgmlType::F32, {7}},
                                                                         {GgmlType::Q8_0, {64, 3}},
                                                                         {GgmlType::F16, {1}},
                                                                         {GgmlType::Q4_K, {256, 2}},
                                                                         {GgmlType::I32, {33}}};
    std::vector<std::vector<uint8_t>> datas;
    std::vector<uint8_t> all;
    for (size_t i = 0; i < decl.size(); ++i) {
        std::vector<uint8_t> d(row_bytes(decl[i].first, decl[i].second[0]) *
                               size_t(decl[i].second.size() > 1 ? decl[i].second[1] : 1));
        for (size_t k = 0; k < d.size(); ++k) d[k] = pattern(i, k);
        all.insert(all.end(), d.begin(), d.end());
        datas.push_back(std::move(d));
    }
    for (size_t chunk : {size_t(1), size_t(7), size_t(1000), all.size()}) {
        SCOPED_TRACE(chunk);
        const std::string file = path(fmt::format("chunks{}.gguf", chunk));
        GgufWriter w(file);
        for (size_t i = 0; i < decl.size(); ++i) w.add_tensor(fmt::format("t{}", i), decl[i].first, decl[i].second);
        for (size_t pos = 0; pos < all.size(); pos += chunk)
            w.write_tensor_data(all.data() + pos, std::min(chunk, all.size() - pos));
        w.write_tensor_data(nullptr, 0);  // an empty write is a no-op
        w.finish();
        const GgufFile f = GgufFile::open(file);
        ASSERT_EQ(f.tensors().size(), decl.size());
        for (size_t i = 0; i < decl.size(); ++i) {
            const GgufTensorInfo & t = f.tensors()[i];
            ASSERT_EQ(t.n_bytes, datas[i].size());
            EXPECT_EQ(std::memcmp(f.tensor_data(t), datas[i].data(), datas[i].size()), 0) << t.name;
        }
    }
}

TEST_F(GgufTest, OneWriteLargerThanTheWriteBuffer) {
    // 9 MiB + 3 bytes in a single call: more than the writer's 4 MiB slices and AtomicFileWriter's 8 MiB buffer.
    const size_t n = (size_t(9) << 20) + 3;
    std::vector<uint8_t> data(n);
    for (size_t k = 0; k < n; ++k) data[k] = pattern(1, k);
    const std::string file = path("big.gguf");
    {
        GgufWriter w(file);
        w.add_tensor("small", GgmlType::F32, {1});
        w.add_tensor("big", GgmlType::I8, {int64_t(n)});
        std::vector<uint8_t> all(4);
        all.insert(all.end(), data.begin(), data.end());
        w.write_tensor_data(all.data(), all.size());
        w.finish();
    }
    const GgufFile f = GgufFile::open(file);
    const GgufTensorInfo & t = *f.find_tensor("big");
    ASSERT_EQ(t.n_bytes, n);
    EXPECT_EQ(std::memcmp(f.tensor_data(t), data.data(), n), 0);
}

TEST_F(GgufTest, WriterChecksTensorBytesAndLeavesNoPartialFile) {
    auto no_files_left = [&] { return fs::is_empty(dir_); };
    {
        GgufWriter w(path("unfinished.gguf"));
        w.add_tensor("a", GgmlType::F32, {4});
        float x[4] = {};
        w.write_tensor_data(x, 8);
    }  // destroyed before finish()
    EXPECT_TRUE(no_files_left());
    {
        GgufWriter w(path("short.gguf"));
        w.add_tensor("a", GgmlType::F32, {4});
        w.add_tensor("b", GgmlType::F32, {4});
        float x[4] = {};
        w.write_tensor_data(x, 16);
        w.write_tensor_data(x, 12);
        const std::string e = error_of([&] { w.finish(); });
        EXPECT_THAT(e, HasSubstr("short.gguf: tensor 'b' received 12 of its 16 bytes"));
    }
    EXPECT_TRUE(no_files_left());
    {
        GgufWriter w(path("long.gguf"));
        w.add_tensor("a", GgmlType::F32, {1});
        float x[2] = {};
        const std::string e = error_of([&] { w.write_tensor_data(x, 8); });
        EXPECT_THAT(e, HasSubstr("long.gguf: 4 bytes of tensor data beyond the 1 declared tensors"));
        EXPECT_THAT(error_of([&] { w.add_tensor("late", GgmlType::F32, {1}); }), HasSubstr("after tensor data"));
        EXPECT_THAT(error_of([&] { w.set("late", GgufValue::make_u32(1)); }), HasSubstr("after tensor data"));
    }
    EXPECT_TRUE(no_files_left());
    {
        GgufWriter w(path("bad-decl.gguf"));
        EXPECT_THAT(error_of([&] { w.add_tensor("q", GgmlType::Q8_0, {33}); }),
                    HasSubstr("tensor 'q': ne[0] = 33 is not a multiple of the q8_0 block size 32"));
        EXPECT_THAT(error_of([&] { w.add_tensor("z", GgmlType::F32, {4, 0}); }), HasSubstr("tensor 'z': ne[1] is 0"));
        EXPECT_THAT(error_of([&] { w.add_tensor("d", GgmlType::F32, {1, 1, 1, 1, 1}); }), HasSubstr("5 dims"));
        EXPECT_THAT(error_of([&] { w.add_tensor("u", GgmlType(4), {1}); }), HasSubstr("unknown ggml type id 4"));
        w.add_tensor("dup", GgmlType::F32, {1});
        EXPECT_THAT(error_of([&] { w.add_tensor("dup", GgmlType::F32, {1}); }), HasSubstr("tensor 'dup': duplicate"));
    }
    EXPECT_TRUE(no_files_left());
    EXPECT_THAT(error_of([&] { GgufWriter(path("x.gguf"), 48); }), HasSubstr("alignment 48 is not a nonzero power"));
    EXPECT_THAT(error_of([&] { GgufWriter(path("x.gguf"), 64).set("general.alignment", GgufValue::make_u32(32)); }),
                HasSubstr("general.alignment must be the writer's alignment 64"));
    // Values a reader could not read back as written are refused when set.
    {
        GgufWriter w(path("values.gguf"));
        GgufValue big = GgufValue::make_u8(0);
        big.u = 256;
        EXPECT_THAT(error_of([&] { w.set("big", big); }), HasSubstr("key 'big': value out of range for UINT8"));
        GgufValue deep = GgufValue::make_array(GgufType::UINT8, {});
        for (int i = 0; i < kGgufMaxArrayDepth - 1; ++i) deep = GgufValue::make_array(GgufType::ARRAY, {deep});
        w.set("deep8", deep);
        deep = GgufValue::make_array(GgufType::ARRAY, {deep});
        EXPECT_THAT(error_of([&] { w.set("deep9", deep); }), HasSubstr("key 'deep9': arrays nested more than 8"));
        EXPECT_THAT(error_of([&] { GgufValue::make_array(GgufType::INT32, {GgufValue::make_u32(1)}); }),
                    HasSubstr("element 0 has type UINT32"));
        w.finish();
        EXPECT_EQ(GgufFile::open(path("values.gguf")).metadata().size(), 1u);  // deep8 reads back
        EXPECT_THAT(error_of([&] { w.finish(); }), HasSubstr("called twice"));
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Validation: every defect is an Error naming the file and the field
// ---------------------------------------------------------------------------------------------------------------------

struct BadCase {
    std::string name;
    std::string bytes;
    std::vector<std::string> expect;  // substrings of the message, after "<file>: "
};

std::vector<BadCase> bad_cases() {
    std::vector<BadCase> cases;
    auto add = [&](std::string name, const Bytes & b, std::vector<std::string> expect) {
        cases.push_back({std::move(name), b.b, std::move(expect)});
    };
    auto one_tensor = [](std::vector<int64_t> ne, uint32_t type, uint64_t offset = 0, size_t data = 64) {
        Bytes b;
        b.header(1, 0).tensor("blk.0.attn_q_a.weight", std::move(ne), type, offset).pad().zeros(data);
        return b;
    };
    Bytes b;

    add("magic.gguf", Bytes{"GGML"}.u32(3).u64(0).u64(0), {"header: bad magic", "not a GGUF file"});
    add("version1.gguf", Bytes{}.header(0, 0, 1), {"header: GGUF version 1"});
    add("version4.gguf", Bytes{}.header(0, 0, 4), {"header: unsupported GGUF version 4"});
    add("bigendian.gguf", Bytes{}.header(0, 0, 0x03000000), {"header: unsupported GGUF version", "big-endian"});
    add("short.gguf", Bytes{"GGUF"}.u32(3).u32(0), {"header: file truncated: tensor_count needs 8 bytes"});
    add("kvcount.gguf", Bytes{}.header(0, uint64_t(1) << 60), {"header: kv_count 1152921504606846976 cannot fit"});
    add("tcount.gguf", Bytes{}.header(~uint64_t(0), 0), {"header: tensor_count 18446744073709551615 cannot fit"});
    add("keylen.gguf", Bytes{}.header(0, 1).u64(~uint64_t(0)).zeros(8), {"metadata entry 0: key of", "past the end"});
    add("emptykey.gguf", Bytes{}.header(0, 1).kv_u32("", 1), {"metadata entry 0: empty key"});
    add("vtype.gguf", Bytes{}.header(0, 1).kv_type("k.x", GgufType(13)).u64(0), {"key 'k.x': unknown value type 13"});
    add("truncval.gguf", Bytes{}.header(0, 1).kv_type("k.x", GgufType::UINT64).u32(0),
        {"key 'k.x': file truncated: UINT64 value needs 8 bytes"});
    add("strlen.gguf", Bytes{}.header(0, 1).kv_type("k.s", GgufType::STRING).u64(100).zeros(8),
        {"key 'k.s': string of 100 bytes", "past the end of the file (size"});
    add("etype.gguf", Bytes{}.header(0, 1).kv_type("k.a", GgufType::ARRAY).u32(77).u64(1),
        {"key 'k.a': unknown array element type 77"});
    add("acount.gguf",
        Bytes{}.header(0, 1).kv_type("k.a", GgufType::ARRAY).u32(uint32_t(GgufType::STRING)).u64(uint64_t(1e12)),
        {"key 'k.a': array of 1000000000000 STRING elements cannot fit in the 0 bytes left"});
    b = Bytes{}.header(0, 1).kv_type("k.n", GgufType::ARRAY);
    for (int i = 0; i < 9; ++i) b.u32(uint32_t(GgufType::ARRAY)).u64(1);
    b.u32(0).u64(0);
    add("nest9.gguf", b, {"key 'k.n'[0][0][0][0][0][0][0][0]: arrays nested more than 8 deep"});
    b = Bytes{}.header(0, 1).kv_type("k.a", GgufType::ARRAY).u32(uint32_t(GgufType::STRING)).u64(3);
    b.str("ab").str("cd").u64(50).str("xyz");
    add("aelem.gguf", b, {"key 'k.a'[2]: string of 50 bytes", "past the end of the file"});
    add("bool.gguf", Bytes{}.header(0, 1).kv_type("k.b", GgufType::BOOL).put<uint8_t>(2),
        {"key 'k.b': BOOL value is 2"});
    add("dupkey.gguf", Bytes{}.header(0, 2).kv_u32("k.d", 1).kv_u32("k.d", 2), {"key 'k.d': duplicate key"});
    add("aligntype.gguf", Bytes{}.header(0, 1).kv_type("general.alignment", GgufType::INT32).u32(64),
        {"key 'general.alignment': type is INT32, expected UINT32"});
    add("align0.gguf", Bytes{}.header(0, 1).kv_u32("general.alignment", 0),
        {"key 'general.alignment': alignment 0 is not a nonzero power of two"});
    add("align48.gguf", Bytes{}.header(0, 1).kv_u32("general.alignment", 48),
        {"key 'general.alignment': alignment 48 is not a nonzero power of two"});

    add("tname.gguf", Bytes{}.header(1, 0).u64(1000).zeros(40), {"tensor 0: name of 1000 bytes", "past the end"});
    add("tempty.gguf", Bytes{}.header(1, 0).tensor("", {4}, 0, 0), {"tensor 0: empty tensor name"});
    add("ndims0.gguf", one_tensor({}, 0), {"tensor 'blk.0.attn_q_a.weight': n_dims is 0, expected 1 to 4"});
    add("ndims5.gguf", one_tensor({1, 1, 1, 1, 1}, 0), {"tensor 'blk.0.attn_q_a.weight': n_dims is 5"});
    add("dim0.gguf", one_tensor({4, 0}, 0), {"tensor 'blk.0.attn_q_a.weight': ne[1] is 0"});
    add("dimneg.gguf", one_tensor({4, 1, -3}, 0), {"tensor 'blk.0.attn_q_a.weight': ne[2] is -3"});
    add("dimover.gguf", one_tensor({int64_t(1) << 32, int64_t(1) << 32}, 0),
        {"tensor 'blk.0.attn_q_a.weight': element count of shape [4294967296, 4294967296] overflows"});
    add("bytesover.gguf", one_tensor({int64_t(1) << 31, int64_t(1) << 31}, uint32_t(GgmlType::F64)),
        {"tensor 'blk.0.attn_q_a.weight': byte size of shape [2147483648, 2147483648] overflows"});
    add("type.gguf", one_tensor({32}, 31), {"tensor 'blk.0.attn_q_a.weight': unknown ggml type id 31"});
    add("typehuge.gguf", one_tensor({32}, 1000), {"tensor 'blk.0.attn_q_a.weight': unknown ggml type id 1000"});
    add("block.gguf", one_tensor({48, 2}, uint32_t(GgmlType::Q8_0)),
        {"tensor 'blk.0.attn_q_a.weight': ne[0] = 48 is not a multiple of the q8_0 block size 32"});
    add("unaligned.gguf", one_tensor({4}, 0, 16),
        {"tensor 'blk.0.attn_q_a.weight': data offset 16 is not a multiple of the alignment 32"});
    b = Bytes{}.header(1, 0).tensor("blk.0.attn_q_a.weight", {4096, 1024}, uint32_t(GgmlType::Q8_0), 0).pad();
    const size_t data_start = b.b.size();
    b.zeros(100);
    add("pastend.gguf", b,
        {fmt::format("tensor 'blk.0.attn_q_a.weight': data range [{}, {}) past end of file (size {})", data_start,
                     data_start + 4096 / 32 * 34 * 1024, data_start + 100)});
    add("offover.gguf", one_tensor({4}, 0, ~uint64_t(0) - 31),
        {"tensor 'blk.0.attn_q_a.weight': data offset", "overflows 64 bits"});
    b = Bytes{}.header(2, 0).tensor("a", {16}, 0, 0).tensor("b", {8}, 0, 32).pad().zeros(64);
    add("overlap.gguf", b, {"tensor 'b': data range", "overlaps tensor 'a'"});
    b = Bytes{}.header(2, 0).tensor("a", {8}, 0, 0).tensor("a", {8}, 0, 32).pad().zeros(64);
    add("duptensor.gguf", b, {"tensor 'a': duplicate tensor name"});
    return cases;
}

TEST_F(GgufTest, EveryValidationErrorNamesFileAndField) {
    for (const BadCase & c : bad_cases()) {
        SCOPED_TRACE(c.name);
        const std::string file = write(c.name, c.bytes);
        const std::string e = error_of([&] { GgufFile::open(file); });
        EXPECT_EQ(e.rfind(file + ": ", 0), 0u) << e;  // starts with the file
        for (const std::string & s : c.expect) EXPECT_THAT(e, HasSubstr(s));
    }
}

TEST_F(GgufTest, EveryTruncationIsAnError) {
    // A file whose last tensor ends on an alignment boundary, so that every shorter prefix lacks data it needs.
    const std::string file = path("full.gguf");
    {
        GgufWriter w(file);
        w.set("a", GgufValue::make_string("text"));
        w.set("b", GgufValue::make_array(GgufType::ARRAY,
                                         {GgufValue::make_array(GgufType::INT16, {GgufValue::make_i16(1)})}));
        w.set("c", GgufValue::make_f64(2));
        w.add_tensor("t0", GgmlType::Q8_0, {32, 2});
        w.add_tensor("t1", GgmlType::F32, {8});
        std::vector<uint8_t> d(68 + 32, 1);
        w.write_tensor_data(d.data(), d.size());
        w.finish();
    }
    const std::string bytes = read_file(file);
    for (size_t n = 0; n < bytes.size(); ++n) {
        const std::string e = parse_error(bytes.substr(0, n), "cut.gguf");
        ASSERT_EQ(e.rfind("cut.gguf: ", 0), 0u) << "prefix " << n << ": " << e;
    }
    EXPECT_NO_THROW(parse_bytes(bytes));
}

TEST_F(GgufTest, InvalidUtf8IsAllowedInKeysValuesAndNames) {
    Bytes b;
    b.header(1, 1).kv_type("k\xff", GgufType::STRING).str("\xc3\x28\x80").tensor("t\xfe", {1}, 0, 0).pad().zeros(32);
    const GgufFile f = parse_bytes(b.b);
    EXPECT_EQ(f.get_string("k\xff"), "\xc3\x28\x80");
    EXPECT_NE(f.find_tensor("t\xfe"), nullptr);
}

TEST_F(GgufTest, EmptyFileAndNoTensors) {
    EXPECT_THAT(error_of([&] { GgufFile::open(write("empty.gguf", "")); }),
                HasSubstr("empty.gguf: header: file truncated: magic needs 4 bytes"));
    const GgufFile f = parse_bytes(Bytes{}.header(0, 1).kv_u32("x", 1).b);
    EXPECT_EQ(f.tensors().size(), 0u);
    EXPECT_EQ(f.get_u64("x"), 1u);
    EXPECT_THAT(error_of([&] { GgufFile::open(path("missing.gguf")); }), HasSubstr("missing.gguf"));
}

TEST(GgufGetters, ConversionsAndErrors) {
    Bytes b;
    b.header(0, 8).kv_u32("u", 7);
    b.kv_type("neg", GgufType::INT32).put<int32_t>(-5);
    b.kv_type("huge", GgufType::UINT64).u64(~uint64_t(0));
    b.kv_type("f", GgufType::FLOAT32).put<float>(0.5f);
    b.kv_type("s", GgufType::STRING).str("x");
    b.kv_type("bl", GgufType::BOOL).put<uint8_t>(1);
    b.kv_type("hugearr", GgufType::ARRAY).u32(uint32_t(GgufType::UINT64)).u64(1).u64(~uint64_t(0));
    b.kv_type("strs", GgufType::ARRAY).u32(uint32_t(GgufType::STRING)).u64(1).str("y");
    const GgufFile f = parse_bytes(b.b, "get.gguf");

    EXPECT_EQ(f.get_u64("u"), 7u);
    EXPECT_EQ(f.get_i64("u"), 7);
    EXPECT_EQ(f.get_f64("u"), 7.0);
    EXPECT_EQ(f.get_i64("neg"), -5);
    EXPECT_EQ(f.get_f64("neg"), -5.0);
    EXPECT_EQ(f.get_u64("huge"), ~uint64_t(0));
    EXPECT_EQ(f.get_f64("f"), 0.5);
    EXPECT_EQ(f.get_u64_opt("u"), 7u);
    EXPECT_EQ(f.get_u64_opt("nope"), std::nullopt);
    EXPECT_EQ(f.get_f64_opt("nope"), std::nullopt);
    EXPECT_EQ(f.get_bool_opt("bl"), true);
    EXPECT_EQ(f.get_bool_opt("nope"), std::nullopt);
    EXPECT_EQ(f.get_string_opt("s"), "x");
    EXPECT_EQ(f.get_string_opt("nope"), std::nullopt);
    EXPECT_EQ(f.get_f64_array("hugearr"), (std::vector<double>{18446744073709551615.0}));

    EXPECT_EQ(error_of([&] { f.get_u64("nope"); }), "get.gguf: metadata key 'nope': missing");
    EXPECT_EQ(error_of([&] { f.get_u64("neg"); }),
              "get.gguf: metadata key 'neg': value -5 is negative, expected an unsigned integer");
    EXPECT_THAT(error_of([&] { f.get_i64("huge"); }), HasSubstr("key 'huge': value 18446744073709551615 does not fit"));
    EXPECT_EQ(error_of([&] { f.get_u64("f"); }), "get.gguf: metadata key 'f': type is FLOAT32, expected an integer");
    EXPECT_THAT(error_of([&] { f.get_f64("s"); }), HasSubstr("key 's': type is STRING, expected a number"));
    EXPECT_THAT(error_of([&] { f.get_bool("u"); }), HasSubstr("key 'u': type is UINT32, expected BOOL"));
    EXPECT_THAT(error_of([&] { f.get_string("u"); }), HasSubstr("key 'u': type is UINT32, expected STRING"));
    EXPECT_THAT(error_of([&] { f.get_int_array("strs"); }),
                HasSubstr("key 'strs': type is ARRAY of STRING, expected an ARRAY of integers"));
    EXPECT_THAT(error_of([&] { f.get_int_array("hugearr"); }), HasSubstr("key 'hugearr': element 0 ="));
    EXPECT_THAT(error_of([&] { f.get_f64_array("u"); }), HasSubstr("key 'u': type is UINT32, expected an ARRAY"));
    EXPECT_THAT(error_of([&] { f.get_string_array("hugearr"); }), HasSubstr("expected an ARRAY of STRING"));
    EXPECT_THAT(error_of([&] { f.get_string_opt("u"); }), HasSubstr("key 'u': type is UINT32"));
    EXPECT_THAT(error_of([&] { f.get_u64_opt("s"); }), HasSubstr("key 's': type is STRING"));
}

// ---------------------------------------------------------------------------------------------------------------------
// Performance: open cost does not depend on tensor data; a full vocabulary parses quickly
// ---------------------------------------------------------------------------------------------------------------------

TEST_F(GgufTest, HugeSparseFileOpensWithoutTouchingData) {
    // Two 40 GB tensors declared in the header; the file is extended sparsely, so no data is ever on disk.
    Bytes b;
    const int64_t rows = 2621440;  // 8192 x 2621440 f16 = 40 GiB each
    b.header(2, 1).kv_u32("general.alignment", 32);
    b.tensor("a", {8192, rows}, uint32_t(GgmlType::F16), 0);
    b.tensor("b", {8192, rows}, uint32_t(GgmlType::F16), uint64_t(8192) * rows * 2);
    b.pad();
    const uint64_t size = b.b.size() + uint64_t(8192) * rows * 2 * 2;
    const std::string file = write("huge.gguf", b.b);
    if (::truncate(file.c_str(), off_t(size)) != 0) GTEST_SKIP() << "no sparse file of " << size << " bytes here";
    const auto t0 = std::chrono::steady_clock::now();
    const GgufFile f = GgufFile::open(file);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(f.file_size(), size);
    EXPECT_EQ(f.tensors()[1].n_bytes, uint64_t(8192) * rows * 2);
    std::printf("opened a %.1f GB GGUF in %.3f ms\n", double(size) / 1e9, ms);
    EXPECT_LT(ms, 500.0);  // milliseconds in practice; generous for a loaded CI machine
}

TEST_F(GgufTest, FullSizeVocabularyParsesFast) {
    const std::string file = path("vocab.gguf");
    constexpr size_t kVocab = 129280;
    {
        GgufWriter w(file);
        std::vector<GgufValue> tokens, types;
        tokens.reserve(kVocab);
        for (size_t i = 0; i < kVocab; ++i) {
            tokens.push_back(GgufValue::make_string(fmt::format("tok{}", i)));
            types.push_back(GgufValue::make_i32(1));
        }
        w.set("tokenizer.ggml.tokens", GgufValue::make_array(GgufType::STRING, std::move(tokens)));
        w.set("tokenizer.ggml.token_type", GgufValue::make_array(GgufType::INT32, std::move(types)));
        w.finish();
    }
    double best = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        const GgufFile f = GgufFile::open(file);
        best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        ASSERT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), kVocab);
        EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens")[kVocab - 1], "tok129279");
    }
    std::printf("parsed a %zu-token vocabulary (+ token types) in %.2f ms\n", kVocab, best);
    EXPECT_LT(best, 1000.0);
}

// llama.cpp's gguf-split layout: the model metadata in the first file, split.no/count/tensors.count in every file,
// tensors spread over PREFIX-0000K-of-0000N.gguf. Opened through the first file, it reads as one model.
TEST_F(GgufTest, SplitModelReadsAsOne) {
    const int n_files = 3;
    auto write_part = [&](int k, std::initializer_list<const char *> names, uint16_t no, int64_t total, bool meta) {
        GgufWriter w(path(fmt::format("m-{:05}-of-{:05}.gguf", k + 1, n_files)));
        if (meta) w.set("general.architecture", GgufValue::make_string("deepseek4"));
        w.set("split.no", GgufValue::make_u16(no));
        w.set("split.count", GgufValue::make_u16(uint16_t(n_files)));
        w.set("split.tensors.count", GgufValue::make_i32(int32_t(total)));
        for (const char * n : names) w.add_tensor(n, GgmlType::F32, {4});
        for (size_t i = 0; i < names.size(); ++i) {
            const float v[4] = {float(k), float(i), 1.5f, -2.0f};
            w.write_tensor_data(v, sizeof v);
        }
        w.finish();
    };
    write_part(0, {"a", "b"}, 0, 5, true);
    write_part(1, {"c"}, 1, 5, false);
    write_part(2, {"d", "e"}, 2, 5, false);
    const GgufFile f = GgufFile::open(path("m-00001-of-00003.gguf"));
    EXPECT_EQ(f.n_splits(), 3u);
    ASSERT_EQ(f.tensors().size(), 5u);
    EXPECT_EQ(f.get_string("general.architecture"), "deepseek4");
    for (const auto & [name, file, index] : {std::tuple{"a", 0, 0}, std::tuple{"c", 1, 0}, std::tuple{"e", 2, 1}}) {
        const GgufTensorInfo * t = f.find_tensor(name);
        ASSERT_NE(t, nullptr) << name;
        const float * v = reinterpret_cast<const float *>(f.tensor_data(*t));
        EXPECT_EQ(v[0], float(file)) << name;
        EXPECT_EQ(v[1], float(index)) << name;
        EXPECT_EQ(v[3], -2.0f) << name;
    }
    // Opening a later part, a missing part, a wrong tensor count or a tensor in two parts: errors naming the file.
    try {
        GgufFile::open(path("m-00002-of-00003.gguf"));
        FAIL() << "opened the second part";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("first file"), std::string::npos) << e.what();
    }
    write_part(2, {"d", "a"}, 2, 5, false);
    try {
        GgufFile::open(path("m-00001-of-00003.gguf"));
        FAIL() << "accepted a tensor in two parts";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("'a'"), std::string::npos) << e.what();
    }
    write_part(2, {"d", "e", "f"}, 2, 5, false);
    EXPECT_THROW(GgufFile::open(path("m-00001-of-00003.gguf")), Error);
    fs::remove(path("m-00003-of-00003.gguf"));
    try {
        GgufFile::open(path("m-00001-of-00003.gguf"));
        FAIL() << "opened with a part missing";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("m-00003-of-00003.gguf"), std::string::npos) << e.what();
    }
}

}  // namespace
