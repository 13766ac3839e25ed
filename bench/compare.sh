#!/usr/bin/env bash
# Side by side: an existing llama.cpp build's llama-bench and dsv4-bench on the same GGUF file, on the same
# machine, in one run, alternating (llama, dsv4, llama, dsv4, ...), then the ratios.
#
#   bench/compare.sh --llama-bench PATH [--runs N] [--prompt P] [--gen G] [--ubatch U] [--backend cuda|cpu] MODEL.gguf
#
# Measures prefill of a P-token prompt (llama-bench pp<P>, dsv4-bench's first frontier) and decode of G tokens
# after it (llama-bench tg<G> at depth P, dsv4-bench decode at frontier P). Both prefill in chunks of U tokens
# (default 2048; llama-bench -b P -ub U). llama-bench runs with flash attention and every layer on the GPU.
# Nothing of llama.cpp is part of this repository: bring your own build. llama.cpp loads only files with a
# tokenizer: make synthetic ones with `dsv4-synth --vocab build/share/dsv4/deepseek-v4-vocab.gguf`.
set -euo pipefail
cd "$(dirname "$0")/.."

llama_bench= runs=3 prompt=2048 gen=128 ubatch=2048 backend=auto model=
while (($#)); do
  case "$1" in
    --llama-bench) llama_bench=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --prompt) prompt=$2; shift 2 ;;
    --gen) gen=$2; shift 2 ;;
    --ubatch) ubatch=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) model=$1; shift ;;
  esac
done
[[ -n "$llama_bench" && -x "$llama_bench" ]] || { echo "compare.sh: --llama-bench PATH (an executable) is required" >&2; exit 2; }
[[ -n "$model" && -f "$model" ]] || { echo "compare.sh: MODEL.gguf is required" >&2; exit 2; }
dsv4_bench=${DSV4_BENCH:-build/bin/dsv4-bench}
[[ -x "$dsv4_bench" ]] || { echo "compare.sh: $dsv4_bench not built (./scripts/setup.sh)" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ngl=99; [[ "$backend" == cpu ]] && ngl=0
for ((r = 1; r <= runs; ++r)); do
  echo "run $r/$runs: llama-bench" >&2
  "$llama_bench" -m "$model" -p "$prompt" -n 0 -b "$prompt" -ub "$ubatch" -fa 1 -ngl "$ngl" -o csv > "$work/llama_pp.$r.csv"
  "$llama_bench" -m "$model" -p 0 -n "$gen" -d "$prompt" -fa 1 -ngl "$ngl" -o csv > "$work/llama_tg.$r.csv"
  echo "run $r/$runs: dsv4-bench" >&2
  "$dsv4_bench" -m "$model" --backend "$backend" --first "$prompt" --ctx-max "$prompt" --gen-tokens "$gen" \
    --ubatch "$ubatch" --no-streams > "$work/dsv4.$r.csv"
done

# Medians of tokens/s: llama-bench's avg_ts column; dsv4-bench's tokens_per_s_median of the prefill and decode rows.
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
llama_col() { # file -> avg_ts of the data row
  awk -F, 'NR==1 {for (i = 1; i <= NF; ++i) { gsub(/"/, "", $i); if ($i == "avg_ts") c = i } next}
           {gsub(/"/, "", $c); print $c}' "$1"
}
dsv4_col() { # file measure -> tokens_per_s_median
  awk -F, -v m="$2" 'NR==1 {for (i = 1; i <= NF; ++i) if ($i == "tokens_per_s_median") c = i; next} $3 == m {print $c}' "$1"
}
llama_pp=$(for f in "$work"/llama_pp.*.csv; do llama_col "$f"; done | median)
llama_tg=$(for f in "$work"/llama_tg.*.csv; do llama_col "$f"; done | median)
dsv4_pp=$(for f in "$work"/dsv4.*.csv; do dsv4_col "$f" prefill; done | median)
dsv4_tg=$(for f in "$work"/dsv4.*.csv; do dsv4_col "$f" decode; done | median)

printf 'model: %s\nruns: %d, prompt %d, gen %d, ubatch %d, backend %s\n' "$model" "$runs" "$prompt" "$gen" "$ubatch" "$backend"
printf '%-28s %12s %12s %8s\n' metric llama.cpp dsv4 ratio
awk -v a="$llama_pp" -v b="$dsv4_pp" -v p="$prompt" 'BEGIN {printf "%-28s %12.1f %12.1f %7.2fx\n", "prefill pp" p " (tok/s)", a, b, b / a}'
awk -v a="$llama_tg" -v b="$dsv4_tg" -v p="$prompt" -v g="$gen" 'BEGIN {printf "%-28s %12.1f %12.1f %7.2fx\n", "decode tg" g "@" p " (tok/s)", a, b, b / a}'
