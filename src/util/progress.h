// A progress line on stderr for long byte-counted jobs (conversion, synthesis, loading): rewritten in place on a
// terminal, one line per second otherwise (logs).
#pragma once

#include "util/timer.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <unistd.h>

namespace dsv4 {

class ProgressLine {
  public:
    ProgressLine() : tty_(isatty(2)) {}

    void update(uint64_t done, uint64_t total) {
        const double t = timer_.seconds();
        if (t - last_ < 1.0 && done != total) return;
        last_ = t;
        std::fprintf(stderr, "%s%5.1f%%  %.2f of %.2f GB  %.0f MB/s%s", tty_ ? "\r" : "",
                     100.0 * double(done) / double(std::max<uint64_t>(total, 1)), double(done) / 1e9,
                     double(total) / 1e9, double(done) / 1e6 / std::max(t, 1e-3), tty_ ? "" : "\n");
        shown_ = true;
    }
    // Ends the line on a terminal.
    void finish() {
        if (tty_ && shown_) std::fputc('\n', stderr);
    }
    double seconds() const { return timer_.seconds(); }

  private:
    bool tty_;
    bool shown_ = false;
    Timer timer_;
    double last_ = -1;
};

}  // namespace dsv4
