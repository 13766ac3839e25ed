// libFuzzer entry point for everything dsv4-server reads from a client or from the model: a request body through the
// API's parser (server/api.h), the chat prompt rendered and tokenized, then a model reply through the detokenizer and
// api::ReplyBuilder (the DSML parser and the API's Writer), as the server's Runner drives them. The input is
//
//   byte 0        the route (low 3 bits: chat, completions, messages, responses, then count_tokens), the template
//                 version (bit 3), the context (bit 4: 1M, else 64K), how the reply ends (bits 5-7)
//   bytes 1..NUL  the request body
//   after NUL     the model's reply as text, tokenized with special tokens recognised (so DSML and </think> come as
//                 the model's own tokens), streamed in updates of 1-8 tokens
//
// What must hold, or the run traps:
//   - a refused request throws ApiError (status 4xx) or dsv4::Error, never anything else, and its error body is JSON;
//   - the rendered prompt's control tokens are exactly the template's special pieces (client text never becomes one)
//     and the prompt's ids decode back to its text;
//   - every Writer output is JSON: the whole response, and each `data:` line of a stream (besides [DONE]);
//   - a tool call's streamed argument fragments join into its final arguments;
//   - the streamed reply parses as the whole reply does (parse_completion).
#include "fuzz/api_fuzz.h"
#include "format/gguf.h"
#include "fuzz/fuzz_check.h"
#include "server/api.h"
#include "text/chat.h"
#include "text/dsml.h"
#include "text/tokenizer.h"
#include "util/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace dsv4;
using api::ApiError;
using api::Prepared;
using api::Writer;

const Tokenizer & vocabulary() {
    static const Tokenizer tok = Tokenizer::from_gguf(GgufFile::open(DSV4_VOCAB_GGUF));
    return tok;
}

bool is_json(std::string_view text) { return nlohmann::json::accept(text); }

// Every event's data line of a server-sent-events chunk is JSON; "[DONE]" ends OpenAI's streams.
void check_sse(std::string_view bytes) {
    size_t pos = 0;
    while (pos < bytes.size()) {
        size_t end = bytes.find('\n', pos);
        if (end == std::string_view::npos) end = bytes.size();
        std::string_view line = bytes.substr(pos, end - pos);
        if (line.starts_with("data: ") && line != "data: [DONE]") FUZZ_CHECK(is_json(line.substr(6)));
        pos = end + 1;
    }
}

// A tiny deterministic stream of choices drawn from the input, so the same input always takes the same path.
struct Choices {
    uint64_t state;
    uint32_t next(uint32_t n) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        return uint32_t((state >> 33) % n);
    }
};

// The API's Writer, checking on the way what a streaming client relies on: each tool call's argument fragments join
// into its final arguments.
class CheckingWriter final : public Writer {
  public:
    CheckingWriter(Writer & inner, const api::ServerInfo & info) : Writer(info, vocabulary()), w_(inner) {}

    api::Style style() const override { return w_.style(); }
    const char * tool_id_prefix() const override { return w_.tool_id_prefix(); }
    bool wants_logprobs() const override { return w_.wants_logprobs(); }
    std::string start(int64_t prompt, int64_t cached) override { return w_.start(prompt, cached); }
    std::string reasoning(std::string_view delta) override { return w_.reasoning(delta); }
    std::string content(std::string_view delta) override { return w_.content(delta); }
    std::string tool_start(int index, const ToolCall & call) override { return w_.tool_start(index, call); }
    std::string tool_args(int index, std::string_view fragment) override {
        args_[index] += fragment;
        return w_.tool_args(index, fragment);
    }
    std::string tool_end(int index, const ToolCall & call) override {
        FUZZ_CHECK(args_[index] == call.arguments);
        return w_.tool_end(index, call);
    }
    std::string logprobs(std::span<const GeneratedToken> tokens) override { return w_.logprobs(tokens); }
    std::string finish(const api::Outcome & outcome) override { return w_.finish(outcome); }
    std::string error_event(const ApiError & error) override { return w_.error_event(error); }
    std::string response(const api::Outcome & outcome) override { return w_.response(outcome); }

