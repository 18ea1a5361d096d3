"""Time one sampler decision (``evict`` + ``select``) at 1k, 10k and 100k buffered groups, for every policy.

A decision must cost O(selected + evicted), not O(buffer): the target is <= 3x the 1k cost at 100k, and under
100 us per call at 100k.

The steady state (built fresh every round, untimed), with trainer version ``T = 10`` and window 1:

- version 8 (too stale, ``w < lo = 9``): pending stragglers (5% of the buffer); in ``in_order`` they are stamped
  for step 9, which has passed;
- version 9: ready groups (45%) — the window's oldest version, stamped for step 10 in ``in_order``;
- version 10: the newest version (50%), a fifth of it still pending, stamped for step 11 in ``in_order``.

Each timed call is one train tick's decision: ``evict(T)`` then ``select(T, N, N)``. Between calls (untimed)
the refill keeps the buffer at its stated size and the state steady: ``E`` stale stragglers commit (so the next
``evict`` drops ``E`` groups), ``N + E`` new groups are reserved at version 10, and ``N + E`` pending groups of
version 10 commit in random order (out of dispatch order, as real rollouts finish).

Run: ``python benchmarks/bench_sampler.py`` (``--quick`` for a smoke run). Prints a pandas table: median us per
call at each size and the ratio 100k/1k. ``--baseline OLD_BUFFER.py`` times another ``ReplayBuffer`` (say
``git show REV:asyncrl/buffer.py > /tmp/old_buffer.py``) against this one in the same run, alternating which goes
first in each of ``--rounds`` rounds, so that a loaded machine slows both alike.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import random
import statistics
import sys
import time

import pandas as pd
from record import meta, save

from asyncrl.buffer import ReplayBuffer
from asyncrl.samplers import build_sampler

T = 10
EVICT_PER_CALL = 2
POLICIES = {
    "windowed": {"name": "windowed"},
    "windowed freshest_first": {"name": "windowed", "freshest_first": True},
    "weight_fifo": {"name": "weight_fifo"},
    "in_order": {"name": "in_order"},
    "ready_first": {"name": "ready_first"},
}


class SteadyState:
    """A buffer of ``size`` groups in the layout above, plus the untimed refill that keeps it there."""

    def __init__(self, policy: dict, size: int, groups_per_step: int, calls: int, rng: random.Random,
                 buffer_cls: type = ReplayBuffer):
        self.rng, self.N = rng, groups_per_step
        self.stamps = policy["name"] == "in_order"
        self.buffer = buffer_cls()
        self.sampler = build_sampler(policy, self.buffer)
        n_stale = max(size // 20, EVICT_PER_CALL * calls)
        n_old = (size - n_stale) * 45 // 95
        n_new = size - n_stale - n_old
        self.stale = [self._reserve(8, T - 1) for _ in range(n_stale)]
        for gid in [self._reserve(9, T) for _ in range(n_old)]:
            self.buffer.commit(gid, None)
        new = [self._reserve(10, T + 1) for _ in range(n_new)]
        rng.shuffle(new)
        cut = n_new // 5
        self.pending, ready = new[:cut], new[cut:]
        for gid in ready:
            self.buffer.commit(gid, None)
        assert len(self.buffer) == size

    def _reserve(self, version: int, target: int) -> int:
        return self.buffer.reserve(version, target if self.stamps else None)

    def prepare(self) -> None:
        """Stale stragglers come back (the next evict drops them)."""
        for _ in range(EVICT_PER_CALL):
            self.buffer.commit(self.stale.pop(), None)

    def refill(self, removed: int) -> None:
        """Back to the stated size: reserve ``removed`` new groups, commit as many pending ones in random order."""
        for _ in range(removed):
            self.pending.append(self._reserve(10, T + 1))
        for _ in range(removed - EVICT_PER_CALL):  # the prepared stragglers were pending too
            i = self.rng.randrange(len(self.pending))
            self.pending[i], self.pending[-1] = self.pending[-1], self.pending[i]
            self.buffer.commit(self.pending.pop(), None)

    def call(self) -> tuple[int, int, int]:
        """One timed decision: evict then select. Returns (ns, evicted, selected)."""
        sampler = self.sampler
        t0 = time.perf_counter_ns()
        evicted = sampler.evict(T)
        chunk = sampler.select(T, self.N, self.N)
        dt = time.perf_counter_ns() - t0
        return dt, len(evicted), len(chunk or ())


def time_policy(policy: dict, size: int, groups_per_step: int, samples: int, seed: int = 0,
                buffer_cls: type = ReplayBuffer) -> list[int]:
    """ns per evict+select call for ``samples`` calls, in rounds on fresh steady states."""
    rng = random.Random(seed)
    # A round may not drain version 9's ready groups (weight_fifo's and in_order's candidates for step T).
    per_round = max(1, min(50, (size * 45 // 100) // (groups_per_step + EVICT_PER_CALL) - 1))
    times: list[int] = []
    while len(times) < samples:
        state = SteadyState(policy, size, groups_per_step, per_round, rng, buffer_cls)
        gc.collect()
        for _ in range(min(per_round, samples - len(times))):
            state.prepare()
            dt, n_evicted, n_selected = state.call()
            if n_selected != groups_per_step:
                raise AssertionError(f"{policy}: selected {n_selected} != {groups_per_step} at size {size}")
            expect_evicted = 0 if policy["name"] == "ready_first" else EVICT_PER_CALL
            if n_evicted != expect_evicted:
                raise AssertionError(f"{policy}: evicted {n_evicted} != {expect_evicted} at size {size}")
            state.refill(n_evicted + n_selected)
            assert len(state.buffer) == size
            times.append(dt)
    return times


def load_buffer(path: str) -> type:
    """``ReplayBuffer`` from a buffer.py file elsewhere (another revision of this one)."""
    spec = importlib.util.spec_from_file_location("baseline_buffer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.ReplayBuffer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--groups-per-step", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--samples", type=int, default=300, help="timed calls per (policy, N, size)")
    parser.add_argument("--quick", action="store_true", help="few samples, for a smoke run")
    parser.add_argument("--baseline", metavar="BUFFER_PY", help="also time the ReplayBuffer of this buffer.py file")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: alternating rounds per cell")
    parser.add_argument("--out", default=None, help="run directory (default benchmarks/data/bench_sampler/<UTC>)")
    parser.add_argument("--name", default=None, help="name of the run directory under benchmarks/data/bench_sampler")
    args = parser.parse_args()
    before = meta("bench_sampler")
    samples = 20 if args.quick else args.samples
    buffers = {"this": ReplayBuffer}
    if args.baseline:
        buffers["baseline"] = load_buffer(args.baseline)
    rounds = args.rounds if args.baseline else 1
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}, {samples} calls per cell, median us per evict+select call")
    rows = []
    for label, policy in POLICIES.items():
        for n in args.groups_per_step:
            cells = {(name, size): [] for name in buffers for size in args.sizes}
            for r in range(rounds):
                names = list(buffers) if r % 2 == 0 else list(buffers)[::-1]  # who goes first alternates
                for size in args.sizes:
                    for name in names:
                        cells[name, size] += time_policy(policy, size, n, -(-samples // rounds), seed=r,
                                                         buffer_cls=buffers[name])
            for name in buffers:
                row = {"policy": label, "N": n, "buffer": name}
                for size in args.sizes:
                    row[f"{size // 1000}k us"] = statistics.median(cells[name, size]) / 1e3
                first, last = args.sizes[0], args.sizes[-1]
                row[f"{last // 1000}k/{first // 1000}k"] = row[f"{last // 1000}k us"] / row[f"{first // 1000}k us"]
                rows.append(row)
                timings = "  ".join(f"{k}={v:.1f}" for k, v in row.items() if "us" in k)
                print(f"  {label:<24} N={n:<3} {name:<8} {timings}", flush=True)
    table = pd.DataFrame(rows).set_index(["policy", "N", "buffer"])
    if not args.baseline:
        table = table.droplevel("buffer")
    with pd.option_context("display.float_format", "{:.1f}".format, "display.width", 120):
        print()
        print(table.to_string())
    results = {"samples": samples, "rounds": rounds, "baseline": args.baseline}
    for name in buffers:
        part = table.xs(name, level="buffer") if args.baseline else table
        results[name] = {"worst_ratio": float(part.iloc[:, -1].max()), "largest": args.sizes[-1],
                         "worst_at_largest_us": float(part.iloc[:, -2].max())}
        print(f"{name}: worst ratio {part.iloc[:, -1].max():.2f} (target <= 3), worst at {args.sizes[-1]:,}: "
              f"{part.iloc[:, -2].max():.1f} us (target < 100)")
    where = save("bench_sampler", pd.DataFrame(rows), results, before=before, out=args.out, name=args.name)
    print(f"raw data: {where}")


if __name__ == "__main__":
    main()
