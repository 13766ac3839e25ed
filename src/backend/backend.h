// The backend op set: everything the DeepSeek V4 forward pass computes, as operations on tensors that live in
// the backend's memory (host memory for the CPU backend, device memory for CUDA). model/forward.cpp is written
// once against this interface; every backend implements every op, and tests/backend_ops checks each op of each
// backend against the CPU reference.
//
// Conventions:
//   - Activations are F32, row-major, contiguous: a tensor [rows, cols] has ne[0] = cols (ggml order).
//   - Weights keep the type of the model file; a matrix W [out, in] has ne[0] = in, ne[1] = out, and is applied
//     as y = W·x to each activation row. Routed experts are [in, out, n_expert] (expert e is one matrix).
//   - Ops are asynchronous on a backend with a device: they are ordered, and results reach the host only through
//     read(). Shapes are checked by the caller (model/forward); ops assert them only in debug builds.
//   - Weight arguments (matrices, a norm's gamma, biases, sinks, the mixing parameters) are never written by an op
//     of the sequence that reads them: a device backend may read them before the previous op has ended (CUDA
//     reads them before its programmatic-dependent-launch wait).
//   - Token positions come as an I32 tensor in backend memory (positions[t] for row t), never as host integers,
//     and no op's launch depends on a position: one decode step is the same op sequence at every position, so a
//     device backend can capture it once and replay it.
#pragma once

#include "format/types.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

namespace dsv4 {

struct Tensor {
    GgmlType type = GgmlType::F32;
    int64_t ne[4] = {1, 1, 1, 1};  // ggml order: ne[0] is contiguous
    void * data = nullptr;         // backend address; owned by a BackendBuffer or a mapped file

    int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
    int64_t rows() const { return ne[1] * ne[2] * ne[3]; }
    size_t row_bytes() const { return dsv4::row_bytes(type, ne[0]); }
    size_t n_bytes() const { return row_bytes() * size_t(rows()); }
    explicit operator bool() const { return data != nullptr; }
    float * f32() const { return static_cast<float *>(data); }
    int32_t * i32() const { return static_cast<int32_t *>(data); }
};

Tensor make_tensor(GgmlType type, void * data, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1, int64_t ne3 = 1);
// Rows [first, first + count) of a tensor viewed as a matrix of rows() rows (same row width).
Tensor row_view(const Tensor & t, int64_t first, int64_t count);
// The same memory with another shape (same type and element count).
Tensor reshape(const Tensor & t, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1, int64_t ne3 = 1);

// Memory owned by a backend; freed with it.
class BackendBuffer {
  public:
    virtual ~BackendBuffer() = default;
    virtual void * data() = 0;
    virtual size_t size() const = 0;
};

// Rotary embedding of the trailing n_rot channels of each head: pairs (2i, 2i+1) of that slice turn by
// angle pos·inv_freq[i]. inv_freq is an F32 tensor [n_rot/2] in backend memory.
struct RopeSpec {
    Tensor inv_freq;  // F32 [n_rot / 2]
    int n_rot = 0;
};

// What happens to a compressed row when its block completes, before it is stored: RMSNorm, RoPE at the block's
// first position b·R, and the official numerics' rounding (FP8 for attention rows, Hadamard + FP4 for indexer keys).
enum class RowRounding { none, fp8, hadamard_fp4 };

struct CompressedRowFinish {
    Tensor norm;  // F32 [width]
    float eps = 1e-6f;
    RopeSpec rope;
    RowRounding rounding = RowRounding::none;
    int64_t fp8_dims = 0;  // fp8: channels [0, fp8_dims) are rounded (the rotated tail is not)
};

// Where the compressed rows that a query attends to come from (attention and the indexer).
struct CompressedRows {
    Tensor rows;        // F32 [capacity, width]: row b pools tokens [bR, bR + R); null when the layer has none
    int64_t ratio = 0;  // R
    Tensor selected;    // I32 [n_tokens, top_k]: rows chosen by the indexer (-1 = none); null means "all
                        // rows visible to the query", i.e. b < floor((pos + 1) / R)
};

constexpr int kCandidateBinsPerNat = 32;  // logit_candidates: bin width 1/32 nat
constexpr int kCandidateBins = 1024;      // over 32 nats below the maximum

// One tensor of norm_rope.
struct NormRopeTarget {
    Tensor x;              // F32 [n, heads, width], in place
    Tensor gamma = {};     // F32 [width], or none
    int64_t fp8_dims = 0;  // FP8 round trip of channels [0, fp8_dims) after the rotation
    Tensor ring = {};      // [ring_rows, heads·width], or none
};

struct MatmulTarget {
    Tensor w;  // [in, out_i], any weight type
    Tensor y;  // F32 [n, out_i]
};

// A sublayer's hyper-connection input (hc_pre): its mixing weights, Sinkhorn's settings and its input norm.
struct HcPre {
    Tensor fn;     // [hc·D, (2+hc)·hc], any weight type
    Tensor scale;  // F32 [3]
    Tensor base;   // F32 [(2+hc)·hc]
    Tensor norm;   // F32 [D], or none (y left unnormed)
    int iters = 0;
    float eps_hc = 0.0f, eps_norm = 0.0f;
};

// An FFN sublayer of V4: the router, one shared expert and k routed experts of n tokens x [n, D]:
//   logits = x·gate_inp; experts, weights = router(logits, bias | tid2eid, tokens, route_scale);
//   g = x·gate_sh, u = x·up_sh; out = moe(x, experts, weights, gate, up, down, limit) + down_sh·swiglu(g, u, limit_sh).
// logits, g, u, experts and weights are the caller's buffers, written on the way (experts and weights stay
// readable for traces).
struct MoeFfn {
    Tensor gate_inp;               // router projection [D, E]
    Tensor bias, tid2eid, tokens;  // as router(): bias F32 [E] (top-k layers) or tid2eid and tokens (hash layers)
    float route_scale = 1.0f;
    Tensor gate_sh, up_sh, down_sh;  // shared expert [D, I_sh], [D, I_sh], [I_sh, D]
    float limit_sh = 0.0f;
    Tensor gate, up, down;  // routed experts [D, I, E], [D, I, E], [I, D, E]
    float limit = 0.0f;
    Tensor logits;   // F32 [n, E]
    Tensor g, u;     // F32 [n, I_sh]
    Tensor experts;  // I32 [n, k]
    Tensor weights;  // F32 [n, k]
};

class Backend {
  public:
    virtual ~Backend() = default;
    virtual std::string name() const = 0;

