"""Where the time of a GRPO step goes on CPU, how much overlap that allows, and how close each way of running gets.

    python benchmarks/bench_async.py [--preset quickstart] [--steps 100] [--repeats 2] [--threads 1]

Prints three tables (about 2-3 minutes on 2 quiet cores):
1. Stage times of a stepped synchronous step (``in_order`` L=0, in-process backends), mean ms per step, from the
   fastest repeat of the ``stepped sync`` mode itself: generation (``generator.poll``), scoring + commit (decode,
   reward, buffer), the rollout tick's own work, old-policy logprobs (0 when the policy takes them from its
   training forward), forward/backward, optimizer step, weight sync, the train tick's own work. The rollout
   stage is the rollout tick, the train stage the train tick; the two-stage bound is
   ``(gen + train) / max(gen, train)``: the most any overlap of the two can gain over doing them in turn.
2. The interpreter lock: a generation call and a training call, each alone and beside a pure-Python spinner
   thread. The spinner runs only while the call releases the lock (torch releases it inside each op), so one
   minus its rate beside the call, as a fraction of its rate alone, is the share of the time the call holds the
   lock. The switch interval is cut to 10 µs meanwhile, or the call would wait 5 ms to get the lock back after each
   op (the slowdown column shows what is left of that). Then generation and training at once: in two threads, and
   with generation in a child process, against one after the other.
3. Modes, alternating ``--repeats`` times so machine noise hits all: stepped synchronous; synchronous ``run``
   (``in_order`` L=0); asynchronous ``run`` (``weight_fifo`` W=1) with the generator in-process and in a child
   process (``generation.placement: process``); on request (``--modes``) also ``async run (no gap metrics)``
   (``loss.gap_metrics: false``: what measuring the training-inference gap costs). For each: ms/step, speed-up
   over stepped synchronous, and that speed-up as a fraction of the two-stage bound. Last, the controller's own
   cost per tick with simulated backends that do no work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import replace

import pandas as pd
import torch
from record import meta, save

from asyncrl import Controller, load_config
from asyncrl.algorithms import make_train_batch
from asyncrl.backends.base import GenerationRequest, capabilities
from asyncrl.backends.process import ProcessGenerator
from asyncrl.backends.torch import TorchGenerator

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
ASYNC = {"name": "weight_fifo", "max_staleness_versions": 1}
MODES = {  # name -> (sampler, generation placement, stepped)
    "stepped sync": (SYNC, "local", True),
    "sync run": (SYNC, "local", False),
    "async run": (ASYNC, "local", False),
    "async run (gen process)": (ASYNC, "process", False),
    "sync run (gen process)": (SYNC, "process", False),
    "async run (no gap metrics)": (ASYNC, "local", False),
}
# What a mode sets beyond its sampler and placement: the gap metrics' extra no-grad pass under kept weights is what
# an asynchronous run on CPU pays for measuring the training-inference gap (loss.gap_metrics; docs/staleness.md).
EXTRA = {"async run (no gap metrics)": {"loss": {"gap_metrics": False}}}
WARMUP = 3


def config(preset: str, sampler: dict, placement: str = "local", **work):
    generation = {**work.pop("generation", {}), "placement": placement}
    return load_config(preset, sampler=sampler, eval_every=None, generation=generation, **work)


# ------------------------------------------------------------------------------------------------ stage times
STAGES = ("generation", "scoring + commit", "old logprobs", "forward/backward", "optimizer", "weight sync")


def stepped_with_stages(ctrl: Controller, steps: int) -> tuple[float, dict[str, float]]:
    """``steps`` stepped synchronous steps (a rollout tick, then train ticks until the step finished: what
    ``tick()`` does under ``in_order`` L=0), timed as a whole and per stage by wrapping the backends' methods (a
    few µs a step). Returns (seconds, mean ms per step of each stage). The stages come from the same steps as the
    mode's ms/step (means, as ms/step is), so the bound they imply and the speed-ups share one stretch of the
    machine's time and the stages add up to the stepped time."""
    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    ctrl.generator.poll = timed("generation", ctrl.generator.poll)
    # scoring + commit: decoding the completions, the reward, and the buffer's commit (the public parts it calls)
    ctrl.tokenizer.batch_decode = timed("scoring + commit", ctrl.tokenizer.batch_decode)
    ctrl.task.reward = timed("scoring + commit", ctrl.task.reward)
    ctrl.buffer.commit = timed("scoring + commit", ctrl.buffer.commit)
    ctrl.policy.logprobs = timed("old logprobs", ctrl.policy.logprobs)  # not called when prev_logprobs_from_forward
    ctrl.policy.begin_train_step = timed("forward/backward", ctrl.policy.begin_train_step)
    ctrl.policy.train_microbatches = timed("forward/backward", ctrl.policy.train_microbatches)
    ctrl.policy.finish_train_step = timed("optimizer", ctrl.policy.finish_train_step)
    ctrl.sync_weights = timed("weight sync", ctrl.sync_weights)
    rows = []
    start = time.perf_counter()
    for _ in range(steps):
        spent.clear()
        t0 = time.perf_counter()
        ctrl.rollout_tick()
        t1 = time.perf_counter()
        while not ctrl.train_tick().step_finished:
            pass
        t2 = time.perf_counter()
        row = {k: spent.get(k, 0.0) for k in STAGES}
        row["rollout tick, own"] = (t1 - t0) - row["generation"] - row["scoring + commit"]
        row["train tick, own"] = (t2 - t1) - sum(row[k] for k in STAGES[2:])
        row["rollout stage"], row["train stage"] = t1 - t0, t2 - t1
        rows.append(row)
    elapsed = time.perf_counter() - start
    return elapsed, {k: 1e3 * statistics.fmean(r[k] for r in rows) for k in rows[0]}


