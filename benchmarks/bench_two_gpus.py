"""Synchronous vs asynchronous GRPO on GPUs, repeated: steps/s, each GPU's busy time, the parts of a weight sync,
the two-stage bound, and reward against wall-clock seconds.

    python benchmarks/bench_two_gpus.py --preset gpu_two_devices [--repeats 3] [--steps 40] [--warmup 3] [--out DIR]
    python benchmarks/bench_two_gpus.py --preset gpu_two_devices_gen_heavy --steps 8 --warmup 2   # throughput
    python benchmarks/bench_two_gpus.py --preset gpu_gen_heavy   # one GPU, colocated (CUDA_VISIBLE_DEVICES=0)
    python benchmarks/bench_two_gpus.py --cpu-dry-run            # the same code on CPU: torch backends, 2 actors, gloo
    python benchmarks/bench_two_gpus.py --preset gpu_two_devices --probe group_size=8 --probe group_size=12  # balance

Two modes, the same preset, model, task and seed, from fresh weights each run:
- ``sync``:  ``in_order`` with no lookahead (L=0): synchronous GRPO, generation and training take turns;
- ``async``: ``weight_fifo`` W=1: generation runs one weight version ahead.
The generator (the vLLM engine, the slow part to build) is built once per preset, and so is a policy actor and the
NCCL group between the two; every run after the first rebuilds the policy object (in its actor: fresh weights and
optimizer, same seed, so the same version 0) and a fresh ``Controller`` around the two, whose first sync loads
version 0 into the generator. Runs alternate sync/async, ``--repeats`` times each; each run is
``ctrl.run(warmup)`` then the timed ``ctrl.run(steps)``, no evaluation inside.

Reported per run, and per mode as the median with the spread (min..max) over repeats:
- steps/s over the timed window, and async/sync (the ratio of the two modes' medians);
- each GPU's busy time: the time its engine held the device (``device_lock``: every block of an engine's GPU work,
  device synchronised at its end). Generation: engine steps and weight loads into vLLM; training: logprobs, forward/
  backward, optimizer step, weight export. The weight *transfer* counts on neither (the receiver's NCCL receive is
  outside the engine's blocks; it runs on its own stream while vLLM generates). Idle = 1 - busy / wall.
- the two-stage bound ``(gen + train) / max(gen, train)`` from the stage times of the *sync* runs of the same
  invocation (busy seconds per step of each GPU while the other waits), and async/sync as a fraction of it;
- the weight sync, in parts: the trainer's wait for a push (the controller's ``sync_time_s``: export + transfer +
  what the generator did before answering), and from the generator (``VLLMGenerator.sync_parts``): ``receive_s``
  (the transfer into staging buffers), ``swap_wait_s`` (staged until swapped in between engine steps), ``load_s``
  (``load_weights`` into vLLM) and ``reset_s`` (prefix-cache reset, 0 with the cache off);
- reward against wall-clock seconds since the run began (warm-up included), sync vs async, every repeat
  (``reward_vs_time.png``, ``reward_curves.csv``), and when the async run first reaches (5-step rolling mean) the sync
  run's final reward (mean of its last 5 steps) compared with the sync run's whole wall time.
With ``placement: local`` (one GPU, both engines in this process) the same is measured, and the device lock's wait
times say where the asynchronous run's overlap is lost.

``--set KEY=VALUE`` overrides the preset (dotted key, YAML value: ``--set model.num_hidden_layers=32``).
``--probe KEY=VALUE[,KEY=VALUE...]`` (repeatable) first runs one short synchronous run per candidate on the engine
already built, prints each candidate's stage times, and measures the candidate whose two stage times are closest
(smallest ``|gen - train| / max(gen, train)``); this is how a balanced preset's batch shape was chosen. Candidates
may change only what does not rebuild the engine: batch shape, ``trainer.*``, and of ``generation.*`` only the
per-request sampling settings (``SAMPLING_KEYS``: completion lengths, temperature), which each run hands to the
generator already built.
``--timeline`` records, in repeat 0 of each mode, every driver-side call of both pumps and each GPU's busy blocks on
one clock: a table of milliseconds a step per call, ``timeline_<mode>.csv`` and a picture of six steps
(``timeline_<mode>.png``). It is how the time a step spends on neither GPU was found.
``--async-steps`` lets the asynchronous runs go on for more steps than the synchronous ones (same wall time, so the
reward curves show where each stands when the other stops).
``--baseline KEY=VALUE`` (repeatable) first measures the preset with these overrides too, in a child process of
this invocation (its own engines; ``<out>/baseline/``), e.g. the settings a preset shipped with
(``generation.enforce_eager=true``), and reports the new runs' steps/s and useful training TFLOP/s against it.
``--stream-batches K`` (a generator in this process only) first runs raw vLLM and the generator side by side on the
same requests: K batches of ``groups_per_step`` groups of the preset's shape (its per-group seeds and long-tailed
limits), all submitted at once. *Raw* is one ``LLM.generate`` call over all of them on the generator's own engine
(vLLM refills freed slots as completions end, with no locks, no controller); *generator* is ``submit`` of the same
groups and ``poll(timeout)`` until every one came back (the streaming engine loop, device lock, logprob extraction);
with ``generation.per_group_seed`` off, *raw_seeded* is raw with per-group seeds (what they cost).
Completion tokens per second, ``--stream-reps`` alternating pairs after one warm-up pair; target: the generator
within 10% of raw (``stream.csv``, and ``stream`` in the results).
Files, through ``benchmarks/record.py``, in ``--out`` (default ``$OUT``, else ``benchmarks/data/bench_two_gpus/<UTC
time>``): ``rows.csv`` (one row per run), ``meta.json`` (machine, versions, commit, command and the results above),
``reward_curves.csv``, ``reward_vs_time.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
from record import DATA, meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl import Controller, cli, load_config  # noqa: E402
from asyncrl.algorithms import GRPOLoss  # noqa: E402
from asyncrl.config import merge_overrides  # noqa: E402
from asyncrl.backends import GENERATORS, POLICIES, _load  # noqa: E402
from asyncrl.backends.device_lock import device_lock_stats  # noqa: E402
from asyncrl.backends.hf import load_tokenizer  # noqa: E402
from asyncrl.backends.ray import RemoteBackend, ensure_ray, remote  # noqa: E402
from asyncrl.tasks import build_task  # noqa: E402

SAMPLERS = {
    "sync": {"name": "in_order", "max_lookahead_versions": 0},
    "async": {"name": "weight_fifo", "max_staleness_versions": 1},
}
# Extra async modes on the same engines, each on request: --inflight, async with in-flight weight updates (the
# generator reads generation.weight_update at every load); --no-gap / --gap, async without / with the gap metrics'
# no-grad pass under kept weights (on one GPU it takes the device lock on the train thread: what measuring the gap
# costs there; the one-GPU presets turn it off); --two-threads, async with a thread per pump (pump_threads 2: on one
# GPU, pump_threads auto drives both pumps from one thread); --overlap, async with the trainer's passes beside vLLM's
# decoding on the GPU both share (device_sharing overlap: a thread per pump, backends/device_lock.py).
EXTRA_MODES = {"async_inflight": {"generation": {"weight_update": "inflight"}},
               "async_nogap": {"loss": {"gap_metrics": False}}, "async_gap": {"loss": {"gap_metrics": True}},
               "async_two_threads": {"pump_threads": 2}, "async_overlap": {"device_sharing": "overlap"}}
GEN_ENGINE, TRAIN_ENGINE = ("VLLMGenerator", "TorchGenerator"), ("MegatronPolicy", "TorchPolicy")
GEN_CALLS = ("poll", "generate_greedy", "load_weights")  # CPU dry run: no device lock, the actors' call times
THROUGHPUT_COLUMNS = ("train_tokens", "train_padded_tokens", "train_tflops", "mfu", "gen_tokens_per_s")
TRAIN_CALLS = ("logprobs", "begin_train_step", "train_microbatches", "finish_train_step", "export_weights")


CURVE_EXTRAS = ("entropy", "grad_norm", "is_weight_mean", "is_truncated_frac", "lag_mean",
                # each step's timing and work (per-step tables: bench_trl_gpu.py; asyncrl.metrics says what each is)
                "step_time_s", "train_time_s", "sync_time_s", "sync_bytes", "completion_tokens", "train_tokens",
                "train_flops",
                "train_tflops", "mfu")
SAMPLING_KEYS = {"max_new_tokens", "min_new_tokens_tail", "length_sigma", "temperature", "top_p"}


def say(*args) -> None:
    print(*args, flush=True)


def _lock_stats(host, reset: bool) -> dict:  # runs in an actor (RemoteBackend.apply_remote)
    from asyncrl.backends.device_lock import device_lock_stats as stats

    return stats(reset)


class Engine:
    """Busy seconds of one backend, wherever it runs: the device lock's held time (GPU), else its call times."""

    def __init__(self, backend, engines: tuple, calls: tuple) -> None:
        self.backend, self.engines, self.calls = backend, engines, calls

    def busy(self) -> float:
        if isinstance(self.backend, RemoteBackend):
            import ray

            locks = ray.get(self.backend.apply_remote(_lock_stats, False))
        else:
            locks = device_lock_stats()
        # "<engine> beside": its passes outside the lock (device_sharing overlap) count as its busy time too
        held = sum(v["held_s"] for k, v in locks.items() if k.split(" ")[0] in self.engines)
        if held or not isinstance(self.backend, RemoteBackend):
            return held
        times = self.backend.call_times()
        return sum(times.get(n, (0.0, 0))[0] for n in self.calls)

    def waited(self) -> float:
        locks = device_lock_stats() if not isinstance(self.backend, RemoteBackend) else {}
        return sum(v["waited_s"] for k, v in locks.items() if k in self.engines)


