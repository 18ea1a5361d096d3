"""An 8B-shaped model with LoRA on one GPU (the ``gpu_lora_8b`` preset): synchronous and asynchronous steps/s, the
adapter-only weight sync against the full-weights sync at the 0.5B shape, and peak memory, in one invocation.

    python benchmarks/bench_lora_gpu.py --preset gpu_lora_8b [--steps 4] [--warmup 3] [--syncs 5] [--out DIR]
    python benchmarks/bench_lora_gpu.py --cpu-dry-run      # the same code on CPU: tiny Qwen3 / Qwen2 directories

What runs, in order, in this one process (one GPU); the run directory is written after each part, so a call cut
short keeps what was measured (``results.complete`` false):
1. **The 8B directory**: a randomly initialised Qwen3-8B-shaped model built on the GPU in bf16 and written to
   ``model.hf_path`` (``model_dirs.py``; kept if already there; ~1-3 min).
2. **The LoRA runs**: the preset's policy (torch engine, LoRA, gradient checkpointing) and generator (vLLM, one
   adapter per weight version) built once; ``sync`` (``in_order`` L=0) then ``async`` (the preset's
   ``weight_fifo`` W=1) through ``bench_two_gpus.one_run``: ``--warmup`` steps then ``--steps`` timed ones each
   (an even number: one GPU's steps alternate slower and faster, benchmarks/README.md). Between the two the policy
   goes back to its first state (adapter and optimizer; the frozen base is not reloaded). Steps/s over the timed
   window, async/sync, the device lock's busy time of each engine, ``sync_time_s`` and ``sync_bytes`` (the metrics),
   and ``torch.cuda.max_memory_allocated`` over each run (vLLM's pool and the trainer together: one process).
3. **The adapter sync at 8B**: ``--syncs`` syncs through ``AdapterWeightSync`` (export, write the peft directory,
   ``add_lora``), each timed (ms, device synchronised) with its bytes. The 8B engines are closed after.
4. **The full-weights sync at the 0.5B shape**: bench_trl_gpu.py's Qwen2.5-0.5B-shaped directory
   (``model_dirs.py``; kept if already there), the torch engine on CUDA (no LoRA) and a vLLM engine (eager, a small
   KV pool) on it, then ``--syncs`` weight syncs through the driver (``DriverWeightSync``: ``export_weights`` and
   vLLM's in-place load), timed as in 3: ``results.sync_ms`` and ``sync_bytes`` of each kind, and their ratios.

Time on one H100, estimated (nothing measured yet): start and imports ~30 s, the 8B directory ~60-180 s, the 8B
policy ~30 s and vLLM engine with LoRA and CUDA graphs ~90-120 s, 2 x (3 + 4) steps at ~6-15 s = 85-210 s, the
adapter syncs ~5 s, the 0.5B part ~60-80 s (directory 25 s, an eager vLLM build ~30 s): 6-10 minutes. ``--steps 4 --warmup 3`` is
run_gpu.sh's ``lora`` part; with more time, 8 timed steps a mode.
Files, through ``benchmarks/record.py``, in ``--out`` (default ``$OUT``, else ``benchmarks/data/bench_lora_gpu/<UTC>``):
``rows.csv`` (one row per mode), ``syncs.csv`` (every timed sync), ``steps.csv`` (every step's metrics row),
``meta.json`` (machine with its GPU, the command naming the preset, and ``results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
from model_dirs import build_model_dir
from record import meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_two_gpus as b2  # noqa: E402

from asyncrl import load_config  # noqa: E402
from asyncrl.algorithms import GRPOLoss  # noqa: E402
from asyncrl.backends import GENERATORS, POLICIES  # noqa: E402
from asyncrl.backends.hf import load_tokenizer  # noqa: E402
from asyncrl.backends.weight_sync import AdapterWeightSync, DriverWeightSync  # noqa: E402
from asyncrl.config import merge_overrides  # noqa: E402
from asyncrl.tasks import build_task  # noqa: E402

FULL_SHAPE = "qwen2_0_5b"  # the full-weights sync's model: bench_trl_gpu.py's directory
STEP_COLUMNS = ("step", "step_time_s", "train_time_s", "sync_time_s", "sync_bytes", "completion_tokens",
                "train_tokens", "train_tflops", "reward", "lag_mean")


def say(*args) -> None:
    print(*args, flush=True)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _close(*backends) -> None:
    import torch

    for backend in backends:
        backend.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_syncs(sync, n: int, shape: str, kind: str, first_version: int) -> list[dict]:
    """``n`` syncs of ``sync`` (versions from ``first_version``), each's milliseconds (device synchronised) and bytes."""
    rows = []
    for i in range(n):
        _synchronize()
        t0 = time.perf_counter()
        sync(first_version + i)
        _synchronize()
        rows.append({"shape": shape, "kind": kind, "sync": i, "sync_ms": 1e3 * (time.perf_counter() - t0),
                     "sync_bytes": int(sync.last_bytes)})
    return rows