    // ---- memory ----------------------------------------------------------------------------------------------
    virtual std::unique_ptr<BackendBuffer> alloc(size_t bytes) = 0;
    // A weight tensor whose bytes are in host memory: the CPU backend uses them in place (zero copy); a device
    // backend copies them into `storage`, which it allocates (caller keeps it alive).
    virtual Tensor upload_weight(const Tensor & host, std::unique_ptr<BackendBuffer> * storage) = 0;
    virtual void write(const Tensor & dst, const void * host, size_t bytes, size_t offset = 0) = 0;
    virtual void read(const Tensor & src, void * host, size_t bytes, size_t offset = 0) = 0;
    virtual void copy(const Tensor & dst, const Tensor & src, size_t bytes, size_t dst_offset = 0,
                      size_t src_offset = 0) = 0;
    virtual void fill(const Tensor & dst, float value) = 0;  // F32 tensors
    virtual void synchronize() = 0;
    // The most device memory this backend has held at once (buffers, weights, scratch, staging); 0 for a backend
    // that works in host memory.
    virtual uint64_t peak_device_bytes() const { return 0; }

    // Runs `ops`, a sequence of op calls whose shapes and buffers are fixed for a given key. A device backend may
    // capture the sequence the first time it sees the key and replay the capture afterwards (CUDA graphs for
    // decode): inputs change only through write() before the call and results leave only through read() after.
    virtual void run_captured(uint64_t key, const std::function<void()> & ops) { ops(); }

    // A branch: ops issued between begin_branch and end_branch that read only what was written before
    // begin_branch or inside the branch, while the ops issued after end_branch and before join_branch neither read
    // what the branch writes nor write what it reads. A device backend may run the branch beside those ops (the
    // CUDA backend does for steps of few tokens, where the ops' latency leaves the GPU idle); every op after
    // join_branch sees the branch's results. n_tokens: the step's tokens. One branch at a time; in-order backends
    // need do nothing.
    virtual void begin_branch(int64_t /*n_tokens*/) {}
    virtual void end_branch() {}
    virtual void join_branch() {}

