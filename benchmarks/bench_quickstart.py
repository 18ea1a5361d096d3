"""What the README's headless quickstart run takes and reaches: ``asyncrl run quickstart --steps 300`` as a user
runs it (a fresh process each, default threads, evaluation every 25 steps, ``reward.png``), once per seed.

    python benchmarks/bench_quickstart.py [--seeds 0,1,2] [--steps 300] [--name NAME]

Per seed: the wall time of the whole command (start-up and the final evaluation included), held-out greedy accuracy
untrained and after the run, the best constant answer's accuracy, the first evaluated step whose accuracy beats
it, and the last line the command prints. Seed 0's ``reward.png`` is kept in the run directory (the README's
picture). Learning numbers are deterministic for a seed on CPU (the preset's ``in_order`` sampler trains the same
data whatever the timing); the wall times depend on the machine and its load, which ``meta.json`` records.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from record import meta, save

ROOT = Path(__file__).resolve().parent.parent


def one_run(seed: int, steps: int, out: Path) -> dict:
    command = [sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--steps", str(steps), "--out", str(out),
               "--quiet", "--set", f"seed={seed}"]
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    metrics = pd.read_csv(out / "metrics.csv")
    evals = metrics.dropna(subset=["eval_accuracy"]) if "eval_accuracy" in metrics else metrics.iloc[:0]
    bar = summary["constant_answer_accuracy"]
    beats = evals[evals.eval_accuracy > bar]
    last = done.stdout.strip().splitlines()[-1]
    untrained = re.search(r"([\d.]+) untrained", last)
    return {"seed": seed, "steps": summary["steps"], "wall_s": wall,
            "final_eval_accuracy": summary["final_eval_accuracy"],
            "untrained_eval_accuracy": float(untrained.group(1)) if untrained else None,
            "constant_answer_accuracy": bar,
            "first_eval_step_above_constant": int(beats.trainer_version.iloc[0]) if len(beats) else None,
            "last_line": last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=None, help="run directory (default benchmarks/data/bench_quickstart/<UTC>)")
    parser.add_argument("--name", default=None, help="name of the run directory under benchmarks/data/bench_quickstart")
    args = parser.parse_args()
    before = meta("bench_quickstart")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            rows.append(one_run(seed, args.steps, Path(tmp) / f"seed{seed}"))
            print(json.dumps(rows[-1]), flush=True)
        table = pd.DataFrame(rows)
        results = {"steps": args.steps, "wall_s_median": float(table.wall_s.median()),
                   "final_eval_accuracy_min": float(table.final_eval_accuracy.min()),
                   "final_eval_accuracy_max": float(table.final_eval_accuracy.max())}
        where = save("bench_quickstart", table, results, before=before, out=args.out, name=args.name)
        first = Path(tmp) / f"seed{rows[0]['seed']}" / "reward.png"
        if first.exists():
            shutil.copy(first, where / "reward.png")
    print(table.drop(columns="last_line").round(3).to_string(index=False))
    print(f"raw data: {where}")


if __name__ == "__main__":
    main()
