"""The reward runner: scores a group at a time, in-process or in ``workers`` processes, and reports each group's
outcome — rewards, or why not — for the rollout pump to commit, retry or skip.

``submit(key, batch)`` hands over one group (``RewardBatch``); ``poll(timeout)`` returns the groups whose scoring
ended (``Scored``), ``wait(keys)`` blocks until those have. With ``workers: 0`` every call runs inside ``submit``
(the inline path: the pump's thread, as before); with ``workers: K`` each function's call on a group goes to one
of ``K`` workers, so a slow verifier overlaps generation and training, and several groups (and several functions
of one group) score at once. Workers are local processes, or Ray actors (``placement="ray"``: a run that uses Ray);
``asyncrl/rewards/pool.py`` dispatches to either alike.

Invariants:
- Every submitted group ends in exactly one ``Scored``: ``rewards`` (totals) with ``parts`` (each function's
  values), or ``problem`` (retryable: an exception, NaN/inf, a weighted sum over ``reward.weights`` that
  overflows, a call past ``timeout_s``, a worker that died), or
  ``bug`` (not retried: a wrong length, a non-number, a missing column, functions a worker cannot load). Never a
  stall: a call past ``timeout_s`` has its worker killed and replaced; a dead worker is replaced; a dispatcher
  that fails turns every open call into a ``bug`` naming why. ``cancel`` drops a group (aborted) for good.
- A worker runs one call at a time, so a timeout or a death is the fault of exactly one call. Workers see the
  caller's ``sys.path`` and load the functions once (cloudpickle: a function defined in a notebook cell, in
  ``__main__``, is sent by value). A function that cannot be pickled runs in this process on a helper thread,
  with a one-line ``RuntimeWarning`` naming it; so does, without a warning, a reward model placed on this
  process's GPU (``in_process``: asyncrl/rewards/models.py); inline (``workers: 0``) and such calls cannot be
  cut off, so their ``timeout_s`` is judged when they return.
- ``seconds`` is the time the functions took on the group (summed over its calls), not the time it queued:
  the ``reward_time_s`` metric.
- Workers are started by the dispatcher thread (building a runner never waits for them) and stopped by
  ``close``; a worker process whose caller dies exits by itself (``asyncrl/rewards/worker.py``), a Ray actor
  goes with its driver.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.faults import describe
from asyncrl.rewards.functions import RewardBatch, RewardFunctions, outcome
from asyncrl.rewards.pool import ProcessWorker, WorkerPool

PLACEMENTS = ("process", "ray")


@dataclass
class Scored:
    """How one group's scoring ended (see the module's invariants)."""

    key: Any
    rewards: list[float] | None = None
    parts: dict[str, list[float | None]] | None = None
    seconds: float = 0.0
    problem: str | None = None
    bug: str | None = None


class _Job:
    def __init__(self, key: Any, n: int):
        self.key, self.results, self.remaining = key, [None] * n, n


class RewardRunner:
    """Scores groups with ``functions`` (``RewardFunctions``) in ``workers`` processes (0: inline)."""

    def __init__(self, functions: RewardFunctions, workers: int = 0, timeout_s: float | None = None,
                 on_done: Callable[[], None] | None = None, placement: str = "process",
                 ray_options: dict | None = None):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(f"reward.workers {workers!r}: a number of worker processes, 0 (inline) or more")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward.timeout_s {timeout_s!r}: seconds a call may take, > 0 (or None: no limit)")
        if placement not in PLACEMENTS:
            raise ValueError(f"reward workers' placement {placement!r}: one of {', '.join(PLACEMENTS)}")
        self.functions, self.workers, self.timeout_s = functions, workers, timeout_s
        self.on_done = on_done  # called when a group's scoring ended (outside the runner's lock)
        self._cond = threading.Condition()
        self._jobs: dict[Any, _Job] = {}
        self._done: dict[Any, Scored] = {}
        self.notices: collections.deque[str] = collections.deque()  # worker replaced while idle: no group's fault
        self._local = set(range(len(functions.funcs))) if workers == 0 else set()
        self.placement = placement
        self._pool: WorkerPool | None = None
        self._threads: ThreadPoolExecutor | None = None
        if workers:
            payload = self._payload()
            if payload is not None:
                self._pool = WorkerPool(self, workers, payload, _maker(placement, ray_options))
            if self._local:
                self._threads = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-reward")

    def _payload(self) -> bytes | None:
        """The functions a worker can load, pickled; the others run here (with a one-line warning each)."""
        import cloudpickle

        sendable = {}
        for i, (name, func) in enumerate(zip(self.functions.names, self.functions.funcs)):
            if getattr(func, "in_process", False):  # a reward model placed on this process's GPU (models.py)
                self._local.add(i)
                continue
            try:
                cloudpickle.dumps(func)
            except Exception as exc:
                self._local.add(i)
                warnings.warn(f"reward function {name!r} cannot be sent to a worker process ({describe(exc)}); it "
                              "runs in this process instead", RuntimeWarning, stacklevel=3)
                continue
            sendable[i] = (name, func)
        return cloudpickle.dumps(sendable) if sendable else None

    # ----------------------------------------------------------------------------------------- the interface
    def submit(self, key: Any, batch: RewardBatch) -> None:
        """Start scoring one group; its ``Scored`` comes back from ``poll``/``wait`` under ``key``."""
        self.submit_all([(key, batch)])

    def submit_all(self, groups: list[tuple[Any, RewardBatch]]) -> None:
        """``submit`` each ``(key, batch)``, handed to the workers at once (one wake-up of their dispatcher, which
        then does not compete with the caller for the interpreter between two groups)."""
        n = len(self.functions.funcs)
        with self._cond:
            for key, _ in groups:
                if key in self._jobs or key in self._done:
                    raise ValueError(f"reward runner: group {key!r} is already being scored")
            for key, _ in groups:
                self._jobs[key] = _Job(key, n)
        remote = [(key, i, batch) for key, batch in groups for i in range(n) if i not in self._local]
        if remote:
            self._pool.enqueue(remote)
        for key, batch in groups:
            for i in sorted(self._local):
                if self._threads is not None:
                    self._threads.submit(self._finish_here, key, i, batch)
                else:
                    self._finish_here(key, i, batch)

    def poll(self, timeout: float = 0.0) -> list[Scored]:
        """The groups whose scoring ended since the last call (waiting up to ``timeout`` for one, if any is
        being scored), in the order they ended."""
        self.ready(timeout)
        return self.take()

    def wait(self, keys: list) -> list[Scored]:
        """Block until the groups ``keys`` are scored and return their ``Scored`` in that order (keys not being
        scored are left out). Bounded: every call ends by its result, ``timeout_s`` or its worker's death."""
        self.wait_for(keys)
        return self.take(keys)

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether a group's scoring has ended and waits to be taken, waiting up to ``timeout`` for one."""
        with self._cond:
            if not self._done and self._jobs and timeout > 0:
                self._cond.wait(timeout)
            return bool(self._done)

    def wait_for(self, keys: list) -> None:
        """Block until none of ``keys`` is being scored (their outcomes wait to be taken, or were taken)."""
        with self._cond:
            self._cond.wait_for(lambda: not any(k in self._jobs for k in keys))

    def take(self, keys: list | None = None) -> list[Scored]:
        """The outcomes that wait to be taken (of ``keys``, in that order; None: all, in the order they ended),
        each given out once."""
        with self._cond:
            if keys is None:
                out = list(self._done.values())
                self._done.clear()
                return out
            return [self._done.pop(k) for k in keys if k in self._done]

    def cancel(self, key: Any) -> None:
        """Forget a group (aborted while it was being scored): its calls still running are ignored."""
        with self._cond:
            self._jobs.pop(key, None)
            self._done.pop(key, None)

    @property
    def pending(self) -> int:
        """Groups submitted and not yet returned by ``poll``/``wait``."""
        with self._cond:
            return len(self._jobs) + len(self._done)

    def scoring(self, key: Any) -> bool:
        with self._cond:
            return key in self._jobs or key in self._done

    def started(self, timeout: float = 60.0) -> bool:
        """Wait until every worker process is ready (a benchmark's clock should not count their start)."""
        end = time.monotonic() + timeout
        while self._pool is not None and len(self._pool.pids()) < self.workers and self._pool.error is None:
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    @property
    def worker_pids(self) -> list[int]:
        return [] if self._pool is None else self._pool.pids()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------ bookkeeping
    def _finish_here(self, key: Any, i: int, batch: RewardBatch) -> None:
        self.finish(key, i, self._run_here(i, batch))

    def _run_here(self, i: int, batch: RewardBatch) -> tuple[str, Any, float]:
        name = self.functions.names[i]
        result = outcome(self.functions.funcs[i], name, batch)
        if self.timeout_s is not None and result[0] == "ok" and result[2] > self.timeout_s:
            return ("problem", f"reward function {name!r} took {result[2]:.3g} s, past reward.timeout_s="
                    f"{self.timeout_s:g} (in this process it cannot be cut off; reward.workers >= 1 can)", result[2])
        return result

    def finish(self, key: Any, index: int, result: tuple[str, Any, float]) -> None:
        """Record one call's outcome; the group's ``Scored`` is made when its last call is in."""
        with self._cond:
            job = self._jobs.get(key)
            if job is None or job.results[index] is not None:
                return  # cancelled, or already ended (a late answer after a timeout)
            job.results[index] = result
            job.remaining -= 1
            if job.remaining:
                return
            del self._jobs[key]
            self._done[key] = self._scored(job)
            self._cond.notify_all()
        if self.on_done is not None and not self._defer(key):
            self.on_done()

    def _defer(self, key: Any) -> bool:
        """Whether the dispatcher thread is the caller: it calls ``on_done`` once it handed out the next calls."""
        if self._pool is None or threading.current_thread() is not self._pool.thread:
            return False
        self._pool.notify = True
        return True

    def _scored(self, job: _Job) -> Scored:
        seconds = sum(r[2] for r in job.results)
        for kind in ("bug", "problem"):
            why = [r[1] for r in job.results if r[0] == kind]
            if why:
                return Scored(job.key, seconds=seconds, **{kind: "; ".join(dict.fromkeys(why))})
        values = [r[1] for r in job.results]
        totals = self.functions.combine(values)
        over = next((i for i, total in enumerate(totals) if not math.isfinite(total)), None)
        if over is not None:  # finite values whose weighted sum is not: as much a data fault as a NaN
            parts = [column[over] for column in values]
            return Scored(job.key, seconds=seconds, problem=f"the weighted sum of completion {over}'s rewards "
                          f"{parts} over reward.weights {self.functions.weights} is {totals[over]!r} (non-finite)")
        return Scored(job.key, totals, self.functions.parts(values), seconds)

    def live(self, key: Any) -> bool:
        with self._cond:
            return key in self._jobs


def _maker(placement: str, ray_options: dict | None) -> Callable[..., Any]:
    """What makes one worker: a local process, or a Ray actor (the run's Ray session must be up)."""
    if placement == "process":
        return ProcessWorker
    from asyncrl.rewards.ray_workers import RayWorker, check_ray

    check_ray()
    return lambda payload, post: RayWorker(payload, post, ray_options)
