// Loading: configuration and weights are validated with errors that name the file and the key or tensor; what
// dsv4 writes (store_config, the converter, dsv4-synth) it reads back; llama.cpp's gguf-py files load; the
// converter accepts shards and ignores extra files; the KV plan adds up.
#include "backend/backend.h"
#include "format/gguf.h"
#include "format/quant.h"
#include "model/convert.h"
#include "model/forward.h"
#include "model/kv_state.h"
#include "model/layout.h"
#include "model/synth.h"
#include "util/error.h"
#include "util/file.h"
#include "util/half.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>

using namespace dsv4;
namespace fs = std::filesystem;

namespace {

class TempDir {
  public:
    TempDir()
        : path_(fs::temp_directory_path() /
                ("dsv4_model_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++))) {
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
    std::function<bool(GgufKv &)> kv;                             // false: drop the key
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
        return rewrite(base, dir.file("bad.gguf"),
                       {[key, v](GgufKv & kv) {
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
    expect_load_error(set("deepseek4.hyper_connection.sinkhorn_iterations", GgufValue::make_u32(4000000000u)),
                      {"hyper_connection.sinkhorn_iterations", "4000000000"});
    expect_load_error(set("deepseek4.attention.indexer.top_k", GgufValue::make_u32(3000000000u)),
                      {"attention.indexer.top_k", "3000000000"});
    expect_load_error(set("deepseek4.block_count", GgufValue::make_u32(1000000000u)), {"block_count", "1000000000"});
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
                          if (t.name == "blk.0.ffn_gate_tid2eid.weight")
                              reinterpret_cast<int32_t *>(bytes.data())[5] = 99;
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

// A model cut by llama.cpp's gguf-split (unsloth publishes its files so) is opened through its first part and
// computes exactly what the single file computes.
TEST(Weights, SplitFileLoadsAsOne) {
    TempDir dir;
    const std::string single = mini_model(dir, StorageMix::q2);
    const GgufFile in = GgufFile::open(single);
    const size_t n_parts = 3, n_tensors = in.tensors().size();
    for (size_t part = 0; part < n_parts; ++part) {
        GgufWriter w(dir.file(fmt::format("split-{:05}-of-{:05}.gguf", part + 1, n_parts)));
        if (part == 0)
            for (const GgufKv & kv : in.metadata()) w.set(kv.key, kv.value);
        w.set("split.no", GgufValue::make_u16(uint16_t(part)));
        w.set("split.count", GgufValue::make_u16(uint16_t(n_parts)));
        w.set("split.tensors.count", GgufValue::make_i32(int32_t(n_tensors)));
        const size_t begin = part * n_tensors / n_parts, end = (part + 1) * n_tensors / n_parts;
        for (size_t i = begin; i < end; ++i) {
            const GgufTensorInfo & t = in.tensors()[i];
            w.add_tensor(t.name, t.type, {t.ne[0], t.ne[1], t.ne[2], t.ne[3]});
        }
        for (size_t i = begin; i < end; ++i)
            w.write_tensor_data(in.tensor_data(in.tensors()[i]), in.tensors()[i].n_bytes);
        w.finish();
    }
    const GgufFile split = GgufFile::open(dir.file(fmt::format("split-00001-of-{:05}.gguf", n_parts)));
    ASSERT_EQ(split.n_splits(), n_parts);
    std::vector<float> logits[2];
    for (int k = 0; k < 2; ++k) {
        auto backend = make_cpu_backend({1, true});
        Model m(k == 0 ? in : split, *backend, 8, Numerics::official);
        std::vector<int32_t> tokens = {1, 5, 9, 200, 42, 7, 3, 299};
        auto state = m.new_state(32);
        logits[k].resize(tokens.size() * size_t(m.config().n_vocab));
        m.eval(*state, tokens, LogitsMode::all, logits[k].data());
    }
    EXPECT_EQ(logits[0], logits[1]);
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
        shards[s][name] = {{"dtype", info["dtype"]},
                           {"shape", info["shape"]},
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

// DeepSeek's official checkpoint encoding, written by this test: the dense projections as FP8 E4M3 with one E8M0
// scale per 128×128 tile, routed experts as packed FP4 E2M1 (even column in the low nibble) with one E8M0 scale per
// 32 values, the rest BF16/F32, ModelArgs config. The converted GGUF must hold exactly the values the bytes encode,
// and the model must stay close to the unquantized one it was made from.
TEST(Convert, OfficialEncodingWrittenHere) {
    TempDir dir;
    SynthOptions o;
    o.config = mini_config(4, 300);  // sliding, sliding, CSA, HCA; hash layers 0-2, score-routed layer 3
    o.mix = StorageMix::f32;
    const std::string ref_path = dir.file("ref.gguf");
    write_synthetic_model(o, ref_path);
    const GgufFile ref = GgufFile::open(ref_path);
    const ModelConfig & c = o.config;

    struct Entry {
        std::string dtype;
        std::vector<int64_t> shape;
        std::string bytes;
    };
    std::map<std::string, Entry> out;
    std::map<std::string, std::vector<float>> expect;  // what the converter must decode, per official name
    auto f32_of = [&](const GgufTensorInfo & t) {
        return std::vector<float>(reinterpret_cast<const float *>(ref.tensor_data(t)),
                                  reinterpret_cast<const float *>(ref.tensor_data(t)) + t.n_elements());
    };
    // Power-of-two scale for a block so that amax / scale fits the format's largest value.
    auto e8m0_for = [](float amax, float fmax) {
        const int e = std::max(-127, std::min(127, int(std::ceil(std::log2(std::max(amax, 1e-30f) / fmax)))));
        return uint8_t(e + 127);
    };
    auto put_fp8 = [&](const std::string & name, const float * w, int64_t rows, int64_t cols) {
        const int64_t sr = (rows + 127) / 128, sc = (cols + 127) / 128;
        std::string q(size_t(rows * cols), '\0'), scales(size_t(sr * sc), '\0');
        std::vector<float> dec(size_t(rows * cols));
        for (int64_t br = 0; br < sr; ++br)
            for (int64_t bc = 0; bc < sc; ++bc) {
                float amax = 0;
                for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
                    for (int64_t k = bc * 128; k < std::min(cols, bc * 128 + 128); ++k)
                        amax = std::max(amax, std::fabs(w[r * cols + k]));
                const uint8_t e = e8m0_for(amax, 448.0f);
                scales[size_t(br * sc + bc)] = char(e);
                const float s = std::ldexp(1.0f, int(e) - 127);
                for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
                    for (int64_t k = bc * 128; k < std::min(cols, bc * 128 + 128); ++k) {
                        const uint8_t code = f32_to_e4m3(w[r * cols + k] / s);
                        q[size_t(r * cols + k)] = char(code);
                        dec[size_t(r * cols + k)] = e4m3_to_f32(code) * s;
                    }
            }
        out[name] = {"F8_E4M3", {rows, cols}, q};
        out[name.substr(0, name.size() - 7) + ".scale"] = {"F8_E8M0", {sr, sc}, scales};
        expect[name] = dec;
    };
    auto put_fp4 = [&](const std::string & name, const float * w, int64_t rows, int64_t cols) {
        std::string q(size_t(rows * cols / 2), '\0'), scales(size_t(rows * cols / 32), '\0');
        std::vector<float> dec(size_t(rows * cols));
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t b = 0; b < cols / 32; ++b) {
                float amax = 0;
                for (int64_t k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(w[r * cols + b * 32 + k]));
                const uint8_t e = e8m0_for(amax, 6.0f);
                scales[size_t(r * (cols / 32) + b)] = char(e);
                const float s = std::ldexp(1.0f, int(e) - 127);
                for (int64_t k = 0; k < 32; ++k) {
                    const int64_t col = b * 32 + k;
                    const uint8_t code = f32_to_e2m1(w[r * cols + col] / s);
                    q[size_t((r * cols + col) / 2)] |= char(col % 2 ? code << 4 : code);
                    dec[size_t(r * cols + col)] = e2m1_to_f32(code) * s;
                }
            }
        out[name] = {"I8", {rows, cols / 2}, q};
        out[name.substr(0, name.size() - 7) + ".scale"] = {"F8_E8M0", {rows, cols / 32}, scales};
        expect[name] = dec;
    };
    auto put_plain = [&](const std::string & name, const std::vector<float> & v, std::vector<int64_t> shape,
                         bool bf16) {
        std::string bytes;
        std::vector<float> dec(v.size());
        for (size_t i = 0; i < v.size(); ++i) {
            if (bf16) {
                const uint16_t h = f32_to_bf16(v[i]);
                bytes.append(reinterpret_cast<const char *>(&h), 2);
                dec[i] = bf16_to_f32(h);
            } else {
                bytes.append(reinterpret_cast<const char *>(&v[i]), 4);
                dec[i] = v[i];
            }
        }
        out[name] = {bf16 ? "BF16" : "F32", std::move(shape), bytes};
        expect[name] = dec;
    };

    for (const TensorSpec & spec : tensor_layout(c)) {
        const GgufTensorInfo & t = *ref.find_tensor(spec.name);
        const std::vector<float> w = f32_of(t);
        const std::string o_prefix = spec.layer < 0 ? "" : "layers." + std::to_string(spec.layer) + ".";
        if (spec.slot == Slot::gate_exps || spec.slot == Slot::up_exps || spec.slot == Slot::down_exps) {
            const char * wn = spec.slot == Slot::gate_exps ? "w1" : spec.slot == Slot::up_exps ? "w3" : "w2";
            for (int64_t e = 0; e < spec.ne[2]; ++e)
                put_fp4(o_prefix + "ffn.experts." + std::to_string(e) + "." + wn + ".weight",
                        w.data() + e * spec.ne[0] * spec.ne[1], spec.ne[1], spec.ne[0]);
            continue;
        }
        const std::string name = o_prefix + checkpoint_tensor_names(spec.slot).second;
        if (spec.role == Role::table) {
            const int32_t * ids = reinterpret_cast<const int32_t *>(ref.tensor_data(t));
            std::string bytes;
            for (int64_t i = 0; i < t.n_elements(); ++i) {
                const int64_t v = ids[i];
                bytes.append(reinterpret_cast<const char *>(&v), 8);
            }
            out[name] = {"I64", {spec.ne[1], spec.ne[0]}, bytes};
            continue;
        }
        const bool fp8 = spec.role == Role::dense && spec.slot != Slot::output;
        const bool f32 = spec.slot == Slot::sinks || spec.slot == Slot::comp_ape || spec.slot == Slot::idx_comp_ape ||
                         spec.slot == Slot::exp_probs_b || spec.slot == Slot::hc_attn_fn ||
                         spec.slot == Slot::hc_attn_base || spec.slot == Slot::hc_attn_scale ||
                         spec.slot == Slot::hc_ffn_fn || spec.slot == Slot::hc_ffn_base ||
                         spec.slot == Slot::hc_ffn_scale || spec.slot == Slot::output_hc_fn ||
                         spec.slot == Slot::output_hc_base || spec.slot == Slot::output_hc_scale;
        std::vector<int64_t> shape =
            spec.ne[1] > 1 ? std::vector<int64_t>{spec.ne[1], spec.ne[0]} : std::vector<int64_t>{spec.ne[0]};
        if (fp8)
            put_fp8(name, w.data(), spec.ne[1], spec.ne[0]);
        else
            put_plain(name, w, shape, !f32);
    }

    // model.safetensors: header (JSON, padded to 8 bytes) and the data in header order.
    nlohmann::json header = nlohmann::json::object();
    std::string data;
    for (auto & [name, e] : out) {
        header[name] = {
            {"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {data.size(), data.size() + e.bytes.size()}}};
        data += e.bytes;
    }
    std::string h = header.dump();
    h.append((8 - h.size() % 8) % 8, ' ');
    std::string file(8, '\0');
    const uint64_t hl = h.size();
    std::memcpy(file.data(), &hl, 8);
    const std::string ck = dir.file("official");
    fs::create_directories(ck);
    write_file_atomic(ck + "/model.safetensors", file + h + data);
    std::vector<int> ratios;
    for (const LayerConfig & l : c.layers) ratios.push_back(int(l.compress_ratio));
    const nlohmann::json args = {{"vocab_size", c.n_vocab},
                                 {"dim", c.n_embd},
                                 {"n_layers", c.n_layer},
                                 {"n_heads", c.n_head},
                                 {"head_dim", c.head_dim},
                                 {"rope_head_dim", c.n_rot},
                                 {"q_lora_rank", c.q_lora_rank},
                                 {"o_groups", c.o_groups},
                                 {"o_lora_rank", c.o_lora_rank},
                                 {"moe_inter_dim", c.expert_ff},
                                 {"n_routed_experts", c.n_expert},
                                 {"n_activated_experts", c.n_expert_used},
                                 {"n_shared_experts", 1},
                                 {"window_size", c.window},
                                 {"index_n_heads", c.indexer_heads},
                                 {"index_head_dim", c.indexer_dim},
                                 {"index_topk", c.indexer_top_k},
                                 {"hc_mult", c.hc},
                                 {"hc_sinkhorn_iters", c.hc_iters},
                                 {"hc_eps", c.hc_eps},
                                 {"norm_eps", c.norm_eps},
                                 {"route_scale", c.route_scale},
                                 {"swiglu_limit", c.layers[0].swiglu_limit},
                                 {"score_func", "sqrtsoftplus"},
                                 {"rope_theta", c.rope_base},
                                 {"compress_rope_theta", c.rope_base_compressed},
                                 {"rope_factor", c.yarn.factor},
                                 {"original_seq_len", int64_t(c.yarn.original_context)},
                                 {"beta_fast", c.yarn.beta_fast},
                                 {"beta_slow", c.yarn.beta_slow},
                                 {"compress_ratios", ratios},
                                 {"n_hash_layers", c.n_hash_layers},
                                 {"max_seq_len", 4096}};
    write_file_atomic(ck + "/config.json", args.dump(1));

    ConvertOptions opt;
    convert_checkpoint(ck, dir.file("converted.gguf"), opt);
    const GgufFile conv = GgufFile::open(dir.file("converted.gguf"));

    // Exact decoding: every tensor of the converted file against the values its bytes encode.
    size_t checked = 0;
    for (const TensorSpec & spec : tensor_layout(c)) {
        const GgufTensorInfo & t = *conv.find_tensor(spec.name);
        if (t.type == GgmlType::I32) continue;
        ASSERT_EQ(t.type, GgmlType::F32) << spec.name;
        const float * got = reinterpret_cast<const float *>(conv.tensor_data(t));
        std::vector<float> want;
        const std::string o_prefix = spec.layer < 0 ? "" : "layers." + std::to_string(spec.layer) + ".";
        if (spec.role == Role::expert_gate || spec.role == Role::expert_down) {
            const char * wn = spec.slot == Slot::gate_exps ? "w1" : spec.slot == Slot::up_exps ? "w3" : "w2";
            for (int64_t e = 0; e < spec.ne[2]; ++e) {
                const auto & v = expect[o_prefix + "ffn.experts." + std::to_string(e) + "." + wn + ".weight"];
                want.insert(want.end(), v.begin(), v.end());
            }
        } else {
            want = expect[o_prefix + checkpoint_tensor_names(spec.slot).second];
        }
        ASSERT_EQ(int64_t(want.size()), t.n_elements()) << spec.name;
        for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], want[i]) << spec.name << " element " << i;
        ++checked;
    }
    EXPECT_GT(checked, 60u);

    // The FP8/FP4 model stays close to the f32 one it was quantized from.
    auto logits_of = [&](const GgufFile & f) {
        auto backend = make_cpu_backend({2, false});
        Model m(f, *backend, 16, Numerics::reference);
        std::vector<int32_t> tokens;
        for (int i = 0; i < 48; ++i) tokens.push_back((i * 37 + 11) % 300);
        std::vector<float> lg(tokens.size() * 300);
        auto state = m.new_state(64);
        m.eval(*state, tokens, LogitsMode::all, lg.data());
        return lg;
    };
    const std::vector<float> a = logits_of(ref), b = logits_of(conv);
    int agree = 0;
    for (size_t t = 0; t < 48; ++t)
        agree += std::max_element(a.begin() + t * 300, a.begin() + (t + 1) * 300) - (a.begin() + t * 300) ==
                 std::max_element(b.begin() + t * 300, b.begin() + (t + 1) * 300) - (b.begin() + t * 300);
    std::printf("official encoding (FP8 dense, FP4 experts): top-1 agreement with the f32 model %d/48\n", agree);
    EXPECT_GE(agree, 30);
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
    // Under the official numerics the indexer keys are BF16: half those bytes.
    EXPECT_EQ(plan_kv(c, ctx, ub, false, indexer_key_type(Numerics::official)).indexer_bytes, p.indexer_bytes / 2);
}

// The official numerics keep the indexer's keys as BF16 (indexer_key_type): the keys are FP4-rounded, so BF16 holds
// them exactly. A state holding them as F32 computes the same logits bit for bit, snapshots to the same bytes, and
// continues the same after a snapshot of either is restored into the other kind. 40 tokens give the CSA layer (ratio
// 4, top 4) 10 rows to choose from.
TEST(KvState, Bf16IndexerKeysAreExactUnderOfficialNumerics) {
    const GgufFile f = GgufFile::open(std::string(DSV4_TEST_DATA) + "/gguf/tiny-deepseek4.gguf");
    auto backend = make_cpu_backend({1, true});
    Model m(f, *backend, 8, Numerics::official);
    ASSERT_EQ(m.config().layers[1].kind, LayerKind::csa);
    ASSERT_EQ(indexer_key_type(Numerics::reference), GgmlType::F32);
    auto bf16 = m.new_state(64);
    ASSERT_EQ(bf16->layer(1).idx_keys.type, GgmlType::BF16);
    KvState f32(m.config(), *backend, 64, m.n_ubatch(), false, GgmlType::F32);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 40; ++i) tokens.push_back((i * 7 + 3) % 32);
    const size_t nv = size_t(m.config().n_vocab);
    std::vector<float> a(tokens.size() * nv), b(tokens.size() * nv);
    m.eval(*bf16, tokens, LogitsMode::all, a.data());
    m.eval(f32, tokens, LogitsMode::all, b.data());
    EXPECT_EQ(a, b);
    const std::string snap = bf16->snapshot();
    EXPECT_EQ(snap, f32.snapshot());

    auto resumed = m.new_state(64);
    resumed->restore(f32.snapshot());
    f32.restore(snap);
    const std::vector<int32_t> more = {5, 17, 2, 30};
    std::vector<float> c(more.size() * nv), d(more.size() * nv);
    m.eval(*resumed, more, LogitsMode::all, c.data());
    m.eval(f32, more, LogitsMode::all, d.data());
    EXPECT_EQ(c, d);
}

}  // namespace
