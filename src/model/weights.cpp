#include "model/weights.h"

#include "model/layout.h"

#include "format/quant.h"
#include "util/error.h"
#include "util/log.h"

#include <set>
#include <vector>

namespace dsv4 {

namespace {

bool is_weight_type(GgmlType t) {
    switch (t) {
        case GgmlType::F32:
        case GgmlType::F16:
        case GgmlType::BF16:
        case GgmlType::Q8_0:
        case GgmlType::Q2_K:
        case GgmlType::Q4_K:
        case GgmlType::IQ2_XXS:
        case GgmlType::MXFP4: return true;
        default: return false;
    }
}

std::string shape_text(const int64_t * ne, int n) {
    std::string s = "[";
    for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
    return s + "]";
}

// Bytes of the model's files in backend memory so far, for the load progress.
struct LoadCount {
    uint64_t done = 0, total = 0;
    const LoadProgressFn * progress = nullptr;
    void add(uint64_t bytes) {
        done += bytes;
        if (progress && *progress) (*progress)(done, total);
    }
};

// Binds tensors of one GGUF file by name, checking shape and type, and records which tensors were used.
class Binder {
  public:
    Binder(const GgufFile & file, Backend & backend, ModelWeights & w, LoadCount & count)
        : file_(file), backend_(backend), w_(w), count_(count) {}

    bool has(const std::string & name) const { return file_.find_tensor(name) != nullptr; }

    // A matrix (or stack of expert matrices) of any supported weight type.
    Tensor matrix(const std::string & name, int64_t ne0, int64_t ne1, int64_t ne2 = 1) {
        const GgufTensorInfo & info = find(name, {ne0, ne1, ne2});
        DSV4_CHECK(is_weight_type(info.type), "{}: tensor '{}' has type {}, which dsv4 cannot use for a weight",
                   file_.path(), name, type_name(info.type));
        Tensor host = make_tensor(info.type, const_cast<uint8_t *>(file_.tensor_data(info)), ne0, ne1, ne2);
        std::unique_ptr<BackendBuffer> storage;
        Tensor t = backend_.upload_weight(host, &storage);
        if (storage) w_.storage.push_back(std::move(storage));
        count_.add(info.n_bytes);
        return t;
    }

    // A small vector, converted to F32 whatever its stored float type.
    Tensor vector(const std::string & name, int64_t n) {
        const GgufTensorInfo & info = find(name, {n, 1, 1});
        DSV4_CHECK(info.type == GgmlType::F32 || info.type == GgmlType::F16 || info.type == GgmlType::BF16,
                   "{}: tensor '{}' has type {}; expected f32, f16 or bf16", file_.path(), name,
                   type_name(info.type));
        std::vector<float> values(static_cast<size_t>(n));
        dequantize_row(info.type, file_.tensor_data(info), values.data(), n);
        count_.add(info.n_bytes);
        return upload_f32(values.data(), n);
    }

    // An integer table (the hash router's token → experts map), I32 [ne0, ne1].
    Tensor table_i32(const std::string & name, int64_t ne0, int64_t ne1) {
        const GgufTensorInfo & info = find(name, {ne0, ne1, 1});
        DSV4_CHECK(info.type == GgmlType::I32, "{}: tensor '{}' has type {}; expected i32", file_.path(), name,
                   type_name(info.type));
        const int32_t * ids = reinterpret_cast<const int32_t *>(file_.tensor_data(info));
        for (int64_t i = 0; i < ne0 * ne1; ++i)
            DSV4_CHECK(ids[i] >= 0 && ids[i] < expert_limit_, "{}: tensor '{}' element {} = {} is not an expert id "
                       "in [0, {})", file_.path(), name, i, ids[i], expert_limit_);
        auto buf = backend_.alloc(size_t(ne0 * ne1) * sizeof(int32_t));
        Tensor t = make_tensor(GgmlType::I32, buf->data(), ne0, ne1);
        backend_.write(t, ids, t.n_bytes());
        w_.storage.push_back(std::move(buf));
        count_.add(info.n_bytes);
        return t;
    }

