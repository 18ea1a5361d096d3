"""The gap pass beside training: during a run, a thread of the train pump's own measures each buffered group under
the weights that sampled it (``policy.logprobs_at`` on the kept copies), so the train pump finds a stale chunk's
``version_logprobs`` known when it selects it and splits the importance weight into staleness and mismatch
(``algorithms.gap_contributions``) without a pass of its own.

Why a thread: an asynchronous run is bound by its train thread (``benchmarks/bench_async_busy.py``: on CPU the
train pump's ticks are 99% of a step) while the rollout thread waits for a third of each step; the gap pass (a
no-grad forward of ``loss.gap_completions`` completions a group) was a tenth of the train thread's time. A group is
measurable as soon as it commits: the policy keeps a copy of its current weights from the optimizer step that made
them (``TrainPump._keep_versions``), so every version a ready group was sampled with is held.

Invariants:
- The numbers are the train pump's: the same ``mark_versions`` over the same completions with the same kept
  weights, and a row's logprobs do not depend on the other rows of its batch (the policy's forward is row-wise:
  tests/test_gap_pass.py checks it on CPU), so a step's metrics row is the same whichever thread measured a group.
- Only for a policy that declares ``Capabilities.concurrent_logprobs_at`` (its ``logprobs_at`` never touches the
  weights being trained), and only while a run goes (``Controller.start`` starts it; it ends within
  ``WAIT_S`` of the run's end): by hand ticks the train pump measures each chunk itself.
- A group is measured here at most once, and never after the train pump selected it: ``claim`` (under the
  controller's lock, at select) takes the known values of the chosen groups, waits while one of them is being
  measured, and marks them all done. A failed measurement is dropped, not raised: the train pump then measures
  the group itself and meets the error where faults are handled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from asyncrl.buffer import ReplayBuffer
from asyncrl.state import RunState

WAIT_S = 0.2  # how long the thread sleeps between looks when nothing is to be measured (a commit wakes it at once)
Measure = Callable[[list[Any]], dict[int, list]]  # groups -> group id -> one value (or None) per completion token


class GapPass:
    """The thread. ``measure(groups)`` computes the values (``TrainPump.measure``); ``kept()`` is the set of weight
    versions the policy holds now; a ready group whose oldest version is among them is measured, unless it is among
    the ``needed()`` oldest ready groups (the step in progress needs that many more, not counting a chunk being
    trained) and was sampled by the current weights: that step will most likely train it fresh, where it needs no
    measure (a guess about the sampler, for the cost only: a group it gets wrong is measured later, here or by the
    train pump)."""

    def __init__(self, state: RunState, buffer: ReplayBuffer, measure: Measure, kept: Callable[[], set[int]],
                 needed: Callable[[], int]):
        self.state, self.buffer, self.measure, self.kept, self.needed = state, buffer, measure, kept, needed
        # Locks: the state's, then ``_measured``, never the other way round (the thread stores what it measured
        # under ``_measured`` alone, so ``claim``, waiting under the state's lock, cannot block it).
        self._measured = threading.Condition()  # guards ``known`` and ``_busy``; notified when a measurement ends
        self.known: dict[int, list] = {}  # measured, not yet claimed
        self._busy: frozenset[int] = frozenset()  # being measured now
        self._done: set[int] = set()  # measured or claimed: never measured again (under the state's lock)
        self._thread: threading.Thread | None = None
        self._running: Callable[[], bool] = lambda: False

    def start(self, running: Callable[[], bool]) -> None:
        """Measure while ``running()`` (a run's; the thread of an earlier run still going carries on for this one).
        What is known stays claimable after."""
        with self.state.lock:
            self._running = running
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="asyncrl-gap-pass")
                self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end (within ``WAIT_S`` of its run's end, after the
        measurement in progress). Why: a daemon thread still inside a torch op when the process exits aborts it
        ("terminate called without an active exception", seen once in CI after an attached ``stop``), and the
        policy it measures with must not be closed under it."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and not self._running():
            thread.join(timeout)

    def claim(self, group_ids: Iterable[int]) -> dict[int, list]:
        """Under the controller's lock: the known values of ``group_ids`` (waiting while one of them is being
        measured); they are never measured here afterwards."""
        ids = set(group_ids)
        self._done |= ids
        with self._measured:
            while self._busy & ids:
                self._measured.wait()
            return {g: self.known.pop(g) for g in ids if g in self.known}

    def _todo(self) -> list[Any]:
        kept = self.kept()
        ready = self.buffer.ready_slots()
        here = {slot.group_id for slot in ready}
        self._done &= here  # a group that left the buffer never comes back
        with self._measured:
            self.known = {g: v for g, v in self.known.items() if g in here}
        T = self.state.trainer_version
        oldest = {slot.group_id: slot.weight_version if slot.start_weight_version is None else slot.start_weight_version
                  for slot in ready}
        fresh = [g for g, v in list(oldest.items())[:max(0, self.needed())] if v >= T]  # dispatch order
        return [slot.rollouts for slot in ready if slot.group_id not in self._done and oldest[slot.group_id] in kept
                and slot.group_id not in fresh]

    def _loop(self) -> None:
        while True:
            with self.state.changed:
                while (going := self._running()) and not (todo := self._todo()):
                    self.state.changed.wait(WAIT_S)
                if not going:
                    self._thread = None  # under the lock: a start from now on starts a new thread
                    return
                ids = frozenset(g.group_id for g in todo)
                self._done |= ids
                with self._measured:
                    self._busy = ids
            try:
                values = self.measure(todo)
            except Exception:  # the train pump measures these itself and meets the error there
                values = {}
            with self._measured:
                self.known.update(values)
                self._busy = frozenset()
                self._measured.notify_all()