    // Lanes: the per-sequence ops of a batched step (Model::decode_batch), n_lanes independent sequences of ops.
    // The ops issued after lane(i) form lane i; lane i writes only what no other lane reads or writes (its sequence's
    // state and rows), and reads only that and what was written before begin_lanes. Every op after end_lanes sees
    // every lane's results. A device backend may run the lanes beside each other (the CUDA backend does: each
    // sequence's chain of small kernels would otherwise run one after another); in-order backends need do nothing.
    // Not inside a branch.
    virtual void begin_lanes(int /*n_lanes*/) {}
    virtual void lane(int /*i*/) {}
    virtual void end_lanes() {}

    // ---- dense ops -------------------------------------------------------------------------------------------
    // out[t] = table[ids[t]] as F32. table [width, n_rows] of any weight type; ids I32 [n]; out F32 [n, width].
    virtual void get_rows(const Tensor & table, const Tensor & ids, const Tensor & out) = 0;
    // y [n, out] = x [n, in] · W^T for W [in, out] of any weight type.
    virtual void matmul(const Tensor & w, const Tensor & x, const Tensor & y) = 0;
    // Several projections of one input: y_i [n, out_i] = x [n, in] · W_i^T for every target. One call lets a
    // backend quantize x once and launch once (decode runs up to seven projections of one normed input).
    virtual void matmul_many(const Tensor & x, std::span<const MatmulTarget> targets) = 0;
    // Grouped low-rank projection: x [n, G·in_g], W [in_g, G·out_g]; group g maps x columns [g·in_g, (g+1)·in_g)
    // through W rows [g·out_g, (g+1)·out_g) into y columns [g·out_g, (g+1)·out_g). y [n, G·out_g].
    virtual void matmul_grouped(const Tensor & w, const Tensor & x, const Tensor & y, int64_t groups) = 0;
    // y = x / sqrt(mean(x^2) + eps) (· gamma when given), per row of width ne[0]. In place is allowed.
    virtual void rms_norm(const Tensor & x, const Tensor & gamma, const Tensor & y, float eps) = 0;
    // In place on x [n, heads, width]: rotates the last spec.n_rot channels of every head of row t by position
    // positions[t] (inverse: by the negative angle).
    virtual void rope(const Tensor & x, const RopeSpec & spec, const Tensor & positions, bool inverse) = 0;
    virtual void add(const Tensor & a, const Tensor & b, const Tensor & out) = 0;  // element-wise; out may alias
    // out = silu(min(gate, limit)) · clamp(up, -limit, limit), element-wise [n, width]. limit <= 0: no clamp.
    virtual void swiglu(const Tensor & gate, const Tensor & up, const Tensor & out, float limit) = 0;
    // y [n, out] = add [n, out] + W·swiglu(gate, up, limit) per row, W [in, out]; gate, up [n, in]; y may alias add.
    // The shared expert's activation, down projection and sum with the routed experts in one op.
    virtual void swiglu_matmul_add(const Tensor & w, const Tensor & gate, const Tensor & up, float limit,
                                   const Tensor & add, const Tensor & y) = 0;
    // In place on every target's x [n, heads, width], per head row: RMSNorm (· gamma [width] when given), RoPE of
    // the last rope.n_rot channels by positions[t], then, when fp8_dims > 0, the FP8 round trip of channels
    // [0, fp8_dims) (fp8_roundtrip); when ring [ring_rows, heads·width] is given, token t's rows are also written at
    // slot positions[t] mod ring_rows (store_rows). The query heads and the K=V row on its way into the raw window,
    // in one call (a device backend runs them as one dependent step).
    virtual void norm_rope(std::span<const NormRopeTarget> targets, float eps, const RopeSpec & rope,
                           const Tensor & positions) = 0;

