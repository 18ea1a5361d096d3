"""Synchronous vs asynchronous GRPO on one preset, in one process, plus the controller's own overhead.

    python benchmarks/bench_async.py [--preset quickstart] [--steps 200] [--repeats 2]

Prints one table:
- ``sync``  — ``in_order`` with ``max_lookahead_versions=0`` (synchronous GRPO), driven by ``run``;
- ``async`` — ``weight_fifo`` with ``max_staleness_versions=1``, driven by ``run`` (generation overlaps training);
- ``stepped sync`` — the synchronous config driven tick by tick (no threads);
- ``overhead`` — simulated backends that do no work: what a tick of the controller itself costs.
Rows alternate sync/async ``--repeats`` times so machine noise hits both; the ratio is taken within one run.
"""

from __future__ import annotations

import argparse
import os
import time

import pandas as pd

from asyncrl import Controller, load_config

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
ASYNC = {"name": "weight_fifo", "max_staleness_versions": 1}


def timed_run(preset: str, sampler: dict, steps: int, stepped: bool = False, **overrides) -> dict:
    cfg = load_config(preset, sampler=sampler, eval_every=None, **overrides)
    ctrl = Controller.from_config(cfg)
    ctrl.run(3, progress=False)  # warm-up: first forward passes, allocator
    start = time.perf_counter()
    if stepped:
        target = ctrl.trainer_version + steps
        while ctrl.trainer_version < target:
            ctrl.tick()
    else:
        ctrl.run(steps, progress=False)
    elapsed = time.perf_counter() - start
    m = ctrl.metrics.iloc[3:]
    return {
        "steps": steps,
        "seconds": elapsed,
        "steps_per_s": steps / elapsed,
        "ms_per_step": 1e3 * elapsed / steps,
        "tokens_per_s": m.tokens_per_s.median() if "tokens_per_s" in m else float("nan"),
        "lag_mean": m.lag_mean.mean(),
        "reward_last": m.reward_mean.tail(20).mean(),
    }


def overhead(ticks: int = 2000) -> dict:
    """Per-tick cost of the controller with backends that do nothing (simulated, zero latency)."""
    cfg = load_config("quickstart", sampler=ASYNC, eval_every=None, torch_threads=1,
                      generation={"backend": "simulated"},
                      trainer={"backend": "simulated"})
    ctrl = Controller.from_config(cfg)
    for _ in range(50):
        ctrl.tick()
    start = time.perf_counter()
    for _ in range(ticks):
        ctrl.rollout_tick()
        ctrl.train_tick()
    per_tick = (time.perf_counter() - start) / (2 * ticks)
    groups = cfg.groups_per_step
    return {"ticks": 2 * ticks, "us_per_tick": per_tick * 1e6, "groups_per_tick": groups}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quickstart")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=4, help="TRL's reference point used 4")
    parser.add_argument("--threads", default="1,2", help="torch intra-op thread counts to compare")
    args = parser.parse_args()
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        work = {"generation": {"max_new_tokens": args.max_new_tokens}, "torch_threads": threads}
        for r in range(args.repeats):
            for mode, sampler in (("sync (in_order L=0, run)", SYNC), ("async (weight_fifo W=1, run)", ASYNC)):
                rows.append({"mode": mode, "threads": threads, "repeat": r,
                             **timed_run(args.preset, sampler, args.steps, **work)})
        rows.append({"mode": "sync (in_order L=0, stepped)", "threads": threads, "repeat": 0,
                     **timed_run(args.preset, SYNC, args.steps, stepped=True, **work)})
    table = pd.DataFrame(rows)
    pd.set_option("display.width", 160)
    print(f"preset={args.preset} steps={args.steps} max_new_tokens={args.max_new_tokens} cpus={os.cpu_count()}")
    print(table.round(4).to_string(index=False))
    best = table.groupby(["threads", "mode"]).steps_per_s.max().unstack("mode")
    best["async/sync"] = best["async (weight_fifo W=1, run)"] / best["sync (in_order L=0, run)"]
    print(f"\nbest of {args.repeats} steps/s per thread count, and the async/sync ratio within it:")
    print(best.round(2).to_string())
    o = overhead()
    print(f"controller overhead, simulated backends doing no work: {o['us_per_tick']:.0f} µs per tick "
          f"({o['groups_per_tick']} groups per batch, {o['ticks']} ticks)")


if __name__ == "__main__":
    main()
