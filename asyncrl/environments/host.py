"""Environment instances, one per trajectory, hosted in ``environment.workers`` worker processes (or, with 0
workers, in this process).

A worker is started as the reward workers are (``python -c BOOT FD``, never ``multiprocessing``'s spawn) and
loads the environment class from a cloudpickle payload, so a class defined in a notebook cell runs too.

Invariants:
- A trajectory's instance lives in one worker (``key -> worker``, by its group: a group's instances together), and a
  worker answers its calls one at a time, in order: a timeout or a death is the fault of the call it was running.
- ``run(calls)`` answers every call with an ``Outcome`` (``start`` sends them and ``collect`` takes the answers
  as they come, so a caller need not wait for the slowest; a deadline is checked whenever either runs): ``ok`` with the value, or a ``problem`` naming the
  environment, the call and why (an exception, a value of the wrong type, past ``timeout_s``, the worker died).
  A worker past its deadline is killed; a dead one is replaced; the instances it held are gone, so every later
  call on them is a problem too ("lost"). Nothing here retries: the turns module gives the trajectory up and the
  rollout pump regenerates its group within ``faults.max_dispatch_attempts``.
- A worker whose caller is gone exits (the reward worker's rule).
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import wait as wait_any
from typing import Any

from asyncrl.environments import is_text_environment, tool_names

BOOT = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
path, payload = conn.recv()
sys.path[:] = path
from asyncrl.environments.host import serve
serve(conn, payload)
"""


PIPELINED = ("step", "tool")  # a turn's calls: small, so a worker's pipe holds several (``EnvironmentHost._pump``)
PIPELINE = 8


@dataclass
class Outcome:
    ok: bool
    value: Any = None
    problem: str = ""


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _accepted(fn: Any, row: dict) -> dict:
    """The row's columns ``fn`` takes: all with ``**kwargs``, else those it names (TRL's ``reset(self)`` takes
    none)."""
    import inspect

    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return row
    return {k: v for k, v in row.items() if k in {p.name for p in params}}


@functools.lru_cache(maxsize=64)
def callable_tools(cls: type) -> tuple[str, ...]:
    """The methods a model may call on ``cls``: the tools it advertises (``tool_names``, the schemas the chat
    template renders); none for a text environment."""
    return () if is_text_environment(cls) else tuple(tool_names(cls))


def refuse_tool_call(cls: type, method: Any, kwargs: Any) -> str:
    """Why a model's tool call is not run (an ``error:`` observation, as TRL answers an unknown tool), or "": a
    name that is not one of the class's tools (``reset``, ``get_reward``, a private method or an attribute are
    none), or arguments that are not a JSON object."""
    tools = callable_tools(cls)
    if not isinstance(method, str) or method not in tools:
        return f"error: unknown tool {method!r} (tools: {', '.join(tools)})"
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        return f"error: the arguments of {method!r} must be a JSON object, got {type(kwargs).__name__}"
    return ""


