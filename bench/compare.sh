#!/usr/bin/env bash
# Side by side: a peer's benchmark (llama.cpp's llama-bench or antirez/ds4's ds4-bench) and dsv4-bench on the same
# GGUF file, on the same machine, in one run, alternating (peer, dsv4, peer, dsv4, ...), then the ratios.
#
#   bench/compare.sh (--llama-bench PATH | --ds4-bench PATH) [--runs N] [--prompt P] [--gen G] [--ubatch U]
#                    [--backend cuda|cpu] MODEL.gguf
#
# llama.cpp: prefill of a P-token prompt (llama-bench pp<P>, dsv4-bench's first frontier) and decode of G tokens
# after it (llama-bench tg<G> at depth P, dsv4-bench decode at frontier P). Both prefill in chunks of U tokens
# (default 2048; llama-bench -b P -ub U), llama-bench with flash attention and every layer on the GPU.
# ds4: ds4-bench walks frontiers of one session and its first prefill pays the process's one-time costs, so its
# first frontier is a 256-token warm-up (dsv4-bench takes an untimed pass for the same reason) and the second is
# measured: P tokens prefilled after the 256, then G decoded at 256 + P. dsv4-bench prefills 256 + P tokens and
# decodes G at 256 + P. Each picks its own prefill chunk unless --ubatch is given (dsv4 only: ds4 has no such
# option); dsv4-bench's own is the one dsv4 and dsv4-server take for the context. ds4 loads only V4 Flash's exact
# shapes, all 43 layers (`dsv4-synth --layers 43`, 81 GB).
# Nothing of either peer is part of this repository: bring your own build. Both load only files with a
# tokenizer: make synthetic ones with `dsv4-synth --vocab build/share/dsv4/deepseek-v4-vocab.gguf`.
set -euo pipefail
cd "$(dirname "$0")/.."

llama_bench= ds4_bench= runs=3 prompt=2048 gen=128 ubatch= backend=auto model=
while (($#)); do
  case "$1" in
    --llama-bench) llama_bench=$2; shift 2 ;;
    --ds4-bench) ds4_bench=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --prompt) prompt=$2; shift 2 ;;
    --gen) gen=$2; shift 2 ;;
    --ubatch) ubatch=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) model=$1; shift ;;
  esac
done
if [[ -n "$llama_bench" && -z "$ds4_bench" ]]; then
  peer=llama.cpp peer_bin=$llama_bench
elif [[ -n "$ds4_bench" && -z "$llama_bench" ]]; then
  peer=ds4 peer_bin=$ds4_bench
else
  echo "compare.sh: give one peer, --llama-bench PATH or --ds4-bench PATH" >&2; exit 2
