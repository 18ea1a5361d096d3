"""The what-if simulator checked against GPU runs: fit its latency model to one ``bench_two_gpus.py`` output, predict
steps/s and async / sync, and compare with what was measured, on the same layout and on the other one.

    python benchmarks/calibrate_gpus.py benchmarks/data/bench_two_gpus/2026-11-30-balanced-g6-lr5e-4 [ONE_GPU_RUN_DIR]
        [--steps 300] [--host-share 0.5] [--admission wave[,streaming]] [--no-record]

Each directory is one invocation of ``bench_two_gpus.py`` (``runs.csv``, or ``rows.csv`` as ``benchmarks/record.py``
writes it, one row per run, with ``results.json`` or ``meta.json`` naming the preset): sync runs (``in_order`` L=0)
and async runs (``weight_fifo`` W=1) of one workload. Its layout comes from the preset: both engines in Ray actors
of their own is two GPUs; both in the driver's process on CUDA is one GPU, colocated.

The model, per step, from the median of the sync runs: ``g`` the generation GPU's busy seconds (waves and weight
loads), ``t`` the training GPU's, ``p`` the trainer's wait for a push, and the rest of a sync step, ``d = step - g - t
- p``, the driver's work on neither GPU (scoring, batch building, Ray round trips). ``asyncrl.simulate.calibrate``
fits the generation side to ``g - load + h d`` and training to ``t + (1 - h) d`` (``h``: ``--host-share``, the part of
the driver's work done by the rollout pump; not measured apart, 0.5 assumed), the sync to ``p`` and the load to the
measured ``load_weights`` time. When both stages run at once, what they share slows them: the rate model's
``overlap_slowdown`` is ``1 + c``, ``c`` the share of a step's work that cannot overlap: ``kappa d / (g + t + d)`` on
two GPUs (the driver's work, one interpreter for both pumps) and ``(g + t + kappa d) / (g + t + d)`` on one GPU (the
GPU work too: the engines take turns). ``kappa``, the share of the driver's work that does not overlap, is 1 when
only sync runs are known (within a layout: the async runs are what is predicted); from the other layout's async
runs it is fitted (bisection on the simulated async steps/s), then carried over. Generation runs in waves or
streams (``--admission``, per output: the vLLM generator before 2026-12-01 ran waves, the streaming one since), the
weights loaded once the running groups are done (``weight_update: drain``); a prediction keeps the fitted output's.

With outputs of one layout only, the other layout's steps/s and async / sync are predicted (``kappa`` fitted to the
async runs), with no measurement beside them: what a later run on that layout checks. Prints the table and records
it (``benchmarks/data/calibrate_gpus/<date>/``) unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl import load_config  # noqa: E402
from asyncrl.cli import parse_overrides  # noqa: E402
from asyncrl.config import merge_overrides  # noqa: E402
from asyncrl.simulate import ASYNC, SYNC, calibrate  # noqa: E402
from record import meta, save  # noqa: E402


def load_bench(run_dir: Path) -> tuple[pd.DataFrame, str, dict]:
    """(one row per run, the preset, its overrides) of a bench_two_gpus.py output directory: the bench's own files
    (``runs.csv``, ``results.json``) or a ``benchmarks/record.py`` run directory (``rows.csv``, ``meta.json`` with
    the bench's results). Its ``preset`` may carry the invocation's ``KEY=VALUE`` pairs after the name."""
    rows = run_dir / ("runs.csv" if (run_dir / "runs.csv").exists() else "rows.csv")
    if (run_dir / "results.json").exists():
        info = json.loads((run_dir / "results.json").read_text())
    else:
        info = json.loads((run_dir / "meta.json").read_text())["results"]
    preset, *pairs = info["preset"].split()
    return pd.read_csv(rows), preset, merge_overrides(info.get("overrides") or {}, parse_overrides(pairs))


def layout(cfg) -> str:
    placements = (cfg.trainer.placement, cfg.generation.placement)
    if placements == ("ray", "ray"):
        return "two GPUs"
    if placements == ("local", "local") and str(cfg.generation.device).startswith("cuda"):
        return "one GPU"
    raise ValueError(f"placements {placements} on {cfg.generation.device}: neither two GPUs (both 'ray') nor one GPU "
                     "colocated (both 'local' on CUDA)")


class Fit:
    """The stage times of one bench output's sync runs and the simulated config they give, for either layout."""

    def __init__(self, run_dir: Path, host_share: float, admission: str) -> None:
        runs, preset, overrides = load_bench(run_dir)
        self.name, self.runs = run_dir.name, runs
        self.cfg = load_config(preset, **overrides, sampler=SYNC)
        self.layout = layout(self.cfg)
        sync = runs[runs["mode"] == "sync"]
        med = sync.median(numeric_only=True)
        self.step = 1 / med.steps_per_s
        self.g, self.t, self.p = med.gen_busy_per_step_s, med.train_busy_per_step_s, med.push_wait_s_median
        self.load = float(med.get("sync_load_s_median", 0.0))
        self.d = max(0.0, self.step - self.g - self.t - self.p)
        gen = max(self.g - self.load, 0.0) + host_share * self.d
        train = self.t + (1 - host_share) * self.d
        metrics = pd.DataFrame({"step_time_s": [gen + train + self.p] * 8, "train_time_s": [train] * 8,
                                "sync_time_s": [self.p] * 8, "tokens": [med.completion_tokens_per_step] * 8})
        self.cal = calibrate(metrics, self.cfg, skip=0)
        self.admission = admission
        self.measured = {mode: float(runs.loc[runs["mode"] == mode, "steps_per_s"].median()) for mode in ("sync", "async")}

    def slowdown(self, on: str, kappa: float) -> float:
        work = self.g + self.t + self.d
        shared = kappa * self.d + (self.g + self.t if on == "one GPU" else 0.0)
        return min(2.0, 1 + shared / work)

    def rate(self, on: str, kappa: float, steps: int, sampler: dict) -> float:
        """Simulated steps/s of this workload on layout ``on`` under ``sampler``."""
        knobs = {"generation": {"admission": self.admission, "weight_update": "drain", "load_s": self.load},
                 "trainer": {"overlap_slowdown": self.slowdown(on, kappa), "colocated": on == "one GPU"},
                 "torch_threads": 1}  # the simulated batches are small tensors: one thread is faster
        return self.cal.predict(sampler, steps, **knobs)["sim_steps_per_hour"] / 3600

    def predict(self, on: str, kappa: float, steps: int) -> dict[str, float]:
        rates = {mode: self.rate(on, kappa, steps, s) for mode, s in (("sync", SYNC), ("async", ASYNC))}
        return {**rates, "async/sync": rates["async"] / rates["sync"]}

    def fit_kappa(self, steps: int) -> float:
        """The share of the driver's work that does not overlap, from this output's own async runs."""
        lo, hi = 0.0, 1.0
        for _ in range(7):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.rate(self.layout, mid, steps, ASYNC) > self.measured["async"] else (lo, mid)
        return (lo + hi) / 2


def compare(fit: Fit, target: Fit | str, kappa: float, steps: int, how: str) -> list[dict]:
    """Predicted against measured for ``target`` (a Fit), or the prediction alone for a layout (a str): the
    same workload on the layout no output measured, to check once one does."""
    on = target if isinstance(target, str) else target.layout
    predicted = fit.predict(on, kappa, steps)
    if isinstance(target, str):
        name, measured = f"{fit.name} on {on} (not measured)", dict.fromkeys(predicted, float("nan"))
    else:
        name = f"{target.name} ({on})"
        measured = {**target.measured, "async/sync": target.measured["async"] / target.measured["sync"]}
    return [{"fitted on": f"{fit.name} ({fit.layout})", "predicts": name, "how": how,
             "kappa": round(kappa, 3), "overlap_slowdown": round(fit.slowdown(on, kappa), 3),
             "what": what, "predicted": predicted[what], "measured": measured[what],
             "error": predicted[what] / measured[what] - 1} for what in ("sync", "async", "async/sync")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", help="one or two bench_two_gpus.py output directories")
    parser.add_argument("--steps", type=int, default=300, help="simulated steps per prediction")
    parser.add_argument("--host-share", type=float, default=0.5, help="share of the driver's work on the rollout side")
    parser.add_argument("--admission", default="wave", help="how the outputs' generator took groups: 'wave' (the vLLM "
                        "generator before the streaming one) or 'streaming'; one value, or one per directory, comma "
                        "separated")
    parser.add_argument("--no-record", action="store_true", help="print only; write nothing under benchmarks/data")
    args = parser.parse_args()
    before = meta("calibrate_gpus")
    admissions = args.admission.split(",")
    if len(admissions) == 1:
        admissions *= len(args.run_dirs)
    if len(admissions) != len(args.run_dirs) or not set(admissions) <= {"wave", "streaming"}:
        parser.error(f"--admission {args.admission!r}: 'wave' or 'streaming', once or once per directory")
    fits = [Fit(d, args.host_share, a) for d, a in zip(args.run_dirs, admissions)]
    rows = []
    for fit in fits:  # within a layout: from the sync runs alone
        rows += compare(fit, fit, 1.0, args.steps, "sync runs only (kappa 1)")
    layouts = {f.layout for f in fits}
    if len(fits) == 2 and len(layouts) == 2:  # across layouts: kappa from the fitted side's own async runs
        for fit, target in (fits, fits[::-1]):
            rows += compare(fit, target, fit.fit_kappa(args.steps), args.steps, "sync + async runs of the other layout")
    else:  # the other layout, predicted before it is measured
        other = {"two GPUs": "one GPU", "one GPU": "two GPUs"}
        for fit in fits:
            rows += compare(fit, other[fit.layout], fit.fit_kappa(args.steps), args.steps,
                            "sync + async runs (kappa fitted), other layout not measured")
    table = pd.DataFrame(rows)
    pd.set_option("display.width", 200)
    print(table.round(4).to_string(index=False))
    for fit in fits:
        print(f"{fit.name} ({fit.layout}): sync step {1e3 * fit.step:.1f} ms = generation GPU {1e3 * fit.g:.1f} + "
              f"training GPU {1e3 * fit.t:.1f} + push {1e3 * fit.p:.1f} + driver {1e3 * fit.d:.1f} ms")
    if len(fits) == 2 and len(layouts) == 1:
        print("both outputs have one layout: no cross-layout prediction (it needs a one-GPU and a two-GPU output)")
    if not args.no_record:
        checked = table.error.dropna().abs()
        results = {"worst_abs_error": float(checked.max()), "within_15%": bool((checked <= 0.15).all()),
                   "inputs": [str(d) for d in args.run_dirs], "host_share": args.host_share, "steps": args.steps}
        print(f"wrote {save('calibrate_gpus', table, results, before=before)}")


if __name__ == "__main__":
    main()
