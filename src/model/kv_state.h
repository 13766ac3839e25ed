// The state of one sequence: per layer, the raw sliding-window ring of K=V rows, the compressed rows and the
// compressor frontiers (the open block's projections), and on CSA layers the indexer's keys and frontier.
// Everything lives in backend memory; snapshot() / restore() move it to and from a byte buffer whose layout does
// not depend on the backend, the context size or the ring size (the disk cache and the server build on this).
#pragma once

#include "backend/backend.h"
#include "model/config.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dsv4 {

struct LayerState {
    Tensor raw;         // F32 [ring, d]: K=V row of position p at row p mod ring
    Tensor comp;        // F32 [n_ctx / R, d]: compressed row b pools positions [bR, bR + R)   (csa, hca)
    Tensor comp_kv;     // F32 [c·R, c·d]: compressor frontier, projected values             (csa: c = 2; hca: 1)
    Tensor comp_score;  // F32 [c·R, c·d]: compressor frontier, gate scores (-inf = empty)
    Tensor idx_keys;    // F32 or BF16 [n_ctx / R, d_I]: indexer key of compressed row b    (csa)
    Tensor idx_kv;      // F32 [2R, 2·d_I]: indexer compressor frontier, values
    Tensor idx_score;   // F32 [2R, 2·d_I]: indexer compressor frontier, scores
};

// Bytes of a state, layer by layer, for planning memory before allocating it.
struct KvPlan {
    int64_t n_ctx = 0;
    int64_t ring = 0;
    size_t raw_bytes = 0;         // all layers' raw rings
    size_t compressed_bytes = 0;  // all layers' compressed rows
    size_t indexer_bytes = 0;     // all layers' indexer keys
    size_t frontier_bytes = 0;    // compressor frontiers
    size_t logits_bytes = 0;      // the last token's logits
    size_t total() const { return raw_bytes + compressed_bytes + indexer_bytes + frontier_bytes + logits_bytes; }
};

// ring = window + n_ubatch - 1: a chunk of n_ubatch tokens writes all its rows before attending, and its first
// query still needs the window - 1 rows before the chunk.
// idx_keys: the indexer keys' type (indexer_key_type in model/forward.h).
KvPlan plan_kv(const ModelConfig & config, int64_t n_ctx, int64_t n_ubatch, bool with_mtp = false,
               GgmlType idx_keys = GgmlType::F32);

class KvState {
  public:
    KvState(const ModelConfig & config, Backend & backend, int64_t n_ctx, int64_t n_ubatch, bool with_mtp = false,
            GgmlType idx_keys = GgmlType::F32);

    int64_t n_ctx() const { return n_ctx_; }
    int64_t n_past() const { return n_past_; }
    void set_n_past(int64_t n) { n_past_ = n; }
    int64_t ring() const { return ring_; }
    const KvPlan & plan() const { return plan_; }
    LayerState & layer(int64_t il) { return layers_[size_t(il)]; }
    LayerState & mtp() { return mtp_; }
    // F32 [n_vocab]: the logits of the last token evaluated (Model::eval), kept in backend memory so that sampling
    // reads a few candidates (Model::logit_candidates) rather than the row. Not part of the snapshot.
    const Tensor & last_logits() const { return last_logits_; }
    bool has_mtp() const { return bool(mtp_.raw); }

    // Empties the state (position 0): frontiers back to (0, -inf). Rows need no clearing: nothing reads a row
    // before it is written.
    void clear();

    // The compressors' frontiers are the only part of the state a chunk changes in place: its raw rows overwrite
    // ring rows older than the window of its first token, its compressed and indexer rows lie past n_past. So a
    // chunk stopped between layers leaves the state as it was once the frontiers saved before it are put back.
    // `backup` holds plan().frontier_bytes.
    void save_frontiers(const Tensor & backup) const;
    void restore_frontiers(const Tensor & backup);

    // The state at its current position as bytes: a versioned header (shapes), the last window-1 raw rows,
    // every written compressed and indexer row (as f32 whatever their type here), the frontiers, and an xxh64
    // checksum.
    std::string snapshot() const;
    // Restores a snapshot; throws dsv4::Error (and leaves the state cleared) when the bytes are corrupt, were made
    // for another model shape, or need more context than this state has.
    void restore(std::string_view bytes);

  private:
    const ModelConfig & config_;
    Backend & backend_;
    int64_t n_ctx_;
    int64_t ring_;
    int64_t n_past_ = 0;
    KvPlan plan_;
    std::vector<LayerState> layers_;
    LayerState mtp_;  // raw ring of the MTP block (when loaded)
    Tensor last_logits_;
    std::vector<std::unique_ptr<BackendBuffer>> buffers_;
};

}  // namespace dsv4
