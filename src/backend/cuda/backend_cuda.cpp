// The CUDA backend's host side: device memory, the weight upload (pinned staging, re-layout of quantized
// blocks), the scratch arena, CUDA graphs for run_captured, and the translation of each op into kernel
// launches (kernels.h). All work is ordered on one stream; only write(), read() and synchronize() wait.
#include "backend/cuda.h"
#include "backend/cuda/kernels.h"
// The IQ2_XXS grid and signs are format constants defined once in format/quant_tables.cpp.
#include "format/quant_impl.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"
#include "util/thread_pool.h"
#include "util/timer.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>
#include <unordered_map>

namespace dsv4 {

namespace {

void check(cudaError_t e, const char * what) {
    if (e != cudaSuccess) fail("cuda: {} failed: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

bool is_float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

// indexer_select scores a group of tokens at a time over every stored row: groups bound the scratch at long contexts.
int64_t indexer_group(int64_t n, int64_t capacity) {
    return std::clamp<int64_t>((int64_t(256) << 20) / 4 / std::max<int64_t>(capacity, 1), 1, std::max<int64_t>(n, 1));
}
// Its scratch for n tokens: a full group's, or the last group's (up to 8 tokens split their top-k where a full group
// may not).
size_t indexer_op_scratch(int64_t n, int64_t capacity, int64_t top_k) {
    const int64_t group = indexer_group(n, capacity);
    return std::max(cuda::indexer_scratch_bytes(group, capacity, top_k),
                    cuda::indexer_scratch_bytes(n % group, capacity, top_k));
}

class CudaBackend;

class DeviceBuffer final : public BackendBuffer {
  public:
    DeviceBuffer(CudaBackend * owner, void * ptr, size_t size) : owner_(owner), ptr_(ptr), size_(size) {}
    ~DeviceBuffer() override;
    void * data() override { return ptr_; }
    size_t size() const override { return size_; }

  private:
    CudaBackend * owner_;
    void * ptr_;
    size_t size_;
};

static_assert(cuda::kCandidateBins == kCandidateBins && cuda::kCandidateBinsPerNat == kCandidateBinsPerNat);

// Dense products on cuBLAS (CudaBackend::dense_on_cublas): from this many tokens, and for weights of at most this
// many values when they must be decoded to f16 first (a decoded copy lives in the scratch arena: 64 MB for V4
// Flash's q_b, wo_a and wo_b; the output head, 1 GB as f16, stays on the tiles).
constexpr int64_t kCublasMinTokens = 1024;
constexpr int64_t kCublasMaxWeight = int64_t(64) << 20;
// A prefill chunk's routed experts on cuBLAS (CudaBackend::moe_cublas): from this many pairs an expert on average
// (a chunk of 10923 tokens of V4 Flash: at 192, a chunk of 8192, the synthetic files' top-k layers measured 5 %
// slower than on the tiles; docs/cuda-journal.md, "Session 31"), their f16 weights decoded into two buffers of this
// many bytes (16 experts' gate and up of V4 Flash each).
constexpr int64_t kMoeCublasMinPairs = 256;
constexpr int64_t kMoeCublasWeightBytes = int64_t(512) << 20;
// FFN sublayers of up to this many tokens (a batch of decode steps) run moe_ffn's fused path, a one-token product
// per (token, expert) pair; larger ones group the pairs by expert (the composition).
constexpr int64_t kFusedFfnTokens = 16;
// Steps of up to this many tokens run a model's branches (Backend::begin_branch) beside the main chain: decode, where
// the chain's small kernels leave most of the GPU idle. Larger steps fill it by themselves.
constexpr int64_t kBranchMaxTokens = 8;
// A batched step's lanes (Backend::begin_lanes) run on this many streams, each with its own scratch arena; more lanes
// share them in turn.
constexpr int kMaxLanes = 16;
// The routed experts on cuBLAS are asked for (DSV4_CUDA_MOE_CUBLAS=1) and cuBLAS is not turned off.
bool moe_cublas_requested() {
    return cuda::env_switch("DSV4_CUDA_CUBLAS", true) && cuda::env_switch("DSV4_CUDA_MOE_CUBLAS", false);
}
// Arena offsets stay 256-byte aligned (cuBLAS's and the vector loads' alignment).
size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }
// What moe_cublas takes of the arena for a chunk of n_pairs pairs, in bytes, in the order it lays them out: the
// products' pointers (A, B, C for every slot of both passes), the sorted pairs, each pair's row, the plan (one
// tile an expert: {expert, first, count}, then the count of tiles) and each expert's row base; f16 rows
// [max_rows, max(D, I)] (the gathered inputs, then the hidden rows) and f32 rows [max_rows, max(2I, D)] (gate | up,
// then the experts' outputs); one of the two buffers of decoded experts. An expert's rows fill slots of 1.25 times
// the mean pairs an expert (rounded up to 32), the last one partly: at most 2.25 times the pairs plus 32 rows an
// expert, in at most one slot an expert plus one a 32 pairs.
struct MoeCublasScratch {
    int64_t max_rows, max_slots;
    size_t ptrs, ints, rows16, rows32, weights;
    size_t total() const { return ptrs + ints + rows16 + rows32 + 2 * weights; }
};
MoeCublasScratch moe_cublas_scratch(int64_t n_pairs, int64_t n_expert, int64_t dim, int64_t inner, int64_t batch) {
    MoeCublasScratch s;
    s.max_rows = 2 * n_pairs + n_pairs / 4 + 32 * n_expert;
    s.max_slots = n_expert + n_pairs / 32;
    s.ptrs = round_up(size_t(6 * s.max_slots) * sizeof(void *));
    s.ints = round_up(size_t(2 * n_pairs + 4 * n_expert + 1) * sizeof(int32_t));
    s.rows16 = round_up(size_t(s.max_rows * std::max(dim, inner)) * 2);
    s.rows32 = round_up(size_t(s.max_rows * std::max(2 * inner, dim)) * sizeof(float));
    s.weights = size_t(batch * 4 * inner * dim);
    return s;
}

// Pinned host staging for uploads: two slots, so the copy of one chunk into a slot overlaps the transfer of the
// other. Quantized blocks land in a device staging slot and are re-laid from there.
constexpr size_t kStageBytes = size_t(64) << 20;

class CudaBackend final : public Backend {
  public:
    explicit CudaBackend(const CudaBackendOptions & o)
        : dev_(o.device), graphs_enabled_(o.graphs), tensor_cores_(o.tensor_cores) {
        int count = 0;
        check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
        DSV4_CHECK(dev_ >= 0 && dev_ < count, "cuda: device {} does not exist ({} device(s))", dev_, count);
        check(cudaSetDevice(dev_), "cudaSetDevice");
        cudaDeviceProp prop;
        check(cudaGetDeviceProperties(&prop, dev_), "cudaGetDeviceProperties");
        name_ = fmt::format("cuda ({}, sm_{}{}, {:.0f} GiB)", prop.name, prop.major, prop.minor,
                            double(prop.totalGlobalMem) / double(1ull << 30));
        check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
        check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate(side)");
        check(cudaEventCreateWithFlags(&side_fork_, cudaEventDisableTiming), "cudaEventCreate(side)");
        check(cudaEventCreateWithFlags(&side_done_, cudaEventDisableTiming), "cudaEventCreate(side)");
        // The branch's kernels take precedence: when a product's blocks fill the machine, the multiprocessors they
        // free go to the branch's chain first (at the default priority the 8-layer decode step at 32K was 9 µs
        // slower: docs/cuda-journal.md, "Session 40").
        int least = 0, greatest = 0;
        check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
        check(cudaStreamCreateWithPriority(&branch_, cudaStreamNonBlocking, greatest), "cudaStreamCreate(branch)");
        check(cudaEventCreateWithFlags(&branch_fork_, cudaEventDisableTiming), "cudaEventCreate(branch)");
        check(cudaEventCreateWithFlags(&branch_done_, cudaEventDisableTiming), "cudaEventCreate(branch)");
        branches_enabled_ = cuda::env_switch("DSV4_CUDA_BRANCH", true);
        // Lanes are latency-bound chains like the branch: the same precedence.
        for (int i = 0; i < kMaxLanes; ++i) {
            check(cudaStreamCreateWithPriority(&lanes_[i], cudaStreamNonBlocking, greatest), "cudaStreamCreate(lane)");
            check(cudaEventCreateWithFlags(&lane_done_[i], cudaEventDisableTiming), "cudaEventCreate(lane)");
        }
        check(cudaEventCreateWithFlags(&lane_fork_, cudaEventDisableTiming), "cudaEventCreate(lane)");
        lanes_enabled_ = cuda::env_switch("DSV4_CUDA_LANES", true);
        ring_enabled_ = cuda::env_switch("DSV4_CUDA_RING", true);
        for (int i = 0; i < 2; ++i) {
            check(cudaEventCreateWithFlags(&moe_decoded_[i], cudaEventDisableTiming), "cudaEventCreate(moe)");
            check(cudaEventCreateWithFlags(&moe_read_[i], cudaEventDisableTiming), "cudaEventCreate(moe)");
        }
        release_host_pages_ = o.release_host_pages || prop.integrated;
        if (prop.integrated)
            log_info(
                "cuda: {} is an integrated GPU (memory shared with the CPU): weight pages of the model file are "
                "released from the page cache as they are copied, so the weights are held once",
                prop.name);
        integrated_ = prop.integrated;
        upload_threads_ = std::clamp(int(std::thread::hardware_concurrency()), 1, 8);
        if (const char * env = std::getenv("DSV4_CUDA_UPLOAD_THREADS"))
            upload_threads_ = std::clamp(std::atoi(env), 1, 64);
        graphs_enabled_ = cuda::env_switch("DSV4_CUDA_GRAPHS", graphs_enabled_);
        profile_ = cuda::env_switch("DSV4_CUDA_PROFILE", false);
        cublas_enabled_ = cuda::env_switch("DSV4_CUDA_CUBLAS", true);
        moe_cublas_enabled_ = moe_cublas_requested();
        if (const char * env = std::getenv("DSV4_CUDA_CUBLAS_MIN_TOKENS"))
            cublas_min_tokens_ = std::max<int64_t>(1, std::atoll(env));
        if (const char * env = std::getenv("DSV4_CUDA_MOE_CUBLAS_MIN_PAIRS"))
            moe_cublas_min_pairs_ = std::max<int64_t>(1, std::atoll(env));
        if (const char * env = std::getenv("DSV4_CUDA_MOE_CUBLAS_BATCH"))
            moe_cublas_batch_ = std::max<int64_t>(1, std::atoll(env));
        if (profile_) graphs_enabled_ = false;  // op timings need eager launches

        cuda::Iq2Tables t{};
        for (int k = 0; k < 256; ++k)
            for (int e = 0; e < 8; ++e) t.sel[k] |= uint32_t((quant_detail::kIq2.levels[k] >> (2 * e)) & 3) << (4 * e);
        check(cudaMalloc(&iq2_, sizeof t), "cudaMalloc(iq2 tables)");
        check(cudaMemcpy(iq2_, &t, sizeof t, cudaMemcpyHostToDevice), "cudaMemcpy(iq2 tables)");
        check(cudaMalloc(&hc_done_, (cuda::kHcRowsTokens + 1) * sizeof(unsigned)), "cudaMalloc(hc counters)");
        check(cudaMemsetAsync(hc_done_, 0, (cuda::kHcRowsTokens + 1) * sizeof(unsigned), stream_),
              "cudaMemset(hc counters)");
        sinkhorns_ = hc_done_ + cuda::kHcRowsTokens;
        check(cudaMalloc(&upload_fence_, sizeof(unsigned)), "cudaMalloc(upload fence)");
    }

    ~CudaBackend() override {
        cudaSetDevice(dev_);
        join_side();
        cudaStreamSynchronize(stream_);
        if (profile_) print_profile();
        drop_graphs();
        for (int i = 0; i < 2; ++i) {
            if (pinned_[i]) cudaFreeHost(pinned_[i]);
            if (dev_stage_[i]) cudaFree(dev_stage_[i]);
            if (staged_[i]) cudaEventDestroy(staged_[i]);
        }
        if (io_pinned_) cudaFreeHost(io_pinned_);
        for (cudaEvent_t e : io_done_)
            if (e) cudaEventDestroy(e);
        for (Arena & a : arenas_)
            if (a.data) cudaFree(a.data);
        for (Arena & a : lane_arenas_)
            if (a.data) cudaFree(a.data);
        if (cublas_) cublasDestroy(cublas_);
        cudaFree(iq2_);
        cudaFree(hc_done_);
        cudaFree(upload_fence_);
        cudaEventDestroy(side_fork_);
        cudaEventDestroy(side_done_);
        cudaEventDestroy(branch_fork_);
        cudaEventDestroy(branch_done_);
        for (int i = 0; i < 2; ++i) {
            cudaEventDestroy(moe_decoded_[i]);
            cudaEventDestroy(moe_read_[i]);
        }
        for (int i = 0; i < kMaxLanes; ++i) {
            cudaEventDestroy(lane_done_[i]);
            cudaStreamDestroy(lanes_[i]);
        }
        cudaEventDestroy(lane_fork_);
        cudaStreamDestroy(side_);
        cudaStreamDestroy(branch_);
        cudaStreamDestroy(stream_);
        if (uploaded_ > 0)
            log_info("cuda: uploaded {:.2f} GB of weights in {:.1f} s ({:.2f} GB/s)", double(uploaded_) / 1e9,
                     upload_seconds_, double(uploaded_) / 1e9 / std::max(upload_seconds_, 1e-9));
    }

    std::string name() const override { return name_; }

    // ---- memory ----------------------------------------------------------------------------------------------
    std::unique_ptr<BackendBuffer> alloc(size_t bytes) override {
        bind();
        void * p = nullptr;
        const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 256));
        if (e != cudaSuccess) {
            cudaGetLastError();
            const CudaMemoryInfo m = cuda_memory_info(dev_);
            fail("cuda: cannot allocate {:.3f} GB on device {} ({:.3f} GB free of {:.3f} GB): {}", double(bytes) / 1e9,
                 dev_, double(m.free_bytes) / 1e9, double(m.total_bytes) / 1e9, cudaGetErrorString(e));
        }
        held(int64_t(std::max<size_t>(bytes, 256)));
        return std::make_unique<DeviceBuffer>(this, p, std::max<size_t>(bytes, 256));
    }

