// libFuzzer entry point for loading a model whose metadata lies: the input is a list of edits to a small valid
// model (tests/data/gguf/tiny-deepseek4.gguf, llama.cpp's deepseek4 layout: 3 layers, sliding + CSA + HCA, hash
// routing), which is written out, opened, loaded on the CPU backend and run for a prompt of 12 tokens and two decode
// steps, then one batched decode step of that sequence and a second one, whose logits must equal, bit for bit, the
// second sequence's single step (Model::decode_batch's promise on the CPU). Each edit is 8 bytes:
//
//   byte 0   what: 0 set a key, 1 drop a key, 2 set an array element or the array's length, 3 change a tensor
//   byte 1   which key (of the base file's, in order) or tensor
//   byte 2   array element, the length, a tensor's axis or type, or a shift for 64-bit values
//   byte 3   the value's type (a scalar's GGUF type, a string, the array's element type)
//   4-7      the value (little-endian u32; floats by their bits)
//
// Edits change the metadata and the tensors' declared types and shapes (their data is cut or zero-padded to match), so
// the fuzzer explores what the configuration's validation has to catch. A model that loads must run without a crash
// or a sanitizer report; one that does not must be refused with dsv4::Error (a crash, another exception or an
// allocation past libFuzzer's limit is a bug). A model whose memory plan exceeds 1 GiB is skipped, as the engine's
// plan would refuse it. When the input ends in a partial edit, its last byte's bit 0 selects the official numerics.
#include "backend/backend.h"
#include "format/gguf.h"
#include "fuzz/fuzz_check.h"
#include "model/forward.h"
#include "model/kv_state.h"
#include "util/error.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace dsv4;

struct Base {
    std::vector<GgufKv> metadata;
    std::vector<GgufTensorInfo> tensors;
    std::vector<std::string> data;  // [tensors] each tensor's bytes
};

const Base & base() {
    static const Base b = [] {
        const GgufFile f = GgufFile::open(std::string(DSV4_TEST_DATA) + "/gguf/tiny-deepseek4.gguf");
        Base out;
        for (const GgufKv & kv : f.metadata()) {
            GgufKv copy = kv;
            // Strings point into the mapping, which closes with f: give each its own storage.
            auto own = [](GgufValue & v, auto & self) -> void {
                if (v.type == GgufType::STRING) {
                    v.owned = std::make_shared<std::string>(v.str);
                    v.str = *v.owned;
                }
                for (GgufValue & e : v.array) self(e, self);
            };
            own(copy.value, own);
            out.metadata.push_back(std::move(copy));
        }
        for (const GgufTensorInfo & t : f.tensors()) {
            out.tensors.push_back(t);
            out.data.emplace_back(reinterpret_cast<const char *>(f.tensor_data(t)), t.n_bytes);
        }
        return out;
    }();
    return b;
}

// Types the loader knows, and some it must refuse.
constexpr GgmlType kTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16,    GgmlType::Q8_0,
                               GgmlType::Q2_K, GgmlType::Q4_K, GgmlType::IQ2_XXS, GgmlType::MXFP4,
                               GgmlType::Q4_0, GgmlType::Q6_K, GgmlType::I32,     GgmlType::IQ4_NL};

GgufValue scalar(uint8_t type, uint32_t v, uint8_t shift) {
    static const char * const kStrings[] = {"", "yarn", "none", "linear", "deepseek4", "llama", "gpt2", "x"};
    switch (type % 9) {
        case 0:
            return GgufValue::make_u32(v);
        case 1:
            return GgufValue::make_i32(int32_t(v));
        case 2: {
            float f;
            std::memcpy(&f, &v, 4);
            return GgufValue::make_f32(f);
        }
        case 3:
            return GgufValue::make_u64(uint64_t(v) << (shift % 40));
        case 4:
            return GgufValue::make_i64(int64_t(0 - (uint64_t(v) << (shift % 40))));
        case 5:
            return GgufValue::make_bool(v & 1);
        case 6:
            return GgufValue::make_string(kStrings[v % 8]);
        case 7:
            return GgufValue::make_u8(uint8_t(v));
        default:
            return GgufValue::make_f64(double(int32_t(v)) / 16);
    }
}

