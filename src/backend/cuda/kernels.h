// The CUDA kernels' launch interface: plain argument structs and launch functions, shared by the host side
// (backend_cuda.cpp, compiled by the C++ compiler) and the kernel files (*.cu). Every launch is asynchronous on
// the given stream, never synchronises, never allocates and depends on no device value (positions, expert ids
// and counts are read by the kernels): a decode step can be captured into a CUDA graph and replayed.
#pragma once

#include "format/types.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::cuda {

// A switch of the environment (the DSV4_CUDA_* variables): "0" is off, anything else on, unset the default.
bool env_switch(const char * name, bool default_on);

// ---------------------------------------------------------------------------------------------------------------------
// Weights in device memory
// ---------------------------------------------------------------------------------------------------------------------
// upload_weight re-lays Q8_0, IQ2_XXS, MXFP4 and Q2_K tensors as two arrays: every block's payload (the codes,
// 16-byte aligned, so a lane loads 16 bytes at once) and after them every block's scale bytes, in block order.
// The size is unchanged. Q4_K blocks (144 bytes, payload already aligned) and float types keep the file layout.
//
// IQ2_XXS also reorders the bits of each 32-value group's second word. The file's word holds four runs of seven
// signs (the eighth sign of each run of eight values is their parity) and the group's 4-bit scale in bits 28-31;
// turning a run into byte masks (extract, spread by a multiply, parity) took nearly half of a one-token product's
// instructions. On the device, the sign of value 8k + j (j < 7) sits at bit 4j + k and the scale stays in bits
// 28-31: once those are replaced by the four parities (iq2_signs, common.cuh: a few instructions a group), run k
// shifted by 2 - k has its eight signs on bit 2 of the word's eight nibbles, where they turn the level codes of
// the run's grid entry (Iq2Tables::sel) into the selectors of a byte permute that returns the signed values, four
// at a time.
struct BlockSplit {
    int block_bytes;     // bytes of one block in the file
    int payload_offset;  // first payload byte inside the file block
    int payload_bytes;   // payload bytes; the block's other bytes are its scale bytes, in file order
};
// The split of a type; payload_bytes == 0 when the type keeps its file layout.
BlockSplit block_split(GgmlType type);

// IQ2_XXS's grid (format/quant_tables.cpp) in device memory, copied once per backend, as level codes: a 4-byte
// entry (one 32-bit shared-memory bank) rather than eight magnitude bytes, so that a warp's random lookups conflict
// less. Its sign table is not needed: the eighth sign bit is the parity of the seven stored ones.
struct Iq2Tables {
    uint32_t sel[256];  // nibble e of entry k: level of element e (0, 1, 2 for magnitudes 8, 25, 43)
};

struct WeightRef {
    const uint8_t * data = nullptr;
    GgmlType type = GgmlType::F32;
    int64_t ne0 = 0;       // row length K
    int64_t n_blocks = 0;  // blocks in the whole tensor: the split layout's scale array starts at n_blocks·payload
    const Iq2Tables * iq2 = nullptr;  // device tables (IQ2_XXS)
};

// Re-lays n_blocks file blocks at src (device) into the split layout at dst (device, tensor of total_blocks
// blocks, this range starting at block first_block).
void repack_blocks(GgmlType type, const uint8_t * src, uint8_t * dst, int64_t first_block, int64_t n_blocks,
                   int64_t total_blocks, cudaStream_t s);

// ---------------------------------------------------------------------------------------------------------------------
// Matrix-vector products (matvec.cu)
// ---------------------------------------------------------------------------------------------------------------------
// Tokens come in tiles of up to kMaxTileTokens; each block reads its rows' weights once per tile. Quantized
// weights multiply 8-bit activations (exactly the CPU backend's quantize_activations rules: BlockQ8A for
// Q8_0/MXFP4, Q8_K for the K and IQ2 types) with integer dot products; float weights multiply f32 activations.
// One launch serves up to kMaxTargets products of the same input (matmul_many): the grid's x blocks are split
// between the targets, each block working on one target's rows. Tiles of 8 tokens read the weights half as often
// as two of 4 but took longer (more registers a thread, fewer blocks resident): session 62's batched decode steps on
// an H100 were 5-9 % faster at 8 to 16 tokens with tiles of 4 (docs/cuda.md, "Batched decode").
constexpr int kMaxTileTokens = 4;
constexpr int kMaxTargets = 8;

