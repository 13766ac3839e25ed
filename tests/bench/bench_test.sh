#!/usr/bin/env bash
# dsv4-bench end to end on the CPU with a small synthetic model carrying the real tokenizer: every measure the
# tool promises appears in its CSV with a positive speed, the roofline column stays empty without --peak-gbps,
# and the CPU backend reports no device memory.
#
#   tests/bench/bench_test.sh BUILD_BIN_DIR VOCAB.gguf
set -euo pipefail
bin=$1 vocab=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bin/dsv4-synth" "$work/mini.gguf" --shape mini --layers 2 --mix q8_0 --vocab "$vocab" > /dev/null
"$bin/dsv4-bench" -m "$work/mini.gguf" --backend cpu -t 2 --first 64 --ctx-max 128 --gen-tokens 2 --ubatch 64 \
  --ttft-prompt 64 --streams 1 2 > "$work/out.csv" 2> "$work/err.txt"
fail() { echo "bench_test: $*" >&2; cat "$work/out.csv" >&2; exit 1; }
head -1 "$work/out.csv" | grep -q '^model,backend,measure,context,tokens,' || fail "no CSV header"
for m in prefill decode ttft_cold ttft_warm streams_1 streams_2 peak_host_mb peak_device_mb; do
  grep -q ",$m," "$work/out.csv" || fail "no $m row"
done
# tokens/s (column 7) of every speed row is positive; the CPU holds no device memory.
awk -F, 'NR > 1 && $3 !~ /^peak_/ && !($7 > 0) {bad = 1} END {exit bad}' "$work/out.csv" || fail "a speed row is not positive"
awk -F, '$3 == "peak_device_mb" && $7 != 0 {bad = 1} END {exit bad}' "$work/out.csv" || fail "device memory on the CPU"
awk -F, '$3 == "peak_host_mb" && !($7 > 0) {bad = 1} END {exit bad}' "$work/out.csv" || fail "no host memory figure"
grep -q "peak device memory: 0 MB" "$work/err.txt" || fail "stderr lacks the memory line"
grep -q "2 streams: .* tok/s per stream" "$work/err.txt" || fail "stderr lacks the per-stream rate"
grep -q "prefill chunks of 64 tokens" "$work/err.txt" || fail "stderr lacks the chunk given by --ubatch"
# Without --ubatch the chunk is the memory plan's, as dsv4 and dsv4-server pick it (256 on the CPU).
"$bin/dsv4-bench" -m "$work/mini.gguf" --backend cpu -t 2 --first 64 --ctx-max 64 --gen-tokens 1 --ttft-prompt 32 \
  --no-streams > /dev/null 2> "$work/err2.txt" || { cat "$work/err2.txt" >&2; fail "the run without --ubatch failed"; }
grep -q "prefill chunks of 256 tokens" "$work/err2.txt" || { cat "$work/err2.txt" >&2; fail "not the plan's chunk"; }
echo "bench_test: ok ($(($(wc -l < "$work/out.csv") - 1)) rows)"
