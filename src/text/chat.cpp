// Chat prompt rendering, a byte-for-byte port of the official encoder's rules (encoding_dsv4.py, encode_messages):
// tool messages merge into user turns, tool results follow the order of the calls that asked for them, old reasoning
// is dropped in thinking mode without tools, and each message renders with the transition its successor needs.
#include "text/chat.h"

#include "text/dsml.h"
#include "util/error.h"
#include "util/strings.h"

#include <algorithm>
#include <array>
#include <map>

namespace dsv4 {

namespace {

// ---------------------------------------------------------------------------------------------------------------------
// Constant texts
// ---------------------------------------------------------------------------------------------------------------------

// The original release's REASONING_EFFORT_MAX; the 0731 ladder reuses it, word for word, as its `high` rung.
constexpr std::string_view kEffortAbsoluteMaximum =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

// The 0731 ladder's `max` rung.
constexpr std::string_view kEffortBeyondMaximum =
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n";

constexpr std::string_view kResponseFormatHeader =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

std::string_view task_token(ChatTask task) {
    switch (task) {
        case ChatTask::action:
            return "<｜action｜>";
        case ChatTask::query:
            return "<｜query｜>";
        case ChatTask::authority:
            return "<｜authority｜>";
        case ChatTask::domain:
            return "<｜domain｜>";
        case ChatTask::title:
            return "<｜title｜>";
        case ChatTask::read_url:
            return "<｜read_url｜>";
        case ChatTask::none:
            break;
    }
    return {};
}

// Every literal append_markup recognises. None is a prefix of another, so the first match at a position is the
// only one.
constexpr std::array<std::string_view, 14> kSpecialLiterals = {
    kBosText,  kEosText,       kUserText,     kAssistantText,    kThinkStartText, kThinkEndText, kLatestReminderText,
    kDsmlText, "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>",  "<｜title｜>", "<｜read_url｜>",
};

// ---------------------------------------------------------------------------------------------------------------------
// Preprocessing: the message list the official renderer walks
// ---------------------------------------------------------------------------------------------------------------------

// A user turn's content block: a text, or a tool result waiting to be wrapped in <tool_result>.
struct Block {
    bool tool_result = false;
    std::string text;
    std::string tool_use_id;
};

struct Turn {
    ChatRole role = ChatRole::user;     // never tool: tool messages became user turns
    const ChatMessage * msg = nullptr;  // the source message (null for a user turn started by a tool result)
    std::vector<Block> blocks;          // user turns
    ChatTask task = ChatTask::none;
};

// Appends pieces rendered elsewhere, merging text at the seam.
void append_pieces(std::vector<TextPiece> & out, const std::vector<TextPiece> & pieces) {
    for (const TextPiece & p : pieces) {
        if (p.special)
            append_special(out, p.text);
        else
            append_text(out, p.text);
    }
}

std::string message_text(const ChatMessage & m) { return m.parts.empty() ? m.content : join(m.parts, "\n\n"); }

// merge_tool_messages: a tool result joins the user turn before it (whatever that turn's task) or starts one; a
// user message joins a preceding user turn unless that turn carries a task.
std::vector<Turn> merge_tool_messages(const std::vector<ChatMessage> & messages) {
    std::vector<Turn> turns;
    for (const ChatMessage & m : messages) {
        if (m.role == ChatRole::tool) {
            Block b{true, message_text(m), m.tool_call_id};
            if (!turns.empty() && turns.back().role == ChatRole::user) {
                turns.back().blocks.push_back(std::move(b));
            } else {
                Turn t;
                t.blocks.push_back(std::move(b));
                turns.push_back(std::move(t));
            }
        } else if (m.role == ChatRole::user) {
            Block b{false, message_text(m), {}};
            if (!turns.empty() && turns.back().role == ChatRole::user && turns.back().task == ChatTask::none) {
                turns.back().blocks.push_back(std::move(b));
            } else {
                Turn t;
                t.msg = &m;
                t.task = m.task;
                t.blocks.push_back(std::move(b));
                turns.push_back(std::move(t));
            }
        } else {
            Turn t;
            t.role = m.role;
            t.msg = &m;
            t.task = m.task;
            turns.push_back(std::move(t));
        }
    }
    return turns;
}

// sort_tool_results_by_call_order: the tool results of a user turn take the order of the most recent assistant
// turn's calls (ids it does not know sort as position 0; the sort is stable); text blocks keep their places.
void sort_tool_results(std::vector<Turn> & turns) {
    std::map<std::string, size_t, std::less<>> order;
    for (Turn & t : turns) {
        if (t.role == ChatRole::assistant && !t.msg->tool_calls.empty()) {
            order.clear();
            for (size_t i = 0; i < t.msg->tool_calls.size(); ++i)
                if (!t.msg->tool_calls[i].id.empty()) order[t.msg->tool_calls[i].id] = i;
        } else if (t.role == ChatRole::user) {
            std::vector<Block> results;
            for (const Block & b : t.blocks)
                if (b.tool_result) results.push_back(b);
            if (results.size() < 2 || order.empty()) continue;
            auto rank = [&](const Block & b) {
                auto it = order.find(b.tool_use_id);
                return it == order.end() ? size_t(0) : it->second;
            };
            std::stable_sort(results.begin(), results.end(),
                             [&](const Block & a, const Block & b) { return rank(a) < rank(b); });
            size_t next = 0;
            for (Block & b : t.blocks)
                if (b.tool_result) b = std::move(results[next++]);
        }
    }
}

int last_user_index(const std::vector<Turn> & turns) {
    for (int i = int(turns.size()) - 1; i >= 0; --i)
        if (turns[i].role == ChatRole::user || turns[i].role == ChatRole::developer) return i;
    return -1;
}

// _drop_thinking_messages: developer turns before the last user/developer turn disappear. (Assistant turns there
// lose their reasoning too, which render_turn already does for every assistant turn before the last user turn.)
std::vector<Turn> drop_developer_turns(std::vector<Turn> turns) {
    int last_user = last_user_index(turns);
    std::vector<Turn> kept;
    for (int i = 0; i < int(turns.size()); ++i)
        if (i >= last_user || turns[i].role != ChatRole::developer) kept.push_back(std::move(turns[i]));
    return kept;
}

// ---------------------------------------------------------------------------------------------------------------------
// Rendering one turn
// ---------------------------------------------------------------------------------------------------------------------

struct RenderState {
    const ChatPrompt & prompt;
    const std::vector<Turn> & turns;
    bool thinking;  // thinking mode
    bool drop;      // drop_thinking in effect (no tools anywhere)
    int last_user;  // index of the last user/developer turn, -1 if none
};

void append_tools_and_format(std::vector<TextPiece> & out, const ChatMessage & m, size_t source_index) {
    if (!m.tools.empty()) {
        append_text(out, "\n\n");
        try {
            append_pieces(out, render_tools_block(m.tools));
        } catch (const Error & e) {
            fail("messages[{}].tools: {}", source_index, e.what());
        }
    }
    if (!m.response_format.empty()) {
        std::string schema;
        try {
            schema = python_json_dumps(m.response_format);
        } catch (const Error & e) {
            fail("messages[{}].response_format: {}", source_index, e.what());
        }
        append_text(out, "\n\n");
        append_text(out, kResponseFormatHeader);
        append_text(out, schema);
    }
}

void render_turn(std::vector<TextPiece> & out, const RenderState & st, int index) {
    const Turn & t = st.turns[index];
    const ChatMessage * m = t.msg;
    size_t source_index = m ? size_t(m - st.prompt.messages.data()) : 0;

    if (index == 0 && st.thinking) append_text(out, reasoning_effort_prefix(st.prompt));

    switch (t.role) {
        case ChatRole::system:
            append_text(out, m->content);
            append_tools_and_format(out, *m, source_index);
            break;
        case ChatRole::developer:
            append_special(out, kUserText);
            append_text(out, m->content);
            append_tools_and_format(out, *m, source_index);
            break;
        case ChatRole::user:
            append_special(out, kUserText);
            for (size_t i = 0; i < t.blocks.size(); ++i) {
                if (i) append_text(out, "\n\n");
                if (t.blocks[i].tool_result) append_text(out, "<tool_result>");
                append_text(out, t.blocks[i].text);
                if (t.blocks[i].tool_result) append_text(out, "</tool_result>");
            }
            break;
        case ChatRole::latest_reminder:
            append_special(out, kLatestReminderText);
            append_text(out, m->content);
            break;
        case ChatRole::assistant: {
            // A task's answer (the turn after a tagged message) never has a thinking part.
            bool after_task = index > 0 && st.turns[index - 1].task != ChatTask::none;
            if (st.thinking && !after_task && (!st.drop || index > st.last_user)) {
                append_text(out, m->reasoning);
                append_special(out, kThinkEndText);
            }
            append_text(out, m->content);
            if (!m->tool_calls.empty()) {
                try {
                    append_pieces(out, render_tool_calls(m->tool_calls));
                } catch (const Error & e) {
                    fail("messages[{}].tool_calls: {}", source_index, e.what());
                }
            }
            append_special(out, kEosText);
            break;
        }
        case ChatRole::tool:
            break;  // merged into user turns before rendering
    }

    // The transition: nothing when another turn follows that is neither assistant nor latest_reminder; otherwise the
    // task token, or for a user/developer turn the assistant marker with the think token the next turn needs.
    int n = int(st.turns.size());
    if (index + 1 < n && st.turns[index + 1].role != ChatRole::assistant &&
        st.turns[index + 1].role != ChatRole::latest_reminder)
        return;
    if (t.task != ChatTask::none) {
        if (t.task == ChatTask::action) {
            append_special(out, kAssistantText);
            append_special(out, st.thinking ? kThinkStartText : kThinkEndText);
        }
        append_special(out, task_token(t.task));
    } else if (t.role == ChatRole::user || t.role == ChatRole::developer) {
        append_special(out, kAssistantText);
        bool open = st.thinking && (!st.drop || index >= st.last_user);
        append_special(out, open ? kThinkStartText : kThinkEndText);
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Pieces
// ---------------------------------------------------------------------------------------------------------------------

void append_text(std::vector<TextPiece> & pieces, std::string_view text) {
    if (text.empty()) return;
    if (!pieces.empty() && !pieces.back().special)
        pieces.back().text += text;
    else
        pieces.push_back({std::string(text), false});
}

void append_special(std::vector<TextPiece> & pieces, std::string_view token) {
    pieces.push_back({std::string(token), true});
}

void append_markup(std::vector<TextPiece> & pieces, std::string_view text) {
    size_t done = 0;
    for (size_t i = 0; i < text.size(); ++i) {
        // Every literal starts with '<' or with the first byte of U+FF5C.
        if (text[i] != '<' && uint8_t(text[i]) != 0xEF) continue;
        for (std::string_view lit : kSpecialLiterals) {
            if (text.compare(i, lit.size(), lit) != 0) continue;
            append_text(pieces, text.substr(done, i - done));
            append_special(pieces, lit);
            i += lit.size() - 1;
            done = i + 1;
            break;
        }
    }
    append_text(pieces, text.substr(done));
}

std::string pieces_text(const std::vector<TextPiece> & pieces) {
    std::string out;
    for (const TextPiece & p : pieces) out += p.text;
    return out;
}

// ---------------------------------------------------------------------------------------------------------------------
// The prompt
// ---------------------------------------------------------------------------------------------------------------------

std::string_view reasoning_effort_prefix(const ChatPrompt & prompt) {
    if (prompt.thinking != ThinkingMode::thinking) return {};
    ReasoningEffort effort = prompt.effort;
    if (effort == ReasoningEffort::max && prompt.context_length < kThinkMaxMinContext) effort = ReasoningEffort::high;
    switch (prompt.version) {
        case ChatTemplateVersion::v4:
            return effort == ReasoningEffort::max ? kEffortAbsoluteMaximum : std::string_view();
        case ChatTemplateVersion::v4_0731:
            if (effort == ReasoningEffort::high) return kEffortAbsoluteMaximum;
            if (effort == ReasoningEffort::max) return kEffortBeyondMaximum;
            return {};
    }
    return {};
}

std::vector<TextPiece> render_chat(const ChatPrompt & prompt) {
    std::vector<Turn> turns = merge_tool_messages(prompt.messages);
    sort_tool_results(turns);

    bool thinking = prompt.thinking == ThinkingMode::thinking;
    bool any_tools = std::any_of(prompt.messages.begin(), prompt.messages.end(),
                                 [](const ChatMessage & m) { return !m.tools.empty(); });
    bool drop = prompt.drop_thinking && !any_tools;
    if (thinking && drop) turns = drop_developer_turns(std::move(turns));

    RenderState st{prompt, turns, thinking, drop, last_user_index(turns)};
    std::vector<TextPiece> out;
    append_special(out, kBosText);
    for (int i = 0; i < int(turns.size()); ++i) render_turn(out, st, i);
    return out;
}

std::string render_chat_text(const ChatPrompt & prompt) { return pieces_text(render_chat(prompt)); }

void attach_tools(std::vector<ChatMessage> & messages, std::vector<std::string> functions,
                  std::string response_format) {
    if (functions.empty() && response_format.empty()) return;
    if (messages.empty() || messages.front().role != ChatRole::system) {
        ChatMessage system;
        system.role = ChatRole::system;
        messages.insert(messages.begin(), std::move(system));
    }
    ChatMessage & target = messages.front();
    for (std::string & f : functions) target.tools.push_back(std::move(f));
    if (!response_format.empty()) target.response_format = std::move(response_format);
}

ChatTemplateVersion parse_chat_template_version(std::string_view name) {
    if (name == "v4") return ChatTemplateVersion::v4;
    if (name == "v4-0731") return ChatTemplateVersion::v4_0731;
    fail("chat template version: unknown value '{}' (expected 'v4' or 'v4-0731')", name);
}

std::string_view chat_template_version_name(ChatTemplateVersion version) {
    return version == ChatTemplateVersion::v4_0731 ? "v4-0731" : "v4";
}

}  // namespace dsv4