struct MatvecTarget {
    WeightRef w;       // [K, rows·groups] or experts [K, rows, E]
    WeightRef w_up;    // glu only: the up matrix, same shape as w (gate)
    int64_t rows = 0;  // output rows of one group / one expert
    float * y = nullptr;
    int64_t y_stride = 0;             // floats between output rows
    const float * add = nullptr;      // y = add + W·x when given (same layout as y)
    int first_block = 0, blocks = 0;  // set by matvec(): the target's share of grid x
};

struct MatvecArgs {
    MatvecTarget t[kMaxTargets];
    int n_targets = 1;
    int groups = 1;  // grouped projection: group g reads x columns [gK, (g+1)K), writes y columns [g·rows..)
    const float * x = nullptr;
    int64_t x_stride = 0;  // floats between activation rows
    // Fused activation: when x_up is given, the activation is swiglu(x, x_up, x_limit) element-wise (same layout).
    const float * x_up = nullptr;
    float x_limit = 0;
    int64_t n = 0;  // tokens (plain products)
    // Expert products (tiles != null, one target): tile i = {expert, first, count} over the expert-sorted pair
    // list `pairs` (pair p = token·k + slot); the activation row of a pair is x[p / src_div] and its output row y[p].
    const int32_t * tiles = nullptr;
    const int32_t * n_tiles = nullptr;
    const int32_t * pairs = nullptr;
    // One token's experts (decode): tile i is pair i alone, of expert pair_experts[i] (skipped outside [0, n_expert)),
    // so no plan kernel runs between the router and the products.
    const int32_t * pair_experts = nullptr;
    int n_expert = 0;
    int src_div = 1;
    bool glu = false;  // y = swiglu(w·x, w_up·x, limit)
    float limit = 0;
    int split = 1;  // set by matvec(): warps that share one row group, each over a slice of K
    // Quantized activations from matvec_quantize (row src·groups + group), per activation kind: [0] Q8A, [1] Q8_K.
    // Needed by every quantized weight type (matvec_needs_quantized); float weights read x.
    const uint8_t * xq[2] = {nullptr, nullptr};
    const uint16_t * x_f16 = nullptr;  // gemm only: the activations as f16 bits, same layout as x
    // One token's large Q8_0 and F16 products may take the ring kernel (matvec.cu), whose blocks fill the
    // multiprocessors' shared memory and read weights before the PDL wait. The backend allows it (ring_allowed)
    // unless DSV4_CUDA_RING=0, never beside a branch, whose kernels would then wait for them, nor before the
    // weights it uploaded have landed.
    bool ring = false;
};
// max_tiles: the grid's tile count (plain: ceil(n / tile)); tile_tokens: tokens per tile (1..kMaxTileTokens).
// Targets of several weight types run in one launch when the kernel for that mix exists (Q8_0 with F16: the
// dense and control matrices of the quantized files), else in one launch per type.
void matvec(const MatvecArgs & a, int64_t max_tiles, int tile_tokens, cudaStream_t s);
// Whether a product of this weight type reads pre-quantized activations (xq: every quantized type), and of which
// kind (0: Q8A, 1: Q8_K).
bool matvec_needs_quantized(GgmlType w);
int matvec_act_kind(GgmlType w);
// Activations to quantize for products of weight type w: the n·groups rows (token t, group g: x[t·x_stride + g·k ..],
// or swiglu of x and x_up there), written to dst as matvec_act_bytes(w, k, n·groups) bytes.
struct QuantizeJob {
    GgmlType w = GgmlType::F32;
    const float * x = nullptr;
    const float * x_up = nullptr;
    float x_limit = 0;
    int64_t x_stride = 0, n = 0;
    int groups = 1;
    int64_t k = 0;
    uint8_t * dst = nullptr;
};
constexpr int kMaxQuantizeJobs = 2;
int64_t matvec_act_bytes(GgmlType w, int64_t k, int64_t rows);
// Jobs of float weight types are skipped; kMaxQuantizeJobs jobs share one launch (an FFN's input quantized for
// the shared expert's Q8_0 rows and the routed experts' K-quant rows at once).
void matvec_quantize(const QuantizeJob * jobs, int n_jobs, cudaStream_t s);
// The tile size matvec picks for n tokens of a product (expert products use it to build their tiles).
int matvec_tile_tokens(GgmlType w, int64_t k, int64_t n);

