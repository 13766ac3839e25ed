// Loading: configuration and weights are validated with errors that name the file and the key or tensor; what
// dsv4 writes (store_config, the converter, dsv4-synth) it reads back; llama.cpp's gguf-py files load; the
// converter accepts shards and ignores extra files; the KV plan adds up.
#include "backend/backend.h"
#include "format/gguf.h"
#include "model/convert.h"
#include "model/forward.h"
#include "model/kv_state.h"
#include "model/synth.h"
#include "util/error.h"
#include "util/file.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <functional>
#include <unistd.h>

using namespace dsv4;
namespace fs = std::filesystem;

namespace {

class TempDir {
  public:
    TempDir() : path_(fs::temp_directory_path() / ("dsv4_model_test_" + std::to_string(::getpid()) + "_" +
                                                     std::to_string(counter_++))) {
        fs::create_directories(path_);
    }
    ~TempDir() { fs::remove_all(path_); }
    std::string file(const std::string & name) const { return (path_ / name).string(); }

  private:
    static inline int counter_ = 0;
    fs::path path_;
};

std::string mini_model(const TempDir & dir, StorageMix mix = StorageMix::f32) {
    SynthOptions o;
    o.config = mini_config(3, 300);
    o.mix = mix;
    const std::string path = dir.file("mini.gguf");
    write_synthetic_model(o, path);
    return path;
}

// Copies a GGUF, letting `kv` drop or replace metadata and `tensor` change a tensor's declared type/shape.
struct Edit {
    std::function<bool(GgufKv &)> kv;                           // false: drop the key
    std::function<void(GgufTensorInfo &, std::string &)> tensor;  // may change type/shape; bytes are padded
};

std::string rewrite(const std::string & in_path, const std::string & out_path, const Edit & edit) {
    const GgufFile in = GgufFile::open(in_path);
    GgufWriter w(out_path);
    for (GgufKv kv : in.metadata())
        if (!edit.kv || edit.kv(kv)) w.set(kv.key, kv.value);
    std::vector<std::pair<GgufTensorInfo, std::string>> tensors;
    for (const GgufTensorInfo & t : in.tensors()) {
        GgufTensorInfo info = t;
        std::string bytes(reinterpret_cast<const char *>(in.tensor_data(t)), t.n_bytes);
        if (edit.tensor) edit.tensor(info, bytes);
        const size_t want = row_bytes(info.type, info.ne[0]) * size_t(info.ne[1] * info.ne[2] * info.ne[3]);
        bytes.resize(want);
        w.add_tensor(info.name, info.type, {info.ne[0], info.ne[1], info.ne[2], info.ne[3]});
        tensors.push_back({info, bytes});
    }
    for (auto & [info, bytes] : tensors) w.write_tensor_data(bytes.data(), bytes.size());
    w.finish();
    return out_path;
}

void expect_load_error(const std::string & path, const std::vector<std::string> & needles) {
    const GgufFile f = GgufFile::open(path);
    auto backend = make_cpu_backend({1, true});
    try {
        Model m(f, *backend, 4, Numerics::reference);
        FAIL() << "loaded without error";
    } catch (const Error & e) {
        const std::string msg = e.what();
        for (const auto & n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg;
    }
}

TEST(Config, StoreAndLoadRoundTrip) {
    TempDir dir;
    const GgufFile f = GgufFile::open(mini_model(dir));
    const ModelConfig c = load_config(f);
    const ModelConfig want = mini_config(3, 300);
    EXPECT_EQ(c.n_layer, want.n_layer);
    EXPECT_EQ(c.n_embd, want.n_embd);
    EXPECT_EQ(c.n_rot, want.n_rot);
    EXPECT_EQ(c.window, want.window);
    EXPECT_EQ(c.n_hash_layers, 3);
    EXPECT_TRUE(c.yarn.enabled);
    EXPECT_FLOAT_EQ(c.yarn.factor, 16);
    ASSERT_EQ(c.layers.size(), 3u);
    EXPECT_EQ(c.layers[0].kind, LayerKind::sliding);
    EXPECT_EQ(c.layers[2].kind, LayerKind::csa);
    EXPECT_EQ(c.layers[2].compress_ratio, 4);
    EXPECT_FLOAT_EQ(c.layers[1].swiglu_limit, 10.0f);
    // The YaRN tables of the real shape: pairs below lo = 15 keep their frequency, above hi = 25 are divided by 16.
    const std::vector<float> f_real = rope_inv_freq(flash_config(4), LayerKind::csa);
    ASSERT_EQ(f_real.size(), 32u);
    EXPECT_FLOAT_EQ(f_real[0], 1.0f);
    EXPECT_NEAR(f_real[10], std::pow(160000.0, -20.0 / 64), 1e-9);
    EXPECT_NEAR(f_real[30], std::pow(160000.0, -60.0 / 64) / 16, 1e-12);
}

TEST(Config, MissingOrInconsistentMetadataIsNamed) {
    TempDir dir;
    const std::string base = mini_model(dir);
    auto drop = [&](const std::string & key) {
        return rewrite(base, dir.file("bad.gguf"), {[key](GgufKv & kv) { return kv.key != key; }, {}});
    };
    expect_load_error(drop("deepseek4.attention.head_count"), {"bad.gguf", "deepseek4.attention.head_count"});
    expect_load_error(drop("deepseek4.attention.compress_ratios"), {"bad.gguf", "compress_ratios"});
    expect_load_error(drop("deepseek4.hyper_connection.count"), {"bad.gguf", "hyper_connection.count"});
    auto set = [&](const std::string & key, GgufValue v) {
        return rewrite(base, dir.file("bad.gguf"), {[key, v](GgufKv & kv) {
                           if (kv.key == key) kv.value = v;
                           return true;
                       },
                                                    {}});
    };
    expect_load_error(set("deepseek4.attention.head_count_kv", GgufValue::make_u32(8)), {"head_count_kv", "8"});
    expect_load_error(set("deepseek4.hash_layer_count", GgufValue::make_u32(1)), {"hash_layer_count", "tid2eid"});
    expect_load_error(set("deepseek4.expert_gating_func", GgufValue::make_u32(2)), {"expert_gating_func"});
    expect_load_error(set("general.architecture", GgufValue::make_string("llama")), {"general.architecture", "llama"});
    expect_load_error(set("deepseek4.attention.head_count", GgufValue::make_string("four")), {"attention.head_count"});
    expect_load_error(set("deepseek4.rope.dimension_count", GgufValue::make_u32(7)), {"rope.dimension_count"});
}

TEST(Weights, WrongShapeTypeOrMissingTensorIsNamed) {
    TempDir dir;
    const std::string base = mini_model(dir, StorageMix::q8_0);
    auto with_tensor_edit = [&](std::function<void(GgufTensorInfo &, std::string &)> fn) {
        return rewrite(base, dir.file("bad.gguf"), {{}, std::move(fn)});
    };
    expect_load_error(with_tensor_edit([](GgufTensorInfo & t, std::string &) {
                          if (t.name == "blk.1.attn_q_b.weight") t.ne[1] += 32;
                      }),
                      {"bad.gguf", "blk.1.attn_q_b.weight", "shape"});
    expect_load_error(with_tensor_edit([](GgufTensorInfo & t, std::string &) {
                          if (t.name == "blk.0.attn_kv.weight") t.type = GgmlType::Q5_K;
                      }),
                      {"blk.0.attn_kv.weight", "q5_K"});
    expect_load_error(with_tensor_edit([](GgufTensorInfo & t, std::string &) {
                          if (t.name == "blk.2.attn_norm.weight") t.type = GgmlType::Q8_0;
                      }),
                      {"blk.2.attn_norm.weight", "q8_0"});
    expect_load_error(with_tensor_edit([](GgufTensorInfo & t, std::string & bytes) {
                          if (t.name == "blk.0.ffn_gate_tid2eid.weight") reinterpret_cast<int32_t *>(bytes.data())[5] = 99;
                      }),
                      {"blk.0.ffn_gate_tid2eid.weight", "99"});
    // A missing tensor: drop it by renaming.
    expect_load_error(with_tensor_edit([](GgufTensorInfo & t, std::string &) {
                          if (t.name == "blk.2.indexer.proj.weight") t.name = "blk.2.indexer.projection.weight";
                      }),
                      {"blk.2.indexer.proj.weight"});
}

// A deepseek4 file written by llama.cpp's own gguf-py (tests/data/gguf): the layout users' files have.
TEST(Weights, LlamaCppWrittenFileLoadsAndRuns) {
    const GgufFile f = GgufFile::open(std::string(DSV4_TEST_DATA) + "/gguf/tiny-deepseek4.gguf");
    std::vector<float> exact, fast;
    for (bool quantize_activations : {false, true}) {
        auto backend = make_cpu_backend({2, quantize_activations});
        Model m(f, *backend, 8, Numerics::official);
        EXPECT_EQ(m.config().n_layer, 3);
        EXPECT_EQ(m.config().layers[1].kind, LayerKind::csa);
        EXPECT_EQ(m.config().layers[2].kind, LayerKind::hca);
        std::vector<int32_t> tokens;
        for (int i = 0; i < 20; ++i) tokens.push_back(i % 32);
        auto state = m.new_state(64);
        std::vector<float> logits(tokens.size() * 32);
        m.eval(*state, tokens, LogitsMode::all, logits.data());
        for (float v : logits) ASSERT_TRUE(std::isfinite(v));
        (quantize_activations ? fast : exact) = logits;
    }
    double worst = 0;
    for (size_t i = 0; i < exact.size(); ++i) worst = std::max(worst, double(std::fabs(exact[i] - fast[i])));
    EXPECT_LT(worst, 0.05) << "8-bit activations drift too far from f32 activations";
}

// The converter reads shards through model.safetensors.index.json, ignores files it does not need, and produces
// the same GGUF as from one file; a missing tensor is named.
TEST(Convert, ShardsExtraFilesAndErrors) {
    TempDir dir;
    const std::string src = std::string(DSV4_TEST_DATA) + "/oracle/hf-edge-seed1";
    ConvertOptions opt;
    convert_checkpoint(src, dir.file("one.gguf"), opt);

    // Split the fixture's safetensors into two shards.
    const std::string blob = read_file(src + "/model.safetensors");
    uint64_t hlen;
    std::memcpy(&hlen, blob.data(), 8);
    const nlohmann::json header = nlohmann::json::parse(blob.substr(8, hlen));
    const std::string data = blob.substr(8 + hlen);
    const std::string shard_dir = dir.file("sharded");
    fs::create_directories(shard_dir);
    nlohmann::json shards[2] = {nlohmann::json::object(), nlohmann::json::object()}, weight_map;
    std::string shard_data[2];
    int i = 0;
    for (auto & [name, info] : header.items()) {
        if (name == "__metadata__") continue;
        const int s = i++ % 2;
        const auto off = info["data_offsets"];
        const std::string bytes = data.substr(off[0].get<size_t>(), off[1].get<size_t>() - off[0].get<size_t>());
        shards[s][name] = {{"dtype", info["dtype"]}, {"shape", info["shape"]},
                           {"data_offsets", {shard_data[s].size(), shard_data[s].size() + bytes.size()}}};
        shard_data[s] += bytes;
        weight_map[name] = "model-0000" + std::to_string(s + 1) + "-of-00002.safetensors";
    }
    for (int s = 0; s < 2; ++s) {
        const std::string h = shards[s].dump();
        std::string out(8, '\0');
        const uint64_t n = h.size();
        std::memcpy(out.data(), &n, 8);
        write_file_atomic(shard_dir + "/model-0000" + std::to_string(s + 1) + "-of-00002.safetensors",
                          out + h + shard_data[s]);
    }
    write_file_atomic(shard_dir + "/model.safetensors.index.json", nlohmann::json{{"weight_map", weight_map}}.dump());
    fs::copy_file(src + "/config.json", shard_dir + "/config.json");
    write_file_atomic(shard_dir + "/README.md", "extra files are ignored");
    write_file_atomic(shard_dir + "/tokenizer_config.json", "{}");
    convert_checkpoint(shard_dir, dir.file("sharded.gguf"), opt);
    const std::string a = read_file(dir.file("one.gguf")), b = read_file(dir.file("sharded.gguf"));
    // Only general.name (the folder name) differs between the two files.
    const GgufFile ga = GgufFile::open(dir.file("one.gguf")), gb = GgufFile::open(dir.file("sharded.gguf"));
    ASSERT_EQ(ga.tensors().size(), gb.tensors().size());
    for (size_t t = 0; t < ga.tensors().size(); ++t) {
        const GgufTensorInfo & x = ga.tensors()[t];
        const GgufTensorInfo & y = gb.tensors()[t];
        EXPECT_EQ(x.name, y.name);
        ASSERT_EQ(x.n_bytes, y.n_bytes);
        EXPECT_EQ(std::memcmp(ga.tensor_data(x), gb.tensor_data(y), x.n_bytes), 0) << x.name;
    }

    // A tensor missing from the index: the error names it.
    weight_map.erase("model.layers.2.self_attn.kv_proj.weight");
    write_file_atomic(shard_dir + "/model.safetensors.index.json", nlohmann::json{{"weight_map", weight_map}}.dump());
    EXPECT_THROW(convert_checkpoint(shard_dir, dir.file("x.gguf"), opt), Error);
    fs::remove(shard_dir + "/model.safetensors.index.json");
    fs::remove(shard_dir + "/model-00001-of-00002.safetensors");
    fs::remove(shard_dir + "/model-00002-of-00002.safetensors");
    try {
        convert_checkpoint(shard_dir, dir.file("x.gguf"), opt);
        FAIL() << "converted a folder without weights";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("sharded"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(dir.file("x.gguf")));  // nothing half-written under the output name
}

// The memory plan of the real shape, by hand: per layer a ring of window + ubatch - 1 rows of 512 floats;
// compressed rows ctx/R of 512; indexer keys ctx/4 of 128 on the 21 CSA layers of 43.
TEST(KvPlan, RealShapeAddsUp) {
    const ModelConfig c = flash_config(43);
    const int64_t ctx = 1 << 20, ub = 512;
    const KvPlan p = plan_kv(c, ctx, ub);
    EXPECT_EQ(p.ring, 128 + ub - 1);
    EXPECT_EQ(p.raw_bytes, size_t(43) * size_t(p.ring) * 512 * 4);
    EXPECT_EQ(p.compressed_bytes, (size_t(21) * (ctx / 4) + size_t(20) * (ctx / 128)) * 512 * 4);
    EXPECT_EQ(p.indexer_bytes, size_t(21) * (ctx / 4) * 128 * 4);
    EXPECT_EQ(p.frontier_bytes, size_t(21) * 2 * (8 * 1024 + 8 * 256) * 4 + size_t(20) * 2 * (128 * 512) * 4);
}

}  // namespace