  private:
    Writer & w_;
    std::map<int, std::string> args_;
};

// The model's reply through the detokenizer and api::ReplyBuilder, updates as the scheduler sends them.
void run_reply(Prepared & p, const api::ServerInfo & info, const RenderedChatRequest & rendered, int64_t n_prompt,
               std::string_view reply_text, FinishReason finish, Choices & choices) {
    const Tokenizer & tok = vocabulary();
    CheckingWriter writer(*p.writer, info);
    api::ReplyBuilder r(writer, p.stream, p.chat, rendered.thinking);
    std::string sent;  // everything the Writer produced
    if (p.stream) sent += writer.start(n_prompt, n_prompt / 2);
    sent += r.text(rendered.forced);
    std::string generated = rendered.forced;  // what the whole-reply parse sees

    const std::vector<int32_t> ids = tok.encode(reply_text, true);
    Utf8StreamDecoder decoder(tok);
    const bool logprobs = writer.wants_logprobs();
    for (size_t i = 0; i < ids.size();) {
        std::vector<GeneratedToken> update;
        for (size_t n = 1 + choices.next(8); n > 0 && i < ids.size(); --n, ++i) {
            GeneratedToken t;
            t.id = ids[i];
            t.text = decoder.push(ids[i]);
            t.logprob = -float(choices.next(1000)) / 100.0f;
            for (int32_t k = 0; k < p.sampling.n_logprobs; ++k)
                t.top.push_back({int32_t(choices.next(uint32_t(tok.n_vocab()))), -float(k)});
            update.push_back(std::move(t));
        }
        for (const GeneratedToken & t : update) {
            generated += t.text;
            sent += r.text(t.text);
            if (logprobs) r.outcome().tokens.push_back(t);
        }
        if (logprobs && p.stream) sent += writer.logprobs(update);
    }
    const std::string tail = decoder.finish();
    generated += tail;
    sent += r.text(tail);

    api::Outcome & outcome = r.outcome();
    outcome.finish = finish;
    outcome.stop_string = finish == FinishReason::stop ? "STOP" : "";
    outcome.usage.prompt_tokens = n_prompt;
    outcome.usage.completion_tokens = int64_t(ids.size());
    const bool failed = finish == FinishReason::error || finish == FinishReason::shutdown;
    if (finish == FinishReason::error && p.stream)
        sent += writer.error_event(ApiError(500, "fuzz: the step failed", "server_error"));
    if (finish == FinishReason::shutdown && p.stream)
        sent += writer.error_event(ApiError(503, "shutting down", api::default_error_type(writer.style(), 503)));
    if (!failed) sent += r.finish();
    if (p.stream) {
        check_sse(sent);
    } else if (!failed) {
        FUZZ_CHECK(is_json(writer.response(outcome)));
    }

    if (p.chat && !failed) {
        // Streamed in pieces, the reply must parse as it does whole.
        const ParsedCompletion whole = parse_completion(generated, rendered.thinking);
        FUZZ_CHECK(whole.reasoning == outcome.reasoning);
        FUZZ_CHECK(whole.content == outcome.content);
        FUZZ_CHECK(whole.tool_calls.size() == outcome.calls.size());
        for (size_t i = 0; i < whole.tool_calls.size(); ++i) {
            FUZZ_CHECK(whole.tool_calls[i].name == outcome.calls[i].name);
            FUZZ_CHECK(whole.tool_calls[i].arguments == outcome.calls[i].arguments);
        }
    }
}

}  // namespace