class StampedPolicy:
    """Forwards to the policy; records the wall-clock time at which each optimizer step finished."""

    def __init__(self, policy, t0: float) -> None:
        self._policy, self.t0, self.stamps = policy, t0, []  # its capabilities are the policy's (__getattr__)

    def finish_train_step(self, *args, **kwargs):
        out = self._policy.finish_train_step(*args, **kwargs)
        self.stamps.append(time.perf_counter() - self.t0)
        return out

    def __getattr__(self, name):
        return getattr(self._policy, name)


class Timeline:
    """``--timeline``: where a step's wall time goes. Spans ``(lane, name, start, end)`` in perf_counter seconds
    (CLOCK_MONOTONIC: one clock for the driver and the actors of this host): the driver's calls by pump thread
    (ticks, dispatch, collect, every generation-backend call, every policy call, the weight sync) and each actor's
    GPU blocks (``device_lock_spans``)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []

    def timed(self, name: str, fn):
        import threading

        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                lane = threading.current_thread().name.replace("asyncrl-", "").replace("-pump", "")
                self.spans.append((lane, name, start, time.perf_counter()))
        return call

    def instrument(self, ctrl, stamped: StampedPolicy) -> None:
        for name in ("rollout_tick", "train_tick"):
            setattr(ctrl, name, self.timed(name, getattr(ctrl, name)))
        for name in ("submit", "poll", "abort", "num_inflight"):  # the generation calls the rollout pump makes
            setattr(ctrl.generator, name, self.timed(f"gen.{name}", getattr(ctrl.generator, name)))
        ctrl.sync_weights = self.timed("weight_sync", ctrl.sync_weights)

        def step_done(event) -> None:  # a zero-length span where each step ended (the plot's window marks)
            now = time.perf_counter()
            self.spans.append(("train", "finish_step", now, now))

        ctrl.subscribe(step_done, events="step")
        for name in ("begin_train_step", "train_microbatches", "finish_train_step", "logprobs"):
            setattr(stamped, name, self.timed(f"policy.{name}", getattr(stamped, name)))

    def add_gpu(self, lane: str, spans) -> None:
        self.spans.extend((lane, name, start, end) for name, start, end in spans)

    def frame(self, t0: float, t1: float) -> pd.DataFrame:
        f = pd.DataFrame(self.spans, columns=["lane", "name", "start", "end"])
        f = f[(f.start >= t0) & (f.end <= t1)].copy()
        f["ms"] = 1e3 * (f.end - f.start)
        return f


def _gpu_spans(host) -> list:  # runs in an actor (RemoteBackend.apply_remote)
    from asyncrl.backends.device_lock import device_lock_spans

    return device_lock_spans()


def timeline_report(timeline: Timeline, generator, policy, t0: float, t1: float, steps: int, mode: str,
                    out: Path) -> pd.DataFrame:
    """Per step: milliseconds in each (lane, call), and the share of the window each lane was inside a tick or a
    GPU block; the spans of the window go to ``timeline_<mode>.csv`` and a picture of 6 steps to
    ``timeline_<mode>.png``."""
    from asyncrl.backends.device_lock import device_lock_spans

    local = device_lock_spans()  # colocated: both engines' blocks are this process's, named by engine class
    for lane, backend, names in (("gen GPU", generator, GEN_ENGINE), ("train GPU", policy, TRAIN_ENGINE)):
        if isinstance(backend, RemoteBackend):
            import ray  # only with actors: a colocated run needs no Ray

            timeline.add_gpu(lane, ray.get(backend.apply_remote(_gpu_spans)))
        else:
            timeline.add_gpu(lane, [span for span in local if span[0].split(" ")[0] in names])  # "beside" too
    f = timeline.frame(t0, t1)
    f.assign(start=f.start - t0, end=f.end - t0).to_csv(out / f"timeline_{mode}.csv", index=False)
    table = f.groupby(["lane", "name"]).ms.agg(["count", "sum", "median", "max"])
    table["ms_per_step"] = table["sum"] / steps
    say(f"\ntimeline of one {mode} run ({steps} steps, {1e3 * (t1 - t0) / steps:.1f} ms a step):")
    say(table[["count", "ms_per_step", "median", "max"]].to_string(float_format=lambda x: f"{x:.2f}"))
    _plot_timeline(f, t0, out / f"timeline_{mode}.png", mode)
    return table.reset_index().assign(mode=mode)


def _plot_timeline(f: pd.DataFrame, t0: float, path: Path, mode: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = f[f.name == "finish_step"].sort_values("end")
    if len(steps) < 8:
        return
    lo, hi = steps.end.iloc[1], steps.end.iloc[7]  # six whole steps after the first of the window
    part = f[(f.end > lo) & (f.start < hi)]
    names = sorted(part.name.unique())
    colours = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}
    lanes = ["rollout", "train", "gen GPU", "train GPU"]
    fig, ax = plt.subplots(figsize=(12, 4))
    for y, lane in enumerate(lanes):
        rows = part[part.lane == lane].sort_values("ms", ascending=False)  # enclosing spans first, calls on top
        for r in rows.itertuples():
            h = 0.8 if r.name.endswith("_tick") else 0.5 if "." not in r.name else 0.3
            ax.broken_barh([(1e3 * (r.start - lo), 1e3 * (r.end - r.start))], (y - h / 2, h),
                           color=colours[r.name], edgecolor="black", linewidth=0.2)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("ms")
    ax.set_title(f"{mode}: six steps (driver pumps and each GPU's busy blocks)", fontsize=9)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names], labels=names, fontsize=6,
              ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_overrides(items) -> dict:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``: the CLI's ``--set``."""
    try:
        return cli.parse_overrides(items)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def configs(preset: str, dry: bool, overrides: dict | None = None, extra: tuple[str, ...] = ()):
    overrides = overrides or {}
    base = {"eval_every": None}
    if dry:
        preset = "quickstart"
        base.update(trainer={"placement": "ray"}, generation={"placement": "ray", "weight_sync": "collective"})
    base = merge_overrides(base, overrides)
    out = {m: load_config(preset, sampler=s, **base) for m, s in SAMPLERS.items()}
    for mode in extra:
        out[mode] = load_config(preset, sampler=SAMPLERS["async"], **merge_overrides(base, EXTRA_MODES[mode]))
    return out


