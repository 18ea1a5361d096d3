"""How fast a run answers a person: the latency of interrupt, stop, pause and fail-fast on the quickstart model.

Each measurement starts a run of the quickstart preset (torch backends, ``torch_threads: 1``), lets it train a few
steps, then measures from the request to the moment it took effect:
- ``interrupt``: ``_thread.interrupt_main()`` (what Ctrl-C and a notebook's Interrupt deliver) during ``run`` until
  ``run`` raised ``KeyboardInterrupt`` with both pumps stopped;
- ``stop``: ``handle.stop()`` until it returned (the run ended);
- ``pause``: ``handle.pause()`` until it returned (both pumps parked);
- ``fail-fast``: the generator's ``poll`` raising until ``run`` re-raised that error in the caller.
The contract is "within 1 s"; a safe point comes after at most one tick, so these follow the tick time.

    python benchmarks/bench_run_loop.py [--reps 5] [--sampler weight_fifo]
"""

from __future__ import annotations

import _thread
import argparse
import statistics
import threading
import time

from asyncrl import Controller, load_config


def controller(sampler: str) -> Controller:
    sampler_cfg = {"name": sampler} if sampler != "in_order" else {"name": "in_order", "max_lookahead_versions": 1}
    ctrl = Controller.from_config(load_config("quickstart", eval_every=None, torch_threads=1, sampler=sampler_cfg))
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


def fail_fast(ctrl: Controller) -> float:
    poll, raised = ctrl.generator.poll, []
    armed = threading.Event()

    def failing(*args, **kwargs):
        if armed.is_set():
            raised.append(time.perf_counter())
            raise RuntimeError("generator went away")
        return poll(*args, **kwargs)

    ctrl.generator.poll = failing
    threading.Thread(target=lambda: (after_steps(ctrl, 3), armed.set()), daemon=True).start()
    try:
        ctrl.run(100_000, progress=False)
    except RuntimeError:
        done = time.perf_counter()
    ctrl.generator.poll = poll
    return done - raised[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sampler", default="weight_fifo", choices=["in_order", "weight_fifo", "windowed"])
    args = parser.parse_args()
    ctrl = controller(args.sampler)
    step_ms = 1000 * ctrl.metrics.step_time_s.tail(3).median()
    print(f"quickstart, sampler {args.sampler}, torch_threads 1, {args.reps} reps; a step takes ~{step_ms:.0f} ms here")
    print(f"{'request':<10} {'median ms':>10} {'max ms':>8}")
    for name, measure in [("interrupt", interrupt), ("stop", stop), ("pause", pause), ("fail-fast", fail_fast)]:
        times = [1000 * measure(ctrl) for _ in range(args.reps)]
        print(f"{name:<10} {statistics.median(times):>10.1f} {max(times):>8.1f}")


if __name__ == "__main__":
    main()
