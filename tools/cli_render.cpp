// dsv4 --render-chat REQUEST.json: the prompt text an OpenAI chat request renders to, printed byte for byte (no
// newline added), for comparing against the official encoder. The request goes through the server's own parser.
// With -m, the model's deepseek4.chat_template_version picks the effort ladder. The context is taken to be large
// enough for Think Max, as the official encoder has no such gate.
#include "format/gguf.h"
#include "server/chat_request.h"
#include "text/chat.h"
#include "tools/cli.h"
#include "util/error.h"
#include "util/file.h"

#include <cstdio>

namespace dsv4::cli {

int run_render_chat(const Options & opts) {
    const std::string & path = opts.render_chat_file;
    ChatRequest request;
    try {
        request = parse_openai_chat_request(read_file(path));
    } catch (const Error & e) {
        fail("{}: {}", path, e.what());
    }
    if (!opts.model.empty()) {
        GgufFile model = GgufFile::open(opts.model);
        if (auto version = model.get_string_opt("deepseek4.chat_template_version")) {
            try {
                request.prompt.version = parse_chat_template_version(*version);
            } catch (const Error & e) {
                fail("{}: {}", opts.model, e.what());
            }
        }
    }
    request.prompt.context_length = kThinkMaxMinContext;
    std::string text = render_chat_text(request.prompt);
    if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size() || std::fflush(stdout) != 0)
        fail("cannot write to standard output");
    return 0;
}

}  // namespace dsv4::cli