def imbalance(gen_s: float, train_s: float) -> float:
    """How far apart two stage times are: ``|gen - train| / max(gen, train)`` (0: equal)."""
    return abs(gen_s - train_s) / max(gen_s, train_s, 1e-12)


def build(cls_name: str, table: dict, args: tuple, section):
    cls = _load(table[cls_name])
    return remote(cls, args, section) if section.placement == "ray" else cls(*args)


def _set_gen_cfg(host, gen_cfg) -> None:  # runs in the generator actor
    host.obj.gen_cfg = gen_cfg


def use_sampling(generator, gen_cfg) -> None:
    """Give the built generator this run's generation section: its per-request sampling settings (``SAMPLING_KEYS``)
    are read from it at every submit; the engine itself is unchanged."""
    if isinstance(generator, RemoteBackend):
        import ray

        ray.get(generator.apply_remote(_set_gen_cfg, gen_cfg))
    else:
        generator.gen_cfg = gen_cfg


def _rebuild(host, cls, args) -> None:  # runs in the policy actor: a fresh policy object, same actor and group
    host.obj.close()
    host.obj = cls(*args)


def fresh_policy(cfg, tok, policy):
    """The policy with fresh weights and optimizer: rebuilt inside its actor, or a new local object."""
    args = (cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok)
    if isinstance(policy, RemoteBackend):
        import ray

        ray.get(policy.apply_remote(_rebuild, _load(POLICIES[cfg.trainer.backend]), args))
        return policy
    if policy is not None:
        policy.close()
    return build(cfg.trainer.backend, POLICIES, args, cfg.trainer)