def full_weights_syncs(args, dry: bool) -> list[dict]:
    """Part 4 (module docstring): the driver's full-weights sync at the 0.5B shape, torch engine -> vLLM."""
    model_dir = build_model_dir(args.full_model_dir, "tiny_qwen2" if dry else FULL_SHAPE)
    over = {"eval_every": None, "model": {"hf_path": str(model_dir)},
            "trainer": {"backend": "torch", "device": "cpu" if dry else "cuda"},
            "generation": {"backend": "torch", "device": "cpu"} if dry else  # dry: merged weights into torch
            {"enforce_eager": True, "kv_cache_tokens": 16384, "weight_update": "drain",
             "gpu_memory_utilization": 0.1}}  # after the 8B engines: a small start-up check
    if dry:
        over["model"]["dtype"] = "float32"
    cfg = load_config("gpu_real_shape", **over)
    tok = load_tokenizer(cfg.model)
    policy = b2.build(cfg.trainer.backend, POLICIES, (cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok),
                      cfg.trainer)
    generator = b2.build(cfg.generation.backend, GENERATORS, (cfg.model, cfg.generation, cfg.seed, tok),
                         cfg.generation)
    try:
        sync = DriverWeightSync(policy, generator)
        sync(0)  # the first load wraps vLLM's loaders: untimed
        return timed_syncs(sync, args.syncs, "tiny_qwen2" if dry else FULL_SHAPE, "full_weights", 1)
    finally:
        _close(generator, policy)


def lora_configs(args, dry: bool) -> dict:
    over = merge_overrides({"eval_every": None}, b2.parse_overrides(args.overrides))
    if dry:  # the torch engines on the CPU, a tiny Qwen3 directory, a small batch
        over = merge_overrides(over, {"groups_per_step": 4, "model": {"dtype": "float32"},
                                      "generation": {"backend": "torch", "device": "cpu", "max_new_tokens": 8},
                                      "trainer": {"device": "cpu", "micro_batch_tokens": 512}})
    sampler = load_config(args.preset, **over).sampler.model_dump()
    return {"sync": load_config(args.preset, **merge_overrides(over, {"sampler": b2.SAMPLERS["sync"]})),
            "async": load_config(args.preset, **merge_overrides(over, {"sampler": sampler}))}


def lora_runs(args, dry: bool, on_mode) -> tuple[list[dict], list[dict], pd.DataFrame, dict]:
    """Parts 1-3 (module docstring): the 8B directory, sync and async runs, the adapter's timed syncs;
    ``on_mode(rows, steps, timings)`` after each mode (the bench writes what it has: a call cut short keeps it)."""
    import torch

    cfgs = lora_configs(args, dry)
    cfg = cfgs["sync"]
    t0 = time.perf_counter()
    build_model_dir(cfg.model.hf_path, "tiny_qwen3" if dry else "qwen3_8b", device="cpu" if dry else "cuda")
    timings = {"model_dir_s": time.perf_counter() - t0}
    say(f"model directory {cfg.model.hf_path}: {timings['model_dir_s']:.0f} s")
    task, tok = build_task(cfg.task), load_tokenizer(cfg.model)
    t0 = time.perf_counter()
    policy = b2.build(cfg.trainer.backend, POLICIES, (cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok),
                      cfg.trainer)
    timings["policy_build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    generator = b2.build(cfg.generation.backend, GENERATORS, (cfg.model, cfg.generation, cfg.seed, tok),
                         cfg.generation)
    timings["generator_build_s"] = time.perf_counter() - t0
    say(f"built: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    first = policy.state_dict()  # the adapter and the optimizer as built: each mode starts from them
    rows, steps, syncs = [], [], []
    try:
        for i, mode in enumerate(("sync", "async")):
            if i:
                policy.load_state_dict(first)
            row, curve, policy = b2.one_run(cfgs[mode], mode, 0, generator, policy, task, tok, args.warmup,
                                            args.steps, False)
            m = curve[curve.step >= args.warmup]  # the timed steps' metrics (bench_two_gpus.CURVE_EXTRAS)
            row.update({"sync_time_s_median": float(m.sync_time_s.median()),
                        "sync_bytes_median": float(m.sync_bytes.median()) if "sync_bytes" in m else float("nan")})
            rows.append(row)
            steps.append(m[[c for c in STEP_COLUMNS if c in m]].assign(mode=mode))
            say(f"  {mode}: {row['steps_per_s']:.4f} steps/s, sync {1e3 * row['sync_time_s_median']:.0f} ms "
                f"{row['sync_bytes_median'] / 1e6:.1f} MB, peak {row.get('peak_allocated_gib', 0):.1f} GiB")
            on_mode(rows, steps, timings)
        if isinstance(generator, b2.RemoteBackend) or cfg.generation.backend != "vllm":
            sync = DriverWeightSync(policy, generator)  # dry run: the torch generator takes merged weights
        else:
            sync = AdapterWeightSync(policy, generator)
        syncs = timed_syncs(sync, args.syncs, "tiny_qwen3" if dry else "qwen3_8b",
                            "adapter" if isinstance(sync, AdapterWeightSync) else "merged", 10_000)
        if torch.cuda.is_available() and not dry:
            timings["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        _close(generator, policy)
    return rows, syncs, pd.concat(steps, ignore_index=True), timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu_lora_8b")
    parser.add_argument("--steps", type=int, default=None, help="timed steps a mode (default 4; even)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs of each kind")
    parser.add_argument("--full-model-dir", default="/tmp/qwen", help="the 0.5B directory (bench_trl_gpu's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    dry = args.cpu_dry_run
    args.steps = args.steps if args.steps is not None else (2 if dry else 4)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 3)
    if args.steps % 2:
        parser.error(f"--steps {args.steps}: use an even number (one GPU's steps alternate slower and faster)")
    if dry:
        args.full_model_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), "asyncrl-bench-lora-tiny-qwen2")
        args.overrides = [*args.overrides, "model.hf_path=" + os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                                           "asyncrl-bench-lora-tiny-qwen3")]
    before = meta("bench_lora_gpu")
    t_all = time.perf_counter()
    rows, adapter, steps, timings = lora_runs(  # the 8B runs first: what a call cut short must keep
        args, dry, lambda rows, steps, timings: write(args, before, [], rows, [], steps, timings, t_all))
    write(args, before, [], rows, adapter, [steps], timings, t_all)
    try:
        full = full_weights_syncs(args, dry)
    except Exception as exc:  # noqa: BLE001 - the 8B figures stand without it; the error is recorded
        say(f"the full-weights sync at the 0.5B shape failed: {exc!r}")
        timings["full_weights_error"] = repr(exc)[:500]
        write(args, before, [], rows, adapter, [steps], timings, t_all)
        return 1
    say(f"full-weights sync at the 0.5B shape: {pd.DataFrame(full).sync_ms.median():.0f} ms, "
        f"{full[0]['sync_bytes'] / 1e6:.0f} MB")
    out = write(args, before, full, rows, adapter, [steps], timings, t_all, final=True)
    say(f"wrote {out}")
    return 0


