#include "util/thread_pool.h"

#include <chrono>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dsv4 {

static thread_local bool t_inside_pool = false;
static constexpr std::chrono::microseconds kSpinGrace{2000};

// A pause for the first iterations of a spin, then a yield: on an oversubscribed machine (ctest -j on two
// cores) a spinning worker must hand its core to whoever has real work.
static inline void cpu_relax(int spin) {
    if (spin < 4096) {
#if defined(__x86_64__)
        _mm_pause();
#endif
    } else {
        std::this_thread::yield();
    }
}

ThreadPool::ThreadPool(int n_threads) {
    if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
    n_threads_ = n_threads;
    for (int t = 1; t < n_threads_; ++t) workers_.emplace_back([this, t] { worker_main(t); });
}

ThreadPool::~ThreadPool() {
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (auto & w : workers_) w.join();
}

void ThreadPool::drain(int thread) {
    for (;;) {
        size_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
        if (task >= n_tasks_) break;
        fn_(ctx_, task, thread);
    }
}

void ThreadPool::worker_main(int thread) {
    t_inside_pool = true;
    uint32_t seen = 0;
    for (;;) {
        // Spin for a while before sleeping: a forward pass issues parallel regions microseconds apart, and a
        // futex wake-up costs tens of microseconds. Idle workers fall asleep after the grace period.
        uint32_t gen = generation_.load(std::memory_order_acquire);
        const auto deadline = std::chrono::steady_clock::now() + kSpinGrace;
        for (int spin = 0; gen == seen; ++spin) {
            cpu_relax(spin);
            gen = generation_.load(std::memory_order_acquire);
            if ((spin & 255) == 255 && std::chrono::steady_clock::now() > deadline) break;
        }
        if (gen == seen) {
            generation_.wait(seen, std::memory_order_acquire);
            continue;
        }
        seen = gen;
        if (stop_) return;
        drain(thread);
        if (pending_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_workers_.notify_one();
    }
}

void ThreadPool::run_raw(size_t n_tasks, TaskFn fn, void * ctx) {
    if (n_tasks == 0) return;
    if (n_threads_ == 1 || n_tasks == 1 || t_inside_pool) {
        for (size_t i = 0; i < n_tasks; ++i) fn(ctx, i, 0);
        return;
    }
    fn_ = fn;
    ctx_ = ctx;
    n_tasks_ = n_tasks;
    next_task_.store(0, std::memory_order_relaxed);
    pending_workers_.store(uint32_t(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();

    t_inside_pool = true;
    drain(0);
    t_inside_pool = false;

    uint32_t left = pending_workers_.load(std::memory_order_acquire);
    const auto deadline = std::chrono::steady_clock::now() + kSpinGrace;
    for (int spin = 0; left != 0; ++spin) {
        cpu_relax(spin);
        left = pending_workers_.load(std::memory_order_acquire);
        if ((spin & 255) == 255 && std::chrono::steady_clock::now() > deadline) break;
    }
    while (left != 0) {
        pending_workers_.wait(left, std::memory_order_acquire);
        left = pending_workers_.load(std::memory_order_acquire);
    }
}

}  // namespace dsv4
