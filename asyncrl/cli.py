"""``asyncrl run CONFIG_OR_PRESET --steps N --out DIR``: a headless run that writes its metrics, trace and config.

Overrides use dotted keys: ``--set seed=1 --set sampler.name=weight_fifo --set sampler.max_staleness_versions=2``.
"""

from __future__ import annotations

import argparse
import json
import sys
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
    from asyncrl.config import load_config
    from asyncrl.controller import Controller

    cfg = load_config(args.config, **_overrides(args.set))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    ctrl = Controller.from_config(cfg)
    ctrl.run(steps=args.steps, progress=not args.quiet)
    final = ctrl.evaluate()
    ctrl.metrics.to_csv(out / "metrics.csv", index=False)
    ctrl.trace.to_csv(out / "trace.csv", index=False)
    summary = {"steps": ctrl.trainer_version, **{f"final_eval_{k}": v for k, v in final.items()},
               "constant_answer_accuracy": ctrl.task.constant_answer_accuracy}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if not args.no_plot:
        _plot(ctrl.metrics, out / "reward.png", ctrl.task.constant_answer_accuracy)
    print(json.dumps(summary))
    return 0


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run headless and write metrics.csv, trace.csv, config.yaml, summary.json")
    p.add_argument("config", help="a preset name (quickstart, ...) or a YAML path")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
