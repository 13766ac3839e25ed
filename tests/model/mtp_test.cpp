// The MTP draft head against a direct implementation of model-spec.md §8, on synthetic f32 models in both file
// layouts: llama.cpp's in-file block (blk.N.*, fused nextn.eh_proj, the main model's HC head) and ds4's separate
// MTP file (mtp.0.*, split e/h projections, its own HC head and norm).
//
// The reference below is written from the spec with plain loops over the dequantized weights, independently of
// the backend ops: it shares only the GGUF reader with the engine.
#include "backend/backend.h"
#include "format/gguf.h"
#include "model/forward.h"
#include "model/synth.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <optional>
#include <unistd.h>

using namespace dsv4;
namespace fs = std::filesystem;

namespace {

using Vec = std::vector<float>;

struct Ref {
    const ModelConfig & c;
    const GgufFile & main;
    const GgufFile & mtp;  // the file holding the MTP block (the main file for llama.cpp's layout)
    std::string p;         // MTP tensor prefix
    bool fused;

    const float * t(const GgufFile & f, const std::string & name) const {
        const GgufTensorInfo * i = f.find_tensor(name);
        EXPECT_TRUE(i && i->type == GgmlType::F32) << name;
        return reinterpret_cast<const float *>(f.tensor_data(*i));
    }
    const float * w(const std::string & suffix) const { return t(mtp, p + suffix); }

    // y = W x for W stored [in, out] (row r of W is out row r).
    static Vec mv(const float * W, const Vec & x, int64_t out) {
        Vec y(static_cast<size_t>(out));
        for (int64_t r = 0; r < out; ++r) {
            double s = 0;
            for (size_t i = 0; i < x.size(); ++i) s += double(W[r * int64_t(x.size()) + int64_t(i)]) * x[i];
            y[size_t(r)] = float(s);
        }
        return y;
    }
    Vec rms(const Vec & x, const float * g) const {
        double s = 0;
        for (float v : x) s += double(v) * v;
        const float k = 1.0f / std::sqrt(float(s / double(x.size())) + c.norm_eps);
        Vec y(x.size());
        for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * k * (g ? g[i] : 1.0f);
        return y;
    }
    static float sigmoid(float x) { return 1 / (1 + std::exp(-x)); }
    void rope(float * v, int64_t width, int64_t pos, bool inverse) const {
        for (int64_t i = 0; i < c.n_rot / 2; ++i) {
            const double ang = double(pos) * std::pow(c.rope_base, -2.0 * double(i) / double(c.n_rot)) * (inverse ? -1 : 1);
            float * q = v + width - c.n_rot + 2 * i;
            const float a = q[0], b = q[1];
            q[0] = float(a * std::cos(ang) - b * std::sin(ang));
            q[1] = float(a * std::sin(ang) + b * std::cos(ang));
        }
    }
    float swiglu(float g, float u, float lim) const {
        g = std::min(g, lim);
        u = std::clamp(u, -lim, lim);
        return g * sigmoid(g) * u;
    }

