// ggml tensor types: the ids GGUF files store, and the block geometry of each. The ids are ggml's, so files
// written by llama.cpp's gguf-py and by dsv4 agree.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dsv4 {

enum class GgmlType : uint32_t {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
};

struct TypeTraits {
    std::string_view name;  // ggml's name, e.g. "q8_0"
    int64_t block_elems;    // values per block (1 for plain types)
    size_t block_bytes;     // bytes per block
    bool supported;         // dsv4 can dequantize it (others are known only so a dump can name them)
};

// Traits of a known type id, or nullptr for an id ggml does not define.
const TypeTraits * type_traits(uint32_t id);
const TypeTraits & type_traits(GgmlType type);
inline std::string_view type_name(GgmlType type) { return type_traits(type).name; }

// Bytes of a row of n values; throws dsv4::Error when n is not a multiple of the block size.
size_t row_bytes(GgmlType type, int64_t n);

}  // namespace dsv4
