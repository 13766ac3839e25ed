// DSML: the official parser's results on canonical completions (tests/data/chat/parse_cases.json, produced by
// encoding_dsv4.py's parse_message_from_completion_text), the deviations we tolerate, hostile values, streaming
// (random splits must give the same result and lose no byte), and the Python-compatible JSON writer.
#include "text/dsml.h"
#include "util/error.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

using namespace dsv4;
using ojson = nlohmann::ordered_json;
using Kind = DsmlEvent::Kind;

namespace {

const std::string kEos(kEosText);

std::string read_file(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    EXPECT_TRUE(f.good()) << path;
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// What a stream of events adds up to.
struct Summary {
    std::string reasoning, content;
    std::vector<ToolCall> calls;
    std::vector<bool> complete;
    std::string rebuilt_after_reasoning;  // content deltas and raw blocks in event order
    bool reasoning_after_other = false;   // a reasoning event came after content or a tool event
};

Summary summarize(const std::vector<DsmlEvent> & events) {
    Summary s;
    std::map<int, std::string> streamed_args;
    std::map<int, std::string> started_names;
    bool other_seen = false;
    for (size_t i = 0; i < events.size(); ++i) {
        const DsmlEvent & e = events[i];
        switch (e.kind) {
            case Kind::reasoning:
                s.reasoning += e.text;
                s.reasoning_after_other = s.reasoning_after_other || other_seen;
                break;
            case Kind::content:
                s.content += e.text;
                s.rebuilt_after_reasoning += e.text;
                other_seen = true;
                break;
            case Kind::tool_call_start:
                EXPECT_FALSE(started_names.count(e.index)) << "started twice: " << e.index;
                started_names[e.index] = e.call.name;
                other_seen = true;
                break;
            case Kind::tool_args:
                EXPECT_TRUE(started_names.count(e.index)) << "arguments before start: " << e.index;
                streamed_args[e.index] += e.text;
                break;
            case Kind::tool_call_end:
                EXPECT_EQ(started_names[e.index], e.call.name);
                EXPECT_EQ(streamed_args[e.index], e.call.arguments) << "streamed arguments differ";
                // The calls of one block end together and share its raw bytes: add them once per run of ends.
                if (i == 0 || events[i - 1].kind != Kind::tool_call_end) s.rebuilt_after_reasoning += e.call.raw_dsml;
                s.calls.push_back(e.call);
                s.complete.push_back(e.complete);
                other_seen = true;
                break;
        }
    }
    return s;
}

std::vector<DsmlEvent> stream(std::string_view text, bool thinking, const std::vector<size_t> & cuts,
                              bool * closed = nullptr) {
    DsmlStreamParser p(thinking);
    std::vector<DsmlEvent> all;
    size_t at = 0;
    for (size_t cut : cuts) {
        auto ev = p.feed(text.substr(at, cut - at));
        all.insert(all.end(), ev.begin(), ev.end());
        at = cut;
    }
    auto ev = p.feed(text.substr(at));
    all.insert(all.end(), ev.begin(), ev.end());
    ev = p.finish();
    all.insert(all.end(), ev.begin(), ev.end());
    if (closed) *closed = p.reasoning_closed();
    return all;
}

bool valid_utf8(std::string_view s) {
    for (size_t i = 0; i < s.size();) {
        uint8_t c = uint8_t(s[i]);
        size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (n == 0 || i + n > s.size()) return false;
        for (size_t k = 1; k < n; ++k)
            if ((uint8_t(s[i + k]) & 0xC0) != 0x80) return false;
        i += n;
    }
    return true;
}

std::string block(const std::string & invokes) {
    return "\n\n<｜DSML｜tool_calls>\n" + invokes + "\n</｜DSML｜tool_calls>";
}
std::string invoke(const std::string & name, const std::string & params) {
    return "<｜DSML｜invoke name=\"" + name + "\">\n" + params + "\n</｜DSML｜invoke>";
}
std::string param(const std::string & name, const std::string & value, bool string) {
    return "<｜DSML｜parameter name=\"" + name + "\" string=\"" + (string ? "true" : "false") + "\">" + value +
           "</｜DSML｜parameter>";
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Against the official parser
// ---------------------------------------------------------------------------------------------------------------------

TEST(DsmlParse, OfficialParserGoldens) {
    ojson cases = ojson::parse(read_file(std::string(DSV4_TEST_DATA) + "/chat/parse_cases.json"));
    ASSERT_GE(cases.size(), 8u);
    for (const ojson & c : cases) {
        std::string text = c["text"];
        bool thinking = c["thinking"];
        const ojson & want = c["expected"];
        ParsedCompletion got = parse_completion(text, thinking);
        SCOPED_TRACE(c["name"].get<std::string>());
        EXPECT_EQ(got.reasoning, want["reasoning"].get<std::string>());
        EXPECT_EQ(got.content, want["content"].get<std::string>());
        EXPECT_EQ(got.reasoning_closed, thinking);
        EXPECT_FALSE(got.truncated);
        ASSERT_EQ(got.tool_calls.size(), want["tool_calls"].size());
        for (size_t i = 0; i < got.tool_calls.size(); ++i) {
            EXPECT_EQ(got.tool_calls[i].name, want["tool_calls"][i]["name"].get<std::string>());
            EXPECT_EQ(got.tool_calls[i].arguments, want["tool_calls"][i]["arguments"].get<std::string>());
            EXPECT_TRUE(got.tool_calls[i].id.empty());
        }
        if (got.tool_calls.empty()) continue;
        // raw_dsml is exactly the bytes between the content and EOS, and the canonical re-render (verified
        // against the official encoder in chat_test) of the parsed calls gives the same bytes back.
        size_t content_end = text.find(got.content + "\n\n<｜DSML｜tool_calls", thinking ? text.find("</think>") : 0) +
                             got.content.size();
        std::string raw = text.substr(content_end, text.size() - kEos.size() - content_end);
        std::vector<ToolCall> calls = got.tool_calls;
        for (ToolCall & call : calls) {
            EXPECT_EQ(call.raw_dsml, raw);
            call.raw_dsml.clear();
        }
        EXPECT_EQ(pieces_text(render_tool_calls(calls)), raw);
    }
}

TEST(DsmlParse, StreamedLikeWhole) {
    ojson cases = ojson::parse(read_file(std::string(DSV4_TEST_DATA) + "/chat/parse_cases.json"));
    for (const ojson & c : cases) {
        std::string text = c["text"];
        bool thinking = c["thinking"];
        Summary whole = summarize(stream(text, thinking, {}));
        std::vector<size_t> every_byte;
        for (size_t i = 1; i < text.size(); ++i) every_byte.push_back(i);
        std::vector<DsmlEvent> events = stream(text, thinking, every_byte);
        Summary bytewise = summarize(events);
        SCOPED_TRACE(c["name"].get<std::string>());
        EXPECT_EQ(bytewise.reasoning, whole.reasoning);
        EXPECT_EQ(bytewise.content, whole.content);
        ASSERT_EQ(bytewise.calls.size(), whole.calls.size());
        for (size_t i = 0; i < whole.calls.size(); ++i) {
            EXPECT_EQ(bytewise.calls[i].arguments, whole.calls[i].arguments);
            EXPECT_EQ(bytewise.calls[i].raw_dsml, whole.calls[i].raw_dsml);
        }
        // Fed one byte at a time, every delta is still whole UTF-8 characters.
        for (const DsmlEvent & e : events) EXPECT_TRUE(valid_utf8(e.text)) << e.text;
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Tolerated deviations
// ---------------------------------------------------------------------------------------------------------------------

TEST(DsmlParse, SpellingVariants) {
    // The first bar missing on every tag.
    ParsedCompletion a = parse_completion(
        "x\n<DSML｜tool_calls>\n<DSML｜invoke name=\"f\">\n<DSML｜parameter name=\"a\" "
        "string=\"true\">v</DSML｜parameter>"
        "\n</DSML｜invoke>\n</DSML｜tool_calls>",
        false);
    ASSERT_EQ(a.tool_calls.size(), 1u);
    EXPECT_EQ(a.content, "x");
    EXPECT_EQ(a.tool_calls[0].name, "f");
    EXPECT_EQ(a.tool_calls[0].arguments, R"({"a": "v"})");
    EXPECT_FALSE(a.truncated);

    // Plain tags, no whitespace between them, missing string= (a string), string="false".
    ParsedCompletion b = parse_completion(
        "<tool_calls><invoke name=\"g\"><parameter name=\"s\">42</parameter><parameter name=\"n\" string=\"false\">42"
        "</parameter></invoke></tool_calls>",
        false);
    ASSERT_EQ(b.tool_calls.size(), 1u);
    EXPECT_EQ(b.content, "");
    EXPECT_EQ(b.tool_calls[0].arguments, R"({"s": "42", "n": 42})");

    // Whitespace everywhere inside and between tags, single quotes, entities in attributes (values stay as is).
    ParsedCompletion c = parse_completion(
        "Sure.  \n <｜DSML｜tool_calls >\n\n  <｜DSML｜invoke   name = 'a&amp;b' >\n\t<｜DSML｜parameter  "
        "string=\"true\" "
        "name=\"q&quot;\"  >&lt;x&gt; &amp;&amp;</｜DSML｜parameter >\n </｜DSML｜invoke  >\n</｜DSML｜tool_calls  >",
        false);
    ASSERT_EQ(c.tool_calls.size(), 1u);
    EXPECT_EQ(c.content, "Sure.");
    EXPECT_EQ(c.tool_calls[0].name, "a&b");
    EXPECT_EQ(c.tool_calls[0].arguments, R"({"q\"": "&lt;x&gt; &amp;&amp;"})");
    EXPECT_EQ(c.tool_calls[0].raw_dsml.substr(0, 4), "  \n ");

    // Mixed spellings in one block: a plain parameter inside canonical tags closes only with its own spelling.
    ParsedCompletion d = parse_completion(block(invoke("h",
                                                       "<parameter name=\"xml\"><a></｜DSML｜parameter></a>"
                                                       "</parameter>")),
                                          false);
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].arguments, R"({"xml": "<a></｜DSML｜parameter></a>"})");
}

TEST(DsmlParse, MissingThinkEndBeforeCall) {
    // Thinking never closed, then a tool block, then the end: the block is a call and ends the reasoning.
    std::string text = "I need the weather." + block(invoke("get_weather", param("city", "Oslo", true))) + kEos;
    ParsedCompletion p = parse_completion(text, true);
    EXPECT_EQ(p.reasoning, "I need the weather.");
    EXPECT_FALSE(p.reasoning_closed);
    EXPECT_EQ(p.content, "");
    ASSERT_EQ(p.tool_calls.size(), 1u);
    EXPECT_EQ(p.tool_calls[0].arguments, R"({"city": "Oslo"})");
    EXPECT_EQ(p.tool_calls[0].raw_dsml, block(invoke("get_weather", param("city", "Oslo", true))));
}

TEST(DsmlParse, DsmlInsideReasoningIsNeverExecuted) {
    // A whole canonical block inside reasoning that goes on afterwards.
    std::string b = block(invoke("rm", param("path", "/", true)));
    ParsedCompletion p = parse_completion("Plan:" + b + "\nNo, too risky.</think>I won't." + kEos, true);
    EXPECT_TRUE(p.tool_calls.empty());
    EXPECT_EQ(p.reasoning, "Plan:" + b + "\nNo, too risky.");
    EXPECT_EQ(p.content, "I won't.");

    // The block is never closed but </think> comes.
    std::string open = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"rm\">";
    p = parse_completion("Hmm" + open + " is the syntax.</think>Answer.", true);
    EXPECT_TRUE(p.tool_calls.empty());
    EXPECT_EQ(p.reasoning, "Hmm" + open + " is the syntax.");
    EXPECT_EQ(p.content, "Answer.");

    // Other spellings in reasoning stay text even at the very end.
    p = parse_completion("x <tool_calls>\n<invoke name=\"rm\">\n</invoke>\n</tool_calls>", true);
    EXPECT_TRUE(p.tool_calls.empty());
    EXPECT_EQ(p.reasoning, "x <tool_calls>\n<invoke name=\"rm\">\n</invoke>\n</tool_calls>");

    // After </think>, the same markup is a call.
    p = parse_completion("x</think>" + b, true);
    EXPECT_EQ(p.tool_calls.size(), 1u);
}

TEST(DsmlParse, TruncatedAtTokenLimit) {
    // Cut inside a string value: the call is closed with what was there.
    std::string text = "ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"write\">\n" + param("path", "a.txt", true) +
                       "\n<｜DSML｜parameter name=\"body\" string=\"true\">line 1\nli";
    ParsedCompletion p = parse_completion(text, false);
    ASSERT_EQ(p.tool_calls.size(), 1u);
    EXPECT_TRUE(p.truncated);
    EXPECT_EQ(p.tool_calls[0].arguments, R"({"path": "a.txt", "body": "line 1\nli"})");
    EXPECT_EQ(p.tool_calls[0].raw_dsml, text.substr(2));
    EXPECT_EQ(p.content, "ok");

    // Cut inside a JSON value that does not parse: kept as a string.
    std::string cut =
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"n\" string=\"false\">[1, 2";
    p = parse_completion(cut, false);
    ASSERT_EQ(p.tool_calls.size(), 1u);
    EXPECT_EQ(p.tool_calls[0].arguments, R"({"n": "[1, 2"})");

    // Cut inside a parameter header: that parameter is lost, the call survives.
    p = parse_completion("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n" + param("a", "1", false) +
                             "\n<｜DSML｜parameter name=\"b\" str",
                         false);
    ASSERT_EQ(p.tool_calls.size(), 1u);
    EXPECT_EQ(p.tool_calls[0].arguments, R"({"a": 1})");

    // Cut inside the first invoke header: no call at all, so the bytes are content.
    std::string no_call = "Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f";
    p = parse_completion(no_call, false);
    EXPECT_TRUE(p.tool_calls.empty());
    EXPECT_EQ(p.content, no_call);
    EXPECT_FALSE(p.truncated);

    // EOS inside the block (the engine stopped on it): closes the block, nothing after it counts.
    p = parse_completion("<｜DSML｜tool_calls>\n" + invoke("f", param("a", "1", false)) + kEos + "junk", false);
    ASSERT_EQ(p.tool_calls.size(), 1u);
    EXPECT_TRUE(p.truncated);
    EXPECT_EQ(p.content, "");
}

TEST(DsmlParse, HostileValues) {
    std::string code =
        "#include <vector>\nint f() { return a<b && c>d ? 1 : 0; } // </div> </parameter>\n"
        "std::string s = \"quote \\\" backslash \\\\ tab\t\";\n</｜DSML｜paramete\n</DSML｜invoke>";
    std::string unicode = "日本語 — 🌍 é \x7f \x01 \u2028";
    std::string text = block(invoke("edit", param("code", code, true) + "\n" + param("u", unicode, true) + "\n" +
                                                param("nested", R"({"a": [1, {"b": null}], "c": "x</y"})", false)) +
                             "\n" + invoke("noop", "")) +
                       kEos;
    ParsedCompletion p = parse_completion(text, false);
    ASSERT_EQ(p.tool_calls.size(), 2u);
    ojson args = ojson::parse(p.tool_calls[0].arguments);
    EXPECT_EQ(args["code"].get<std::string>(), code);
    EXPECT_EQ(args["u"].get<std::string>(), unicode);
    EXPECT_EQ(args["nested"]["c"].get<std::string>(), "x</y");
    EXPECT_EQ(p.tool_calls[0].arguments.substr(p.tool_calls[0].arguments.find("\"u\": ")),
              "\"u\": \"日本語 — 🌍 é \x7f \\u0001 \u2028\", \"nested\": {\"a\": [1, {\"b\": null}], \"c\": \"x</y\"}}");
    EXPECT_EQ(p.tool_calls[1].name, "noop");
    EXPECT_EQ(p.tool_calls[1].arguments, "{}");
    EXPECT_EQ(p.tool_calls[0].raw_dsml, p.tool_calls[1].raw_dsml);
}

TEST(DsmlParse, NotMarkup) {
    for (const std::string & text :
         {std::string("Use the <tool_calls> tag, then <invoke>."), std::string("a < b and c <d> </tool_calls>"),
          std::string("<｜DSML｜tool_calls> alone\n"), std::string("</think> in chat content, <think> too"),
          std::string("<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>"), std::string("trailing spaces   \n\n"),
          std::string("<tool_calls>\n<invoker name=\"x\">")}) {
        ParsedCompletion p = parse_completion(text, false);
        EXPECT_EQ(p.content, text);
        EXPECT_TRUE(p.tool_calls.empty()) << text;
    }
}

TEST(DsmlParse, SeveralBlocksAndTextAfter) {
    std::string b1 = block(invoke("a", param("x", "1", false)));
    std::string b2 =
        "\n<tool_calls>\n<invoke name=\"b\">\n<parameter name=\"y\">2</parameter>\n</invoke>\n</tool_calls>";
    ParsedCompletion p = parse_completion("Start" + b1 + "\nmiddle" + b2 + " \n" + kEos, false);
    ASSERT_EQ(p.tool_calls.size(), 2u);
    EXPECT_EQ(p.content, "Start\nmiddle");
    EXPECT_EQ(p.tool_calls[0].raw_dsml, b1);
    EXPECT_EQ(p.tool_calls[1].raw_dsml, b2 + " \n");  // whitespace before EOS belongs to the block
    EXPECT_EQ(p.tool_calls[1].arguments, R"({"y": "2"})");

    // A leading <think> echoed by the model is dropped; text after EOS is ignored.
    p = parse_completion("<think>r</think>c" + kEos + "ignored", true);
    EXPECT_EQ(p.reasoning, "r");
    EXPECT_EQ(p.content, "c");

    // Duplicate parameter names are kept in order (JSON readers take the last).
    p = parse_completion(block(invoke("d", param("k", "1", false) + "\n" + param("k", "2", false))), false);
    EXPECT_EQ(p.tool_calls[0].arguments, R"({"k": 1, "k": 2})");
}

// ---------------------------------------------------------------------------------------------------------------------
// Streaming behaviour
// ---------------------------------------------------------------------------------------------------------------------

TEST(DsmlStream, EventsArriveEarly) {
    DsmlStreamParser p(false);
    auto ev = p.feed("Hello <to");
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].kind, Kind::content);
    EXPECT_EQ(ev[0].text, "Hello");  // " <to" might still be markup
    ev = p.feed("ol_calls> is a tag");
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].text, " <tool_calls> is a tag");

    ev = p.feed("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\"");
    EXPECT_TRUE(ev.empty());
    ev = p.feed(">\n<｜DSML｜parameter name=\"body\" string=\"true\">hello wor");
    ASSERT_EQ(ev.size(), 2u);
    EXPECT_EQ(ev[0].kind, Kind::tool_call_start);
    EXPECT_EQ(ev[0].index, 0);
    EXPECT_EQ(ev[0].call.name, "f");
    EXPECT_EQ(ev[1].kind, Kind::tool_args);
    EXPECT_EQ(ev[1].text, "{\"body\": \"hello wor");
    ev = p.feed("ld\n</｜DSML｜param");
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].text, "ld\\n");
    ev = p.feed("eter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].text, "\"}");
    ev = p.finish();
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].kind, Kind::tool_call_end);
    EXPECT_EQ(ev[0].call.arguments, R"({"body": "hello world\n"})");
    EXPECT_TRUE(ev[0].complete);
}

