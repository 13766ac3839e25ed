// dsv4-quant-bench: CPU dot products per weight type at the model's row lengths (4096 and 2048 inputs), scalar
// against AVX2, plus quantize / dequantize speed. Results and the command line: docs/quant-benchmarks.md.
//
// Names: dot/<form>/<type>/<n>/<impl>/<set>
//   form  q8   weight row · activations pre-quantized to dot_type (vec_dot; the decode path)
//         f32  weight row · f32 activations (vec_dot_f32)
//         rows vec_dot_rows over the whole set (one call per iteration)
//   set   hot     16 rows that stay in L2: kernel speed
//         stream  rows cycling through 256 MiB (far beyond the caches): the bandwidth-bound decode case
// bytes_per_second counts weight bytes; GFLOP/s counts 2·n per row.
#include "format/quant.h"

#include "util/aligned.h"

#include <benchmark/benchmark.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace dsv4 {
namespace {

const GgmlType kTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16,    GgmlType::Q8_0,
                           GgmlType::Q2_K, GgmlType::Q4_K, GgmlType::IQ2_XXS, GgmlType::MXFP4};

constexpr int kHotRows = 16;
constexpr size_t kStreamBytes = size_t(256) << 20;

std::vector<float> gaussian(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> v(static_cast<size_t>(n));
    for (float & x : v) x = dist(rng);
    return v;
}

// A weight matrix: kHotRows quantized rows, repeated to fill `bytes` when streaming (the values do not matter
// for speed, only that they are valid blocks).
struct Matrix {
    AlignedBuffer data;
    size_t row_bytes = 0;
    int rows = 0;
};

// Hot matrices are kept; only the most recent streaming one is (256 MiB each).
const Matrix & matrix(GgmlType t, int64_t n, bool stream) {
    static std::map<std::pair<GgmlType, int64_t>, Matrix> hot;
    static std::pair<GgmlType, int64_t> stream_key{GgmlType::F32, 0};
    static Matrix stream_matrix;
    const std::pair<GgmlType, int64_t> key{t, n};
    if (!stream) {
        auto it = hot.find(key);
        if (it != hot.end()) return it->second;
    } else if (stream_key == key) {
        return stream_matrix;
    }
    Matrix & m = stream ? stream_matrix : hot[key];
    if (stream) stream_key = key;
    m.row_bytes = row_bytes(t, n);
    m.rows = stream ? int(kStreamBytes / m.row_bytes) : kHotRows;
    m.data.resize(m.row_bytes * size_t(m.rows));
    for (int r = 0; r < kHotRows; ++r)
        quantize_row(t, gaussian(n, uint32_t(r)).data(), m.data.as<uint8_t>() + r * m.row_bytes, n);
    for (int r = kHotRows; r < m.rows; ++r)
        std::memcpy(m.data.as<uint8_t>() + r * m.row_bytes, m.data.as<uint8_t>() + (r % kHotRows) * m.row_bytes,
                    m.row_bytes);
    return m;
}

enum class Form { q8, f32, rows };

