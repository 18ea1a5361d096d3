"""The reward runner: scores a group at a time, in-process or in ``workers`` processes, and reports each group's
outcome — rewards, or why not — for the rollout pump to commit, retry or skip.

``submit(key, batch)`` hands over one group (``RewardBatch``); ``poll(timeout)`` returns the groups whose scoring
ended (``Scored``), ``wait(keys)`` blocks until those have. With ``workers: 0`` every call runs inside ``submit``
(the inline path: the pump's thread, as before); with ``workers: K`` each function's call on a group goes to one
of ``K`` worker processes, so a slow verifier overlaps generation and training, and several groups (and several
functions of one group) score at once.

Invariants:
- Every submitted group ends in exactly one ``Scored``: ``rewards`` (totals) with ``parts`` (each function's
  values), or ``problem`` (retryable: an exception, NaN/inf, a call past ``timeout_s``, a worker that died), or
  ``bug`` (not retried: a wrong length, a non-number, a missing column, functions a worker cannot load). Never a
  stall: a call past ``timeout_s`` has its worker killed and replaced; a dead worker is replaced; a dispatcher
  that fails turns every open call into a ``bug`` naming why. ``cancel`` drops a group (aborted) for good.
- A worker runs one call at a time, so a timeout or a death is the fault of exactly one call. Workers see the
  caller's ``sys.path`` and load the functions once (cloudpickle: a function defined in a notebook cell, in
  ``__main__``, is sent by value). A function that cannot be pickled runs in this process on a helper thread,
  with a one-line ``RuntimeWarning`` naming it; inline (``workers: 0``) and such calls cannot be cut off, so their
  ``timeout_s`` is judged when they return.
- ``seconds`` is the time the functions took on the group (summed over its calls), not the time it queued:
  the ``reward_time_s`` metric.
- Worker processes are started by the dispatcher thread (building a runner never waits for them) and stopped by
  ``close``; a worker whose caller dies exits by itself (``asyncrl/rewards/worker.py``).

A run on Ray could hold Ray actors instead of processes (the same one-call-per-worker dispatch over
``ray.wait``, ``ray.kill`` for a timeout, ``RayActorError`` for a death); today workers are local processes.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import wait as wait_any
from typing import Any

from asyncrl.faults import describe
from asyncrl.rewards.functions import RewardBatch, RewardFunctions, outcome
from asyncrl.rewards.worker import BOOT

START_FAILURES = 3  # workers in a row that die before they are ready: the functions cannot run in a worker


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
                 on_done: Callable[[], None] | None = None):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(f"reward.workers {workers!r}: a number of worker processes, 0 (inline) or more")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward.timeout_s {timeout_s!r}: seconds a call may take, > 0 (or None: no limit)")
        self.functions, self.workers, self.timeout_s = functions, workers, timeout_s
        self.on_done = on_done  # called when a group's scoring ended (outside the runner's lock)
        self._cond = threading.Condition()
        self._jobs: dict[Any, _Job] = {}
        self._done: dict[Any, Scored] = {}
        self.notices: collections.deque[str] = collections.deque()  # worker replaced while idle: no group's fault
        self._local = set(range(len(functions.funcs))) if workers == 0 else set()
        self._pool: _ProcessPool | None = None
        self._threads: ThreadPoolExecutor | None = None
        if workers:
            payload = self._payload()
            if payload is not None:
                self._pool = _ProcessPool(self, workers, payload)
            if self._local:
                self._threads = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-reward")

    def _payload(self) -> bytes | None:
        """The functions a worker can load, pickled; the others run here (with a one-line warning each)."""
        import cloudpickle

        sendable = {}
        for i, (name, func) in enumerate(zip(self.functions.names, self.functions.funcs)):
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
        n = len(self.functions.funcs)
        with self._cond:
            if key in self._jobs or key in self._done:
                raise ValueError(f"reward runner: group {key!r} is already being scored")
            self._jobs[key] = _Job(key, n)
        for i in range(n):
            if i not in self._local:
                self._pool.enqueue(key, i, batch)
            elif self._threads is not None:
                self._threads.submit(lambda i=i: self.finish(key, i, self._run_here(i, batch)))
            else:
                self.finish(key, i, self._run_here(i, batch))

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
        return Scored(job.key, self.functions.combine(values), self.functions.parts(values), seconds)

    def live(self, key: Any) -> bool:
        with self._cond:
            return key in self._jobs


def _how(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Worker:
    """One worker process and its connection; ``call`` is the (key, index, name, sent) it is scoring."""

    def __init__(self, payload: bytes):
        parent, child = Pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", BOOT, str(child.fileno())], pass_fds=(child.fileno(),),
                                     stdin=subprocess.DEVNULL)
        child.close()
        self.conn, self.ready, self.call = parent, False, None
        parent.send(("init", list(sys.path), payload))

    def stop(self, grace_s: float = 0.0) -> int | None:
        if grace_s and self.proc.poll() is None:
            try:
                self.conn.send(("stop",))
                self.proc.wait(grace_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        self.conn.close()
        return code


class _ProcessPool:
    """``workers`` processes fed by one dispatcher thread: it hands each idle worker the next call, collects
    answers, kills a call past ``timeout_s`` and replaces dead workers (see the module's invariants)."""

    def __init__(self, runner: RewardRunner, workers: int, payload: bytes):
        self.runner, self.n, self.payload = runner, workers, payload
        self.queue: collections.deque = collections.deque()
        self.workers: list[_Worker] = []
        self.error: str | None = None
        self.lock = threading.Lock()  # ``error`` and ``queue`` change together: no call queues after a break
        self.closing = False
        self.notify = False  # a group ended on this thread: call the runner's on_done after the next assignment
        self.start_failures = 0
        self.wake_r, self.wake_w = os.pipe()
        self.thread = threading.Thread(target=self._run, name="asyncrl-reward-dispatch", daemon=True)
        self.thread.start()

    def enqueue(self, key: Any, index: int, batch: RewardBatch) -> None:
        with self.lock:
            error = self.error
            if error is None:
                self.queue.append((key, index, batch))
                os.write(self.wake_w, b"x")
        if error is not None:
            self.runner.finish(key, index, ("bug", error, 0.0))

    def pids(self) -> list[int]:
        return [w.proc.pid for w in list(self.workers) if w.ready]

    def close(self) -> None:
        self.closing = True
        with self.lock:
            if self.wake_w is not None:
                os.write(self.wake_w, b"x")
        self.thread.join(10.0)

    # --------------------------------------------------------------------------------- the dispatcher thread
    def _run(self) -> None:
        try:
            self.workers = [_Worker(self.payload) for _ in range(self.n)]
            while not self.closing:
                self._assign()
                if self.notify and self.runner.on_done is not None:  # after the next calls went out, not before
                    self.notify = False
                    self.runner.on_done()
                by_conn = {w.conn: w for w in self.workers}
                for ready in wait_any([*by_conn, self.wake_r], self._wait_s()):
                    if ready == self.wake_r:
                        os.read(self.wake_r, 4096)
                    elif by_conn[ready] in self.workers:  # not replaced meanwhile
                        self._receive(by_conn[ready])
                self._expire()
        except BaseException as exc:  # noqa: BLE001 - nothing may be left waiting on a dead dispatcher
            self._break(f"the reward dispatcher failed: {describe(exc)}")
        finally:
            if self.error is None:
                self._break("the reward runner is closed")
            for w in self.workers:
                w.stop(grace_s=1.0)
            with self.lock:
                os.close(self.wake_r)
                os.close(self.wake_w)
                self.wake_w = None

    def _wait_s(self) -> float:
        timeout = self.runner.timeout_s
        busy = [w.call[3] + timeout - time.monotonic() for w in self.workers if w.call and timeout is not None]
        return max(0.0, min([1.0, *busy]))

    def _assign(self) -> None:
        for w in self.workers:
            if not (w.ready and w.call is None):
                continue
            while self.queue:
                key, index, batch = self.queue.popleft()
                if not self.runner.live(key):
                    continue  # cancelled while it queued
                try:
                    w.conn.send(("call", index, batch))
                except (OSError, EOFError):  # the worker just died: its EOF comes next; the call waits again
                    self.queue.appendleft((key, index, batch))
                    break
                except Exception as exc:  # the group's columns cannot be pickled
                    self.runner.finish(key, index, ("bug", f"a reward worker cannot be sent group {key!r}'s inputs "
                                                           f"({describe(exc)})", 0.0))
                    continue
                w.call = (key, index, self.runner.functions.names[index], time.monotonic())
                break

    def _receive(self, w: _Worker) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            self._died(w)
            return
        if message[0] == "ready":
            w.ready, self.start_failures = True, 0
        elif message[0] == "init_error":
            self._break(f"a reward worker could not load the reward functions: {message[1]}")
        else:
            key, index, _, _ = w.call
            w.call = None
            self.runner.finish(key, index, message)

    def _replace(self, w: _Worker) -> None:
        self.workers[self.workers.index(w)] = _Worker(self.payload)

    def _died(self, w: _Worker) -> None:
        how = _how(w.stop())
        if w.call is not None:
            key, index, name, sent = w.call
            self.runner.finish(key, index, ("problem", f"the reward worker (pid {w.proc.pid}) died ({how}) while "
                                            f"scoring with {name!r}; it was replaced", time.monotonic() - sent))
        elif not w.ready:
            self.start_failures += 1
            if self.start_failures >= START_FAILURES:
                self._break(f"reward workers die as they start ({self.start_failures} in a row, the last {how})")
                return
        else:
            self.runner.notices.append(f"a reward worker (pid {w.proc.pid}) died while idle ({how}); replaced")
        self._replace(w)

    def _expire(self) -> None:
        timeout = self.runner.timeout_s
        if timeout is None:
            return
        for w in list(self.workers):
            if w.call is not None and time.monotonic() - w.call[3] > timeout:
                key, index, name, sent = w.call
                w.stop()
                self.runner.finish(key, index, ("problem", f"reward function {name!r} ran past reward.timeout_s="
                                                f"{timeout:g} s; its worker (pid {w.proc.pid}) was stopped and "
                                                "replaced", time.monotonic() - sent))
                self._replace(w)

    def _break(self, why: str) -> None:
        """Nothing can score any more: every open call ends as a bug naming ``why``, and so will new ones."""
        with self.lock:
            self.error = why
            queued = list(self.queue)
            self.queue.clear()
        for w in self.workers:
            if w.call is not None:
                self.runner.finish(w.call[0], w.call[1], ("bug", why, 0.0))
                w.call = None
        for key, index, _ in queued:
            self.runner.finish(key, index, ("bug", why, 0.0))
        self.closing = True
