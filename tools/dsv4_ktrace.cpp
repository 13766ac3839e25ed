// libdsv4_ktrace.so: a kernel timeline of any CUDA program, for decode-step attribution (docs/cuda.md, "Kernel
// timelines"; its first use: docs/cuda-journal.md, "Decode, session 10"). Preloaded (LD_PRELOAD), it asks CUPTI
// for every kernel's and memory copy's GPU start and end, graph nodes included, and appends one line per record to
// $DSV4_KTRACE (default /tmp/dsv4-ktrace.txt)
// as CUPTI hands over its buffers (the last at exit):
//   start_ns end_ns graph_id grid_x grid_y graph_node_id demangled-name
// A copy's line has grid 0 0 and the name "memcpy DIRECTION BYTES" (HtoD, DtoH, DtoD, other).
// scripts/ktrace_summary.py turns the lines into per-step costs. Inside a graph with programmatic dependent
// launch a kernel's blocks start early and wait, so its start says little; what it adds to a step is how much
// later it ends than the kernel before it.
//
// With $DSV4_PMSAMPLE set to a path it also samples the GPU's performance monitors (CUPTI PM sampling) every
// $DSV4_PMSAMPLE_NS nanoseconds (default 1000) over the windows the program opens and closes through
// dsv4_ktrace_pm() (dsv4-cuda-bench: each depth's timed decode steps), and rewrites the file at each window's end (the
// last window stays):
//   # metric names
//   start_ns end_ns value...
// The metric is DRAM bytes read per interval (dram__bytes_read.sum), or the comma-separated ones of
// $DSV4_PMSAMPLE_METRICS. The hardware buffer ($DSV4_PMSAMPLE_MB megabytes, default 64) must hold a window: on an H200
// it held a 27 ms window of one metric at 1 µs, and four metrics overflowed it; $DSV4_PMSAMPLE_MAX (default 40000)
// bounds the samples decoded. Sample and kernel timestamps share the
// GPU's clock; `ktrace_summary.py --pm FILE` gives each kernel of a step the DRAM bytes read while it was the step's
// last.
// DSV4_PMSAMPLE_VERBOSE=1 prints every CUPTI call's result.
#include <cupti.h>
#include <cupti_pmsampling.h>
#include <cupti_profiler_host.h>
#include <cupti_profiler_target.h>
#include <cupti_target.h>

#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

// ---------------------------------------------------------------------------------------------------------------------
// PM sampling
// ---------------------------------------------------------------------------------------------------------------------
// Set up at the program's first dsv4_ktrace_pm(device, 1), outside the window it measures (the setup takes a moment);
// each window then starts and stops the sampler and rewrites the file. A failing CUPTI call prints its name and error
// and leaves sampling off. The program calls from one thread, while its context is alive: sampling cannot start in
// CUPTI's context-created callback (a run that tried printed nothing for minutes) nor be decoded after the runtime's
// exit handlers destroyed it.

// A CUPTI parameter struct: zeroed (null pPriv, no leftover fields), its size set.
template <class P>
P params(size_t struct_size) {
    P p;
    std::memset(&p, 0, sizeof p);
    p.structSize = struct_size;
    return p;
}

struct PmSampler {
    std::string path;
    std::vector<std::string> names;
    std::vector<const char *> metrics;
    CUpti_Profiler_Host_Object * host = nullptr;
    CUpti_PmSampling_Object * sampler = nullptr;
    std::vector<uint8_t> availability, config, counter_data;  // CUPTI keeps pointers into the first two
    bool running = false;

    static bool ok(CUptiResult r, const char * what) {
        if (std::getenv("DSV4_PMSAMPLE_VERBOSE")) std::fprintf(stderr, "dsv4-ktrace: %s -> %d\n", what, int(r));
        if (r == CUPTI_SUCCESS) return true;
        const char * msg = nullptr;
        cuptiGetResultString(r, &msg);
        std::fprintf(stderr, "dsv4-ktrace: PM sampling: %s failed: %s\n", what, msg ? msg : "?");
        return false;
    }
    static size_t env_size(const char * name, size_t fallback) {
        const char * e = std::getenv(name);
        return e && *e ? size_t(std::strtoull(e, nullptr, 10)) : fallback;
    }

