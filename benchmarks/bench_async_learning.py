"""Does asynchronous GRPO learn as robustly as synchronous GRPO on a preset's model, task, batch and loss? On CPU.

    python benchmarks/bench_async_learning.py [--preset gpu_two_devices_balanced] [--seeds 0-5] [--sync-steps 80]
        [--async-steps 120] [--settings preset,old] [--workers 2] [--out DIR]

The preset's model, task, batch shape, loss and learning rate, with the torch backends on CPU in this process
(float32, one torch thread per worker process), from the same seed in two modes:
- ``sync``:  ``in_order`` with no lookahead (L=0): synchronous GRPO;
- ``async``: ``weight_fifo`` W=1, stepped with one batch generated ahead: every step after the first trains on
  rollouts of the weights one version older (lag 1), as a two-GPU asynchronous run does for nearly every group.
Both are stepped by hand (``rollout_tick``/``tick``), so each (setting, seed, mode) is deterministic: what differs
between the modes is only the staleness, not timing. (Speed is not measured here: ``bench_two_gpus.py`` does that.)

Per seed it prints the sync run's final reward (mean of its last 5 steps, as ``bench_two_gpus.py`` takes it), the
step where the sync run's 5-step mean first reaches 0.6, the step where the async run's 5-step mean first reaches
the sync final (and that over the sync run's length), the lowest 5-step mean of the async run after that point, and
``collapsed`` when that minimum falls below half the sync final (the async run was pushed off what it had learned).

Settings: ``preset`` is the preset as it is; ``old`` the values the two-GPU presets had when asynchronous runs
collapsed on two H200s (lr 1e-3, tis at 2, entropy 0.03; ``OLD``); more as ``NAME:KEY=VALUE[;KEY=VALUE]`` (dotted
keys, YAML values), e.g. ``--settings 'lr3e-4:trainer.lr=3e-4;loss.entropy_coef=0.02'``.
Files under ``--out`` (default ``$OUT`` or ``runs/bench_async_learning``): ``results.json`` (the table) and
``curves.csv`` (every step's metrics of every run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pandas as pd
from record import meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.cli import parse_overrides  # noqa: E402
from asyncrl.config import merge_overrides  # noqa: E402

OLD = {"trainer": {"lr": 1.0e-3}, "loss": {"truncation": "tis", "is_cap": 2.0, "entropy_coef": 0.03}}
MODES = {"sync": {"name": "in_order", "max_lookahead_versions": 0},
         "async": {"name": "weight_fifo", "max_staleness_versions": 1}}


def cpu_overrides(preset: str) -> dict:
    """The preset's model, task, batch, loss and lr on the torch backends in this process: only the engines, their
    placement and dtype change (float32: the torch engine's weights and AdamW state would be bf16 too, unlike
    Megatron's fp32 master weights)."""
    from asyncrl import load_config

    cfg = load_config(preset)
    return {
        "eval_every": None, "torch_threads": 1, "model": {"dtype": "float32"},
        "generation": {"backend": "torch", "device": "cpu", "placement": "local", "ray_options": {},
                       "weight_sync": "driver", "max_new_tokens": cfg.generation.max_new_tokens,
                       "temperature": cfg.generation.temperature},
        "trainer": {"backend": "torch", "device": "cpu", "placement": "local", "ray_options": {},
                    "lr": cfg.trainer.lr, "grad_clip": cfg.trainer.grad_clip},
    }


def one_run(job: tuple) -> pd.DataFrame:
    preset, setting, overrides, seed, mode, steps = job
    from asyncrl import Controller, load_config

    cfg = load_config(preset, **merge_overrides(merge_overrides(cpu_overrides(preset), overrides), {"seed": seed, "sampler": MODES[mode]}))
    with Controller.from_config(cfg) as ctrl:
        if mode == "async":
            ctrl.rollout_tick()  # one batch ahead: from here on each step trains rollouts one version old
        while len(ctrl.metrics) < steps:
            ctrl.tick()
        m = ctrl.metrics.copy()
    if mode == "async" and not (m.lag_mean.iloc[1:] == 1).all():
        raise RuntimeError(f"{setting} seed {seed}: async steps were not all one version stale: {m.lag_mean.tolist()}")
    return m.assign(setting=setting, seed=seed, mode=mode)


def summarise(curves: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (setting, seed), runs in curves.groupby(["setting", "seed"], sort=False):
        s = runs[runs["mode"] == "sync"].reset_index(drop=True)
        a = runs[runs["mode"] == "async"].reset_index(drop=True)
        target = float(s.reward_mean.tail(5).mean())
        s5 = s.reward_mean.rolling(5).mean()
        a5 = a.reward_mean.rolling(5).mean()
        reached = a5.index[a5 >= target]
        reach = int(reached[0]) if len(reached) else None
        after = a5[reach:] if reach is not None else a5[a5.idxmax():]
        low = float(after.min())
        sync06 = s5.index[s5 >= 0.6]
        rows.append({
            "setting": setting, "seed": seed, "sync_final": round(target, 3),
            "sync_first_0.6": int(sync06[0]) if len(sync06) else None,
            "async_reaches_sync_final_at": reach,
            "async_steps_over_sync": round(reach / len(s), 2) if reach is not None else None,
            "async_min_after": round(low, 3), "async_peak": round(float(a5.max()), 3),
            "async_final": round(float(a.reward_mean.tail(5).mean()), 3),
            "collapsed": bool(low < 0.5 * target),
        })
    return pd.DataFrame(rows)


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = map(int, text.split("-"))
        return list(range(lo, hi + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpu_two_devices_balanced")
    parser.add_argument("--seeds", default="0-5", help="'0-5' or '0,3,7'")
    parser.add_argument("--sync-steps", type=int, default=80, help="as bench_two_gpus.py's timed sync runs")
    parser.add_argument("--async-steps", type=int, default=120)
    parser.add_argument("--settings", default="preset,old", help="comma-separated: preset, old, NAME:KEY=VALUE;...")
    parser.add_argument("--workers", type=int, default=2, help="runs at once (one process and torch thread each)")
    parser.add_argument("--out", default=None,
                        help="run directory (default benchmarks/data/bench_async_learning/<UTC time>)")
    parser.add_argument("--name", default=None, help="name of the run directory under benchmarks/data/bench_async_learning")
    args = parser.parse_args()
    before = meta("bench_async_learning")

    settings = {}
    for spec in args.settings.split(","):
        name, _, assignments = spec.partition(":")
        settings[name] = {"preset": {}, "old": OLD}.get(name, None) if not assignments else parse_overrides(filter(None, assignments.split(";")))
        if settings[name] is None:
            raise SystemExit(f"unknown setting {name!r}: 'preset', 'old' or NAME:KEY=VALUE[;KEY=VALUE]")
    seeds = parse_seeds(args.seeds)
    jobs = [(args.preset, name, ov, seed, mode, args.sync_steps if mode == "sync" else args.async_steps)
            for name, ov in settings.items() for seed in seeds for mode in MODES]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        curves = pd.concat(list(pool.map(one_run, jobs)), ignore_index=True)
    wall = time.perf_counter() - start

    table = summarise(curves)
    print(f"{args.preset} on CPU, stepped; sync {args.sync_steps} steps, async {args.async_steps} (lag 1); "
          f"{len(jobs)} runs in {wall:.0f} s")
    for name, ov in settings.items():
        print(f"  {name}: {json.dumps(ov) if ov else 'the preset as it is'}")
    print(table.to_string(index=False))
    print(table.groupby("setting", sort=False).agg(
        collapsed=("collapsed", "sum"), reached=("async_reaches_sync_final_at", "count"),
        median_async_steps_over_sync=("async_steps_over_sync", "median"), median_sync_final=("sync_final", "median"),
    ).to_string())

    where = save("bench_async_learning", table, {
        "preset": args.preset, "settings": settings, "seeds": seeds, "sync_steps": args.sync_steps,
        "async_steps": args.async_steps, "wall_s": wall}, before=before, out=args.out, name=args.name,
        files={"curves.csv": curves})
    print(f"raw data: {where}")


if __name__ == "__main__":
    main()
