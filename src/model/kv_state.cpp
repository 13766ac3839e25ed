#include "model/kv_state.h"

#include "util/error.h"
#include "util/half.h"

#include <xxhash.h>

#include <cstring>
#include <limits>

namespace dsv4 {

namespace {

constexpr char kMagic[8] = {'D', 'S', 'V', '4', 'K', 'V', 'S', '1'};
constexpr uint32_t kVersion = 1;

int64_t frontier_rows(const LayerConfig & lc) { return (lc.kind == LayerKind::csa ? 2 : 1) * lc.compress_ratio; }
int64_t frontier_width(const LayerConfig & lc, int64_t d) { return (lc.kind == LayerKind::csa ? 2 : 1) * d; }

class ByteWriter {
  public:
    void put(const void * p, size_t n) { out.append(static_cast<const char *>(p), n); }
    template <typename T> void put(T v) { put(&v, sizeof v); }
    std::string out;
};

class ByteReader {
  public:
    explicit ByteReader(std::string_view in) : in_(in) {}
    void get(void * p, size_t n) {
        DSV4_CHECK(n <= in_.size() - pos_, "KV snapshot truncated at byte {} (needs {} more)", pos_, n);
        std::memcpy(p, in_.data() + pos_, n);
        pos_ += n;
    }
    template <typename T> T get() {
        T v;
        get(&v, sizeof v);
        return v;
    }
    size_t pos() const { return pos_; }