api::Prepared fuzz::prepare_route(int route, std::string_view body, const api::ServerInfo & info,
                                  const Tokenizer & tok) {
    switch (route) {
        case 0:
            return api::prepare_openai_chat(body, info, tok);
        case 1:
            return api::prepare_openai_completion(body, info, tok);
        case 2:
            return api::prepare_anthropic_messages(body, info, tok);
        case 3:
            return api::prepare_responses(body, info, tok);
    }
    api::Prepared p;
    p.request = api::parse_anthropic_count_tokens(body);
    return p;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0) return 0;
    const uint8_t selector = data[0];
    const std::string_view rest(reinterpret_cast<const char *>(data + 1), size - 1);
    const size_t nul = rest.find('\0');
    const std::string_view body = rest.substr(0, nul);
    const std::string_view reply = nul == std::string_view::npos ? std::string_view() : rest.substr(nul + 1);

    const Tokenizer & tok = vocabulary();
    api::ServerInfo info;
    info.model_id = "fuzz";
    info.n_ctx = selector & 16 ? int64_t(1) << 20 : 65536;
    const int route = selector & 7;
    const auto style = route == 2 || route >= 4 ? api::Style::anthropic : api::Style::openai;

    Prepared p;
    try {
        p = fuzz::prepare_route(route, body, info, tok);
    } catch (const ApiError & e) {
        FUZZ_CHECK(e.status >= 400 && e.status < 500);
        FUZZ_CHECK(is_json(api::error_body(style, e.status, e.what(), e.type, e.param, e.code)));
        return 0;
    } catch (const Error & e) {
        FUZZ_CHECK(is_json(api::error_body(style, 400, e.what())));
        return 0;
    }

    // The prompt, as HttpServer::plan renders and tokenizes it.
    RenderedChatRequest rendered;
    int64_t n_prompt = 0;
    if (p.chat) {
        ChatPrompt & prompt = p.request.prompt;
        prompt.version = selector & 8 ? ChatTemplateVersion::v4_0731 : ChatTemplateVersion::v4;
        prompt.context_length = info.n_ctx;
        try {
            rendered = render_chat_request(p.request);
        } catch (const Error &) {
            return 0;  // the server answers 400
        }
        int64_t n_special_pieces = 0;
        for (const TextPiece & piece : rendered.pieces) n_special_pieces += piece.special;
        const std::vector<int32_t> ids = tok.encode_pieces(rendered.pieces);
        const int64_t n_special_ids =
            std::count_if(ids.begin(), ids.end(), [&](int32_t id) { return tok.is_special(id); });
        FUZZ_CHECK(n_special_ids == n_special_pieces);
        FUZZ_CHECK(tok.decode(ids) == pieces_text(rendered.pieces));
        n_prompt = int64_t(ids.size());
    } else if (!p.raw_tokens.empty()) {
        for (int32_t id : p.raw_tokens) FUZZ_CHECK(id >= 0 && id < tok.n_vocab());
        n_prompt = int64_t(p.raw_tokens.size());
    } else {
        n_prompt = int64_t(tok.encode(p.raw_prompt, true).size());
    }
    if (route >= 4) return 0;  // count_tokens answers with the count only
    FUZZ_CHECK(p.writer != nullptr);
    FUZZ_CHECK(p.max_tokens >= 0);
    FUZZ_CHECK(p.sampling.n_logprobs >= 0 && p.sampling.n_logprobs <= SamplingParams::kMaxLogprobs);

    constexpr FinishReason kFinish[] = {FinishReason::eos,    FinishReason::eos,   FinishReason::stop,
                                        FinishReason::length, FinishReason::error, FinishReason::shutdown,
                                        FinishReason::eos,    FinishReason::length};
    uint64_t seed = size;
    for (size_t i = 0; i < std::min<size_t>(size, 64); ++i) seed = seed * 131 + data[i];
    Choices choices{seed};
    run_reply(p, info, rendered, n_prompt, reply, kFinish[selector >> 5], choices);
    return 0;
}
