// DSML, DeepSeek V4's tool-call markup: rendering tool definitions and past calls the way the official encoder does,
// and parsing model output (whole or streamed) into reasoning, content and tool calls. The canonical form:
//
//   \n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="NAME">\n
//   <｜DSML｜parameter name="K" string="true">RAW TEXT</｜DSML｜parameter>\n
//   <｜DSML｜parameter name="K2" string="false">JSON</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>
//
// docs/chat-format.md lists the deviations the parsers tolerate.
#pragma once

#include "text/chat.h"

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

// ---------------------------------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------------------------------

// Python's json.dumps(json.loads(text), ensure_ascii=False): ", " and ": " separators, key order kept, non-ASCII
// raw, floats in repr form. Throws dsv4::Error when `json_text` is not JSON or nests deeper than kMaxJsonDepth.
std::string python_json_dumps(std::string_view json_text);
// json.dumps of one string (quoted and escaped). Invalid UTF-8 bytes become U+FFFD.
std::string python_json_string(std::string_view text);
// The deepest nesting of arrays and objects in a JSON text (strings skipped, validity not checked). JSON deeper than
// kMaxJsonDepth is refused everywhere: serializers recurse, and a hostile request must not exhaust the stack.
int json_nesting_depth(std::string_view json_text);
inline constexpr int kMaxJsonDepth = 256;

// A tool definition as the function object the tools block lists (Python json.dumps form). OpenAI:
// {"type":"function","function":{…}} → the inner object as given (a bare function object is accepted too).
// Anthropic: {"name","description","input_schema",…} → {"name","description","parameters"}. Throws dsv4::Error
// naming the field ("function.name: …").
std::string function_from_openai_tool(std::string_view tool_json);
std::string function_from_anthropic_tool(std::string_view tool_json);

// The "## Tools" block for the given function objects (JSON texts), ending with its final "\n".
std::vector<TextPiece> render_tools_block(const std::vector<std::string> & functions);

// What follows an assistant turn's content for these calls. When every call carries raw_dsml, the distinct raw
// blocks in order (replay exactly as sampled); otherwise "\n\n" + the canonical block. Arguments that are not a
// JSON object are wrapped as one parameter named "arguments" (the official fallback).
std::vector<TextPiece> render_tool_calls(const std::vector<ToolCall> & calls);

// ---------------------------------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------------------------------

struct DsmlEvent {
    enum class Kind { reasoning, content, tool_call_start, tool_args, tool_call_end };
    Kind kind = Kind::content;
    std::string text;      // reasoning / content delta, or an arguments JSON fragment (tool_args)
    int index = -1;        // tool call number within the completion, from 0 (tool_* kinds)
    ToolCall call;         // tool_call_start: name; tool_call_end: name, arguments, raw_dsml (id is left to the caller)
    bool complete = true;  // tool_call_end: false when finish() had to close the call's markup
};

// Incremental parser for one completion, fed detokenized text as it is generated. Events come in order; a tool
// call starts as soon as its invoke header is complete, its arguments stream as JSON fragments whose
// concatenation is exactly the final arguments, and all calls of a block end together when the block is over (the
// raw bytes of the whole block belong to each of them). Only bytes that might still be markup are held back.
// Nothing is lost: the reasoning and content deltas and the raw blocks, in event order, are the input minus a
// leading "<think>", the "</think>" that ends reasoning and anything from an EOS literal on.
class DsmlStreamParser {
  public:
    // thinking: the prompt ended with <think>, so the completion starts with reasoning.
    explicit DsmlStreamParser(bool thinking);
    DsmlStreamParser(DsmlStreamParser &&) noexcept;
    DsmlStreamParser & operator=(DsmlStreamParser &&) noexcept;
    ~DsmlStreamParser();

    std::vector<DsmlEvent> feed(std::string_view delta);
    // End of generation: flushes held-back text and closes any open markup.
    std::vector<DsmlEvent> finish();

    bool reasoning_closed() const;  // a "</think>" ended the reasoning

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

struct ParsedCompletion {
    std::string reasoning;
    std::string content;
    std::vector<ToolCall> tool_calls;  // ids empty
    bool reasoning_closed = false;     // thinking mode: "</think>" was seen
    bool truncated = false;            // the text ended inside tool-call markup
};

// A whole completion, parsed exactly as DsmlStreamParser would parse it streamed.
ParsedCompletion parse_completion(std::string_view text, bool thinking);

}  // namespace dsv4