    Tensor upload_weight(const Tensor & host, std::unique_ptr<BackendBuffer> * storage) override {
        bind();
        const Timer timer;
        const size_t bytes = host.n_bytes();
        *storage = alloc(bytes);
        Tensor t = host;
        t.data = (*storage)->data();
        const cuda::BlockSplit sp = cuda::block_split(host.type);
        const size_t chunk =
            sp.payload_bytes ? kStageBytes / size_t(sp.block_bytes) * size_t(sp.block_bytes) : kStageBytes;
        const int64_t total_blocks = sp.payload_bytes ? int64_t(bytes / size_t(sp.block_bytes)) : 0;
        for (size_t off = 0; off < bytes; off += chunk) {
            const size_t n = std::min(chunk, bytes - off);
            const int slot = stage_next_;
            stage_next_ ^= 1;
            uint8_t * pinned = stage_slot(slot);
            check(cudaEventSynchronize(staged_[slot]), "cudaEventSynchronize(staging)");
            const uint8_t * src = static_cast<const uint8_t *>(host.data) + off;
            copy_to_staging(pinned, src, n);
            if (release_host_pages_) release_pages(src, n);
            if (sp.payload_bytes) {
                check(cudaMemcpyAsync(dev_stage_[slot], pinned, n, cudaMemcpyHostToDevice, stream_), "upload");
                cuda::repack_blocks(host.type, dev_stage_[slot], static_cast<uint8_t *>(t.data),
                                    int64_t(off / size_t(sp.block_bytes)), int64_t(n / size_t(sp.block_bytes)),
                                    total_blocks, stream_);
                check(cudaGetLastError(), "repack_blocks");
            } else {
                check(cudaMemcpyAsync(static_cast<uint8_t *>(t.data) + off, pinned, n, cudaMemcpyHostToDevice, stream_),
                      "upload");
            }
            check(cudaEventRecord(staged_[slot], stream_), "cudaEventRecord");
        }
        // The repack kernel lets the kernels after it launch early, and kernels may read weights before their PDL
        // wait (the ring's bulk copies do): they would read this weight while the repack still wrote it (session
        // 50's race). A memset is no kernel, so the next kernel cannot overlap it, and it starts only once the
        // repack has completed.
        if (sp.payload_bytes) check(cudaMemsetAsync(upload_fence_, 0, sizeof(unsigned), stream_), "upload fence");
        uploaded_ += bytes;
        upload_seconds_ += timer.seconds();
        if (uploaded_ / (size_t(8) << 30) != (uploaded_ - bytes) / (size_t(8) << 30))
            log_info("cuda: {:.1f} GB of weights uploaded ({:.2f} GB/s)", double(uploaded_) / 1e9,
                     double(uploaded_) / 1e9 / std::max(upload_seconds_, 1e-9));
        return t;
    }

    void write(const Tensor & dst, const void * host, size_t bytes, size_t offset) override {
        bind();
        DSV4_CHECK(!capturing_, "cuda: write() inside a captured sequence");
        join_side();
        if (bytes <= kIoSlotBytes) {
            // Through a pinned slot, without waiting: the bytes are ours once copied there, and the stream orders
            // the transfer before any kernel that reads them. The slot's previous transfer has long finished.
            const int slot = io_next_;
            io_next_ = (io_next_ + 1) % kIoSlots;
            uint8_t * pinned = io_slot(slot);
            check(cudaEventSynchronize(io_done_[slot]), "write (pinned slot)");
            std::memcpy(pinned, host, bytes);
            check(cudaMemcpyAsync(static_cast<uint8_t *>(dst.data) + offset, pinned, bytes, cudaMemcpyHostToDevice,
                                  stream_),
                  "write");
            check(cudaEventRecord(io_done_[slot], stream_), "write (event)");
            return;
        }
        check(cudaMemcpyAsync(static_cast<uint8_t *>(dst.data) + offset, host, bytes, cudaMemcpyHostToDevice, stream_),
              "write");
        check(cudaStreamSynchronize(stream_), "write (synchronize)");
    }
    void read(const Tensor & src, void * host, size_t bytes, size_t offset) override {
        bind();
        DSV4_CHECK(!capturing_, "cuda: read() inside a captured sequence");
        join_side();
        // Small reads (the sampler's candidates) land in a pinned slot: the copy goes straight to host memory
        // instead of through the driver's staging buffer. A pending write from the same slot is earlier in the
        // stream, so it has read the slot before this copy fills it.
        uint8_t * pinned = bytes <= kIoSlotBytes ? io_slot(io_next_) : nullptr;
        check(cudaMemcpyAsync(pinned ? pinned : host, static_cast<const uint8_t *>(src.data) + offset, bytes,
                              cudaMemcpyDeviceToHost, stream_),
              "read");
        check(cudaStreamSynchronize(stream_), "read (synchronize)");
        if (pinned) std::memcpy(host, pinned, bytes);
        if (profile_) collect_timings();
    }
    void copy(const Tensor & dst, const Tensor & src, size_t bytes, size_t dst_offset, size_t src_offset) override {
        join_side();
        check(cudaMemcpyAsync(static_cast<uint8_t *>(dst.data) + dst_offset,
                              static_cast<const uint8_t *>(src.data) + src_offset, bytes, cudaMemcpyDeviceToDevice,
                              stream_),
              "copy");
    }
    void fill(const Tensor & dst, float value) override {
        join_side();
        cuda::fill_f32(dst.f32(), dst.n_elements(), value, stream_);
        launched("fill");
    }
    void synchronize() override {
        bind();
        join_side();
        check(cudaStreamSynchronize(stream_), "synchronize");
    }

    // The first call of a key runs eagerly (it sizes the scratch arena); the second captures the sequence into a
    // graph; later calls replay it. Freeing any buffer or growing the scratch drops every graph.
    void run_captured(uint64_t key, const std::function<void()> & ops) override {
        bind();
        if (!graphs_enabled_) return ops();
        auto it = graphs_.find(key);
        if (it == graphs_.end()) {
            // Batched steps are keyed by their set of states: a server whose streams come and go makes new sets, and
            // old sets rarely return. Past the cap every graph goes (each costs one eager step and one capture again).
            if (graphs_.size() >= kMaxGraphs) drop_graphs();
            graphs_.emplace(key, nullptr);
            return ops();
        }
        if (!it->second) {
            join_side();  // the capture must not wait on work recorded before it began
            check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), "cudaStreamBeginCapture");
            capturing_ = true;
            cudaGraph_t graph = nullptr;
            try {
                ops();
                join_side();  // a capture ends on its origin stream with every fork joined
            } catch (...) {
                capturing_ = false;
                cudaStreamEndCapture(stream_, &graph);
                if (graph) cudaGraphDestroy(graph);
                cudaGetLastError();
                throw;
            }
            capturing_ = false;
            check(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture");
            cudaGraphExec_t exec = nullptr;
            // The branch's launches carry their stream's priority (cuda::launch); a graph ignores it without this flag.
            const cudaError_t e = cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
            cudaGraphDestroy(graph);
            check(e, "cudaGraphInstantiate");
            it = graphs_.find(key);  // ops() may have dropped the graphs (buffers freed); re-insert
            if (it == graphs_.end()) it = graphs_.emplace(key, nullptr).first;
            it->second = exec;
        }
        check(cudaGraphLaunch(it->second, stream_), "cudaGraphLaunch");
    }

    // Steps of up to kBranchMaxTokens tokens run a branch on branch_, a stream of the highest priority, forked from
    // stream_ and joined back by an event; stream_ names the branch's stream while its ops are issued, so every op
    // launches where it is issued, and takes the branch's own scratch arena there. DSV4_CUDA_BRANCH=0 runs branches
    // in order.
    void begin_branch(int64_t n_tokens) override {
        DSV4_CHECK(!in_branch_ && origin_ == nullptr, "cuda: a branch began inside another");
        DSV4_CHECK(!in_lanes_, "cuda: a branch began inside lanes");
        in_branch_ = true;
        if (!branches_enabled_ || n_tokens > kBranchMaxTokens) return;
        check(cudaEventRecord(branch_fork_, stream_), "cudaEventRecord(branch)");
        check(cudaStreamWaitEvent(branch_, branch_fork_), "cudaStreamWaitEvent(branch)");
        origin_ = stream_;
        stream_ = branch_;
    }
    void end_branch() override {
        DSV4_CHECK(in_branch_, "cuda: end_branch without begin_branch");
        in_branch_ = false;
        if (!origin_) return;
        check(cudaEventRecord(branch_done_, branch_), "cudaEventRecord(branch)");
        stream_ = origin_;
        origin_ = nullptr;
        branch_pending_ = true;
    }
    void join_branch() override {
        DSV4_CHECK(!in_branch_, "cuda: join_branch inside a branch");
        join_branch_pending();
    }