// Tensor-core products (gemm.cu) for prefill: the same arguments as matvec (targets, groups, expert tiles, glu,
// add; split and xq unused), weights decoded to f16 tiles, f32 accumulation. The activations come rounded to
// f16 in x_f16 (gemm_activations: rows × x_stride values, SwiGLU of x and x_up applied). Tiles hold
// tile_tokens = gemm_tile_tokens(tokens per weight matrix, type) tokens (the smallest over a launch's weight types;
// expert products plan their tiles with it): 128, or 64 where the tokens of a matrix (an expert's pairs on
// average) would leave 128-token tiles mostly empty or where the type's 128-token tiles do not fit the device.
int gemm_tile_tokens(int64_t tokens_per_matrix, GgmlType w);
// Below this many tokens a product stays on matvec: a 64-token tile would be mostly empty.
constexpr int kGemmMinTokens = 32;
bool gemm_supported(GgmlType w, int64_t k);  // every type but F32, K a multiple of 64, tiles fit shared memory
bool gemm_inputs_aligned(const MatvecArgs & a);
// rows × width activations, x_stride floats between rows (and between x_up's), to dense f16 rows.
void gemm_activations(const float * x, const float * x_up, float limit, int64_t rows, int64_t width, int64_t x_stride,
                      uint16_t * dst, cudaStream_t s);
void gemm(const MatvecArgs & a, int64_t max_tiles, int tile_tokens, cudaStream_t s);
// Products on cuBLAS (backend_cuda.cpp) read weights as f16 rows [rows][K] holding the values the tiles decode
// (every gemm type): n_blocks blocks, block b rows [first + b·rows, first + (b + 1)·rows) of w, followed by the same
// rows of w2 when given (the routed experts' gate and up, one [2·rows][K] matrix an expert); fewer than 2^31 rows.
bool weights_f16_supported(GgmlType w, int64_t k);
void weights_f16(const WeightRef & w, const WeightRef * w2, int64_t first, int64_t rows, int64_t n_blocks,
                 uint16_t * dst, cudaStream_t s);

// Groups the n·k (token, slot) pairs by expert: pairs (sorted pair ids), tiles of up to tile_tokens pairs of one
// expert ({expert, first, count}), n_tiles. Pairs with an expert id outside [0, E) are dropped.
void moe_plan(const int32_t * experts, int64_t n_pairs, int64_t n_expert, int tile_tokens, int32_t * pairs,
              int32_t * tiles, int32_t * n_tiles, cudaStream_t s);
// out[t] = Σ_j weights[t,j]·ybuf[row_of[t·k + j]] (row_of null: row t·k + j) over the slots with a valid expert
// id (+ add[t] when add is given).
void moe_combine(const float * ybuf, const int32_t * row_of, const int32_t * experts, const float * weights, int64_t n,
                 int64_t k, int64_t n_expert, int64_t width, const float * add, float * out, cudaStream_t s);