# ---------------------------------------------------------------------------------------- the interpreter lock
PROBE_SWITCH_S = 1e-5  # switch interval during the spinner probe: a call waits at most this to get the lock back


def _spinner(stop: threading.Event, out: list) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


def _spin_rate(seconds: float) -> float:
    """Iterations per second of the spinner thread alone."""
    out: list = []
    stop = threading.Event()
    t = threading.Thread(target=_spinner, args=(stop, out))
    start = time.perf_counter()
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join()
    return out[0] / (time.perf_counter() - start)


def _beside_spinner(fn, reps: int) -> tuple[float, float]:
    """(ms per call with the spinner thread running, spinner iterations per second meanwhile)."""
    out: list = []
    stop = threading.Event()
    t = threading.Thread(target=_spinner, args=(stop, out))
    t.start()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    stop.set()
    t.join()
    return 1e3 * elapsed / reps, out[0] / elapsed


def _ms(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - start) / reps


def gil_probe(preset: str, work: dict, reps: int = 20) -> pd.DataFrame:
    ctrl = Controller.from_config(config(preset, SYNC, **work))
    for _ in range(WARMUP):
        ctrl.tick()
    gen, policy, N, G = ctrl.generator, ctrl.policy, ctrl.cfg.groups_per_step, ctrl.cfg.group_size
    prompts = [ctrl.encode(ctrl.stream.get(i).text) for i in range(N)]

    def generate():
        gen.submit([GenerationRequest(i, prompts[i], G) for i in range(N)])
        return gen.poll()

    groups = generate()
    for g in groups:
        g.rewards = [float(i % 2) for i in range(len(g.completion_ids))]
    batch = make_train_batch(groups, ctrl.cfg.loss, ctrl.tokenizer.pad_token_id)

    def train():  # the train tick's compute: (old logprobs,) forward/backward, optimizer step (weights change)
        chunk = batch
        if not capabilities(policy).prev_logprobs_from_forward:  # as TrainPump._train_chunk decides
            chunk = replace(batch, prev_logprobs=policy.logprobs(batch))
        policy.begin_train_step()
        policy.train_microbatches(chunk)
        policy.finish_train_step()

    rows = []
    switch = sys.getswitchinterval()
    for name, fn in (("generation", generate), ("train (fwd/bwd + optimizer)", train)):
        alone = _ms(fn, reps)
        sys.setswitchinterval(PROBE_SWITCH_S)
        try:
            solo_rate = _spin_rate(0.5)
            beside, rate = _beside_spinner(fn, reps)
        finally:
            sys.setswitchinterval(switch)
        rows.append({"call": name, "alone ms": alone, "beside spinner ms": beside, "slowdown": beside / alone,
                     "lock held (1 - spinner share)": 1 - rate / solo_rate})
    serial = _ms(lambda: (generate(), train()), reps)

    def both_threads(gen_fn):
        t = threading.Thread(target=lambda: [gen_fn() for _ in range(reps)])
        start = time.perf_counter()
        t.start()
        for _ in range(reps):
            train()
        t.join()
        return 1e3 * (time.perf_counter() - start) / reps

    child = ProcessGenerator(TorchGenerator, (ctrl.cfg.model, ctrl.cfg.generation, ctrl.cfg.seed, ctrl.tokenizer))
    child.load_weights(policy.export_weights(), 1)

    def child_generate():
        child.submit([GenerationRequest(i, prompts[i], G) for i in range(N)])
        return child.poll()

    in_child = _ms(child_generate, reps)
    threaded, processes = both_threads(generate), both_threads(child_generate)
    child.close()
    rows.append({"call": "generation in a child process (pipe round trip included)", "alone ms": in_child})
    rows.append({"call": "generation then train, one thread", "alone ms": serial})
    rows.append({"call": "generation || train, two threads", "alone ms": threaded, "slowdown": threaded / serial})
    rows.append({"call": "generation in a child || train", "alone ms": processes, "slowdown": processes / serial})
    ctrl.close()
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------------ modes
def timed_run(preset: str, mode: str, steps: int, work: dict) -> dict:
    sampler, placement, stepped = MODES[mode]
    ctrl = Controller.from_config(config(preset, sampler, placement, **work, **EXTRA.get(mode, {})))
    ctrl.run(WARMUP, progress=False)  # first forward passes, allocator, the child's first batches
    stages = None
    if stepped:
        elapsed, stages = stepped_with_stages(ctrl, steps)
    else:
        start = time.perf_counter()
        ctrl.run(steps, progress=False)
        elapsed = time.perf_counter() - start
    m = ctrl.metrics.iloc[WARMUP:]
    ctrl.close()
    return {"mode": mode, "steps": steps, "ms_per_step": 1e3 * elapsed / steps, "lag_mean": m.lag_mean.mean(),
            "reward_mean": m.reward_mean.mean(), "stages": stages}