    // Lane i's ops on stream i % kMaxLanes, which waits for stream_'s work before begin_lanes; end_lanes makes
    // stream_ wait for each. A batch's per-sequence kernels (one to a few dozen blocks each, 3-9 a layer) then run
    // beside each other instead of in one chain as long as the batch.
    void begin_lanes(int n_lanes) override {
        DSV4_CHECK(!in_branch_ && origin_ == nullptr && !in_lanes_, "cuda: lanes began inside a branch or lanes");
        in_lanes_ = true;
        if (!lanes_enabled_ || n_lanes < 2) return;
        lane_origin_ = stream_;
        lanes_open_ = std::min(n_lanes, kMaxLanes);
        check(cudaEventRecord(lane_fork_, stream_), "cudaEventRecord(lanes)");
        for (int i = 0; i < lanes_open_; ++i)
            check(cudaStreamWaitEvent(lanes_[i], lane_fork_), "cudaStreamWaitEvent(lanes)");
    }
    void lane(int i) override {
        DSV4_CHECK(in_lanes_ && i >= 0, "cuda: lane {} outside lanes", i);
        if (!lane_origin_) return;
        lane_ = i % lanes_open_;
        stream_ = lanes_[lane_];
    }
    void end_lanes() override {
        DSV4_CHECK(in_lanes_, "cuda: end_lanes without begin_lanes");
        in_lanes_ = false;
        if (!lane_origin_) return;
        stream_ = lane_origin_;
        for (int i = 0; i < lanes_open_; ++i) {
            check(cudaEventRecord(lane_done_[i], lanes_[i]), "cudaEventRecord(lanes)");
            check(cudaStreamWaitEvent(stream_, lane_done_[i]), "cudaStreamWaitEvent(lanes)");
        }
        lane_origin_ = nullptr;
        lane_ = -1;
        lanes_open_ = 0;
    }

    // ---- dense ops -------------------------------------------------------------------------------------------
    void get_rows(const Tensor & table, const Tensor & ids, const Tensor & out) override {
        const OpScope scope(*this, "get_rows");
        cuda::get_rows(ref(table), ids.i32(), ids.n_elements(), out.f32(), stream_);
        launched("get_rows");
    }

    void matmul(const Tensor & w, const Tensor & x, const Tensor & y) override {
        const OpScope scope(*this, matmul_name(w, x));
        cuda::MatvecArgs a = matvec_args(x);
        a.t[0] = target(w, y, w.ne[1]);
        run_matvec(a);
    }

    // All targets in one launch (up to cuda::kMaxTargets of them; more run in further launches).
    void matmul_many(const Tensor & x, std::span<const MatmulTarget> targets) override {
        const OpScope scope(*this, "matmul_many " + matmul_name(targets.empty() ? Tensor{} : targets[0].w, x));
        for (size_t first = 0; first < targets.size(); first += cuda::kMaxTargets) {
            cuda::MatvecArgs a = matvec_args(x);
            a.n_targets = int(std::min<size_t>(cuda::kMaxTargets, targets.size() - first));
            for (int i = 0; i < a.n_targets; ++i) {
                const MatmulTarget & t = targets[first + size_t(i)];
                DSV4_CHECK(t.w.ne[0] == x.ne[0], "cuda matmul_many: weight width {} is not the input width {}",
                           t.w.ne[0], x.ne[0]);
                a.t[i] = target(t.w, t.y, t.w.ne[1]);
            }
            run_matvec(a);
        }
    }

    void matmul_grouped(const Tensor & w, const Tensor & x, const Tensor & y, int64_t groups) override {
        const OpScope scope(*this, "matmul_grouped " + matmul_name(w, x));
        cuda::MatvecArgs a = matvec_args(x);
        a.t[0] = target(w, y, w.ne[1] / groups);
        a.groups = int(groups);
        run_matvec(a);
    }

    void rms_norm(const Tensor & x, const Tensor & gamma, const Tensor & y, float eps) override {
        const OpScope scope(*this, "rms_norm");
        cuda::rms_norm(x.f32(), gamma ? gamma.f32() : nullptr, y.f32(), x.rows(), x.ne[0], eps, stream_);
        launched("rms_norm");
    }

    void rope(const Tensor & x, const RopeSpec & spec, const Tensor & positions, bool inverse) override {
        const OpScope scope(*this, "rope");
        const int64_t heads = x.ne[1];
        cuda::rope(x.f32(), x.rows() / heads, heads, x.ne[0], spec.inv_freq.f32(), spec.n_rot, positions.i32(), inverse,
                   stream_);
        launched("rope");
    }

    void add(const Tensor & a, const Tensor & b, const Tensor & out) override {
        const OpScope scope(*this, "add");
        cuda::add(a.f32(), b.f32(), out.f32(), out.n_elements(), stream_);
        launched("add");
    }

    void swiglu(const Tensor & gate, const Tensor & up, const Tensor & out, float limit) override {
        const OpScope scope(*this, "swiglu");
        cuda::swiglu(gate.f32(), up.f32(), out.f32(), out.n_elements(), limit, stream_);
        launched("swiglu");
    }

    // One product whose blocks read swiglu(gate, up) as their activation and add `add` as they store.
    void swiglu_matmul_add(const Tensor & w, const Tensor & gate, const Tensor & up, float limit, const Tensor & add,
                           const Tensor & y) override {
        const OpScope scope(*this, "swiglu_matmul_add " + matmul_name(w, gate));
        cuda::MatvecArgs a = matvec_args(gate);
        a.x_up = up.f32();
        a.x_limit = limit;
        a.t[0] = target(w, y, w.ne[1]);
        a.t[0].add = add.f32();
        run_matvec(a);
    }

    void norm_rope(std::span<const NormRopeTarget> targets, float eps, const RopeSpec & rope,
                   const Tensor & positions) override {
        const OpScope scope(*this, "norm_rope");
        for (size_t first = 0; first < targets.size(); first += cuda::kMaxNormRopeTargets) {
            cuda::NormRopeArgs a;
            a.eps = eps;
            a.inv_freq = rope.inv_freq.f32();
            a.n_rot = rope.n_rot;
            a.positions = positions.i32();
            a.n_targets = int(std::min<size_t>(cuda::kMaxNormRopeTargets, targets.size() - first));
            for (int i = 0; i < a.n_targets; ++i) {
                const NormRopeTarget & r = targets[first + size_t(i)];
                cuda::NormRopeRows & t = a.t[i];
                t.x = r.x.f32();
                t.gamma = r.gamma ? r.gamma.f32() : nullptr;
                t.heads = r.x.ne[1];
                t.width = r.x.ne[0];
                t.fp8_dims = r.fp8_dims;
                t.ring = r.ring ? r.ring.f32() : nullptr;
                t.ring_rows = r.ring ? r.ring.rows() : 0;
                DSV4_CHECK(t.width * sizeof(float) <= 48 * 1024, "cuda norm_rope: row width {} is more than 12288",
                           t.width);
                const int64_t n = r.x.rows() / t.heads;
                DSV4_CHECK(i == 0 || n == a.n, "cuda norm_rope: targets of {} and {} tokens", a.n, n);
                a.n = n;
            }
            cuda::norm_rope(a, stream_);
            launched("norm_rope");
        }
    }

    void fp8_roundtrip(const Tensor & x, int64_t n_dims) override {
        const OpScope scope(*this, "fp8_roundtrip");
        cuda::fp8_roundtrip(x.f32(), x.rows(), x.ne[0], n_dims, stream_);
        launched("fp8_roundtrip");
    }

    void hadamard_fp4_roundtrip(const Tensor & x) override {
        const OpScope scope(*this, "hadamard_fp4_roundtrip");
        const int64_t w = x.ne[0];
        DSV4_CHECK(w > 0 && (w & (w - 1)) == 0, "cuda hadamard_fp4_roundtrip: width {} is not a power of two", w);
        cuda::hadamard_fp4_roundtrip(x.f32(), x.rows(), w, stream_);
        launched("hadamard_fp4_roundtrip");
    }

    // ---- hyper-connections -----------------------------------------------------------------------------------
    void hc_expand(const Tensor & x, const Tensor & streams) override {
        const OpScope scope(*this, "hc_expand");
        cuda::hc_expand(x.f32(), streams.f32(), x.rows(), streams.ne[1], x.ne[0], stream_);
        launched("hc_expand");
    }

    void hc_pre(const Tensor & streams, const HcPre & w, const Tensor & y, const Tensor & post,
                const Tensor & comb) override {
        const OpScope scope(*this, "hc_pre");
        mix_boundary(hc_pre_args(streams, w, y, post, comb));
        launched("hc_pre");
    }

    void hc_post_pre(const Tensor & streams, const Tensor & o, const Tensor & post, const Tensor & comb,
                     const Tensor & out, const HcPre & w, const Tensor & y) override {
        const OpScope scope(*this, "hc_post_pre");
        cuda::HcArgs a = hc_pre_args(out, w, y, post, comb);
        a.post_streams = streams.f32();
        a.post_o = o.f32();
        mix_boundary(a);
        launched("hc_post_pre");
    }

    void hc_post(const Tensor & streams, const Tensor & o, const Tensor & post, const Tensor & comb,
                 const Tensor & out) override {
        const OpScope scope(*this, "hc_post");
        join_side();
        const int64_t hc = streams.ne[1];
        cuda::hc_post(streams.f32(), o.f32(), post.f32(), comb.f32(), out.f32(), streams.rows() / hc, hc, streams.ne[0],
                      stream_);
        launched("hc_post");
    }

    void hc_head(const Tensor & streams, const Tensor & fn, const Tensor & scale, const Tensor & base, float eps_hc,
                 float eps_norm, const Tensor & z) override {
        const OpScope scope(*this, "hc_head");
        cuda::HcArgs a = hc_args(streams, fn, scale, base, eps_hc, eps_norm, z, true);
        cuda::hc_mix(a, stream_);
        launched("hc_head");
    }

    // ---- attention -------------------------------------------------------------------------------------------
    void store_rows(const Tensor & ring, const Tensor & rows, const Tensor & positions) override {
        const OpScope scope(*this, "store_rows");
        cuda::store_rows(ring.f32(), ring.rows(), rows.f32(), rows.rows(), rows.ne[0], positions.i32(), stream_);
        launched("store_rows");
    }

    void compressor_update(const Tensor & kv, const Tensor & score, const Tensor & ape, const Tensor & state_kv,
                           const Tensor & state_score, const Tensor & positions, int64_t ratio, bool overlap,
                           const CompressedRowFinish & finish, const Tensor & store) override {
        const OpScope scope(*this, "compressor_update");
        cuda::CompressorArgs a;
        a.kv = kv.f32();
        a.score = score.f32();
        a.ape = ref(ape);
        a.state_kv = state_kv.f32();
        a.state_score = state_score.f32();
        a.positions = positions.i32();
        a.n = kv.rows();
        a.ratio = ratio;
        a.wide = kv.ne[0];
        a.overlap = overlap;
        a.norm = finish.norm.f32();
        a.eps = finish.eps;
        a.inv_freq = finish.rope.inv_freq.f32();
        a.n_rot = finish.rope.n_rot;
        a.rounding = finish.rounding == RowRounding::fp8 ? 1 : finish.rounding == RowRounding::hadamard_fp4 ? 2 : 0;
        a.fp8_dims = finish.fp8_dims;
        DSV4_CHECK(store.type == GgmlType::F32 || store.type == GgmlType::BF16,
                   "cuda compressor_update: the store must be F32 or BF16");
        a.store = store.data;
        a.store_bf16 = store.type == GgmlType::BF16;
        a.capacity = store.rows();
        const int64_t width = overlap ? a.wide / 2 : a.wide;
        DSV4_CHECK(a.rounding != 2 || (width & (width - 1)) == 0,
                   "cuda compressor_update: Hadamard rounding needs a power-of-two width (got {})", width);
        cuda::compressor_update(a, stream_);
        launched("compressor_update");
    }

