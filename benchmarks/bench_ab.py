"""Two commands as whole processes, in turn (A B A B ...), for a ratio that holds while the machine's speed drifts.

    python benchmarks/bench_ab.py --name NAME -n 6 --a 'CMD A' --b 'CMD B'

One warm-up run of each, then ``-n`` pairs, alternating which goes first. Each run's wall seconds and its CPU
seconds (user + sys of the child, from ``resource.getrusage``) go to ``rows.csv``; ``meta.json`` records the
medians and the median of the per-pair ratios A/B (the figure to quote), with the command, machine and commit
(``benchmarks/record.py``). A command that exits non-zero stops the bench: a ratio of a failed run means nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time

from record import meta, save


def timed(cmd: str) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(shlex.split(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"command failed with exit code {done.returncode}: {cmd}\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="command A (split as a shell splits words; no shell)")
    parser.add_argument("--b", required=True, help="command B")
    parser.add_argument("-n", type=int, default=6, help="pairs counted (default 6)")
    parser.add_argument("--name", default=None, help="run directory name under benchmarks/data/bench_ab")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.n < 1:
        parser.error(f"-n must be at least 1, got {args.n}")
    before = meta("bench_ab")
    print(f"load before: {os.getloadavg()[0]:.2f}; warm-up")
    timed(args.a), timed(args.b)
    rows = []
    for pair in range(args.n):
        order = ("a", "b") if pair % 2 == 0 else ("b", "a")
        got = {}
        for side in order:
            got[side] = timed(getattr(args, side))
            rows.append({"pair": pair, "side": side, "first": side == order[0], "wall_s": got[side][0],
                         "cpu_s": got[side][1]})
        print(f"pair {pair}: A {got['a'][0]:.2f} s, B {got['b'][0]:.2f} s, A/B {got['a'][0] / got['b'][0]:.3f}")
    ratios = [rows[i]["wall_s"] / rows[i + 1]["wall_s"] if rows[i]["side"] == "a"
              else rows[i + 1]["wall_s"] / rows[i]["wall_s"] for i in range(0, len(rows), 2)]
    cpu_ratios = [rows[i]["cpu_s"] / rows[i + 1]["cpu_s"] if rows[i]["side"] == "a"
                  else rows[i + 1]["cpu_s"] / rows[i]["cpu_s"] for i in range(0, len(rows), 2)]
    results = {"a": args.a, "b": args.b, "pairs": args.n,
               "a_wall_median_s": statistics.median(r["wall_s"] for r in rows if r["side"] == "a"),
               "b_wall_median_s": statistics.median(r["wall_s"] for r in rows if r["side"] == "b"),
               "wall_ratio_median": statistics.median(ratios), "wall_ratio_min": min(ratios),
               "wall_ratio_max": max(ratios), "cpu_ratio_median": statistics.median(cpu_ratios),
               "load_after": round(os.getloadavg()[0], 2)}
    print(f"A/B wall: median {results['wall_ratio_median']:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"cpu {results['cpu_ratio_median']:.3f}")
    print(f"raw data: {save('bench_ab', rows, results, before=before, out=args.out, name=args.name)}")


if __name__ == "__main__":
    main()
