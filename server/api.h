// The wire formats of dsv4-server: the generation options each API spells its own way, the response bodies and the
// streaming event sequences of OpenAI chat completions, OpenAI completions, Anthropic messages and OpenAI Responses,
// and the error bodies. server.cpp drives a generation and calls a Writer with what happened; a Writer turns that
// into bytes. Nothing here touches HTTP or the engine's threads.
#pragma once

#include "engine/scheduler.h"
#include "server/chat_request.h"
#include "text/dsml.h"
#include "util/error.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4::api {

// ---------------------------------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------------------------------

enum class Style { openai, anthropic };

// A request the server refuses. The message names the field ("max_tokens: …").
struct ApiError : Error {
    ApiError(int status, std::string message, std::string type = "invalid_request_error", std::string param = {},
             std::string code = {})
        : Error(message), status(status), type(std::move(type)), param(std::move(param)), code(std::move(code)) {}
    int status;
    std::string type;   // OpenAI-style type; anthropic_type() maps it
    std::string param;  // the JSON path of the offending field, when known
    std::string code;   // e.g. "context_length_exceeded"
};

// {"error": {"message", "type", "param", "code"}} or {"type": "error", "error": {"type", "message"}}.
std::string error_body(Style style, int status, std::string_view message, std::string_view type = {},
                       std::string_view param = {}, std::string_view code = {});
// The error type a status gets when none is given (invalid_request_error, authentication_error, …), per style.
std::string default_error_type(Style style, int status);

// ---------------------------------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------------------------------

// What the server knows about itself when answering.
struct ServerInfo {
    std::string model_id;  // the id /v1/models lists and responses carry
    int64_t n_ctx = 0;
    int64_t max_output = 0;  // default and cap of max_tokens (0: the context's room)
};

class Writer;

struct Prepared {
    bool chat = true;                 // a chat prompt (rendered, DSML-parsed); false: a raw completion prompt
    ChatRequest request;              // chat
    std::string raw_prompt;           // completions: text, tokenized with the raw rule
    std::vector<int32_t> raw_tokens;  // completions: a token-id prompt
    int64_t max_tokens = 0;           // 0: as much as the context leaves (capped by ServerInfo::max_output)
    SamplingParams sampling;
    std::vector<std::string> stop;
    bool stream = false;
    std::unique_ptr<Writer> writer;
};

// Parse a request body: the chat prompt (chat_request.h) plus the generation options, and make the Writer that will
// answer it. Throw ApiError. `info` and `tokenizer` must outlive the Writer.
Prepared prepare_openai_chat(std::string_view body, const ServerInfo & info, const Tokenizer & tokenizer);
Prepared prepare_openai_completion(std::string_view body, const ServerInfo & info, const Tokenizer & tokenizer);
Prepared prepare_anthropic_messages(std::string_view body, const ServerInfo & info, const Tokenizer & tokenizer);
Prepared prepare_responses(std::string_view body, const ServerInfo & info, const Tokenizer & tokenizer);
// POST /v1/messages/count_tokens: the chat request only.
ChatRequest parse_anthropic_count_tokens(std::string_view body);

// ---------------------------------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------------------------------

// A finished generation, as every API reports it.
struct Outcome {
    std::string reasoning;
    std::string content;                 // chat: the visible answer; raw completions: all generated text
    std::vector<ToolCall> calls;         // ids assigned, arguments complete (or cut short)
    std::vector<GeneratedToken> tokens;  // with logprobs, when they were asked for
    FinishReason finish = FinishReason::eos;
    std::string stop_string;  // the stop string that ended generation (FinishReason::stop)
    GenerationUsage usage;
    int64_t reasoning_tokens = 0;
};

// One request's response: streamed (the event methods, each returning bytes to send) or whole (response()).
class Writer {
  public:
    Writer(const ServerInfo & info, const Tokenizer & tokenizer) : info_(info), tokenizer_(tokenizer) {}
    virtual ~Writer() = default;

    virtual Style style() const { return Style::openai; }
    virtual const char * tool_id_prefix() const { return "call_"; }
    // Asked for per-token log-probabilities.
    virtual bool wants_logprobs() const { return false; }

    // The generation left the queue: prompt size and cache hit are known.
    virtual std::string start(int64_t prompt_tokens, int64_t cached_tokens) = 0;
    virtual std::string reasoning(std::string_view delta) { return {}; }
    virtual std::string content(std::string_view delta) = 0;
    virtual std::string tool_start(int index, const ToolCall & call) { return {}; }
    virtual std::string tool_args(int index, std::string_view fragment) { return {}; }
    virtual std::string tool_end(int index, const ToolCall & call) { return {}; }
    virtual std::string logprobs(std::span<const GeneratedToken> tokens) { return {}; }
    virtual std::string finish(const Outcome & outcome) = 0;
    // The generation failed after the stream began: an error event that ends the stream.
    virtual std::string error_event(const ApiError & error) = 0;
    // The whole response (non-streaming), JSON.
    virtual std::string response(const Outcome & outcome) = 0;

  protected:
    const ServerInfo & info_;
    const Tokenizer & tokenizer_;
};

// One reply as it is generated: text (through the DSML parser for a chat reply) becomes the Outcome and, when
// streaming, the Writer's events. Tool calls get fresh ids with the Writer's prefix. The server's Runner drives it;
// so does the request fuzzer (tests/fuzz/api_fuzz.cpp).
class ReplyBuilder {
  public:
    // thinking: the reply starts inside reasoning. on_call: each tool call as it completes, id assigned (the server
    // remembers its raw DSML).
    ReplyBuilder(Writer & writer, bool streaming, bool chat, bool thinking,
                 std::function<void(const ToolCall &)> on_call = {});

    // Generated text, in order. Returns the bytes to send (empty when not streaming).
    std::string text(std::string_view t);
    // Generation ended normally (eos, stop, length), with outcome()'s finish, stop string and usage set: closes any
    // open markup and returns the Writer's last events.
    std::string finish();

    Outcome & outcome() { return outcome_; }

  private:
    std::string dispatch(const std::vector<DsmlEvent> & events);

    Writer & writer_;
    bool streaming_;
    bool chat_;
    DsmlStreamParser parser_;
    std::function<void(const ToolCall &)> on_call_;
    std::map<int, std::string> ids_;  // tool call index → id
    Outcome outcome_;
};

// Random ids: prefix + 24 letters and digits.
std::string random_id(std::string_view prefix);

}  // namespace dsv4::api