    void indexer_select(const Tensor & q, const Tensor & w, const Tensor & keys, const Tensor & positions,
                        int64_t ratio, float key_scale, const Tensor & selected) override {
        const OpScope scope(*this, "indexer_select");
        cuda::IndexerArgs a;
        a.heads = q.ne[1];
        a.dim = q.ne[0];
        a.capacity = keys.rows();
        a.ratio = ratio;
        a.top_k = selected.ne[0];
        a.key_scale = key_scale;
        a.tensor_cores = tensor_cores_;
        DSV4_CHECK(a.dim % 4 == 0, "cuda indexer_select: key width {} is not a multiple of 4", a.dim);
        DSV4_CHECK(keys.type == GgmlType::F32 || keys.type == GgmlType::BF16,
                   "cuda indexer_select: keys must be F32 or BF16");
        a.keys_bf16 = keys.type == GgmlType::BF16;
        const int64_t n = q.rows() / a.heads;
        const int64_t group = indexer_group(n, a.capacity);
        float * scores = static_cast<float *>(scratch(indexer_op_scratch(n, a.capacity, a.top_k)));
        for (int64_t t0 = 0; t0 < n; t0 += group) {
            a.n = std::min(group, n - t0);
            a.q = q.f32() + t0 * a.heads * a.dim;
            a.w = w.f32() + t0 * a.heads;
            a.keys = keys.data;
            a.positions = positions.i32() + t0;
            a.selected = selected.i32() + t0 * a.top_k;
            a.scores = scores;
            cuda::indexer_select(a, stream_);
        }
        launched("indexer_select");
    }

    void attention(const Tensor & q, const Tensor & raw, const Tensor & positions, int64_t window,
                   const CompressedRows & comp, const Tensor & sinks, float scale, const Tensor & out,
                   const RopeSpec * unrotate) override {
        const OpScope scope(*this, "attention");
        cuda::AttentionArgs a;
        a.dim = q.ne[0];
        a.heads = q.ne[1];
        a.n = q.rows() / a.heads;
        DSV4_CHECK(a.dim <= 512, "cuda attention: head width {} is more than 512", a.dim);
        a.q = q.f32();
        a.raw = raw.f32();
        a.ring = raw.rows();
        a.positions = positions.i32();
        a.window = window;
        if (comp.rows) {
            a.comp = comp.rows.f32();
            a.comp_capacity = comp.rows.rows();
            a.ratio = comp.ratio;
            if (comp.selected) {
                a.selected = comp.selected.i32();
                a.top_k = comp.selected.ne[0];
            }
        }
        a.sinks = sinks.f32();
        a.scale = scale;
        a.out = out.f32();
        if (unrotate) {
            a.out_inv_freq = unrotate->inv_freq.f32();
            a.out_n_rot = unrotate->n_rot;
        }
        a.tensor_cores = tensor_cores_;
        a.partial = static_cast<float *>(scratch(size_t(cuda::attention_partial_floats(a)) * sizeof(float)));
        cuda::attention(a, stream_);
        launched("attention");
    }

    // ---- mixture of experts ----------------------------------------------------------------------------------
    void router(const Tensor & logits, const Tensor & bias, const Tensor & tid2eid, const Tensor & tokens,
                float route_scale, const Tensor & experts, const Tensor & weights) override {
        const OpScope scope(*this, "router");
        DSV4_CHECK(experts.ne[0] <= 32, "cuda router: {} experts per token (at most 32)", experts.ne[0]);
        DSV4_CHECK(logits.ne[0] <= cuda::kRouterMaxExperts, "cuda router: {} experts (at most {})", logits.ne[0],
                   cuda::kRouterMaxExperts);
        cuda::router(logits.f32(), bias ? bias.f32() : nullptr, tid2eid ? tid2eid.i32() : nullptr,
                     tokens ? tokens.i32() : nullptr, logits.rows(), logits.ne[0], experts.ne[0], route_scale,
                     experts.i32(), weights.f32(), stream_);
        launched("router");
    }

    void logit_candidates(const Tensor & logits, const Tensor & ids, const Tensor & values,
                          const Tensor & stats) override {
        const OpScope scope(*this, "logit_candidates");
        DSV4_CHECK(ids.ne[0] <= kCandidateBins, "cuda: logit_candidates keeps at most {} candidates, not {}",
                   kCandidateBins, ids.ne[0]);
        cuda::logit_candidates(logits.f32(), logits.rows(), logits.ne[0], ids.ne[0], ids.i32(), values.f32(),
                               stats.f32(), scratch(cuda::logit_candidates_scratch(logits.rows())), stream_);
        launched("logit_candidates");
    }

    void moe(const Tensor & x, const Tensor & experts, const Tensor & weights, const Tensor & gate, const Tensor & up,
             const Tensor & down, float limit, const Tensor & out) override {
        const OpScope scope(*this, "moe");
        const int64_t n = x.rows(), dim = x.ne[0], inner = gate.ne[1], n_expert = gate.ne[2], k = experts.ne[0];
        const int64_t n_pairs = n * k;
        cuda::MatvecArgs g;
        g.t[0] = target(gate, Tensor{}, inner);
        g.t[0].w_up = ref(up);
        g.glu = true;
        g.limit = limit;
        g.x = x.f32();
        g.x_stride = dim;
        g.src_div = int(k);
        cuda::MatvecArgs d;
        d.t[0] = target(down, Tensor{}, dim);
        d.x_stride = inner;
        d.src_div = 1;
        // Tensor cores once an expert sees about 8 pairs on average (a prefill chunk; 64- or 128-pair tiles, f16
        // activations); below that the integer dot products over 8-pair tiles waste less.
        const bool tensor_cores = tensor_cores_ &&
                                  cuda_tensor_core_moe(gate.type, down.type, dim, inner, n_pairs, n_expert) &&
                                  cuda::gemm_inputs_aligned(g);
        if (tensor_cores && moe_on_cublas(gate, down, n_pairs))
            return moe_cublas(x, experts, weights, gate, up, down, limit, out);
        const int nt = tensor_cores ? std::min(cuda::gemm_tile_tokens(n_pairs / n_expert, gate.type),
                                               cuda::gemm_tile_tokens(n_pairs / n_expert, down.type))
                                    : std::min(cuda::matvec_tile_tokens(gate.type, dim, n),
                                               cuda::matvec_tile_tokens(down.type, inner, n));
        const int64_t max_tiles = std::min(n_pairs, (n_pairs + nt - 1) / nt + n_expert);
        // Scratch: sorted pairs, tiles, tile count, hidden rows [pairs, I], expert outputs [pairs, D], and the
        // activations of x (per token) and of the hidden rows (per pair) as the products read them: 8-bit codes
        // for tiles of several tokens on the integer path, f16 on the tensor cores.
        const bool gq = !tensor_cores && cuda::matvec_needs_quantized(gate.type);
        const bool dq = !tensor_cores && cuda::matvec_needs_quantized(down.type);
        const size_t ints = size_t(n_pairs + 3 * max_tiles + 1);
        const size_t ints_bytes = round_up(ints * sizeof(int32_t));
        const size_t h_bytes = round_up(size_t(n_pairs * inner) * sizeof(float));
        const size_t y_bytes = round_up(size_t(n_pairs * dim) * sizeof(float));
        const size_t xq_bytes = tensor_cores ? round_up(size_t(n * dim) * 2)
                                : gq         ? round_up(size_t(cuda::matvec_act_bytes(gate.type, dim, n)))
                                             : 0;
        const size_t hq_bytes = tensor_cores ? round_up(size_t(n_pairs * inner) * 2)
                                : dq         ? round_up(size_t(cuda::matvec_act_bytes(down.type, inner, n_pairs)))
                                             : 0;
        uint8_t * base = static_cast<uint8_t *>(scratch(ints_bytes + h_bytes + y_bytes + xq_bytes + hq_bytes));
        int32_t * pairs = reinterpret_cast<int32_t *>(base);
        int32_t * tiles = pairs + n_pairs;
        int32_t * n_tiles = tiles + 3 * max_tiles;
        float * h = reinterpret_cast<float *>(base + ints_bytes);
        float * ybuf = reinterpret_cast<float *>(base + ints_bytes + h_bytes);
        uint8_t * xq = base + ints_bytes + h_bytes + y_bytes;
        uint8_t * hq = xq + xq_bytes;
        // One token (decode): a tile per pair, read straight from the router's output.
        const bool direct = n == 1 && !tensor_cores;
        if (!direct) {
            cuda::moe_plan(experts.i32(), n_pairs, n_expert, nt, pairs, tiles, n_tiles, stream_);
            launched("moe_plan");
        }
        g.t[0].y = h;
        g.t[0].y_stride = inner;
        d.x = h;
        d.t[0].y = ybuf;
        d.t[0].y_stride = dim;
        if (tensor_cores) {
            cuda::gemm_activations(x.f32(), nullptr, 0, n, dim, dim, reinterpret_cast<uint16_t *>(xq), stream_);
            g.x_f16 = reinterpret_cast<const uint16_t *>(xq);
        } else if (gq) {
            const cuda::QuantizeJob job{gate.type, x.f32(), nullptr, 0, dim, n, 1, dim, xq};
            cuda::matvec_quantize(&job, 1, stream_);
            g.xq[cuda::matvec_act_kind(gate.type)] = xq;
        }
        for (cuda::MatvecArgs * a : {&g, &d}) {
            if (a == &d && tensor_cores) {
                cuda::gemm_activations(h, nullptr, 0, n_pairs, inner, inner, reinterpret_cast<uint16_t *>(hq), stream_);
                d.x_f16 = reinterpret_cast<const uint16_t *>(hq);
            } else if (a == &d && dq) {
                const cuda::QuantizeJob job{down.type, h, nullptr, 0, inner, n_pairs, 1, inner, hq};
                cuda::matvec_quantize(&job, 1, stream_);
                d.xq[cuda::matvec_act_kind(down.type)] = hq;
            }
            if (direct) {
                a->pair_experts = experts.i32();
                a->n_expert = int(n_expert);
            } else {
                a->tiles = tiles;
                a->n_tiles = n_tiles;
                a->pairs = pairs;
            }
            if (tensor_cores)
                cuda::gemm(*a, max_tiles, nt, stream_);
            else
                cuda::matvec(*a, max_tiles, nt, stream_);
            launched(a == &g ? "moe gate/up" : "moe down");
        }
        cuda::moe_combine(ybuf, nullptr, experts.i32(), weights.f32(), n, k, n_expert, dim, nullptr, out.f32(),
                          stream_);
        launched("moe_combine");
    }

