"""``asyncrl run CONFIG_OR_PRESET --steps N --out DIR``: a headless run that writes its metrics, trace and config.

Overrides use dotted keys: ``--set seed=1 --set sampler.name=weight_fifo --set sampler.max_staleness_versions=2``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import yaml


def _overrides(pairs: list[str]) -> dict:
    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw)
    return out


def run(args: argparse.Namespace) -> int:
    """Check everything, then run, appending each finished step to metrics.csv and its events to trace.csv.
    Exit 0 when the run completed (or the data ran out), 130 on Ctrl-C (the files hold every finished step),
    1 when it failed; summary.json says which (``status``) and why."""
    from asyncrl.config import load_config
    from asyncrl.controller import TRACE_COLUMNS, Controller

    stop = {"asked": False, "handle": None}

    def on_sigint(signum, frame):  # stop at the pumps' next safe point; a second Ctrl-C kills at once
        stop["asked"] = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if stop["handle"] is not None:
            stop["handle"].stop(wait=False)

    try:  # nothing is written before the config, the output directory and the controller are known to be good
        cfg = load_config(args.config, **_overrides(args.set))
        out = Path(args.out)
        _check_writable(out)
        ctrl = Controller.from_config(cfg)
    except KeyboardInterrupt:
        print("interrupted before the run started; nothing written", file=sys.stderr)
        return 130
    except (ValueError, TypeError, ImportError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"asyncrl run: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    metrics, trace = _CsvLog(out / "metrics.csv"), _CsvLog(out / "trace.csv")

    def on_step(row: dict, events: list[tuple]) -> None:
        trace.write(dict(zip(TRACE_COLUMNS, event)) for event in events)
        metrics.write([row])

    previous = signal.signal(signal.SIGINT, on_sigint)
    error = None
    try:
        stop["handle"] = ctrl.start(args.steps, progress=not args.quiet, on_step=on_step)
        if stop["asked"]:
            stop["handle"].stop(wait=False)
        stop["handle"].wait()
    except Exception as exc:  # the run's own error, re-raised by wait()
        error = exc
        traceback.print_exception(exc)
    finally:
        signal.signal(signal.SIGINT, previous)
    trace.write(dict(zip(TRACE_COLUMNS, event)) for event in ctrl._trace[trace.count:])  # after the last step
    metrics.close()
    trace.close()
    status = "failed" if error is not None else "interrupted" if stop["asked"] else "completed"
    handle = stop["handle"]
    summary = {"status": status, "steps": ctrl.trainer_version, "ended": handle.status if handle else "not started"}
    if error is not None:
        summary["error"] = f"{type(error).__name__}: {error}"
    if status == "completed":
        final = ctrl.evaluate()
        summary.update({f"final_eval_{k}": v for k, v in final.items()})
    summary["constant_answer_accuracy"] = ctrl.task.constant_answer_accuracy
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if not args.no_plot and len(ctrl.metrics):
        _plot(ctrl.metrics, out / "reward.png", ctrl.task.constant_answer_accuracy)
    ctrl.close()
    print(json.dumps(summary))
    return {"completed": 0, "interrupted": 130}.get(status, 1)


def _check_writable(out: Path) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out {str(out)!r}: {str(probe)!r} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out {str(out)!r}: {str(probe)!r} is not writable")


class _CsvLog:
    """A CSV file that grows by rows while a run goes, flushed after every write. A row bringing a new column
    rewrites the file with the wider header (metrics gain ``eval_*`` columns at the first evaluation)."""

    def __init__(self, path: Path):
        self.file = open(path, "w", newline="")
        self.columns: list[str] = []
        self.rows: list[dict] = []

    @property
    def count(self) -> int:
        return len(self.rows)

    def write(self, rows) -> None:
        rows = list(rows)
        if not rows:
            return
        self.rows.extend(rows)
        new = list(dict.fromkeys(k for row in rows for k in row if k not in self.columns))
        if new:
            self.columns += new
            self.file.seek(0)
            self.file.truncate()
            writer = csv.DictWriter(self.file, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        else:
            csv.DictWriter(self.file, self.columns).writerows(rows)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _plot(metrics, path: Path, constant_accuracy: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no reward.png (pip install 'asyncrl[notebook]')", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(metrics["step"], metrics["reward_mean"], label="train reward (sampled)")
    if "eval_accuracy" in metrics:
        ev = metrics.dropna(subset=["eval_accuracy"])
        ax.plot(ev["step"], ev["eval_accuracy"], "o-", label="held-out greedy accuracy")
    ax.axhline(constant_accuracy, color="gray", ls="--", lw=1, label="best constant answer")
    ax.set_xlabel("optimizer step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run headless and write metrics.csv, trace.csv, config.yaml, summary.json")
    p.add_argument("config", help="a preset name (quickstart, ...) or a YAML path")
    p.add_argument("--steps", type=_positive, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