    // Host object, configuration and the enabled sampler, once; false (and the path cleared) when CUPTI refuses.
    bool set_up(uint32_t device) {
        if (sampler) return true;
        const std::string wanted = path;
        path.clear();
        const char * list = std::getenv("DSV4_PMSAMPLE_METRICS");
        const std::string all = list && *list ? list : "dram__bytes_read.sum";
        for (size_t at = 0; at <= all.size();) {
            const size_t comma = std::min(all.find(',', at), all.size());
            if (comma > at) names.push_back(all.substr(at, comma - at));
            at = comma + 1;
        }
        for (const std::string & n : names) metrics.push_back(n.c_str());

        auto init = params<CUpti_Profiler_Initialize_Params>(CUpti_Profiler_Initialize_Params_STRUCT_SIZE);
        if (!ok(cuptiProfilerInitialize(&init), "cuptiProfilerInitialize")) return false;
        auto chip = params<CUpti_Device_GetChipName_Params>(CUpti_Device_GetChipName_Params_STRUCT_SIZE);
        chip.deviceIndex = device;
        if (!ok(cuptiDeviceGetChipName(&chip), "cuptiDeviceGetChipName")) return false;
        auto avail = params<CUpti_PmSampling_GetCounterAvailability_Params>(
            CUpti_PmSampling_GetCounterAvailability_Params_STRUCT_SIZE);
        avail.deviceIndex = device;
        if (!ok(cuptiPmSamplingGetCounterAvailability(&avail), "cuptiPmSamplingGetCounterAvailability (size)"))
            return false;
        availability.assign(avail.counterAvailabilityImageSize, 0);
        avail.pCounterAvailabilityImage = availability.data();
        if (!ok(cuptiPmSamplingGetCounterAvailability(&avail), "cuptiPmSamplingGetCounterAvailability")) return false;

        auto hi = params<CUpti_Profiler_Host_Initialize_Params>(CUpti_Profiler_Host_Initialize_Params_STRUCT_SIZE);
        hi.profilerType = CUPTI_PROFILER_TYPE_PM_SAMPLING;
        hi.pChipName = chip.pChipName;
        hi.pCounterAvailabilityImage = availability.data();
        if (!ok(cuptiProfilerHostInitialize(&hi), "cuptiProfilerHostInitialize")) return false;
        host = hi.pHostObject;
        auto add = params<CUpti_Profiler_Host_ConfigAddMetrics_Params>(
            CUpti_Profiler_Host_ConfigAddMetrics_Params_STRUCT_SIZE);
        add.pHostObject = host;
        add.ppMetricNames = metrics.data();
        add.numMetrics = metrics.size();
        if (!ok(cuptiProfilerHostConfigAddMetrics(&add), "cuptiProfilerHostConfigAddMetrics")) return false;
        auto cs = params<CUpti_Profiler_Host_GetConfigImageSize_Params>(
            CUpti_Profiler_Host_GetConfigImageSize_Params_STRUCT_SIZE);
        cs.pHostObject = host;
        if (!ok(cuptiProfilerHostGetConfigImageSize(&cs), "cuptiProfilerHostGetConfigImageSize")) return false;
        config.assign(cs.configImageSize, 0);
        auto ci =
            params<CUpti_Profiler_Host_GetConfigImage_Params>(CUpti_Profiler_Host_GetConfigImage_Params_STRUCT_SIZE);
        ci.pHostObject = host;
        ci.configImageSize = config.size();
        ci.pConfigImage = config.data();
        if (!ok(cuptiProfilerHostGetConfigImage(&ci), "cuptiProfilerHostGetConfigImage")) return false;

        auto en = params<CUpti_PmSampling_Enable_Params>(CUpti_PmSampling_Enable_Params_STRUCT_SIZE);
        en.deviceIndex = device;
        if (!ok(cuptiPmSamplingEnable(&en), "cuptiPmSamplingEnable")) return false;
        auto sc = params<CUpti_PmSampling_SetConfig_Params>(CUpti_PmSampling_SetConfig_Params_STRUCT_SIZE);
        sc.pPmSamplingObject = en.pPmSamplingObject;
        sc.configSize = config.size();
        sc.pConfig = config.data();
        sc.hardwareBufferSize = env_size("DSV4_PMSAMPLE_MB", 64) << 20;
        sc.samplingInterval = env_size("DSV4_PMSAMPLE_NS", 1000);
        sc.triggerMode = CUPTI_PM_SAMPLING_TRIGGER_MODE_GPU_TIME_INTERVAL;
        // Keeping the latest records instead made the decode fail (CUPTI_ERROR_UNKNOWN, CUDA 13.0); a window that fits
        // the buffer loses nothing either way.
        sc.hwBufferAppendMode = CUPTI_PM_SAMPLING_HARDWARE_BUFFER_APPEND_MODE_KEEP_OLDEST;
        if (!ok(cuptiPmSamplingSetConfig(&sc), "cuptiPmSamplingSetConfig")) return false;
        sampler = en.pPmSamplingObject;
        path = wanted;
        std::fprintf(stderr, "dsv4-ktrace: PM sampling %s every %zu ns into %s\n", all.c_str(),
                     size_t(sc.samplingInterval), path.c_str());
        return true;
    }

