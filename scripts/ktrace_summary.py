#!/usr/bin/env python3
"""Per-kernel costs of the decode steps in a libdsv4_ktrace.so timeline (docs/cuda.md).

Usage: ktrace_summary.py TIMELINE [--steps N] [--list]
       ktrace_summary.py TIMELINE --totals [--top N]

A step is one execution of the decode graph: the kernels of one graph id until a graph node repeats. The steps of
the most common size are used (the last N of them). Each kernel's cost is how much later it ends than the kernel
that ended before it: in a chain of dependent kernels with programmatic dependent launch, blocks start early and
wait, so durations overlap and only the ends add up to the step. Between two steps, what the GPU ran outside the
graph (the sampler's kernels, the token's copies) is listed with its mean time; the rest of the gap the GPU waited
for the host. --list prints the last step kernel by kernel. --totals sums every kernel and copy of the timeline by
kind instead, for runs that are not decode steps (a long prefill: its chunks run eagerly, one kernel after another,
so the durations add up to the GPU's time).
"""
import argparse
import collections
import re


def read(path):
    kernels = []
    with open(path) as f:
        for line in f:
            start, end, graph, gx, gy, node, name = line.rstrip('\n').split(' ', 6)
            kernels.append((int(start), int(end), int(graph), int(gx), int(gy), int(node), name))
    return sorted(kernels)


def steps_of(kernels):
    steps, cur, nodes = [], [], set()
    for k in kernels:
        graph, node = k[2], k[5]
        if graph == 0 or (cur and (graph != cur[-1][2] or node in nodes)):
            if cur:
                steps.append(cur)
            cur, nodes = [], set()
        if graph != 0:
            cur.append(k)
            nodes.add(node)
    if cur:
        steps.append(cur)
    return steps


def kind(name):
    name = re.sub(r'dsv4::cuda::|\(anonymous namespace\)::|void ', '', name)
    return name if name.startswith(('matvec_kernel', 'gemm_kernel', 'memcpy')) else re.sub(r'[<(].*$', '', name)


def totals(records, top):
    if not records:
        raise SystemExit('no kernels in the timeline (was the program run with LD_PRELOAD?)')
    time = collections.defaultdict(lambda: [0, 0])
    for k in records:
        t = time[kind(k[6])]
        t[0] += 1
        t[1] += k[1] - k[0]
    busy = sum(t for _, t in time.values())
    span = max(k[1] for k in records) - min(k[0] for k in records)
    print(f'span {span / 1e9:.3f} s, kernels and copies {busy / 1e9:.3f} s')
    print(f'{"launches":>8} {"ms":>10} {"share":>6}  kind')
    for name, (n, t) in sorted(time.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f'{n:8d} {t / 1e6:10.1f} {100 * t / busy:5.1f} %  {name[:100]}')


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('timeline')
    ap.add_argument('--steps', type=int, default=8, help='steps averaged (the last ones; default 8)')
    ap.add_argument('--list', action='store_true', help='the last step kernel by kernel')
    ap.add_argument('--totals', action='store_true', help='every kernel and copy summed by kind (prefill runs)')
    ap.add_argument('--top', type=int, default=20, help='kinds printed with --totals (default 20)')
    args = ap.parse_args()
    records = read(args.timeline)
    if args.totals:
        totals(records, args.top)
        return
    steps = steps_of(records)
    if not steps:
        raise SystemExit(f'{args.timeline}: no graph kernels (was the program run with LD_PRELOAD?)')
    size = collections.Counter(len(s) for s in steps).most_common(1)[0][0]
    use = [s for s in steps if len(s) == size][-args.steps:]
    spans = [(max(k[1] for k in s) - s[0][0]) / 1e3 for s in use]
    print(f'{len(steps)} graph executions; {len(use)} steps of {size} kernels; GPU span per step '
          f'{sum(spans) / len(spans):.1f} us (min {min(spans):.1f}, max {max(spans):.1f})')
    gaps = [(b[0][0] - max(k[1] for k in a)) / 1e3 for a, b in zip(use, use[1:])]
    if gaps:
        print(f'between steps (host work, graph launch): {sum(gaps) / len(gaps):.1f} us')
        between = collections.defaultdict(lambda: [0, 0.0])
        for a, b in zip(use, use[1:]):
            lo, hi = max(k[1] for k in a), b[0][0]
            for k in records:
                if k[2] == 0 and lo <= k[0] < hi:
                    between[kind(k[6])][0] += 1
                    between[kind(k[6])][1] += (k[1] - k[0]) / 1e3
        busy = sum(v[1] for v in between.values()) / len(gaps)
        for name, (n, t) in sorted(between.items(), key=lambda kv: -kv[1][1]):
            print(f'  {n / len(gaps):4.1f} x {t / n:6.1f} us  {name[:90]}')
        print(f'  GPU idle between steps: {sum(gaps) / len(gaps) - busy:.1f} us')
    cost = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for s in use:
        prev = s[0][0]
        for k in sorted(s, key=lambda k: k[1]):
            c = cost[kind(k[6])]
            c[0] += 1
            c[1] += (k[1] - prev) / 1e3
            c[2] += (k[1] - k[0]) / 1e3
            prev = max(prev, k[1])
    print(f'{"launches":>8} {"cost us":>8} {"busy us":>8}  kernel (per step)')
    for name, (n, c, busy) in sorted(cost.items(), key=lambda kv: -kv[1][1]):
        print(f'{n / len(use):8.1f} {c / len(use):8.1f} {busy / len(use):8.1f}  {name[:100]}')
    if args.list:
        s = sorted(use[-1], key=lambda k: k[1])
        t0 = prev = s[0][0]
        print(f'{"start":>8} {"end":>8} {"cost":>6}  grid      kernel (last step, us from its first start)')
        for k in s:
            print(f'{(k[0] - t0) / 1e3:8.1f} {(k[1] - t0) / 1e3:8.1f} {(k[1] - prev) / 1e3:6.1f}  '
                  f'{f"{k[3]}x{k[4]}":9} {kind(k[6])[:90]}')
            prev = max(prev, k[1])


if __name__ == '__main__':
    main()