    // HCPre → (y, post, comb) of model-spec §4.1.
    Vec hc_pre(const std::vector<Vec> & X, const std::string & which, Vec & post, Vec & comb) const {
        const int64_t hc = c.hc, D = c.n_embd, mix_n = (2 + hc) * hc;
        Vec flat;
        for (auto & s : X) flat.insert(flat.end(), s.begin(), s.end());
        const Vec mix = mv(w("hc_" + which + "_fn.weight"), rms(flat, nullptr), mix_n);
        const float * sc = w("hc_" + which + "_scale.weight");
        const float * bs = w("hc_" + which + "_base.weight");
        Vec pre(static_cast<size_t>(hc));
        post.assign(size_t(hc), 0);
        comb.assign(size_t(hc * hc), 0);
        for (int64_t h = 0; h < hc; ++h) {
            pre[size_t(h)] = sigmoid(mix[size_t(h)] * sc[0] + bs[h]) + c.hc_eps;
            post[size_t(h)] = 2 * sigmoid(mix[size_t(hc + h)] * sc[1] + bs[hc + h]);
        }
        for (int64_t i = 0; i < hc; ++i) {
            double s = 0, m = -1e30;
            for (int64_t j = 0; j < hc; ++j) m = std::max<double>(m, mix[size_t(2 * hc + i * hc + j)] * sc[2] + bs[2 * hc + i * hc + j]);
            for (int64_t j = 0; j < hc; ++j)
                s += comb[size_t(i * hc + j)] = float(std::exp(mix[size_t(2 * hc + i * hc + j)] * sc[2] + bs[2 * hc + i * hc + j] - m));
            for (int64_t j = 0; j < hc; ++j) comb[size_t(i * hc + j)] = float(comb[size_t(i * hc + j)] / s) + c.hc_eps;
        }
        for (int64_t it = 0; it < c.hc_iters; ++it) {
            if (it > 0)
                for (int64_t i = 0; i < hc; ++i) {
                    float s = 0;
                    for (int64_t j = 0; j < hc; ++j) s += comb[size_t(i * hc + j)];
                    for (int64_t j = 0; j < hc; ++j) comb[size_t(i * hc + j)] /= s + c.hc_eps;
                }
            for (int64_t j = 0; j < hc; ++j) {
                float s = 0;
                for (int64_t i = 0; i < hc; ++i) s += comb[size_t(i * hc + j)];
                for (int64_t i = 0; i < hc; ++i) comb[size_t(i * hc + j)] /= s + c.hc_eps;
            }
        }
        Vec y(static_cast<size_t>(D), 0);
        for (int64_t h = 0; h < hc; ++h)
            for (int64_t k = 0; k < D; ++k) y[size_t(k)] += pre[size_t(h)] * X[size_t(h)][size_t(k)];
        return y;
    }
    void hc_post(std::vector<Vec> & X, const Vec & o, const Vec & post, const Vec & comb) const {
        std::vector<Vec> out(X.size(), Vec(o.size()));
        for (size_t j = 0; j < X.size(); ++j)
            for (size_t k = 0; k < o.size(); ++k) {
                float s = post[j] * o[k];
                for (size_t i = 0; i < X.size(); ++i) s += comb[i * X.size() + j] * X[i][k];
                out[j][k] = s;
            }
        X = out;
    }

    // The MTP block's K=V rows by position (its own sliding window).
    std::vector<Vec> kv_rows;

    Vec attention(const Vec & xn, int64_t pos) {
        const int64_t H = c.n_head, d = c.head_dim, G = c.o_groups;
        const Vec cq = rms(mv(w("attn_q_a.weight"), xn, c.q_lora_rank), w("attn_q_a_norm.weight"));
        Vec q = mv(w("attn_q_b.weight"), cq, H * d);
        for (int64_t h = 0; h < H; ++h) {
            Vec head(q.begin() + h * d, q.begin() + (h + 1) * d);
            head = rms(head, nullptr);
            rope(head.data(), d, pos, false);
            std::copy(head.begin(), head.end(), q.begin() + h * d);
        }
        Vec kv = rms(mv(w("attn_kv.weight"), xn, d), w("attn_kv_a_norm.weight"));
        rope(kv.data(), d, pos, false);
        if (int64_t(kv_rows.size()) <= pos) kv_rows.resize(size_t(pos + 1));
        kv_rows[size_t(pos)] = kv;
        const float * sinks = w("attn_sinks.weight");
        Vec o(static_cast<size_t>(H * d), 0);
        for (int64_t h = 0; h < H; ++h) {
            std::vector<double> s;
            std::vector<const Vec *> rows;
            for (int64_t r = std::max<int64_t>(0, pos - c.window + 1); r <= pos; ++r) {
                double dot = 0;
                for (int64_t k = 0; k < d; ++k) dot += double(q[size_t(h * d + k)]) * kv_rows[size_t(r)][size_t(k)];
                s.push_back(dot / std::sqrt(double(d)));
                rows.push_back(&kv_rows[size_t(r)]);
            }
            double m = sinks[h];
            for (double v : s) m = std::max(m, v);
            double den = std::exp(sinks[h] - m);
            for (double v : s) den += std::exp(v - m);
            for (size_t r = 0; r < rows.size(); ++r)
                for (int64_t k = 0; k < d; ++k) o[size_t(h * d + k)] += float(std::exp(s[r] - m) / den * (*rows[r])[size_t(k)]);
            rope(o.data() + h * d, d, pos, true);
        }
        const int64_t in_g = H * d / G;
        Vec low;
        for (int64_t g = 0; g < G; ++g) {
            Vec part(o.begin() + g * in_g, o.begin() + (g + 1) * in_g);
            Vec y = mv(w("attn_output_a.weight") + g * c.o_lora_rank * in_g, part, c.o_lora_rank);
            low.insert(low.end(), y.begin(), y.end());
        }
        return mv(w("attn_output_b.weight"), low, c.n_embd);
    }

