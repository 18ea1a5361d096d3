"""Where an asynchronous CPU run's step goes, thread by thread: the policy's and the generator's calls timed inside
``Controller.run``, beside the two pumps' whole ticks.

    python benchmarks/bench_async_busy.py [--steps 100]

The quickstart shape of ``bench_async.py`` (8 x 8 completions, 4 new tokens, ``torch_threads: 1``), three runs:
``async`` (``weight_fifo`` W=1), ``async, no gap metrics`` (the same with ``loss.gap_metrics: false``) and ``sync``
(``in_order`` L=0, one thread). Each backend method is wrapped with a timer (a few µs a call); the table gives ms a
step of each call and of each pump's ticks. In an asynchronous run the two pumps run in two threads: when the train
pump's ticks take the whole step, the run is bound by the train thread, and whatever the train tick does besides
``train_microbatches`` (the gap metrics' pass under kept weights, ``policy.logprobs_at``; the controller's own work)
is taken from the overlap. Rows through ``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from bench_async import ASYNC, SYNC, config
from record import meta, save

from asyncrl import Controller

RUNS = {"async": (ASYNC, {}), "async, no gap metrics": (ASYNC, {"loss": {"gap_metrics": False}}), "sync": (SYNC, {})}
POLICY = ("begin_train_step", "train_microbatches", "finish_train_step", "logprobs_at", "keep_versions",
          "export_weights")
GENERATOR = ("poll", "submit", "load_weights")


def timed(obj, name: str, key: str, spent: dict) -> None:
    """Replace ``obj.name`` by a wrapper adding its seconds to ``spent[key]`` (the pumps call the same object)."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
    setattr(obj, name, wrapper)


def one(label: str, steps: int) -> list[dict]:
    sampler, extra = RUNS[label]
    ctrl = Controller.from_config(config("quickstart", sampler, "local", generation={"max_new_tokens": 4},
                                         torch_threads=1, **extra))
    ctrl.run(3, progress=False)
    spent: dict[str, float] = defaultdict(float)
    for name in POLICY:
        if hasattr(ctrl.policy, name):
            timed(ctrl.policy, name, f"policy.{name}", spent)
    for name in GENERATOR:
        timed(ctrl.generator, name, f"generator.{name}", spent)
    timed(ctrl, "train_tick", "train pump: its ticks", spent)
    timed(ctrl, "rollout_tick", "rollout pump: its ticks", spent)
    start = time.perf_counter()
    ctrl.run(steps, progress=False)
    wall = time.perf_counter() - start
    ctrl.close()
    rows = [{"run": label, "what": "wall", "ms_per_step": 1e3 * wall / steps}]
    rows += [{"run": label, "what": k, "ms_per_step": 1e3 * v / steps} for k, v in sorted(spent.items())]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default=None, help="run directory name under benchmarks/data/bench_async_busy")
    args = parser.parse_args()
    before = meta("bench_async_busy")
    rows = [r for label in RUNS for r in one(label, args.steps)]
    import pandas as pd

    table = pd.DataFrame(rows).pivot(index="what", columns="run", values="ms_per_step")[list(RUNS)]
    print(f"ms a step, {args.steps} steps of each run (quickstart shape, torch_threads 1):")
    print(table.round(2).to_string())
    results = {label: {r["what"]: r["ms_per_step"] for r in rows if r["run"] == label} for label in RUNS}
    print(f"raw data: {save('bench_async_busy', rows, results, before=before, out=args.out, name=args.name)}")


if __name__ == "__main__":
    main()
