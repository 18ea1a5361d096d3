"""How fast a run answers a person: the latency of interrupt, stop, pause and fail-fast on the quickstart model.

Each measurement starts a run of the quickstart preset (torch backends, ``torch_threads: 1``), lets it train a few
steps, then measures from the request to the moment it took effect:
- ``interrupt``: ``_thread.interrupt_main()`` (what Ctrl-C and a notebook's Interrupt deliver) during ``run`` until
  ``run`` raised ``KeyboardInterrupt`` with both pumps stopped;
- ``stop``: ``handle.stop()`` until it returned (the run ended);
- ``pause``: ``handle.pause()`` until it returned (both pumps parked);
- errors: the policy's ``train_microbatches`` or the generator's ``poll`` raising until ``run`` re-raised it in the
  caller. A generation error is first retried (``faults.generation_retries``, with backoff: asyncrl/faults.py), so
  with the default budget it surfaces after the backoff schedule (~7 s); with no retries it is the loop's own time.
The contract for interrupt and stop is "within 1 s"; a safe point comes after at most one tick, so these follow
the tick time.

    python benchmarks/bench_run_loop.py [--reps 5] [--sampler weight_fifo]
"""

from __future__ import annotations

import _thread
import argparse
import signal
import statistics
import threading
import time

from record import meta, save

from asyncrl import Controller, load_config


def controller(sampler: str, **overrides) -> Controller:
    sampler_cfg = {"name": sampler} if sampler != "in_order" else {"name": "in_order", "max_lookahead_versions": 1}
    ctrl = Controller.from_config(load_config("quickstart", eval_every=None, torch_threads=1, sampler=sampler_cfg,
                                              **overrides))
    ctrl.run(3, progress=False)  # warm-up: first forward passes, allocator
    return ctrl


def after_steps(ctrl: Controller, steps: int) -> None:
    target = ctrl.trainer_version + steps
    while ctrl.trainer_version < target:
        time.sleep(0.002)


def interrupt(ctrl: Controller) -> float:
    asked = []

    def interrupter():
        after_steps(ctrl, 3)
        asked.append(time.perf_counter())
        _thread.interrupt_main()

    threading.Thread(target=interrupter, daemon=True).start()
    try:
        ctrl.run(100_000, progress=False)
    except KeyboardInterrupt:
        done = time.perf_counter()
    assert not ctrl.last_run.alive
    return done - asked[0]


def stop(ctrl: Controller) -> float:
    handle = ctrl.start(100_000, progress=False)
    after_steps(ctrl, 3)
    asked = time.perf_counter()
    handle.stop()
    return time.perf_counter() - asked


def pause(ctrl: Controller) -> float:
    handle = ctrl.start(100_000, progress=False)
    after_steps(ctrl, 3)
    asked = time.perf_counter()
    handle.pause()
    took = time.perf_counter() - asked
    handle.stop()
    return took


def fail_fast(ctrl: Controller, backend: str, method: str) -> float:
    """From the backend call raising (armed after 3 steps) until ``run`` re-raised in the caller."""
    obj = getattr(ctrl, backend)
    original, raised, armed = getattr(obj, method), [], threading.Event()

    def failing(*args, **kwargs):
        if armed.is_set():
            raised.append(time.perf_counter())
            raise RuntimeError(f"{method} went away")
        return original(*args, **kwargs)

    setattr(obj, method, failing)
    threading.Thread(target=lambda: (after_steps(ctrl, 3), armed.set()), daemon=True).start()
    try:
        ctrl.run(100_000, progress=False)
    except RuntimeError:  # the error itself, or GenerationFailed carrying it once the retries are spent
        done = time.perf_counter()
    setattr(obj, method, original)
    return done - raised[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sampler", default="weight_fifo", choices=["in_order", "weight_fifo", "windowed"])
    parser.add_argument("--out", default=None, help="run directory (default benchmarks/data/bench_run_loop/<UTC time>)")
    parser.add_argument("--name", default=None, help="name of the run directory under benchmarks/data/bench_run_loop")
    args = parser.parse_args()
    before = meta("bench_run_loop")
    # interrupt_main() raises only while SIGINT has Python's handler (not when started under nohup)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl = controller(args.sampler)
    step_ms = 1000 * ctrl.metrics.step_time_s.tail(3).median()
    print(f"quickstart, sampler {args.sampler}, torch_threads 1, {args.reps} reps; a step takes ~{step_ms:.0f} ms here")
    print(f"{'request':<34} {'median ms':>10} {'max ms':>8}")
    no_retries = controller(args.sampler, faults={"generation_retries": 0})
    rows = [
        ("interrupt", lambda: interrupt(ctrl)),
        ("stop", lambda: stop(ctrl)),
        ("pause", lambda: pause(ctrl)),
        # a trainer failure leaves its step half-trained (TrainerFailed afterwards): a fresh controller each time
        ("policy error", lambda: fail_fast(controller(args.sampler), "policy", "train_microbatches")),
        ("generator error, no retries", lambda: fail_fast(no_retries, "generator", "poll")),
        ("generator error, default retries", lambda: fail_fast(ctrl, "generator", "poll")),
    ]
    raw = []
    for name, measure in rows:
        times = [1000 * measure() for _ in range(args.reps)]
        raw += [{"request": name, "rep": i, "ms": t} for i, t in enumerate(times)]
        print(f"{name:<34} {statistics.median(times):>10.1f} {max(times):>8.1f}")
    where = save("bench_run_loop", raw, {"sampler": args.sampler, "reps": args.reps, "step_ms": step_ms},
                 before=before, out=args.out, name=args.name)
    print(f"raw data: {where}")


if __name__ == "__main__":
    main()
