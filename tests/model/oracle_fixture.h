// The HF oracle fixtures of tests/data/oracle (made by ../shared/oracle/make_reference.py and
// tests/oracle/make_fixtures.py), shared by the CPU tests (tests/model/oracle_test.cpp) and the CUDA tests
// (tests/backend/cuda_model_test.cpp): loading, conversion to GGUF once per run, and running a call schedule.
#pragma once

#include "model/convert.h"
#include "model/forward.h"
#include "util/file.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <span>

namespace dsv4::oracle {

struct Npy {
    std::vector<float> data;
    int64_t rows = 0, cols = 0;
};

// NumPy .npy, float32 little-endian, C order, 2-D.
inline Npy load_npy(const std::string & path) {
    const std::string b = read_file(path);
    EXPECT_EQ(b.substr(1, 5), "NUMPY");
    uint16_t header_len;
    std::memcpy(&header_len, b.data() + 8, 2);
    const std::string header = b.substr(10, header_len);
    EXPECT_NE(header.find("'<f4'"), std::string::npos) << header;
    const size_t open = header.find("'shape': (") + 10;
    Npy n;
    std::sscanf(header.c_str() + open, "%ld, %ld", &n.rows, &n.cols);
    n.data.resize(size_t(n.rows * n.cols));
    std::memcpy(n.data.data(), b.data() + 10 + header_len, n.data.size() * sizeof(float));
    return n;
}

struct OracleFixture {
    std::string name;
    std::string dir;
    std::vector<int32_t> tokens;
    int64_t prefill = 1;
    std::vector<int64_t> chunks;  // the oracle's random chunk schedule
    Npy logits;                   // logits_full.npy: [S, V]
    std::set<int64_t> fragile;    // positions with an indexer/router top-k margin under 1e-4
};

inline const OracleFixture & oracle_fixture(const std::string & name) {
    static std::map<std::string, OracleFixture> cache;
    auto it = cache.find(name);
    if (it != cache.end()) return it->second;
    OracleFixture f;
    f.name = name;
    // DSV4_TEST_DATA in the environment: the data of a checkout other than the build's (a GPU machine running a
    // package of test binaries built elsewhere, scripts/gpu-check.sh).
    const char * data = std::getenv("DSV4_TEST_DATA");
    f.dir = std::string(data ? data : DSV4_TEST_DATA) + "/oracle/" + name;
    const auto tok = nlohmann::json::parse(read_file(f.dir + "/tokens.json"));
    f.tokens = tok["tokens"].get<std::vector<int32_t>>();
    f.prefill = tok.value("prefill", int64_t(1));
    if (tok.contains("chunk_schedule")) f.chunks = tok["chunk_schedule"].get<std::vector<int64_t>>();
    f.logits = load_npy(f.dir + "/logits_full.npy");
    if (std::filesystem::exists(f.dir + "/meta.json")) {
        const auto meta = nlohmann::json::parse(read_file(f.dir + "/meta.json"));
        for (auto & [layer, kinds] : meta["fragile_positions"].items())
            for (auto & [kind, list] : kinds.items())
                for (auto & pm : list) f.fragile.insert(pm[0].get<int64_t>());
    }
    return cache.emplace(name, std::move(f)).first->second;
}

// The fixture converted to a GGUF of the given storage mix, once per test run; the files are removed at exit.
inline const std::string & oracle_gguf(const std::string & name, StorageMix mix = StorageMix::f32) {
    struct TempFiles {
        std::map<std::string, std::string> paths;
        ~TempFiles() {
            for (const auto & [key, p] : paths) std::filesystem::remove(p);
        }
    };
    static TempFiles temp;
    const std::string key = name + "/" + storage_mix_name(mix);
    auto it = temp.paths.find(key);
    if (it != temp.paths.end()) return it->second;
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("dsv4_oracle_" + name + "_" + storage_mix_name(mix) + "_" + std::to_string(::getpid()) +
                               ".gguf"))
                                 .string();
    ConvertOptions opt;
    opt.mix = mix;
    convert_checkpoint(oracle_fixture(name).dir, path, opt);
    return temp.paths.emplace(key, path).first->second;
}

// Evaluates the tokens in calls of the given sizes on one new state; returns every position's logits.
inline std::vector<float> run_calls(Model & model, const std::vector<int32_t> & tokens,
                                    const std::vector<int64_t> & calls) {
    const int64_t V = model.config().n_vocab;
    std::vector<float> out(tokens.size() * size_t(V));
    auto state = model.new_state(int64_t(tokens.size()));
    size_t pos = 0;
    for (int64_t n : calls) {
        model.eval(*state, std::span<const int32_t>(tokens).subspan(pos, size_t(n)), LogitsMode::all,
                   out.data() + pos * size_t(V));
        pos += size_t(n);
    }
    EXPECT_EQ(pos, tokens.size());
    return out;
}

