#!/usr/bin/env python3
"""Per-kernel costs of the decode steps in a libdsv4_ktrace.so timeline (docs/cuda.md).

Usage: ktrace_summary.py TIMELINE [--steps N] [--largest] [--list] [--pm PMFILE]
       ktrace_summary.py TIMELINE --totals [--top N]

A step is one execution of the decode graph: the kernels of one graph id until a graph node repeats. The steps of
the most common size are used (the last N of them; --largest: those of the most kernels, a batch's among 1-token
steps). Each kernel's cost is how much later it ends than the kernel that ended before it: in a chain of dependent
kernels with programmatic dependent launch, blocks start early and wait, so durations overlap and only the ends add
up to the step. Between two steps, what the GPU ran outside the
graph (the sampler's kernels, the token's copies) is listed with its mean time; the rest of the gap the GPU waited
for the host. --list prints the last step kernel by kernel. --totals sums every kernel and copy of the timeline by
kind instead, for runs that are not decode steps (a long prefill: its chunks run eagerly, one kernel after another,
so the durations add up to the GPU's time).

--pm reads the library's PM samples ($DSV4_PMSAMPLE: DRAM bytes read per interval, on the kernels' clock) and adds,
over the steps inside the sampled window, each kind's DRAM megabytes read during its costs, the step's mean rate and
how much of the step DRAM ran below a quarter of PEAK (--peak, TB/s, default 4.3: the H200's copy rate); --list then
shows each kernel's bytes and rate over its cost.
"""
import argparse
import bisect
import collections
import re


def read(path):
    kernels = []
    with open(path) as f:
        for line in f:
            start, end, graph, gx, gy, node, name = line.rstrip('\n').split(' ', 6)
            kernels.append((int(start), int(end), int(graph), int(gx), int(gy), int(node), name))
    return sorted(kernels)


class Dram:
    """DRAM bytes read between two timestamps, from the PM samples (each interval's bytes spread evenly over it)."""

    def __init__(self, path):
        self.samples = []
        with open(path) as f:
            for line in f:
                if not line.startswith('#'):
                    start, end, value = line.split()[:3]
                    if int(end) > int(start):
                        self.samples.append((int(start), int(end), float(value)))
        self.samples.sort()
        self.starts = [s[0] for s in self.samples]
        # The first sample runs from the sampler's setup, not from the window's start: it is left out.
        self.lo = self.samples[1][0] if len(self.samples) > 1 else 0
        self.hi = self.samples[-1][1] if self.samples else 0

    def covers(self, t0, t1):
        return self.lo <= t0 and t1 <= self.hi

    def overlaps(self, t0, t1):
        """(nanoseconds of [t0, t1) inside the sample, the sample's bytes per nanosecond) for each sample it meets."""
        i = max(0, bisect.bisect_right(self.starts, t0) - 1)
        while i < len(self.samples) and self.samples[i][0] < t1:
            a, b, v = self.samples[i]
            overlap = min(b, t1) - max(a, t0)
            if overlap > 0:
                yield overlap, v / (b - a)
            i += 1

    def bytes(self, t0, t1):
        return sum(overlap * rate for overlap, rate in self.overlaps(t0, t1))

    def time_below(self, t0, t1, rate):
        """Nanoseconds of [t0, t1) whose samples read below `rate` bytes per nanosecond."""
        return sum(overlap for overlap, r in self.overlaps(t0, t1) if r < rate)


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
    ap.add_argument('--largest', action='store_true',
                    help='the steps of the most kernels instead of the most common size (a batch among 1-token steps)')
    ap.add_argument('--totals', action='store_true', help='every kernel and copy summed by kind (prefill runs)')
    ap.add_argument('--top', type=int, default=20, help='kinds printed with --totals (default 20)')
    ap.add_argument('--pm', help="the library's PM samples (DSV4_PMSAMPLE)")
    ap.add_argument('--peak', type=float, default=4.3, help='DRAM rate taken as the peak, TB/s (default 4.3)')
    args = ap.parse_args()
    dram = Dram(args.pm) if args.pm else None
    records = read(args.timeline)
    if args.totals:
        totals(records, args.top)
        return
    steps = steps_of(records)
    if not steps:
        raise SystemExit(f'{args.timeline}: no graph kernels (was the program run with LD_PRELOAD?)')
    sizes = collections.Counter(len(s) for s in steps)
    size = max(sizes) if args.largest else sizes.most_common(1)[0][0]
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
    sampled = []
    if dram:
        sampled = [s for s in use if dram.covers(s[0][0], max(k[1] for k in s))]
        if not sampled:
            raise SystemExit(f'{args.pm}: no step of the timeline lies inside the sampled window')
        bounds = [(s[0][0], max(k[1] for k in s)) for s in sampled]
        per_step = [dram.bytes(t0, t1) for t0, t1 in bounds]
        span = sum(t1 - t0 for t0, t1 in bounds)
        low = sum(dram.time_below(t0, t1, args.peak * 1e3 / 4) for t0, t1 in bounds)
        print(f'DRAM over {len(sampled)} sampled steps: {sum(per_step) / len(per_step) / 1e9:.3f} GB read a step, '
              f'{sum(per_step) / span / 1e3:.2f} TB/s on average, below {args.peak / 4:.2f} TB/s for '
              f'{100 * low / span:.0f} % of the time')
    cost = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for s in use:
        prev = s[0][0]
        for k in sorted(s, key=lambda k: k[1]):
            c = cost[kind(k[6])]
            c[0] += 1
            c[1] += (k[1] - prev) / 1e3
            c[2] += (k[1] - k[0]) / 1e3
            if s in sampled:
                c[3] += dram.bytes(prev, k[1]) / 1e6
            prev = max(prev, k[1])
    dram_head = f' {"DRAM MB":>8}' if dram else ''
    print(f'{"launches":>8} {"cost us":>8} {"busy us":>8}{dram_head}  kernel (per step)')
    for name, (n, c, busy, mb) in sorted(cost.items(), key=lambda kv: -kv[1][1]):
        dram_col = f' {mb / len(sampled):8.1f}' if dram else ''
        print(f'{n / len(use):8.1f} {c / len(use):8.1f} {busy / len(use):8.1f}{dram_col}  {name[:100]}')
    if args.list:
        last = sampled[-1] if dram else use[-1]
        s = sorted(last, key=lambda k: k[1])
        t0 = prev = s[0][0]
        dram_head = f' {"MB":>6} {"TB/s":>5}' if dram else ''
        print(f'{"start":>8} {"end":>8} {"cost":>6}{dram_head}  grid      kernel (last step, us from its first start)')
        for k in s:
            dram_col = ''
            if dram:
                b = dram.bytes(prev, k[1])
                dram_col = f' {b / 1e6:6.1f} {b / max(k[1] - prev, 1) / 1e3:5.2f}'
            print(f'{(k[0] - t0) / 1e3:8.1f} {(k[1] - t0) / 1e3:8.1f} {(k[1] - prev) / 1e3:6.1f}{dram_col}  '
                  f'{f"{k[3]}x{k[4]}":9} {kind(k[6])[:90]}')
            prev = max(prev, k[1])


if __name__ == '__main__':
    main()