    // ---- numerics of DeepSeek's official inference code (the "official" mode) --------------------------------
    // In place, per row of x [n, width]: FP8 E4M3 round trip of channels [0, n_dims) in blocks of 64 with a
    // power-of-two (UE8M0) scale per block.
    virtual void fp8_roundtrip(const Tensor & x, int64_t n_dims) = 0;
    // In place, per row of x [n, width] (width a power of two): Walsh-Hadamard rotation scaled by 1/sqrt(width),
    // then an FP4 E2M1 round trip in blocks of 32.
    virtual void hadamard_fp4_roundtrip(const Tensor & x) = 0;

    // ---- hyper-connections -----------------------------------------------------------------------------------
    // streams [n, hc, D]: every stream of token t starts as x[t] (x [n, D]).
    virtual void hc_expand(const Tensor & x, const Tensor & streams) = 0;
    // streams [n, hc, D]; w as HcPre describes. Outputs: y [n, D] = Σ_h pre_h·stream_h, then, when w.norm is given,
    // RMS-normed (w.eps_norm) and scaled by it (the sublayer's input norm); post [n, hc]; comb [n, hc, hc] (source,
    // destination), Sinkhorn-normalised with w.iters iterations.
    virtual void hc_pre(const Tensor & streams, const HcPre & w, const Tensor & y, const Tensor & post,
                        const Tensor & comb) = 0;
    // out[t, j] = post[t, j]·o[t] + Σ_i comb[t, i, j]·streams[t, i]. out [n, hc, D] must not alias streams.
    virtual void hc_post(const Tensor & streams, const Tensor & o, const Tensor & post, const Tensor & comb,
                         const Tensor & out) = 0;
    // hc_post(streams, o, post, comb, out), then hc_pre(out, ...) writing y, post and comb: one sublayer's output
    // into the streams and the next sublayer's input in one op, which a device backend runs as one kernel for a
    // few tokens (a decode step). post and comb are read as HCPost's inputs, then overwritten.
    virtual void hc_post_pre(const Tensor & streams, const Tensor & o, const Tensor & post, const Tensor & comb,
                             const Tensor & out, const HcPre & w, const Tensor & y) {
        hc_post(streams, o, post, comb, out);
        hc_pre(out, w, y, post, comb);
    }
    // Final collapse: z [n, D] = Σ_h (σ(scale·μ_h + base_h) + eps_hc)·stream_h with μ = fn · rms0(streams).
    // fn [hc·D, hc]; scale F32 [1]; base F32 [hc].
    virtual void hc_head(const Tensor & streams, const Tensor & fn, const Tensor & scale, const Tensor & base,
                         float eps_hc, float eps_norm, const Tensor & z) = 0;

    // ---- attention -------------------------------------------------------------------------------------------
    // Writes row t of rows [n, d] into ring [ring_rows, d] at slot positions[t] mod ring_rows.
    virtual void store_rows(const Tensor & ring, const Tensor & rows, const Tensor & positions) = 0;
    // Compressor: for token t (position p = positions[t], consecutive), adds ape[p mod R] to its score row, puts
    // its projections into the open block of the state, and when p mod R = R - 1 pools the block into one row
    // per channel (softmax over the candidates' scores), finishes it (`finish`) and stores it as row p / R of
    // `store` [capacity, width] (F32, or BF16: the finished row rounded to nearest even).
    //   kv, score: F32 [n, c·width] (c = 2 with overlap, else 1); ape [c·width, R] (any float type)
    //   state_kv, state_score: F32 [c·R, c·width]. Without overlap, row j holds token j of the open block. With
    //   overlap, rows [0, R) hold the previous complete block and rows [R, 2R) the open one; a block's row pools
    //   the first half (channels [0, width)) of the previous block's tokens and the second half of its own.
    //   Unwritten state is (value 0, score -inf).
    virtual void compressor_update(const Tensor & kv, const Tensor & score, const Tensor & ape, const Tensor & state_kv,
                                   const Tensor & state_score, const Tensor & positions, int64_t ratio, bool overlap,
                                   const CompressedRowFinish & finish, const Tensor & store) = 0;
    // Lightning indexer: for query t at position p = positions[t], score_b = Σ_h w[t,h]·relu(q[t,h]·keys[b])·
    // key_scale over the visible rows b < floor((p + 1) / R); writes the top_k best row ids (ascending), -1
    // padded, to selected I32 [n, top_k]. q [n, H_I, d_I]; w [n, H_I]; keys [capacity, d_I] (F32 or BF16).
    virtual void indexer_select(const Tensor & q, const Tensor & w, const Tensor & keys, const Tensor & positions,
                                int64_t ratio, float key_scale, const Tensor & selected) = 0;
    // Sink attention of queries q [n, H, d] (query t at position p = positions[t]) over the raw window (positions
    // (p - window, p], stored at slot position mod ring in raw [ring, d]) and the compressed rows; K = V; one
    // softmax per head with the sink logit sinks[h] in the denominator only. out [n, H, d]. With unrotate, each
    // head's output is then turned back by its query's angle, as rope(out, *unrotate, positions, true) does (the
    // values carry their own positions' rotation; a device backend does it as it writes out).
    virtual void attention(const Tensor & q, const Tensor & raw, const Tensor & positions, int64_t window,
                           const CompressedRows & comp, const Tensor & sinks, float scale, const Tensor & out,
                           const RopeSpec * unrotate) = 0;