def write(args, before: dict, full: list, rows: list, adapter: list, steps: list, timings: dict, t_all: float,
          final: bool = False) -> Path:
    """The run directory with what is measured so far (``results.complete`` says whether all of it is)."""
    by_mode = {r["mode"]: r for r in rows}
    syncs = pd.DataFrame(full + adapter, columns=["shape", "kind", "sync", "sync_ms", "sync_bytes"])
    med = syncs.groupby("kind").agg(sync_ms=("sync_ms", "median"), sync_bytes=("sync_bytes", "median"))
    results = {
        "preset": args.preset, "steps": args.steps, "warmup": args.warmup, "syncs": args.syncs,
        "dry_run": args.cpu_dry_run, "complete": final,
        "steps_per_s": {m: r["steps_per_s"] for m, r in by_mode.items()},
        "sync_ms": {k: float(v) for k, v in med.sync_ms.items()},
        "sync_bytes": {k: int(v) for k, v in med.sync_bytes.items()},
        "run_sync_time_s_median": {m: r["sync_time_s_median"] for m, r in by_mode.items()},
        "run_sync_bytes_median": {m: r["sync_bytes_median"] for m, r in by_mode.items()},
        "peak_allocated_gib": {m: r.get("peak_allocated_gib", float("nan")) for m, r in by_mode.items()},
        "timings_s": {**timings, "total_s": time.perf_counter() - t_all},
    }
    if {"sync", "async"} <= set(by_mode):
        results["async_over_sync"] = by_mode["async"]["steps_per_s"] / by_mode["sync"]["steps_per_s"]
    if adapter and full:
        kind = adapter[0]["kind"]
        results["sync_ms_over_full_weights"] = float(med.sync_ms[kind] / med.sync_ms["full_weights"])
        results["sync_bytes_over_full_weights"] = float(med.sync_bytes[kind] / med.sync_bytes["full_weights"])
    if final:
        table = pd.DataFrame([{"mode": m, "steps/s": r["steps_per_s"], "gen busy s/step": r["gen_busy_per_step_s"],
                               "train busy s/step": r["train_busy_per_step_s"],
                               "sync ms (run)": 1e3 * r["sync_time_s_median"],
                               "sync MB": r["sync_bytes_median"] / 1e6,
                               "peak GiB": r.get("peak_allocated_gib", float("nan"))} for m, r in by_mode.items()])
        say(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        say(med.assign(sync_MB=med.sync_bytes / 1e6).drop(columns="sync_bytes").to_string(
            float_format=lambda x: f"{x:.1f}"))
        say(f"async/sync {results['async_over_sync']:.2f}x; {adapter[0]['kind']} sync "
            f"{results['sync_ms_over_full_weights']:.2f}x the full-weights sync's ms at the 0.5B shape, "
            f"{results['sync_bytes_over_full_weights']:.4f}x its bytes")
    steps_frame = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame()
    return save("bench_lora_gpu", pd.DataFrame(rows), results, before=before, out=args.out,
                files={"syncs.csv": syncs, "steps.csv": steps_frame})


if __name__ == "__main__":
    raise SystemExit(main())