// MODEL_FUZZ_VERBOSE=1 in the environment prints each edit and the outcome, to read what a saved input does.
const bool kVerbose = std::getenv("MODEL_FUZZ_VERBOSE") != nullptr;

std::string describe(const GgufValue & v) {
    switch (v.type) {
        case GgufType::STRING:
            return fmt::format("'{}'", v.str);
        case GgufType::FLOAT32:
        case GgufType::FLOAT64:
            return std::to_string(v.f);
        case GgufType::INT8:
        case GgufType::INT16:
        case GgufType::INT32:
        case GgufType::INT64:
            return std::to_string(v.i);
        case GgufType::ARRAY:
            return fmt::format("[{} elements]", v.array.size());
        default:
            return std::to_string(v.u);
    }
}

// Applies one edit (an edit that names nothing changes nothing).
void apply(const uint8_t * e, std::vector<GgufKv> & metadata, std::vector<GgufTensorInfo> & tensors) {
    uint32_t v;
    std::memcpy(&v, e + 4, 4);
    const int what = e[0] % 4;
    if (what < 3 && metadata.empty()) return;
    GgufKv * kv = what < 3 ? &metadata[e[1] % metadata.size()] : nullptr;
    switch (what) {
        case 0:
            kv->value = scalar(e[3], v, e[2]);
            if (kVerbose)
                std::fprintf(stderr, "set %s = %s (%s)\n", kv->key.c_str(), describe(kv->value).c_str(),
                             std::string(gguf_type_name(kv->value.type)).c_str());
            break;
        case 1:
            if (kVerbose) std::fprintf(stderr, "drop %s\n", kv->key.c_str());
            metadata.erase(metadata.begin() + (kv - metadata.data()));
            break;
        case 2: {
            GgufValue & a = kv->value;
            if (a.type != GgufType::ARRAY) break;
            if (e[3] & 0x80) {
                // A new length; added elements copy the first one (or are zero of the element type).
                const size_t n = e[2] % 70;
                GgufValue fill = a.array.empty() ? scalar(a.elem_type == GgufType::FLOAT32 ? 2 : 1, 0, 0) : a.array[0];
                if (a.array.empty()) a.elem_type = fill.type;
                a.array.resize(n, fill);
            } else if (!a.array.empty()) {
                GgufValue & x = a.array[e[2] % a.array.size()];
                if (x.type == GgufType::STRING) {
                    x = scalar(6, v, 0);
                } else if (x.type == GgufType::FLOAT32 || x.type == GgufType::FLOAT64) {
                    x.f = scalar(2, v, 0).f;  // keep the array homogeneous: the value in the element's type
                } else if (x.type != GgufType::ARRAY) {
                    x.u = v;
                    x.i = int32_t(v);
                }
            }
            if (kVerbose) std::fprintf(stderr, "array %s = %s\n", kv->key.c_str(), describe(a).c_str());
            break;
        }
        default: {
            if (tensors.empty()) break;
            GgufTensorInfo & info = tensors[e[1] % tensors.size()];
            if (e[3] & 1) {
                info.type = kTypes[e[2] % std::size(kTypes)];
            } else {
                const int axis = e[2] % 4;
                info.ne[axis] = int64_t(v % 1025);
                info.n_dims = std::max(info.n_dims, axis + 1);
            }
            if (kVerbose)
                std::fprintf(stderr, "tensor %s: %s [%lld, %lld, %lld, %lld]\n", info.name.c_str(),
                             std::string(type_name(info.type)).c_str(), (long long)info.ne[0], (long long)info.ne[1],
                             (long long)info.ne[2], (long long)info.ne[3]);
            break;
        }
    }
}

