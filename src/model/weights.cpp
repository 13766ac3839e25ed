#include "model/weights.h"

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

// Binds tensors of one GGUF file by name, checking shape and type, and records which tensors were used.
class Binder {
  public:
    Binder(const GgufFile & file, Backend & backend, ModelWeights & w) : file_(file), backend_(backend), w_(w) {}

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
    std::set<std::string> used_;
    int64_t expert_limit_ = 0;
};

// Binds one transformer block whose tensors are named `prefix` + suffix.
LayerWeights bind_layer(Binder & b, const std::string & prefix, const ModelConfig & c, const LayerConfig & lc) {
    const int64_t D = c.n_embd, d = c.head_dim, mix = c.hc_mix();
    auto n = [&](const char * suffix) { return prefix + suffix; };
    LayerWeights l;
    l.hc_attn_fn = b.matrix(n("hc_attn_fn.weight"), c.hc * D, mix);
    l.hc_attn_scale = b.vector(n("hc_attn_scale.weight"), 3);
    l.hc_attn_base = b.vector(n("hc_attn_base.weight"), mix);
    l.hc_ffn_fn = b.matrix(n("hc_ffn_fn.weight"), c.hc * D, mix);
    l.hc_ffn_scale = b.vector(n("hc_ffn_scale.weight"), 3);
    l.hc_ffn_base = b.vector(n("hc_ffn_base.weight"), mix);

    l.attn_norm = b.vector(n("attn_norm.weight"), D);
    l.q_a = b.matrix(n("attn_q_a.weight"), D, c.q_lora_rank);
    l.q_a_norm = b.vector(n("attn_q_a_norm.weight"), c.q_lora_rank);
    l.q_b = b.matrix(n("attn_q_b.weight"), c.q_lora_rank, c.q_dim());
    l.kv = b.matrix(n("attn_kv.weight"), D, d);
    l.kv_norm = b.vector(n("attn_kv_a_norm.weight"), d);
    l.sinks = b.vector(n("attn_sinks.weight"), c.n_head);
    l.o_a = b.matrix(n("attn_output_a.weight"), c.q_dim() / c.o_groups, c.o_groups * c.o_lora_rank);
    l.o_b = b.matrix(n("attn_output_b.weight"), c.o_groups * c.o_lora_rank, D);

    if (lc.kind != LayerKind::sliding) {
        const int64_t width = (lc.kind == LayerKind::csa ? 2 : 1) * d;
        l.comp_kv = b.matrix(n("attn_compressor_kv.weight"), D, width);
        l.comp_gate = b.matrix(n("attn_compressor_gate.weight"), D, width);
        l.comp_ape = b.matrix(n("attn_compressor_ape.weight"), width, lc.compress_ratio);
        l.comp_norm = b.vector(n("attn_compressor_norm.weight"), d);
    }
    if (lc.kind == LayerKind::csa) {
        const int64_t dI = c.indexer_dim;
        l.idx_q_b = b.matrix(n("indexer.attn_q_b.weight"), c.q_lora_rank, c.indexer_heads * dI);
        l.idx_proj = b.matrix(n("indexer.proj.weight"), D, c.indexer_heads);
        l.idx_comp_kv = b.matrix(n("indexer_compressor_kv.weight"), D, 2 * dI);
        l.idx_comp_gate = b.matrix(n("indexer_compressor_gate.weight"), D, 2 * dI);
        l.idx_comp_ape = b.matrix(n("indexer_compressor_ape.weight"), 2 * dI, lc.compress_ratio);
        l.idx_comp_norm = b.vector(n("indexer_compressor_norm.weight"), dI);
    }

    l.ffn_norm = b.vector(n("ffn_norm.weight"), D);
    l.gate_inp = b.matrix(n("ffn_gate_inp.weight"), D, c.n_expert);
    if (lc.hash_routed) {
        l.tid2eid = b.table_i32(n("ffn_gate_tid2eid.weight"), c.n_expert_used, c.n_vocab);
    } else if (b.has(n("exp_probs_b.bias"))) {
        l.exp_probs_b = b.vector(n("exp_probs_b.bias"), c.n_expert);
    } else {
        // ds4 treats the selection bias as optional: no bias is a zero bias.
        std::vector<float> zeros(static_cast<size_t>(c.n_expert), 0.0f);
        l.exp_probs_b = b.upload_f32(zeros.data(), c.n_expert);
    }
    l.gate_exps = b.matrix(n("ffn_gate_exps.weight"), D, c.expert_ff, c.n_expert);
    l.up_exps = b.matrix(n("ffn_up_exps.weight"), D, c.expert_ff, c.n_expert);
    l.down_exps = b.matrix(n("ffn_down_exps.weight"), c.expert_ff, D, c.n_expert);
    l.gate_shexp = b.matrix(n("ffn_gate_shexp.weight"), D, c.expert_ff * c.n_expert_shared);
    l.up_shexp = b.matrix(n("ffn_up_shexp.weight"), D, c.expert_ff * c.n_expert_shared);
    l.down_shexp = b.matrix(n("ffn_down_shexp.weight"), c.expert_ff * c.n_expert_shared, D);
    return l;
}

