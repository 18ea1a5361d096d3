"""What the completions log costs: steps/s of the quickstart run writing ``completions.jsonl`` (``log_completions:
all``, the default) beside the same run logging nothing (``none``), in one run.

Both controllers write a run directory as ``asyncrl run`` does (``RunFiles``: trace.csv, metrics.csv and, for
``all``, completions.jsonl, a group's rows in one write as it is committed). They are built and warmed up first;
then timed stretches of ``--steps`` steps alternate between them ``--reps`` times, so load on the machine hits
both alike. The figure is the median steps/s and the ratio none/all. The target (issue 31): within 5%.

    python benchmarks/bench_completions.py [--steps 90] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from record import meta, save

from asyncrl import Controller, load_config
from asyncrl.run_files import RunFiles


def build(log_completions, out: Path) -> tuple[Controller, RunFiles]:
    ctrl = Controller.from_config(load_config("quickstart", eval_every=None, torch_threads=1,
                                              log_completions=log_completions))
    out.mkdir(parents=True)
    files = RunFiles(out).attach(ctrl)
    ctrl.run(3, progress=False)  # warm-up: first passes, the allocator
    return ctrl, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None, help="run directory (default benchmarks/data/bench_completions/<UTC time>)")
    parser.add_argument("--name", default=None, help="name of the run directory under benchmarks/data/bench_completions")
    args = parser.parse_args()
    before = meta("bench_completions")
    raw = []
    with tempfile.TemporaryDirectory() as tmp:
        cells = {mode: build(mode, Path(tmp) / mode) for mode in ("all", "none")}
        try:
            for rep in range(args.reps):
                for mode, (ctrl, _) in cells.items():
                    start = time.perf_counter()
                    ctrl.run(args.steps, progress=False)
                    raw.append({"log_completions": mode, "rep": rep, "steps": args.steps,
                                "steps_per_s": args.steps / (time.perf_counter() - start)})
            log = Path(tmp) / "all" / "completions.jsonl"
            written = {"rows": sum(1 for _ in open(log, "rb")), "bytes": log.stat().st_size}
        finally:
            for ctrl, files in cells.values():
                files.close()
                ctrl.close()
    median = {mode: statistics.median(r["steps_per_s"] for r in raw if r["log_completions"] == mode)
              for mode in cells}
    ratio = median["all"] / median["none"]
    print(f"quickstart (copy_first, 8 groups x 8 per step), torch_threads 1, {args.steps} steps x {args.reps} reps "
          f"each; load {before['machine']['load_1min']} before the run")
    print(f"{'log_completions':<16} {'steps/s':>8}")
    for mode, value in median.items():
        print(f"{mode:<16} {value:>8.2f}")
    results = {"steps_per_s": median, "all_over_none": ratio, "target_met": ratio >= 0.95, **written}
    where = save("bench_completions", raw, results, before=before, out=args.out, name=args.name)
    print(f"all / none = {ratio:.3f} (target >= 0.95: {ratio >= 0.95}); {written['rows']} rows, "
          f"{written['bytes'] / 1e6:.1f} MB written; raw data: {where}")


if __name__ == "__main__":
    main()