TEST(DsmlStream, ReasoningHoldsOnlyPossibleMarkers) {
    DsmlStreamParser p(true);
    auto ev = p.feed("<thi");
    EXPECT_TRUE(ev.empty());
    ev = p.feed("nk>step 1\n");
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].text, "step 1");
    ev = p.feed("\nstep 2 </th");
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].text, "\n\nstep 2 ");
    ev = p.feed("ink>done");
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].kind, Kind::content);
    EXPECT_EQ(ev[0].text, "done");
    EXPECT_TRUE(p.reasoning_closed());
}

// Random inputs built from markup and near-markup fragments, cut at random byte offsets: every split gives the same
// result as the whole text, and reasoning + "</think>" + content and raw blocks in event order rebuild the input.
TEST(DsmlStream, RandomSplitsLoseNothing) {
    const std::vector<std::string> reasoning_bits = {"Let me think.",
                                                     "\n\n",
                                                     "a < b",
                                                     "</thi",
                                                     "<｜DSML｜invoke name=\"x\">",
                                                     "\n\n<｜DSML｜tool_call",
                                                     "日本",
                                                     "<tool_calls>",
                                                     "\n",
                                                     " ",
                                                     "<think>",
                                                     "&amp;"};
    const std::vector<std::string> content_bits = {
        "Answer.",          "\n\n", " ", "<tool_calls> tag", "x <｜DSML｜tool_calls>\n", "é🌍", "</think>", "<", "a<b",
        "<｜end▁of▁senten", "\t\n"};
    const std::vector<std::string> blocks = {
        block(invoke("f", param("a", "v1", true))),
        block(invoke("g", param("code", "if (a < b && c) {}\n</div>", true) + "\n" + param("n", "[1, 2]", false)) +
              "\n" + invoke("h", "")),
        "\n<DSML｜tool_calls>\n<DSML｜invoke name=\"m\">\n<DSML｜parameter name=\"k\">x</DSML｜parameter>\n"
        "</DSML｜invoke>\n</DSML｜tool_calls>",
        " <tool_calls><invoke name=\"p\"><parameter name=\"z\" string=\"false\">{\"q\": 1}</parameter></invoke>"
        "</tool_calls>",
        "\n\n<｜DSML｜tool_calls>\n <｜DSML｜invoke  name=\"w\" >\n<｜DSML｜parameter name=\"s\" string=\"false\">not "
        "json"
        "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>  \n"};
    std::mt19937 rng(1234);
    auto pick = [&](const std::vector<std::string> & v) { return v[rng() % v.size()]; };
    int checked = 0, with_calls = 0, truncated = 0, calls_without_think_end = 0, blocks_in_reasoning = 0;
    for (int iter = 0; iter < 600; ++iter) {
        bool thinking = rng() % 2;
        std::string text;
        bool leading_think = thinking && rng() % 4 == 0;
        if (leading_think) text += "<think>";
        if (thinking) {
            for (int i = rng() % 5; i > 0; --i) text += pick(reasoning_bits);
            int end = rng() % 4;
            if (end == 0 && text.find("</think>") == std::string::npos) {
                text += pick(blocks);  // a call that forgot "</think>"
            } else {
                text += "</think>";
            }
        }
        for (int parts = rng() % 5; parts > 0; --parts) text += rng() % 3 ? pick(content_bits) : pick(blocks);
        if (rng() % 5 == 0) text = text.substr(0, rng() % (text.size() + 1));  // the token limit
        if (rng() % 6 == 0) text += kEos;

        bool whole_closed = false;
        std::vector<DsmlEvent> whole_events = stream(text, thinking, {}, &whole_closed);
        Summary whole = summarize(whole_events);
        EXPECT_FALSE(whole.reasoning_after_other);

        // The input minus what the parser consumes as markers.
        std::string expected = text.substr(0, text.find(kEos));
        if (thinking && expected.rfind("<think>", 0) == 0) expected.erase(0, 7);
        std::string rebuilt = whole.reasoning + (whole_closed ? "</think>" : "") + whole.rebuilt_after_reasoning;
        ASSERT_EQ(rebuilt, expected) << "input: " << text;
        with_calls += !whole.calls.empty();
        for (bool c : whole.complete) truncated += !c;
        calls_without_think_end += thinking && !whole_closed && !whole.calls.empty();
        blocks_in_reasoning += whole.reasoning.find("tool_calls>") != std::string::npos;

        for (int split = 0; split < 4; ++split) {
            std::vector<size_t> cuts;
            for (size_t i = 1; i < text.size(); ++i)
                if (rng() % 4 == 0) cuts.push_back(i);
            bool closed = false;
            Summary s = summarize(stream(text, thinking, cuts, &closed));
            ASSERT_EQ(s.reasoning, whole.reasoning) << text;
            ASSERT_EQ(s.content, whole.content) << text;
            ASSERT_EQ(closed, whole_closed);
            ASSERT_EQ(s.rebuilt_after_reasoning, whole.rebuilt_after_reasoning) << text;
            ASSERT_EQ(s.calls.size(), whole.calls.size()) << text;
            for (size_t i = 0; i < s.calls.size(); ++i) {
                EXPECT_EQ(s.calls[i].name, whole.calls[i].name);
                EXPECT_EQ(s.calls[i].arguments, whole.calls[i].arguments);
                EXPECT_EQ(s.complete[i], whole.complete[i]);
                EXPECT_TRUE(ojson::accept(s.calls[i].arguments)) << s.calls[i].arguments;
            }
            ++checked;
        }
    }
    EXPECT_EQ(checked, 2400);
    // The generator reaches the interesting paths.
    EXPECT_GT(with_calls, 150);
    EXPECT_GT(truncated, 10);
    EXPECT_GT(calls_without_think_end, 10);
    EXPECT_GT(blocks_in_reasoning, 10);
    std::printf(
        "random inputs: %d with calls, %d truncated calls, %d calls without </think>, %d blocks kept as "
        "reasoning\n",
        with_calls, truncated, calls_without_think_end, blocks_in_reasoning);
}

