// Small string helpers shared across layers.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

inline std::string join(const std::vector<std::string> & parts, std::string_view sep) {
    std::string out;
    for (size_t i = 0; i < parts.size(); ++i) {
        if (i) out += sep;
        out += parts[i];
    }
    return out;
}

}  // namespace dsv4
