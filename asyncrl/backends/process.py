"""Run a generation backend in a child process: ``generation.placement: process``.

Why: on a CPU box, generating and training a small model are both bound by Python and the torch dispatcher, so the
two pump threads of ``Controller.run`` take turns on one interpreter lock instead of overlapping (measured in
``benchmarks/README.md``). A child process has its own interpreter lock. Ray actors give that too, but each call is a
round trip through Ray plus object-store copies, which at this size outweighed the gain; here a call is one message
over a pipe and the weights go through shared memory.

How:
- The child (started with ``spawn``: no forked threads or OpenMP state) builds ``cls(*args)`` with the parent's
  torch thread count, then serves two pipes: *generation* (``poll``) and *control* (weight loads and every other
  method). It handles one message at a time, so a weight load never interleaves a generation, as with the
  in-process generator's lock.
- ``submit`` and ``abort`` never cross the pipe: requests wait in the parent until ``poll`` sends what is queued,
  one generate call per ``submit`` call, and waits for the child to generate it (``submit`` + ``poll(None)``
  there); ``load_weights`` first generates what is still queued (drain). That keeps the in-process generator's
  contract exactly: ``poll`` generates what is queued, a load never changes the weights of a group submitted
  before it, ``abort`` cancels what is still queued and a group being generated finishes; and one decode per
  submitted batch draws the same random numbers in the same order, so a seeded run gives bit-identical tokens in
  either placement (same threads).
  While ``poll`` waits on the pipe the parent's interpreter lock is free for training.
- Weights: the first ``load_weights`` allocates one shared-memory tensor per weight (``share_memory_()``) and hands
  them to the child once; each load then copies into them and sends only ``("load", version)``; the child copies
  them into its model between generations. ``version`` moves when the child has acknowledged the load, and
  ``load_weights`` returns only then, so the parent never overwrites the staging tensors while the child reads them.
- Failure: a child that dies makes the next (or the waiting) call raise ``RuntimeError`` naming its pid and exit
  code, never hang (the parent holds no copy of the child's pipe ends, so a dead child is an EOF). An exception
  inside the child is re-raised in the parent with the child's traceback; the child serves on.
- An interrupted call (``KeyboardInterrupt`` while waiting) leaves its reply owed; the next call on that pipe reads
  it first: a late generation's groups are returned by the next ``poll`` (nothing is lost), a late load sets
  ``version``.
- ``close()`` asks the child to close its backend and exit, then reaps it (terminates it after a grace period).
  The child ignores SIGINT (Ctrl-C reaches the whole process group): interrupts are the parent's to handle.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from asyncrl.backends.base import Capabilities, capabilities
from asyncrl.backends.submit_queue import SubmitQueue

START_TIMEOUT_S = 300.0  # building the backend in the child (imports + model) must finish within this
CLOSE_TIMEOUT_S = 10.0


def _serve(cls: type, args: tuple, threads: int, gen_conn: Connection, ctl_conn: Connection) -> None:
    """The child's main loop."""
    # Ctrl-C in a terminal or a notebook's Interrupt signals the whole process group: the parent decides what an
    # interrupt stops, and the child ends on "close" or when the parent's pipe ends close.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        obj = cls(*args)
    except BaseException:
        ctl_conn.send(("error", traceback.format_exc()))
        return
    ctl_conn.send(("ok", obj.version))
    staging: dict[str, torch.Tensor] = {}
    while True:
        for conn in wait([gen_conn, ctl_conn]):
            try:
                op, *a = conn.recv()
            except EOFError:  # the parent is gone
                return
            try:
                if op == "generate":
                    obj.submit(a[0])
                    result = obj.poll(None)
                elif op == "load":
                    version, tensors = a
                    staging = tensors if tensors is not None else staging
                    obj.load_weights(staging, version)
                    result = obj.version
                elif op == "call":
                    result = getattr(obj, a[0])(*a[1])
                elif op == "get":
                    result = getattr(obj, a[0])
                elif op == "close":
                    if hasattr(obj, "close"):
                        obj.close()
                    conn.send(("ok", None))
                    return
                else:
                    raise ValueError(f"unknown message {op!r}")
                reply = ("ok", result)
            except Exception:
                reply = ("error", traceback.format_exc())
            conn.send(reply)