// Markup soup: random sequences of tag fragments, quotes, markers and invalid bytes, fed in random pieces. Whatever
// comes in, streaming agrees with the whole-text parse and every call's arguments are a JSON object.
TEST(DsmlStream, MarkupSoup) {
    const std::vector<std::string> alphabet = {"<",
                                               "/",
                                               "｜DSML｜",
                                               "DSML｜",
                                               "tool_calls",
                                               "invoke",
                                               "parameter",
                                               " name=",
                                               "\"",
                                               "'",
                                               ">",
                                               "\n",
                                               " ",
                                               " string=",
                                               "false",
                                               "true",
                                               "</think>",
                                               "<think>",
                                               "a",
                                               "{",
                                               "}",
                                               "[1",
                                               "&amp;",
                                               "<｜end▁of▁sen",
                                               "tence｜>",
                                               "日",
                                               "\xff",
                                               "=",
                                               "\n\n<｜DSML｜tool_calls>",
                                               "<｜DSML｜invoke name=\"f\">",
                                               "<｜DSML｜parameter name=\"p\" string=\"false\">",
                                               "</｜DSML｜parameter>",
                                               "</｜DSML｜invoke>",
                                               "</｜DSML｜tool_calls>"};
    std::mt19937 rng(7);
    size_t calls = 0;
    for (int iter = 0; iter < 20000; ++iter) {
        std::string text;
        for (int n = rng() % 40; n > 0; --n) text += alphabet[rng() % alphabet.size()];
        bool thinking = rng() % 2;
        std::vector<size_t> cuts;
        for (size_t at = 1 + rng() % 8; at < text.size(); at += 1 + rng() % 8) cuts.push_back(at);
        Summary streamed = summarize(stream(text, thinking, cuts));
        ParsedCompletion whole = parse_completion(text, thinking);
        ASSERT_EQ(streamed.reasoning, whole.reasoning) << text;
        ASSERT_EQ(streamed.content, whole.content) << text;
        ASSERT_EQ(streamed.calls.size(), whole.tool_calls.size()) << text;
        for (const ToolCall & c : whole.tool_calls) {
            ASSERT_TRUE(ojson::accept(c.arguments)) << c.arguments;
            ASSERT_TRUE(ojson::parse(c.arguments).is_object()) << c.arguments;
        }
        calls += whole.tool_calls.size();
    }
    EXPECT_GT(calls, 200u);
}

