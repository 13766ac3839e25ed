// libdsv4_ktrace.so: a kernel timeline of any CUDA program, for decode-step attribution (docs/cuda.md, "Where a
// decode step's time goes"). Preloaded (LD_PRELOAD), it asks CUPTI for every kernel's and memory copy's GPU start
// and end, graph nodes included, and appends one line per record to $DSV4_KTRACE (default /tmp/dsv4-ktrace.txt)
// as CUPTI hands over its buffers (the last at exit):
//   start_ns end_ns graph_id grid_x grid_y graph_node_id demangled-name
// A copy's line has grid 0 0 and the name "memcpy DIRECTION BYTES" (HtoD, DtoH, DtoD, other).
// scripts/ktrace_summary.py turns the lines into per-step costs. Inside a graph with programmatic dependent
// launch a kernel's blocks start early and wait, so its start says little; what it adds to a step is how much
// later it ends than the kernel before it.
#include <cupti.h>

#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;

void CUPTIAPI buffer_requested(uint8_t ** buffer, size_t * size, size_t * max_records) {
    *size = kBufferBytes;
    *buffer = static_cast<uint8_t *>(std::aligned_alloc(8, kBufferBytes));
    *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t * buffer, size_t, size_t valid) {
    const char * env = std::getenv("DSV4_KTRACE");
    const char * path = env ? env : "/tmp/dsv4-ktrace.txt";
    FILE * f = std::fopen(path, "a");
    if (!f) std::fprintf(stderr, "dsv4-ktrace: cannot open %s\n", path);
    CUpti_Activity * record = nullptr;
    while (f && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const auto * m = reinterpret_cast<const CUpti_ActivityMemcpy6 *>(record);
            const char * dir = m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "HtoD"
                               : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "DtoH"
                               : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD ? "DtoD"
                                                                                : "other";
            std::fprintf(f, "%llu %llu %u 0 0 %llu memcpy %s %llu\n", static_cast<unsigned long long>(m->start),
                         static_cast<unsigned long long>(m->end), m->graphId,
                         static_cast<unsigned long long>(m->graphNodeId), dir,
                         static_cast<unsigned long long>(m->bytes));
            continue;
        }
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const auto * k = reinterpret_cast<const CUpti_ActivityKernel10 *>(record);
        int status = 0;
        char * demangled = abi::__cxa_demangle(k->name, nullptr, nullptr, &status);
        const std::string name = status == 0 && demangled ? demangled : k->name;
        std::free(demangled);
        std::fprintf(f, "%llu %llu %u %d %d %llu %s\n", static_cast<unsigned long long>(k->start),
                     static_cast<unsigned long long>(k->end), k->graphId, k->gridX, k->gridY,
                     static_cast<unsigned long long>(k->graphNodeId), name.substr(0, 200).c_str());
    }
    if (f) std::fclose(f);
    std::free(buffer);
}

// Starts tracing when the library loads. CUPTI hands over a buffer when it fills, when the CUDA context is destroyed
// and at the flush registered here for the process's exit, whichever comes first: a program that exits without
// destroying its context still leaves its last kernels in the file.
struct Tracer {
    Tracer() {
        if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
            cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
            cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS) {
            std::fprintf(stderr, "dsv4-ktrace: CUPTI refused kernel tracing; no timeline\n");
            return;
        }
        std::atexit([] { cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED); });
    }
} tracer;

}  // namespace
