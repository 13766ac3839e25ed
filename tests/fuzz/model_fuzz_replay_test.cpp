// Replays the model-loading fuzz corpus (tests/data/fuzz/model: edits to tests/data/gguf/tiny-deepseek4.gguf) through
// the fuzz entry point in the normal build: the empty seed (the model unedited) and the fuzzer's finds.
#include "backend/backend.h"
#include "format/gguf.h"
#include "fuzz/replay.h"
#include "model/forward.h"
#include "model/kv_state.h"

#include <string>

namespace {

const std::string kCorpus = std::string(DSV4_TEST_DATA) + "/fuzz/model";

TEST(ModelFuzzReplay, EveryCorpusFileComesBack) { dsv4::fuzz::replay_corpus(kCorpus, 1); }

// The base the edits apply to loads and runs, so a refusal in the corpus is the edit's doing.
TEST(ModelFuzzReplay, BaseModelRuns) {
    const dsv4::GgufFile f = dsv4::GgufFile::open(std::string(DSV4_TEST_DATA) + "/gguf/tiny-deepseek4.gguf");
    auto backend = dsv4::make_cpu_backend({1, false});
    dsv4::Model m(f, *backend, 4, dsv4::Numerics::reference);
    auto state = m.new_state(32);
    std::vector<int32_t> prompt(12, 3);
    std::vector<float> logits(static_cast<size_t>(m.config().n_vocab));
    EXPECT_TRUE(m.eval(*state, prompt, dsv4::LogitsMode::last, logits.data()));
}

}  // namespace