// A long value streamed a few bytes at a time stays linear (the parser never rescans what it already passed).
TEST(DsmlStream, LongValueIsLinear) {
    std::string body;
    for (int i = 0; i < 20000; ++i) body += "line " + std::to_string(i) + " <x> && y\n";
    std::string text = "I'll write it." + block(invoke("write", param("content", body, true)));
    for (bool thinking : {false, true}) {  // thinking: the block is held back until generation ends
        DsmlStreamParser p(thinking);
        std::string args;
        for (size_t i = 0; i < text.size(); i += 3)
            for (const DsmlEvent & e : p.feed(std::string_view(text).substr(i, 3)))
                if (e.kind == Kind::tool_args) args += e.text;
        for (const DsmlEvent & e : p.finish())
            if (e.kind == Kind::tool_args) args += e.text;
        EXPECT_EQ(ojson::parse(args)["content"].get<std::string>(), body);
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Rendering helpers
// ---------------------------------------------------------------------------------------------------------------------

TEST(DsmlRender, PythonJsonDumps) {
    // Right-hand sides are Python 3.11's json.dumps(json.loads(lhs), ensure_ascii=False).
    const std::pair<std::string, std::string> cases[] = {
        {"1.0", "1.0"},
        {"1e16", "1e+16"},
        {"1e15", "1000000000000000.0"},
        {"123456789012345678", "123456789012345678"},
        {"1.5e-7", "1.5e-07"},
        {"0.0001", "0.0001"},
        {"0.00001", "1e-05"},
        {"-0.0", "-0.0"},
        {"1E5", "100000.0"},
        {"12345678901234567890", "12345678901234567890"},
        {"2.5e300", "2.5e+300"},
        {"0.1", "0.1"},
        {"5e-324", "5e-324"},
        {"123.456e5", "12345600.0"},
        {R"({"b":1,"a":[true,false,null,{}],"c":{"x":[]}})",
         R"({"b": 1, "a": [true, false, null, {}], "c": {"x": []}})"},
        {R"("é\u00e9\ud83c\udf0d/\/\b\f\n\r\t\u0001\u007f\"\\")", "\"éé🌍//\\b\\f\\n\\r\\t\\u0001\x7f\\\"\\\\\""},
    };
    for (const auto & [in, out] : cases) EXPECT_EQ(python_json_dumps(in), out) << in;
    EXPECT_THROW(python_json_dumps("{"), Error);
    EXPECT_THROW(python_json_dumps(std::string(100000, '[') + std::string(100000, ']')), Error);
    EXPECT_EQ(json_nesting_depth(R"({"a": ["[{", {"b": "\"]"}]})"), 3);
    EXPECT_EQ(python_json_string("a\xff"
                                 "b\xe6\x97"),
              "\"a\xEF\xBF\xBD"
              "b\xEF\xBF\xBD\"");
}

TEST(DsmlRender, ToolDefinitions) {
    EXPECT_EQ(
        function_from_openai_tool(
            R"({"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object"},"strict":true}})"),
        R"({"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": true})");
    EXPECT_EQ(function_from_openai_tool(R"({"name":"bare","parameters":{}})"), R"({"name": "bare", "parameters": {}})");
    EXPECT_EQ(
        function_from_anthropic_tool(
            R"({"name":"a","input_schema":{"type":"object","properties":{"q":{"type":"string"}}},"description":"x","cache_control":{}})"),
        R"({"name": "a", "description": "x", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}})");
    auto error_of = [](auto fn, const char * json) {
        try {
            fn(json);
        } catch (const Error & e) {
            return std::string(e.what());
        }
        return std::string("no error");
    };
    EXPECT_EQ(error_of(function_from_openai_tool, R"({"type":"function","function":{"description":"d"}})"),
              "function.name: missing or not a non-empty string");
    EXPECT_EQ(error_of(function_from_openai_tool, R"({"function":3})"), "function: expected an object");
    EXPECT_EQ(error_of(function_from_openai_tool, "[]"), "expected an object");
    EXPECT_NE(error_of(function_from_openai_tool, "{"), "no error");
    EXPECT_EQ(error_of(function_from_anthropic_tool, R"({"name":"a"})"), "input_schema: missing or not an object");
    EXPECT_EQ(error_of(function_from_anthropic_tool, R"({"input_schema":{}})"),
              "name: missing or not a non-empty string");
    EXPECT_EQ(error_of(function_from_anthropic_tool, R"({"name":"a","description":1,"input_schema":{}})"),
              "description: expected a string");
}

TEST(DsmlRender, ArgumentsFallbacks) {
    auto render = [](const std::string & args) { return pieces_text(render_tool_calls({{"", "f", args, ""}})); };
    // Not JSON: the official fallback, one string parameter named "arguments".
    EXPECT_NE(render("oops {").find("<｜DSML｜parameter name=\"arguments\" string=\"true\">oops {</｜DSML｜parameter>"),
              std::string::npos);
    // JSON but not an object (the official encoder would crash): wrapped the same way, as JSON.
    EXPECT_NE(render("[1,2]").find("<｜DSML｜parameter name=\"arguments\" string=\"false\">[1, 2]</｜DSML｜parameter>"),
              std::string::npos);
    EXPECT_EQ(render("{}"),
              "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
}
