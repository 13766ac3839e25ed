// Levelled logging to stderr. The level comes from set_log_level() or the DSV4_LOG environment variable
// (error, warn, info, debug). Thread-safe: one line is written with one call.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace dsv4 {

enum class LogLevel { error = 0, warn = 1, info = 2, debug = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
bool parse_log_level(std::string_view name, LogLevel * out);
void log_write(LogLevel level, std::string_view message);

template <typename... Args> void log_error(fmt::format_string<Args...> f, Args &&... a) {
    log_write(LogLevel::error, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args> void log_warn(fmt::format_string<Args...> f, Args &&... a) {
    if (log_level() >= LogLevel::warn) log_write(LogLevel::warn, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args> void log_info(fmt::format_string<Args...> f, Args &&... a) {
    if (log_level() >= LogLevel::info) log_write(LogLevel::info, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args> void log_debug(fmt::format_string<Args...> f, Args &&... a) {
    if (log_level() >= LogLevel::debug) log_write(LogLevel::debug, fmt::format(f, std::forward<Args>(a)...));
}

}  // namespace dsv4
