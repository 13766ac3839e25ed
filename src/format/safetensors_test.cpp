// safetensors reader: the real HF fixtures (checked against their JSON headers, parsed here independently, and
// against values read with Python), a sharded folder written here, and hand-made broken files whose errors must
// name the file and the field.
#include "format/safetensors.h"
#include "util/error.h"
#include "util/file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

using namespace dsv4;
using nlohmann::json;
using ::testing::HasSubstr;

namespace {

namespace fs = std::filesystem;

const std::string kFixtures = "/work/shared/fixtures";

std::string fixture(const std::string & name) {
    // The shared fixtures sit beside the repository (../shared from the checkout) or at their usual place.
    const fs::path beside = fs::path(DSV4_TEST_DATA).parent_path().parent_path().parent_path() / "shared" / "fixtures";
    const fs::path p = fs::exists(beside / name) ? beside / name : fs::path(kFixtures) / name;
    return p.string();
}

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

class SafetensorsTest : public ::testing::Test {
  protected:
    void SetUp() override {
        const auto * info = ::testing::UnitTest::GetInstance()->current_test_info();
        dir_ = fs::temp_directory_path() / fmt::format("dsv4-st-test-{}-{}", ::getpid(), info->name());
        fs::remove_all(dir_);
        fs::create_directories(dir_);
    }
    void TearDown() override { fs::remove_all(dir_); }

    std::string path(const std::string & name) const { return (dir_ / name).string(); }

    // A file with the given header text (padded to 8 bytes as the reference writer does) and data section.
    std::string write_raw(const std::string & name, const std::string & header, const std::string & data) const {
        std::string h = header;
        h.resize((h.size() + 7) / 8 * 8, ' ');
        const uint64_t n = h.size();
        std::ofstream out(path(name), std::ios::binary);
        out.write(reinterpret_cast<const char *>(&n), 8);
        out << h << data;
        return path(name);
    }
    std::string write(const std::string & name, const json & header, const std::string & data) const {
        return write_raw(name, header.dump(), data);
    }

    fs::path dir_;
};

// A header entry.
json entry(const std::string & dtype, std::vector<int64_t> shape, uint64_t begin, uint64_t end) {
    return json{{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, end}}};
}

std::string floats(std::vector<float> v) { return std::string(reinterpret_cast<const char *>(v.data()), 4 * v.size()); }

// ---------------------------------------------------------------------------------------------------------------------
// Real fixtures
// ---------------------------------------------------------------------------------------------------------------------

// Every tensor against the header parsed here with nlohmann, and its bytes against the file read as a whole.
void check_against_header(const std::string & file, const SafetensorsSet & set) {
    const std::string bytes = read_file(file);
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    const json header = json::parse(bytes.substr(8, n));
    size_t count = 0;
    for (const auto & [name, e] : header.items()) {
        if (name == "__metadata__") continue;
        ++count;
        SCOPED_TRACE(name);
        const StTensor * t = set.find(name);
        ASSERT_NE(t, nullptr);
        EXPECT_EQ(st_dtype_name(t->dtype), e["dtype"].get<std::string>());
        EXPECT_EQ(t->shape, e["shape"].get<std::vector<int64_t>>());
        const uint64_t begin = e["data_offsets"][0], end = e["data_offsets"][1];
        ASSERT_EQ(t->n_bytes, end - begin);
        EXPECT_EQ(std::memcmp(t->data, bytes.data() + 8 + n + begin, t->n_bytes), 0);
        EXPECT_EQ(*t->file, file);
    }
    EXPECT_EQ(set.tensors().size(), count);
}

std::map<std::string, int> dtype_counts(const SafetensorsSet & set) {
    std::map<std::string, int> counts;
    for (const StTensor & t : set.tensors()) counts[std::string(st_dtype_name(t.dtype))]++;
    return counts;
}