    Vec moe(const Vec & xn) const {
        const int64_t E = c.n_expert, k = c.n_expert_used, I = c.expert_ff, D = c.n_embd;
        const LayerConfig lc = mtp_layer_config(c);
        const Vec logits = mv(w("ffn_gate_inp.weight"), xn, E);
        Vec p(static_cast<size_t>(E)), score(static_cast<size_t>(E));
        const float * bias = w("exp_probs_b.bias");
        for (int64_t e = 0; e < E; ++e) {
            const float z = logits[size_t(e)];
            p[size_t(e)] = std::sqrt(z > 20 ? z : std::log1p(std::exp(z)));
            score[size_t(e)] = p[size_t(e)] + bias[e];
        }
        std::vector<int> idx(static_cast<size_t>(E));
        std::iota(idx.begin(), idx.end(), 0);
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return score[size_t(a)] > score[size_t(b)]; });
        double sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += p[size_t(idx[size_t(j)])];
        Vec out(static_cast<size_t>(D), 0);
        auto expert = [&](const float * g, const float * u, const float * dn, float limit, float weight) {
            const Vec hg = mv(g, xn, I), hu = mv(u, xn, I);
            Vec h(static_cast<size_t>(I));
            for (int64_t i = 0; i < I; ++i) h[size_t(i)] = swiglu(hg[size_t(i)], hu[size_t(i)], limit);
            const Vec y = mv(dn, h, D);
            for (int64_t i = 0; i < D; ++i) out[size_t(i)] += weight * y[size_t(i)];
        };
        for (int64_t j = 0; j < k; ++j) {
            const int e = idx[size_t(j)];
            const float wgt = float(p[size_t(e)] / sum * c.route_scale);
            expert(w("ffn_gate_exps.weight") + e * I * D, w("ffn_up_exps.weight") + e * I * D,
                   w("ffn_down_exps.weight") + e * D * I, lc.swiglu_limit, wgt);
        }
        expert(w("ffn_gate_shexp.weight"), w("ffn_up_shexp.weight"), w("ffn_down_shexp.weight"),
               lc.swiglu_limit_shared, 1.0f);
        return out;
    }

    // One draft step at position pos: hidden streams of the main model, the next token; returns logits, updates
    // `hidden` to the block's output streams.
    Vec step(std::vector<Vec> & X, int32_t next, int64_t pos) {
        const int64_t D = c.n_embd;
        const float * emb = t(main, "token_embd.weight") + int64_t(next) * D;
        const Vec en = rms(Vec(emb, emb + D), w(fused ? "nextn.enorm.weight" : "enorm.weight"));
        for (auto & s : X) {
            const Vec hn = rms(s, w(fused ? "nextn.hnorm.weight" : "hnorm.weight"));
            if (fused) {
                Vec cat = en;
                cat.insert(cat.end(), hn.begin(), hn.end());
                s = mv(w("nextn.eh_proj.weight"), cat, D);
            } else {
                const Vec a = mv(w("e_proj.weight"), en, D), b = mv(w("h_proj.weight"), hn, D);
                for (int64_t i = 0; i < D; ++i) s[size_t(i)] = a[size_t(i)] + b[size_t(i)];
            }
        }
        Vec post, comb;
        Vec y = hc_pre(X, "attn", post, comb);
        hc_post(X, attention(rms(y, w("attn_norm.weight")), pos), post, comb);
        y = hc_pre(X, "ffn", post, comb);
        hc_post(X, moe(rms(y, w("ffn_norm.weight"))), post, comb);
        // Head: the MTP block's own HC head and norm in ds4's layout, the main model's in llama.cpp's.
        const GgufFile & hf = fused ? main : mtp;
        const std::string hp = fused ? "output_hc_" : p + "hc_head_";
        Vec flat;
        for (auto & s : X) flat.insert(flat.end(), s.begin(), s.end());
        const Vec mix = mv(t(hf, hp + "fn.weight"), rms(flat, nullptr), c.hc);
        Vec z(static_cast<size_t>(D), 0);
        for (int64_t h = 0; h < c.hc; ++h) {
            const float wh = sigmoid(mix[size_t(h)] * t(hf, hp + "scale.weight")[0] + t(hf, hp + "base.weight")[h]) + c.hc_eps;
            for (int64_t i = 0; i < D; ++i) z[size_t(i)] += wh * X[size_t(h)][size_t(i)];
        }
        z = rms(z, fused ? t(main, "output_norm.weight") : w("norm.weight"));
        return mv(t(main, "output.weight"), z, c.n_vocab);
    }
};