// The routed pairs' activations for dense products: for the j < n_rows sorted pairs p = pairs[j], row r = j +
// row_base[experts[p]] of dst is f16(x[p / src_div]) (x: rows of width values), and row_of[p] = r.
void moe_gather_f16(const float * x, int64_t width, const int32_t * pairs, int src_div, const int32_t * experts,
                    const int32_t * row_base, int64_t n_rows, uint16_t * dst, int32_t * row_of, cudaStream_t s);
// A decode step's FFN sublayer parts for moe_ffn (ds4's q2 mix: IQ2_XXS gate/up, Q2_K down, Q8_0 shared expert; the
// widths' activation rows must fit a block's shared memory). moe_shared: the routed gate/up products (`routed`: one
// glu target over `pairs` pairs, pair_experts and n_expert set, its input quantized in xq) and the shared expert's
// down projection of each of shared.n tokens (`shared`: one target, no xq: x and x_up are the shared expert's gate
// and up rows and x_limit its SwiGLU limit, quantized by each block in shared memory) in one launch. moe_down: the
// routed down products (pair_experts set, no xq), each block quantizing its pair's hidden row x itself.
bool moe_ffn_fused_supported(GgmlType gate, GgmlType down, GgmlType shared_down, int64_t inner, int64_t shared_inner);
void moe_shared(MatvecArgs routed, int pairs, MatvecArgs shared, cudaStream_t s);
void moe_down(MatvecArgs a, int pairs, cudaStream_t s);

// ---------------------------------------------------------------------------------------------------------------------
// Element-wise and per-row ops (misc.cu)
// ---------------------------------------------------------------------------------------------------------------------
void fill_f32(float * dst, int64_t n, float value, cudaStream_t s);
void get_rows(const WeightRef & table, const int32_t * ids, int64_t n, float * out, cudaStream_t s);
void rms_norm(const float * x, const float * gamma, float * y, int64_t rows, int64_t width, float eps, cudaStream_t s);
// x [n, heads, width]: rotates the last n_rot channels of every head by positions[t] (or its negative).
void rope(float * x, int64_t n, int64_t heads, int64_t width, const float * inv_freq, int n_rot,
          const int32_t * positions, bool inverse, cudaStream_t s);
// Per head row of each target's x [n, heads, width], in place: RMSNorm (· gamma), RoPE of the last n_rot channels
// by positions[t], FP8 round trip of [0, fp8_dims), and a copy of token t's rows into ring slot positions[t] mod
// ring_rows (ring [ring_rows, heads·width], when given). The targets' rows run in one launch.
struct NormRopeRows {
    float * x = nullptr;
    const float * gamma = nullptr;  // [width] or null
    int64_t heads = 0, width = 0;
    int64_t fp8_dims = 0;
    float * ring = nullptr;
    int64_t ring_rows = 0;
};
constexpr int kMaxNormRopeTargets = 2;
struct NormRopeArgs {
    NormRopeRows t[kMaxNormRopeTargets];
    int n_targets = 0;
    float eps = 0;
    int64_t n = 0;
    const float * inv_freq = nullptr;
    int n_rot = 0;
    const int32_t * positions = nullptr;
};
void norm_rope(const NormRopeArgs & a, cudaStream_t s);
void add(const float * a, const float * b, float * out, int64_t n, cudaStream_t s);
void swiglu(const float * gate, const float * up, float * out, int64_t n, float limit, cudaStream_t s);
void fp8_roundtrip(float * x, int64_t rows, int64_t width, int64_t n_dims, cudaStream_t s);
void hadamard_fp4_roundtrip(float * x, int64_t rows, int64_t width, cudaStream_t s);