    void start(uint32_t device) {
        if (running || path.empty() || !set_up(device)) return;
        auto ds =
            params<CUpti_PmSampling_GetCounterDataSize_Params>(CUpti_PmSampling_GetCounterDataSize_Params_STRUCT_SIZE);
        ds.pPmSamplingObject = sampler;
        ds.pMetricNames = metrics.data();
        ds.numMetrics = metrics.size();
        ds.maxSamples = uint32_t(env_size("DSV4_PMSAMPLE_MAX", 40000));
        if (!ok(cuptiPmSamplingGetCounterDataSize(&ds), "cuptiPmSamplingGetCounterDataSize")) return;
        counter_data.assign(ds.counterDataSize, 0);
        auto di = params<CUpti_PmSampling_CounterDataImage_Initialize_Params>(
            CUpti_PmSampling_CounterDataImage_Initialize_Params_STRUCT_SIZE);
        di.pPmSamplingObject = sampler;
        di.counterDataSize = counter_data.size();
        di.pCounterData = counter_data.data();
        if (!ok(cuptiPmSamplingCounterDataImageInitialize(&di), "cuptiPmSamplingCounterDataImageInitialize")) return;
        auto st = params<CUpti_PmSampling_Start_Params>(CUpti_PmSampling_Start_Params_STRUCT_SIZE);
        st.pPmSamplingObject = sampler;
        if (!ok(cuptiPmSamplingStart(&st), "cuptiPmSamplingStart")) return;
        running = true;
    }

    void finish() {
        if (!running) return;
        running = false;
        auto sp = params<CUpti_PmSampling_Stop_Params>(CUpti_PmSampling_Stop_Params_STRUCT_SIZE);
        sp.pPmSamplingObject = sampler;
        if (!ok(cuptiPmSamplingStop(&sp), "cuptiPmSamplingStop")) return;
        auto dd = params<CUpti_PmSampling_DecodeData_Params>(CUpti_PmSampling_DecodeData_Params_STRUCT_SIZE);
        dd.pPmSamplingObject = sampler;
        dd.pCounterDataImage = counter_data.data();
        dd.counterDataImageSize = counter_data.size();
        if (!ok(cuptiPmSamplingDecodeData(&dd), "cuptiPmSamplingDecodeData")) {
            if (dd.overflow) std::fprintf(stderr, "dsv4-ktrace: the window overflowed DSV4_PMSAMPLE_MB\n");
            return;
        }
        auto info =
            params<CUpti_PmSampling_GetCounterDataInfo_Params>(CUpti_PmSampling_GetCounterDataInfo_Params_STRUCT_SIZE);
        info.pCounterDataImage = counter_data.data();
        info.counterDataImageSize = counter_data.size();
        if (!ok(cuptiPmSamplingGetCounterDataInfo(&info), "cuptiPmSamplingGetCounterDataInfo")) return;
        FILE * f = std::fopen(path.c_str(), "w");
        if (!f) {
            std::fprintf(stderr, "dsv4-ktrace: cannot open %s\n", path.c_str());
            return;
        }
        std::fprintf(f, "#");
        for (const std::string & n : names) std::fprintf(f, " %s", n.c_str());
        std::fprintf(f, "\n");
        std::vector<double> values(metrics.size());
        for (size_t i = 0; i < info.numCompletedSamples; ++i) {
            auto si = params<CUpti_PmSampling_CounterData_GetSampleInfo_Params>(
                CUpti_PmSampling_CounterData_GetSampleInfo_Params_STRUCT_SIZE);
            si.pPmSamplingObject = sampler;
            si.pCounterDataImage = counter_data.data();
            si.counterDataImageSize = counter_data.size();
            si.sampleIndex = i;
            auto ev = params<CUpti_Profiler_Host_EvaluateToGpuValues_Params>(
                CUpti_Profiler_Host_EvaluateToGpuValues_Params_STRUCT_SIZE);
            ev.pHostObject = host;
            ev.pCounterDataImage = counter_data.data();
            ev.counterDataImageSize = counter_data.size();
            ev.rangeIndex = i;
            ev.ppMetricNames = metrics.data();
            ev.numMetrics = metrics.size();
            ev.pMetricValues = values.data();
            if (!ok(cuptiPmSamplingCounterDataGetSampleInfo(&si), "cuptiPmSamplingCounterDataGetSampleInfo") ||
                !ok(cuptiProfilerHostEvaluateToGpuValues(&ev), "cuptiProfilerHostEvaluateToGpuValues"))
                break;
            std::fprintf(f, "%llu %llu", static_cast<unsigned long long>(si.startTimestamp),
                         static_cast<unsigned long long>(si.endTimestamp));
            for (double v : values) std::fprintf(f, " %.6g", v);
            std::fprintf(f, "\n");
        }
        std::fclose(f);
        std::fprintf(stderr, "dsv4-ktrace: %zu PM samples (%zu in the hardware ring%s) written to %s\n",
                     size_t(info.numCompletedSamples), size_t(info.numPopulatedSamples),
                     dd.overflow ? ", which overflowed" : "", path.c_str());
    }
} pm;

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
        if (const char * p = std::getenv("DSV4_PMSAMPLE"); p && *p) pm.path = p;
        std::atexit([] { cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED); });
    }
} tracer;

}  // namespace

// The program's switch for the sampler (dsv4-cuda-bench finds it with dlsym): on starts sampling device `device`
// (set up at the first call), off stops it and writes the file. Without DSV4_PMSAMPLE it does nothing.
extern "C" int dsv4_ktrace_pm(int device, int on) {
    if (pm.path.empty()) return 0;
    if (on)
        pm.start(uint32_t(device));
    else
        pm.finish();
    return 1;
}
