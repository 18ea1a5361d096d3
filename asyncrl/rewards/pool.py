"""The reward workers' dispatcher: ``WorkerPool`` feeds ``workers`` workers (local processes, ``ProcessWorker``, or
Ray actors, ``asyncrl.rewards.ray_workers.RayWorker``) from one thread, collects their answers, cuts off a call
past ``timeout_s`` and replaces workers that die.

Invariants:
- A worker runs one call at a time, in the order it was sent, so a timeout or a death is the fault of exactly one
  call: the one it was running (the head of ``Worker.calls``). The calls queued behind it were never started:
  they go back to the front of the queue, to be sent again, and are nobody's fault.
- A call goes to the first worker free, so a slow call holds up no other. (Sending a busy worker its next call
  ahead saved nothing measurable on the quickstart shape, benchmarks/README.md, and would queue calls behind a
  slow one; ``calls`` and ``_requeue`` keep that possible: a call's clock starts when its worker starts it.)
- Every event reaches this thread without a poll interval: a process worker's connection, or the wake pipe
  (a new call queued, a Ray actor's answer posted by Ray's callback thread, ``close``); it only times out to cut
  off a call at its deadline.
- A worker that does not get ready within ``START_TIMEOUT_S``, ``START_FAILURES`` workers in a row that die before
  they are ready, functions a worker cannot load, or this thread failing: nothing can score any more, and every
  open and later call ends as a ``bug`` naming why (the run stops with that line; never a stall).
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import wait as wait_any
from typing import Any

from asyncrl.faults import describe
from asyncrl.rewards.worker import BOOT

START_FAILURES = 3  # workers in a row that die before they are ready: the functions cannot run in a worker
START_TIMEOUT_S = 120.0  # a worker (a Ray actor waiting for resources) not ready by then: the run stops, named


def how(code: int | None) -> str:
    """An exit code in words."""
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessWorker:
    """One worker process (``asyncrl/rewards/worker.py``) and its connection. ``conn`` is what the dispatcher
    waits on; answers are read from it. ``calls``: the ``[key, index, name, started]`` sent to it, in order."""

    where = "process"

    def __init__(self, payload: bytes, post: Callable[[Any, tuple], None]):
        parent, child = Pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", BOOT, str(child.fileno())], pass_fds=(child.fileno(),),
                                     stdin=subprocess.DEVNULL)
        child.close()
        self.conn, self.ready, self.calls, self.since = parent, False, [], time.monotonic()
        self.label = f"pid {self.proc.pid}"
        parent.send(("init", list(sys.path), payload))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: bytes) -> None:
        self.conn.send_bytes(message)

    def stop(self, grace_s: float = 0.0) -> str:
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
        return how(code)


class WorkerPool:
    """``workers`` workers made by ``make(payload, post)`` (``ProcessWorker`` or ``RayWorker``), fed by one
    dispatcher thread (see the module's invariants). ``runner`` is the ``RewardRunner`` it reports to (``finish``,
    ``live``, ``notices``, ``on_done``, ``timeout_s``)."""

    def __init__(self, runner: Any, workers: int, payload: bytes, make: Callable[..., Any] = ProcessWorker):
        self.runner, self.n, self.payload, self.make = runner, workers, payload, make
        self.queue: collections.deque = collections.deque()  # (key, index, batch) not yet sent
        self.inbox: collections.deque = collections.deque()  # (worker, message) posted from other threads (Ray)
        self.workers: list[Any] = []
        self.error: str | None = None
        self.lock = threading.Lock()  # ``error`` and ``queue`` change together: no call queues after a break
        self.closing = False
        self.notify = False  # a group ended on this thread: call the runner's on_done after the next assignment
        self.start_failures = 0
        self.wake_r, self.wake_w = os.pipe()
        self.thread = threading.Thread(target=self._run, name="asyncrl-reward-dispatch", daemon=True)
        self.thread.start()

    def enqueue(self, calls: list[tuple[Any, int, Any]]) -> None:
        """Queue ``(key, index, batch)`` calls; one wake-up for all of them."""
        with self.lock:
            error = self.error
            if error is None:
                self.queue.extend(calls)
                self._wake()
        if error is not None:
            for key, index, _ in calls:
                self.runner.finish(key, index, ("bug", error, 0.0))

    def post(self, worker: Any, message: tuple) -> None:
        """A message of ``worker`` that arrived on another thread (a Ray actor's answer)."""
        self.inbox.append((worker, message))
        with self.lock:
            self._wake()

    def _wake(self) -> None:  # under ``lock``
        if self.wake_w is not None:
            os.write(self.wake_w, b"x")

    def pids(self) -> list[int]:
        return [w.pid for w in list(self.workers) if w.ready]

    def close(self) -> None:
        self.closing = True
        with self.lock:
            self._wake()
        self.thread.join(10.0)

    # --------------------------------------------------------------------------------- the dispatcher thread
    def _run(self) -> None:
        try:
            self.workers = [self.make(self.payload, self.post) for _ in range(self.n)]
            while not self.closing:
                self._assign()
                if self.notify and self.runner.on_done is not None:  # after the next calls went out, not before
                    self.notify = False
                    self.runner.on_done()
                by_conn = {w.conn: w for w in self.workers if w.conn is not None}
                for ready in wait_any([*by_conn, self.wake_r], self._wait_s()):
                    if ready == self.wake_r:
                        os.read(self.wake_r, 4096)
                    elif by_conn[ready] in self.workers:  # not replaced meanwhile
                        try:
                            message = ready.recv()
                        except (EOFError, OSError):
                            message = ("died", None)
                        self._handle(by_conn[ready], message)
                while self.inbox:
                    worker, message = self.inbox.popleft()
                    if worker in self.workers:
                        self._handle(worker, message)
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
        timeout, now = self.runner.timeout_s, time.monotonic()
        due = [w.since + START_TIMEOUT_S - now for w in self.workers if not w.ready]
        if timeout is not None:
            due += [w.calls[0][3] + timeout - now for w in self.workers if w.calls]
        return max(0.0, min([1.0, *due]))

    def _assign(self) -> None:
        """Each idle worker gets the next call."""
        for w in self.workers:
            if w.ready and not w.calls and not self._send_next(w):
                return

    def _send_next(self, w: Any) -> bool:
        """Send ``w`` the next live call; False when none was sent (the queue is empty)."""
        while self.queue:
            key, index, batch = self.queue.popleft()
            if not self.runner.live(key):
                continue  # cancelled while it queued
            try:
                message = pickle.dumps(("call", index, batch), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # the group's columns cannot be pickled
                self.runner.finish(key, index, ("bug", f"a reward worker cannot be sent group {key!r}'s inputs "
                                                       f"({describe(exc)})", 0.0))
                continue
            try:
                w.send(message)
            except (OSError, EOFError):  # the worker just died: its EOF comes next; the call waits again
                self.queue.appendleft((key, index, batch))
                return False
            w.calls.append([key, index, self.runner.functions.names[index], None if w.calls else time.monotonic(),
                            batch])
            return True
        return False

    def _handle(self, w: Any, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            w.ready, self.start_failures = True, 0
        elif kind == "init_error":
            self._break(f"a reward worker could not load the reward functions: {message[1]}")
        elif kind == "died":
            self._died(w, message[1])
        elif w.calls:
            key, index = w.calls.pop(0)[:2]
            if w.calls:
                w.calls[0][3] = time.monotonic()  # it starts the next one now
            self.runner.finish(key, index, message)

    def _requeue(self, w: Any) -> None:
        """Put the calls ``w`` was sent but never started back at the front of the queue, in their order."""
        with self.lock:
            for key, index, _, _, batch in reversed(w.calls[1:]):
                self.queue.appendleft((key, index, batch))
        del w.calls[1:]

    def _replace(self, w: Any) -> None:
        self.workers[self.workers.index(w)] = self.make(self.payload, self.post)

    def _died(self, w: Any, why: str | None) -> None:
        ended = w.stop()
        why = why or ended
        self._requeue(w)
        if w.calls:
            key, index, name, started, _ = w.calls[0]
            self.runner.finish(key, index, ("problem", f"the reward worker ({w.label}) died ({why}) while scoring "
                                            f"with {name!r}; it was replaced", time.monotonic() - started))
        elif not w.ready:
            self.start_failures += 1
            if self.start_failures >= START_FAILURES:
                self._break(f"reward workers die as they start ({self.start_failures} in a row, the last {why})")
                return
        else:
            self.runner.notices.append(f"a reward worker ({w.label}) died while idle ({why}); replaced")
        self._replace(w)

    def _expire(self) -> None:
        timeout, now = self.runner.timeout_s, time.monotonic()
        for w in list(self.workers):
            if not w.ready and now - w.since > START_TIMEOUT_S:
                self._break(f"a reward worker ({w.where}) was not ready within {START_TIMEOUT_S:g} s")
                return
            if timeout is not None and w.calls and now - w.calls[0][3] > timeout:
                key, index, name, started, _ = w.calls[0]
                w.stop()
                self._requeue(w)
                self.runner.finish(key, index, ("problem", f"reward function {name!r} ran past reward.timeout_s="
                                                f"{timeout:g} s; its worker ({w.label}) was stopped and replaced",
                                                now - started))
                self._replace(w)

    def _break(self, why: str) -> None:
        """Nothing can score any more: every open call ends as a bug naming ``why``, and so will new ones."""
        with self.lock:
            self.error = why
            queued = list(self.queue)
            self.queue.clear()
        for w in self.workers:
            for key, index, *_ in w.calls:
                self.runner.finish(key, index, ("bug", why, 0.0))
            w.calls = []
        for key, index, _ in queued:
            self.runner.finish(key, index, ("bug", why, 0.0))
        self.closing = True