void hc_expand(const float * x, float * streams, int64_t n, int64_t hc, int64_t width, cudaStream_t s);
// The mixing weights of HCPre (n_mix = (2+hc)·hc) or the head (n_mix = hc): partial sums over chunks of the
// hc·D stream row, then one block per token finishes (Sinkhorn for HCPre) and writes the weighted stream sum.
struct HcArgs {
    float * streams = nullptr;      // [n, hc, D]; written first when post_streams is given
    WeightRef fn;                   // [hc·D, n_mix]
    const float * scale = nullptr;  // [3] (pre) or [1] (head)
    const float * base = nullptr;   // [n_mix]
    int64_t n = 0, hc = 0, width = 0;
    int iters = 0;
    float eps_hc = 0, eps_norm = 0;
    bool head = false;
    bool tensor_cores = false;     // prefill partial sums of an F16 mixing matrix on the tensor cores
    const float * norm = nullptr;  // [D]: y is RMS-normed (eps_norm) and scaled by it, when given (pre only)
    float * y = nullptr;           // [n, D]
    float * post = nullptr;        // [n, hc] (pre)
    float * comb = nullptr;        // [n, hc, hc] (pre)
    float * partial = nullptr;     // scratch: hc_partial_floats(n, hc, D, n_mix)
    // The previous sublayer's HCPost, fused (hc_post_pre): streams = post·o + combᵀ·post_streams per token, with
    // post and comb read before they are overwritten.
    const float * post_streams = nullptr;  // [n, hc, D]
    const float * post_o = nullptr;        // [n, D]
    unsigned * done = nullptr;             // [kHcRowsTokens], zero between launches: the decode kernel's counters
    // The hc_sinkhorn launches completed since the last reset (see hc_mix_clusters; the host resets it before a
    // boundary with nothing in flight): a decode cluster kernel with sinkhorns_wait > 0 polls until that many have
    // completed before its HCPost reads comb.
    unsigned * sinkhorns = nullptr;
    unsigned sinkhorns_wait = 0;
};
// Mixing weights per token (HCPre: (2+hc)·hc; head: hc); hc_mix handles up to kHcMaxMix and hc <= 16. Fewer than
// kHcRowsTokens tokens take the one-kernel decode path.
constexpr int64_t kHcMaxMix = 48;
constexpr int kHcRowsTokens = 16;
int64_t hc_n_mix(int64_t hc, bool head);
int64_t hc_partial_floats(int64_t n, int64_t hc, int64_t width, int64_t n_mix);
void hc_mix(const HcArgs & a, cudaStream_t s);
// Whether hc_mix runs a's mixing as the decode cluster kernel. For HCPre (not the head) that kernel leaves comb
// holding Sinkhorn's input, the logits: hc_sinkhorn must follow, on any stream. The 20 dependent rounds were the
// kernel's tail (~2.5 µs a boundary, every later kernel waiting); on a second stream they run beside the next
// sublayer, and the next cluster kernel polls a.sinkhorns (done long before) instead of waiting for a graph edge,
// which would cost its early launch. A count, not a flag: a flag cleared by one token's cluster could be read
// after that by a later-scheduled cluster of the same launch.
bool hc_mix_clusters(const HcArgs & a);
// comb [n, 4, 4] (hc = 4, n < kHcRowsTokens) from logits to the doubly stochastic matrix, in place; then adds one
// to *count (release).
void hc_sinkhorn(float * comb, int64_t n, int iters, float eps, unsigned * count, cudaStream_t s);
void hc_post(const float * streams, const float * o, const float * post, const float * comb, float * out, int64_t n,
             int64_t hc, int64_t width, cudaStream_t s);

// Backend::logit_candidates: ids and values [rows, k], stats [rows, 4]; scratch of logit_candidates_scratch(rows)
// bytes. The kernels compile as C++17 and cannot include backend.h: its bin constants are repeated here
// (backend_cuda.cpp checks they agree).
constexpr int kCandidateBinsPerNat = 32, kCandidateBins = 1024;
size_t logit_candidates_scratch(int64_t rows);
void logit_candidates(const float * logits, int64_t rows, int64_t n_vocab, int64_t k, int32_t * ids, float * values,
                      float * stats, void * scratch, cudaStream_t s);
// Top-k (or hash) routing of n tokens: k <= 32 choices of n_expert <= kRouterMaxExperts (a lane's share of the
// scores stays in registers).
constexpr int kRouterMaxExperts = 1024;
void router(const float * logits, const float * bias, const int32_t * tid2eid, const int32_t * tokens, int64_t n,
            int64_t n_expert, int64_t k, float route_scale, int32_t * experts, float * weights, cudaStream_t s);

