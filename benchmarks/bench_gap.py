"""The training-inference gap, apart (issue 33): what ``mismatch_kl`` and the importance weight's two parts read on a
real run, and what keeping earlier weights for them costs in time and memory.

    python benchmarks/bench_gap.py --preset quickstart --steps 60                 # CPU: torch trains and generates
    python benchmarks/bench_gap.py --preset gpu_quickstart --steps 40 --set generation.max_new_tokens=16

A controller from the preset (``--set`` overrides, dotted) runs ``--steps`` steps, stepped by hand (one rollout
tick, one train tick: the schedule and the data do not depend on timing). The policy's ``keep_versions`` and
``logprobs_at`` calls are timed (``Capabilities.keeps_versions``: the copy of the weights before an optimizer step,
and the extra no-grad pass under a stale token's version), and after each step ``kept_bytes()`` says what the copies
take. One row per step: the gap metrics, ``token_staleness_mean``, the step's ``train_time_s``, the seconds the two
calls took and the kept bytes; ``results`` has their medians, the model's parameter bytes and, on a GPU, the peak
memory allocated.

``--ab`` (CPU) adds the same run with ``loss.gap_metrics: false`` (no version kept, no extra pass), to compare
``train_time_s`` on identical data; the gap metrics are then over the fresh tokens only (none, at lag 1).
Raw rows: ``benchmarks/data/bench_gap/<name>/`` (benchmarks/record.py). The box is shared: wall times move with
its load (``meta.json`` has the load before the run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from record import meta, save  # noqa: E402

GAP = ["gap_tokens", "mismatch_kl", "is_mismatch_mean", "is_mismatch_max", "is_staleness_mean", "is_staleness_max",
       "is_weight_mean", "token_staleness_mean", "lag_mean", "completion_tokens", "train_time_s", "step_time_s"]


def timed(obj, name: str, log: dict) -> None:
    """Replace ``obj.name`` by a version that adds its seconds to ``log[name]``."""
    inner = getattr(obj, name)

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            log[name] = log.get(name, 0.0) + time.perf_counter() - start

    setattr(obj, name, call)


def one_run(cfg, steps: int, keep: bool) -> tuple[list[dict], dict]:
    from asyncrl import Controller

    if not keep:
        cfg = cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"gap_metrics": False})})
    return _run(Controller.from_config(cfg), steps, keep)


def _run(ctrl, steps: int, keep: bool) -> tuple[list[dict], dict]:
    import torch

    policy, log, rows = ctrl.policy, {}, []
    if keep:
        for name in ("keep_versions", "logprobs_at"):
            timed(policy, name, log)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        while ctrl.trainer_version < steps:
            before = ctrl.trainer_version
            ctrl.rollout_tick()
            ctrl.train_tick()
            if ctrl.trainer_version > before:
                m = ctrl.metrics.iloc[-1]
                rows.append({"keep": keep, "step": int(m["step"]), **{k: float(m[k]) for k in GAP if k in m},
                             "keep_versions_s": log.pop("keep_versions", 0.0),
                             "logprobs_at_s": log.pop("logprobs_at", 0.0),
                             "kept_bytes": policy.kept_bytes() if hasattr(policy, "kept_bytes") else 0,
                             "kept_versions": len(getattr(policy, "_kept", {}))})
        params = sum(p.numel() * p.element_size() for p in policy.model.parameters()) \
            if hasattr(policy, "model") else None
        facts = {"param_bytes": params, "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    finally:
        ctrl.close()
    return rows, facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quickstart")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ab", action="store_true", help="also run keeping no versions (train_time_s A/B)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    before = meta("bench_gap")
    import pandas as pd

    from asyncrl import load_config
    from asyncrl.cli import parse_overrides

    cfg = load_config(args.preset, **{"eval_every": None, **parse_overrides(args.set)})
    rows, facts = one_run(cfg, args.steps, keep=True)
    if args.ab:
        rows += one_run(cfg, args.steps, keep=False)[0]
    frame = pd.DataFrame(rows)
    kept = frame[frame.keep & (frame.step >= 3)]  # past the warm-up
    med = lambda col, part=kept: float(part[col].median())  # noqa: E731
    results = {
        "preset": args.preset, "overrides": parse_overrides(args.set), "sampler": cfg.sampler.model_dump(),
        "steps": args.steps, **facts,
        "mismatch_kl_median": med("mismatch_kl"), "mismatch_kl_max": float(kept.mismatch_kl.max()),
        "is_mismatch_mean_median": med("is_mismatch_mean"), "is_mismatch_max": float(kept.is_mismatch_max.max()),
        "is_staleness_mean_median": med("is_staleness_mean"), "is_staleness_max": float(kept.is_staleness_max.max()),
        "gap_token_share": float(kept.gap_tokens.sum() / kept.completion_tokens.sum()),
        "train_time_s_median": med("train_time_s"), "keep_versions_s_median": med("keep_versions_s"),
        "logprobs_at_s_median": med("logprobs_at_s"), "kept_bytes_max": int(kept.kept_bytes.max()),
        "kept_versions_max": int(kept.kept_versions.max()),
        "extra_share_of_train_time": (med("keep_versions_s") + med("logprobs_at_s")) / med("train_time_s"),
    }
    if args.ab:
        off = frame[~frame.keep & (frame.step >= 3)]
        results["train_time_s_median_without"] = med("train_time_s", off)
        results["train_time_ratio_with_over_without"] = med("train_time_s") / med("train_time_s", off)
    where = save("bench_gap", frame, results, before=before, out=args.out, name=args.name)
    with pd.option_context("display.width", 220, "display.max_columns", None):
        print(frame.tail(8).to_string(index=False))
    print({k: v for k, v in results.items()})
    print(f"raw rows: {where}")


if __name__ == "__main__":
    main()