// The file each input is written to, in memory where /dev/shm exists. It is removed once mapped, so no exit, crash
// or timeout of the fuzzer leaves it behind.
const std::string & scratch_path() {
    static const std::string path = std::string(access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp") +
                                    "/dsv4_model_fuzz_" + std::to_string(getpid()) + ".gguf";
    return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * input, size_t size) {
    const Base & b = base();
    std::vector<GgufKv> metadata = b.metadata;
    std::vector<GgufTensorInfo> tensors = b.tensors;
    const size_t n_edits = std::min<size_t>(size / 8, 16);
    for (size_t i = 0; i < n_edits; ++i) apply(input + 8 * i, metadata, tensors);
    const bool official = size % 8 != 0 && (input[size - 1] & 1);

    // Files past 16 MB test nothing the small ones do not, and would only slow the search.
    uint64_t file_bytes = 0;
    for (const GgufTensorInfo & t : tensors) {
        if (t.ne[0] % type_traits(t.type).block_elems != 0) return 0;  // not writable as GGUF
        file_bytes += row_bytes(t.type, t.ne[0]) * uint64_t(t.ne[1] * t.ne[2] * t.ne[3]);
    }
    if (file_bytes > (16u << 20)) return 0;

    const std::string & path = scratch_path();
    try {
        GgufWriter w(path);
        for (const GgufKv & kv : metadata) w.set(kv.key, kv.value);
        for (const GgufTensorInfo & t : tensors) w.add_tensor(t.name, t.type, {t.ne[0], t.ne[1], t.ne[2], t.ne[3]});
        for (size_t i = 0; i < tensors.size(); ++i) {
            const GgufTensorInfo & t = tensors[i];
            // The declared shape's bytes: the base's data cut or zero-padded (a quantized block of zeros is zero).
            const size_t rows = size_t(t.ne[1] * t.ne[2] * t.ne[3]);
            std::string bytes = b.data[i];
            bytes.resize(row_bytes(t.type, t.ne[0]) * rows);
            w.write_tensor_data(bytes.data(), bytes.size());
        }
        w.finish();
    } catch (const Error &) {
        std::remove(path.c_str());
        return 0;  // the writer refuses what GGUF cannot hold
    }

    try {
        const GgufFile f = GgufFile::open(path);
        std::remove(path.c_str());  // the mapping stays valid
        // The engine plans memory from the configuration before it loads anything and refuses a model whose plan
        // does not fit (Engine::plan): so does this, with 1 GiB for the KV state and the workspace.
        constexpr int64_t kCtx = 32, kUbatch = 4;
        const ModelConfig config = load_config(f);
        if (plan_kv(config, kCtx, kUbatch).total() + Model::workspace_bytes(config, kUbatch, false) >
            (uint64_t(1) << 30)) {
            if (kVerbose) std::fprintf(stderr, "refused by the memory plan\n");
            return 0;
        }
        auto backend = make_cpu_backend({1, false});
        Model m(f, *backend, kUbatch, official ? Numerics::official : Numerics::reference);
        auto state = m.new_state(kCtx);
        const int64_t n_vocab = m.config().n_vocab;
        std::vector<int32_t> prompt;
        for (int i = 0; i < 12; ++i) prompt.push_back(int32_t((i * 7 + 3) % n_vocab));
        std::vector<float> logits(static_cast<size_t>(n_vocab));
        m.eval(*state, prompt, LogitsMode::last, logits.data());
        for (int step = 0; step < 2; ++step) {
            const int32_t next = int32_t((step * 5 + 1) % n_vocab);
            m.eval(*state, std::span<const int32_t>(&next, 1), LogitsMode::last, logits.data());
        }
        auto second = m.new_state(kCtx), alone = m.new_state(kCtx);
        const std::span<const int32_t> head = std::span<const int32_t>(prompt).first(5);
        m.eval(*second, head, LogitsMode::none, nullptr);
        m.eval(*alone, head, LogitsMode::none, nullptr);
        KvState * const batch[] = {state.get(), second.get()};
        const int32_t tokens[] = {int32_t(2 % n_vocab), int32_t(9 % n_vocab)};
        m.decode_batch(batch, tokens);
        m.eval(*alone, std::span<const int32_t>(&tokens[1], 1), LogitsMode::last, logits.data());
        std::vector<float> batched(logits.size());
        m.read_last_logits(*second, batched.data());
        FUZZ_CHECK(std::memcmp(batched.data(), logits.data(), logits.size() * sizeof(float)) == 0);
        if (kVerbose) std::fprintf(stderr, "loaded and ran\n");
    } catch (const Error & e) {
        std::remove(path.c_str());  // when the file did not open
        if (kVerbose) std::fprintf(stderr, "refused: %s\n", e.what());
    }
    return 0;
}