    // With DSV4_CUDA_MOE_CUBLAS=1, a prefill chunk's routed experts on cuBLAS where they see kMoeCublasMinPairs
    // pairs an expert on average (DSV4_CUDA_MOE_CUBLAS_MIN_PAIRS moves it): each expert's gate and up decoded
    // to one f16 [2I][D] matrix and its down to [D][I], the values the tiles decode, a batch of experts at a time
    // on side_ into two buffers in turn while stream_ multiplies the batch before. cuBLAS has no grouped f16 × f16
    // → f32 product, and a product an expert cost 0.1–1 ms of host time at each new token count
    // (docs/cuda-journal.md, "Session 30"), so the pairs are laid out in slots of one token count (a quarter above the
    // mean an expert, rounded up to 32): an expert's rows fill as many consecutive slots as they need, and a batch's
    // slots run as one batched product of that one shape (a hot expert is several slots of the same weight). It reads
    // the experts' pair counts on the host (one wait a layer) and writes every used expert's f16 weights once a chunk
    // (12.9 GB a V4 Flash layer): never on an integrated GPU, whose bandwidth makes that write cost more than the
    // tiles' products.
    bool moe_on_cublas(const Tensor & gate, const Tensor & down, int64_t n_pairs) const {
        const int64_t dim = gate.ne[0], inner = gate.ne[1], n_expert = gate.ne[2];
        return moe_cublas_enabled_ && !capturing_ && !integrated_ && n_pairs >= moe_cublas_min_pairs_ * n_expert &&
               cuda::weights_f16_supported(gate.type, dim) && cuda::weights_f16_supported(down.type, inner) &&
               4 * inner * dim <= kMoeCublasWeightBytes;
    }

    void moe_cublas(const Tensor & x, const Tensor & experts, const Tensor & weights, const Tensor & gate,
                    const Tensor & up, const Tensor & down, float limit, const Tensor & out) {
        const int64_t n = x.rows(), dim = x.ne[0], inner = gate.ne[1], n_expert = gate.ne[2], k = experts.ne[0];
        const int64_t n_pairs = n * k;
        const int64_t batch = std::min({n_expert, kMoeCublasWeightBytes / (4 * inner * dim), moe_cublas_batch_});
        const MoeCublasScratch sizes = moe_cublas_scratch(n_pairs, n_expert, dim, inner, batch);
        uint8_t * base = static_cast<uint8_t *>(scratch(sizes.total()));
        void ** ptrs_dev = reinterpret_cast<void **>(base);
        int32_t * pairs = reinterpret_cast<int32_t *>(base + sizes.ptrs);
        int32_t * row_of = pairs + n_pairs;
        int32_t * tiles = row_of + n_pairs;
        int32_t * row_base_dev = tiles + 3 * n_expert + 1;
        uint16_t * rows16 = reinterpret_cast<uint16_t *>(base + sizes.ptrs + sizes.ints);
        float * rows32 = reinterpret_cast<float *>(base + sizes.ptrs + sizes.ints + sizes.rows16);
        uint8_t * w_base = base + sizes.ptrs + sizes.ints + sizes.rows16 + sizes.rows32;
        uint16_t * w16[2] = {reinterpret_cast<uint16_t *>(w_base),
                             reinterpret_cast<uint16_t *>(w_base + sizes.weights)};
        join_side();
        cuda::moe_plan(experts.i32(), n_pairs, n_expert, int(n_pairs), pairs, tiles, tiles + 3 * n_expert, stream_);
        launched("moe_plan");
        std::vector<int32_t> plan(size_t(3 * n_expert + 1));
        check(cudaMemcpyAsync(plan.data(), tiles, plan.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_),
              "cudaMemcpyAsync(moe plan)");
        // Also what side_ needs: stream_'s earlier work on the arena is done when it starts decoding.
        check(cudaStreamSynchronize(stream_), "synchronize (moe plan)");

        // The layout: expert e's rows from row_base[e] + its first sorted pair, in ceil(count / slot) slots. The
        // batches of experts: {first expert, end, first slot, end}.
        const int32_t n_used = plan.back();
        auto tile = [&](int32_t i, int field) { return int64_t(plan[size_t(3 * i + field)]); };
        const int64_t n_sorted = n_used > 0 ? tile(n_used - 1, 1) + tile(n_used - 1, 2) : 0;
        const int64_t mean = n_used > 0 ? (n_sorted + n_used - 1) / n_used : 1;
        const int64_t slot = (mean + mean / 4 + 31) / 32 * 32;
        struct Batch {
            int64_t e0, e1, s0, s1;
        };
        std::vector<Batch> batches;
        std::vector<int32_t> row_base(size_t(n_expert), 0);
        std::vector<std::pair<int64_t, int64_t>> slots;  // {expert, first row}
        int64_t rows = 0;
        for (int32_t i = 0; i < n_used; ++i) {
            const int64_t e = tile(i, 0), e0 = e / batch * batch;
            if (batches.empty() || batches.back().e0 != e0)
                batches.push_back({e0, std::min(n_expert, e0 + batch), int64_t(slots.size()), 0});
            row_base[size_t(e)] = int32_t(rows - tile(i, 1));
            for (int64_t r = 0; r < tile(i, 2); r += slot) slots.push_back({e, rows + r});
            rows += (tile(i, 2) + slot - 1) / slot * slot;
            batches.back().s1 = int64_t(slots.size());
        }
        DSV4_CHECK(rows <= sizes.max_rows && int64_t(slots.size()) <= sizes.max_slots,
                   "cuda moe_cublas: {} rows in {} slots laid out, {} and {} planned", rows, slots.size(),
                   sizes.max_rows, sizes.max_slots);
        // The products' operands, slot by slot: gate | up = W_e · x, then down = W_e · h (column-major: W_e is
        // op(A) = Aᵀ of its [rows][K] f16 rows, a slot's rows are B's columns); batch b's weights in buffer b % 2 of
        // the gate/up pass, (batches + b) % 2 of the down pass.
        const int64_t n_slots = int64_t(slots.size());
        std::vector<void *> ptrs(size_t(6 * n_slots));
        for (int pass = 0; pass < 2; ++pass) {
            const int64_t m = pass == 0 ? 2 * inner : dim, kk = pass == 0 ? dim : inner;
            void ** p = ptrs.data() + 3 * pass * n_slots;
            for (size_t b = 0; b < batches.size(); ++b)
                for (int64_t s = batches[b].s0; s < batches[b].s1; ++s) {
                    const auto [e, row] = slots[size_t(s)];
                    p[s] = w16[(pass * batches.size() + b) % 2] + (e - batches[b].e0) * m * kk;
                    p[n_slots + s] = rows16 + row * kk;
                    p[2 * n_slots + s] = rows32 + row * m;
                }
        }
        check(cudaMemcpyAsync(ptrs_dev, ptrs.data(), ptrs.size() * sizeof(void *), cudaMemcpyHostToDevice, stream_),
              "cudaMemcpyAsync(moe pointers)");
        check(cudaMemcpyAsync(row_base_dev, row_base.data(), row_base.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                              stream_),
              "cudaMemcpyAsync(moe rows)");
        cuda::moe_gather_f16(x.f32(), dim, pairs, int(k), experts.i32(), row_base_dev, n_sorted, rows16, row_of,
                             stream_);
        bind_cublas();
        const cuda::WeightRef up_ref = ref(up);
        int turn = 0;  // batches decoded so far: buffer turn % 2 is next
        for (int pass = 0; pass < 2; ++pass) {
            const int64_t m = pass == 0 ? 2 * inner : dim, kk = pass == 0 ? dim : inner;
            void ** p = ptrs_dev + 3 * pass * n_slots;
            if (pass == 1)
                cuda::gemm_activations(rows32, rows32 + inner, limit, rows, inner, 2 * inner, rows16, stream_);
            for (const Batch & b : batches) {
                const int buf = turn % 2;
                if (turn++ >= 2) check(cudaStreamWaitEvent(side_, moe_read_[buf]), "cudaStreamWaitEvent(moe)");
                if (pass == 0)
                    cuda::weights_f16(ref(gate), &up_ref, b.e0 * inner, inner, b.e1 - b.e0, w16[buf], side_);
                else
                    cuda::weights_f16(ref(down), nullptr, b.e0 * dim, dim, b.e1 - b.e0, w16[buf], side_);
                check(cudaEventRecord(moe_decoded_[buf], side_), "cudaEventRecord(moe)");
                check(cudaStreamWaitEvent(stream_, moe_decoded_[buf]), "cudaStreamWaitEvent(moe)");
                // Rows past an expert's pairs in its last slot are computed from whatever the arena holds there
                // and never read.
                const float one = 1.0f, zero = 0.0f;
                check_cublas(cublasGemmBatchedEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(slot), int(kk), &one,
                                                 p + b.s0, CUDA_R_16F, int(kk), p + n_slots + b.s0, CUDA_R_16F, int(kk),
                                                 &zero, p + 2 * n_slots + b.s0, CUDA_R_32F, int(m), int(b.s1 - b.s0),
                                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                             "cublasGemmBatchedEx (experts)");
                check(cudaEventRecord(moe_read_[buf], stream_), "cudaEventRecord(moe)");
            }
        }
        launched("moe (cuBLAS)");
        cuda::moe_combine(rows32, row_of, experts.i32(), weights.f32(), n, k, n_expert, dim, nullptr, out.f32(),
                          stream_);
        launched("moe_combine");
    }

