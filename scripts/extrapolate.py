#!/usr/bin/env python3
"""Extrapolates dsv4-cuda-bench runs of two synthetic files (4 and 8 layers of the real shapes) to the real model.

    scripts/extrapolate.py SMALL.txt LARGE.txt [--small 4] [--large 8] [--layers 43]

Each file holds the output of `dsv4-cuda-bench flashL.gguf --depth D,... --decode N` (other lines are skipped, a
tag before "depth" is allowed). For every depth both files measured, time = fixed + layers × per layer, with
per layer = (large − small) / (large layers − small layers), for the decode step and for the prefill of that
depth (its time taken as depth / rate: the rate has more digits than the printed seconds); the decode's share of
the weight roofline uses the real model's bytes a token (--gb, 9.546 GB for the q2
mix) over the measured copy bandwidth (--tbps, 4.3 TB/s on an H200). This is the rule docs/performance.md states;
the script only saves the arithmetic.
"""
import argparse
import re
import sys

LINE = re.compile(r"depth\s+(\d+): prefill\s+([\d.]+) tok/s \(([\d.]+) s,.*\| decode ([\d.]+) ms/token")


def parse(path):
    runs = {}
    with open(path) as f:
        for line in f:
            m = LINE.search(line)
            if m:
                # The prefill's seconds from its rate (printed to 5 digits; the seconds have 2 decimals).
                depth, rate = int(m.group(1)), float(m.group(2))
                seconds = max(depth, 1) / rate if rate > 0 else float(m.group(3))
                runs.setdefault(depth, []).append((seconds, float(m.group(4))))
    if not runs:
        sys.exit(f"{path}: no dsv4-cuda-bench 'depth ...: prefill ... | decode ... ms/token' line")
    # Repeated runs of a depth: their mean.
    return {d: tuple(sum(v) / len(v) for v in zip(*rs)) for d, rs in runs.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("small")
    p.add_argument("large")
    p.add_argument("--small-layers", "--small", type=int, default=4, dest="small_layers")
    p.add_argument("--large-layers", "--large", type=int, default=8, dest="large_layers")
    p.add_argument("--layers", type=int, default=43, help="layers of the real model")
    p.add_argument("--gb", type=float, default=9.546, help="GB of weights the real model reads a decoded token")
    p.add_argument("--tbps", type=float, default=4.3, help="memory bandwidth, TB/s")
    a = p.parse_args()
    if a.large_layers <= a.small_layers:
        sys.exit("--large must exceed --small")
    small, large = parse(a.small), parse(a.large)
    depths = sorted(set(small) & set(large))
    if not depths:
        sys.exit("the two files share no depth")
    roofline_ms = a.gb / a.tbps
    span = a.large_layers - a.small_layers
    print(f"{'depth':>8}  {'decode/layer':>12}  {'fixed':>8}  {f'{a.layers} layers':>10}  {'tok/s':>7}  {'roofline':>8}"
          f"  {'prefill/layer':>13}  {f'prefill {a.layers}':>11}  {'tok/s':>7}")
    for d in depths:
        (ps, ds), (pl, dl) = small[d], large[d]
        per = (dl - ds) / span
        fixed = ds - a.small_layers * per
        total = fixed + a.layers * per
        pper = (pl - ps) / span
        ptotal = ps + (a.layers - a.small_layers) * pper
        print(f"{d:>8}  {per * 1000:>9.1f} us  {fixed * 1000:>5.0f} us  {total:>7.2f} ms  {1000 / total:>7.1f}"
              f"  {100 * roofline_ms / total:>7.1f}%  {pper:>11.3f} s  {ptotal:>9.2f} s  {d / ptotal:>7.0f}")


if __name__ == "__main__":
    main()