// A chunk stopped between layers (Model::eval's progress), then the rest: the model's chunks are 16 tokens and every
// chunk checks. Evaluates tokens[0, 16), then tokens[16, ...) stopped after half the layers of that call's second
// chunk (its first chunk reports after each of its first L - 1 layers and once whole: L calls), then tokens[32, ...).
// Returns the last call's logits (positions 32 onward) and checks what the stopped call reported and left.
inline std::vector<float> stopped_chunk_then_rest(Model & model, const std::vector<int32_t> & all) {
    EXPECT_EQ(model.n_ubatch(), 16);
    model.set_layer_check_tokens(2);
    const int64_t V = model.config().n_vocab, L = model.config().n_layer;
    const std::span<const int32_t> tokens(all);
    EXPECT_GT(tokens.size(), size_t(48));
    auto s = model.new_state(int64_t(tokens.size()));
    EXPECT_TRUE(model.eval(*s, tokens.first(16), LogitsMode::none, nullptr));
    const int64_t stop_at = L + std::max<int64_t>(L / 2, 1);
    std::vector<int64_t> reported;
    const bool finished = model.eval(*s, tokens.subspan(16), LogitsMode::none, nullptr, [&](int64_t done) {
        reported.push_back(done);
        return int64_t(reported.size()) < stop_at;
    });
    EXPECT_FALSE(finished);
    EXPECT_EQ(s->n_past(), 32);
    EXPECT_EQ(int64_t(reported.size()), stop_at);
    if (int64_t(reported.size()) >= L) {
        EXPECT_EQ(reported[size_t(L - 1)], 16);  // the first chunk whole
    }
    EXPECT_TRUE(std::is_sorted(reported.begin(), reported.end()));
    EXPECT_LT(reported.back(), 32);
    std::vector<float> rest((tokens.size() - 32) * size_t(V));
    EXPECT_TRUE(model.eval(*s, tokens.subspan(32), LogitsMode::all, rest.data()));
    model.set_layer_check_tokens(Model::kLayerCheckTokens);
    return rest;
}

// Calls of `step` tokens (the last one shorter) covering `total`.
inline std::vector<int64_t> uniform_calls(size_t total, int64_t step) {
    std::vector<int64_t> calls;
    for (size_t done = 0; done < total; done += size_t(step))
        calls.push_back(std::min<int64_t>(step, int64_t(total - done)));
    return calls;
}

// The largest error of `got` against `ref`, relative to |ref| but never to less than 1 (logits near zero).
inline double max_rel_err(std::span<const float> got, std::span<const float> ref) {
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i)
        worst = std::max(worst, std::fabs(double(got[i]) - double(ref[i])) / std::max(1.0, std::fabs(double(ref[i]))));
    return worst;
}

// A prefill of `first` tokens, then one call per token.
inline std::vector<int64_t> prefill_then_decode(int64_t first, size_t total) {
    std::vector<int64_t> calls = {first};
    for (size_t i = size_t(first); i < total; ++i) calls.push_back(1);
    return calls;
}

// The batched-decode tests' three sequences of one fixture: sequence i reads the fixture's tokens from offset
// shift[i] (wrapping) and is prefilled to depth[i], so their compressors, indexers and rings are at different points;
// sequence 0 then decodes the fixture's own tokens.
struct BatchSequences {
    const OracleFixture & f;
    int64_t n = int64_t(f.tokens.size());
    int64_t shift[3] = {0, 5, n / 2}, depth[3] = {n / 2, 3, n / 3};

    int32_t token(int i, int64_t p) const { return f.tokens[size_t((p + shift[i]) % n)]; }
    std::vector<int32_t> prompt(int i) const {
        std::vector<int32_t> t;
        for (int64_t p = 0; p < depth[i]; ++p) t.push_back(token(i, p));
        return t;
    }
    // Whether sequence i, at n_past tokens, is in the batch of `step`: until its context is full, and sequence 1
    // sits out every fifth step (so batches change and recur).
    bool steps(int i, int step, int64_t n_past) const { return n_past < n && !(i == 1 && step % 5 == 2); }
};

// A state's sampling candidates (Model::logit_candidates) against its last row: the max and the argmax, ids
// ascending with their own logits, and exactly the logits at or above the lowest candidate. The candidates are
// returned (ids, then values, then stats as floats).
inline std::vector<float> expect_candidates_of_row(Model & m, const KvState & s, const std::string & what) {
    const int64_t k = m.n_candidates();
    std::vector<float> row(static_cast<size_t>(m.config().n_vocab)), values(static_cast<size_t>(k));
    std::vector<int32_t> ids(static_cast<size_t>(k));
    float stats[4];
    m.logit_candidates(s, ids.data(), values.data(), stats);
    m.read_last_logits(s, row.data());
    const int64_t argmax = std::max_element(row.begin(), row.end()) - row.begin();
    EXPECT_EQ(stats[3], float(argmax)) << what;
    EXPECT_EQ(stats[0], row[size_t(argmax)]) << what;
    const int64_t count = int64_t(stats[2]);
    EXPECT_GT(count, 0) << what;
    float lowest = INFINITY;
    for (int64_t j = 0; j < count && j < k; ++j) {
        EXPECT_EQ(values[size_t(j)], row[size_t(ids[size_t(j)])]) << what << " candidate " << j;
        if (j > 0) {
            EXPECT_LT(ids[size_t(j - 1)], ids[size_t(j)]) << what;
        }
        lowest = std::min(lowest, values[size_t(j)]);
    }
    int64_t above = 0;  // logits at or above the lowest candidate: exactly the candidates
    for (float x : row) above += x >= lowest;
    EXPECT_EQ(above, count) << what;
    std::vector<float> out(ids.size());
    std::memcpy(out.data(), ids.data(), ids.size() * sizeof(int32_t));
    out.insert(out.end(), values.begin(), values.end());
    out.insert(out.end(), stats, stats + 4);
    return out;
}

}  // namespace dsv4::oracle