_SYNCS: dict = {}


def _one_weight_sync_per_pair(cfg, policy, generator):
    """Every run's Controller reuses the first weight sync made for this policy/generator pair (one NCCL group for
    the whole benchmark, as in a long training run), instead of one group per run."""
    policy = getattr(policy, "_policy", policy)  # a run's StampedPolicy: the sync is the wrapped policy's
    key = (id(policy), id(generator), cfg.generation.weight_sync)
    if key not in _SYNCS:
        _SYNCS[key] = _build_weight_sync(cfg, policy, generator)
    return _SYNCS[key]


import asyncrl.backends.weight_sync as _weight_sync  # noqa: E402

_build_weight_sync = _weight_sync.build_weight_sync
_weight_sync.build_weight_sync = _one_weight_sync_per_pair


def one_run(cfg, mode: str, repeat: int, generator, policy, task, tok, warmup: int, steps: int, rebuild: bool,
            timeline_out: Path | None = None):
    t_build = time.perf_counter()
    if rebuild:  # else the policy is the one just built, as this run's config asks
        policy = fresh_policy(cfg, tok, policy)
    generator.poll(0.0)  # nothing of an earlier run may come back under a reused group id
    use_sampling(generator, cfg.generation)
    # The pumps hold the policy they were built with: the stamping wrapper is what the controller is built around.
    stamped = StampedPolicy(policy, time.perf_counter())
    ctrl = Controller(cfg, task, stamped, generator, tok)  # its first sync loads version 0 into the generator
    build_s = time.perf_counter() - t_build
    gen, train = Engine(generator, GEN_ENGINE, GEN_CALLS), Engine(policy, TRAIN_ENGINE, TRAIN_CALLS)
    parts0 = len(generator.sync_parts()) if hasattr(generator, "sync_parts") else 0
    t0 = stamped.t0 = time.perf_counter()
    timeline = Timeline() if timeline_out is not None else None
    if timeline is not None:
        timeline.instrument(ctrl, stamped)
    cuda = _local_cuda(policy)
    if cuda:  # the peak over the run, warm-up included (the first step is where an OOM would happen)
        import torch

        torch.cuda.reset_peak_memory_stats()
    if warmup:
        ctrl.run(warmup, progress=False)
    g0, tr0, w0 = gen.busy(), train.busy(), gen.waited() + train.waited()
    rows0 = len(ctrl.metrics)
    t1 = time.perf_counter()
    ctrl.run(steps, progress=False)
    t2 = time.perf_counter()
    wall = t2 - t1
    g1, tr1, w1 = gen.busy(), train.busy(), gen.waited() + train.waited()
    m = ctrl.metrics.iloc[rows0:]
    if timeline is not None:
        timeline_report(timeline, generator, policy, t1, t2, len(m), mode, timeline_out)
    parts = pd.DataFrame(generator.sync_parts()[parts0:] if hasattr(generator, "sync_parts") else [])
    parts = parts[parts.version > warmup] if len(parts) else parts
    n = len(m)
    row = {
        "run": f"{mode}#{repeat}", "mode": mode, "repeat": repeat, "steps": n, "wall_s": wall,
        "pump_threads": 1 if ctrl.lockstep else 2,
        "steps_per_s": n / wall,
        "gen_busy_per_step_s": (g1 - g0) / n, "train_busy_per_step_s": (tr1 - tr0) / n,
        "gen_gpu_idle": 1 - (g1 - g0) / wall, "train_gpu_idle": 1 - (tr1 - tr0) / wall,
        "device_lock_wait_per_step_s": (w1 - w0) / n,  # colocated only: time an engine waited for the other
        "push_wait_s_median": float(m.sync_time_s.median()), "push_wait_s_max": float(m.sync_time_s.max()),
        "completion_tokens_per_step": float(m.completion_tokens.mean()),
        # throughput the controller reports (asyncrl.metrics): real and padded positions, useful TFLOP/s, MFU
        **{f"{c}_median": float(m[c].median()) if c in m else float("nan") for c in THROUGHPUT_COLUMNS},
        "lag_mean": float(m.lag_mean.mean()), "lag_max": int(m.lag_max.max()),
        "groups_evicted": int(m.groups_evicted.sum()) if "groups_evicted" in m else 0,  # generated, never trained
        "reward_last5": float(ctrl.metrics.reward_mean.tail(5).mean()),
        "build_s": build_s,
        # 6 x parameters x completion tokens over the training GPU's busy time: the useful work rate (no padding)
        "useful_train_tflops": 6 * _parameters(policy) * float(m.completion_tokens.mean())
        / max((tr1 - tr0) / n, 1e-12) / 1e12,
    }
    for part in ("receive_s", "swap_wait_s", "load_s", "reset_s"):
        row[f"sync_{part}_median"] = float(parts[part].median()) if len(parts) else float("nan")
    if cuda:
        import torch

        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        row["memory_plan"] = json.dumps(getattr(policy, "memory_plan", {}) or {})
    curve = pd.DataFrame({"run": row["run"], "mode": mode, "repeat": repeat,
                          "step": ctrl.metrics.step.to_numpy(), "wall_s": stamped.stamps[:len(ctrl.metrics)],
                          "reward": ctrl.metrics.reward_mean.to_numpy()})
    for col in CURVE_EXTRAS:  # what a learning curve's shape is read against (entropy collapse, clipped weights)
        if col in ctrl.metrics:
            curve[col] = ctrl.metrics[col].to_numpy()
    return row, curve, policy