// ---------------------------------------------------------------------------------------------------------------------
// Attention, compressor, indexer (attention.cu)
// ---------------------------------------------------------------------------------------------------------------------
void store_rows(float * ring, int64_t ring_rows, const float * rows, int64_t n, int64_t width,
                const int32_t * positions, cudaStream_t s);

struct CompressorArgs {
    const float * kv = nullptr;     // [n, wide]
    const float * score = nullptr;  // [n, wide]
    WeightRef ape;                  // [wide, R]
    float * state_kv = nullptr;     // [c·R, wide]
    float * state_score = nullptr;
    const int32_t * positions = nullptr;
    int64_t n = 0, ratio = 0, wide = 0;
    bool overlap = false;
    const float * norm = nullptr;  // [width]
    float eps = 0;
    const float * inv_freq = nullptr;
    int n_rot = 0;
    int rounding = 0;  // 0 none, 1 fp8, 2 hadamard + fp4
    int64_t fp8_dims = 0;
    void * store = nullptr;  // [capacity, width], f32 or (store_bf16) BF16
    bool store_bf16 = false;
    int64_t capacity = 0;
};
void compressor_update(const CompressorArgs & a, cudaStream_t s);

struct IndexerArgs {
    const float * q = nullptr;     // [n, H, d]
    const float * w = nullptr;     // [n, H]
    const void * keys = nullptr;   // [capacity, d], f32 or (keys_bf16) BF16
    bool keys_bf16 = false;
    const int32_t * positions = nullptr;
    int64_t n = 0, heads = 0, dim = 0, capacity = 0, ratio = 0, top_k = 0;
    float key_scale = 0;
    int32_t * selected = nullptr;  // [n, top_k]
    float * scores = nullptr;      // scratch of indexer_scratch_bytes: [n, capacity], then the split top-k's candidates
    float * cand_scores = nullptr;  // set by indexer_select
    int32_t * cand_rows = nullptr;
    bool tensor_cores = false;  // score on the tensor cores: f16 queries and keys, bf16 for BF16 keys
};
size_t indexer_scratch_bytes(int64_t n, int64_t capacity, int64_t top_k);
void indexer_select(IndexerArgs a, cudaStream_t s);

struct AttentionArgs {
    const float * q = nullptr;    // [n, H, d]
    const float * raw = nullptr;  // [ring, d]
    int64_t ring = 0;
    const int32_t * positions = nullptr;
    int64_t window = 0;
    const float * comp = nullptr;  // [capacity, d] or null
    int64_t comp_capacity = 0, ratio = 0;
    const int32_t * selected = nullptr;  // [n, top_k] or null
    int64_t top_k = 0;
    const float * sinks = nullptr;  // [H]
    float scale = 0;
    int64_t n = 0, heads = 0, dim = 0;
    float * out = nullptr;      // [n, H, d]
    // When n_rot > 0, each head's output is turned back by its query's angle as rope_kernel (inverse) would: the
    // last n_rot channels, pair i at frequency out_inv_freq[i].
    const float * out_inv_freq = nullptr;
    int out_n_rot = 0;
    float * partial = nullptr;  // scratch: attention_partial_floats(...)
    bool tensor_cores = false;  // prefill on the tensor cores (f16 queries, keys and probabilities) where it applies
};
// Whether attention over n tokens of head width dim, each with up to `keys` keys (the window plus the selected or
// stored compressed rows), runs on the tensor cores (when a.tensor_cores is set).
bool attention_tensor_cores(int64_t dim, int64_t n, int64_t keys);
// Key splits the launch uses and the scratch floats they need.
int attention_splits(const AttentionArgs & a);
int64_t attention_partial_floats(const AttentionArgs & a);
void attention(const AttentionArgs & a, cudaStream_t s);

}  // namespace dsv4::cuda
