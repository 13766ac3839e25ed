// A fork-join thread pool for matrix work. The calling thread takes part, tasks are handed out through an
// atomic counter (so uneven tasks balance), and idle workers sleep on a futex after a short spin: decode issues
// hundreds of small parallel regions per token, so waking must be cheap, but a pool must not burn cores that
// other processes (ctest -j, the HTTP threads) need.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

namespace dsv4 {

class ThreadPool {
  public:
    // n_threads counts the calling thread; 0 means the number of hardware threads.
    explicit ThreadPool(int n_threads = 0);
    ~ThreadPool();
    ThreadPool(const ThreadPool &) = delete;
    ThreadPool & operator=(const ThreadPool &) = delete;

    int size() const { return n_threads_; }

    // Calls fn(task, thread) for every task in [0, n_tasks); thread is in [0, size()). Returns when all are done.
    // A call made from inside a task runs serially on that thread.
    template <typename F> void run(size_t n_tasks, F && fn) {
        auto trampoline = [](void * ctx, size_t task, int thread) { (*static_cast<F *>(ctx))(task, thread); };
        run_raw(n_tasks, trampoline, &fn);
    }

    // Splits [0, n) into chunks of at least `grain` items and calls fn(begin, end, thread) per chunk.
    template <typename F> void parallel_for(size_t n, size_t grain, F && fn) {
        if (n == 0) return;
        if (grain == 0) grain = 1;
        size_t chunks = std::min((n + grain - 1) / grain, size_t(n_threads_) * 4);
        if (chunks <= 1) {
            fn(size_t(0), n, 0);
            return;
        }
        size_t per = (n + chunks - 1) / chunks;
        run((n + per - 1) / per, [&](size_t c, int thread) { fn(c * per, std::min(n, (c + 1) * per), thread); });
    }

  private:
    using TaskFn = void (*)(void *, size_t, int);
    void run_raw(size_t n_tasks, TaskFn fn, void * ctx);
    void worker_main(int thread);
    void drain(int thread);

    int n_threads_ = 1;
    std::vector<std::thread> workers_;
    std::atomic<uint32_t> generation_{0};
    std::atomic<uint32_t> pending_workers_{0};
    std::atomic<size_t> next_task_{0};
    size_t n_tasks_ = 0;
    TaskFn fn_ = nullptr;
    void * ctx_ = nullptr;
    bool stop_ = false;
};

}  // namespace dsv4
