// Replays the request fuzz corpus (tests/data/fuzz/api) through the fuzz entry point in the normal build: every file
// must come back (a failed check traps). Seeds named "ok-*" are requests the server accepts, so that the replay also
// walks the prompt, reply and Writer checks on each API rather than only its refusals; the fuzzer's own finds have
// other names.
#include "format/gguf.h"
#include "fuzz/api_fuzz.h"
#include "fuzz/replay.h"
#include "server/api.h"
#include "text/tokenizer.h"

#include <set>
#include <string>

namespace {

const std::string kCorpus = std::string(DSV4_TEST_DATA) + "/fuzz/api";

TEST(ApiFuzzReplay, EveryCorpusFileComesBack) { dsv4::fuzz::replay_corpus(kCorpus, 10); }

TEST(ApiFuzzReplay, OkSeedsAreAccepted) {
    const dsv4::Tokenizer tok = dsv4::Tokenizer::from_gguf(dsv4::GgufFile::open(DSV4_VOCAB_GGUF));
    dsv4::api::ServerInfo info;
    info.model_id = "fuzz";
    info.n_ctx = 65536;
    std::set<int> routes;
    for (const auto & p : dsv4::fuzz::corpus_files(kCorpus)) {
        const std::string name = p.filename().string();
        if (!name.starts_with("ok-")) continue;
        SCOPED_TRACE(name);
        const std::string bytes = dsv4::read_file(p.string());
        ASSERT_FALSE(bytes.empty());
        const std::string body = bytes.substr(1, bytes.find('\0', 1) - 1);
        const int route = bytes[0] & 7;
        routes.insert(route);
        EXPECT_NO_THROW(dsv4::fuzz::prepare_route(route, body, info, tok));
    }
    EXPECT_EQ(routes.size(), 5u) << "every route needs an accepted seed";
}

}  // namespace