fi
[[ -x "$peer_bin" ]] || { echo "compare.sh: $peer_bin is not an executable" >&2; exit 2; }
[[ -n "$model" && -f "$model" ]] || { echo "compare.sh: MODEL.gguf is required" >&2; exit 2; }
dsv4_bench=${DSV4_BENCH:-build/bin/dsv4-bench}
[[ -x "$dsv4_bench" ]] || { echo "compare.sh: $dsv4_bench not built (./scripts/setup.sh)" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
warm=256
if [[ $peer == ds4 ]]; then
  depth=$((warm + prompt))
  # ds4-bench slices its prompt file's tokens at each frontier: the book dsv4-bench walks, twice over, is ~340K.
  cat bench/data/pride-and-prejudice.txt bench/data/pride-and-prejudice.txt > "$work/prompt.txt"
  ds4_backend=(); [[ $backend == cuda || $backend == cpu ]] && ds4_backend=(--"$backend")
  dsv4_ubatch=(); [[ -n "$ubatch" ]] && dsv4_ubatch=(--ubatch "$ubatch")
else
  depth=$prompt ubatch=${ubatch:-2048}
  dsv4_ubatch=(--ubatch "$ubatch")
fi
ngl=99; [[ "$backend" == cpu ]] && ngl=0
for ((r = 1; r <= runs; ++r)); do
  echo "run $r/$runs: $peer" >&2
  if [[ $peer == ds4 ]]; then
    "$ds4_bench" -m "$model" "${ds4_backend[@]}" --prompt-file "$work/prompt.txt" --ctx-start "$warm" \
      --ctx-max "$depth" --step-incr "$prompt" --gen-tokens "$gen" --csv "$work/ds4.$r.csv"
  else
    "$llama_bench" -m "$model" -p "$prompt" -n 0 -b "$prompt" -ub "$ubatch" -fa 1 -ngl "$ngl" -o csv > "$work/llama_pp.$r.csv"
    "$llama_bench" -m "$model" -p 0 -n "$gen" -d "$prompt" -fa 1 -ngl "$ngl" -o csv > "$work/llama_tg.$r.csv"
  fi
  echo "run $r/$runs: dsv4-bench" >&2
  "$dsv4_bench" -m "$model" --backend "$backend" --first "$depth" --ctx-max "$depth" --gen-tokens "$gen" \
    "${dsv4_ubatch[@]}" --no-streams > "$work/dsv4.$r.csv"
done

# Medians of tokens/s: llama-bench's avg_ts column; ds4-bench's prefill_tps and gen_tps of the measured frontier;
# dsv4-bench's tokens_per_s_median of the prefill and decode rows.
median() { sort -g | awk '{a[NR]=$1} END {if (NR) print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
llama_col() { # file -> avg_ts of the data row
  awk -F, 'NR==1 {for (i = 1; i <= NF; ++i) { gsub(/"/, "", $i); if ($i == "avg_ts") c = i } next}
           {gsub(/"/, "", $c); print $c}' "$1"
}
ds4_col() { # file column -> that column of the row at the measured frontier
  awk -F, -v col="$2" -v d="$depth" 'NR==1 {for (i = 1; i <= NF; ++i) if ($i == col) c = i; next} $1 == d {print $c}' "$1"
}
dsv4_col() { # file measure -> tokens_per_s_median
  awk -F, -v m="$2" 'NR==1 {for (i = 1; i <= NF; ++i) if ($i == "tokens_per_s_median") c = i; next} $3 == m {print $c}' "$1"
}
if [[ $peer == ds4 ]]; then
  peer_pp=$(for f in "$work"/ds4.*.csv; do ds4_col "$f" prefill_tps; done | median)
  peer_tg=$(for f in "$work"/ds4.*.csv; do ds4_col "$f" gen_tps; done | median)
  pp_label="prefill $prompt (tok/s)" settings="warm-up $warm, dsv4 ubatch ${ubatch:-default}"
else
  peer_pp=$(for f in "$work"/llama_pp.*.csv; do llama_col "$f"; done | median)
  peer_tg=$(for f in "$work"/llama_tg.*.csv; do llama_col "$f"; done | median)
  pp_label="prefill pp$prompt (tok/s)" settings="ubatch $ubatch"
fi
dsv4_pp=$(for f in "$work"/dsv4.*.csv; do dsv4_col "$f" prefill; done | median)
dsv4_tg=$(for f in "$work"/dsv4.*.csv; do dsv4_col "$f" decode; done | median)
[[ -n "$peer_pp" && -n "$peer_tg" ]] || { echo "compare.sh: no $peer figures for frontier $depth" >&2; exit 1; }
[[ -n "$dsv4_pp" && -n "$dsv4_tg" ]] || { echo "compare.sh: no dsv4 figures for frontier $depth" >&2; exit 1; }

printf 'model: %s\nruns: %d, prompt %d, gen %d, %s, backend %s\n' "$model" "$runs" "$prompt" "$gen" "$settings" "$backend"
printf '%-28s %12s %12s %8s\n' metric "$peer" dsv4 ratio
awk -v a="$peer_pp" -v b="$dsv4_pp" -v l="$pp_label" 'BEGIN {printf "%-28s %12.1f %12.1f %7.2fx\n", l, a, b, b / a}'
awk -v a="$peer_tg" -v b="$dsv4_tg" -v d="$depth" -v g="$gen" 'BEGIN {printf "%-28s %12.1f %12.1f %7.2fx\n", "decode tg" g "@" d " (tok/s)", a, b, b / a}'
