"""The what-if simulator's calibration checked against a GPU run: fit the latency model to each synchronous run of a
``bench_two_gpus.py`` output directory and compare its predicted async / sync ratio with the measured one.

    python benchmarks/calibrate_two_gpus.py benchmarks/data/two_gpus_balanced [--preset gpu_two_devices_balanced]

``bench_two_gpus.py`` keeps per-step wall times (``reward_curves.csv``) and per-run means (``runs.csv``), not the
controller's ``metrics.csv``, so the fit takes each step's time from the wall-clock curve, the training time from
the training GPU's busy time a step and the sync from the trainer's median push wait. ``overlap_slowdown`` stays 1:
the two stages run on separate GPUs (what they share, the driver's interpreter, is not measured apart here).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from asyncrl import load_config
from asyncrl.simulate import calibrate

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
ASYNC = {"name": "weight_fifo", "max_staleness_versions": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--preset", default="gpu_two_devices_balanced")
    parser.add_argument("--steps", type=int, default=300, help="simulated steps per prediction")
    args = parser.parse_args()
    runs = pd.read_csv(args.run_dir / "runs.csv")
    curves = pd.read_csv(args.run_dir / "reward_curves.csv")
    overrides = json.loads((args.run_dir / "results.json").read_text()).get("overrides") or {}
    cfg = load_config(args.preset, **overrides, sampler=SYNC)
    rows = []
    for run in runs[runs["mode"] == "sync"].itertuples():
        wall = curves[curves["run"] == run.run].sort_values("step")["wall_s"]
        metrics = pd.DataFrame({"step_time_s": wall.diff().dropna().to_numpy(), "train_time_s": run.train_busy_per_step_s,
                                "sync_time_s": run.push_wait_s_median, "tokens": run.completion_tokens_per_step})
        cal = calibrate(metrics, cfg)
        sync_h = cal.predict(SYNC, steps=args.steps)["sim_steps_per_hour"]
        async_h = cal.predict(ASYNC, steps=args.steps)["sim_steps_per_hour"]
        rows.append({"sync run": run.run, "measured sync steps/s": run.steps_per_s,
                     "predicted sync steps/s": sync_h / 3600, "predicted async steps/s": async_h / 3600,
                     "predicted async/sync": async_h / sync_h})
    table = pd.DataFrame(rows)
    measured = runs.loc[runs["mode"] == "async", "steps_per_s"].median() / runs.loc[runs["mode"] == "sync",
                                                                                   "steps_per_s"].median()
    predicted = float(np.median(table["predicted async/sync"]))
    print(table.round(3).to_string(index=False))
    print(f"\nasync / sync: predicted {predicted:.3f} (median over the sync runs), measured {measured:.3f} "
          f"(median async steps/s / median sync steps/s), error {predicted / measured - 1:+.1%}")


if __name__ == "__main__":
    main()