  private:
    std::string_view in_;
    size_t pos_ = 0;
};

// Rows of a compressed layer's store; one at least, so a context shorter than a block still has a tensor.
int64_t compressed_rows(const LayerConfig & lc, int64_t n_ctx) {
    return std::max<int64_t>(n_ctx / lc.compress_ratio, 1);
}

// Calls f(frontier tensor, its offset in a backup) for every layer's frontiers, in the one order that
// save_frontiers and restore_frontiers share.
template <class F>
void for_each_frontier(const std::vector<LayerState> & layers, F f) {
    size_t at = 0;
    for (const LayerState & s : layers)
        for (const Tensor * t : {&s.comp_kv, &s.comp_score, &s.idx_kv, &s.idx_score})
            if (*t) {
                f(*t, at);
                at += t->n_bytes();
            }
}
}  // namespace

KvPlan plan_kv(const ModelConfig & c, int64_t n_ctx, int64_t n_ubatch, bool with_mtp, GgmlType idx_keys) {
    KvPlan p;
    p.n_ctx = n_ctx;
    p.ring = c.window + std::max<int64_t>(n_ubatch, 1) - 1;
    const size_t f = sizeof(float);
    for (const LayerConfig & lc : c.layers) {
        p.raw_bytes += size_t(p.ring * c.head_dim) * f;
        if (lc.kind == LayerKind::sliding) continue;
        const int64_t rows = compressed_rows(lc, n_ctx);
        p.compressed_bytes += size_t(rows * c.head_dim) * f;
        p.frontier_bytes += 2 * size_t(frontier_rows(lc) * frontier_width(lc, c.head_dim)) * f;
        if (lc.kind == LayerKind::csa) {
            p.indexer_bytes += row_bytes(idx_keys, c.indexer_dim) * size_t(rows);
            p.frontier_bytes += 2 * size_t(2 * lc.compress_ratio * 2 * c.indexer_dim) * f;
        }
    }
    if (with_mtp) p.raw_bytes += size_t(p.ring * c.head_dim) * f;
    p.logits_bytes = size_t(c.n_vocab) * f;
    return p;
}

KvState::KvState(const ModelConfig & config, Backend & backend, int64_t n_ctx, int64_t n_ubatch, bool with_mtp,
                 GgmlType idx_keys)
    : config_(config), backend_(backend), n_ctx_(n_ctx) {
    DSV4_CHECK(n_ctx > 0 && n_ubatch > 0, "context ({}) and batch ({}) must be positive", n_ctx, n_ubatch);
    DSV4_CHECK(idx_keys == GgmlType::F32 || idx_keys == GgmlType::BF16, "indexer keys must be F32 or BF16");
    plan_ = plan_kv(config, n_ctx, n_ubatch, with_mtp, idx_keys);
    ring_ = plan_.ring;
    auto tensor = [&](int64_t width, int64_t rows, GgmlType type = GgmlType::F32) {
        auto buf = backend_.alloc(row_bytes(type, width) * size_t(rows));
        Tensor t = make_tensor(type, buf->data(), width, rows);
        buffers_.push_back(std::move(buf));
        return t;
    };
    const int64_t d = config.head_dim;
    for (const LayerConfig & lc : config.layers) {
        LayerState s;
        s.raw = tensor(d, ring_);
        if (lc.kind != LayerKind::sliding) {
            const int64_t rows = compressed_rows(lc, n_ctx);
            s.comp = tensor(d, rows);
            s.comp_kv = tensor(frontier_width(lc, d), frontier_rows(lc));
            s.comp_score = tensor(frontier_width(lc, d), frontier_rows(lc));
            if (lc.kind == LayerKind::csa) {
                s.idx_keys = tensor(config.indexer_dim, rows, idx_keys);
                s.idx_kv = tensor(2 * config.indexer_dim, 2 * lc.compress_ratio);
                s.idx_score = tensor(2 * config.indexer_dim, 2 * lc.compress_ratio);
            }
        }
        layers_.push_back(s);
    }
    if (with_mtp) mtp_.raw = tensor(d, ring_);
    last_logits_ = tensor(config.n_vocab, 1);
    clear();
}

void KvState::clear() {
    n_past_ = 0;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (LayerState & s : layers_) {
        if (s.comp_kv) {
            backend_.fill(s.comp_kv, 0.0f);
            backend_.fill(s.comp_score, neg_inf);
        }
        if (s.idx_kv) {
            backend_.fill(s.idx_kv, 0.0f);
            backend_.fill(s.idx_score, neg_inf);
        }
    }
}

void KvState::save_frontiers(const Tensor & backup) const {
    DSV4_CHECK(backup.n_bytes() >= plan_.frontier_bytes, "frontier backup of {} bytes, {} needed", backup.n_bytes(),
               plan_.frontier_bytes);
    for_each_frontier(layers_, [&](const Tensor & t, size_t at) { backend_.copy(backup, t, t.n_bytes(), at, 0); });
}

void KvState::restore_frontiers(const Tensor & backup) {
    for_each_frontier(layers_, [&](const Tensor & t, size_t at) { backend_.copy(t, backup, t.n_bytes(), 0, at); });
}

std::string KvState::snapshot() const {
    ByteWriter w;
    w.put(kMagic, sizeof kMagic);
    w.put(kVersion);
    w.put(uint32_t(config_.n_layer));
    w.put(uint32_t(config_.head_dim));
    w.put(uint32_t(config_.indexer_dim));
    w.put(uint32_t(config_.window));
    for (const LayerConfig & lc : config_.layers) {
        w.put(uint32_t(lc.kind));
        w.put(uint32_t(lc.compress_ratio));
    }
    w.put(uint8_t(has_mtp()));
    w.put(uint64_t(n_past_));

    const int64_t n_raw = std::min<int64_t>(n_past_, config_.window - 1);
    std::vector<float> buf;
    std::vector<uint16_t> half;
    auto put_rows = [&](const Tensor & t, int64_t first, int64_t count) {
        buf.resize(size_t(count * t.ne[0]));
        const size_t bytes = size_t(count) * t.row_bytes(), offset = size_t(first) * t.row_bytes();
        if (t.type == GgmlType::BF16) {
            half.resize(buf.size());
            backend_.read(t, half.data(), bytes, offset);
            for (size_t i = 0; i < buf.size(); ++i) buf[i] = bf16_to_f32(half[i]);
        } else {
            backend_.read(t, buf.data(), bytes, offset);
        }
        w.put(buf.data(), buf.size() * sizeof(float));
    };
    auto put_raw = [&](const Tensor & raw) {
        for (int64_t p = n_past_ - n_raw; p < n_past_; ++p) put_rows(raw, p % ring_, 1);
    };
    for (size_t il = 0; il < layers_.size(); ++il) {
        const LayerState & s = layers_[il];
        const LayerConfig & lc = config_.layers[il];
        put_raw(s.raw);
        if (lc.kind == LayerKind::sliding) continue;
        const int64_t rows = n_past_ / lc.compress_ratio;
        put_rows(s.comp, 0, rows);
        put_rows(s.comp_kv, 0, s.comp_kv.rows());
        put_rows(s.comp_score, 0, s.comp_score.rows());
        if (lc.kind == LayerKind::csa) {
            put_rows(s.idx_keys, 0, rows);
            put_rows(s.idx_kv, 0, s.idx_kv.rows());
            put_rows(s.idx_score, 0, s.idx_score.rows());
        }
    }
    if (has_mtp()) put_raw(mtp_.raw);
    w.put(uint64_t(XXH64(w.out.data(), w.out.size(), 0)));
    return std::move(w.out);
}

void KvState::restore(std::string_view bytes) {
    clear();
    DSV4_CHECK(bytes.size() >= sizeof kMagic + 8, "KV snapshot too short ({} bytes)", bytes.size());
    uint64_t stored_sum;
    std::memcpy(&stored_sum, bytes.data() + bytes.size() - 8, 8);
    DSV4_CHECK(XXH64(bytes.data(), bytes.size() - 8, 0) == stored_sum, "KV snapshot checksum mismatch");
    ByteReader r(bytes.substr(0, bytes.size() - 8));
    char magic[8];
    r.get(magic, sizeof magic);
    DSV4_CHECK(std::memcmp(magic, kMagic, sizeof magic) == 0, "not a dsv4 KV snapshot (bad magic)");
    const uint32_t version = r.get<uint32_t>();
    DSV4_CHECK(version == kVersion, "KV snapshot version {} is not supported (expected {})", version, kVersion);
    const uint32_t n_layer = r.get<uint32_t>(), head_dim = r.get<uint32_t>(), indexer_dim = r.get<uint32_t>(),
                   window = r.get<uint32_t>();
    DSV4_CHECK(n_layer == config_.n_layer && head_dim == config_.head_dim && indexer_dim == config_.indexer_dim &&
                   window == config_.window,
               "KV snapshot was made for another model shape ({} layers, head {}, indexer {}, window {})", n_layer,
               head_dim, indexer_dim, window);
    for (const LayerConfig & lc : config_.layers) {
        const uint32_t kind = r.get<uint32_t>(), ratio = r.get<uint32_t>();
        DSV4_CHECK(kind == uint32_t(lc.kind) && ratio == lc.compress_ratio,
                   "KV snapshot was made for another layer layout");
    }
    const bool snap_mtp = r.get<uint8_t>() != 0;
    const uint64_t n_past = r.get<uint64_t>();
    DSV4_CHECK(n_past <= uint64_t(n_ctx_), "KV snapshot holds {} tokens; the context is {}", n_past, n_ctx_);

    const int64_t n_raw = std::min<int64_t>(int64_t(n_past), config_.window - 1);
    std::vector<float> buf;
    std::vector<uint16_t> half;
    // A BF16 store takes the rows rounded (exact for a state of the same numerics, which wrote them as BF16).
    auto get_rows = [&](const Tensor & t, int64_t first, int64_t count) {
        buf.resize(size_t(count * t.ne[0]));
        r.get(buf.data(), buf.size() * sizeof(float));
        const size_t bytes = size_t(count) * t.row_bytes(), offset = size_t(first) * t.row_bytes();
        if (t.type == GgmlType::BF16) {
            half.resize(buf.size());
            for (size_t i = 0; i < buf.size(); ++i) half[i] = f32_to_bf16(buf[i]);
            backend_.write(t, half.data(), bytes, offset);
        } else {
            backend_.write(t, buf.data(), bytes, offset);
        }
    };
    auto get_raw = [&](const Tensor & raw) {
        for (int64_t p = int64_t(n_past) - n_raw; p < int64_t(n_past); ++p) get_rows(raw, p % ring_, 1);
    };
    try {
        for (size_t il = 0; il < layers_.size(); ++il) {
            const LayerState & s = layers_[il];
            const LayerConfig & lc = config_.layers[il];
            get_raw(s.raw);
            if (lc.kind == LayerKind::sliding) continue;
            const int64_t rows = int64_t(n_past) / lc.compress_ratio;
            get_rows(s.comp, 0, rows);
            get_rows(s.comp_kv, 0, s.comp_kv.rows());
            get_rows(s.comp_score, 0, s.comp_score.rows());
            if (lc.kind == LayerKind::csa) {
                get_rows(s.idx_keys, 0, rows);
                get_rows(s.idx_kv, 0, s.idx_kv.rows());
                get_rows(s.idx_score, 0, s.idx_score.rows());
            }
        }
        if (snap_mtp) {
            if (has_mtp()) {
                get_raw(mtp_.raw);
            } else {
                buf.resize(size_t(n_raw * config_.head_dim));
                r.get(buf.data(), buf.size() * sizeof(float));
            }
        }
        DSV4_CHECK(r.pos() == bytes.size() - 8, "KV snapshot has {} unexpected trailing bytes",
                   bytes.size() - 8 - r.pos());
    } catch (...) {
        clear();
        throw;
    }
    n_past_ = int64_t(n_past);
}

}  // namespace dsv4
