// DeepSeek V4 chat prompts: the conversation as plain structs, and the renderer that turns it into the exact text
// (and special-token pieces) the official encoder `encoding/encoding_dsv4.py` produces. docs/chat-format.md lists
// the rules as implemented, the reasoning-effort ladders and how the golden renderings were made.
#pragma once

#include "text/tokenizer.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

// ---------------------------------------------------------------------------------------------------------------------
// Special-token literals (U+FF5C bars, U+2581 spaces). The renderer emits each as its own special TextPiece.
// ---------------------------------------------------------------------------------------------------------------------

inline constexpr std::string_view kBosText = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEosText = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kUserText = "<｜User｜>";
inline constexpr std::string_view kAssistantText = "<｜Assistant｜>";
inline constexpr std::string_view kThinkStartText = "<think>";
inline constexpr std::string_view kThinkEndText = "</think>";
inline constexpr std::string_view kLatestReminderText = "<｜latest_reminder｜>";
inline constexpr std::string_view kDsmlText = "｜DSML｜";

// Think Max's effort prefix needs a context of at least 384K tokens (model card); below it the request renders as
// the next rung down.
inline constexpr int64_t kThinkMaxMinContext = 393216;

// ---------------------------------------------------------------------------------------------------------------------
// The conversation
// ---------------------------------------------------------------------------------------------------------------------

enum class ChatRole { system, developer, user, assistant, tool, latest_reminder };

// The official encoder's internal quick-instruction tasks (a special token appended after the tagged message).
// Request parsers never set them; they exist so the official golden renderings can be reproduced.
enum class ChatTask { none, action, query, authority, domain, title, read_url };

struct ToolCall {
    std::string id;  // client-visible id ("call_…"); orders tool results, never rendered
    std::string name;
    std::string arguments;  // JSON object text
    std::string raw_dsml;   // exact sampled bytes of the whole DSML block this call came from; may be empty
};

struct ChatMessage {
    ChatRole role = ChatRole::user;
    std::string content;
    // user / tool: several text parts, joined with "\n\n" (the official content-block rule); used instead of
    // `content` when not empty.
    std::vector<std::string> parts;
    std::string reasoning;             // assistant
    std::vector<ToolCall> tool_calls;  // assistant
    std::string tool_call_id;          // tool
    // system / developer: OpenAI function objects ({"name","description","parameters",…}) as JSON text, rendered
    // as the tools block after the content; and a response schema (JSON text) rendered after that.
    std::vector<std::string> tools;
    std::string response_format;
    ChatTask task = ChatTask::none;
};

enum class ThinkingMode { chat, thinking };

// The requested reasoning effort. Which prefix text (if any) it selects depends on the template version.
enum class ReasoningEffort { low, high, max };

// Which effort ladder the model was trained with; a model file names it in `deepseek4.chat_template_version`.
//   v4       the original V4 release: only `max` adds a prefix ("Reasoning Effort: Absolute maximum …").
//   v4_0731  the 0731 update: `low` adds nothing, `high` adds the original max text, `max` adds "Reasoning Effort:
//            Beyond maximum …".
enum class ChatTemplateVersion { v4, v4_0731 };

struct ChatPrompt {
    std::vector<ChatMessage> messages;
    ThinkingMode thinking = ThinkingMode::thinking;
    ReasoningEffort effort = ReasoningEffort::high;
    ChatTemplateVersion version = ChatTemplateVersion::v4;
    // Tokens the session can hold. A `max` effort below kThinkMaxMinContext renders as `high`.
    int64_t context_length = 0;
    // The official default: in thinking mode without tools, reasoning of turns before the last user message is
    // not rendered. Tools anywhere in the conversation switch this off regardless.
    bool drop_thinking = true;
};

// ---------------------------------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------------------------------

// The whole prompt: BOS, every message, and the generation prompt after a final user turn. Adjacent text is merged
// into one piece. Template-written markup (role markers, <think>/</think>, ｜DSML｜ in the tools block and in past
// tool calls) is special; everything that came from a client (contents, schemas, arguments) is plain text, so no
// client string can turn into a control token.
std::vector<TextPiece> render_chat(const ChatPrompt & prompt);
// The same prompt as one string (what the official encoder returns).
std::string render_chat_text(const ChatPrompt & prompt);

// The effort prefix the prompt starts with (after BOS) in thinking mode, or "" (version ladder, Think Max gate).
std::string_view reasoning_effort_prefix(const ChatPrompt & prompt);

// Puts request-level tools and a response schema where the official test data puts them: on the first message when
// it is a system message, otherwise on a new empty system message inserted first. Empty inputs change nothing.
void attach_tools(std::vector<ChatMessage> & messages, std::vector<std::string> functions, std::string response_format);

// `deepseek4.chat_template_version` values: "v4" and "v4-0731". Throws dsv4::Error on anything else.
ChatTemplateVersion parse_chat_template_version(std::string_view name);
std::string_view chat_template_version_name(ChatTemplateVersion version);

// Piece helpers shared with the DSML renderer. append_text never creates a special piece; append_markup turns
// every special-token literal inside template-written text into its own special piece.
void append_text(std::vector<TextPiece> & pieces, std::string_view text);
void append_special(std::vector<TextPiece> & pieces, std::string_view token);
void append_markup(std::vector<TextPiece> & pieces, std::string_view text);
std::string pieces_text(const std::vector<TextPiece> & pieces);

}  // namespace dsv4
