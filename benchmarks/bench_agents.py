"""Multi-turn on CPU: what asynchrony hides of an environment's wait, and how well the what-if tools predict it.

    python benchmarks/bench_agents.py [--steps 20] [--repeats 3] [--workers 4]

``guess_letter`` (the quickstart-sized model, raw text observations) with ``SlowGuessLetter`` (benchmarks/
slow_env.py): every environment call sleeps a seeded pareto draw, median 20 ms, clipped at 500 ms. Small groups
(``--groups`` x ``--group-size``) keep the run short. Modes, alternating ``--repeats`` times (the order flips each
repeat) so the machine's noise hits both: ``sync`` (``in_order`` L=0) and ``async`` (``weight_fifo`` W=1), each an
``asyncrl run`` in this process with ``environment.workers`` processes. Per run: steps/s over the steps after
``WARMUP`` (the sum of their ``step_time_s``: the workers' start-up and the first steps' compilation left out), the
mean lag of what trained, mean turns and environment calls per step.

Then the same run on the simulated clock, two ways, against the real numbers (the median repeat of each mode):
- ``simulate``: the simulated backends with the ``turns`` model calibrated to the real run: ``max_turns``, the
  environment's own latency shape (``slow_env.LATENCY``: pareto, alpha 1.5) scaled so a call's mean is what a call
  cost the real sync run (the sleep plus the worker's round trip and the pump's share), ``mean_turns`` and
  observation tokens as that run played them; decoding and training rates fitted from it
  (``asyncrl.replay.latency.fit``, which separates decoding from the environment's seconds by least squares);
- ``replay``: ``Recording(sync run).replay(sampler)``: the real sync run's own trajectories (turns, lengths,
  rewards) served to each sampler, the environment's seconds from the fit.

Writes benchmarks/data/bench_agents/<name>/ (rows.csv: one row per real run; predicted.csv: the table; meta.json)
and prints the table.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from record import meta, save  # noqa: E402
from slow_env import LATENCY  # noqa: E402

import asyncrl  # noqa: E402
from asyncrl import Controller, cli  # noqa: E402
from asyncrl.backends.simulated import draw_env_seconds  # noqa: E402
from asyncrl.config import SimulatedTurns  # noqa: E402
from asyncrl.replay.latency import fit  # noqa: E402
from asyncrl.replay.recorded import read  # noqa: E402
from asyncrl.replay.replayed import _config  # noqa: E402
from asyncrl.simulate import Simulation  # noqa: E402

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
ASYNC = {"name": "weight_fifo", "max_staleness_versions": 1}
MODES = {"sync": SYNC, "async": ASYNC}
WARMUP = 3


def run(out: Path, sampler: dict, args) -> dict:
    """One real run (``asyncrl run guess_letter``) and what it measured."""
    sets = [f"sampler={sampler}", "eval_every=null", "torch_threads=1", f"groups_per_step={args.groups}",
            f"group_size={args.group_size}", "environment.factory=slow_env:SlowGuessLetter",
            f"environment.workers={args.workers}", "environment.timeout_s=10", f"seed={args.seed}"]
    start = time.perf_counter()
    assert cli.main(["run", "guess_letter", "--steps", str(args.steps), "--out", str(out), "--quiet", "--no-plot",
                     *[x for s in sets for x in ("--set", s)]]) == 0
    wall = time.perf_counter() - start
    return {**measure(asyncrl.Recording(out).metrics, asyncrl.Recording(out).trace), "wall_s": wall,
            **played(pd.read_json(out / "completions.jsonl", lines=True), args.steps)}


def measure(metrics: pd.DataFrame, trace: pd.DataFrame) -> dict:
    """Steps/s after the warm-up (simulated seconds where the metrics have them) and the mean lag trained."""
    m = metrics.iloc[WARMUP:]
    seconds = float(m.step_time_s.sum())
    select = trace[trace.event == "select"]
    select = select[select.trainer_version >= WARMUP]
    return {"steps_per_s": len(m) / seconds if seconds > 0 else math.nan, "step_ms": 1e3 * seconds / len(m),
            "lag_mean": float(select.lag.astype(float).mean()), "train_ms": 1e3 * float(m.train_time_s.mean())}


def played(completions: pd.DataFrame, steps: int) -> dict:
    turns = completions.turns.astype(float)
    return {"turns_mean": float(turns.mean()), "env_calls_per_step": float(turns.sum()) / steps,
            "env_tokens_per_obs": float(completions.env_tokens.sum() / max(1.0, (turns - 1).sum()))}


def call_mean(draws: int = 100_000) -> float:
    """The mean seconds of one ``SlowGuessLetter`` sleep (a pareto clipped at its cap has no closed form here)."""
    import random

    rng, model = random.Random(0), SimulatedTurns(**LATENCY)
    return statistics.fmean(draw_env_seconds(model, rng) for _ in range(draws))


def simulate(recorded, real: dict, sampler: dict, steps: int) -> dict:
    """The calibrated what-if run (module docstring) under ``sampler``."""
    generation, training, found = fit(recorded)
    latency = dict(LATENCY)
    if found.get("env_call_s"):  # the environment's tail shape, scaled so a call costs what it cost the real run
        latency.update(env_latency_s=LATENCY["env_latency_s"] * found["env_call_s"] / call_mean(),
                       env_latency_max_s=LATENCY["env_latency_max_s"] * found["env_call_s"] / call_mean())
    generation["turns"] = {"max_turns": recorded.cfg.environment.max_turns, **latency,
                           "mean_turns": real["turns_mean"], "env_tokens": round(real["env_tokens_per_obs"]),
                           "workers": recorded.cfg.environment.workers}  # free turns under the async sampler
    cfg = _config(recorded.cfg, sampler, generation, training)
    ctrl = Controller.from_config(cfg)
    sim = Simulation(ctrl)
    sim.run(steps)
    return measure(sim.metrics, sim.trace)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name")
    p.add_argument("--out")
    args = p.parse_args()
    before = meta("bench_agents")
    rows, dirs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                out = Path(tmp) / f"{mode}-{r}"
                row = {"mode": mode, "repeat": r, **run(out, MODES[mode], args)}
                rows.append(row)
                dirs[mode, r] = out
                print(f"  {mode:5s} repeat {r}: {row['steps_per_s']:.3f} steps/s, lag {row['lag_mean']:.2f}",
                      file=sys.stderr)
        runs = pd.DataFrame(rows)
        median = {}
        for mode in MODES:
            mine = runs[runs["mode"] == mode]
            k = mine.steps_per_s.sub(mine.steps_per_s.median()).abs().idxmin()
            median[mode] = runs.loc[k]
        sync_dir = dirs["sync", int(median["sync"]["repeat"])]
        recording = asyncrl.Recording(sync_dir)
        recorded = read(recording)
        table = []
        for mode, sampler in MODES.items():
            real = median[mode]
            sim = simulate(recorded, median["sync"].to_dict(), sampler, args.steps)
            rep = measure(*(lambda x: (x.metrics, x.trace))(recording.replay(sampler=sampler)))
            for source, got in (("real", real), ("simulate", sim), ("replay", rep)):
                table.append({"mode": mode, "source": source, "steps_per_s": got["steps_per_s"],
                              "step_ms": got["step_ms"], "lag_mean": got["lag_mean"]})
        fitted = fit(recorded)
    table = pd.DataFrame(table)
    speed = {s: table[(table["source"] == s) & (table["mode"] == "async")].steps_per_s.iloc[0]
             / table[(table["source"] == s) & (table["mode"] == "sync")].steps_per_s.iloc[0]
             for s in ("real", "simulate", "replay")}
    table["speedup"] = [speed[s] if m == "async" else 1.0 for m, s in zip(table["mode"], table["source"])]
    results = {"speedup_real": speed["real"], "speedup_simulate": speed["simulate"], "speedup_replay": speed["replay"],
               "speedup_repeats": [float(a / s) for a, s in zip(runs[runs["mode"] == "async"].steps_per_s,
                                                                runs[runs["mode"] == "sync"].steps_per_s)],
               "sync_step_ms_median": float(median["sync"].step_ms), "train_ms_median": float(median["sync"].train_ms),
               "turns_mean": float(median["sync"].turns_mean),
               "env_calls_per_step": float(median["sync"].env_calls_per_step),
               "fit": fitted[2], "fit_generation": fitted[0], "latency": LATENCY,
               "settings": {"steps": args.steps, "repeats": args.repeats, "groups": args.groups,
                            "group_size": args.group_size, "workers": args.workers, "seed": args.seed,
                            "warmup": WARMUP}}
    where = save("bench_agents", runs, results, before=before, out=args.out, name=args.name,
                 files={"predicted.csv": table})
    with pd.option_context("display.width", 200):
        print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print(f"async/sync: real {speed['real']:.2f}x, simulate {speed['simulate']:.2f}x, replay {speed['replay']:.2f}x "
          f"(repeats {', '.join(f'{x:.2f}' for x in results['speedup_repeats'])}); data in {where}")


if __name__ == "__main__":
    main()