    Tensor upload_f32(const float * values, int64_t n) {
        auto buf = backend_.alloc(size_t(n) * sizeof(float));
        Tensor t = make_tensor(GgmlType::F32, buf->data(), n);
        backend_.write(t, values, t.n_bytes());
        w_.storage.push_back(std::move(buf));
        return t;
    }

    void set_expert_limit(int64_t n) { expert_limit_ = n; }

    void warn_unused(const std::string & prefix_filter = "") const {
        size_t unused = 0;
        for (const auto & t : file_.tensors())
            if (!used_.count(t.name) && t.name.rfind(prefix_filter, 0) == 0) {
                if (unused++ < 8) log_warn("{}: tensor '{}' is not used by the model", file_.path(), t.name);
            }
        if (unused > 8) log_warn("{}: {} tensors are not used by the model", file_.path(), unused);
    }

  private:
    const GgufTensorInfo & find(const std::string & name, std::initializer_list<int64_t> shape) {
        const GgufTensorInfo * info = file_.find_tensor(name);
        DSV4_CHECK(info, "{}: missing tensor '{}'", file_.path(), name);
        int64_t want[4] = {1, 1, 1, 1};
        int i = 0;
        for (int64_t v : shape) want[i++] = v;
        DSV4_CHECK(info->ne[0] == want[0] && info->ne[1] == want[1] && info->ne[2] == want[2] && info->ne[3] == 1,
                   "{}: tensor '{}' has shape {}, expected {}", file_.path(), name, shape_text(info->ne, 4),
                   shape_text(want, 4));
        used_.insert(name);
        return *info;
    }

