#!/usr/bin/env bash
# Regenerates the speed-against-context plots of docs/performance.md from dsv4-bench CSV files.
#
#   bench/plot.sh OUT_DIR LABEL=FILE.csv [LABEL=FILE.csv ...]
#
# Writes OUT_DIR/prefill.svg and OUT_DIR/decode.svg: tokens/s (median over --repeat) against context, one line per
# labelled CSV (e.g. "H200 q2 4 layers=docs/perf-data/h200-flash4-q2.csv"). Needs gnuplot (Debian: gnuplot-nox).
set -euo pipefail
(($# >= 2)) || { sed -n '2,8p' "$0" >&2; exit 2; }
out=$1; shift
command -v gnuplot >/dev/null || { echo "plot.sh: gnuplot is not installed (apt-get install gnuplot-nox)" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for measure in prefill decode; do
  plots=()
  i=0
  for spec in "$@"; do
    label=${spec%%=*} file=${spec#*=}
    [[ -f "$file" ]] || { echo "plot.sh: $file not found" >&2; exit 2; }
    # Columns: measure (3), context (4), tokens_per_s_median (7).
    awk -F, -v m="$measure" 'NR > 1 && $3 == m {print $4, $7}' "$file" > "$work/$measure.$i.dat"
    [[ -s "$work/$measure.$i.dat" ]] || { echo "plot.sh: $file has no $measure rows" >&2; exit 2; }
    plots+=("'$work/$measure.$i.dat' using 1:2 with linespoints title '${label//\'/}'")
    i=$((i + 1))
  done
  joined=$(IFS=,; echo "${plots[*]}")
  gnuplot <<GP
set terminal svg size 720,420 dynamic font 'sans,11'
set output '$out/$measure.svg'
set title '$measure speed against context (dsv4-bench)'
set xlabel 'context (tokens)'
set ylabel 'tokens/s'
set logscale x 2
set grid
set key left bottom
plot $joined
GP
  echo "wrote $out/$measure.svg"
done