    // A decode step of a q2-mix file (one token, or a batch of up to kFusedFfnTokens sequences), in six launches
    // instead of the composition's ten: x quantized once for both the shared expert's Q8_0 rows and the routed
    // experts' K-quant rows; the router's and the shared expert's gate/up projections; the router; the routed gate/up
    // beside the shared expert's down projection (moe_shared: the first is bound by instruction issue, the second by
    // its 8.9 MB, and neither needs the other; the shared blocks quantize swiglu(g, u) themselves); the routed down,
    // each block quantizing its pair's hidden row (moe_down); the weighted sum plus the shared row. Every (token,
    // expert) pair is its own one-token product: a batch's tokens rarely share an expert (6 of 256 each), so grouping
    // them by expert (the composition's plan) would save few bytes, and its tiles of several tokens ran the routed
    // products at a quarter of this path's rate (docs/cuda.md, "Batched decode"). For one token the values are the
    // composition's bit for bit: the same quantization, each product split as its own launch would, and routed +
    // shared added once.
    void moe_ffn(const Tensor & x, const MoeFfn & f, const Tensor & out) override {
        const int64_t n = x.rows(), dim = x.ne[0], inner = f.gate.ne[1], n_expert = f.gate.ne[2];
        const int64_t k = f.experts.ne[0], inner_sh = f.down_sh.ne[0], pairs = n * k;
        const bool fused =
            n <= kFusedFfnTokens && k <= 32 && n_expert <= cuda::kRouterMaxExperts && f.gate.type == f.up.type &&
            cuda::moe_ffn_fused_supported(f.gate.type, f.down.type, f.down_sh.type, inner, inner_sh) &&
            !(tensor_cores_ && cuda_tensor_core_moe(f.gate.type, f.down.type, dim, inner, pairs, n_expert));
        if (!fused) return Backend::moe_ffn(x, f, out);
        const OpScope scope(*this, "moe_ffn " + matmul_name(f.gate, x));
        cuda::MatvecArgs proj = matvec_args(x);
        proj.n_targets = 3;
        proj.t[0] = target(f.gate_inp, f.logits, f.gate_inp.ne[1]);
        proj.t[1] = target(f.gate_sh, f.g, f.gate_sh.ne[1]);
        proj.t[2] = target(f.up_sh, f.u, f.up_sh.ne[1]);
        cuda::MatvecArgs g;
        g.t[0] = target(f.gate, Tensor{}, inner);
        g.t[0].w_up = ref(f.up);
        g.glu = true;
        g.limit = f.limit;
        g.x = x.f32();
        g.x_stride = dim;
        g.src_div = int(k);
        g.pair_experts = f.experts.i32();
        g.n_expert = int(n_expert);
        cuda::MatvecArgs sh = matvec_args(f.g);
        sh.x_up = f.u.f32();
        sh.x_limit = f.limit_sh;
        cuda::MatvecArgs d;
        d.t[0] = target(f.down, Tensor{}, dim);
        d.x_stride = inner;
        d.pair_experts = f.experts.i32();
        d.n_expert = int(n_expert);

        // Scratch (one arena for the op): x's codes of each kind (the projections' and the routed gate/up's),
        // hidden rows [pairs, I], expert rows [pairs, D], the shared expert's rows [n, D].
        const ActPlan plan = act_plan(proj, dim, f.gate.type);
        const size_t h_bytes = round_up(size_t(pairs * inner) * sizeof(float));
        const size_t y_bytes = round_up(size_t(pairs * dim) * sizeof(float));
        uint8_t * base = static_cast<uint8_t *>(
            scratch(plan.total() + h_bytes + y_bytes + round_up(size_t(n * dim) * sizeof(float))));
        float * h = reinterpret_cast<float *>(base + plan.total());
        float * ybuf = reinterpret_cast<float *>(base + plan.total() + h_bytes);
        float * ysh = reinterpret_cast<float *>(base + plan.total() + h_bytes + y_bytes);

        quantize_acts(proj, plan, dim, base);
        g.xq[0] = proj.xq[0];
        g.xq[1] = proj.xq[1];
        proj.ring = ring_allowed();
        const int nt = tile_tokens(proj);
        cuda::matvec(proj, (n + nt - 1) / nt, nt, stream_);
        launched("moe_ffn projections");
        cuda::router(f.logits.f32(), f.bias ? f.bias.f32() : nullptr, f.tid2eid ? f.tid2eid.i32() : nullptr,
                     f.tokens ? f.tokens.i32() : nullptr, n, f.logits.ne[0], k, f.route_scale, f.experts.i32(),
                     f.weights.f32(), stream_);
        g.t[0].y = h;
        g.t[0].y_stride = inner;
        sh.t[0] = target(f.down_sh, Tensor{}, dim);
        sh.t[0].y = ysh;
        sh.t[0].y_stride = dim;
        cuda::moe_shared(g, int(pairs), sh, stream_);
        launched("moe_ffn gate/up + shared down");
        d.x = h;
        d.t[0].y = ybuf;
        d.t[0].y_stride = dim;
        cuda::moe_down(d, int(pairs), stream_);
        cuda::moe_combine(ybuf, nullptr, f.experts.i32(), f.weights.f32(), n, k, n_expert, dim, ysh, out.f32(),
                          stream_);
        launched("moe_ffn down + combine");
    }

    // Called by DeviceBuffer: a freed buffer may be referenced by a captured graph.
    void release(void * p, size_t bytes) {
        cudaSetDevice(dev_);
        cudaStreamSynchronize(stream_);
        drop_graphs();
        cudaFree(p);
        held(-int64_t(bytes));
    }

    uint64_t peak_device_bytes() const override { return peak_bytes_; }

  private:
    // DSV4_CUDA_PROFILE=1: every op is bracketed by events; totals per op name print when the backend closes.
    class OpScope {
      public:
        OpScope(CudaBackend & b, std::string name) : b_(b) {
            if (!b_.profile_) return;
            name_ = std::move(name);
            start_ = b_.event();
            cudaEventRecord(start_, b_.stream_);
        }
        ~OpScope() {
            if (!b_.profile_) return;
            cudaEvent_t end = b_.event();
            cudaEventRecord(end, b_.stream_);
            b_.timings_.push_back({std::move(name_), start_, end});
        }

      private:
        CudaBackend & b_;
        std::string name_;
        cudaEvent_t start_ = nullptr;
    };
    struct Timing {
        std::string name;
        cudaEvent_t start, end;
    };

    cudaEvent_t event() {
        if (!free_events_.empty()) {
            cudaEvent_t e = free_events_.back();
            free_events_.pop_back();
            return e;
        }
        cudaEvent_t e = nullptr;
        check(cudaEventCreate(&e), "cudaEventCreate");
        return e;
    }
    void collect_timings() {
        if (timings_.empty()) return;
        cudaEventSynchronize(timings_.back().end);
        for (Timing & t : timings_) {
            float ms = 0;
            cudaEventElapsedTime(&ms, t.start, t.end);
            auto & [count, total] = profile_totals_[t.name];
            ++count;
            total += ms;
            free_events_.push_back(t.start);
            free_events_.push_back(t.end);
        }
        timings_.clear();
    }
    void print_profile() {
        collect_timings();
        std::vector<std::pair<std::string, std::pair<int64_t, double>>> rows(profile_totals_.begin(),
                                                                             profile_totals_.end());
        std::sort(rows.begin(), rows.end(), [](auto & a, auto & b) { return a.second.second > b.second.second; });
        double all = 0;
        for (auto & r : rows) all += r.second.second;
        std::fprintf(stderr, "cuda profile: %.3f ms in %zu op kinds\n", all, rows.size());
        for (auto & [name, ct] : rows)
            std::fprintf(stderr, "  %9.3f ms %5.1f %%  %7ld calls  %8.2f us/call  %s\n", ct.second,
                         100 * ct.second / all, ct.first, 1e3 * ct.second / double(ct.first), name.c_str());
        for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
        free_events_.clear();
    }
    static std::string matmul_name(const Tensor & w, const Tensor & x) {
        return fmt::format("matmul {} [{} -> {}] n={}", type_name(w.type), w.ne[0], w.ne[1], x.rows());
    }

    void bind() const { cudaSetDevice(dev_); }

    void launched(const char * what) { check(cudaGetLastError(), what); }

    // A sublayer boundary's HCPre (and HCPost, when a.post_streams). The decode cluster kernel leaves comb holding
    // Sinkhorn's logits (cuda::hc_mix_clusters): their 20 dependent rounds run on side_, beside the next sublayer,
    // which does not read comb. The next boundary, when it reads that comb, polls the count of Sinkhorns done
    // rather than waiting for a join (a graph edge from another stream would cost it its early launch); everything
    // else that may read or rewrite comb (hc_pre, hc_post, the rows kernel, read, write, copy, fill, synchronize, a
    // capture's start and end) joins side_ first. Before a boundary after a join (nothing in flight) the count is
    // reset, on the device and here, so a captured graph's waits hold for every replay. The reset is a memset on the
    // stream, not a write by that boundary: a later boundary, launched early (pdl_begin), could poll before the
    // boundary ran, whereas every later kernel starts after a memset node has completed. The memset is also what
    // lets that boundary read comb before its PDL wait without a poll: every kernel before it has completed.
    void mix_boundary(cuda::HcArgs a) {
        const bool clusters = cuda::hc_mix_clusters(a);
        const bool pending = clusters && a.post_streams && side_pending_ && a.comb == side_comb_;
        if (!pending) {
            join_side();
            if (clusters) {
                check(cudaMemsetAsync(sinkhorns_, 0, sizeof(unsigned), stream_), "cudaMemsetAsync(sinkhorns)");
                sinkhorns_launched_ = 0;
            }
        }
        a.sinkhorns = sinkhorns_;
        a.sinkhorns_wait = pending ? sinkhorns_launched_ : 0;
        cuda::hc_mix(a, stream_);
        if (!clusters) return;
        check(cudaEventRecord(side_fork_, stream_), "cudaEventRecord(side)");
        check(cudaStreamWaitEvent(side_, side_fork_), "cudaStreamWaitEvent(side)");
        cuda::hc_sinkhorn(a.comb, a.n, a.iters, a.eps_hc, sinkhorns_, side_);
        check(cudaEventRecord(side_done_, side_), "cudaEventRecord(side)");
        ++sinkhorns_launched_;
        side_pending_ = true;
        side_comb_ = a.comb;
    }
    void join_branch_pending() {
        if (!branch_pending_) return;
        check(cudaStreamWaitEvent(stream_, branch_done_), "cudaStreamWaitEvent(branch)");
        branch_pending_ = false;
    }
    // Every stream's work joined into stream_ (the branch's and the Sinkhorns' of side_).
    void join_side() {
        DSV4_CHECK(!in_branch_ && !in_lanes_,
                   "cuda: a step that synchronises, reads or writes inside a branch or lanes");
        join_branch_pending();
        if (!side_pending_) return;
        check(cudaStreamWaitEvent(stream_, side_done_), "cudaStreamWaitEvent(side)");
        side_pending_ = false;
    }

    cuda::WeightRef ref(const Tensor & t) const {
        cuda::WeightRef r;
        r.data = static_cast<const uint8_t *>(t.data);
        r.type = t.type;
        r.ne0 = t.ne[0];
        const TypeTraits & tr = type_traits(t.type);
        r.n_blocks = tr.block_elems > 0 ? t.n_elements() / tr.block_elems : 0;
        r.iq2 = iq2_;
        return r;
    }

    static void check_weight_type(GgmlType t) {
        DSV4_CHECK(is_float_type(t) || t == GgmlType::Q8_0 || t == GgmlType::Q2_K || t == GgmlType::Q4_K ||
                       t == GgmlType::IQ2_XXS || t == GgmlType::MXFP4,
                   "cuda matmul: weight type {} is not supported", type_name(t));
    }

    static cuda::MatvecArgs matvec_args(const Tensor & x) {
        cuda::MatvecArgs a;
        a.x = x.f32();
        a.x_stride = x.ne[0];
        a.n = x.rows();
        return a;
    }

    cuda::MatvecTarget target(const Tensor & w, const Tensor & y, int64_t rows) const {
        check_weight_type(w.type);
        cuda::MatvecTarget t;
        t.w = ref(w);
        t.rows = rows;
        t.y = y ? y.f32() : nullptr;
        t.y_stride = y ? y.ne[0] : 0;
        return t;
    }

    // The quantized activation rows a's input needs: a weight type of each kind (Q8A, Q8_K) its targets' weights
    // read, plus `also`'s (F32: none), and their bytes (256-byte multiples, 0 for a kind not needed).
    struct ActPlan {
        GgmlType kinds[2] = {GgmlType::F32, GgmlType::F32};
        size_t bytes[2] = {0, 0};
        size_t total() const { return bytes[0] + bytes[1]; }
    };
    static ActPlan act_plan(const cuda::MatvecArgs & a, int64_t k, GgmlType also = GgmlType::F32) {
        ActPlan p;
        for (int i = 0; i <= a.n_targets; ++i) {
            const GgmlType t = i < a.n_targets ? a.t[i].w.type : also;
            if (cuda::matvec_needs_quantized(t)) p.kinds[cuda::matvec_act_kind(t)] = t;
        }
        for (int j = 0; j < 2; ++j)
            p.bytes[j] = round_up(size_t(cuda::matvec_act_bytes(p.kinds[j], k, a.n * a.groups)));
        return p;
    }

    // Quantizes a's input for every kind of the plan into base (plan.total() bytes) in one launch; sets a.xq.
    void quantize_acts(cuda::MatvecArgs & a, const ActPlan & plan, int64_t k, uint8_t * base) {
        cuda::QuantizeJob jobs[2];
        int n_jobs = 0;
        for (int j = 0; j < 2; ++j) {
            if (!plan.bytes[j]) continue;
            uint8_t * dst = base + (j ? plan.bytes[0] : 0);
            jobs[n_jobs++] = {plan.kinds[j], a.x, a.x_up, a.x_limit, a.x_stride, a.n, a.groups, k, dst};
            a.xq[j] = dst;
        }
        cuda::matvec_quantize(jobs, n_jobs, stream_);
    }