def _local_cuda(policy) -> bool:
    """Whether the policy trains on a CUDA device of this process (its peak memory is this process's)."""
    device = None if isinstance(policy, RemoteBackend) else getattr(policy, "device", None)
    return device is not None and str(device).startswith("cuda")


def _parameters(policy) -> int:
    """The policy's parameter count where it says (a local Megatron or torch policy), else 0."""
    count = None if isinstance(policy, RemoteBackend) else getattr(policy, "num_parameters", None)
    if count is None and not isinstance(policy, RemoteBackend) and hasattr(policy, "model"):
        count = sum(p.numel() for p in policy.model.parameters())
    return int(count or 0)


def time_to_reward(curves: pd.DataFrame) -> dict:
    """Per repeat: the sync run's final reward (last 5 steps), its wall time, and when async first reached it."""
    out = {}
    for r, per in curves.groupby("repeat"):
        s, a = per[per["mode"] == "sync"], per[per["mode"] == "async"]
        if s.empty or a.empty:
            continue
        target = float(s.reward.tail(5).mean())
        rolled = a.reward.rolling(5, min_periods=5).mean()
        hit = a.wall_s[rolled >= target]
        out[int(r)] = {"sync_final_reward": target, "sync_wall_s": float(s.wall_s.iloc[-1]),
                       "async_reaches_it_at_s": float(hit.iloc[0]) if len(hit) else None,
                       "async_final_reward": float(a.reward.tail(5).mean()), "async_wall_s": float(a.wall_s.iloc[-1])}
    return out


