// The four generation APIs on the wire (api.h). Request options are validated here with errors that name the field;
// responses and SSE events are built with ordered JSON and dumped with invalid UTF-8 replaced, so no client-visible
// text can make serialization throw.
#include "server/api.h"

#include "text/dsml.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <random>

namespace dsv4::api {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

std::string dump(const ojson & j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }
std::string sse_data(const ojson & j) { return "data: " + dump(j) + "\n\n"; }
std::string sse_event(std::string_view name, const ojson & j) {
    return "event: " + std::string(name) + "\ndata: " + dump(j) + "\n\n";
}

int64_t unix_now() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// ---------------------------------------------------------------------------------------------------------------------
// Request fields
// ---------------------------------------------------------------------------------------------------------------------

[[noreturn]] void bad(const std::string & param, const std::string & problem) {
    throw ApiError(400, param + ": " + problem, "invalid_request_error", param);
}

json parse_body(std::string_view body) {
    if (json_nesting_depth(body) > kMaxJsonDepth)
        throw ApiError(400, fmt::format("request body: JSON nested deeper than {} levels", kMaxJsonDepth));
    json j;
    try {
        j = json::parse(body);
    } catch (const json::exception & e) {
        throw ApiError(400, fmt::format("request body: not valid JSON ({})", e.what()));
    }
    return j;
}

// chat_request.h errors start with the JSON path of the field.
ChatRequest chat_request(ChatRequest (*parse)(std::string_view), std::string_view body) {
    try {
        return parse(body);
    } catch (const Error & e) {
        std::string message = e.what();
        const size_t colon = message.find(": ");
        std::string param = colon == std::string::npos ? std::string() : message.substr(0, colon);
        if (param.find(' ') != std::string::npos) param.clear();
        throw ApiError(400, message, "invalid_request_error", param);
    }
}

const json * field(const json & body, const char * key) {
    auto it = body.find(key);
    return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::optional<int64_t> int_field(const json & body, const char * key, int64_t lo, int64_t hi) {
    const json * v = field(body, key);
    if (!v) return std::nullopt;
    double d = 0;
    if (v->is_number_integer())
        d = double(v->get<int64_t>());
    else if (v->is_number_unsigned())
        d = double(v->get<uint64_t>());
    else if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>())
        d = v->get<double>();
    else
        bad(key, "expected an integer");
    if (!(d >= double(lo) && d <= double(hi))) bad(key, fmt::format("must be between {} and {}", lo, hi));
    return int64_t(d);
}

std::optional<double> number_field(const json & body, const char * key, double lo, double hi) {
    const json * v = field(body, key);
    if (!v) return std::nullopt;
    if (!v->is_number()) bad(key, "expected a number");
    const double d = v->get<double>();
    if (!(d >= lo && d <= hi)) bad(key, fmt::format("must be between {} and {}", lo, hi));
    return d;
}

std::optional<bool> bool_field(const json & body, const char * key) {
    const json * v = field(body, key);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) bad(key, "expected a boolean");
    return v->get<bool>();
}

constexpr int64_t kMaxTokensLimit = std::numeric_limits<int32_t>::max();
constexpr size_t kMaxStops = 16;

std::vector<std::string> stop_field(const json & body, const char * key) {
    const json * v = field(body, key);
    if (!v) return {};
    std::vector<std::string> out;
    if (v->is_string()) {
        out.push_back(v->get<std::string>());
    } else if (v->is_array()) {
        if (v->size() > kMaxStops) bad(key, fmt::format("at most {} stop sequences", kMaxStops));
        for (size_t i = 0; i < v->size(); ++i) {
            if (!(*v)[i].is_string()) bad(fmt::format("{}[{}]", key, i), "expected a string");
            out.push_back((*v)[i].get<std::string>());
        }
    } else {
        bad(key, "expected a string or an array of strings");
    }
    for (const std::string & s : out)
        if (s.empty()) bad(key, "a stop sequence is empty");
    return out;
}