TEST(SafetensorsFixture, HfSmall) {
    const std::string file = fixture("hf-small-seed1/model.safetensors");
    const SafetensorsSet set = SafetensorsSet::open(file);
    // Counts and values below were read with Python's json and struct modules.
    EXPECT_EQ(set.tensors().size(), 149u);
    EXPECT_EQ(dtype_counts(set), (std::map<std::string, int>{{"F32", 147}, {"I64", 2}}));
    EXPECT_EQ(set.metadata().at("format"), "pt");
    const StTensor & head = set.get("lm_head.weight");
    EXPECT_EQ(head.dtype, StDtype::F32);
    EXPECT_EQ(head.shape, (std::vector<int64_t>{512, 64}));
    EXPECT_EQ(head.n_elements(), 512 * 64);
    EXPECT_EQ(head.n_bytes, 512u * 64 * 4);
    float v[3];
    std::memcpy(v, head.data, sizeof v);
    EXPECT_EQ(v[0], 0.09365870803594589f);
    EXPECT_EQ(v[1], 0.008755609393119812f);
    EXPECT_EQ(v[2], 0.15004104375839233f);
    const StTensor & tid = set.get("model.layers.0.mlp.gate.tid2eid");
    EXPECT_EQ(tid.dtype, StDtype::I64);
    EXPECT_EQ(tid.shape, (std::vector<int64_t>{512, 2}));
    int64_t ids[4];
    std::memcpy(ids, tid.data, sizeof ids);
    EXPECT_EQ(ids[0], 1);
    EXPECT_EQ(ids[1], 0);
    EXPECT_EQ(ids[2], 2);
    EXPECT_EQ(ids[3], 7);
    EXPECT_EQ(set.find("no.such.tensor"), nullptr);
    EXPECT_THAT(error_of([&] { set.get("no.such.tensor"); }), HasSubstr(file + ": tensor 'no.such.tensor' not found"));
    check_against_header(file, set);
}

TEST(SafetensorsFixture, OfficialTinyHasEveryCheckpointDtype) {
    const std::string file = fixture("official-tiny/model.safetensors");
    const SafetensorsSet set = SafetensorsSet::open(file);
    EXPECT_EQ(set.tensors().size(), 421u);
    EXPECT_EQ(dtype_counts(set),
              (std::map<std::string, int>{
                  {"BF16", 48}, {"F32", 47}, {"F8_E4M3", 42}, {"F8_E8M0", 162}, {"I64", 2}, {"I8", 120}}));
    check_against_header(file, set);
}

TEST_F(SafetensorsTest, FolderWithOneModelFile) {
    fs::create_directories(dir_ / "model");
    fs::create_symlink(fixture("hf-small-seed1/model.safetensors"), dir_ / "model" / "model.safetensors");
    const SafetensorsSet set = SafetensorsSet::open(path("model"));
    EXPECT_EQ(set.tensors().size(), 149u);
    EXPECT_EQ(*set.tensors()[0].file, (dir_ / "model" / "model.safetensors").string());

    fs::create_directories(dir_ / "empty");
    EXPECT_THAT(error_of([&] { SafetensorsSet::open(path("empty")); }),
                HasSubstr("empty: no model.safetensors.index.json or model.safetensors"));
    EXPECT_THAT(error_of([&] { SafetensorsSet::open(path("missing.safetensors")); }), HasSubstr("missing.safetensors"));
}

// ---------------------------------------------------------------------------------------------------------------------
// Files written here
// ---------------------------------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, EveryDtypeAndEdgeShapes) {
    const std::vector<std::pair<std::string, size_t>> dtypes = {
        {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
        {"U8", 1},  {"I8", 1},  {"I16", 2}, {"I32", 4},  {"I64", 8},     {"BOOL", 1}};
    json h;
    std::string data;
    for (const auto & [name, size] : dtypes) {
        h["t." + name] = entry(name, {3}, data.size(), data.size() + 3 * size);
        data.append(3 * size, char(size));
    }
    h["scalar"] = entry("F32", {}, data.size(), data.size() + 4);
    data += floats({2.5f});
    h["empty1"] = entry("F32", {0, 4}, data.size(), data.size());  // no bytes: may share an offset
    h["empty2"] = entry("I8", {0}, data.size(), data.size());
    h["__metadata__"] = {{"format", "pt"}, {"note", "x"}};
    const SafetensorsSet set = SafetensorsSet::open(write("all.safetensors", h, data));
    EXPECT_EQ(set.tensors().size(), dtypes.size() + 3);
    for (const auto & [name, size] : dtypes) {
        SCOPED_TRACE(name);
        const StTensor & t = set.get("t." + name);
        EXPECT_EQ(st_dtype_name(t.dtype), name);
        EXPECT_EQ(st_dtype_size(t.dtype), size);
        EXPECT_EQ(t.n_bytes, 3 * size);
        EXPECT_EQ(t.data[0], char(size));
    }
    EXPECT_EQ(set.get("scalar").n_elements(), 1);
    float x;
    std::memcpy(&x, set.get("scalar").data, 4);
    EXPECT_EQ(x, 2.5f);
    EXPECT_EQ(set.get("empty1").n_elements(), 0);
    EXPECT_EQ(set.get("empty1").n_bytes, 0u);
    EXPECT_EQ(set.metadata().at("note"), "x");
}

