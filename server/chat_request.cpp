// Request parsing for the chat APIs. Bodies are read as ordered JSON so tool schemas keep the client's key order,
// which the tools block reproduces. Every error names the JSON path of the offending field.
#include "server/chat_request.h"

#include "text/dsml.h"
#include "util/error.h"
#include "util/strings.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <span>

namespace dsv4 {

namespace {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------------------------------
// JSON access with paths
// ---------------------------------------------------------------------------------------------------------------------

[[noreturn]] void bad(const std::string & path, std::string_view problem) { fail("{}: {}", path, problem); }

std::string index_path(const std::string & path, size_t i) { return path + "[" + std::to_string(i) + "]"; }
std::string field_path(const std::string & path, std::string_view key) {
    return path.empty() ? std::string(key) : path + "." + std::string(key);
}

ojson parse_body(std::string_view body) {
    if (json_nesting_depth(body) > kMaxJsonDepth)
        fail("request body: JSON nested deeper than {} levels", kMaxJsonDepth);
    ojson j;
    try {
        j = ojson::parse(body);
    } catch (const ojson::exception & e) {
        fail("request body: not valid JSON ({})", e.what());
    }
    return j;
}

// The member, or null when absent or JSON null (clients send null for "not given").
const ojson * member(const ojson & object, std::string_view key) {
    auto it = object.find(key);
    return it == object.end() || it->is_null() ? nullptr : &*it;
}

std::string string_member(const ojson & object, std::string_view key, const std::string & path, bool required) {
    const ojson * v = member(object, key);
    if (!v) {
        if (required) bad(field_path(path, key), "missing");
        return {};
    }
    if (!v->is_string()) bad(field_path(path, key), "expected a string");
    return v->get<std::string>();
}

const ojson & object_at(const ojson & v, const std::string & path) {
    if (!v.is_object()) bad(path, "expected an object");
    return v;
}

const ojson & array_member(const ojson & object, std::string_view key, const std::string & path) {
    const ojson * v = member(object, key);
    if (!v || !v->is_array()) bad(field_path(path, key), "missing or not an array");
    return *v;
}

ChatMessage message(ChatRole role, std::string content = {}) {
    ChatMessage m;
    m.role = role;
    m.content = std::move(content);
    return m;
}

// Content part types that carry text, per API.
constexpr std::string_view kTextType[] = {"text"};
constexpr std::string_view kResponsesText[] = {"input_text", "output_text", "text"};
constexpr std::string_view kReasoningText[] = {"reasoning_text"};
constexpr std::string_view kSummaryText[] = {"summary_text"};

// Text parts of a content value: a string, or an array of parts whose type is one of `text_types` (with a "text"
// field; "refusal" parts carry theirs in "refusal"). Any other part type is an error, except in a tool result, where
// it becomes the text "[Unsupported <type>]" (the official encoder's rule for tool_result blocks).
std::vector<std::string> text_parts(const ojson * content, const std::string & path,
                                    std::span<const std::string_view> text_types, bool tool_result = false) {
    if (!content) return {};
    if (content->is_string()) return {content->get<std::string>()};
    if (!content->is_array()) bad(path, "expected a string or an array of content parts");
    std::vector<std::string> parts;
    for (size_t i = 0; i < content->size(); ++i) {
        std::string p = index_path(path, i);
        const ojson & part = object_at((*content)[i], p);
        std::string type = string_member(part, "type", p, true);
        if (type == "refusal") {
            parts.push_back(string_member(part, "refusal", p, true));
        } else if (std::find(text_types.begin(), text_types.end(), type) != text_types.end()) {
            parts.push_back(string_member(part, "text", p, true));
        } else if (tool_result) {
            parts.push_back("[Unsupported " + type + "]");
        } else {
            bad(field_path(p, "type"), fmt::format("unsupported content type '{}'", type));
        }
    }
    return parts;
}

void set_parts(ChatMessage & m, std::vector<std::string> parts) {
    if (parts.size() == 1)
        m.content = std::move(parts[0]);
    else
        m.parts = std::move(parts);
}

// ---------------------------------------------------------------------------------------------------------------------
// Thinking and effort (formats-spec §4.3; the three request ladders meet in one ReasoningEffort)
// ---------------------------------------------------------------------------------------------------------------------

void apply_effort(ChatPrompt & prompt, const ojson * value, const std::string & path) {
    if (!value) return;
    if (!value->is_string()) bad(path, "expected a string");
    std::string e = value->get<std::string>();
    if (e == "none") {
        prompt.thinking = ThinkingMode::chat;
    } else if (e == "minimal" || e == "low" || e == "medium") {
        prompt.effort = ReasoningEffort::low;
    } else if (e == "high" || e == "xhigh") {
        prompt.effort = ReasoningEffort::high;
    } else if (e == "max") {
        prompt.effort = ReasoningEffort::max;
    } else {
        bad(path, fmt::format("unknown value '{}' (none, minimal, low, medium, high, xhigh, max)", e));
    }
}

// {"type": "enabled" | "disabled" | "adaptive"}, or (OpenAI-compatible servers) a plain boolean.
void apply_thinking(ChatPrompt & prompt, const ojson * value, const std::string & path, bool allow_bool) {
    if (!value) return;
    if (allow_bool && value->is_boolean()) {
        prompt.thinking = value->get<bool>() ? ThinkingMode::thinking : ThinkingMode::chat;
        return;
    }
    if (!value->is_object()) bad(path, allow_bool ? "expected a boolean or an object" : "expected an object");
    std::string type = string_member(*value, "type", path, true);
    if (type == "enabled" || type == "adaptive")
        prompt.thinking = ThinkingMode::thinking;
    else if (type == "disabled")
        prompt.thinking = ThinkingMode::chat;
    else
        bad(field_path(path, "type"), fmt::format("unknown value '{}' (enabled, disabled, adaptive)", type));
}

void apply_bool_thinking(ChatPrompt & prompt, const ojson * value, const std::string & path) {
    if (!value) return;
    if (!value->is_boolean()) bad(path, "expected a boolean");
    prompt.thinking = value->get<bool>() ? ThinkingMode::thinking : ThinkingMode::chat;
}

// ---------------------------------------------------------------------------------------------------------------------
// Tools, tool choice, response format
// ---------------------------------------------------------------------------------------------------------------------

struct Tools {
    std::vector<std::string> functions;  // Python-dumped function objects
    std::vector<std::string> names;
};

// `convert` turns one tool object into a function object, or returns "" for a tool type the model cannot call
// (hosted/server tools), which is left out.
template <typename Convert>
Tools parse_tools(const ojson & body, const Convert & convert) {
    Tools tools;
    const ojson * list = member(body, "tools");
    if (!list) return tools;
    if (!list->is_array()) bad("tools", "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
        std::string path = index_path("tools", i);
        const ojson & tool = object_at((*list)[i], path);
        std::string function;
        try {
            function = convert(tool);
        } catch (const Error & e) {
            fail("{}.{}", path, e.what());
        }
        if (function.empty()) continue;
        tools.names.push_back(ojson::parse(function)["name"].get<std::string>());
        tools.functions.push_back(std::move(function));
    }
    return tools;
}

ToolChoice choose_function(const Tools & tools, std::string name, const std::string & path) {
    if (std::find(tools.names.begin(), tools.names.end(), name) == tools.names.end())
        bad(path, fmt::format("no tool named '{}'", name));
    return {ToolChoice::Mode::function, std::move(name)};
}

// OpenAI chat and Responses: "none" | "auto" | "required" | a function.
ToolChoice parse_openai_tool_choice(const ojson & body, const Tools & tools, bool responses) {
    const ojson * v = member(body, "tool_choice");
    if (!v) return {};
    if (v->is_string()) {
        std::string s = v->get<std::string>();
        if (s == "auto") return {};
        if (s == "none") return {ToolChoice::Mode::none, {}};
        if (s == "required") return {ToolChoice::Mode::required, {}};
        bad("tool_choice", fmt::format("unknown value '{}' (none, auto, required)", s));
    }
    const ojson & o = object_at(*v, "tool_choice");
    std::string type = string_member(o, "type", "tool_choice", true);
    if (type != "function") bad("tool_choice.type", fmt::format("unsupported value '{}'", type));
    if (responses) return choose_function(tools, string_member(o, "name", "tool_choice", true), "tool_choice.name");
    const ojson * f = member(o, "function");
    if (!f) bad("tool_choice.function", "missing");
    object_at(*f, "tool_choice.function");
    return choose_function(tools, string_member(*f, "name", "tool_choice.function", true), "tool_choice.function.name");
}

// A JSON schema response format → the schema the prompt shows ("" for plain text).
std::string schema_of_format(const ojson & format, const std::string & path, bool responses) {
    object_at(format, path);
    std::string type = string_member(format, "type", path, true);
    if (type == "text") return {};
    if (type == "json_object") return R"({"type": "object"})";
    if (type != "json_schema") bad(field_path(path, "type"), fmt::format("unsupported value '{}'", type));
    // Chat completions nest the schema in "json_schema"; Responses put it on the format itself.
    const ojson * holder = &format;
    std::string holder_path = path;
    if (!responses) {
        holder = member(format, "json_schema");
        holder_path = field_path(path, "json_schema");
        if (!holder) bad(holder_path, "missing");
        object_at(*holder, holder_path);
    }
    const ojson * schema = member(*holder, "schema");
    if (!schema || !schema->is_object()) bad(field_path(holder_path, "schema"), "missing or not an object");
    return schema->dump();
}

ChatRequest finish(std::vector<ChatMessage> messages, const Tools & tools, ToolChoice choice,
                   std::string response_format, ChatPrompt controls, const char * messages_field) {
    if (messages.empty()) bad(messages_field, "no messages");
    std::vector<std::string> functions =
        choice.mode == ToolChoice::Mode::none ? std::vector<std::string>() : tools.functions;
    attach_tools(messages, std::move(functions), std::move(response_format));
    ChatRequest r;
    r.prompt = std::move(controls);
    r.prompt.messages = std::move(messages);
    r.tool_choice = std::move(choice);
    return r;
}

// ---------------------------------------------------------------------------------------------------------------------
// OpenAI chat completions
// ---------------------------------------------------------------------------------------------------------------------

ToolCall openai_tool_call(const ojson & tc, const std::string & path) {
    object_at(tc, path);
    ToolCall call;
    call.id = string_member(tc, "id", path, false);
    std::string type = string_member(tc, "type", path, false);
    if (!type.empty() && type != "function") bad(field_path(path, "type"), fmt::format("unsupported value '{}'", type));
    std::string fpath = field_path(path, "function");
    const ojson * f = member(tc, "function");
    if (!f) bad(fpath, "missing");
    object_at(*f, fpath);
    call.name = string_member(*f, "name", fpath, true);
    const ojson * args = member(*f, "arguments");
    if (!args)
        call.arguments = "{}";
    else if (args->is_string())
        call.arguments = args->get<std::string>();
    else if (args->is_object())
        call.arguments = args->dump();  // some clients send the object itself
    else
        bad(field_path(fpath, "arguments"), "expected a string");
    return call;
}

ChatMessage openai_message(const ojson & m, const std::string & path) {
    object_at(m, path);
    std::string role_path = field_path(path, "role");
    const ojson * role_v = member(m, "role");
    if (!role_v || !role_v->is_string()) bad(role_path, "missing or not a string");
    std::string role = role_v->get<std::string>();
    std::string content_path = field_path(path, "content");
    const ojson * content = member(m, "content");

    if (role == "system" || role == "developer") {
        // OpenAI's "developer" is its newer name for the system prompt, not DeepSeek's internal developer turn.
        return message(ChatRole::system, join(text_parts(content, content_path, kTextType), "\n\n"));
    }
    if (role == "user") {
        ChatMessage msg = message(ChatRole::user);
        set_parts(msg, text_parts(content, content_path, kTextType));
        return msg;
    }
    if (role == "assistant") {
        ChatMessage msg = message(ChatRole::assistant, join(text_parts(content, content_path, kTextType), ""));
        // DeepSeek's API names it reasoning_content; vLLM and OpenRouter use reasoning.
        msg.reasoning = string_member(m, "reasoning_content", path, false);
        if (msg.reasoning.empty()) msg.reasoning = string_member(m, "reasoning", path, false);
        if (const ojson * calls = member(m, "tool_calls")) {
            std::string cpath = field_path(path, "tool_calls");
            if (!calls->is_array()) bad(cpath, "expected an array");
            for (size_t i = 0; i < calls->size(); ++i)
                msg.tool_calls.push_back(openai_tool_call((*calls)[i], index_path(cpath, i)));
        }
        return msg;
    }
    if (role == "tool") {
        ChatMessage msg = message(ChatRole::tool);
        msg.tool_call_id = string_member(m, "tool_call_id", path, false);
        set_parts(msg, text_parts(content, content_path, kTextType, true));
        return msg;
    }
    bad(role_path, fmt::format("unknown role '{}'", role));
}

std::string openai_function(const ojson & tool) {
    std::string type = string_member(tool, "type", "", false);
    if (!type.empty() && type != "function") return {};  // custom / hosted tools: not callable through DSML
    return function_from_openai_tool(tool.dump());
}

}  // namespace

ChatRequest parse_openai_chat_request(std::string_view body_text) {
    ojson body = parse_body(body_text);
    if (body.is_array()) body = ojson{{"messages", std::move(body)}};
    object_at(body, "request body");

    std::vector<ChatMessage> messages;
    const ojson & list = array_member(body, "messages", "");
    for (size_t i = 0; i < list.size(); ++i) messages.push_back(openai_message(list[i], index_path("messages", i)));

    ChatPrompt controls;
    if (const ojson * model = member(body, "model"); model && model->is_string()) {
        if (*model == "deepseek-chat") controls.thinking = ThinkingMode::chat;
        if (*model == "deepseek-reasoner") controls.thinking = ThinkingMode::thinking;
    }
    apply_thinking(controls, member(body, "thinking"), "thinking", true);
    apply_bool_thinking(controls, member(body, "think"), "think");
    if (const ojson * kwargs = member(body, "chat_template_kwargs")) {
        object_at(*kwargs, "chat_template_kwargs");
        apply_bool_thinking(controls, member(*kwargs, "thinking"), "chat_template_kwargs.thinking");
        apply_bool_thinking(controls, member(*kwargs, "enable_thinking"), "chat_template_kwargs.enable_thinking");
    }
    apply_effort(controls, member(body, "reasoning_effort"), "reasoning_effort");

    Tools tools = parse_tools(body, openai_function);
    ToolChoice choice = parse_openai_tool_choice(body, tools, false);
    std::string format;
    if (const ojson * rf = member(body, "response_format")) format = schema_of_format(*rf, "response_format", false);
    return finish(std::move(messages), tools, std::move(choice), std::move(format), controls, "messages");
}

// ---------------------------------------------------------------------------------------------------------------------
// Anthropic messages
// ---------------------------------------------------------------------------------------------------------------------

namespace {

// One Anthropic message → one or more of ours: user text blocks gather into user messages, each tool_result becomes
// a tool message (the renderer joins them back into one user turn in order); an assistant message stays one.
void anthropic_message(const ojson & m, const std::string & path, std::vector<ChatMessage> & out) {
    object_at(m, path);
    std::string role = string_member(m, "role", path, true);
    std::string content_path = field_path(path, "content");
    const ojson * content = member(m, "content");
    if (role != "user" && role != "assistant") bad(field_path(path, "role"), fmt::format("unknown role '{}'", role));
    ChatRole chat_role = role == "user" ? ChatRole::user : ChatRole::assistant;
    if (!content || content->is_string()) {
        out.push_back(message(chat_role, content ? content->get<std::string>() : std::string()));
        return;
    }
    if (!content->is_array()) bad(content_path, "expected a string or an array of content blocks");

    if (chat_role == ChatRole::assistant) {
        ChatMessage msg = message(ChatRole::assistant);
        for (size_t i = 0; i < content->size(); ++i) {
            std::string p = index_path(content_path, i);
            const ojson & b = object_at((*content)[i], p);
            std::string type = string_member(b, "type", p, true);
            if (type == "text") {
                msg.content += string_member(b, "text", p, true);
            } else if (type == "thinking") {
                msg.reasoning += string_member(b, "thinking", p, true);
            } else if (type == "redacted_thinking") {
                continue;  // opaque to us
            } else if (type == "tool_use") {
                ToolCall call;
                call.id = string_member(b, "id", p, true);
                call.name = string_member(b, "name", p, true);
                const ojson * input = member(b, "input");
                if (input && !input->is_object()) bad(field_path(p, "input"), "expected an object");
                call.arguments = input ? input->dump() : "{}";
                msg.tool_calls.push_back(std::move(call));
            } else {
                bad(field_path(p, "type"), fmt::format("unsupported content type '{}'", type));
            }
        }
        out.push_back(std::move(msg));
        return;
    }

    std::vector<std::string> texts;
    auto flush_texts = [&] {
        if (texts.empty()) return;
        ChatMessage msg = message(ChatRole::user);
        set_parts(msg, std::move(texts));
        out.push_back(std::move(msg));
        texts.clear();
    };
    for (size_t i = 0; i < content->size(); ++i) {
        std::string p = index_path(content_path, i);
        const ojson & b = object_at((*content)[i], p);
        std::string type = string_member(b, "type", p, true);
        if (type == "text") {
            texts.push_back(string_member(b, "text", p, true));
        } else if (type == "tool_result") {
            flush_texts();
            ChatMessage msg = message(ChatRole::tool);
            msg.tool_call_id = string_member(b, "tool_use_id", p, true);
            set_parts(msg, text_parts(member(b, "content"), field_path(p, "content"), kTextType, true));
            out.push_back(std::move(msg));
        } else {
            bad(field_path(p, "type"), fmt::format("unsupported content type '{}'", type));
        }
    }
    flush_texts();
}

std::string anthropic_function(const ojson & tool) {
    // Server tools (web search, bash, editor: a "type" and no input_schema) run on Anthropic's side only.
    if (!tool.contains("input_schema") && tool.contains("type") && tool["type"] != "custom") return {};
    return function_from_anthropic_tool(tool.dump());
}

}  // namespace

ChatRequest parse_anthropic_messages_request(std::string_view body_text) {
    ojson body = parse_body(body_text);
    object_at(body, "request body");

    std::vector<ChatMessage> messages;
    if (const ojson * system = member(body, "system")) {
        std::vector<std::string> parts = text_parts(system, "system", kTextType);
        messages.push_back(message(ChatRole::system, join(parts, "\n\n")));
    }
    const ojson & list = array_member(body, "messages", "");
    for (size_t i = 0; i < list.size(); ++i) anthropic_message(list[i], index_path("messages", i), messages);

    ChatPrompt controls;
    apply_thinking(controls, member(body, "thinking"), "thinking", false);
    if (const ojson * oc = member(body, "output_config")) {
        object_at(*oc, "output_config");
        apply_effort(controls, member(*oc, "effort"), "output_config.effort");
    }

    Tools tools = parse_tools(body, anthropic_function);
    ToolChoice choice;
    if (const ojson * tc = member(body, "tool_choice")) {
        object_at(*tc, "tool_choice");
        std::string type = string_member(*tc, "type", "tool_choice", true);
        if (type == "none")
            choice.mode = ToolChoice::Mode::none;
        else if (type == "any")
            choice.mode = ToolChoice::Mode::required;
        else if (type == "tool")
            choice = choose_function(tools, string_member(*tc, "name", "tool_choice", true), "tool_choice.name");
        else if (type != "auto")
            bad("tool_choice.type", fmt::format("unknown value '{}' (auto, any, tool, none)", type));
    }
    return finish(std::move(messages), tools, std::move(choice), {}, controls, "messages");
}

// ---------------------------------------------------------------------------------------------------------------------
// OpenAI Responses
// ---------------------------------------------------------------------------------------------------------------------

namespace {

void responses_item(const ojson & item, const std::string & path, std::vector<ChatMessage> & out) {
    object_at(item, path);
    std::string type = string_member(item, "type", path, false);
    if (type.empty() && item.contains("role")) type = "message";
    // An assistant turn the next items may still add to: started by a reasoning item, or holding calls.
    auto open_assistant = [&]() -> ChatMessage * {
        return !out.empty() && out.back().role == ChatRole::assistant ? &out.back() : nullptr;
    };

    if (type == "message") {
        std::string role = string_member(item, "role", path, true);
        std::string content_path = field_path(path, "content");
        std::vector<std::string> parts = text_parts(member(item, "content"), content_path, kResponsesText);
        if (role == "user") {
            ChatMessage msg = message(ChatRole::user);
            set_parts(msg, std::move(parts));
            out.push_back(std::move(msg));
        } else if (role == "system" || role == "developer") {
            out.push_back(message(ChatRole::system, join(parts, "\n\n")));
        } else if (role == "assistant") {
            ChatMessage * open = open_assistant();
            if (open && open->content.empty() && open->tool_calls.empty())
                open->content = join(parts, "");
            else
                out.push_back(message(ChatRole::assistant, join(parts, "")));
        } else {
            bad(field_path(path, "role"), fmt::format("unknown role '{}'", role));
        }
    } else if (type == "reasoning") {
        // Full reasoning text when the client kept it, else the summaries.
        std::string text;
        if (const ojson * content = member(item, "content")) {
            for (const std::string & t : text_parts(content, field_path(path, "content"), kReasoningText)) text += t;
        }
        if (text.empty()) {
            if (const ojson * summary = member(item, "summary"))
                text = join(text_parts(summary, field_path(path, "summary"), kSummaryText), "\n\n");
        }
        ChatMessage msg = message(ChatRole::assistant);
        msg.reasoning = std::move(text);
        out.push_back(std::move(msg));
    } else if (type == "function_call") {
        ToolCall call;
        call.id = string_member(item, "call_id", path, true);
        call.name = string_member(item, "name", path, true);
        call.arguments = string_member(item, "arguments", path, false);
        if (call.arguments.empty()) call.arguments = "{}";
        if (ChatMessage * open = open_assistant()) {
            open->tool_calls.push_back(std::move(call));
        } else {
            ChatMessage msg = message(ChatRole::assistant);
            msg.tool_calls.push_back(std::move(call));
            out.push_back(std::move(msg));
        }
    } else if (type == "function_call_output") {
        ChatMessage msg = message(ChatRole::tool);
        msg.tool_call_id = string_member(item, "call_id", path, true);
        set_parts(msg, text_parts(member(item, "output"), field_path(path, "output"), kResponsesText, true));
        out.push_back(std::move(msg));
    } else {
        bad(field_path(path, "type"), fmt::format("unsupported item type '{}'", type.empty() ? "(none)" : type));
    }
}

std::string responses_function(const ojson & tool) {
    std::string type = string_member(tool, "type", "", false);
    if (type != "function") return {};  // hosted tools (web_search, file_search, …) and custom tools
    ojson function = tool;
    function.erase("type");
    return function_from_openai_tool(function.dump());
}

}  // namespace

ChatRequest parse_responses_request(std::string_view body_text) {
    ojson body = parse_body(body_text);
    object_at(body, "request body");
    if (member(body, "previous_response_id"))
        bad("previous_response_id", "not supported (no stored responses): send the whole conversation in input");
    if (member(body, "conversation"))
        bad("conversation", "not supported (no stored conversations): send the whole conversation in input");

    std::vector<ChatMessage> messages;
    std::string instructions = string_member(body, "instructions", "", false);
    if (!instructions.empty()) messages.push_back(message(ChatRole::system, instructions));
    const ojson * input = member(body, "input");
    if (!input) bad("input", "missing");
    if (input->is_string()) {
        messages.push_back(message(ChatRole::user, input->get<std::string>()));
    } else if (input->is_array()) {
        for (size_t i = 0; i < input->size(); ++i) responses_item((*input)[i], index_path("input", i), messages);
    } else {
        bad("input", "expected a string or an array of items");
    }

    ChatPrompt controls;
    if (const ojson * reasoning = member(body, "reasoning")) {
        object_at(*reasoning, "reasoning");
        apply_effort(controls, member(*reasoning, "effort"), "reasoning.effort");
    }
    Tools tools = parse_tools(body, responses_function);
    ToolChoice choice = parse_openai_tool_choice(body, tools, true);
    std::string format;
    if (const ojson * text = member(body, "text")) {
        object_at(*text, "text");
        if (const ojson * f = member(*text, "format")) format = schema_of_format(*f, "text.format", true);
    }
    return finish(std::move(messages), tools, std::move(choice), std::move(format), controls, "input");
}

// ---------------------------------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------------------------------

RenderedChatRequest render_chat_request(const ChatRequest & request) {
    RenderedChatRequest out;
    out.pieces = render_chat(request.prompt);
    out.thinking = !out.pieces.empty() && out.pieces.back().special && out.pieces.back().text == kThinkStartText;
    const ToolChoice & choice = request.tool_choice;
    if (choice.mode != ToolChoice::Mode::required && choice.mode != ToolChoice::Mode::function) return out;
    // The model cannot be made to call a tool, but its reply can be started as one: the opener (and the name) are
    // prefilled and the model writes the rest. In thinking mode that skips the reasoning.
    std::string opener;
    if (out.thinking) opener = std::string(kThinkEndText);
    opener += fmt::format("\n\n<{0}tool_calls>\n<{0}invoke name=\"", kDsmlText);
    append_markup(out.pieces, opener);
    out.forced = opener;
    if (choice.mode == ToolChoice::Mode::function) {
        // An attribute value: '"' and '&' as the entities the output parser decodes, so the name comes back as sent.
        std::string name;
        for (char c : choice.name)
            name += c == '"' ? std::string("&quot;") : c == '&' ? std::string("&amp;") : std::string(1, c);
        name += "\">\n";
        append_text(out.pieces, name);
        out.forced += name;
    }
    return out;
}

}  // namespace dsv4
