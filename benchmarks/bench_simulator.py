"""The what-if simulator: its numbers, its speed, its determinism, and one calibrated prediction checked for real.

    python benchmarks/bench_simulator.py [--steps 1000] [--real-steps 150] [--skip-real]

Prints four tables:
1. ``equal stages`` — the ``what_if`` preset (mean generation time per batch = training + sync time per step):
   steps per simulated hour for sync (``in_order`` L=0) and async (``weight_fifo`` W=1), their ratio (the limit is
   2), and the wall time of each ``--steps``-step simulation.
2. ``long tail`` — the same preset with Pareto completion lengths (alpha 1.5, mean 24 tokens, clipped at 128) and
   16 groups decoding at once: what each sampler gains over sync, its lag, and what it drops.
3. ``determinism`` — two simulations with one seed: sha256 of every file they write.
4. ``calibration`` — a real synchronous run of the CPU ``quickstart`` preset (4 new tokens, one torch thread per
   pump, as ``bench_async.py``), the latency model fitted to its metrics, the async/sync ratio the simulator
   predicts from that fit, and the real asynchronous run's ratio, measured right after (target: within 15%).
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import pandas as pd

from asyncrl import Controller, load_config
from asyncrl.simulate import ASYNC, SYNC, calibrate, simulate

LONG_TAIL = {"generation": {"lengths": "pareto", "pareto_alpha": 1.5, "length_mean": 24.0, "concurrency": 16}}
SAMPLERS = [SYNC, {"name": "in_order", "max_lookahead_versions": 1}, ASYNC,
            {"name": "weight_fifo", "max_staleness_versions": 2}, {"name": "windowed", "max_staleness_versions": 1},
            {"name": "ready_first", "max_staleness_versions": 1}]


def label(sampler: dict) -> str:
    knob = "L" if sampler["name"] == "in_order" else "W"
    return f"{sampler['name']} {knob}={next(v for k, v in sampler.items() if k != 'name')}"


def equal_stages(steps: int) -> pd.DataFrame:
    rows = []
    for sampler in (SYNC, ASYNC):
        start = time.perf_counter()
        s = simulate("what_if", steps, sampler=sampler).summary()
        rows.append({"sampler": label(sampler), "steps": steps, "steps_per_sim_hour": s["sim_steps_per_hour"],
                     "gen_s_per_step": s["gen_busy_s_per_step"], "train_s_per_step": s["train_busy_s_per_step"],
                     "gen_idle": s["gen_idle_frac"], "train_idle": s["train_idle_frac"], "lag_mean": s["lag_mean"],
                     "wall_s": time.perf_counter() - start})
    table = pd.DataFrame(rows)
    table["vs_sync"] = table.steps_per_sim_hour / table.steps_per_sim_hour.iloc[0]
    return table


def long_tail(steps: int) -> pd.DataFrame:
    rows = []
    for sampler in SAMPLERS:
        s = simulate("what_if", steps, sampler=sampler, **LONG_TAIL).summary()
        rows.append({"sampler": label(sampler), "steps_per_sim_hour": s["sim_steps_per_hour"],
                     "lag_mean": s["lag_mean"], "lag_max": s["lag_max"], "dropped": s["groups_dropped"],
                     "dispatched": s["groups_dispatched"], "drop_frac": s["drop_frac"],
                     "gen_idle": s["gen_idle_frac"], "train_idle": s["train_idle_frac"]})
    table = pd.DataFrame(rows)
    table.insert(2, "vs_sync", table.steps_per_sim_hour / table.steps_per_sim_hour.iloc[0])
    return table


def determinism(steps: int) -> pd.DataFrame:
    digests = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("a", "b"):
            out = simulate("what_if", steps, sampler={"name": "windowed", "max_staleness_versions": 1},
                           **LONG_TAIL).write(Path(tmp) / name)
            digests.append({f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in sorted(out.iterdir())})
    return pd.DataFrame({"file": list(digests[0]), "run 1": list(digests[0].values()),
                         "run 2": [digests[1][f] for f in digests[0]]}).assign(
        identical=lambda t: t["run 1"] == t["run 2"])


def real_run(sampler: dict, steps: int, out: Path | None = None) -> tuple[float, pd.DataFrame, object]:
    cfg = load_config("quickstart", sampler=sampler, eval_every=None, torch_threads=1,
                      generation={"max_new_tokens": 4})
    ctrl = Controller.from_config(cfg)
    ctrl.run(3, progress=False)  # warm-up, as bench_async.py
    start = time.perf_counter()
    ctrl.run(steps, progress=False)
    elapsed = time.perf_counter() - start
    ctrl.close()
    return steps / elapsed, ctrl.metrics, cfg


def calibration(steps: int, sim_steps: int) -> pd.DataFrame:
    sync_rate, metrics, cfg = real_run(SYNC, steps)
    cal = calibrate(metrics, cfg, skip=3)
    predicted = {label(s): cal.predict(s, sim_steps)["sim_steps_per_hour"] / 3600 for s in (SYNC, ASYNC)}
    async_rate, _, _ = real_run(ASYNC, steps)
    m = cal.measured
    print(f"fitted from {m['steps']} synchronous steps: generation {1e3 * m['gen_s']:.1f} ms, training "
          f"{1e3 * m['train_s']:.1f} ms, sync {1e3 * m['sync_s']:.2f} ms a step, {m['tokens']:.0f} tokens; knobs "
          f"decode_s_per_token={cal.generation.decode_s_per_token:.3g}, length_mean={cal.generation.length_mean:.3g}, "
          f"train_s_per_token={cal.training.train_s_per_token:.3g}, train_s_per_step={cal.training.train_s_per_step:.3g}")
    rows = [{"what": "sync steps/s", "predicted": predicted[label(SYNC)], "measured": sync_rate},
            {"what": "async steps/s", "predicted": predicted[label(ASYNC)], "measured": async_rate},
            {"what": "async/sync", "predicted": predicted[label(ASYNC)] / predicted[label(SYNC)],
             "measured": async_rate / sync_rate}]
    table = pd.DataFrame(rows)
    table["error"] = table.predicted / table.measured - 1
    table["within_15%"] = table.error.abs() <= 0.15
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="simulated steps per run")
    parser.add_argument("--real-steps", type=int, default=150, help="real CPU steps per run in the calibration")
    parser.add_argument("--skip-real", action="store_true", help="leave out the real runs (section 4)")
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    print("1. equal stage times (what_if preset)")
    print(equal_stages(args.steps).round(3).to_string(index=False))
    print("\n2. long-tailed lengths (pareto alpha 1.5, mean 24, max 128; concurrency 16)")
    print(long_tail(args.steps).round(3).to_string(index=False))
    print("\n3. two runs with one seed")
    print(determinism(min(args.steps, 300)).to_string(index=False))
    if not args.skip_real:
        print("\n4. calibrated on a real synchronous CPU run, checked against the real asynchronous run")
        print(calibration(args.real_steps, min(args.steps, 300)).round(3).to_string(index=False))


if __name__ == "__main__":
    main()
