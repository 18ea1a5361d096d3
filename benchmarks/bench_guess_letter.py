"""Does the model use what the environment said? ``asyncrl run guess_letter --steps 400 --set seed=N`` as a user
runs it (a fresh process each, the preset's settings, evaluation every 25 steps), once per seed.

    python benchmarks/bench_guess_letter.py [--seeds 0,1,2] [--steps 400] [--jobs 1] [--name NAME]

Per seed: the wall time of the whole command (start-up and the final evaluation included), held-out accuracy
untrained (the step-0 evaluation) and after the run (``final_eval_accuracy``), the best feedback-blind strategy's
accuracy (``constant_answer_accuracy``: the same guesses whatever the replies) and whether the trained model beats
it. ``curves.csv`` holds every seed's held-out accuracy by step and ``accuracy.png`` draws them with the bar.
Learning numbers are deterministic for a seed on CPU (the preset's ``in_order`` sampler trains the same data
whatever the timing); the wall times depend on the machine and its load, which ``meta.json`` records. Seeds run
one at a time unless ``--jobs`` asks for more (each run uses the machine's cores; parallel runs slow each other).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
from record import meta, save

ROOT = Path(__file__).resolve().parent.parent
BENCH = "bench_guess_letter"


def one_run(seed: int, steps: int, out: Path) -> tuple[dict, pd.DataFrame]:
    """(the seed's row, its held-out accuracy by step) from one ``asyncrl run guess_letter`` subprocess."""
    command = [sys.executable, "-m", "asyncrl.cli", "run", "guess_letter", "--steps", str(steps), "--out", str(out),
               "--quiet", "--set", f"seed={seed}"]
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: `{' '.join(command)}` exited {done.returncode}: "
                         f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    summary = json.loads((out / "summary.json").read_text())
    metrics = pd.read_csv(out / "metrics.csv")
    if "eval_accuracy" not in metrics:
        metrics = metrics.assign(eval_accuracy=float("nan"))
    evals = metrics.dropna(subset=["eval_accuracy"])
    curve = pd.DataFrame({"seed": seed, "step": evals.trainer_version.astype(int),
                          "eval_accuracy": evals.eval_accuracy.astype(float)}).drop_duplicates("step", keep="last")
    bar = float(summary["constant_answer_accuracy"])
    final = float(summary["final_eval_accuracy"])
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    # The step-0 evaluation is printed in the last line, not written to metrics.csv (no step trained yet).
    untrained = re.search(r"([\d.]+) untrained", last)
    head = [{"seed": seed, "step": 0, "eval_accuracy": float(untrained.group(1))}] if untrained else []
    tail = [] if int(summary["steps"]) in set(curve.step) else [
        {"seed": seed, "step": int(summary["steps"]), "eval_accuracy": final}]
    curve = pd.concat([pd.DataFrame(head), curve, pd.DataFrame(tail)], ignore_index=True)
    row = {"seed": seed, "steps": int(summary["steps"]), "wall_s": wall,
           "untrained_eval_accuracy": float(untrained.group(1)) if untrained else None,
           "final_eval_accuracy": final, "constant_answer_accuracy": bar, "beat": final > bar, "last_line": last}
    return row, curve


def figure(curves: pd.DataFrame, bar: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for seed, curve in curves.groupby("seed"):
        ax.plot(curve.step, curve.eval_accuracy, marker="o", markersize=3, label=f"seed {seed}")
    ax.axhline(bar, color="black", linestyle="--", linewidth=1,
               label=f"blind play (constant_answer_accuracy {bar:.3f})")
    ax.set_xlabel("training step (weight version)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("guess_letter: secret found within 3 turns, held-out secrets")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once (default 1: one at a time)")
    parser.add_argument("--out", default=None, help=f"run directory (default benchmarks/data/{BENCH}/<UTC>)")
    parser.add_argument("--name", default=None, help=f"name of the run directory under benchmarks/data/{BENCH}")
    args = parser.parse_args()
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: must be 1 or more")
    seeds = [int(s) for s in args.seeds.split(",")]
    before = meta(BENCH)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda s: one_run(s, args.steps, Path(tmp) / f"seed{s}"), seeds))
    for row, _ in done:
        print(json.dumps(row), flush=True)
    table = pd.DataFrame([row for row, _ in done])
    curves = pd.concat([curve for _, curve in done], ignore_index=True)
    bar = float(table.constant_answer_accuracy.iloc[0])
    results = {"steps": args.steps, "jobs": args.jobs, "seeds": seeds, "constant_answer_accuracy": bar,
               "seeds_above_bar": int(table.beat.sum()), "wall_s_max": float(table.wall_s.max()),
               "claim_met": bool(table.beat.sum() >= 2)}
    where = save(BENCH, table, results, before=before, out=args.out, name=args.name, files={"curves.csv": curves})
    figure(curves, bar, where / "accuracy.png")
    print(table.drop(columns="last_line").round(3).to_string(index=False))
    print(f"raw data: {where}")


if __name__ == "__main__":
    main()
