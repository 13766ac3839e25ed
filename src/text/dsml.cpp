// DSML rendering and parsing. Rendering follows the official encoder byte for byte (Python json.dumps spacing, key
// order as given); parsing is the official parser made tolerant and incremental: one state machine serves both the
// streamed and the whole-text parse, so the two can never disagree.
#include "text/dsml.h"

#include "util/error.h"

#include <nlohmann/json.hpp>

#include <array>
#include <cctype>
#include <charconv>
#include <map>
#include <utility>

namespace dsv4 {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------------------------------
// Python json.dumps(ensure_ascii=False)
// ---------------------------------------------------------------------------------------------------------------------

namespace {

// Length of the valid UTF-8 sequence starting at s[i], or 0 when s[i] starts an ill-formed one; `*skip` is then the
// length of its maximal ill-formed subpart (what one U+FFFD replaces).
size_t utf8_sequence(std::string_view s, size_t i, size_t * skip) {
    uint8_t c = uint8_t(s[i]);
    size_t len = c < 0x80                   ? 1
                 : (c >= 0xC2 && c <= 0xDF) ? 2
                 : (c >= 0xE0 && c <= 0xEF) ? 3
                 : (c >= 0xF0 && c <= 0xF4) ? 4
                                            : 0;
    *skip = 1;
    if (len <= 1) return len;
    for (size_t k = 1; k < len; ++k) {
        if (i + k >= s.size()) return 0;
        uint8_t d = uint8_t(s[i + k]);
        uint8_t lo = 0x80, hi = 0xBF;
        if (k == 1) {
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        }
        if (d < lo || d > hi) return 0;
        *skip = k + 1;
    }
    return len;
}

// The characters json.dumps writes as a backslash and a letter; the rest below 0x20 become \u00XX.
constexpr std::string_view kShortEscaped = "\"\\\n\r\t\b\f";
constexpr std::string_view kShortEscapes = "\"\\nrtbf";

void append_json_string(std::string & out, std::string_view s) {
    static constexpr char kHex[] = "0123456789abcdef";
    out += '"';
    for (size_t i = 0; i < s.size();) {
        char c = s[i];
        if (size_t k = kShortEscaped.find(c); k != std::string_view::npos) {
            out += '\\';
            out += kShortEscapes[k];
            ++i;
            continue;
        }
        if (uint8_t(c) < 0x20) {
            out += "\\u00";
            out += kHex[uint8_t(c) >> 4];
            out += kHex[uint8_t(c) & 15];
            ++i;
            continue;
        }
        size_t skip = 1;
        size_t len = utf8_sequence(s, i, &skip);
        if (len == 0) {
            out += "\xEF\xBF\xBD";
            i += skip;
        } else {
            out.append(s, i, len);
            i += len;
        }
    }
    out += '"';
}

// Python's float repr: the shortest round-trip digits, positional for decimal exponents -4..15, else d.ddde±XX.
void append_python_float(std::string & out, double v) {
    char buf[64];
    auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
    std::string_view sci(buf, size_t(res.ptr - buf));  // "-1.2345e+07"
    bool negative = !sci.empty() && sci[0] == '-';
    if (negative) sci.remove_prefix(1);
    size_t e = sci.find('e');
    std::string digits;
    for (char ch : sci.substr(0, e))
        if (ch != '.') digits += ch;
    int exp = 0;
    std::from_chars(sci.data() + e + (sci[e + 1] == '+' ? 2 : 1), sci.data() + sci.size(), exp);
    if (negative) out += '-';
    if (exp >= -4 && exp < 16) {
        if (exp >= 0) {
            std::string int_part = digits.substr(0, std::min(digits.size(), size_t(exp) + 1));
            int_part.append(size_t(exp) + 1 - int_part.size(), '0');
            std::string frac = digits.size() > size_t(exp) + 1 ? digits.substr(size_t(exp) + 1) : "0";
            out += int_part + "." + frac;
        } else {
            out += "0." + std::string(size_t(-exp - 1), '0') + digits;
        }
    } else {
        out += digits[0];
        if (digits.size() > 1) out += "." + digits.substr(1);
        out += exp < 0 ? "e-" : "e+";
        std::string x = std::to_string(exp < 0 ? -exp : exp);
        if (x.size() < 2) out += '0';
        out += x;
    }
}

void append_python_json(std::string & out, const ojson & j) {
    switch (j.type()) {
        case ojson::value_t::object: {
            out += '{';
            bool first = true;
            for (const auto & [key, value] : j.items()) {
                if (!first) out += ", ";
                first = false;
                append_json_string(out, key);
                out += ": ";
                append_python_json(out, value);
            }
            out += '}';
            break;
        }
        case ojson::value_t::array: {
            out += '[';
            for (size_t i = 0; i < j.size(); ++i) {
                if (i) out += ", ";
                append_python_json(out, j[i]);
            }
            out += ']';
            break;
        }
        case ojson::value_t::string:
            append_json_string(out, j.get_ref<const std::string &>());
            break;
        case ojson::value_t::boolean:
            out += j.get<bool>() ? "true" : "false";
            break;
        case ojson::value_t::number_integer:
            out += std::to_string(j.get<int64_t>());
            break;
        case ojson::value_t::number_unsigned:
            out += std::to_string(j.get<uint64_t>());
            break;
        case ojson::value_t::number_float:
            append_python_float(out, j.get<double>());
            break;
        default:
            out += "null";
            break;
    }
}

std::string python_dumps(const ojson & j) {
    std::string out;
    append_python_json(out, j);
    return out;
}

ojson parse_json(std::string_view text) {
    if (json_nesting_depth(text) > kMaxJsonDepth) fail("JSON nested deeper than {} levels", kMaxJsonDepth);
    try {
        return ojson::parse(text);
    } catch (const ojson::exception & e) {
        fail("not valid JSON ({})", e.what());
    }
}

}  // namespace

std::string python_json_dumps(std::string_view json_text) { return python_dumps(parse_json(json_text)); }

int json_nesting_depth(std::string_view json_text) {
    int depth = 0, deepest = 0;
    bool in_string = false;
    for (size_t i = 0; i < json_text.size(); ++i) {
        char c = json_text[i];
        if (in_string) {
            if (c == '\\')
                ++i;
            else if (c == '"')
                in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            deepest = std::max(deepest, ++depth);
        } else if (c == ']' || c == '}') {
            --depth;
        }
    }
    return deepest;
}

std::string python_json_string(std::string_view text) {
    std::string out;
    append_json_string(out, text);
    return out;
}

// ---------------------------------------------------------------------------------------------------------------------
// Tool definitions
// ---------------------------------------------------------------------------------------------------------------------

std::string function_from_openai_tool(std::string_view tool_json) {
    ojson tool = parse_json(tool_json);
    if (!tool.is_object()) fail("expected an object");
    const ojson * function = &tool;
    std::string where;
    if (tool.contains("function")) {
        function = &tool["function"];
        where = "function.";
        if (!function->is_object()) fail("function: expected an object");
    }
    auto name = function->find("name");
    if (name == function->end() || !name->is_string() || name->get_ref<const std::string &>().empty())
        fail("{}name: missing or not a non-empty string", where);
    return python_dumps(*function);
}

std::string function_from_anthropic_tool(std::string_view tool_json) {
    ojson tool = parse_json(tool_json);
    if (!tool.is_object()) fail("expected an object");
    auto name = tool.find("name");
    if (name == tool.end() || !name->is_string() || name->get_ref<const std::string &>().empty())
        fail("name: missing or not a non-empty string");
    ojson function = ojson::object();
    function["name"] = *name;
    if (auto d = tool.find("description"); d != tool.end()) {
        if (!d->is_string()) fail("description: expected a string");
        function["description"] = *d;
    }
    auto schema = tool.find("input_schema");
    if (schema == tool.end() || !schema->is_object()) fail("input_schema: missing or not an object");
    function["parameters"] = *schema;
    return python_dumps(function);
}

// ---------------------------------------------------------------------------------------------------------------------
// Rendering: the tools block and past calls
// ---------------------------------------------------------------------------------------------------------------------

namespace {

constexpr std::string_view kToolsHead =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, "
    "arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n";
constexpr std::string_view kToolsTail =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

}  // namespace

std::vector<TextPiece> render_tools_block(const std::vector<std::string> & functions) {
    std::vector<TextPiece> out;
    append_markup(out, kToolsHead);
    for (size_t i = 0; i < functions.size(); ++i) {
        if (i) append_text(out, "\n");
        try {
            append_text(out, python_json_dumps(functions[i]));
        } catch (const Error & e) {
            fail("[{}]: {}", i, e.what());
        }
    }
    append_markup(out, kToolsTail);
    return out;
}

std::vector<TextPiece> render_tool_calls(const std::vector<ToolCall> & calls) {
    std::vector<TextPiece> out;
    bool all_raw = !calls.empty();
    for (const ToolCall & c : calls) all_raw = all_raw && !c.raw_dsml.empty();
    if (all_raw) {
        for (size_t i = 0; i < calls.size(); ++i)
            if (i == 0 || calls[i].raw_dsml != calls[i - 1].raw_dsml) append_markup(out, calls[i].raw_dsml);
        return out;
    }
    append_markup(out, "\n\n<｜DSML｜tool_calls>\n");
    for (size_t i = 0; i < calls.size(); ++i) {
        const ToolCall & c = calls[i];
        if (i) append_text(out, "\n");
        append_markup(out, "<｜DSML｜invoke name=\"");
        append_text(out, c.name);
        append_markup(out, "\">\n");
        // json.loads(arguments), falling back to {"arguments": <the text>} like the official encoder; a JSON value
        // that is not an object is wrapped the same way (the official encoder would crash on it).
        ojson args = c.arguments;
        if (json_nesting_depth(c.arguments) <= kMaxJsonDepth) {
            args = ojson::parse(c.arguments, nullptr, false);
            if (args.is_discarded()) args = c.arguments;
        }
        if (!args.is_object()) args = ojson{{"arguments", std::move(args)}};
        bool first = true;
        for (const auto & [key, value] : args.items()) {
            if (!first) append_text(out, "\n");
            first = false;
            append_markup(out, "<｜DSML｜parameter name=\"");
            append_text(out, key);
            append_text(out, value.is_string() ? "\" string=\"true\">" : "\" string=\"false\">");
            append_text(out, value.is_string() ? value.get_ref<const std::string &>() : python_dumps(value));
            append_markup(out, "</｜DSML｜parameter>");
        }
        append_markup(out, "\n</｜DSML｜invoke>");
    }
    append_markup(out, "\n</｜DSML｜tool_calls>");
    return out;
}

// ---------------------------------------------------------------------------------------------------------------------
// Parsing: markup matchers
// ---------------------------------------------------------------------------------------------------------------------

namespace {

// The three spellings of a tag prefix seen in the wild: the canonical one (｜DSML｜ is a single token), the one
// with its first bar missing, and plain XML-like tags.
enum Variant : uint8_t { kFullBar = 1, kMissingBar = 2, kPlain = 4 };
constexpr uint8_t kAnyVariant = kFullBar | kMissingBar | kPlain;
constexpr uint8_t kDsmlVariants = kFullBar | kMissingBar;
constexpr std::array<std::pair<Variant, std::string_view>, 3> kPrefixes = {
    {{kFullBar, "｜DSML｜"}, {kMissingBar, "DSML｜"}, {kPlain, ""}}};

// The official parser's opener of a tool block (without its '>'): in reasoning, only this exact spelling ends the
// reasoning early (a model that forgot "</think>").
constexpr std::string_view kReasoningBlockOpener = "\n\n<｜DSML｜tool_calls";

// no: not here; more: the text ends inside a possible match; yes: matched.
enum class Scan { no, more, yes };

Scan match_literal(std::string_view s, size_t pos, std::string_view lit) {
    size_t n = std::min(lit.size(), s.size() - pos);
    if (s.compare(pos, n, lit.substr(0, n)) != 0) return Scan::no;
    return n == lit.size() ? Scan::yes : Scan::more;
}

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

struct TagScan {
    Scan scan = Scan::no;
    size_t end = 0;  // just past the match
    Variant variant = kFullBar;
};

// '<' ['/'] PREFIX NAME, then: for a tag with attributes one whitespace; otherwise optional whitespace and '>'.
TagScan match_tag(std::string_view s, size_t pos, bool close, std::string_view name, uint8_t variants,
                  bool has_attributes) {
    std::string_view head = close ? "</" : "<";
    Scan h = match_literal(s, pos, head);
    if (h != Scan::yes) return {h};
    bool more = false;
    for (const auto & [variant, prefix] : kPrefixes) {
        if (!(variants & variant)) continue;
        size_t p = pos + head.size();
        Scan a = match_literal(s, p, prefix);
        if (a == Scan::yes) {
            p += prefix.size();
            a = match_literal(s, p, name);
        }
        if (a == Scan::more) more = true;
        if (a != Scan::yes) continue;
        p += name.size();
        if (has_attributes) {
            if (p == s.size()) {
                more = true;
                continue;
            }
            if (is_ws(s[p])) return {Scan::yes, p + 1, variant};
            continue;
        }
        while (p < s.size() && is_ws(s[p])) ++p;
        if (p == s.size()) {
            more = true;
            continue;
        }
        if (s[p] == '>') return {Scan::yes, p + 1, variant};
    }
    return {more ? Scan::more : Scan::no};
}

std::string decode_entities(std::string_view s) {
    static constexpr std::pair<std::string_view, char> kEntities[] = {
        {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
        bool replaced = false;
        if (s[i] == '&') {
            for (const auto & [entity, ch] : kEntities) {
                if (s.compare(i, entity.size(), entity) == 0) {
                    out += ch;
                    i += entity.size() - 1;
                    replaced = true;
                    break;
                }
            }
        }
        if (!replaced) out += s[i];
    }
    return out;
}

struct Attributes {
    Scan scan = Scan::more;
    size_t end = 0;  // just past the '>'
    std::map<std::string, std::string, std::less<>> values;
};

// The attributes of a tag up to its '>': key = "value" pairs with any whitespace around '=', single or double
// quotes (a quote never spans a line), unquoted values, entities decoded. Stray bytes are skipped.
Attributes parse_attributes(std::string_view s, size_t pos) {
    Attributes a;
    size_t p = pos, n = s.size();
    auto skip_ws = [&] {
        while (p < n && is_ws(s[p])) ++p;
        return p < n;
    };
    while (true) {
        if (!skip_ws()) return a;
        if (s[p] == '>') break;
        size_t k0 = p;
        while (p < n && (std::isalnum(uint8_t(s[p])) || s[p] == '_' || s[p] == '-')) ++p;
        if (p == n) return a;
        if (p == k0) {
            ++p;
            continue;
        }
        std::string key(s.substr(k0, p - k0));
        if (!skip_ws()) return a;
        if (s[p] != '=') continue;
        ++p;
        if (!skip_ws()) return a;
        size_t v0 = p;
        if (s[p] == '"' || s[p] == '\'') {
            char quote = s[p++];
            v0 = p;
            while (p < n && s[p] != quote && s[p] != '\n') ++p;
            if (p == n) return a;
            a.values[key] = decode_entities(s.substr(v0, p - v0));
            if (s[p] == quote) ++p;
        } else {
            while (p < n && !is_ws(s[p]) && s[p] != '>') ++p;
            if (p == n) return a;
            a.values[key] = decode_entities(s.substr(v0, p - v0));
        }
    }
    a.scan = Scan::yes;
    a.end = p + 1;
    return a;
}

// Bytes of s that can be emitted without splitting a UTF-8 sequence at the end.
size_t utf8_complete(std::string_view s) {
    size_t n = s.size();
    for (size_t back = 1; back <= 3 && back <= n; ++back) {
        uint8_t c = uint8_t(s[n - back]);
        if ((c & 0xC0) == 0x80) continue;  // a continuation byte: keep looking for the lead
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return need > back ? n - back : n;
    }
    return n;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Parsing: the state machine
// ---------------------------------------------------------------------------------------------------------------------

struct DsmlStreamParser::Impl {
    enum class State {
        reasoning,  // before "</think>"
        tentative,  // in reasoning, after the official block opener: a call only if generation ends after it
        content,
        block,        // inside a confirmed tool-call block
        after_block,  // a block closed; its calls end once we know where the whitespace after it belongs
        done,         // EOS seen or finished: further input is ignored
    };
    enum class Part { between, invoke_header, in_invoke, param_header, param_value };

    struct BlockCall {
        int index;
        ToolCall call;
    };

    State state;
    bool at_start;  // thinking mode, nothing consumed yet: a leading "<think>" is dropped
    bool reasoning_closed = false;
    std::string buf;             // input not yet consumed
    std::string eos_tail;        // the end of the input so far, when it could be the start of an EOS literal
    std::vector<DsmlEvent> out;  // events of the current feed/finish call
    int next_index = 0;          // tool call numbering across the completion

    // The block being parsed.
    Part part = Part::between;
    std::string raw;               // its bytes so far, leading whitespace included
    std::vector<BlockCall> calls;  // its calls
    bool block_complete = false;   // its closing tag was seen
    bool invoke_open = false;      // a call's arguments are open (false inside an invoke without a name)
    bool param_first = true;
    bool param_string = true;  // string="true" (or no string attribute)
    uint8_t param_closers = kDsmlVariants;
    std::string json_value;  // a string="false" value collected until its closing tag
    // Tentative state: the whole block stays buffered, so the search for its end resumes where it stopped.
    size_t scan = 0;
    size_t tentative_end = 0;  // past the block's closing tag, 0 while not seen

    explicit Impl(bool thinking) : state(thinking ? State::reasoning : State::content), at_start(thinking) {}

    // -- emitting ------------------------------------------------------------------------------------------------

    void emit_text(DsmlEvent::Kind kind, std::string_view text) {
        if (text.empty()) return;
        if (!out.empty() && out.back().kind == kind) {
            out.back().text += text;
            return;
        }
        DsmlEvent e;
        e.kind = kind;
        e.text = text;
        out.push_back(std::move(e));
    }

    void emit_args(std::string_view text) {
        if (!invoke_open || text.empty()) return;
        BlockCall & c = calls.back();
        c.call.arguments += text;
        if (!out.empty() && out.back().kind == DsmlEvent::Kind::tool_args && out.back().index == c.index) {
            out.back().text += text;
            return;
        }
        DsmlEvent e;
        e.kind = DsmlEvent::Kind::tool_args;
        e.index = c.index;
        e.text = text;
        out.push_back(std::move(e));
    }

    // Emits buf[0, n) as reasoning/content text, never splitting a UTF-8 sequence unless `final`.
    void emit_prefix(DsmlEvent::Kind kind, size_t n, bool final) {
        if (!final && n == buf.size()) n = utf8_complete(buf);
        emit_text(kind, std::string_view(buf).substr(0, n));
        buf.erase(0, n);
    }

    void eat(size_t n) {
        raw.append(buf, 0, n);
        buf.erase(0, n);
    }

    static Scan settle(Scan s, bool final) { return final && s == Scan::more ? Scan::no : s; }

    // -- reasoning -----------------------------------------------------------------------------------------------

    bool step_reasoning(bool final) {
        if (at_start) {
            Scan s = settle(match_literal(buf, 0, kThinkStartText), final);
            if (s == Scan::more) return false;
            if (s == Scan::yes) buf.erase(0, kThinkStartText.size());
            at_start = false;
        }
        size_t hold = buf.size();
        for (size_t p = 0; p < buf.size() && hold == buf.size(); ++p) {
            if (buf[p] == '<') {
                Scan end = settle(match_literal(buf, p, kThinkEndText), final);
                if (end == Scan::yes) {
                    emit_prefix(DsmlEvent::Kind::reasoning, p, true);
                    buf.erase(0, kThinkEndText.size());
                    reasoning_closed = true;
                    state = State::content;
                    return true;
                }
                if (end == Scan::more) hold = p;
            } else if (buf[p] == '\n') {
                Scan s = settle(match_literal(buf, p, kReasoningBlockOpener), final);
                if (s == Scan::yes) {
                    emit_prefix(DsmlEvent::Kind::reasoning, p, true);
                    state = State::tentative;
                    scan = 0;
                    tentative_end = 0;
                    return true;
                }
                if (s == Scan::more) hold = p;
            }
        }
        emit_prefix(DsmlEvent::Kind::reasoning, hold, final);
        if (final) state = State::done;
        return false;
    }

    // A tool block that opened inside reasoning is a call only when generation ends right after it; if reasoning
    // goes on (or "</think>" comes first) the block was just reasoning text.
    bool step_tentative(bool final) {
        if (tentative_end == 0) {
            for (size_t p = std::max<size_t>(scan, kReasoningBlockOpener.size()); p < buf.size(); ++p) {
                if (buf[p] != '<') continue;
                TagScan close = match_tag(buf, p, true, "tool_calls", kAnyVariant, false);
                Scan end = match_literal(buf, p, kThinkEndText);
                if (close.scan == Scan::yes) {
                    tentative_end = close.end;
                    break;
                }
                if (end == Scan::yes) {
                    emit_prefix(DsmlEvent::Kind::reasoning, p, true);
                    buf.erase(0, kThinkEndText.size());
                    reasoning_closed = true;
                    state = State::content;
                    return true;
                }
                if (!final && (close.scan == Scan::more || end == Scan::more)) {
                    scan = p;
                    return false;
                }
            }
            if (tentative_end == 0) {
                scan = buf.size();
                if (final) commit_tentative(buf.size());
                return false;
            }
        }
        size_t p = tentative_end;
        while (p < buf.size() && is_ws(buf[p])) ++p;
        if (p == buf.size()) {
            if (final) commit_tentative(p);
            return false;
        }
        emit_prefix(DsmlEvent::Kind::reasoning, tentative_end, true);
        state = State::reasoning;
        return true;
    }

    // Generation ended after buf[0, n): parse it as a tool block; without a call in it, it was reasoning.
    void commit_tentative(size_t n) {
        Impl sub(false);
        sub.next_index = next_index;
        sub.buf = buf.substr(0, n);
        sub.run(true);
        bool has_call = false;
        for (const DsmlEvent & e : sub.out) has_call = has_call || e.kind == DsmlEvent::Kind::tool_call_end;
        if (has_call) {
            for (DsmlEvent & e : sub.out) out.push_back(std::move(e));
            next_index = sub.next_index;
            buf.erase(0, n);
        } else {
            emit_prefix(DsmlEvent::Kind::reasoning, n, true);
        }
        state = State::done;
    }

    // -- content -------------------------------------------------------------------------------------------------

    bool step_content(bool final) {
        size_t hold = buf.size();
        size_t ws_start = 0;  // start of the whitespace run ending at p
        for (size_t p = 0; p < buf.size(); ++p) {
            char c = buf[p];
            if (is_ws(c)) continue;
            if (c == '<') {
                size_t lead = p;
                while (lead > ws_start && is_ws(buf[lead - 1])) --lead;
                Scan opener = settle(match_block_opener(p), final);
                if (opener == Scan::yes) {
                    emit_prefix(DsmlEvent::Kind::content, lead, true);
                    raw.clear();
                    calls.clear();
                    block_complete = false;
                    part = Part::between;
                    state = State::block;
                    eat(match_tag(buf, p - lead, false, "tool_calls", kAnyVariant, false).end);
                    return true;
                }
                if (opener == Scan::more) {
                    hold = lead;
                    break;
                }
            }
            ws_start = p + 1;
        }
        if (hold == buf.size()) {
            size_t trailing = buf.size();
            while (trailing > 0 && is_ws(buf[trailing - 1])) --trailing;
            if (!final) hold = trailing;
        }
        emit_prefix(DsmlEvent::Kind::content, hold, final);
        if (final) state = State::done;
        return false;
    }

    // A block opener counts once the first invoke tag after it is in sight: "<tool_calls>" alone is too common in
    // prose to act on.
    Scan match_block_opener(size_t p) const {
        TagScan open = match_tag(buf, p, false, "tool_calls", kAnyVariant, false);
        if (open.scan != Scan::yes) return open.scan;
        size_t q = open.end;
        while (q < buf.size() && is_ws(buf[q])) ++q;
        if (q == buf.size()) return Scan::more;
        return match_tag(buf, q, false, "invoke", kAnyVariant, true).scan;
    }

    // -- block ---------------------------------------------------------------------------------------------------

    void start_call(const std::string & name) {
        BlockCall c{next_index++, {}};
        c.call.name = name;
        calls.push_back(c);
        DsmlEvent e;
        e.kind = DsmlEvent::Kind::tool_call_start;
        e.index = c.index;
        e.call.name = name;
        out.push_back(std::move(e));
        invoke_open = true;
        param_first = true;
        emit_args("{");
    }

    void close_invoke() {
        emit_args("}");
        invoke_open = false;
    }

    void finish_value(std::string_view tail) {
        if (param_string) {
            std::string escaped = python_json_string(tail);
            emit_args(std::string_view(escaped).substr(1));  // drop the opening quote: it went out with the key
        } else {
            json_value += tail;
            emit_args(nlohmann::json::accept(json_value) ? json_value : python_json_string(json_value));
            json_value.clear();
        }
    }

    void end_block(bool complete) {
        if (invoke_open) close_invoke();
        block_complete = complete;
        if (calls.empty()) {
            // Nothing callable came of it: the bytes were text after all.
            emit_text(DsmlEvent::Kind::content, raw);
            raw.clear();
            state = State::content;
            return;
        }
        state = State::after_block;
    }

    bool step_block(bool final) {
        switch (part) {
            case Part::between:
            case Part::in_invoke: {
                size_t ws = 0;
                while (ws < buf.size() && is_ws(buf[ws])) ++ws;
                eat(ws);
                if (buf.empty()) {
                    if (!final) return false;
                    end_block(false);
                    return true;
                }
                if (buf[0] != '<') {
                    eat(1);  // stray text inside the block: kept in raw, otherwise ignored
                    return true;
                }
                bool in_invoke = part == Part::in_invoke;
                TagScan tag = in_invoke ? match_tag(buf, 0, false, "parameter", kAnyVariant, true)
                                        : match_tag(buf, 0, false, "invoke", kAnyVariant, true);
                if (tag.scan == Scan::yes) {
                    eat(tag.end);
                    param_closers = tag.variant == kPlain ? uint8_t(kPlain) : kDsmlVariants;
                    part = in_invoke ? Part::param_header : Part::invoke_header;
                    return true;
                }
                TagScan close_invoke_tag = match_tag(buf, 0, true, "invoke", kAnyVariant, false);
                if (in_invoke && close_invoke_tag.scan == Scan::yes) {
                    eat(close_invoke_tag.end);
                    if (invoke_open) close_invoke();
                    part = Part::between;
                    return true;
                }
                TagScan close_block = match_tag(buf, 0, true, "tool_calls", kAnyVariant, false);
                if (close_block.scan == Scan::yes) {  // also closes an invoke left open
                    eat(close_block.end);
                    end_block(true);
                    return true;
                }
                bool more = tag.scan == Scan::more || (in_invoke && close_invoke_tag.scan == Scan::more) ||
                            close_block.scan == Scan::more;
                if (more && !final) return false;
                eat(1);
                return true;
            }
            case Part::invoke_header:
            case Part::param_header: {
                Attributes a = parse_attributes(buf, 0);
                if (a.scan != Scan::yes) {
                    if (!final) return false;
                    eat(buf.size());  // cut off inside the tag: what it would have said is lost
                    end_block(false);
                    return true;
                }
                eat(a.end);
                auto name = a.values.find("name");
                if (part == Part::invoke_header) {
                    // An invoke without a name cannot be called: its parameters are consumed silently.
                    if (name != a.values.end() && !name->second.empty()) start_call(name->second);
                    part = Part::in_invoke;
                    return true;
                }
                auto string_attr = a.values.find("string");
                param_string = string_attr == a.values.end() || string_attr->second != "false";
                std::string head = param_first ? "" : ", ";
                head += python_json_string(name == a.values.end() ? std::string() : name->second);
                head += param_string ? ": \"" : ": ";
                if (invoke_open) param_first = false;
                emit_args(head);
                json_value.clear();
                part = Part::param_value;
                return true;
            }
            case Part::param_value: {
                size_t hold = buf.size();
                // Everything before `hold` is streamed below, so the buffer stays short and is scanned from 0.
                for (size_t p = 0; p < buf.size(); ++p) {
                    if (buf[p] != '<') continue;
                    TagScan close = match_tag(buf, p, true, "parameter", param_closers, false);
                    if (close.scan == Scan::yes) {
                        std::string value = buf.substr(0, p);
                        eat(close.end);
                        finish_value(value);
                        part = Part::in_invoke;
                        return true;
                    }
                    if (close.scan == Scan::more && !final) {
                        hold = p;
                        break;
                    }
                }
                if (final) {
                    std::string value = buf;
                    eat(buf.size());
                    finish_value(value);
                    end_block(false);
                    return true;
                }
                // Stream what cannot be part of the closing tag.
                size_t n = hold == buf.size() ? utf8_complete(buf) : hold;
                std::string_view chunk = std::string_view(buf).substr(0, n);
                if (param_string) {
                    std::string escaped = python_json_string(chunk);
                    emit_args(std::string_view(escaped).substr(1, escaped.size() - 2));
                } else {
                    json_value += chunk;
                }
                eat(n);
                return false;
            }
        }
        return false;
    }

    void flush_block_end() {
        for (BlockCall & c : calls) {
            DsmlEvent e;
            e.kind = DsmlEvent::Kind::tool_call_end;
            e.index = c.index;
            e.call = std::move(c.call);
            e.call.raw_dsml = raw;
            e.complete = block_complete;
            out.push_back(std::move(e));
        }
        calls.clear();
        raw.clear();
    }

    bool step_after_block(bool final) {
        size_t ws = 0;
        while (ws < buf.size() && is_ws(buf[ws])) ++ws;
        if (ws == buf.size()) {
            if (!final) return false;
            eat(ws);
            flush_block_end();
            state = State::done;
            return true;
        }
        flush_block_end();
        state = State::content;
        return true;
    }

    // -- driver --------------------------------------------------------------------------------------------------

    void run(bool final) {
        while (true) {
            bool progressed = false;
            switch (state) {
                case State::reasoning:
                    progressed = step_reasoning(final);
                    break;
                case State::tentative:
                    progressed = step_tentative(final);
                    break;
                case State::content:
                    progressed = step_content(final);
                    break;
                case State::block:
                    progressed = step_block(final);
                    break;
                case State::after_block:
                    progressed = step_after_block(final);
                    break;
                case State::done:
                    buf.clear();
                    return;
            }
            if (!progressed && !final) return;
        }
    }
};

DsmlStreamParser::DsmlStreamParser(bool thinking) : impl_(std::make_unique<Impl>(thinking)) {}
DsmlStreamParser::DsmlStreamParser(DsmlStreamParser &&) noexcept = default;
DsmlStreamParser & DsmlStreamParser::operator=(DsmlStreamParser &&) noexcept = default;
DsmlStreamParser::~DsmlStreamParser() = default;

std::vector<DsmlEvent> DsmlStreamParser::feed(std::string_view delta) {
    Impl & m = *impl_;
    if (m.state == Impl::State::done) return {};
    // EOS ends the completion wherever it appears (the engine normally stops before feeding it): the text before
    // it is the whole input. A tail that may be the start of an EOS waits for the next delta.
    std::string input = std::exchange(m.eos_tail, {});
    input += delta;
    size_t eos = input.find(kEosText);
    if (eos != std::string::npos) {
        m.buf.append(input, 0, eos);
        m.run(true);
        return std::exchange(m.out, {});
    }
    size_t keep = 0;
    for (size_t k = std::min(input.size(), kEosText.size() - 1); k > 0 && keep == 0; --k)
        if (kEosText.substr(0, k) == std::string_view(input).substr(input.size() - k)) keep = k;
    m.eos_tail = input.substr(input.size() - keep);
    m.buf.append(input, 0, input.size() - keep);
    m.run(false);
    return std::exchange(m.out, {});
}

std::vector<DsmlEvent> DsmlStreamParser::finish() {
    Impl & m = *impl_;
    if (m.state != Impl::State::done) m.buf += std::exchange(m.eos_tail, {});
    m.run(true);
    return std::exchange(m.out, {});
}

bool DsmlStreamParser::reasoning_closed() const { return impl_->reasoning_closed; }

ParsedCompletion parse_completion(std::string_view text, bool thinking) {
    DsmlStreamParser parser(thinking);
    std::vector<DsmlEvent> events = parser.feed(text);
    std::vector<DsmlEvent> tail = parser.finish();
    events.insert(events.end(), tail.begin(), tail.end());
    ParsedCompletion result;
    for (DsmlEvent & e : events) {
        switch (e.kind) {
            case DsmlEvent::Kind::reasoning:
                result.reasoning += e.text;
                break;
            case DsmlEvent::Kind::content:
                result.content += e.text;
                break;
            case DsmlEvent::Kind::tool_call_end:
                result.truncated = result.truncated || !e.complete;
                result.tool_calls.push_back(std::move(e.call));
                break;
            default:
                break;
        }
    }
    result.reasoning_closed = parser.reasoning_closed();
    return result;
}

}  // namespace dsv4
