"""``asyncrl replay RUN --sampler S [--sampler S ...] --out DIR``: a recorded run replayed under each sampler on the
simulated clock, side by side with the run as recorded (``asyncrl.replay.compare``). ``S`` is a sampler name with
its default knobs (``windowed``) or a YAML mapping (``'{name: windowed, max_staleness_versions: 2}'``). Writes
``replay.csv`` (the table: a column per sampler), ``replay.png`` (the figure), ``schedule.csv`` (every trained group
of every run: which groups each sampler trained at any step), ``drops.csv``, and a directory per replay with its
``metrics.csv``, ``trace.csv`` and ``summary.json``; prints the table.

``asyncrl/cli.py`` registers the verb (``add_parser``) and calls ``main``; this module sits above the recording it
opens.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a recorded run under other samplers on the simulated clock: "
                       "replay.csv, replay.png, schedule.csv, drops.csv")
    p.add_argument("run", help="a run directory written by `asyncrl run` (or `asyncrl simulate`)")
    p.add_argument("--sampler", action="append", required=True, metavar="S",
                   help="a sampler name with its default knobs, or a YAML mapping such as "
                        "'{name: windowed, max_staleness_versions: 2}' (repeatable: one replay each)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the files (created if missing)")
    p.add_argument("--steps", type=int, metavar="N", help="steps to replay (default: as many as recorded)")
    p.add_argument("--overlap-slowdown", type=float, metavar="X",
                   help="how much generation and training slow each other while both run (default 1: the "
                        "recording's timings already hold it; asyncrl.simulate.measure_overlap measures it)")
    p.add_argument("--no-plot", action="store_true", help="do not write replay.png")


def parse_sampler(text: str) -> dict:
    """``windowed`` -> ``{"name": "windowed"}``; a YAML mapping -> itself. Anything else is a one-line error."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"--sampler {text!r} is not YAML ({exc.problem}); give a sampler name or a mapping such "
                         "as '{name: windowed, max_staleness_versions: 2}'") from None
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict) and "name" in value:
        return value
    raise ValueError(f"--sampler {text!r}: give a sampler name or a YAML mapping with a name, such as "
                     "'{name: windowed, max_staleness_versions: 2}'")


def main(args: argparse.Namespace) -> int:
    import pandas as pd

    from asyncrl.recording import Recording, RecordingDamaged
    from asyncrl.replay.comparison import compare

    start = time.perf_counter()
    try:
        samplers = [parse_sampler(s) for s in args.sampler]
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {str(out)!r} is not a directory")
        with warnings.catch_warnings(record=True) as said:  # a file cut mid-row: one line each, whole steps only
            warnings.simplefilter("always", RecordingDamaged)
            recording = Recording(args.run)
        for w in said:
            if issubclass(w.category, RecordingDamaged):
                print(f"asyncrl replay: {w.message}", file=sys.stderr)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        cmp = compare(recording, samplers, args.steps, args.overlap_slowdown)
    except (ValueError, TypeError, ImportError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"asyncrl replay: {_one_line(exc)}", file=sys.stderr)
        return 2
    cmp.write(out, plots=not args.no_plot)
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(cmp.table.to_string(float_format=lambda x: f"{x:.3g}"))
    print(f"replayed {args.run} under {len(samplers)} sampler(s) in {time.perf_counter() - start:.1f} s; files in "
          f"{out}", file=sys.stderr)
    return 0


def _one_line(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        given = "" if isinstance(first["input"], dict) else f" = {first['input']!r}"
        return f"invalid sampler: {where + given + ': ' if where else ''}{first['msg'].removeprefix('Input ')}"
    return str(exc)