    // Tokens a tile of a's plain products takes: the fewest any target's weight type allows.
    static int tile_tokens(const cuda::MatvecArgs & a) {
        int nt = cuda::kMaxTileTokens;
        for (int i = 0; i < a.n_targets; ++i)
            nt = std::min(nt, cuda::matvec_tile_tokens(a.t[i].w.type, a.t[0].w.ne0, a.n));
        return nt;
    }

    // Whether a one-token product may take the ring kernel (MatvecArgs::ring): not beside a branch, whose kernels
    // would wait for its blocks. (Its producer reads weights before the PDL wait: upload_weight's fence keeps an
    // upload's repack ahead of it.)
    bool ring_allowed() { return ring_enabled_ && !branch_pending_ && !origin_ && !lane_origin_; }

    // Quantizes the activations once per kind the targets need (quantized weights), then launches.
    void run_matvec(cuda::MatvecArgs & a) {
        if (a.n <= 0) return;
        bool tensor_cores = tensor_cores_ && cuda::gemm_inputs_aligned(a);
        for (int i = 0; i < a.n_targets; ++i)
            tensor_cores = tensor_cores && cuda_tensor_core_product(a.t[i].w.type, a.t[i].w.ne0, a.n);
        if (tensor_cores && dense_on_cublas(a)) {
            gemm_cublas(a);
            launched("gemm (cuBLAS)");
            return;
        }
        if (tensor_cores) {
            uint16_t * x16 = static_cast<uint16_t *>(scratch(size_t(a.n * a.x_stride) * 2));
            cuda::gemm_activations(a.x, a.x_up, a.x_limit, a.n, a.x_stride, a.x_stride, x16, stream_);
            a.x_f16 = x16;
            int nt = 128;
            for (int i = 0; i < a.n_targets; ++i) nt = std::min(nt, cuda::gemm_tile_tokens(a.n, a.t[i].w.type));
            cuda::gemm(a, (a.n + nt - 1) / nt, nt, stream_);
            launched("gemm");
            return;
        }
        const int64_t k = a.t[0].w.ne0;
        const int nt = tile_tokens(a);
        const ActPlan plan = act_plan(a, k);
        if (plan.total() > 0) quantize_acts(a, plan, k, static_cast<uint8_t *>(scratch(plan.total())));
        a.ring = ring_allowed();
        cuda::matvec(a, (a.n + nt - 1) / nt, nt, stream_);
        launched("matmul");
    }

    // Dense prefill products of at least kCublasMinTokens tokens run on cuBLAS (no expert tiles, no SwiGLU of the
    // outputs): the same f16 terms as the tiles, and an 8K prompt's prefill 21 % faster on an H200
    // (docs/cuda-journal.md, "Session 29"). DSV4_CUDA_CUBLAS=0 keeps every product on the tiles;
    // DSV4_CUDA_CUBLAS_MIN_TOKENS moves the threshold (the tests run the small products' cases through cuBLAS).
    bool dense_on_cublas(const cuda::MatvecArgs & a) const {
        // Never inside a capture (decode's graphs): the handle and the arena may not be made there.
        if (!cublas_enabled_ || capturing_ || a.tiles || a.pair_experts || a.glu || a.n < cublas_min_tokens_)
            return false;
        for (int i = 0; i < a.n_targets; ++i)
            if (!cuda::weights_f16_supported(a.t[i].w.type, a.t[i].w.ne0) ||
                (a.t[i].w.type != GgmlType::F16 && a.t[i].rows * a.groups * a.t[i].w.ne0 > kCublasMaxWeight))
                return false;
        return true;
    }

    void bind_cublas() {
        if (cublas_) return;
        bind();  // a handle belongs to the device current at its creation
        check_cublas(cublasCreate(&cublas_), "cublasCreate");
        check_cublas(cublasSetStream(cublas_, stream_), "cublasSetStream");
    }

    // y = W·x (+ add) for every target: the activations rounded to f16 as the tiles take them, the weights as the
    // tiles decode them (F16 in place, others decoded into the arena one target at a time), f32 accumulation; a
    // grouped product is one strided batch (group g: rows [g·rows, (g+1)·rows) of W, x columns [gK, (g+1)K),
    // y columns [g·rows, ...)).
    void gemm_cublas(const cuda::MatvecArgs & a) {
        bind_cublas();
        const int64_t k = a.t[0].w.ne0;
        size_t w_bytes = 0;
        for (int i = 0; i < a.n_targets; ++i)
            if (a.t[i].w.type != GgmlType::F16)
                w_bytes = std::max(w_bytes, size_t(a.t[i].rows * a.groups * a.t[i].w.ne0) * 2);
        const size_t x_bytes = round_up(size_t(a.n * a.x_stride) * 2);
        uint8_t * base = static_cast<uint8_t *>(scratch(x_bytes + w_bytes));
        uint16_t * x16 = reinterpret_cast<uint16_t *>(base);
        uint16_t * w16 = reinterpret_cast<uint16_t *>(base + x_bytes);
        cuda::gemm_activations(a.x, a.x_up, a.x_limit, a.n, a.x_stride, a.x_stride, x16, stream_);
        for (int i = 0; i < a.n_targets; ++i) {
            const cuda::MatvecTarget & t = a.t[i];
            DSV4_CHECK(t.w.ne0 == k, "cuda gemm_cublas: targets of one input differ in K ({} and {})", k, t.w.ne0);
            const uint16_t * w = reinterpret_cast<const uint16_t *>(t.w.data);
            if (t.w.type != GgmlType::F16) {
                cuda::weights_f16(t.w, nullptr, 0, t.rows * a.groups, 1, w16, stream_);
                w = w16;
            }
            float beta = 0.0f;
            if (t.add) {
                if (t.add != t.y)
                    check(cudaMemcpy2DAsync(t.y, size_t(t.y_stride) * 4, t.add, size_t(t.y_stride) * 4,
                                            size_t(t.rows * a.groups) * 4, size_t(a.n), cudaMemcpyDeviceToDevice,
                                            stream_),
                          "cudaMemcpy2DAsync(add)");
                beta = 1.0f;
            }
            const float alpha = 1.0f;
            check_cublas(cublasGemmStridedBatchedEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(t.rows), int(a.n), int(k),
                                                    &alpha, w, CUDA_R_16F, int(k), t.rows * k, x16, CUDA_R_16F,
                                                    int(a.x_stride), k, &beta, t.y, CUDA_R_32F, int(t.y_stride), t.rows,
                                                    a.groups, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                         "cublasGemmStridedBatchedEx");
        }
    }
    static void check_cublas(cublasStatus_t st, const char * what) {
        if (st != CUBLAS_STATUS_SUCCESS) fail("cuda: {} failed: {}", what, cublasGetStatusString(st));
    }

    cuda::HcArgs hc_pre_args(const Tensor & streams, const HcPre & w, const Tensor & y, const Tensor & post,
                             const Tensor & comb) {
        cuda::HcArgs a = hc_args(streams, w.fn, w.scale, w.base, w.eps_hc, w.eps_norm, y, false);
        DSV4_CHECK(!w.norm || a.width * sizeof(float) <= 48 * 1024, "cuda hc_pre: normed width {} is more than 12288",
                   a.width);
        a.norm = w.norm ? w.norm.f32() : nullptr;
        a.iters = w.iters;
        a.post = post.f32();
        a.comb = comb.f32();
        return a;
    }

    cuda::HcArgs hc_args(const Tensor & streams, const Tensor & fn, const Tensor & scale, const Tensor & base,
                         float eps_hc, float eps_norm, const Tensor & y, bool head) {
        cuda::HcArgs a;
        a.hc = streams.ne[1];
        a.width = streams.ne[0];
        a.n = streams.rows() / a.hc;
        a.streams = streams.f32();
        a.fn = ref(fn);
        a.scale = scale.f32();
        a.base = base.f32();
        a.eps_hc = eps_hc;
        a.eps_norm = eps_norm;
        a.head = head;
        a.y = y.f32();
        a.done = hc_done_;
        a.tensor_cores = tensor_cores_;
        const int64_t n_mix = cuda::hc_n_mix(a.hc, head);
        DSV4_CHECK(n_mix <= cuda::kHcMaxMix && a.hc <= 16 && fn.ne[1] == n_mix && fn.ne[0] == a.hc * a.width,
                   "cuda hyper-connections: {} streams of {} (mixing matrix [{}, {}]) are not supported", a.hc, a.width,
                   fn.ne[0], fn.ne[1]);
        a.partial =
            static_cast<float *>(scratch(size_t(cuda::hc_partial_floats(a.n, a.hc, a.width, n_mix)) * sizeof(float)));
        return a;
    }

    // An arena for every op's temporaries (ops run in stream order, so each reuses it from the start), and one for
    // a branch's ops, which run beside them. It only grows, outside captures: the first run of a captured sequence
    // is eager and sizes it.
    void * scratch(size_t bytes) {
        Arena & a = lane_ >= 0 ? lane_arenas_[lane_] : arenas_[stream_ == branch_ ? 1 : 0];
        bytes = std::max<size_t>(bytes, 256);
        if (bytes <= a.size) return a.data;
        DSV4_CHECK(!capturing_, "cuda: scratch arena would grow inside a captured sequence ({} bytes)", bytes);
        check(cudaStreamSynchronize(stream_), "synchronize (scratch)");
        drop_graphs();
        if (a.data) cudaFree(a.data);
        held(-int64_t(a.size));
        a = Arena{};
        const size_t want = bytes + bytes / 4;
        check(cudaMalloc(&a.data, want), "cudaMalloc(scratch)");
        a.size = want;
        held(int64_t(want));
        return a.data;
    }

    // A chunk of a weight from the mapped file into pinned staging, by several threads: from the page cache (a
    // model loaded again) one thread copied 6.4 GB/s on the H200's host, eight 26-29 GB/s, about what the host link
    // takes; from a cold file the disk bounds either (docs/cuda-journal.md, "Session 38").
    void copy_to_staging(uint8_t * pinned, const uint8_t * src, size_t n) {
        if (!upload_pool_) upload_pool_ = std::make_unique<ThreadPool>(upload_threads_);
        upload_pool_->parallel_for(n, size_t(1) << 20, [&](size_t begin, size_t end, int) {
            std::memcpy(pinned + begin, src + begin, end - begin);
        });
    }

    // The whole pages inside [p, p + n): clean file pages, which the kernel drops (they can be read again).
    static void release_pages(const uint8_t * p, size_t n) {
        const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
        const uintptr_t first = (uintptr_t(p) + page - 1) / page * page, last = (uintptr_t(p) + n) / page * page;
        if (last > first) madvise(reinterpret_cast<void *>(first), last - first, MADV_PAGEOUT);
    }

    uint8_t * io_slot(int slot) {
        if (!io_pinned_) {
            check(cudaMallocHost(&io_pinned_, kIoSlots * kIoSlotBytes), "cudaMallocHost(io slots)");
            for (cudaEvent_t & e : io_done_) {
                check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
                check(cudaEventRecord(e, stream_), "cudaEventRecord");
            }
        }
        return static_cast<uint8_t *>(io_pinned_) + size_t(slot) * kIoSlotBytes;
    }

