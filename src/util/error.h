// Error handling used across dsv4: one exception type whose message names what failed and where
// (a file and a field, a tensor, a request field). Frontends catch it at their edge and turn it into
// a CLI message or an HTTP 4xx/5xx; nothing below the frontends prints or exits.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dsv4 {

class Error : public std::runtime_error {
  public:
    explicit Error(const std::string & what) : std::runtime_error(what) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args &&... args) {
    throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// Checks an invariant that input data (a file, a request) may violate; throws dsv4::Error.
#define DSV4_CHECK(cond, ...)                                                                                         \
    do {                                                                                                               \
        if (!(cond)) ::dsv4::fail(__VA_ARGS__);                                                                        \
    } while (0)

}  // namespace dsv4