def overhead(ticks: int = 2000) -> float:
    """µs per tick of the controller with backends that do nothing (simulated, zero latency)."""
    cfg = load_config("quickstart", sampler=ASYNC, eval_every=None, torch_threads=1,
                      generation={"backend": "simulated"}, trainer={"backend": "simulated"})
    ctrl = Controller.from_config(cfg)
    for _ in range(50):
        ctrl.tick()
    start = time.perf_counter()
    for _ in range(ticks):
        ctrl.rollout_tick()
        ctrl.train_tick()
    return 1e6 * (time.perf_counter() - start) / (2 * ticks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quickstart")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=4, help="TRL's reference point used 4")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (1 on 2 cores; "
                        "0: torch_threads unset, torch's default of a thread per core, what quickstart uses)")
    parser.add_argument("--modes", default=",".join(list(MODES)[:4]),
                        help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--out", default=None, help="run directory (default benchmarks/data/bench_async/<UTC time>)")
    parser.add_argument("--name", default=None, help="name of the run directory under benchmarks/data/bench_async")
    args = parser.parse_args()
    before = meta("bench_async")
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {list(MODES)}")
    if "stepped sync" not in modes:
        parser.error("the stage times, the bound and every speed-up come from the 'stepped sync' mode: include it")
    work = {"generation": {"max_new_tokens": args.max_new_tokens}, "torch_threads": args.threads or None}
    pd.set_option("display.width", 160)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"preset={args.preset} steps={args.steps} max_new_tokens={args.max_new_tokens} threads={args.threads} "
          f"cpus={len(os.sched_getaffinity(0))} torch={torch.__version__} python={sys.version.split()[0]} "
          f"load={load:.2f}")

    rows = []
    for r in range(args.repeats):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            rows.append({"repeat": r, **timed_run(args.preset, mode, args.steps, work)})
    # The stages of the stepped synchronous repeat that was fastest: the one its speed-ups are taken against.
    stepped = [r for r in rows if r["stages"] is not None]
    stages = min(stepped, key=lambda r: r["ms_per_step"])["stages"]
    gen, train = stages["rollout stage"], stages["train stage"]
    bound = (gen + train) / max(gen, train)
    print("\n1. stage times of a stepped synchronous step (its fastest repeat), mean ms:")
    print(pd.Series(stages).round(2).to_string())
    print(f"two-stage bound (gen + train) / max(gen, train) = ({gen:.1f} + {train:.1f}) / {max(gen, train):.1f} "
          f"= {bound:.2f}x")

    print(f"\n2. the interpreter lock (switch interval {1e6 * PROBE_SWITCH_S:.0f} µs while the spinner runs; "
          "'slowdown' of the last two rows: vs one after the other):")
    gil = gil_probe(args.preset, work)
    print(gil.round(2).to_string(index=False))

    table = pd.DataFrame(rows).drop(columns="stages")
    best = table.groupby("mode", sort=False).ms_per_step.min()
    base = best.get("stepped sync", float("nan"))
    summary = pd.DataFrame({
        "ms/step (best)": best,
        "ms/step (all)": table.groupby("mode", sort=False).ms_per_step.apply(
            lambda s: " ".join(f"{v:.1f}" for v in s)),
        "speed-up vs stepped sync": base / best,
        "of the bound": (base / best) / bound,
        "lag_mean": table.groupby("mode", sort=False).lag_mean.mean(),
    })
    print(f"\n3. modes, {args.steps} steps after {WARMUP} warm-up, {args.repeats} repeats alternating; "
          f"bound {bound:.2f}x:")
    print(summary.round(2).to_string())
    results = {"bound": bound, "stepped_ms": base, "best_ms": best.to_dict(),
               "speedup_vs_stepped": (base / best).to_dict()}
    for mode, key, target, met in (
            ("sync run", "sync_run_over_stepped", "<= 1.05x the stepped time", lambda r: r <= 1.05),
            ("async run", "async_run_speedup", ">= 1.3x faster than stepped", lambda r: r >= 1.3)):
        if mode in best:
            ratio = best[mode] / base if mode == "sync run" else base / best[mode]
            results[key], results[key + "_met"] = ratio, bool(met(ratio))
            print(f"target {mode} {target}: {ratio:.2f}x, {'met' if met(ratio) else 'NOT met'} in this run")
    results["overhead_us_per_tick"] = overhead()
    print(f"\ncontroller overhead, simulated backends doing no work: {results['overhead_us_per_tick']:.0f} µs per tick")
    where = save("bench_async", table, results, before=before, out=args.out, name=args.name,
                 files={"stages.json": stages, "gil_probe.csv": gil})
    print(f"raw data: {where}")


if __name__ == "__main__":
    main()