struct Broken {
    std::string name;
    std::string header;  // JSON text
    std::string data;
    std::string expect;  // substring after "<file>: "
};

TEST_F(SafetensorsTest, BrokenFilesNameFileAndField) {
    const std::string d16(16, '\0');
    const std::vector<Broken> cases = {
        {"json.safetensors", "{\"a\": {", d16, "header: invalid JSON"},
        {"array.safetensors", "[1, 2]", d16, "header: expected a JSON object, found array"},
        {"dup.safetensors",
         R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
             "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
         d16, "tensor 'w': listed twice in the header"},
        {"notobj.safetensors", R"({"w": 5})", d16, "tensor 'w': expected an object, found number"},
        {"nodtype.safetensors", R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", d16,
         "tensor 'w': dtype: missing or not a string"},
        {"dtype.safetensors", R"({"w": {"dtype": "F8_E5M2", "shape": [1], "data_offsets": [0, 1]}})", d16,
         "tensor 'w': dtype: unknown dtype 'F8_E5M2'"},
        {"shape.safetensors", R"({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}})", d16,
         "tensor 'w': shape: missing or not an array"},
        {"negdim.safetensors", R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", d16,
         "tensor 'w': shape: -1 is not a non-negative integer"},
        {"floatdim.safetensors", R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", d16,
         "tensor 'w': shape: 1.5 is not a non-negative integer"},
        {"overflow.safetensors",
         R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}})", d16,
         "tensor 'w': shape: [4294967296,4294967296] overflows 63 bits"},
        {"bytesover.safetensors", R"({"w": {"dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 4]}})",
         d16, "tensor 'w': shape: [4611686018427387904] of F64 is over 2^64 bytes"},
        {"offsets.safetensors", R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", d16,
         "tensor 'w': data_offsets: missing or not a [begin, end] pair"},
        {"reversed.safetensors", R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", d16,
         "tensor 'w': data_offsets: [8,4] is not a range"},
        {"pastend.safetensors", R"({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}})", d16,
         "tensor 'w': data_offsets: [0, 32) past the end of the data section (16 bytes)"},
        {"size.safetensors", R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})", d16,
         "tensor 'w': data_offsets: [0, 12) holds 12 bytes, shape [2,2] of F32 needs 16"},
        {"overlap.safetensors",
         R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "I16", "shape": [2], "data_offsets": [4, 8]}})",
         d16, "tensor 'b': data_offsets [4, 8) overlap tensor 'a' at [0, 8)"},
        {"meta.safetensors", R"({"__metadata__": {"format": 1}})", d16, "__metadata__['format']: expected a string"},
        {"metaobj.safetensors", R"({"__metadata__": []})", d16, "__metadata__: expected an object"},
    };
    for (const Broken & c : cases) {
        SCOPED_TRACE(c.name);
        const std::string file = write_raw(c.name, c.header, c.data);
        const std::string e = error_of([&] { SafetensorsSet::open(file); });
        EXPECT_EQ(e.rfind(file + ": ", 0), 0u) << e;
        EXPECT_THAT(e, HasSubstr(c.expect));
    }

    // Broken framing: too short for the length, and a length past the end of the file.
    std::ofstream(path("tiny.safetensors"), std::ios::binary) << "abc";
    EXPECT_THAT(error_of([&] { SafetensorsSet::open(path("tiny.safetensors")); }),
                HasSubstr("tiny.safetensors: header: file of 3 bytes is too short"));
    {
        std::ofstream out(path("len.safetensors"), std::ios::binary);
        const uint64_t n = 1000;
        out.write(reinterpret_cast<const char *>(&n), 8);
        out << "{}";
    }
    EXPECT_THAT(error_of([&] { SafetensorsSet::open(path("len.safetensors")); }),
                HasSubstr("len.safetensors: header: length 1000 runs past the end of the file (size 10)"));
}

