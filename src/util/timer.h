// Monotonic time.
#pragma once

#include <chrono>

namespace dsv4 {

inline double now_seconds() {
    using clock = std::chrono::steady_clock;
    return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

class Timer {
  public:
    Timer() : start_(now_seconds()) {}
    void reset() { start_ = now_seconds(); }
    double seconds() const { return now_seconds() - start_; }

  private:
    double start_;
};

}  // namespace dsv4