// temperature, top_p, top_k, min_p, seed: shared by every API (Anthropic has no min_p or seed, but accepting them
// costs nothing).
SamplingParams sampling_fields(const json & body) {
    SamplingParams s;
    if (auto t = number_field(body, "temperature", 0, 2)) s.temperature = float(*t);
    if (auto p = number_field(body, "top_p", 0, 1)) {
        if (*p == 0)
            s.greedy = true;  // only the single most likely token has mass 0 < p
        else
            s.top_p = float(*p);
    }
    if (auto k = int_field(body, "top_k", -1, kMaxTokensLimit)) s.top_k = *k < 0 ? 0 : int32_t(*k);
    if (auto m = number_field(body, "min_p", 0, 0.999999)) s.min_p = float(*m);
    if (auto seed = int_field(body, "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()))
        s.seed = uint64_t(*seed);
    for (const char * ignored : {"presence_penalty", "frequency_penalty", "repetition_penalty"})
        number_field(body, ignored, -1e9, 1e9);  // type-checked; not implemented (docs/server.md)
    return s;
}

// OpenAI's stream_options.include_usage (chat and raw completions): a last chunk with the usage.
bool include_usage_field(const json & body) {
    const json * so = field(body, "stream_options");
    if (!so) return false;
    if (!so->is_object()) bad("stream_options", "expected an object");
    return bool_field(*so, "include_usage").value_or(false);
}

void check_n(const json & body) {
    if (auto n = int_field(body, "n", 1, kMaxTokensLimit); n && *n != 1) bad("n", "only n = 1 is supported");
}

int64_t max_tokens_field(const json & body, std::initializer_list<const char *> keys) {
    int64_t out = 0;
    for (const char * key : keys)
        if (auto v = int_field(body, key, 1, kMaxTokensLimit)) out = *v;
    return out;
}

// ---------------------------------------------------------------------------------------------------------------------
// Shared response pieces
// ---------------------------------------------------------------------------------------------------------------------

ojson logprob_entry(const Tokenizer & tok, int32_t id, float logprob) {
    const std::string bytes = tok.token_bytes(id);
    ojson b = ojson::array();
    for (unsigned char c : bytes) b.push_back(int(c));
    return ojson{{"token", bytes}, {"logprob", logprob}, {"bytes", std::move(b)}};
}

ojson openai_logprobs(const Tokenizer & tok, std::span<const GeneratedToken> tokens) {
    ojson content = ojson::array();
    for (const GeneratedToken & t : tokens) {
        ojson e = logprob_entry(tok, t.id, t.logprob);
        ojson top = ojson::array();
        for (const TokenLogprob & alt : t.top) top.push_back(logprob_entry(tok, alt.id, alt.logprob));
        e["top_logprobs"] = std::move(top);
        content.push_back(std::move(e));
    }
    return ojson{{"content", std::move(content)}, {"refusal", nullptr}};
}

// A tool call's arguments as a JSON object (Anthropic input): cut-short or non-object arguments keep their text.
ojson arguments_object(const std::string & arguments) {
    ojson j = ojson::parse(arguments, nullptr, false);
    if (j.is_object()) return j;
    return ojson{{"arguments", arguments}};
}

const char * openai_finish(const Outcome & o) {
    switch (o.finish) {
        case FinishReason::length:
            return "length";
        case FinishReason::stop:
            return "stop";
        default:
            return o.calls.empty() ? "stop" : "tool_calls";
    }
}

ojson error_json(Style style, int status, std::string_view message, std::string_view type, std::string_view param,
                 std::string_view code) {
    std::string t = type.empty() ? default_error_type(style, status) : std::string(type);
    if (style == Style::anthropic) {
        if (t == "invalid_request_error" || t == "authentication_error" || t == "not_found_error" ||
            t == "overloaded_error" || t == "api_error" || t == "permission_error" || t == "request_too_large" ||
            t == "rate_limit_error") {
        } else {
            t = default_error_type(style, status);
        }
        return ojson{{"type", "error"}, {"error", {{"type", t}, {"message", message}}}};
    }
    return ojson{{"error",
                  {{"message", message},
                   {"type", t},
                   {"param", param.empty() ? ojson(nullptr) : ojson(param)},
                   {"code", code.empty() ? ojson(nullptr) : ojson(code)}}}};
}

// The end of an OpenAI stream (chat and raw completions): the last chunk, with stream_options.include_usage a
// chunk of no choices that carries the usage (built on `usage_base`, the API's chunk fields; null without it),
// then [DONE].
std::string openai_stream_end(std::string last_chunk, ojson usage_base, ojson usage) {
    if (!usage_base.is_null()) {
        usage_base["choices"] = ojson::array();
        usage_base["usage"] = std::move(usage);
        last_chunk += sse_data(usage_base);
    }
    return last_chunk + "data: [DONE]\n\n";
}

std::string openai_error_event(const ApiError & e) {
    return sse_data(error_json(Style::openai, e.status, e.what(), e.type, e.param, e.code)) + "data: [DONE]\n\n";
}

// ---------------------------------------------------------------------------------------------------------------------
// OpenAI chat completions
// ---------------------------------------------------------------------------------------------------------------------

class OpenAiChatWriter final : public Writer {
  public:
    OpenAiChatWriter(const ServerInfo & info, const Tokenizer & tok, bool include_usage, bool logprobs)
        : Writer(info, tok), include_usage_(include_usage), logprobs_(logprobs) {}

    bool wants_logprobs() const override { return logprobs_; }

    std::string start(int64_t, int64_t) override { return chunk({{"role", "assistant"}, {"content", ""}}); }
    std::string reasoning(std::string_view d) override { return chunk({{"reasoning_content", d}}); }
    std::string content(std::string_view d) override { return chunk({{"content", d}}); }
    std::string tool_start(int index, const ToolCall & call) override {
        return chunk({{"tool_calls", ojson::array({{{"index", index},
                                                    {"id", call.id},
                                                    {"type", "function"},
                                                    {"function", {{"name", call.name}, {"arguments", ""}}}}})}});
    }
    std::string tool_args(int index, std::string_view fragment) override {
        return chunk({{"tool_calls", ojson::array({{{"index", index}, {"function", {{"arguments", fragment}}}}})}});
    }
    std::string logprobs(std::span<const GeneratedToken> tokens) override {
        return chunk(ojson::object(), nullptr, openai_logprobs(tokenizer_, tokens));
    }
    std::string finish(const Outcome & o) override {
        return openai_stream_end(chunk(ojson::object(), openai_finish(o)),
                                 include_usage_ ? base("chat.completion.chunk") : ojson(), usage(o));
    }
    std::string error_event(const ApiError & e) override { return openai_error_event(e); }
    std::string response(const Outcome & o) override {
        ojson message{{"role", "assistant"}, {"content", o.content}};
        if (!o.reasoning.empty()) message["reasoning_content"] = o.reasoning;
        if (!o.calls.empty()) {
            ojson calls = ojson::array();
            for (const ToolCall & c : o.calls)
                calls.push_back(
                    {{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
            message["tool_calls"] = std::move(calls);
        }
        ojson j = base("chat.completion");
        j["choices"] = ojson::array({{{"index", 0},
                                      {"message", std::move(message)},
                                      {"logprobs", logprobs_ ? openai_logprobs(tokenizer_, o.tokens) : ojson(nullptr)},
                                      {"finish_reason", openai_finish(o)}}});
        j["usage"] = usage(o);
        return dump(j);
    }

  private:
    ojson base(const char * object) const {
        return ojson{{"id", id_},
                     {"object", object},
                     {"created", created_},
                     {"model", info_.model_id},
                     {"system_fingerprint", "dsv4"}};
    }
    std::string chunk(ojson delta, ojson finish = nullptr, ojson logprobs = nullptr) const {
        ojson j = base("chat.completion.chunk");
        j["choices"] = ojson::array({{{"index", 0},
                                      {"delta", std::move(delta)},
                                      {"logprobs", std::move(logprobs)},
                                      {"finish_reason", std::move(finish)}}});
        return sse_data(j);
    }
    static ojson usage(const Outcome & o) {
        return {{"prompt_tokens", o.usage.prompt_tokens},
                {"completion_tokens", o.usage.completion_tokens},
                {"total_tokens", o.usage.prompt_tokens + o.usage.completion_tokens},
                {"prompt_tokens_details", {{"cached_tokens", o.usage.cached_tokens}}},
                {"completion_tokens_details", {{"reasoning_tokens", o.reasoning_tokens}}}};
    }

    std::string id_ = random_id("chatcmpl-");
    int64_t created_ = unix_now();
    bool include_usage_;
    bool logprobs_;
};

// ---------------------------------------------------------------------------------------------------------------------
// OpenAI completions (raw prompt)
// ---------------------------------------------------------------------------------------------------------------------

class CompletionWriter final : public Writer {
  public:
    CompletionWriter(const ServerInfo & info, const Tokenizer & tok, bool include_usage, int n_logprobs)
        : Writer(info, tok), include_usage_(include_usage), n_logprobs_(n_logprobs) {}

    bool wants_logprobs() const override { return n_logprobs_ >= 0; }
    std::string start(int64_t, int64_t) override { return {}; }
    std::string content(std::string_view d) override { return chunk(d, nullptr, nullptr); }
    std::string logprobs(std::span<const GeneratedToken> tokens) override {
        return chunk("", nullptr, legacy_logprobs(tokens));
    }
    std::string finish(const Outcome & o) override {
        return openai_stream_end(chunk("", o.finish == FinishReason::length ? "length" : "stop", nullptr),
                                 include_usage_ ? base() : ojson(), usage(o));
    }
    std::string error_event(const ApiError & e) override { return openai_error_event(e); }
    std::string response(const Outcome & o) override {
        ojson j = base();
        j["choices"] = ojson::array({{{"text", o.content},
                                      {"index", 0},
                                      {"logprobs", wants_logprobs() ? legacy_logprobs(o.tokens) : ojson(nullptr)},
                                      {"finish_reason", o.finish == FinishReason::length ? "length" : "stop"}}});
        j["usage"] = usage(o);
        return dump(j);
    }

  private:
    ojson base() const {
        return ojson{{"id", id_}, {"object", "text_completion"}, {"created", created_}, {"model", info_.model_id}};
    }
    std::string chunk(std::string_view text, ojson finish, ojson logprobs) const {
        ojson j = base();
        j["choices"] = ojson::array(
            {{{"text", text}, {"index", 0}, {"logprobs", std::move(logprobs)}, {"finish_reason", std::move(finish)}}});
        return sse_data(j);
    }
    // The legacy shape: parallel arrays, and the alternatives as {token: logprob} objects.
    ojson legacy_logprobs(std::span<const GeneratedToken> tokens) const {
        ojson toks = ojson::array(), lps = ojson::array(), tops = ojson::array(), offsets = ojson::array();
        for (const GeneratedToken & t : tokens) {
            toks.push_back(tokenizer_.token_bytes(t.id));
            lps.push_back(t.logprob);
            ojson top = ojson::object();
            for (const TokenLogprob & alt : t.top) top[tokenizer_.token_bytes(alt.id)] = alt.logprob;
            tops.push_back(std::move(top));
            offsets.push_back(offset_);
            offset_ += int64_t(tokenizer_.token_bytes(t.id).size());
        }
        return {{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
    }
    static ojson usage(const Outcome & o) {
        return {{"prompt_tokens", o.usage.prompt_tokens},
                {"completion_tokens", o.usage.completion_tokens},
                {"total_tokens", o.usage.prompt_tokens + o.usage.completion_tokens},
                {"prompt_tokens_details", {{"cached_tokens", o.usage.cached_tokens}}}};
    }

    std::string id_ = random_id("cmpl-");
    int64_t created_ = unix_now();
    bool include_usage_;
    int n_logprobs_;
    mutable int64_t offset_ = 0;
};

// ---------------------------------------------------------------------------------------------------------------------
// Anthropic messages
// ---------------------------------------------------------------------------------------------------------------------

class AnthropicWriter final : public Writer {
  public:
    using Writer::Writer;

    Style style() const override { return Style::anthropic; }
    const char * tool_id_prefix() const override { return "toolu_"; }

    std::string start(int64_t prompt_tokens, int64_t cached_tokens) override {
        ojson message{{"id", id_},
                      {"type", "message"},
                      {"role", "assistant"},
                      {"model", info_.model_id},
                      {"content", ojson::array()},
                      {"stop_reason", nullptr},
                      {"stop_sequence", nullptr},
                      {"usage", usage(prompt_tokens, cached_tokens, 0)}};
        return sse_event("message_start", {{"type", "message_start"}, {"message", std::move(message)}});
    }
    std::string reasoning(std::string_view d) override {
        std::string out = open("thinking", {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}});
        return out + delta({{"type", "thinking_delta"}, {"thinking", d}});
    }
    std::string content(std::string_view d) override {
        std::string out = open("text", {{"type", "text"}, {"text", ""}});
        return out + delta({{"type", "text_delta"}, {"text", d}});
    }
    std::string tool_start(int, const ToolCall & call) override {
        // A new block always: two calls are two tool_use blocks.
        std::string out = close();
        kind_ = "tool_use";
        out += sse_event("content_block_start",
                         {{"type", "content_block_start"},
                          {"index", index_},
                          {"content_block",
                           {{"type", "tool_use"}, {"id", call.id}, {"name", call.name}, {"input", ojson::object()}}}});
        return out;
    }
    std::string tool_args(int, std::string_view fragment) override {
        if (kind_ != "tool_use") return {};
        return delta({{"type", "input_json_delta"}, {"partial_json", fragment}});
    }
    std::string finish(const Outcome & o) override {
        std::string out = close();
        ojson u = usage(o.usage.prompt_tokens, o.usage.cached_tokens, o.usage.completion_tokens);
        out += sse_event("message_delta",
                         {{"type", "message_delta"},
                          {"delta", {{"stop_reason", stop_reason(o)}, {"stop_sequence", stop_sequence(o)}}},
                          {"usage", std::move(u)}});
        return out + sse_event("message_stop", {{"type", "message_stop"}});
    }
    std::string error_event(const ApiError & e) override {
        return sse_event("error", error_json(Style::anthropic, e.status, e.what(), e.type, {}, {}));
    }
    std::string response(const Outcome & o) override {
        ojson content = ojson::array();
        if (!o.reasoning.empty())
            content.push_back({{"type", "thinking"}, {"thinking", o.reasoning}, {"signature", kSignature}});
        if (!o.content.empty()) content.push_back({{"type", "text"}, {"text", o.content}});
        for (const ToolCall & c : o.calls)
            content.push_back(
                {{"type", "tool_use"}, {"id", c.id}, {"name", c.name}, {"input", arguments_object(c.arguments)}});
        return dump({{"id", id_},
                     {"type", "message"},
                     {"role", "assistant"},
                     {"model", info_.model_id},
                     {"content", std::move(content)},
                     {"stop_reason", stop_reason(o)},
                     {"stop_sequence", stop_sequence(o)},
                     {"usage", usage(o.usage.prompt_tokens, o.usage.cached_tokens, o.usage.completion_tokens)}});
    }

  private:
    // Thinking blocks carry a signature in Anthropic's API; ours is a constant marker (there is nothing to verify:
    // the server renders whatever thinking text comes back).
    static constexpr const char * kSignature = "dsv4";

    // Anthropic's input_tokens excludes what was read from the cache.
    static ojson usage(int64_t prompt, int64_t cached, int64_t output) {
        return {{"input_tokens", prompt - cached},
                {"cache_creation_input_tokens", 0},
                {"cache_read_input_tokens", cached},
                {"output_tokens", output}};
    }
    static const char * stop_reason(const Outcome & o) {
        switch (o.finish) {
            case FinishReason::length:
                return "max_tokens";
            case FinishReason::stop:
                return "stop_sequence";
            default:
                return o.calls.empty() ? "end_turn" : "tool_use";
        }
    }
    static ojson stop_sequence(const Outcome & o) {
        return o.finish == FinishReason::stop ? ojson(o.stop_string) : ojson(nullptr);
    }
    std::string open(const char * kind, ojson block) {
        if (kind_ == kind) return {};
        std::string out = close();
        kind_ = kind;
        return out +
               sse_event("content_block_start",
                         {{"type", "content_block_start"}, {"index", index_}, {"content_block", std::move(block)}});
    }
    std::string close() {
        if (kind_.empty()) return {};
        std::string out;
        if (kind_ == "thinking") out = delta({{"type", "signature_delta"}, {"signature", kSignature}});
        out += sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
        kind_.clear();
        ++index_;
        return out;
    }
    std::string delta(ojson d) const {
        return sse_event("content_block_delta",
                         {{"type", "content_block_delta"}, {"index", index_}, {"delta", std::move(d)}});
    }

    std::string id_ = random_id("msg_");
    std::string kind_;  // the open block's type, "" when none
    int index_ = 0;
};

// ---------------------------------------------------------------------------------------------------------------------
// OpenAI Responses
// ---------------------------------------------------------------------------------------------------------------------

class ResponsesWriter final : public Writer {
  public:
    ResponsesWriter(const ServerInfo & info, const Tokenizer & tok, int64_t max_output)
        : Writer(info, tok), max_output_(max_output) {}

    std::string start(int64_t, int64_t) override {
        std::string out = event("response.created", {{"response", snapshot("in_progress", nullptr)}});
        return out + event("response.in_progress", {{"response", snapshot("in_progress", nullptr)}});
    }
    std::string reasoning(std::string_view d) override {
        std::string out = open("reasoning");
        out += event("response.reasoning_text.delta",
                     {{"item_id", current()["id"]}, {"output_index", index()}, {"content_index", 0}, {"delta", d}});
        text_ += d;
        return out;
    }
    std::string content(std::string_view d) override {
        std::string out = open("message");
        out += event("response.output_text.delta", {{"item_id", current()["id"]},
                                                    {"output_index", index()},
                                                    {"content_index", 0},
                                                    {"delta", d},
                                                    {"logprobs", ojson::array()}});
        text_ += d;
        return out;
    }
    std::string tool_start(int, const ToolCall & call) override {
        std::string out = close();
        kind_ = "function_call";
        output_.push_back({{"id", random_id("fc_")},
                           {"type", "function_call"},
                           {"status", "in_progress"},
                           {"arguments", ""},
                           {"call_id", call.id},
                           {"name", call.name}});
        return out + event("response.output_item.added", {{"output_index", index()}, {"item", current()}});
    }
    std::string tool_args(int, std::string_view fragment) override {
        if (kind_ != "function_call") return {};
        text_ += fragment;
        return event("response.function_call_arguments.delta",
                     {{"item_id", current()["id"]}, {"output_index", index()}, {"delta", fragment}});
    }
    std::string tool_end(int, const ToolCall & call) override {
        // Calls of one DSML block end together; the arguments of a closed item are final already.
        for (ojson & item : output_)
            if (item["type"] == "function_call" && item["call_id"] == call.id) item["arguments"] = call.arguments;
        return {};
    }
    std::string finish(const Outcome & o) override {
        std::string out = close();
        const bool incomplete = o.finish == FinishReason::length;
        ojson r = snapshot(incomplete ? "incomplete" : "completed", usage(o));
        if (incomplete) r["incomplete_details"] = {{"reason", "max_output_tokens"}};
        return out + event(incomplete ? "response.incomplete" : "response.completed", {{"response", std::move(r)}});
    }
    std::string error_event(const ApiError & e) override {
        ojson r = snapshot("failed", nullptr);
        r["error"] = {{"code", e.code.empty() ? std::string("server_error") : e.code}, {"message", e.what()}};
        return event("response.failed", {{"response", std::move(r)}});
    }
    std::string response(const Outcome & o) override {
        // Replay the events into the item list so both paths build the same output.
        if (!o.reasoning.empty()) reasoning(o.reasoning);
        if (!o.content.empty()) content(o.content);
        for (size_t i = 0; i < o.calls.size(); ++i) {
            tool_start(int(i), o.calls[i]);
            tool_args(int(i), o.calls[i].arguments);
        }
        close();
        const bool incomplete = o.finish == FinishReason::length;
        ojson r = snapshot(incomplete ? "incomplete" : "completed", usage(o));
        if (incomplete) r["incomplete_details"] = {{"reason", "max_output_tokens"}};
        return dump(r);
    }

  private:
    ojson snapshot(const char * status, ojson usage) const {
        return {{"id", id_},
                {"object", "response"},
                {"created_at", created_},
                {"status", status},
                {"model", info_.model_id},
                {"output", output_},
                {"parallel_tool_calls", true},
                {"tool_choice", "auto"},
                {"tools", ojson::array()},
                {"max_output_tokens", max_output_ > 0 ? ojson(max_output_) : ojson(nullptr)},
                {"incomplete_details", nullptr},
                {"error", nullptr},
                {"usage", std::move(usage)}};
    }
    static ojson usage(const Outcome & o) {
        return {{"input_tokens", o.usage.prompt_tokens},
                {"input_tokens_details", {{"cached_tokens", o.usage.cached_tokens}}},
                {"output_tokens", o.usage.completion_tokens},
                {"output_tokens_details", {{"reasoning_tokens", o.reasoning_tokens}}},
                {"total_tokens", o.usage.prompt_tokens + o.usage.completion_tokens}};
    }
    std::string event(const char * type, ojson body) {
        ojson j{{"type", type}, {"sequence_number", seq_++}};
        for (auto & [k, v] : body.items()) j[k] = v;
        return sse_event(type, j);
    }
    ojson & current() { return output_.back(); }
    int index() const { return int(output_.size()) - 1; }

    std::string open(const std::string & kind) {
        if (kind_ == kind) return {};
        std::string out = close();
        kind_ = kind;
        text_.clear();
        const bool message = kind == "message";
        output_.push_back(message ? ojson{{"id", random_id("msg_")},
                                          {"type", "message"},
                                          {"status", "in_progress"},
                                          {"role", "assistant"},
                                          {"content", ojson::array()}}
                                  : ojson{{"id", random_id("rs_")},
                                          {"type", "reasoning"},
                                          {"summary", ojson::array()},
                                          {"content", ojson::array()}});
        out += event("response.output_item.added", {{"output_index", index()}, {"item", current()}});
        ojson part = message ? ojson{{"type", "output_text"}, {"text", ""}, {"annotations", ojson::array()}}
                             : ojson{{"type", "reasoning_text"}, {"text", ""}};
        out += event("response.content_part.added",
                     {{"item_id", current()["id"]}, {"output_index", index()}, {"content_index", 0}, {"part", part}});
        return out;
    }
    std::string close() {
        if (kind_.empty()) return {};
        std::string out;
        ojson & item = current();
        if (kind_ == "message" || kind_ == "reasoning") {
            const bool message = kind_ == "message";
            ojson part = message ? ojson{{"type", "output_text"}, {"text", text_}, {"annotations", ojson::array()}}
                                 : ojson{{"type", "reasoning_text"}, {"text", text_}};
            out += event(message ? "response.output_text.done" : "response.reasoning_text.done",
                         {{"item_id", item["id"]}, {"output_index", index()}, {"content_index", 0}, {"text", text_}});
            out += event("response.content_part.done",
                         {{"item_id", item["id"]}, {"output_index", index()}, {"content_index", 0}, {"part", part}});
            item["content"] = ojson::array({part});
            if (message) item["status"] = "completed";
        } else {
            item["arguments"] = text_;
            item["status"] = "completed";
            out += event("response.function_call_arguments.done",
                         {{"item_id", item["id"]}, {"output_index", index()}, {"arguments", text_}});
        }
        out += event("response.output_item.done", {{"output_index", index()}, {"item", item}});
        kind_.clear();
        text_.clear();
        return out;
    }

    int64_t max_output_;
    std::string id_ = random_id("resp_");
    int64_t created_ = unix_now();
    ojson output_ = ojson::array();
    std::string kind_;  // the open item's type, "" when none
    std::string text_;  // the open item's text or arguments so far
    int64_t seq_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Public functions
// ---------------------------------------------------------------------------------------------------------------------

std::string default_error_type(Style style, int status) {
    const bool a = style == Style::anthropic;
    switch (status) {
        case 400:
            return "invalid_request_error";
        case 401:
            return a ? "authentication_error" : "invalid_request_error";
        case 403:
            return a ? "permission_error" : "invalid_request_error";
        case 404:
            return a ? "not_found_error" : "invalid_request_error";
        case 413:
            return a ? "request_too_large" : "invalid_request_error";
        case 429:
            return a ? "rate_limit_error" : "rate_limit_exceeded";
        case 503:
            return a ? "overloaded_error" : "server_error";
        default:
            return status >= 500 ? (a ? "api_error" : "server_error") : "invalid_request_error";
    }
}

std::string error_body(Style style, int status, std::string_view message, std::string_view type, std::string_view param,
                       std::string_view code) {
    return dump(error_json(style, status, message, type, param, code));
}

std::string random_id(std::string_view prefix) {
    static std::mutex mutex;
    static std::mt19937_64 rng{std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32)};
    static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::string out(prefix);
    std::lock_guard<std::mutex> lock(mutex);
    for (int i = 0; i < 24; ++i) out += kChars[rng() % (sizeof kChars - 1)];
    return out;
}

Prepared prepare_openai_chat(std::string_view body_text, const ServerInfo & info, const Tokenizer & tok) {
    json body = parse_body(body_text);
    Prepared p;
    p.request = chat_request(parse_openai_chat_request, body_text);
    if (body.is_array()) body = json::object();  // a bare messages array: no options
    check_n(body);
    p.max_tokens = max_tokens_field(body, {"max_tokens", "max_completion_tokens"});
    p.sampling = sampling_fields(body);
    p.stop = stop_field(body, "stop");
    p.stream = bool_field(body, "stream").value_or(false);
    const bool include_usage = include_usage_field(body);
    const bool logprobs = bool_field(body, "logprobs").value_or(false);
    if (auto n = int_field(body, "top_logprobs", 0, SamplingParams::kMaxLogprobs)) {
        if (!logprobs) bad("top_logprobs", "needs logprobs: true");
        p.sampling.n_logprobs = int32_t(*n);
    }
    p.writer = std::make_unique<OpenAiChatWriter>(info, tok, include_usage, logprobs);
    return p;
}

Prepared prepare_openai_completion(std::string_view body_text, const ServerInfo & info, const Tokenizer & tok) {
    json body = parse_body(body_text);
    if (!body.is_object()) throw ApiError(400, "request body: expected a JSON object");
    Prepared p;
    p.chat = false;
    const json * prompt = field(body, "prompt");
    if (!prompt) bad("prompt", "missing");
    if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) prompt = &(*prompt)[0];
    if (prompt->is_string()) {
        p.raw_prompt = prompt->get<std::string>();
        if (p.raw_prompt.empty()) bad("prompt", "empty");
    } else if (prompt->is_array() && !prompt->empty()) {
        for (size_t i = 0; i < prompt->size(); ++i) {
            const json & v = (*prompt)[i];
            if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.n_vocab())
                bad(fmt::format("prompt[{}]", i),
                    fmt::format("expected a token id below {} (one prompt per request)", tok.n_vocab()));
            p.raw_tokens.push_back(int32_t(v.get<int64_t>()));
        }
    } else {
        bad("prompt", "expected a string, an array with one string, or an array of token ids");
    }
    if (bool_field(body, "echo").value_or(false)) bad("echo", "not supported");
    if (field(body, "suffix")) bad("suffix", "not supported");
    if (auto b = int_field(body, "best_of", 1, kMaxTokensLimit); b && *b != 1) bad("best_of", "only 1 is supported");
    check_n(body);
    p.max_tokens = max_tokens_field(body, {"max_tokens"});
    if (!field(body, "max_tokens")) p.max_tokens = 16;  // the completions API's documented default
    p.sampling = sampling_fields(body);
    p.stop = stop_field(body, "stop");
    p.stream = bool_field(body, "stream").value_or(false);
    const bool include_usage = include_usage_field(body);
    int n_logprobs = -1;
    if (auto n = int_field(body, "logprobs", 0, SamplingParams::kMaxLogprobs)) {
        n_logprobs = int(*n);
        p.sampling.n_logprobs = int32_t(*n);
    }
    p.writer = std::make_unique<CompletionWriter>(info, tok, include_usage, n_logprobs);
    return p;
}

Prepared prepare_anthropic_messages(std::string_view body_text, const ServerInfo & info, const Tokenizer & tok) {
    json body = parse_body(body_text);
    if (!body.is_object()) throw ApiError(400, "request body: expected a JSON object");
    Prepared p;
    p.request = chat_request(parse_anthropic_messages_request, body_text);
    if (!field(body, "max_tokens")) bad("max_tokens", "missing");
    p.max_tokens = max_tokens_field(body, {"max_tokens"});
    p.sampling = sampling_fields(body);
    p.stop = stop_field(body, "stop_sequences");
    p.stream = bool_field(body, "stream").value_or(false);
    p.writer = std::make_unique<AnthropicWriter>(info, tok);
    return p;
}

ChatRequest parse_anthropic_count_tokens(std::string_view body) {
    return chat_request(parse_anthropic_messages_request, body);
}

Prepared prepare_responses(std::string_view body_text, const ServerInfo & info, const Tokenizer & tok) {
    json body = parse_body(body_text);
    if (!body.is_object()) throw ApiError(400, "request body: expected a JSON object");
    Prepared p;
    p.request = chat_request(parse_responses_request, body_text);
    p.max_tokens = max_tokens_field(body, {"max_tokens", "max_output_tokens"});
    p.sampling = sampling_fields(body);
    p.stream = bool_field(body, "stream").value_or(false);
    p.writer = std::make_unique<ResponsesWriter>(info, tok, p.max_tokens);
    return p;
}

// ---------------------------------------------------------------------------------------------------------------------
// A reply as it streams
// ---------------------------------------------------------------------------------------------------------------------

ReplyBuilder::ReplyBuilder(Writer & writer, bool streaming, bool chat, bool thinking,
                           std::function<void(const ToolCall &)> on_call)
    : writer_(writer), streaming_(streaming), chat_(chat), parser_(thinking), on_call_(std::move(on_call)) {}

std::string ReplyBuilder::text(std::string_view t) {
    if (t.empty()) return {};
    if (chat_) return dispatch(parser_.feed(t));
    outcome_.content += t;
    return streaming_ ? writer_.content(t) : std::string();
}

std::string ReplyBuilder::finish() {
    std::string out = chat_ ? dispatch(parser_.finish()) : std::string();
    if (streaming_) out += writer_.finish(outcome_);
    return out;
}

std::string ReplyBuilder::dispatch(const std::vector<DsmlEvent> & events) {
    std::string out;
    for (const DsmlEvent & e : events) {
        switch (e.kind) {
            case DsmlEvent::Kind::reasoning:
                outcome_.reasoning += e.text;
                if (streaming_) out += writer_.reasoning(e.text);
                break;
            case DsmlEvent::Kind::content:
                outcome_.content += e.text;
                if (streaming_) out += writer_.content(e.text);
                break;
            case DsmlEvent::Kind::tool_call_start: {
                ToolCall call = e.call;
                call.id = ids_[e.index] = random_id(writer_.tool_id_prefix());
                if (streaming_) out += writer_.tool_start(e.index, call);
                break;
            }
            case DsmlEvent::Kind::tool_args:
                if (streaming_) out += writer_.tool_args(e.index, e.text);
                break;
            case DsmlEvent::Kind::tool_call_end: {
                ToolCall call = e.call;
                call.id = ids_[e.index];
                if (on_call_) on_call_(call);
                if (streaming_) out += writer_.tool_end(e.index, call);
                outcome_.calls.push_back(std::move(call));
                break;
            }
        }
    }
    return out;
}

}  // namespace dsv4::api
