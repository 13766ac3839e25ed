#include "util/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace dsv4 {

static LogLevel initial_level() {
    LogLevel level = LogLevel::info;
    if (const char * env = std::getenv("DSV4_LOG")) parse_log_level(env, &level);
    return level;
}

static std::atomic<LogLevel> g_level{initial_level()};
static std::mutex g_log_mutex;

void set_log_level(LogLevel level) { g_level.store(level); }
LogLevel log_level() { return g_level.load(std::memory_order_relaxed); }

bool parse_log_level(std::string_view name, LogLevel * out) {
    if (name == "error") *out = LogLevel::error;
    else if (name == "warn" || name == "warning") *out = LogLevel::warn;
    else if (name == "info") *out = LogLevel::info;
    else if (name == "debug") *out = LogLevel::debug;
    else return false;
    return true;
}

void log_write(LogLevel level, std::string_view message) {
    static const char * const prefix[] = {"error: ", "warning: ", "", "debug: "};
    std::lock_guard<std::mutex> lock(g_log_mutex);
    std::fprintf(stderr, "%s%.*s\n", prefix[int(level)], int(message.size()), message.data());
}

}  // namespace dsv4
