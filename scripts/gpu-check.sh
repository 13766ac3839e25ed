#!/usr/bin/env bash
# The GPU half of the checks, on a machine with an NVIDIA GPU: every `gpu` test variant of tests/CMakeLists.txt and
# the benchmark lines of docs/performance.md. It runs from a build tree, or from a package of one made on another
# machine (the GPU machine then needs the driver and the toolkit's libraries the build linked, no compiler):
#
#   scripts/gpu-check.sh pack OUT.tar.xz           # on the build machine, from the build tree: the GPU test binaries,
#                                                  # dsv4-cuda-bench, dsv4-bench, dsv4-sync-bench,
#                                                  # dsv4-overlap-bench, dsv4-synth,
#                                                  # libdsv4_ktrace.so, the V4 vocabulary, the ctest files
#   scripts/gpu-check.sh tests [PKG.tar.xz [ARGS]] # ctest -L gpu, every variant (skipped where no GPU is found);
#                                                  # ARGS go to ctest (e.g. -R memcheck)
#   scripts/gpu-check.sh bench [PKG.tar.xz]        # prefill of an 8K and a 64K prompt in chunks of 16384 and decode at
#                                                  # 2K and 32K on 4- and 8-layer q2 files of V4 Flash's shapes, then
#                                                  # the 43-layer extrapolation (scripts/extrapolate.py)
#   scripts/gpu-check.sh skip [PKG.tar.xz]         # what each kind of small kernel adds to a decode step at 2K: the
#                                                  # 4- and 8-layer steps with one kind left out of the graph at a
#                                                  # time (DSV4_CUDA_SKIP; the values are then wrong), DSV4_SKIP_ROUNDS
#                                                  # rounds (default 2), the 8-layer step's change per layer
#   scripts/gpu-check.sh compare [PKG.tar.xz] LLAMA_BENCH
#                                                  # bench/compare.sh (llama.cpp's llama-bench against dsv4-bench, 8K
#                                                  # prompt and decode after it, chunks of 2048) on the same files
#
# The synthetic files carry the V4 vocabulary (llama.cpp loads no file without a tokenizer).
#
# Environment: DSV4_BUILD_DIR (the build tree, default build), DSV4_MODELS (where bench makes its synthetic files
# once, default /tmp/dsv4-models), DSV4_BENCH_ARGS (more dsv4-cuda-bench arguments, e.g. --gpu 1).
set -euo pipefail
caller=$PWD  # package paths are relative to where the script was called from
cd "$(dirname "$0")/.."
root=$PWD
build_dir=$(realpath -m "${DSV4_BUILD_DIR:-build}")
mode=${1:-}
shift || true

# The package's tree (or the build tree itself): bin/, tests/, lib/ and the ctest files, whose absolute paths name
# the build machine's tree until unpack rewrites them.
tree=$build_dir
unpack() {
    local pkg
    pkg=$(cd "$caller" && realpath -m "$1")
    tree=$(mktemp -d /tmp/dsv4-gpu.XXXXXX)
    tar xJf "$pkg" -C "$tree"
    local from_build from_root
    from_build=$(sed -n 1p "$tree/pack-root")
    from_root=$(sed -n 2p "$tree/pack-root")
    find "$tree" -name CTestTestfile.cmake -exec sed -i "s|$from_build|$tree|g; s|$from_root|$root|g" {} +
    # The tests read the oracle fixtures of this checkout.
    export DSV4_TEST_DATA=$root/tests/data
}

# synth L: the bench file of L layers (q2, V4 Flash's shapes, the V4 vocabulary), made once; its path in $file.
models=${DSV4_MODELS:-/tmp/dsv4-models}
synth() {
    file=$models/flash$1-q2v.gguf
    mkdir -p "$models"
    [[ -f "$file" ]] || "$tree/bin/dsv4-synth" "$file" --shape flash --layers "$1" --mix q2 \
        --vocab "$tree/share/dsv4/deepseek-v4-vocab.gguf" > /dev/null
}