    const GgufFile & file_;
    Backend & backend_;
    ModelWeights & w_;
    LoadCount & count_;
    std::set<std::string> used_;
    int64_t expert_limit_ = 0;
};

Tensor * layer_field(LayerWeights & l, Slot slot) {
    switch (slot) {
        case Slot::hc_attn_fn: return &l.hc_attn_fn;
        case Slot::hc_attn_scale: return &l.hc_attn_scale;
        case Slot::hc_attn_base: return &l.hc_attn_base;
        case Slot::hc_ffn_fn: return &l.hc_ffn_fn;
        case Slot::hc_ffn_scale: return &l.hc_ffn_scale;
        case Slot::hc_ffn_base: return &l.hc_ffn_base;
        case Slot::attn_norm: return &l.attn_norm;
        case Slot::q_a: return &l.q_a;
        case Slot::q_a_norm: return &l.q_a_norm;
        case Slot::q_b: return &l.q_b;
        case Slot::kv: return &l.kv;
        case Slot::kv_norm: return &l.kv_norm;
        case Slot::sinks: return &l.sinks;
        case Slot::o_a: return &l.o_a;
        case Slot::o_b: return &l.o_b;
        case Slot::comp_kv: return &l.comp_kv;
        case Slot::comp_gate: return &l.comp_gate;
        case Slot::comp_ape: return &l.comp_ape;
        case Slot::comp_norm: return &l.comp_norm;
        case Slot::idx_q_b: return &l.idx_q_b;
        case Slot::idx_proj: return &l.idx_proj;
        case Slot::idx_comp_kv: return &l.idx_comp_kv;
        case Slot::idx_comp_gate: return &l.idx_comp_gate;
        case Slot::idx_comp_ape: return &l.idx_comp_ape;
        case Slot::idx_comp_norm: return &l.idx_comp_norm;
        case Slot::ffn_norm: return &l.ffn_norm;
        case Slot::gate_inp: return &l.gate_inp;
        case Slot::exp_probs_b: return &l.exp_probs_b;
        case Slot::tid2eid: return &l.tid2eid;
        case Slot::gate_exps: return &l.gate_exps;
        case Slot::up_exps: return &l.up_exps;
        case Slot::down_exps: return &l.down_exps;
        case Slot::gate_shexp: return &l.gate_shexp;
        case Slot::up_shexp: return &l.up_shexp;
        case Slot::down_shexp: return &l.down_shexp;
        default: return nullptr;
    }
}

Tensor * field(ModelWeights & w, MtpWeights * mtp, const TensorSpec & s) {
    switch (s.slot) {
        case Slot::token_embd: return &w.token_embd;
        case Slot::output_norm: return &w.output_norm;
        case Slot::output: return &w.output;
        case Slot::output_hc_fn: return &w.output_hc_fn;
        case Slot::output_hc_scale: return &w.output_hc_scale;
        case Slot::output_hc_base: return &w.output_hc_base;
        case Slot::mtp_eh_proj: return &mtp->eh_proj;
        case Slot::mtp_e_proj: return &mtp->e_proj;
        case Slot::mtp_h_proj: return &mtp->h_proj;
        case Slot::mtp_enorm: return &mtp->enorm;
        case Slot::mtp_hnorm: return &mtp->hnorm;
        case Slot::mtp_norm: return &mtp->norm;
        case Slot::mtp_hc_head_fn: return &mtp->hc_head_fn;
        case Slot::mtp_hc_head_scale: return &mtp->hc_head_scale;
        case Slot::mtp_hc_head_base: return &mtp->hc_head_base;
        default: return layer_field(mtp ? mtp->block : w.layers[size_t(s.layer)], s.slot);
    }
}

// Binds every tensor of a layout.
void bind_layout(Binder & b, const std::vector<TensorSpec> & specs, ModelWeights & w, MtpWeights * mtp) {
    for (const TensorSpec & s : specs) {
        Tensor * t = field(w, mtp, s);
        if (s.slot == Slot::exp_probs_b && !b.has(s.name)) {
            // ds4 treats the selection bias as optional: no bias is a zero bias.
            std::vector<float> zeros(static_cast<size_t>(s.ne[0]), 0.0f);
            *t = b.upload_f32(zeros.data(), s.ne[0]);
            continue;
        }
        switch (s.role) {
            case Role::vector: *t = b.vector(s.name, s.ne[0]); break;
            case Role::table: *t = b.table_i32(s.name, s.ne[0], s.ne[1]); break;
            default: *t = b.matrix(s.name, s.ne[0], s.ne[1], s.ne[2]); break;
        }
    }
}

}  // namespace

ModelWeights load_weights(const GgufFile & file, const ModelConfig & c, Backend & backend, const GgufFile * mtp_file,
                          const LoadProgressFn & progress) {
    ModelWeights w;
    w.layers.resize(size_t(c.n_layer));
    LoadCount count;
    count.progress = &progress;
    for (const GgufFile * f : {&file, mtp_file})
        if (f)
            for (const GgufTensorInfo & t : f->tensors()) count.total += t.n_bytes;
    Binder b(file, backend, w, count);
    b.set_expert_limit(c.n_expert);
    bind_layout(b, tensor_layout(c), w, nullptr);

    // MTP: llama.cpp keeps it in the main file as block n_layer with nextn.* tensors; ds4 ships mtp.0.* apart.
    const std::string in_file = "blk." + std::to_string(c.n_layer) + ".";
    if (b.has(in_file + slot_suffix(Slot::mtp_eh_proj))) {
        MtpWeights m;
        m.config = mtp_layer_config(c);
        bind_layout(b, mtp_layout(c, in_file, true), w, &m);
        // llama.cpp's layout has no HC head of its own for the MTP block (it uses the main model's) and an
        // optional norm before the shared LM head.
        const std::string norm = in_file + "nextn.shared_head_norm.weight";
        m.norm = b.has(norm) ? b.vector(norm, c.n_embd) : w.output_norm;
        m.hc_head_fn = w.output_hc_fn;
        m.hc_head_scale = w.output_hc_scale;
        m.hc_head_base = w.output_hc_base;
        w.mtp = std::move(m);
    }
    b.warn_unused();

    if (mtp_file) {
        DSV4_CHECK(!w.mtp, "{}: the model already has an MTP block; drop the separate MTP file", mtp_file->path());
        Binder mb(*mtp_file, backend, w, count);
        mb.set_expert_limit(c.n_expert);
        MtpWeights m;
        m.config = mtp_layer_config(c);
        bind_layout(mb, mtp_layout(c, "mtp.0.", false), w, &m);
        w.mtp = std::move(m);
        mb.warn_unused();
    }
    return w;
}

}  // namespace dsv4