LayerConfig mtp_layer_config(const ModelConfig & c) {
    // The MTP block attends over its own raw window only, routes by score, and clamps like the last layer.
    LayerConfig lc = c.layers.back();
    lc.kind = LayerKind::sliding;
    lc.compress_ratio = 0;
    lc.hash_routed = false;
    return lc;
}

}  // namespace

ModelWeights load_weights(const GgufFile & file, const ModelConfig & c, Backend & backend, const GgufFile * mtp_file) {
    ModelWeights w;
    Binder b(file, backend, w);
    b.set_expert_limit(c.n_expert);
    const int64_t D = c.n_embd;
    w.token_embd = b.matrix("token_embd.weight", D, c.n_vocab);
    w.output_hc_fn = b.matrix("output_hc_fn.weight", c.hc * D, c.hc);
    w.output_hc_scale = b.vector("output_hc_scale.weight", 1);
    w.output_hc_base = b.vector("output_hc_base.weight", c.hc);
    w.output_norm = b.vector("output_norm.weight", D);
    w.output = b.matrix("output.weight", D, c.n_vocab);

    for (int64_t il = 0; il < c.n_layer; ++il) {
        const std::string prefix = fmt::format("blk.{}.", il);
        w.layers.push_back(bind_layer(b, prefix, c, c.layers[size_t(il)]));
    }

    // MTP: llama.cpp keeps it in the main file as block n_layer with nextn.* tensors; ds4 ships mtp.0.* apart.
    const std::string lc_prefix = fmt::format("blk.{}.", c.n_layer);
    if (b.has(lc_prefix + "nextn.eh_proj.weight")) {
        MtpWeights m;
        m.config = mtp_layer_config(c);
        m.block = bind_layer(b, lc_prefix, c, m.config);
        m.eh_proj = b.matrix(lc_prefix + "nextn.eh_proj.weight", 2 * D, D);
        m.enorm = b.vector(lc_prefix + "nextn.enorm.weight", D);
        m.hnorm = b.vector(lc_prefix + "nextn.hnorm.weight", D);
        // llama.cpp's layout stores no HC head of its own for the MTP block: it uses the main model's.
        const bool own_norm = b.has(lc_prefix + "nextn.shared_head_norm.weight");
        m.norm = own_norm ? b.vector(lc_prefix + "nextn.shared_head_norm.weight", D) : w.output_norm;
        m.hc_head_fn = w.output_hc_fn;
        m.hc_head_scale = w.output_hc_scale;
        m.hc_head_base = w.output_hc_base;
        w.mtp = std::move(m);
    }
    b.warn_unused();

    if (mtp_file) {
        DSV4_CHECK(!w.mtp, "{}: the model already has an MTP block; drop the separate MTP file", mtp_file->path());
        Binder mb(*mtp_file, backend, w);
        mb.set_expert_limit(c.n_expert);
        MtpWeights m;
        m.config = mtp_layer_config(c);
        m.block = bind_layer(mb, "mtp.0.", c, m.config);
        m.e_proj = mb.matrix("mtp.0.e_proj.weight", D, D);
        m.h_proj = mb.matrix("mtp.0.h_proj.weight", D, D);
        m.enorm = mb.vector("mtp.0.enorm.weight", D);
        m.hnorm = mb.vector("mtp.0.hnorm.weight", D);
        m.norm = mb.vector("mtp.0.norm.weight", D);
        m.hc_head_fn = mb.matrix("mtp.0.hc_head_fn.weight", c.hc * D, c.hc);
        m.hc_head_scale = mb.vector("mtp.0.hc_head_scale.weight", 1);
        m.hc_head_base = mb.vector("mtp.0.hc_head_base.weight", c.hc);
        w.mtp = std::move(m);
        mb.warn_unused();
    }
    return w;
}

}  // namespace dsv4