    uint8_t * stage_slot(int slot) {
        if (!pinned_[slot]) {
            check(cudaMallocHost(&pinned_[slot], kStageBytes), "cudaMallocHost(staging)");
            check(cudaMalloc(&dev_stage_[slot], kStageBytes), "cudaMalloc(staging)");
            held(int64_t(kStageBytes));
            check(cudaEventCreateWithFlags(&staged_[slot], cudaEventDisableTiming), "cudaEventCreate");
            check(cudaEventRecord(staged_[slot], stream_), "cudaEventRecord");
        }
        return static_cast<uint8_t *>(pinned_[slot]);
    }

    void drop_graphs() {
        for (auto & [key, exec] : graphs_)
            if (exec) cudaGraphExecDestroy(exec);
        graphs_.clear();
    }

    int dev_;
    bool graphs_enabled_;
    bool tensor_cores_;  // prefill products on gemm() (CudaBackendOptions::tensor_cores)
    std::string name_;
    cudaStream_t stream_ = nullptr;
    cudaStream_t side_ = nullptr;  // the decode boundaries' Sinkhorn, beside stream_ (mix_boundary)
    cudaEvent_t side_fork_ = nullptr, side_done_ = nullptr;
    // moe_cublas: a buffer of decoded experts is written (on side_) / read by its last product (on stream_)
    cudaEvent_t moe_decoded_[2] = {}, moe_read_[2] = {};
    bool side_pending_ = false;          // side_ has work stream_ has not joined
    const float * side_comb_ = nullptr;  // the comb whose Sinkhorn side_ ran last
    unsigned * sinkhorns_ = nullptr;     // device: Sinkhorns done since the last reset (mix_boundary)
    unsigned * upload_fence_ = nullptr;  // device: the word upload_weight's memset writes after a repack
    unsigned sinkhorns_launched_ = 0;    // launched since then
    cuda::Iq2Tables * iq2_ = nullptr;
    // [kHcRowsTokens + 1]: hc_mix's rows kernel counts its blocks per token here; the last is sinkhorns_
    unsigned * hc_done_ = nullptr;
    struct Arena {
        void * data = nullptr;
        size_t size = 0;
    };
    Arena arenas_[2];                // scratch(): stream_'s ops, a branch's ops
    cudaStream_t branch_ = nullptr;  // begin_branch .. end_branch's ops, beside stream_ (highest priority)
    cudaEvent_t branch_fork_ = nullptr, branch_done_ = nullptr;
    cudaStream_t origin_ = nullptr;  // stream_ while a branch's ops are issued on branch_
    bool in_branch_ = false;         // between begin_branch and end_branch
    bool branch_pending_ = false;    // branch_ has work stream_ has not joined
    bool branches_enabled_ = true;
    cudaStream_t lanes_[kMaxLanes] = {};  // begin_lanes .. end_lanes' ops, lane i on lanes_[i % kMaxLanes]
    cudaEvent_t lane_fork_ = nullptr, lane_done_[kMaxLanes] = {};
    Arena lane_arenas_[kMaxLanes];        // scratch() of each lane stream's ops
    cudaStream_t lane_origin_ = nullptr;  // stream_ while lanes' ops are issued
    int lane_ = -1;                       // the lane whose ops are issued, or -1
    int lanes_open_ = 0;                  // lane streams of the open lanes
    bool in_lanes_ = false;               // between begin_lanes and end_lanes
    bool lanes_enabled_ = true;           // DSV4_CUDA_LANES
    bool ring_enabled_ = true;            // DSV4_CUDA_RING: one token's large products on the ring kernel (matvec.cu)
    cublasHandle_t cublas_ = nullptr;     // created at the first product on cuBLAS
    bool cublas_enabled_ = true;
    int64_t cublas_min_tokens_ = kCublasMinTokens;
    // Off by default: on the synthetic files the experts' f16 copies cost about what cuBLAS's products save over the
    // tiles, and the 43-layer extrapolation does not gain (docs/cuda-journal.md, "Session 31").
    bool moe_cublas_enabled_ = false;
    int64_t moe_cublas_min_pairs_ = kMoeCublasMinPairs;
    int64_t moe_cublas_batch_ = INT64_MAX;  // experts a batch at most (tests: several batches of small experts)
    bool integrated_ = false;
    // Device bytes held now and at most (cudaMalloc'd buffers, weights, scratch, staging).
    int64_t held_bytes_ = 0;
    uint64_t peak_bytes_ = 0;
    void held(int64_t delta) {
        held_bytes_ += delta;
        peak_bytes_ = std::max(peak_bytes_, uint64_t(std::max<int64_t>(held_bytes_, 0)));
    }
    // Pinned slots for small writes and reads (a decode step's token and position, the candidates): a copy from
    // pageable memory to the device first waits for the stream, a host round trip per write while the GPU idles.
    static constexpr int kIoSlots = 4;
    static constexpr size_t kIoSlotBytes = size_t(64) << 10;
    void * io_pinned_ = nullptr;
    cudaEvent_t io_done_[kIoSlots] = {};
    int io_next_ = 0;
    void * pinned_[2] = {nullptr, nullptr};
    uint8_t * dev_stage_[2] = {nullptr, nullptr};
    cudaEvent_t staged_[2] = {nullptr, nullptr};
    int stage_next_ = 0;
    bool release_host_pages_ = false;
    int upload_threads_ = 1;
    std::unique_ptr<ThreadPool> upload_pool_;  // made at the first upload
    size_t uploaded_ = 0;
    double upload_seconds_ = 0;
    bool capturing_ = false;
    std::unordered_map<uint64_t, cudaGraphExec_t> graphs_;
    static constexpr size_t kMaxGraphs = 256;
    bool profile_ = false;
    std::vector<Timing> timings_;
    std::vector<cudaEvent_t> free_events_;
    std::map<std::string, std::pair<int64_t, double>> profile_totals_;
};

DeviceBuffer::~DeviceBuffer() { owner_->release(ptr_, size_); }

}  // namespace

int cuda_device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions & options) {
    return std::make_unique<CudaBackend>(options);
}

CudaMemoryInfo cuda_memory_info(int device) {
    CudaMemoryInfo m;
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        cudaGetLastError();
        return m;
    }
    if (prop.integrated) {
        m.integrated = true;
        m.total_bytes = prop.totalGlobalMem;
        m.free_bytes = std::min<uint64_t>(proc_field("/proc/meminfo", "MemAvailable"), m.total_bytes);
        return m;
    }
    int cur = 0;
    if (cudaGetDevice(&cur) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
        cudaGetLastError();
        return m;
    }
    size_t f = 0, t = 0;
    if (cudaMemGetInfo(&f, &t) == cudaSuccess) {
        m.free_bytes = f;
        m.total_bytes = t;
    } else {
        cudaGetLastError();
    }
    cudaSetDevice(cur);
    return m;
}

std::string cuda_device_summary() {
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    std::string s =
        fmt::format("CUDA runtime {}.{}, driver {}.{}", rt / 1000, rt % 1000 / 10, drv / 1000, drv % 1000 / 10);
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return s + fmt::format("; no GPU ({})", cudaGetErrorString(e));
    }
    if (n == 0) return s + "; no GPU";
    for (int i = 0; i < n; ++i) {
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
        s += fmt::format("\n  gpu {}: {}, sm_{}{}, {:.1f} GiB, {} SMs{}", i, p.name, p.major, p.minor,
                         double(p.totalGlobalMem) / double(1ull << 30), p.multiProcessorCount,
                         p.integrated ? ", integrated (unified memory)" : "");
    }
    return s;
}

bool cuda_tensor_core_product(GgmlType type, int64_t k, int64_t n) {
    return n >= cuda::kGemmMinTokens && cuda::gemm_supported(type, k);
}

bool cuda_tensor_core_moe(GgmlType gate, GgmlType down, int64_t dim, int64_t inner, int64_t n_pairs, int64_t n_expert) {
    return cuda::gemm_supported(gate, dim) && cuda::gemm_supported(down, inner) && n_pairs >= 8 * n_expert;
}

bool cuda_tensor_core_attention(int64_t head_dim, int64_t n, int64_t keys) {
    return cuda::attention_tensor_cores(head_dim, n, keys);
}

uint64_t cuda_scratch_bytes(const CudaScratchShape & s) {
    const uint64_t f = sizeof(float);
    const uint64_t pairs = uint64_t(s.n_ubatch * s.n_expert_used);
    // Hidden and output rows per pair (f32), the activations' copies (8-bit codes, scales and sums: < 1.5 bytes
    // a value; f16 on the tensor cores: 2), ids.
    const uint64_t moe = pairs * uint64_t(s.expert_ff + s.n_embd) * f +
                         (pairs * uint64_t(s.expert_ff) + uint64_t(s.n_ubatch * s.n_embd)) * 2 + pairs * 16 + (1 << 20);
    // On cuBLAS (when asked for, in chunks of at least kMoeCublasMinPairs pairs an expert on average).
    const int64_t inner = s.expert_ff, dim = s.n_embd;
    const uint64_t moe_cublas =
        moe_cublas_requested() && s.n_expert > 0 && int64_t(pairs) >= kMoeCublasMinPairs * s.n_expert
            ? moe_cublas_scratch(int64_t(pairs), s.n_expert, dim, inner,
                                 std::min(s.n_expert, kMoeCublasWeightBytes / (4 * inner * dim)))
                  .total()
            : 0;
    // A dense product's f16 activations on the tensor cores (the widest input is the attention output), and on
    // cuBLAS the largest decoded weight beside them.
    const uint64_t dense =
        uint64_t(s.n_ubatch * s.n_head * s.head_dim) * 2 + 256 +
        (s.n_ubatch >= kCublasMinTokens ? uint64_t(std::min(s.dense_weight, kCublasMaxWeight)) * 2 : 0);
    const int64_t rows = s.min_ratio > 0 ? s.n_ctx / s.min_ratio : 0;
    // indexer_select's scratch for n tokens; top_k 1: a larger k can only turn the decode top-k's split (its
    // candidates) off.
    auto idx_of = [&](int64_t n) { return rows > 0 ? uint64_t(indexer_op_scratch(n, rows, 1)) : 0; };
    // Attention splits only when few tokens fill the GPU: at most 64 splits of every head of 32 tokens.
    auto attn_of = [&](int64_t n) { return uint64_t(std::min<int64_t>(n, 32) * s.n_head * 64 * (s.head_dim + 2)) * f; };
    const uint64_t idx = idx_of(std::max<int64_t>(s.n_ubatch, 1)), attn = attn_of(s.n_ubatch);
    // A branch's arena (decode steps): the indexer's scratch and its query product's activation codes (its input,
    // the low-rank query, is narrower than the embedding).
    const int64_t branch_tokens = std::min(std::max<int64_t>(s.n_ubatch, 1), kBranchMaxTokens);
    const uint64_t branch = rows > 0 ? idx_of(branch_tokens) + uint64_t(branch_tokens * s.n_embd) * 2 + 4096 : 0;
    // A batched step's lanes (one a sequence, at most kMaxLanes): one token's attention partials or indexer scratch.
    const uint64_t lane = std::max(idx_of(1), attn_of(1));
    const uint64_t lanes = s.lanes > 1 ? uint64_t(std::min<int64_t>(s.lanes, kMaxLanes)) * lane : 0;
    // The arena holds one op's scratch at a time; the branch's and the lanes' arenas and the upload staging stay
    // allocated beside it.
    return std::max({moe, moe_cublas, idx, attn, dense}) + branch + lanes + 2 * kStageBytes;
}

}  // namespace dsv4