def plot(curves: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"sync": "tab:blue", "async": "tab:orange", "async_inflight": "tab:green", "async_nogap": "tab:red",
               "async_gap": "tab:purple", "async_two_threads": "tab:brown", "async_overlap": "tab:olive"}
    for (mode, repeat), per in curves.groupby(["mode", "repeat"]):
        ax.plot(per.wall_s, per.reward.rolling(5, min_periods=1).mean(), color=colours[mode], alpha=0.8,
                label=f"{mode}" if repeat == 0 else None)
    ax.set_xlabel("wall-clock seconds since the run began (warm-up included)")
    ax.set_ylabel("train reward (5-step rolling mean)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(dry: bool) -> dict:
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        env["gpus"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                      "--format=csv,noheader"], capture_output=True, text=True,
                                     timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        env["gpus"] = []
    env.update({k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE")})
    return env


def stream_compare(generator, cfg, task, tok, batches: int, reps: int) -> pd.DataFrame:
    """``--stream-batches``: raw ``LLM.generate`` vs the generator on the same requests (module docstring)."""
    from asyncrl.data import GenerationRequest

    n = batches * cfg.groups_per_step
    prompts = [tok.encode(task.train_prompts[i % len(task.train_prompts)].text) for i in range(n)]
    rows = []  # both sides return only once their GPU work ended (LLM.generate, and poll's device block)
    for rep in range(reps + 1):  # rep 0 warms both up
        # fresh group ids a rep (so fresh seeds and limits), the same ids on both sides (so the same requests)
        requests = [GenerationRequest(1_000_000 * (rep + 1) + i, prompts[i], cfg.group_size) for i in range(n)]
        sides = ("raw", "generator") if rep % 2 == 0 else ("generator", "raw")
        if not generator.per_group_seed:  # what per-group seeds would cost: raw vLLM with them, same requests
            sides += ("raw_seeded",)
        for side in sides:
            t0 = time.perf_counter()
            if side.startswith("raw"):
                unseeded, generator.per_group_seed = generator.per_group_seed, side == "raw_seeded"
                params = [generator._params(r) for r in requests]
                generator.per_group_seed = unseeded
                outs = generator.llm.generate([{"prompt_token_ids": list(r.prompt_ids)} for r in requests], params,
                                              use_tqdm=False)
                tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            else:
                generator.submit(requests)
                got = []
                while len(got) < n:
                    got += generator.poll(timeout=1.0)
                tokens = sum(g.num_tokens for g in got)
            wall = time.perf_counter() - t0
            if rep:
                rows.append({"rep": rep, "side": side, "groups": n, "sequences": n * cfg.group_size,
                             "tokens": tokens, "s": wall, "tok_s": tokens / wall})
                say(f"  stream rep {rep} {side}: {tokens} tokens in {wall:.3f} s = {tokens / wall:.0f} tok/s")
    return pd.DataFrame(rows)


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without the given options (``--flag VALUE`` and ``--flag=VALUE`` forms)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not any(arg.startswith(f + "=") for f in flags):
            out.append(arg)
    return out


def run_baseline(args, out: Path) -> pd.DataFrame | None:
    """``--baseline``: this bench again in a child process with the baseline overrides (its own engines, freed when
    it exits) into ``<out>/baseline``; its rows (one per run), or None if it failed."""
    where = out / "baseline"
    cmd = [sys.executable, str(Path(__file__).resolve()),
           *_without(sys.argv[1:], ("--baseline", "--out", "--stream-batches")), "--out", str(where)]
    for item in args.baseline:
        cmd += ["--set", item]
    say(f"baseline: {' '.join(cmd)}")
    done = subprocess.run(cmd)
    path = where / "rows.csv"
    if done.returncode != 0 or not path.exists():
        say(f"!!! the baseline run failed (exit {done.returncode})")
        return None
    return pd.read_csv(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu_two_devices")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 40; dry run 4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; dry run 1)")
    parser.add_argument("--async-steps", type=int, default=None, help="timed steps of the async runs (default --steps)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the preset (dotted key, YAML value); repeatable")
    parser.add_argument("--probe", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="a candidate batch shape: one short sync run each, the most balanced one is measured")
    parser.add_argument("--probe-steps", type=int, default=10, help="timed steps of each probe run (after --warmup)")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="run directory (default benchmarks/data/bench_two_gpus/<UTC time>)")
    parser.add_argument("--name", default=None, help="name of the run directory under benchmarks/data/bench_two_gpus")
    parser.add_argument("--timeline", action="store_true",
                        help="repeat 0 of each mode also records where each step's time goes (Timeline)")
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--baseline", action="append", default=[], metavar="KEY=VALUE",
                        help="also measure the preset with these overrides (the old settings), first; repeatable")
    parser.add_argument("--stream-batches", type=int, default=0,
                        help="first compare raw vLLM and the generator on this many batches of requests")
    parser.add_argument("--stream-reps", type=int, default=3)
    parser.add_argument("--inflight", action="store_true",
                        help="also run async with generation.weight_update=inflight (mode async_inflight)")
    parser.add_argument("--no-gap", action="store_true",
                        help="also run async with loss.gap_metrics=false (mode async_nogap)")
    parser.add_argument("--gap", action="store_true", help="also run async with loss.gap_metrics=true (mode async_gap)")
    parser.add_argument("--two-threads", action="store_true",
                        help="also run async with a thread per pump (pump_threads=2; mode async_two_threads)")
    parser.add_argument("--overlap", action="store_true",
                        help="also run async with the trainer's passes beside vLLM's decoding on one GPU "
                        "(device_sharing=overlap; mode async_overlap)")
    args = parser.parse_args()
    before = meta("bench_two_gpus")
    dry = args.cpu_dry_run
    steps = args.steps or (4 if dry else 40)
    async_steps = args.async_steps or steps
    warmup = args.warmup if args.warmup is not None else (1 if dry else 3)
    out = Path(args.out) if args.out else DATA / "bench_two_gpus" / (
        args.name or time.strftime("%Y-%m-%dT%H%MZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    overrides = parse_overrides(args.overrides)
    probes = [parse_overrides(p.split(",")) for p in args.probe]
    for probe in probes:
        if "model" in probe or set(probe.get("generation", {})) - SAMPLING_KEYS:
            raise SystemExit(f"a probe may not change the engine (model.*, generation.* other than "
                             f"{sorted(SAMPLING_KEYS)}): {probe}")
    wanted = {"async_inflight": args.inflight, "async_nogap": args.no_gap, "async_gap": args.gap,
              "async_two_threads": args.two_threads, "async_overlap": args.overlap}
    extra = tuple(mode for mode, on in wanted.items() if on)
    cfgs = configs(args.preset, dry, overrides, extra)
    for probe in probes:  # validate every candidate before anything is built
        configs(args.preset, dry, merge_overrides(overrides, probe))
    cfg = cfgs["sync"]
    if "ray" in (cfg.trainer.placement, cfg.generation.placement):
        ensure_ray()
    env = environment(dry)
    label = ("quickstart (CPU dry run)" if dry else args.preset) + "".join(f" {o}" for o in args.overrides)
    say(f"bench_two_gpus {label}: {env}")
    baseline = run_baseline(args, out) if args.baseline else None
    task, tok = build_task(cfg.task), load_tokenizer(cfg.model)
    rows, curves, probed, chosen = [], [], [], {}
    stream, stream_summary = pd.DataFrame(), {}
    # The policy first, then the engine: the order Controller.from_config builds a colocated pair in. The first run
    # uses this policy as built; every later run rebuilds it (fresh weights and optimizer).
    t0 = time.perf_counter()
    policy = build(cfg.trainer.backend, POLICIES, (cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok),
                   cfg.trainer)
    say(f"policy built in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    generator = build(cfg.generation.backend, GENERATORS, (cfg.model, cfg.generation, cfg.seed, tok), cfg.generation)
    say(f"generator built in {time.perf_counter() - t0:.1f} s; build timings: "
        f"{getattr(generator, 'build_timings', None) if not isinstance(generator, RemoteBackend) else 'in its actor'}")
    try:
        if args.stream_batches and not isinstance(generator, RemoteBackend):
            say(f"\nraw vLLM vs the generator: {args.stream_batches} batches of {cfg.groups_per_step} groups at once")
            stream = stream_compare(generator, cfg, task, tok, args.stream_batches, args.stream_reps)
            per = stream.pivot(index="rep", columns="side", values="tok_s")
            ratio = float((per["generator"] / per["raw"]).median())
            stream_summary = {"tok_s_raw": float(per["raw"].median()), "tok_s_generator": float(per["generator"].median()),
                              "generator_over_raw": ratio, "per_rep": (per["generator"] / per["raw"]).tolist(),
                              **({"tok_s_raw_seeded": float(per["raw_seeded"].median())} if "raw_seeded" in per else {}),
                              "same_tokens": bool(stream.groupby("rep").tokens.nunique().eq(1).all()),
                              "target_met": ratio >= 0.9}
            say(f"stream: generator / raw = {ratio:.3f} (target >= 0.9): {json.dumps(stream_summary)}")
        for i, probe in enumerate(probes):
            pcfg = configs(args.preset, dry, merge_overrides(overrides, probe))["sync"]
            row, _, policy = one_run(pcfg, "sync", -1 - i, generator, policy, task, tok, warmup, args.probe_steps,
                                     rebuild=i > 0 or pcfg.trainer != cfg.trainer)
            probed.append({"probe": probe, "steps_per_s": row["steps_per_s"], "gen_s": row["gen_busy_per_step_s"],
                           "train_s": row["train_busy_per_step_s"],
                           "imbalance": imbalance(row["gen_busy_per_step_s"], row["train_busy_per_step_s"])})
            say(f"  probe {probe}: sync {row['steps_per_s']:.4g} steps/s, generation "
                f"{row['gen_busy_per_step_s']:.4g} s, training {row['train_busy_per_step_s']:.4g} s a step, imbalance {probed[-1]['imbalance']:.2f}")
        if probed:
            chosen = min(probed, key=lambda p: p["imbalance"])["probe"]
            cfgs = configs(args.preset, dry, merge_overrides(overrides, chosen), extra)
            say(f"measuring the most balanced probe: {chosen}")
            label += " " + ",".join(args.probe[[p["probe"] for p in probed].index(chosen)].split(","))
        for r in range(args.repeats):
            for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")) + extra:
                n = async_steps if mode == "async" else steps
                rebuild = bool(probed or rows) or cfgs[mode].trainer != cfg.trainer
                row, curve, policy = one_run(cfgs[mode], mode, r, generator, policy, task, tok, warmup, n, rebuild,
                                             out if args.timeline and r == 0 else None)
                rows.append(row)
                curves.append(curve)
                say(f"  {row['run']}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                    for k, v in row.items() if k not in ("run", "mode", "repeat")))
    finally:
        for backend in (generator, policy):
            if backend is not None:
                backend.close()
    runs = pd.DataFrame(rows)
    curves = pd.concat(curves, ignore_index=True)
    cols = ["steps_per_s", "gen_busy_per_step_s", "train_busy_per_step_s", "gen_gpu_idle", "train_gpu_idle",
            "device_lock_wait_per_step_s", "push_wait_s_median", "push_wait_s_max", "sync_receive_s_median",
            "sync_swap_wait_s_median", "sync_load_s_median", "sync_reset_s_median", "completion_tokens_per_step",
            *(f"{c}_median" for c in THROUGHPUT_COLUMNS), "lag_max", "groups_evicted", "reward_last5", "useful_train_tflops"]
    summary = runs.groupby("mode")[cols].agg(["median", "min", "max"])
    med = runs.groupby("mode")[cols].median()
    sync_gen, sync_train = med.loc["sync", "gen_busy_per_step_s"], med.loc["sync", "train_busy_per_step_s"]
    bound = (sync_gen + sync_train) / max(sync_gen, sync_train)
    ratio = med.loc["async", "steps_per_s"] / med.loc["sync", "steps_per_s"]
    per_repeat = runs.pivot(index="repeat", columns="mode", values="steps_per_s")
    ratios = (per_repeat["async"] / per_repeat["sync"]).tolist()
    reach = time_to_reward(curves)
    say("\n" + med.T.to_string(float_format=lambda x: f"{x:.4g}"))
    say(f"\nsteps/s median (min..max): sync {med.loc['sync', 'steps_per_s']:.4g} "
        f"({summary.loc['sync', ('steps_per_s', 'min')]:.4g}..{summary.loc['sync', ('steps_per_s', 'max')]:.4g}), "
        f"async {med.loc['async', 'steps_per_s']:.4g} ({summary.loc['async', ('steps_per_s', 'min')]:.4g}.."
        f"{summary.loc['async', ('steps_per_s', 'max')]:.4g})")
    say(f"async/sync: {ratio:.3f} (per repeat {', '.join(f'{x:.3f}' for x in ratios)})")
    extra_over_sync = {mode: {"median": med.loc[mode, "steps_per_s"] / med.loc["sync", "steps_per_s"],
                              "per_repeat": (per_repeat[mode] / per_repeat["sync"]).tolist()} for mode in extra}
    for mode, r in extra_over_sync.items():
        say(f"{mode}/sync: {r['median']:.3f} (per repeat {', '.join(f'{x:.3f}' for x in r['per_repeat'])})")
    say(f"stage times in the sync runs: generation {sync_gen:.4g} s, training {sync_train:.4g} s a step "
        f"(train/gen {sync_train / sync_gen:.2f}, imbalance {imbalance(sync_gen, sync_train):.2f}); two-stage bound "
        f"{bound:.3f}; async/sync = {ratio / bound:.0%} of it")
    say(f"time to the sync run's final reward: {json.dumps(reach)}")
    versus = {}
    if baseline is not None:
        old = baseline.groupby("mode")[["steps_per_s", "useful_train_tflops"]].median()
        for mode in ("sync", "async"):
            versus[f"{mode}_steps_per_s_over_baseline"] = float(med.loc[mode, "steps_per_s"] / old.loc[mode, "steps_per_s"])
        versus["useful_train_tflops_over_baseline"] = float(
            runs.useful_train_tflops.median() / baseline.useful_train_tflops.median())
        versus["baseline"] = {"overrides": args.baseline, "steps_per_s": old.steps_per_s.to_dict(),
                              "useful_train_tflops": old.useful_train_tflops.to_dict()}
        say(f"against the baseline {args.baseline}: {json.dumps(versus)}")
    plot(curves, out / "reward_vs_time.png", f"{label}: sync (in_order L=0) vs async (weight_fifo W=1)")
    save("bench_two_gpus", runs, {
        "environment": env, "label": label, "preset": "quickstart" if dry else args.preset,
        "overrides": merge_overrides(overrides, chosen), "invocation_overrides": overrides, "probes": probed,
        "chosen_probe": chosen, "steps": steps, "async_steps": async_steps, "warmup": warmup, "repeats": args.repeats,
        "async_over_sync": ratio, "async_over_sync_per_repeat": ratios, "extra_modes_over_sync": extra_over_sync,
        "two_stage_bound": bound,
        "fraction_of_bound": ratio / bound, "stage_gen_s": sync_gen, "stage_train_s": sync_train,
        "stage_imbalance": imbalance(sync_gen, sync_train),
        "time_to_sync_final_reward": reach, "summary": json.loads(summary.to_json()),
        "stream": stream_summary, "versus_baseline": versus,
        "build_timings": getattr(generator, "build_timings", None) if not isinstance(generator, RemoteBackend) else None},
        before=before, out=out, files={"reward_curves.csv": curves, **({"stream.csv": stream} if len(stream) else {})})
    say(f"raw data: {out} (rows.csv: one row per run; meta.json; reward_curves.csv, reward_vs_time.png)"
        + ("  (CPU dry run: numbers mean nothing)" if dry else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