// A checkpoint split over two shards by an index, as HF writes it.
class ShardedTest : public SafetensorsTest {
  protected:
    void SetUp() override {
        SafetensorsTest::SetUp();
        fs::create_directories(dir_ / "ckpt");
        json h1;
        h1["a"] = entry("F32", {2}, 0, 8);
        h1["b"] = entry("I32", {1}, 8, 12);
        h1["__metadata__"] = {{"format", "pt"}};
        write("ckpt/model-00001-of-00002.safetensors", h1, floats({1, 2}) + floats({0}));
        json h2;
        h2["c"] = entry("F16", {2, 1}, 0, 4);
        write("ckpt/model-00002-of-00002.safetensors", h2, "\x01\x02\x03\x04");
        index_ = {{"metadata", {{"total_size", 16}}},
                  {"weight_map",
                   {{"a", "model-00001-of-00002.safetensors"},
                    {"b", "model-00001-of-00002.safetensors"},
                    {"c", "model-00002-of-00002.safetensors"}}}};
    }
    std::string write_index(const json & index) {
        std::ofstream(path("ckpt/model.safetensors.index.json")) << index.dump(2);
        return path("ckpt");
    }

    json index_;
};

TEST_F(ShardedTest, OpensAFolderOfShards) {
    const SafetensorsSet set = SafetensorsSet::open(write_index(index_));
    ASSERT_EQ(set.tensors().size(), 3u);
    EXPECT_EQ(*set.get("a").file, path("ckpt/model-00001-of-00002.safetensors"));
    EXPECT_EQ(*set.get("c").file, path("ckpt/model-00002-of-00002.safetensors"));
    float a[2];
    std::memcpy(a, set.get("a").data, 8);
    EXPECT_EQ(a[1], 2.0f);
    EXPECT_EQ(set.get("c").data[3], 4);
    EXPECT_EQ(set.get("c").shape, (std::vector<int64_t>{2, 1}));
    EXPECT_EQ(set.metadata().at("format"), "pt");
    EXPECT_EQ(set.metadata().at("total_size"), "16");
    EXPECT_THAT(error_of([&] { set.get("zz"); }), HasSubstr("tensor 'zz' not found"));
}

TEST_F(ShardedTest, IndexAndShardsMustAgree) {
    const std::string index_file = path("ckpt/model.safetensors.index.json");
    auto open_error = [&](const json & index) {
        const std::string folder = write_index(index);
        return error_of([&] { SafetensorsSet::open(folder); });
    };

    json j = index_;
    j["weight_map"]["d"] = "model-00003-of-00003.safetensors";
    EXPECT_THAT(open_error(j), HasSubstr(index_file + ": weight_map['d']: shard 'model-00003-of-00003.safetensors' "
                                                      "is missing"));
    j = index_;
    j["weight_map"]["d"] = "model-00002-of-00002.safetensors";
    EXPECT_THAT(open_error(j), HasSubstr(index_file + ": weight_map['d']: tensor not found in shard "
                                                      "'model-00002-of-00002.safetensors'"));
    j = index_;
    j["weight_map"]["c"] = "model-00001-of-00002.safetensors";
    j["weight_map"]["x"] = "model-00002-of-00002.safetensors";
    EXPECT_THAT(open_error(j), HasSubstr("weight_map['c']: tensor is in"));
    j = index_;
    j["weight_map"].erase("b");
    EXPECT_THAT(open_error(j), HasSubstr("model-00001-of-00002.safetensors: tensor 'b': not listed in " + index_file));
    j = index_;
    j["weight_map"]["a"] = "../elsewhere.safetensors";
    EXPECT_THAT(open_error(j), HasSubstr("weight_map['a']: shard '../elsewhere.safetensors' is not a file name"));
    j = index_;
    j["weight_map"]["a"] = 3;
    EXPECT_THAT(open_error(j), HasSubstr("weight_map['a']: expected a shard file name"));
    EXPECT_THAT(open_error(json{{"metadata", {}}}), HasSubstr(index_file + ": weight_map: missing or not an object"));
    std::ofstream(index_file) << "{\"weight_map\": ";
    EXPECT_THAT(error_of([&] { SafetensorsSet::open(path("ckpt")); }), HasSubstr(index_file + ": invalid JSON"));

    // The same tensor name in two shards.
    json h2;
    h2["c"] = entry("F16", {2, 1}, 0, 4);
    h2["a"] = entry("F32", {1}, 4, 8);
    write("ckpt/model-00002-of-00002.safetensors", h2, std::string(8, '\0'));
    EXPECT_THAT(open_error(index_), HasSubstr("model-00002-of-00002.safetensors: tensor 'a': also in " +
                                              path("ckpt/model-00001-of-00002.safetensors")));
}

}  // namespace
