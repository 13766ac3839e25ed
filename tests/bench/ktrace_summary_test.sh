#!/usr/bin/env bash
# scripts/ktrace_summary.py on a made-up timeline of four decode steps and PM samples of known rates: the per-step
# costs, and with --pm the DRAM bytes each kernel kind read during its costs, the steps' mean rate and time below a
# quarter of the peak.
set -euo pipefail
root=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Steps 100 us apart (graph 1, nodes 1-3): alpha [0, 10) us, beta [2, 40), gamma [41, 50).
for s in 0 1 2 3; do
    b=$((s * 100000))
    echo "$b $((b + 10000)) 1 16 1 1 alpha_kernel(int)"
    echo "$((b + 2000)) $((b + 40000)) 1 64 1 2 beta_kernel(int)"
    echo "$((b + 41000)) $((b + 50000)) 1 8 2 3 gamma_kernel(int)"
done > "$work/kt.txt"
# 1 us samples over [0, 400) us: 4 MB each (4 TB/s) while a step is in [10, 40) us, else nothing; the first line is
# the sampler's setup interval, which the script leaves out.
{
    echo "# dram__bytes_read.sum"
    echo "-5000 0 999999999"
    for i in $(seq 0 399); do
        t=$((i % 100))
        v=0; if ((t >= 10 && t < 40)); then v=4000000; fi
        echo "$((i * 1000)) $(((i + 1) * 1000)) $v"
    done
} > "$work/pm.txt"
out=$(python3 "$root/scripts/ktrace_summary.py" "$work/kt.txt" --steps 8 --pm "$work/pm.txt" --peak 4.0 --list)
echo "$out"
fail() { echo "ktrace_summary_test: $1"; exit 1; }
grep -q '^4 graph executions; 4 steps of 3 kernels; GPU span per step 50.0 us' <<<"$out" || fail "step line"
grep -q 'between steps (host work, graph launch): 50.0 us' <<<"$out" || fail "gap line"
# Costs: alpha 10 us (from the step's start), beta 30 (10 -> 40), gamma 10 (40 -> 50). Beta's cost window holds
# every byte: 30 samples of 4 MB.
grep -q 'DRAM over 4 sampled steps: 0.120 GB read a step, 2.40 TB/s on average, below 1.00 TB/s for 40 % of the time' \
    <<<"$out" || fail "DRAM line"
grep -Eq '^ +1.0 +30.0 +38.0 +120.0  beta_kernel$' <<<"$out" || fail "beta's cost and bytes"
grep -Eq '^ +1.0 +10.0 +10.0 +0.0  alpha_kernel$' <<<"$out" || fail "alpha's cost and bytes"
grep -Eq '^ +2.0 +40.0 +30.0 +120.0 +4.00  64x1 +beta_kernel$' <<<"$out" || fail "beta's --list line"
# Without --pm the same costs and no DRAM columns.
plain=$(python3 "$root/scripts/ktrace_summary.py" "$work/kt.txt" --steps 8)
grep -Eq '^ +1.0 +30.0 +38.0  beta_kernel$' <<<"$plain" || fail "plain costs"
! grep -q DRAM <<<"$plain" || fail "DRAM without --pm"
echo "ktrace_summary_test: ok"