def _start_without_main(process: Any) -> None:
    """Start a ``spawn`` process without re-running the caller's ``__main__`` in it. ``spawn`` normally imports
    the main script in the child, which re-executes a script that has no ``if __name__ == "__main__":`` guard (and
    then fails on its own ``Controller``). The child runs only ``_serve`` and an asyncrl backend class, so it needs
    nothing from ``__main__``; spawn decides what to import from these two attributes while ``start()`` runs."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        process.start()
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


class _Channel:
    """One pipe to the child, its lock, and the ops whose replies are still owed (calls interrupted while waiting)."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock, self.owed = conn, threading.Lock(), deque()


class ProcessGenerator:
    """A :class:`~asyncrl.backends.base.GenerationBackend` whose ``cls(*args)`` lives in a child process (see the
    module docstring). Besides the protocol it forwards ``generate_greedy`` (evaluation), ``state_dict`` and
    ``load_state_dict`` (save/restore), and ``step_metrics`` when ``cls`` declares it, over the control pipe."""

    capabilities = Capabilities()  # the instance's: what it passes on of what ``cls`` declares

    def __init__(self, cls: type, args: tuple, threads: int | None = None) -> None:
        # Of what ``cls`` declares, step_metrics crosses the pipe like any call. Not staged weights (a load goes
        # through shared memory, between generations) and not an actor (a dead child is an error, not a restart).
        self.capabilities = Capabilities(step_metrics=capabilities(cls).step_metrics,
                                         sampled_evaluation=capabilities(cls).sampled_evaluation)
        ctx = torch.multiprocessing.get_context("spawn")  # torch's pickler shares tensors through shared memory
        gen_parent, gen_child = ctx.Pipe()
        ctl_parent, ctl_child = ctx.Pipe()
        self.name = f"{cls.__name__} generator process"
        self._process = ctx.Process(target=_serve, name=self.name, daemon=True,
                                    args=(cls, args, threads or torch.get_num_threads(), gen_child, ctl_child))
        _start_without_main(self._process)
        gen_child.close()  # only the child holds these ends now: its death is an EOF here, not a hang
        ctl_child.close()
        self._gen, self._ctl = _Channel(gen_parent), _Channel(ctl_parent)
        self._queue = SubmitQueue()
        self._drain = threading.Lock()  # taking the queue and generating it, or a load: never interleaved
        self._late: list = []  # groups of an interrupted poll, returned by the next one
        self._staging: dict[str, torch.Tensor] | None = None
        self._closed = False
        if not ctl_parent.poll(START_TIMEOUT_S):
            self._process.terminate()
            raise RuntimeError(f"{self.name} did not start within {START_TIMEOUT_S:.0f} s")
        self._ctl.owed.append("start")
        self._version = self._reply(self._ctl)

    # -- the pipes -------------------------------------------------------------------------------------------
    def _died(self, exc: BaseException | None = None) -> RuntimeError:
        self._process.join(1.0)
        code = self._process.exitcode
        state = "is still running" if code is None else f"exited with code {code}"
        return RuntimeError(f"{self.name} (pid {self._process.pid}) died: it {state} and its pipe broke ({exc!r})")

    def _reply(self, ch: _Channel) -> Any:
        """Receive the reply owed first on ``ch``; raise the child's error, or that the child died."""
        op = ch.owed[0]
        try:
            status, value = ch.conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died(exc) from exc
        ch.owed.popleft()  # received: owed no more, error or not
        if status == "error":
            raise RuntimeError(f"{self.name} (pid {self._process.pid}) failed in {op}:\n{value}")
        return value

    def _call(self, ch: _Channel, op: str, *args: Any, prepare=None) -> Any:
        """Send ``(op, *args)`` and return the reply. ``prepare()`` runs first, once every owed reply is read
        (the child is then idle on this pipe) and may return replacement ``args``."""
        with ch.lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            while ch.owed:  # replies of calls interrupted before they read them, in order
                late_op = ch.owed[0]
                self._settle_late(late_op, self._reply(ch))
            if prepare is not None:
                args = prepare()
            try:
                ch.conn.send((op, *args))
            except OSError as exc:
                raise self._died(exc) from exc
            ch.owed.append(op)
            return self._reply(ch)

    def _settle_late(self, op: str, value: Any) -> None:
        if op == "generate":
            self._late.extend(value)
        elif op == "load":
            self._version = value

    # -- GenerationBackend -----------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def submit(self, requests: Sequence) -> None:
        self._queue.submit(requests)

    def num_inflight(self) -> int:
        return self._queue.inflight() + len(self._late)

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        """Remove still-queued groups; a group already being generated finishes (and is not listed)."""
        return self._queue.abort(group_ids)

    def poll(self, timeout: float | None = 0.0) -> list:
        """Generate everything queued now in the child, one call per submitted batch, and return it (with the
        groups of an interrupted earlier poll or of a load's drain); ``[]`` when nothing is queued. Like the
        in-process generator, ``timeout`` never makes it wait longer than the generation itself."""
        with self._drain:
            done = self._generate_queued()
            late, self._late = self._late, []
        return late + done

    def _generate_queued(self) -> list:
        return self._queue.generate(lambda requests: self._call(self._gen, "generate", requests))

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``weights`` into the shared staging tensors, then have the child load them; returns (and moves
        ``version``) once the child has. The first call shares the staging tensors with the child."""

        def stage() -> tuple:  # runs with no load owed, so the child is not reading the staging tensors
            if self._staging is None:
                self._staging = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in weights.items()}
                return int(version), self._staging
            if weights.keys() != self._staging.keys():
                raise KeyError(f"load_weights: weights {sorted(set(weights) ^ set(self._staging))} differ from "
                               "the first load's")
            with torch.no_grad():
                for name, tensor in weights.items():
                    self._staging[name].copy_(tensor)
            return int(version), None

        with self._drain:  # what was submitted before the load is generated with the weights it was submitted for
            self._late += self._generate_queued()
            self._version = self._call(self._ctl, "load", prepare=stage)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None) -> list:
        return self._call(self._ctl, "call", "generate_greedy", (prompts, max_new_tokens))

    def generate_sampled(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, seed: int,
                         max_new_tokens: int | None = None) -> list:
        """The hosted generator's (used only when it declares ``sampled_evaluation``: ``capabilities``)."""
        return self._call(self._ctl, "call", "generate_sampled", (prompts, n, temperature, seed, max_new_tokens))

    def step_metrics(self) -> dict[str, float]:
        """The hosted generator's ``step_metrics()`` (read only when it declares them: ``capabilities``)."""
        return self._call(self._ctl, "call", "step_metrics", ())

    def state_dict(self) -> dict[str, Any]:
        return self._call(self._ctl, "call", "state_dict", ())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call(self._ctl, "call", "load_state_dict", (state,))
        self._version = self._call(self._ctl, "get", "version")

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self) -> None:
        """Close the hosted backend and end the child; idempotent."""
        if self._closed:
            return
        try:
            if self._process.is_alive():
                self._call(self._ctl, "close")
        except RuntimeError:
            pass  # already dead: nothing to close
        finally:
            self._closed = True
            self._process.join(CLOSE_TIMEOUT_S)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(CLOSE_TIMEOUT_S)
            for ch in (self._gen, self._ctl):
                ch.conn.close()
