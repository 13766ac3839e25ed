// The fuzz targets' invariant check: a failed one names itself, then traps, so libFuzzer saves the input (and the
// corpus replay test crashes on it).
#pragma once

#include <cstdio>

#define FUZZ_CHECK(cond)                                                                  \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            __builtin_trap();                                                             \
        }                                                                                 \
    } while (0)
