"""How fast a recording opens and scrubs (asyncrl/recording.py): record a long run, open it, jump to random steps.

    python benchmarks/bench_recording.py --steps 100000      # the issue's size; minutes to hours to record
    python benchmarks/bench_recording.py --open DIR           # a recording made earlier (--keep DIR): just measure

The run is real: the controller, buffer and sampler on the simulated backends' virtual clock (the ``what_if``
preset, ``in_order`` L=1), written live by ``RunFiles`` as ``asyncrl run`` writes it (``trace.csv``,
``metrics.csv``, ``trace_index.csv``) into a scratch directory that is deleted afterwards (it is hundreds of MB).
Then: ``Recording(dir)`` and its first ``steps`` and ``metrics`` (open), and ``--scrubs`` random jumps, each
``rec.at(step)`` or ``rec.at(step, event=i)`` followed by ``view.explain()`` (a scrub, what ``widgets.Replay``
does per slider move). The target: opens in seconds, a scrub under 100 ms, without loading the whole trace.
Raw rows and results go to ``benchmarks/data/bench_recording/<name>/`` (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record import meta, save  # noqa: E402


def _open(Recording, work: Path):
    """``Recording(dir)``, its ``steps`` and ``metrics``: what opening a recording costs."""
    start = time.perf_counter()
    rec = Recording(work)
    steps, metrics = rec.steps, rec.metrics
    return time.perf_counter() - start, rec, steps, metrics


def _scrub(rec, steps: list[int], args, rows: list[dict]) -> None:
    """Random jumps, each a view and its verdicts (what one slider move of ``widgets.Replay`` costs)."""
    rng = random.Random(args.seed)
    for i in range(args.scrubs):
        step = rng.choice(steps)
        event = None if i % 2 == 0 else rng.randrange(rec.events(step))
        start = time.perf_counter()
        view = rec.at(step, event=event)
        view.explain()
        rows.append({"op": "scrub", "step": step, "event": event, "seconds": time.perf_counter() - start,
                     "step_rows": len(view.trace)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--scrubs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="run directory name under benchmarks/data/bench_recording")
    parser.add_argument("--out", default=None, help="write rows.csv/meta.json here instead")
    parser.add_argument("--keep", metavar="DIR", help="record into DIR and keep it (default: a scratch directory)")
    parser.add_argument("--open", metavar="DIR", dest="existing",
                        help="measure a recording made earlier (a run directory, --keep's) instead of recording one")
    args = parser.parse_args()
    before = meta("bench_recording")

    import yaml

    from asyncrl import Controller, Recording, load_config
    from asyncrl.recording import RunFiles
    from asyncrl.simulate import Simulation

    work = Path(args.existing or args.keep or tempfile.mkdtemp(prefix="bench-recording-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, record_s = [], None
    try:
        if not args.existing:  # record: the simulated run, written as asyncrl run writes it
            cfg = load_config("what_if", seed=args.seed)
            (work / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
            ctrl = Controller.from_config(cfg)
            files = RunFiles(work).attach(ctrl)
            start = time.perf_counter()
            Simulation(ctrl).run(args.steps)
            files.close()
            record_s = time.perf_counter() - start
            del ctrl, files
        sizes = {name: (work / name).stat().st_size for name in ("trace.csv", "metrics.csv", "trace_index.csv")}
        open_s, rec, steps, metrics = _open(Recording, work)
        rows.append({"op": "open", "step": None, "event": None, "seconds": open_s, "step_rows": None})
        assert len(steps) == len(metrics), (len(steps), len(metrics))
        args.steps = len(steps)
        trace_rows = rec.at(steps[-1]).row.seq + 1
        _scrub(rec, steps, args, rows)
    finally:
        if not args.keep and not args.existing:
            shutil.rmtree(work, ignore_errors=True)

    scrubs = [r["seconds"] for r in rows if r["op"] == "scrub"]
    results = {
        "steps": args.steps, "trace_rows": trace_rows, "record_s": None if record_s is None else round(record_s, 1),
        "open_s": round(open_s, 3), "recording": str(work) if args.existing else "recorded by this run",
        "scrub_median_ms": round(1000 * statistics.median(scrubs), 2),
        "scrub_p95_ms": round(1000 * sorted(scrubs)[int(0.95 * (len(scrubs) - 1))], 2),
        "scrub_max_ms": round(1000 * max(scrubs), 2), "scrubs": len(scrubs), "file_bytes": sizes,
        "targets": {"open_under_10_s": open_s < 10, "scrub_median_under_100_ms": statistics.median(scrubs) < 0.1},
    }
    where = save("bench_recording", rows, results, before=before, out=args.out, name=args.name)
    print(f"| steps | trace rows | trace.csv | record | open | scrub median | p95 | max | load before |\n"
          f"| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
          f"| {args.steps:,} | {trace_rows:,} | {sizes['trace.csv'] / 1e6:.0f} MB | "
          f"{'-' if record_s is None else f'{record_s:.0f} s'} | "
          f"{open_s:.2f} s | {results['scrub_median_ms']:.1f} ms | {results['scrub_p95_ms']:.1f} ms | "
          f"{results['scrub_max_ms']:.1f} ms | {before['machine']['load_1min']} |")
    print(f"raw rows: {where}")


if __name__ == "__main__":
    main()
