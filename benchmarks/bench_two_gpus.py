"""Two GPUs: vLLM generation on one, Megatron-core training on the other (Ray actors), weights over NCCL.

    python benchmarks/bench_two_gpus.py [--steps 40] [--warmup 3] [--out DIR] [--driver-sync]   # nvidia-h200-x2
    python benchmarks/bench_two_gpus.py --cpu-dry-run     # the same code on CPU: torch backends, two actors, gloo

The ``gpu_two_devices`` preset (placement ray for both backends, ``weight_sync: collective``), the same model, task
and seed, run from fresh weights under two samplers for the same number of steps:
- ``sync``:  ``in_order`` with no lookahead (L=0): synchronous GRPO, the GPUs take turns;
- ``async``: ``weight_fifo`` W=1: generation runs one weight version ahead, the GPUs overlap.
(``--driver-sync`` adds ``async`` once more with ``weight_sync: driver``: the weights through this process.)

Each run is a fresh ``Controller`` (two fresh actors, a fresh process group), ``ctrl.run(warmup)``, then the timed
``ctrl.run(steps)`` with no evaluation inside the timed window (``eval_every`` off; one ``evaluate()`` at the end).
Reported per run:
- steps/s over the timed window, and async/sync;
- tokens/s per GPU: the generation GPU's generated completion tokens (counted from what ``poll`` returned) and the
  training GPU's trained completion tokens, per wall second;
- the fraction of the window each GPU was idle: 1 - busy/wall, where *busy* is the time the actor spent inside
  its backend calls, as the actor timed them (``RemoteBackend.call_times``): generation = ``poll`` (vLLM runs a
  wave inside it; no background thread in this preset) + the weight receive-and-load; training = ``logprobs`` +
  ``begin/train_microbatches/finish_train_step`` + the weight transfer (the receive time, counted on both sides:
  the sender's own call also includes waiting for the generator to finish its wave, which is idle time);
- weight-sync time: the controller's ``sync_time_s`` (median, max), and the two actors' send / receive times;
- the reward curves side by side (``reward_curves.csv``), the mean of the last 5 steps, held-out accuracy.
Files under ``--out`` (default ``$OUT`` or ``runs/bench_two_gpus``): ``results.json``, ``runs.csv``,
``reward_curves.csv``.

``--cpu-dry-run``: the ``quickstart`` preset's torch backends in two Ray actors on the CPU with ``weight_sync:
collective`` over gloo, small step count. It proves the script and the code path; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl import Controller, load_config  # noqa: E402
from asyncrl.backends.ray import ensure_ray  # noqa: E402

SAMPLERS = {
    "sync": {"name": "in_order", "max_lookahead_versions": 0},
    "async": {"name": "weight_fifo", "max_staleness_versions": 1},
}
GEN_BUSY = ("poll", "generate_greedy", "_receive", "load_weights")  # load_weights: driver sync
TRAIN_BUSY = ("logprobs", "begin_train_step", "train_microbatches", "finish_train_step", "export_weights")


def say(*args) -> None:
    print(*args, flush=True)


class CountingGenerator:
    """Forwards to the generator proxy; counts the completion tokens ``poll`` returns (the generation GPU's work)."""

    def __init__(self, generator) -> None:
        self._generator = generator
        self.tokens = 0

    def poll(self, *args, **kwargs):
        groups = self._generator.poll(*args, **kwargs)
        self.tokens += sum(g.num_tokens for g in groups)
        return groups

    def __getattr__(self, name):
        return getattr(self._generator, name)


def config(dry: bool, mode: str, weight_sync: str):
    sampler = SAMPLERS[mode]
    if dry:
        return load_config("quickstart", sampler=sampler, eval_every=None,
                           trainer={"placement": "ray"}, generation={"placement": "ray", "weight_sync": weight_sync})
    return load_config("gpu_two_devices", sampler=sampler, eval_every=None, generation={"weight_sync": weight_sync})


def busy(times: dict, names: tuple) -> float:
    return sum(times.get(n, (0.0, 0))[0] for n in names)


def delta(after: dict, before: dict) -> dict:
    return {k: (v[0] - before.get(k, (0.0, 0))[0], v[1] - before.get(k, (0.0, 0))[1]) for k, v in after.items()}


def one_run(dry: bool, mode: str, weight_sync: str, warmup: int, steps: int) -> tuple[dict, pd.DataFrame]:
    label = mode if weight_sync == "collective" else f"{mode}+driver_sync"
    t0 = time.perf_counter()
    ctrl = Controller.from_config(config(dry, mode, weight_sync))
    build_s = time.perf_counter() - t0
    with ctrl:
        counter = ctrl.generator = CountingGenerator(ctrl.generator)  # the sync keeps its own handle on the actor
        if warmup:
            ctrl.run(warmup, progress=False)
        gen0, pol0 = ctrl.generator.call_times(), ctrl.policy.call_times()
        tok0, rows0 = counter.tokens, len(ctrl.metrics)
        t0 = time.perf_counter()
        ctrl.run(steps, progress=False)
        wall = time.perf_counter() - t0
        gen, pol = delta(ctrl.generator.call_times(), gen0), delta(ctrl.policy.call_times(), pol0)
        m = ctrl.metrics.iloc[rows0:]
        trained_tokens = float((m.tokens_per_s * m.step_time_s).sum())
        transfer = gen.get("_receive", (0.0, 0))[0]  # both sides hold the transfer; the receiver's time is the transfer
        ev = ctrl.evaluate()
        ws = ctrl.sync_weights
        params = sum(math.prod(shape) for _, shape, _ in getattr(ws, "meta", [])) or None
        row = {
            "run": label, "sampler": SAMPLERS[mode]["name"], "weight_sync": weight_sync, "steps": len(m),
            "wall_s": wall, "steps_per_s": len(m) / wall,
            "gen_tokens_per_s": (counter.tokens - tok0) / wall, "train_tokens_per_s": trained_tokens / wall,
            "gen_gpu_idle": 1 - busy(gen, GEN_BUSY) / wall,
            "train_gpu_idle": 1 - (busy(pol, TRAIN_BUSY) + (transfer if weight_sync == "collective" else 0)) / wall,
            "sync_s_median": float(m.sync_time_s.median()), "sync_s_max": float(m.sync_time_s.max()),
            "send_s_mean": pol.get("_send", (0.0, 0))[0] / max(pol.get("_send", (0.0, 1))[1], 1),
            "receive_s_mean": transfer / max(gen.get("_receive", (0.0, 1))[1], 1),
            "lag_mean": float(m.lag_mean.mean()), "lag_max": int(m.lag_max.max()),
            "groups_evicted": int(m.groups_evicted.sum()), "groups_aborted": int(m.groups_aborted.sum()),
            "reward_last5": float(ctrl.metrics.reward_mean.tail(5).mean()),
            "eval_accuracy": ev["accuracy"], "eval_reward": ev["reward_mean"],
            "build_s": build_s, "params": params,
            "sync_bytes_per_step": getattr(ws, "bytes_sent", 0) / max(getattr(ws, "syncs", 1), 1),
        }
        curve = ctrl.metrics[["step", "reward_mean"]].rename(columns={"reward_mean": label}).set_index("step")
    return row, curve


def environment(dry: bool) -> dict:
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "kind": "cpu dry run" if dry else "nvidia-h200-x2 (intended)"}
    try:
        import torch

        env["torch"] = torch.__version__
        env["gpus"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        env["gpus"] = []
    env.update({k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")})
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 40; dry run 4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; dry run 1)")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/bench_two_gpus"))
    parser.add_argument("--driver-sync", action="store_true", help="also run async with weight_sync: driver")
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    dry = args.cpu_dry_run
    steps = args.steps or (4 if dry else 40)
    warmup = args.warmup if args.warmup is not None else (1 if dry else 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Multicast off in this process too (the actors get it from asyncrl.backends.ray either way).
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    ensure_ray()
    env = environment(dry)
    say(f"bench_two_gpus: {env}")
    plan = [("sync", "collective"), ("async", "collective")] + ([("async", "driver")] if args.driver_sync else [])
    rows, curves = [], []
    for mode, weight_sync in plan:
        say(f"-- {mode} ({SAMPLERS[mode]['name']}), weight_sync {weight_sync}: {warmup} warm-up + {steps} timed steps")
        row, curve = one_run(dry, mode, weight_sync, warmup, steps)
        rows.append(row)
        curves.append(curve)
        say("   " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    runs = pd.DataFrame(rows).set_index("run")
    curves = pd.concat(curves, axis=1)
    ratio = runs.loc["async", "steps_per_s"] / runs.loc["sync", "steps_per_s"]
    cols = ["steps_per_s", "gen_tokens_per_s", "train_tokens_per_s", "gen_gpu_idle", "train_gpu_idle",
            "sync_s_median", "send_s_mean", "receive_s_mean", "lag_max", "reward_last5", "eval_accuracy"]
    say("\n" + runs[cols].to_string(float_format=lambda x: f"{x:.4g}"))
    say(f"\nasync/sync steps/s: {ratio:.2f}  (goal >= 1.6 with equal reward at the end)")
    say("\nreward curves (mean train reward per step):\n" + curves.to_string(float_format=lambda x: f"{x:.3f}"))
    runs.to_csv(out / "runs.csv")
    curves.to_csv(out / "reward_curves.csv")
    (out / "results.json").write_text(json.dumps(
        {"environment": env, "steps": steps, "warmup": warmup, "async_over_sync": ratio,
         "runs": runs.reset_index().to_dict(orient="records")}, indent=1, default=str))
    say(f"\nwrote {out}/results.json, runs.csv, reward_curves.csv"
        + ("  (CPU dry run: numbers mean nothing)" if dry else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
