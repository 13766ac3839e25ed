// libFuzzer entry point for the GGUF reader: parse the input, then touch everything the reader hands out (every
// value, nested element and string byte, every typed getter, the first and last byte of every tensor) so that a
// view pointing outside the input shows up under AddressSanitizer. dsv4::Error is the expected outcome for bad
// input; anything else (a crash, a sanitizer report, another exception) is a bug.
#include "format/gguf.h"
#include "util/error.h"

#include <cstddef>
#include <cstdint>

namespace {

uint64_t walk(const dsv4::GgufValue & v) {
    uint64_t h = uint64_t(v.type) + v.u + uint64_t(v.i) + uint64_t(v.f == v.f);
    for (char c : v.str) h = h * 31 + uint8_t(c);
    for (const dsv4::GgufValue & e : v.array) h += walk(e);
    return h;
}

template <typename F>
uint64_t try_get(F && get) {
    try {
        get();
        return 1;
    } catch (const dsv4::Error &) {
        return 0;
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    volatile uint64_t sink = 0;
    try {
        const dsv4::GgufFile f = dsv4::GgufFile::parse(data, size, "fuzz-input");
        for (const dsv4::GgufKv & kv : f.metadata()) {
            sink = sink + walk(kv.value);
            const std::string & k = kv.key;
            sink = sink + try_get([&] { return f.get_u64(k); }) + try_get([&] { return f.get_i64(k); }) +
                   try_get([&] { return f.get_f64(k); }) + try_get([&] { return f.get_bool(k); }) +
                   try_get([&] { return f.get_string(k); }) + try_get([&] { return f.get_int_array(k); }) +
                   try_get([&] { return f.get_f64_array(k); }) + try_get([&] { return f.get_string_array(k); });
        }
        for (const dsv4::GgufTensorInfo & t : f.tensors()) {
            if (f.find_tensor(t.name) != &t) __builtin_trap();  // names are unique, so each finds itself
            const uint8_t * p = f.tensor_data(t);
            sink = sink + p[0] + p[t.n_bytes - 1] + uint64_t(t.n_elements());
        }
    } catch (const dsv4::Error &) {
    }
    return 0;
}