case "$mode" in
pack)
    out=$(cd "$caller" && realpath -m "${1:?gpu-check.sh pack OUT.tar.xz}")
    [[ -f "$build_dir/tests/backend_ops_test" ]] || { echo "gpu-check: no CUDA test binaries in $build_dir" >&2; exit 2; }
    staging=$(mktemp -d)
    trap 'rm -rf "$staging"' EXIT
    (cd "$build_dir" && find . -name CTestTestfile.cmake -print0 | xargs -0 cp --parents -t "$staging")
    mkdir -p "$staging/bin" "$staging/tests" "$staging/lib" "$staging/share/dsv4"
    cp "$build_dir/bin/dsv4-cuda-bench" "$build_dir/bin/dsv4-bench" "$build_dir/bin/dsv4-synth" \
        "$build_dir/bin/dsv4-sync-bench" "$build_dir/bin/dsv4-overlap-bench" "$staging/bin/"
    cp "$build_dir/tests/backend_ops_test" "$build_dir/tests/cuda_model_test" "$staging/tests/"
    cp "$build_dir/lib/libdsv4_ktrace.so" "$staging/lib/"
    cp "$build_dir/share/dsv4/deepseek-v4-vocab.gguf" "$staging/share/dsv4/"
    strip "$staging"/bin/* "$staging"/tests/backend_ops_test "$staging"/tests/cuda_model_test
    printf '%s\n%s\n' "$build_dir" "$root" > "$staging/pack-root"
    # xz -9e's 64 MB window sees that the binaries share their CUDA code: a 90a build packs into 14 MB (36 at -6), one
    # of three architectures into 73.
    tar cf - -C "$staging" . | xz -9e -T0 > "$out"
    echo "gpu-check: $out ($(du -h "$out" | cut -f1))"
    ;;
tests)
    [[ $# -gt 0 ]] && { unpack "$1"; shift; }
    ctest --test-dir "$tree" -L gpu --output-on-failure "$@"
    ;;
bench)
    [[ $# -gt 0 ]] && unpack "$1"
    read -r -a extra <<< "${DSV4_BENCH_ARGS:-}"
    for layers in 4 8; do
        synth "$layers"
        {
            "$tree/bin/dsv4-cuda-bench" "$file" --depth 8192,65536 --decode 2 --ubatch 16384 --warmup 8192 "${extra[@]}"
            "$tree/bin/dsv4-cuda-bench" "$file" --depth 2048,32768 --decode 64 "${extra[@]}"
        } | grep -E "depth" | tee "$models/bench$layers.txt"
    done
    python3 scripts/extrapolate.py "$models/bench4.txt" "$models/bench8.txt"
    ;;
skip)
    [[ $# -gt 0 ]] && unpack "$1"
    read -r -a extra <<< "${DSV4_BENCH_ARGS:-}"
    # hc_sinkhorn is not among them: the next boundary polls for its count and traps.
    kinds=(none hc_cluster quantize_rows moe_down "indexer_scores,indexer_topk,hadamard,::rope_kernel" attention_kernel
        norm_rope attention_combine compressor_ rms_norm moe_combine moe_shared cand_)
    mkdir -p "$models"  # for skip.txt, before synth makes the files
    for ((round = 1; round <= ${DSV4_SKIP_ROUNDS:-2}; ++round)); do
        for kind in "${kinds[@]}"; do
            line=$kind
            for layers in 4 8; do
                synth "$layers"
                ms=$(DSV4_CUDA_SKIP=$([[ $kind == none ]] || echo "$kind") timeout 120 "$tree/bin/dsv4-cuda-bench" \
                    "$file" --depth 2048 --decode 64 "${extra[@]}" 2> /dev/null |
                    sed -nE 's/.*decode ([0-9.]+) ms.*/\1/p' || true)
                line="$line ${ms:-failed}"
            done
            echo "$line"
        done
    done | tee "$models/skip.txt"
    # Means over the rounds; a kind's cost is the 8-layer step's change against `none`, divided by its 8 layers.
    awk '$2 != "failed" && $3 != "failed" { n[$1]++; a[$1] += $2; b[$1] += $3; if (!($1 in seen)) { seen[$1] = 1; order[++k] = $1 } }
        END { if (!n["none"]) { print "gpu-check: the step with nothing left out failed" > "/dev/stderr"; exit 1 }
              printf "%-52s %9s %9s %12s\n", "left out", "4 layers", "8 layers", "us a layer";
              for (i = 1; i <= k; ++i) { x = order[i]; printf "%-52s %9.4f %9.4f %12.1f\n", x, a[x] / n[x], b[x] / n[x],
                  (b[x] / n[x] - b["none"] / n["none"]) * 1000 / 8 } }' "$models/skip.txt"
    ;;
compare)
    [[ $# -gt 1 ]] && { unpack "$1"; shift; }
    llama_bench=$(cd "$caller" && realpath -m "${1:?gpu-check.sh compare [PKG.tar.xz] LLAMA_BENCH}")
    for layers in 4 8; do
        synth "$layers"
        DSV4_BENCH="$tree/bin/dsv4-bench" bench/compare.sh --llama-bench "$llama_bench" --runs 1 --prompt 8192 \
            --gen 32 --ubatch 2048 --backend cuda "$file"
    done
    ;;
*)
    sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
