// HTTP request bodies → ChatPrompt, for the three APIs the server speaks: OpenAI chat completions, Anthropic
// messages and OpenAI Responses. Only the fields that shape the prompt are read here (messages, tools, tool choice,
// thinking and effort controls, response format); sampling and streaming options are the server's. Bad input throws
// dsv4::Error whose message starts with the JSON path of the field ("messages[2].role: unknown role 'robot'"), which
// the server turns into a 400. docs/chat-format.md lists the mappings.
#pragma once

#include "text/chat.h"

#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

struct ToolChoice {
    enum class Mode { automatic, none, required, function };
    Mode mode = Mode::automatic;
    std::string name;  // Mode::function: the tool the model must call (checked to exist)
};

struct ChatRequest {
    // messages, thinking mode and effort from the request. The caller sets prompt.version (the model's template
    // version) and prompt.context_length (its session context; Think Max needs 384K).
    ChatPrompt prompt;
    // Mode::none also leaves the tools out of the prompt.
    ToolChoice tool_choice;
};

// What a chat request sends the model: the prompt's pieces and, when tool_choice forces a call, the assistant markup
// the server prefills after them so that the reply starts as that call. The caller sets request.prompt.version and
// context_length first. The tool's name is client text and stays plain text (never a special token).
struct RenderedChatRequest {
    std::vector<TextPiece> pieces;  // the prompt, ending with the forced opener when there is one
    bool thinking = false;          // the completion starts inside reasoning (the pieces end with <think>)
    std::string forced;             // the prefilled markup as the output parser must see it first; "" when none
};
RenderedChatRequest render_chat_request(const ChatRequest & request);

// POST /v1/chat/completions. A bare messages array is accepted as {"messages": […]}.
ChatRequest parse_openai_chat_request(std::string_view body);
// POST /v1/messages.
ChatRequest parse_anthropic_messages_request(std::string_view body);
// POST /v1/responses (stateless: previous_response_id and conversation are refused).
ChatRequest parse_responses_request(std::string_view body);

}  // namespace dsv4