def apply(cls: type, instances: dict, key: Any, op: str, args: tuple, functions: Any = None) -> Outcome:
    """One call on the instance of ``key``: ``make`` (a new instance, reset with the row), ``step``, ``tool``
    (a method by name, keyword arguments), ``reward`` (``get_reward``), ``score`` (the run's reward functions on a
    group, ``environments=`` its instances: ``[(kind, values, seconds)]`` per function, as
    ``asyncrl.rewards.functions.outcome``) or ``drop``. A wrong type is a problem."""
    name = cls.__qualname__
    if op == "score":
        from asyncrl.rewards.functions import outcome

        keys, batch = args
        if any(k not in instances for k in keys):
            return Outcome(False, problem=f"{name} instances lost before scoring (their worker was replaced)")
        batch.columns["environments"] = [instances[k] for k in keys]  # TRL's keyword
        return Outcome(True, [outcome(f, n, batch) for f, n in zip(functions.funcs, functions.names)])
    try:
        if op == "make":
            instances[key] = env = cls()
            out = env.reset(**_accepted(env.reset, args[0]))
            if out is not None and not isinstance(out, str):
                return Outcome(False, problem=f"{name}.reset returned {type(out).__name__}, not a str or None")
            return Outcome(True, out)
        if op == "drop":
            instances.pop(key, None)
            return Outcome(True)
        env = instances.get(key)
        if env is None:
            return Outcome(False, problem=f"{name} instance lost (its worker was replaced)")
        if op == "step":
            out = env.step(args[0])
            if (not isinstance(out, tuple) or len(out) != 3 or not (out[0] is None or isinstance(out[0], str))
                    or not isinstance(out[1], (int, float)) or isinstance(out[1], bool)):
                return Outcome(False, problem=f"{name}.step returned {out!r:.80}, not (str | None, float, bool)")
            return Outcome(True, (out[0], float(out[1]), bool(out[2])))
        if op == "tool":
            method, kwargs = args
            refused = refuse_tool_call(cls, method, kwargs)
            if refused:  # never executed: the model reads why (it counts as a tool call that errored)
                return Outcome(True, refused)
            try:
                return Outcome(True, str(getattr(env, method)(**kwargs)))
            except Exception as exc:  # a tool's error is the model's to read, as TRL returns it
                return Outcome(True, f"error: {_describe(exc)}")
        if op == "reward":
            out = env.get_reward() if hasattr(env, "get_reward") else 0.0
            if not isinstance(out, (int, float)) or isinstance(out, bool):
                return Outcome(False, problem=f"{name}.get_reward returned {type(out).__name__}, not a float")
            return Outcome(True, float(out))
        raise ValueError(f"unknown environment call {op!r}")
    except Exception as exc:
        return Outcome(False, problem=f"{name}.{'reset' if op == 'make' else op} raised {_describe(exc)}")


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def serve(conn, payload: bytes) -> None:
    """The worker: load the class, then answer ``(key, op, args)`` calls until the caller goes away."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    try:
        cls, functions = pickle.loads(payload)
    except BaseException as exc:  # noqa: BLE001 - the caller must hear it in one line
        conn.send(("init_error", _describe(exc)))
        return
    conn.send(("ready",))
    instances: dict = {}
    while True:
        try:
            key, op, args = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(apply(cls, instances, key, op, args, functions))


class _Worker:
    def __init__(self, payload: bytes):
        parent, child = Pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", BOOT, str(child.fileno())], pass_fds=(child.fileno(),),
                                     stdin=subprocess.DEVNULL)
        child.close()
        self.conn = parent
        parent.send((list(sys.path), payload))
        self.ready = False

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        self.conn.close()
        return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


class EnvironmentHost:
    """The instances of ``cls`` in ``workers`` processes (0: here). ``timeout_s`` bounds each call; ``start_s``
    how long a new worker may take to load the class; ``functions``: the run's reward functions (``score``), sent
    with the class. A group's trajectories live in one worker (``key = (group id, trajectory)``), so its reward
    functions see all its instances."""

    def __init__(self, cls: type, workers: int, timeout_s: float, start_s: float = 60.0, functions: Any = None):
        self.cls, self.n, self.timeout_s, self.start_s, self.functions = cls, workers, timeout_s, start_s, functions
        self.instances: dict = {}  # workers == 0
        self.owner: dict = {}  # key -> worker index
        self._lock = threading.RLock()
        self.workers: list[_Worker] = []
        # Calls in the workers (``start``/``collect``; ``run`` is both): each a ticket; per worker the tickets
        # waiting (in order) and the one running with its deadline; the answers not yet collected.
        self._next = 0
        self._calls: dict[int, tuple] = {}
        self._queues: dict[int, deque] = {}
        self._running: dict[int, tuple[int, float]] = {}
        self._done: dict[int, Outcome] = {}
        self._discard: set[int] = set()  # answers nobody collects (drops not waited for)
        if workers:
            import cloudpickle

            self.payload = cloudpickle.dumps((cls, functions))
            self.workers = [_Worker(self.payload) for _ in range(workers)]

    def run(self, calls: list[tuple[Any, str, tuple]]) -> list[Outcome]:
        """Each ``(key, op, args)`` answered, in order per worker, calls on different workers at once. One caller
        at a time (an evaluation on the train pump's thread waits for the rollout pump's calls)."""
        with self._lock:
            tickets = self._start(calls)
            while any(t not in self._done for t in tickets):
                self._pump(None)
            return [self._done.pop(t) for t in tickets]

    def start(self, calls: list[tuple[Any, str, tuple]]) -> list[int]:
        """Send calls without waiting for them: a ticket each, for ``collect`` (with 0 workers: answered here)."""
        with self._lock:
            return self._start(calls)

    def collect(self, tickets: set[int], timeout: float = 0.0) -> dict[int, Outcome]:
        """The calls of ``tickets`` answered by now, waiting up to ``timeout`` seconds for a first one (a call past
        its deadline is answered as ``run`` answers it)."""
        with self._lock:
            if not any(t in self._done for t in tickets) and any(t in self._calls for t in tickets):
                self._pump(timeout)
            self._pump(0.0)
            return {t: self._done.pop(t) for t in list(tickets) if t in self._done}

    def _start(self, calls: list[tuple[Any, str, tuple]]) -> list[int]:
        tickets = list(range(self._next, self._next + len(calls)))
        self._next += len(calls)
        for t, (key, op, args) in zip(tickets, calls):
            if not self.n:
                self._done[t] = apply(self.cls, self.instances, key, op, args, self.functions)
                continue
            if op == "make" or key not in self.owner:
                self.owner[key] = key[0] % self.n  # a group's trajectories together (its reward functions' view)
            self._calls[t] = (key, op, args)
            self._queues.setdefault(self.owner[key], deque()).append(t)
        return tickets

    def _pump(self, timeout: float | None) -> None:
        """Send each worker its next calls (a turn's ``step``/``tool`` calls queue up to ``PIPELINE`` deep in its
        pipe, so it goes from one to the next without waiting for this caller; any other call goes alone); take the
        answers that come within ``timeout`` (None: until the next deadline or answer); the call a worker is
        running past its deadline (counted from when it came to the head of that worker's line) stops it."""
        now = time.monotonic()
        for w in list(self._queues):
            sent = self._running.setdefault(w, deque())
            while w in self._queues and self._ready(w) and self._fits(sent, self._calls[self._queues[w][0]][1]):
                t = self._queues[w].popleft()
                if not self._queues[w]:
                    del self._queues[w]
                try:
                    self.workers[w].conn.send(self._calls[t])
                    sent.append([t, now + self.timeout_s if not sent else None, self._calls[t][1]])
                except Exception as exc:  # e.g. the arguments cannot be pickled
                    self._answer(t, Outcome(False, problem=f"an environment call cannot be sent: {_describe(exc)}"))
        busy = {w: sent for w, sent in self._running.items() if sent}
        if not busy:
            return
        by_conn = {self.workers[w].conn: w for w in busy}
        wait = max(0.0, min(sent[0][1] for sent in busy.values()) - time.monotonic())
        for conn in wait_any(list(by_conn), wait if timeout is None else min(wait, timeout)):
            w = by_conn[conn]
            try:
                while busy[w] and conn.poll():
                    outcome = conn.recv()  # first: a dead worker's EOF is the fault of the call at the head
                    self._answer(busy[w].popleft()[0], outcome)
                    if busy[w]:
                        busy[w][0][1] = time.monotonic() + self.timeout_s  # the next one is running now
            except (EOFError, OSError):
                t = busy[w].popleft()[0]
                why = self._replace(w)
                self._answer(t, Outcome(False, problem=f"the environment worker died ({why}) during "
                                        f"{self.cls.__qualname__}.{self._calls[t][1]}; it was replaced"))
        now = time.monotonic()
        for w, sent in busy.items():
            if sent and now >= sent[0][1]:
                t = sent.popleft()[0]
                self._replace(w)
                self._answer(t, Outcome(False, problem=f"{self.cls.__qualname__}.{self._calls[t][1]} ran past "
                                        f"environment.timeout_s={self.timeout_s:g} s; its worker was stopped and "
                                        "replaced"))

    @staticmethod
    def _fits(sent: deque, op: str) -> bool:
        """May a call ``op`` go to a worker that is running ``sent`` now (see ``_pump``)."""
        return not sent or (op in PIPELINED and len(sent) < PIPELINE and all(x[2] in PIPELINED for x in sent))

    def _answer(self, ticket: int, outcome: Outcome) -> None:
        self._calls.pop(ticket, None)
        if ticket in self._discard:
            self._discard.discard(ticket)
        else:
            self._done[ticket] = outcome

    def _ready(self, w: int) -> bool:
        """Wait for worker ``w`` to have loaded the class (a failure to load is one line: nothing could run)."""
        worker = self.workers[w]
        if not worker.ready:
            if not worker.conn.poll(self.start_s):
                raise RuntimeError(f"an environment worker did not start within {self.start_s:g} s")
            message = worker.conn.recv()
            if message[0] != "ready":
                raise RuntimeError(f"an environment worker cannot load {self.cls.__qualname__}: {message[1]}")
            worker.ready = True
        return True

    def _replace(self, w: int) -> str:
        """Stop worker ``w`` and start another; the instances it held are lost (their keys forget the worker); the
        calls sent to it behind the one it was running go to the new one (as lost instances' calls, they fail)."""
        rest = self._running.get(w, deque())
        if rest:
            self._queues[w] = deque([x[0] for x in rest] + list(self._queues.get(w, ())))
            rest.clear()
        why = self.workers[w].stop()
        self.workers[w] = _Worker(self.payload)
        for key in [k for k, owner in self.owner.items() if owner == w]:
            del self.owner[key]
        return why

    def drop(self, keys: list, wait: bool = True) -> None:
        """Forget the instances of ``keys`` (finished, given up or aborted trajectories); ``wait`` False: the drops
        are sent and their answers ignored (a worker takes them after the calls sent before)."""
        with self._lock:
            live = [k for k in keys if (k in self.instances if not self.n else k in self.owner)]
            if live and (wait or not self.n):
                self.run([(k, "drop", ()) for k in live])
            elif live:
                self._discard.update(self._start([(k, "drop", ()) for k in live]))
                self._pump(0.0)
            for k in live:
                self.owner.pop(k, None)
        for k in live:
            self.owner.pop(k, None)

    def close(self) -> None:
        with self._lock:
            for worker in self.workers:
                worker.stop()
            self.workers = []