class Mtp : public ::testing::TestWithParam<bool> {};  // true: llama.cpp's in-file layout

TEST_P(Mtp, DraftHeadMatchesTheSpec) {
    const bool in_file = GetParam();
    const std::string dir = (fs::temp_directory_path() / ("dsv4_mtp_" + std::to_string(::getpid()))).string();
    fs::create_directories(dir);
    SynthOptions o;
    o.config = mini_config(2, 384);
    o.config.window = 8;  // the draft sequence crosses the window
    o.mix = StorageMix::f32;
    o.seed = 7;
    o.mtp_in_file = in_file;
    if (!in_file) o.mtp_path = dir + "/mtp.gguf";
    write_synthetic_model(o, dir + "/model.gguf");

    const GgufFile file = GgufFile::open(dir + "/model.gguf");
    std::optional<GgufFile> mtp_file;
    if (!in_file) mtp_file = GgufFile::open(o.mtp_path);
    auto backend = make_cpu_backend({2, false});
    Model model(file, *backend, 4, Numerics::reference, mtp_file ? &*mtp_file : nullptr);
    const ModelConfig & c = model.config();
    ASSERT_TRUE(model.weights().mtp.has_value());

    std::vector<int32_t> tokens;
    for (int i = 0; i < 14; ++i) tokens.push_back(int32_t((i * 97 + 13) % c.n_vocab));
    const int64_t S = int64_t(tokens.size()), V = c.n_vocab, HD = c.hc * c.n_embd;
    auto state = model.new_state(64);
    Vec logits(size_t(S * V)), hidden(size_t(S * HD));
    model.eval(*state, tokens, LogitsMode::all, logits.data(), {}, hidden.data());

    // The engine: MTP over positions 0..S-2 pairing H_p with x_{p+1}, in chunks of 3 (its window fills as it goes).
    Vec draft(size_t((S - 1) * V)), draft_hidden(size_t((S - 1) * HD));
    for (int64_t p0 = 0; p0 < S - 1; p0 += 3) {
        const int64_t n = std::min<int64_t>(3, S - 1 - p0);
        model.mtp_eval(*state, p0, std::span<const int32_t>(tokens).subspan(size_t(p0 + 1), size_t(n)),
                       hidden.data() + p0 * HD, draft.data() + p0 * V, draft_hidden.data() + p0 * HD);
    }

    Ref ref{c, file, in_file ? file : *mtp_file, in_file ? "blk." + std::to_string(c.n_layer) + "." : "mtp.0.", in_file, {}};
    double worst = 0;
    for (int64_t p = 0; p < S - 1; ++p) {
        std::vector<Vec> X;
        for (int64_t h = 0; h < c.hc; ++h)
            X.emplace_back(hidden.begin() + p * HD + h * c.n_embd, hidden.begin() + p * HD + (h + 1) * c.n_embd);
        const Vec want = ref.step(X, tokens[size_t(p + 1)], p);
        for (int64_t v = 0; v < V; ++v)
            worst = std::max(worst, std::fabs(double(want[size_t(v)]) - draft[size_t(p * V + v)]) /
                                        std::max(1.0, std::fabs(double(want[size_t(v)]))));
        for (int64_t i = 0; i < HD; ++i)
            ASSERT_NEAR(X[size_t(i / c.n_embd)][size_t(i % c.n_embd)], draft_hidden[size_t(p * HD + i)], 1e-3);
    }
    EXPECT_LT(worst, 1e-4);
    std::printf("MTP (%s layout): max relative logit error %.3g over %ld draft positions\n",
                in_file ? "llama.cpp" : "ds4", worst, S - 1);
    fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Layouts, Mtp, ::testing::Values(true, false));

}  // namespace
