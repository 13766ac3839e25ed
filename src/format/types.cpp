#include "format/types.h"

#include "util/error.h"

namespace dsv4 {

namespace {

// Indexed by ggml type id. Ids ggml has retired (4, 5, 31-33, 36-38) have an empty name. Sizes are ggml's
// (ggml-common.h); `supported` marks the types dsv4 dequantizes.
constexpr TypeTraits kTraits[] = {
    /*  0 */ {"f32", 1, 4, true},
    /*  1 */ {"f16", 1, 2, true},
    /*  2 */ {"q4_0", 32, 18, false},
    /*  3 */ {"q4_1", 32, 20, false},
    /*  4 */ {"", 0, 0, false},
    /*  5 */ {"", 0, 0, false},
    /*  6 */ {"q5_0", 32, 22, false},
    /*  7 */ {"q5_1", 32, 24, false},
    /*  8 */ {"q8_0", 32, 34, true},
    /*  9 */ {"q8_1", 32, 36, false},
    /* 10 */ {"q2_K", 256, 84, true},
    /* 11 */ {"q3_K", 256, 110, false},
    /* 12 */ {"q4_K", 256, 144, true},
    /* 13 */ {"q5_K", 256, 176, false},
    /* 14 */ {"q6_K", 256, 210, false},
    /* 15 */ {"q8_K", 256, 292, true},
    /* 16 */ {"iq2_xxs", 256, 66, true},
    /* 17 */ {"iq2_xs", 256, 74, false},
    /* 18 */ {"iq3_xxs", 256, 98, false},
    /* 19 */ {"iq1_s", 256, 50, false},
    /* 20 */ {"iq4_nl", 32, 18, false},
    /* 21 */ {"iq3_s", 256, 110, false},
    /* 22 */ {"iq2_s", 256, 82, false},
    /* 23 */ {"iq4_xs", 256, 136, false},
    /* 24 */ {"i8", 1, 1, false},
    /* 25 */ {"i16", 1, 2, false},
    /* 26 */ {"i32", 1, 4, false},
    /* 27 */ {"i64", 1, 8, false},
    /* 28 */ {"f64", 1, 8, false},
    /* 29 */ {"iq1_m", 256, 56, false},
    /* 30 */ {"bf16", 1, 2, true},
    /* 31 */ {"", 0, 0, false},
    /* 32 */ {"", 0, 0, false},
    /* 33 */ {"", 0, 0, false},
    /* 34 */ {"tq1_0", 256, 54, false},
    /* 35 */ {"tq2_0", 256, 66, false},
    /* 36 */ {"", 0, 0, false},
    /* 37 */ {"", 0, 0, false},
    /* 38 */ {"", 0, 0, false},
    /* 39 */ {"mxfp4", 32, 17, true},
};

}  // namespace

const TypeTraits * type_traits(uint32_t id) {
    if (id >= std::size(kTraits) || kTraits[id].block_elems == 0) return nullptr;
    return &kTraits[id];
}

const TypeTraits & type_traits(GgmlType type) {
    const TypeTraits * t = type_traits(uint32_t(type));
    if (!t) fail("unknown ggml type id {}", uint32_t(type));
    return *t;
}

size_t row_bytes(GgmlType type, int64_t n) {
    const TypeTraits & t = type_traits(type);
    if (n < 0 || n % t.block_elems != 0)
        fail("a row of {} values is not a whole number of {} blocks ({} values each)", n, t.name, t.block_elems);
    return size_t(n / t.block_elems) * t.block_bytes;
}

}  // namespace dsv4
