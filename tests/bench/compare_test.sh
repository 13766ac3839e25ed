#!/usr/bin/env bash
# bench/compare.sh against stand-ins for llama-bench, ds4-bench and dsv4-bench that print known CSV: checks the
# alternation, the argument passing and the medians and ratios it prints.
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

# ds4-bench: a warm-up frontier of 256, then the measured one at 256 + P; its CSV has one row a frontier.
cat > "$work/ds4-bench" <<'STUB'
#!/usr/bin/env bash
echo "ds4 $*" >> "${0%/*}/calls"
n=$(grep -c . "${0%/*}/calls")
while (($#)); do case "$1" in --csv) out=$2; shift 2 ;; --prompt-file) cp "$2" "${0%/*}/prompt.seen"; shift 2 ;; *) shift ;; esac; done
{ echo "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes"
  echo "256,256,10.00,64,1.00,1"
  echo "8448,8192,$((2000 + n)).00,64,$((30 + n)).50,2"; } > "$out"
STUB
chmod +x "$work/ds4-bench"
: > "$work/calls"
out=$(DSV4_BENCH="$work/dsv4-bench" "$root/bench/compare.sh" --ds4-bench "$work/ds4-bench" --runs 2 --prompt 8192 \
  --gen 64 --backend cuda "$work/model.gguf")
echo "$out"
# ds4 runs are calls 1 and 3: prefill 2001, 2003 (median 2002), decode 31.5, 33.5 (median 32.5); the warm-up row is
# not counted. The dsv4 stub's rows are read whatever the frontier.
grep -Eq 'prefill 8192 \(tok/s\) +2002.0 +4000.0 +2.00x' <<<"$out" || { echo "ds4 prefill line wrong"; exit 1; }
grep -Eq 'decode tg64@8448 \(tok/s\) +32.5 +100.0 +3.08x' <<<"$out" || { echo "ds4 decode line wrong"; exit 1; }
grep -q -- '^ds4 -m .*model.gguf --cuda --prompt-file .* --ctx-start 256 --ctx-max 8448 --step-incr 8192 --gen-tokens 64' \
  "$work/calls" || { echo "ds4 arguments wrong"; cat "$work/calls"; exit 1; }
# dsv4 measures the same frontier, in its own chunks (no --ubatch unless asked for).
[[ $(grep -c -- '^dsv4 .*--first 8448 --ctx-max 8448 --gen-tokens 64 --no-streams' "$work/calls") == 2 ]] \
  || { echo "dsv4 arguments wrong"; cat "$work/calls"; exit 1; }
sed -n '2p;4p' "$work/calls" | grep -q '^dsv4' || { echo "not alternating"; cat "$work/calls"; exit 1; }
cmp -s "$work/prompt.seen" <(cat "$root/bench/data/pride-and-prejudice.txt" "$root/bench/data/pride-and-prejudice.txt") \
  || { echo "ds4 prompt file wrong"; exit 1; }
# A ds4 CSV without the measured frontier is an error, not a ratio of nothing.
sed -i 's/^  echo "8448,/  echo "4096,/' "$work/ds4-bench"
if DSV4_BENCH="$work/dsv4-bench" "$root/bench/compare.sh" --ds4-bench "$work/ds4-bench" --runs 1 --prompt 8192 \
  "$work/model.gguf" > /dev/null 2> "$work/err"; then echo "accepted a CSV without the frontier"; exit 1; fi
grep -q 'no ds4 figures for frontier 8448' "$work/err" || { cat "$work/err"; exit 1; }

# No peer, or both, is an error with a message.
if "$root/bench/compare.sh" "$work/model.gguf" 2> "$work/err"; then echo "accepted no peer"; exit 1; fi
grep -q -- '--llama-bench PATH or --ds4-bench PATH' "$work/err"
if "$root/bench/compare.sh" --llama-bench "$work/llama-bench" --ds4-bench "$work/ds4-bench" "$work/model.gguf" \
  2> "$work/err"; then echo "accepted two peers"; exit 1; fi
grep -q -- 'give one peer' "$work/err"
echo PASS
