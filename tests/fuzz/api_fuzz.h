// What api_fuzz.cpp's selector byte routes a request body to, shared with its corpus replay (api_fuzz_replay_test.cpp),
// which checks that the accepted seeds cover every route.
#pragma once

#include "server/api.h"

#include <string_view>

namespace dsv4::fuzz {

// Routes 0-3: chat completions, completions, messages, Responses; 4 and up: count_tokens (only `request` is set).
// Throws what the API's parser throws.
api::Prepared prepare_route(int route, std::string_view body, const api::ServerInfo & info, const Tokenizer & tok);

}  // namespace dsv4::fuzz