void bm_dot(benchmark::State & state, GgmlType t, int64_t n, Form form, bool scalar, bool stream) {
    quant_force_scalar(scalar);
    const Matrix & m = matrix(t, n, stream);
    const std::vector<float> x = gaussian(n, 99);
    std::vector<uint8_t> act(dot_row_bytes(t, n));
    quantize_activations(t, x.data(), act.data(), n);
    std::vector<float> out(static_cast<size_t>(m.rows));
    const uint8_t * w = m.data.as<uint8_t>();
    int r = 0;
    int64_t rows_done = 0;
    for (auto _ : state) {
        if (form == Form::rows) {
            vec_dot_rows(t, n, w, m.row_bytes, m.rows, act.data(), out.data());
            benchmark::DoNotOptimize(out.data());
            rows_done += m.rows;
            continue;
        }
        // 16 rows per iteration keeps the timer overhead out of the per-row numbers.
        for (int k = 0; k < 16; ++k) {
            const uint8_t * row = w + size_t(r) * m.row_bytes;
            float v = form == Form::q8 ? vec_dot(t, n, row, act.data()) : vec_dot_f32(t, n, row, x.data());
            benchmark::DoNotOptimize(v);
            if (++r == m.rows) r = 0;
        }
        rows_done += 16;
    }
    state.SetBytesProcessed(rows_done * int64_t(m.row_bytes));
    state.counters["GFLOP/s"] =
        benchmark::Counter(double(rows_done) * 2.0 * double(n) * 1e-9, benchmark::Counter::kIsRate);
    state.counters["ns/row"] =
        benchmark::Counter(double(rows_done) * 1e-9, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
    quant_force_scalar(false);
}

// Conversion speed over one 4096-value row; bytes_per_second counts the f32 side (4 bytes per value).
void bm_convert(benchmark::State & state, GgmlType t, bool quantize, bool scalar) {
    quant_force_scalar(scalar);
    const int64_t n = 4096;
    const std::vector<float> x = gaussian(n, 7);
    std::vector<uint8_t> q(row_bytes(t, n));
    quantize_row(t, x.data(), q.data(), n);
    std::vector<float> y(static_cast<size_t>(n));
    for (auto _ : state) {
        if (quantize)
            quantize_row(t, x.data(), q.data(), n);
        else
            dequantize_row(t, q.data(), y.data(), n);
        benchmark::ClobberMemory();
    }
    state.SetBytesProcessed(int64_t(state.iterations()) * n * 4);
    quant_force_scalar(false);
}

void bm_activations(benchmark::State & state, GgmlType weight, bool scalar) {
    quant_force_scalar(scalar);
    const int64_t n = 4096;
    const std::vector<float> x = gaussian(n, 8);
    std::vector<uint8_t> act(dot_row_bytes(weight, n));
    for (auto _ : state) {
        quantize_activations(weight, x.data(), act.data(), n);
        benchmark::ClobberMemory();
    }
    state.SetBytesProcessed(int64_t(state.iterations()) * n * 4);
    quant_force_scalar(false);
}

void register_all() {
    quant_force_scalar(false);
    const bool avx2 = std::string(quant_simd_name()) == "avx2";
    std::vector<bool> impls = {true};
    if (avx2) impls.push_back(false);
    auto impl_name = [](bool scalar) { return scalar ? "scalar" : "avx2"; };
    for (GgmlType t : kTypes) {
        const std::string tn(type_name(t));
        const bool is_float = dot_type(t) == GgmlType::F32;
        for (int64_t n : {4096, 2048})
            for (bool scalar : impls) {
                const std::string suffix = "/" + tn + "/" + std::to_string(n) + "/" + impl_name(scalar);
                if (!is_float)
                    benchmark::RegisterBenchmark(("dot/q8" + suffix + "/hot").c_str(), bm_dot, t, n, Form::q8, scalar,
                                                 false);
                benchmark::RegisterBenchmark(("dot/f32" + suffix + "/hot").c_str(), bm_dot, t, n, Form::f32, scalar,
                                             false);
                // Streaming is memory bound, so only the fast path is worth the time.
                if (!scalar || !avx2)
                    benchmark::RegisterBenchmark(
                        ("dot/" + std::string(is_float ? "f32" : "q8") + suffix + "/stream").c_str(), bm_dot, t, n,
                        is_float ? Form::f32 : Form::q8, scalar, true);
            }
    }
    for (bool scalar : impls)
        for (bool stream : {false, true})
            benchmark::RegisterBenchmark(
                (std::string("dot/rows/q8_0/4096/") + impl_name(scalar) + (stream ? "/stream" : "/hot")).c_str(),
                bm_dot, GgmlType::Q8_0, int64_t(4096), Form::rows, scalar, stream);
    for (GgmlType t : kTypes)
        for (bool quantize : {false, true})
            for (bool scalar : impls) {
                const bool simd_path = t == GgmlType::F16 || t == GgmlType::BF16;
                if (!scalar && !simd_path) continue;  // only the 16-bit conversions have AVX2 versions
                benchmark::RegisterBenchmark((std::string(quantize ? "quantize/" : "dequantize/") +
                                              std::string(type_name(t)) + "/4096/" + impl_name(scalar))
                                                 .c_str(),
                                             bm_convert, t, quantize, scalar);
            }
    for (GgmlType w : {GgmlType::Q8_0, GgmlType::Q2_K})
        for (bool scalar : impls)
            benchmark::RegisterBenchmark(
                (std::string("activations/") + (w == GgmlType::Q8_0 ? "q8a" : "q8_K") + "/4096/" + impl_name(scalar))
                    .c_str(),
                bm_activations, w, scalar);
}

}  // namespace
}  // namespace dsv4

int main(int argc, char ** argv) {
    dsv4::register_all();
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}
