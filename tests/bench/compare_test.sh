#!/usr/bin/env bash
# bench/compare.sh against stand-ins for llama-bench and dsv4-bench that print known CSV: checks the alternation,
# the argument passing and the medians and ratios it prints.
set -euo pipefail
root=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/llama-bench" <<'STUB'
#!/usr/bin/env bash
# llama-bench's CSV: a quoted header and one quoted row per test; avg_ts is tokens/s.
echo "$@" >> "${0%/*}/calls"
if [[ " $* " == *" -n 0 "* ]]; then ts=1000; else ts=50; fi
n=$(grep -c . "${0%/*}/calls")
echo '"build_commit","model_filename","n_prompt","n_gen","avg_ts","stddev_ts"'
echo "\"abc\",\"m.gguf\",\"2048\",\"0\",\"$((ts + n))\",\"1.0\""
STUB
cat > "$work/dsv4-bench" <<'STUB'
#!/usr/bin/env bash
echo "dsv4 $*" >> "${0%/*}/calls"
echo "model,backend,measure,context,tokens,seconds_median,tokens_per_s_median,tokens_per_s_min,tokens_per_s_max,kv_bytes,roofline_fraction"
echo "m,cuda,prefill,2048,2048,0.5,4000.0,3900,4100,1,0"
echo "m,cuda,decode,2048,128,1.0,100.0,99,101,1,0.2"
STUB
chmod +x "$work/llama-bench" "$work/dsv4-bench"
touch "$work/model.gguf"
out=$(DSV4_BENCH="$work/dsv4-bench" "$root/bench/compare.sh" --llama-bench "$work/llama-bench" --runs 3 "$work/model.gguf")
echo "$out"
# The stub adds its call number: pp runs are calls 1, 4, 7 (1001, 1004, 1007: median 1004), tg runs calls 2, 5, 8
# (52, 55, 58: median 55); dsv4 reports 4000 and 100.
grep -Eq 'prefill pp2048 \(tok/s\) +1004.0 +4000.0 +3.98x' <<<"$out" || { echo "prefill line wrong"; exit 1; }
grep -Eq 'decode tg128@2048 \(tok/s\) +55.0 +100.0 +1.82x' <<<"$out" || { echo "decode line wrong"; exit 1; }
# Alternation: llama pp, llama tg, dsv4 in each run; the prompt length is the decode test's depth.
[[ $(grep -c '^dsv4' "$work/calls") == 3 && $(grep -c -- '-d 2048' "$work/calls") == 3 ]] || { echo "calls wrong"; cat "$work/calls"; exit 1; }
sed -n '3p;6p;9p' "$work/calls" | grep -q '^dsv4' || { echo "not alternating"; cat "$work/calls"; exit 1; }
# Missing llama-bench is an error with a message.
if "$root/bench/compare.sh" "$work/model.gguf" 2> "$work/err"; then echo "accepted no --llama-bench"; exit 1; fi
grep -q -- '--llama-bench' "$work/err"
echo PASS