    // ---- sampling --------------------------------------------------------------------------------------------
    // Per row of logits [rows, V] (NaN counts as -inf), the few a sampler can draw, so that the row need not leave
    // the device. With m the row's maximum, logit l falls in bin floor((m − l)·kCandidateBinsPerNat) (f32
    // arithmetic; bins 0 .. kCandidateBins − 1 hold the logits within 32 nats of m); the candidates are the logits
    // of as many of the lowest bins as fit in k together: ids I32 [rows, k] ascending (then -1), values F32
    // [rows, k] (then -inf), stats F32 [rows, 4] = (m, log Σ exp(l − m), number of candidates, lowest id holding m).
    // Every logit left out is below every candidate; there are none when more than k logits share the top bin.
    // k <= kCandidateBins.
    virtual void logit_candidates(const Tensor & logits, const Tensor & ids, const Tensor & values,
                                  const Tensor & stats) = 0;

    // ---- mixture of experts ----------------------------------------------------------------------------------
    // Router: p = sqrt(softplus(logits [n, E])). Hash layers (tid2eid I32 [k, V] given) take experts
    // tid2eid[tokens[t]]; others take the top k of p + bias (bias F32 [E]). Weights are the unbiased p of the
    // chosen experts, renormalised to sum 1 and multiplied by route_scale. experts I32 [n, k], weights F32 [n, k].
    virtual void router(const Tensor & logits, const Tensor & bias, const Tensor & tid2eid, const Tensor & tokens,
                        float route_scale, const Tensor & experts, const Tensor & weights) = 0;
    // Routed experts: out[t] = Σ_j weights[t,j] · down_e(swiglu(gate_e·x[t], up_e·x[t], limit)), e = experts[t,j].
    // x [n, D]; gate/up [D, I, E]; down [I, D, E]; out [n, D].
    virtual void moe(const Tensor & x, const Tensor & experts, const Tensor & weights, const Tensor & gate,
                     const Tensor & up, const Tensor & down, float limit, const Tensor & out) = 0;
    // A whole FFN sublayer of x [n, D] (MoeFfn), out [n, D]. This composition is the definition; a device backend
    // may order the parts itself where they are independent (the CUDA backend's one-token path runs the shared
    // expert's down projection beside the routed experts' gate/up, in one launch).
    virtual void moe_ffn(const Tensor & x, const MoeFfn & f, const Tensor & out) {
        const MatmulTarget proj[] = {{f.gate_inp, f.logits}, {f.gate_sh, f.g}, {f.up_sh, f.u}};
        matmul_many(x, proj);
        router(f.logits, f.bias, f.tid2eid, f.tokens, f.route_scale, f.experts, f.weights);
        moe(x, f.experts, f.weights, f.gate, f.up, f.down, f.limit, out);
        swiglu_matmul_add(f.down_sh, f.g, f.u, f.limit_sh, out, out);
    }
};

struct CpuBackendOptions {
    int n_threads = 0;  // 0: all hardware threads
    // Quantized weights: multiply with 8-bit quantized activations (fast, ds4's CPU numerics) or with f32
    // activations (exact up to float reassociation).
    bool quantize_activations = true;
};

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendOptions & options = {});

}  // namespace dsv4
