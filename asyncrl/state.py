"""The controller's run state, with one owner: ``RunState`` holds ``T``, the data position, whether the stream is
exhausted, the trace, the metrics rows and the evaluations. The controller holds one and hands it to its pumps;
nothing else writes it. (The groups in flight are the buffer's pending slots; what only the rollout pump needs of
them, the requests waiting for ``submit`` and the dispatch attempts, is the rollout pump's.) Observers subscribe to
its typed events (``Controller.subscribe``); ``state_dict`` / ``load_state_dict`` are what a checkpoint stores of it.

Invariants:
- Every change happens under ``lock``; ``changed`` (a condition on that lock) is notified when a pump made
  progress the other may wait for (a commit, a select, a step).
- ``trace[i].seq == i``; the i-th ``step`` row belongs to ``metrics[i]``.
- Subscribers are called outside ``lock``, one event at a time in trace order, each event once, from the thread
  that delivers (the end of a tick: ``deliver``). An event recorded while nobody listens is not kept for later
  subscribers (``subscribe(history=True)`` replays the trace instead).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.trace import STEP, TRACE_EVENTS, StepEvent, TraceRow

Event = TraceRow | StepEvent
Callback = Callable[[Event], Any]


class Subscription:
    """What ``subscribe`` returns: ``cancel()`` (or leave a ``with`` block) to stop receiving events."""

    def __init__(self, state: RunState, callback: Callback, events: frozenset[str], since: int):
        self.callback, self.events, self.since = callback, events, since
        self._state = state

    def cancel(self) -> None:
        self._state.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    def __repr__(self) -> str:
        return f"Subscription({getattr(self.callback, '__name__', self.callback)!r}, events={sorted(self.events)})"


def check_events(events: Iterable[str] | str | None) -> frozenset[str]:
    """``events`` as a set of trace event names (None: all); a bad name is an error naming the allowed ones."""
    if events is None:
        return frozenset(TRACE_EVENTS)
    names = (events,) if isinstance(events, str) else tuple(events)
    bad = [e for e in names if e not in TRACE_EVENTS]
    if bad or not names:
        raise ValueError(f"events must name trace events ({', '.join(TRACE_EVENTS)}), got {events!r}")
    return frozenset(names)


@dataclass(eq=False)
class RunState:
    trainer_version: int = 0  # T: optimizer steps done, and the weights the generator holds
    data_position: int = 0  # prompts taken from the stream
    exhausted: bool = False  # the stream has no batch left
    trace: list[TraceRow] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)  # one row per optimizer step
    evaluations: list[dict] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)
        self._subscribers: list[Subscription] = []
        self._pending: list[tuple[TraceRow, dict | None]] = []  # recorded, not yet delivered
        self._delivering = threading.RLock()  # one delivery at a time keeps trace order across threads

    # ------------------------------------------------------------------------------------------- recording
    def record(self, event: str, group_id=None, weight_version=None, target_step=None, lag=None, detail="",
               reason="", metrics: dict | None = None, **numbers: int | None) -> TraceRow:
        """Append one trace row (``metrics``: the step's metrics row, for a ``step`` event; ``numbers``: the typed
        columns ``gen_start_version``, ``gen_end_version``, ``replica``, ``dispatch_index``)."""
        with self.lock:
            row = TraceRow(len(self.trace), event, self.trainer_version, group_id, weight_version, target_step, lag,
                           detail, reason, **numbers)
            self.trace.append(row)
            if self._subscribers:
                self._pending.append((row, metrics))
            return row

    def finish_step(self, metrics: dict, detail: str, reason: str) -> TraceRow:
        """The metrics row of a finished step and its ``step`` trace row, together."""
        with self.lock:
            self.metrics.append(metrics)
            return self.record(STEP, detail=detail, reason=reason, metrics=metrics)

    # ---------------------------------------------------------------------------------------- subscribing
    def subscribe(self, callback: Callback, events=None, history: bool = False) -> Subscription:
        names = check_events(events)
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        with self._delivering:
            with self.lock:
                sub = Subscription(self, callback, names, len(self.trace))
                past = list(zip(self.trace, _step_rows(self.trace, self.metrics))) if history else []
                self._subscribers.append(sub)
            for row, metrics in past:  # outside the lock, before anything newer (delivery waits for us)
                if row.event in names:
                    callback(StepEvent(row, metrics) if metrics is not None else row)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self.lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)
            if not self._subscribers:
                self._pending.clear()

    def deliver(self) -> None:
        """Hand every event recorded since the last delivery to the subscribers that asked for it. Called by the
        controller at the end of each tick, never while holding ``lock``. With subscribers it always waits for a
        delivery another thread has under way, so a tick's events have reached them when the tick returns."""
        if not self._subscribers:
            return
        with self._delivering:
            with self.lock:
                pending, self._pending = self._pending, []
                subscribers = list(self._subscribers)
            for row, metrics in pending:
                item = StepEvent(row, metrics) if metrics is not None else row
                for sub in subscribers:
                    if row.event in sub.events and row.seq >= sub.since:
                        sub.callback(item)

    # ---------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """``T``, the data position, the trace (rows as lists, without their trailing empty typed columns, so a
        checkpoint from before those columns is written back byte for byte), metrics and evaluations: plain JSON
        values. Groups in flight are not in it: the buffer holds them as pending slots, and a restore submits them
        again."""
        with self.lock:
            return {"trainer_version": self.trainer_version, "data_position": self.data_position,
                    "exhausted": self.exhausted, "trace": [_trimmed(row) for row in self.trace],
                    "metrics": [dict(row) for row in self.metrics],
                    "evaluations": [dict(row) for row in self.evaluations]}

    def load_state_dict(self, state: dict) -> None:
        """Replace the history and counters by ``state``'s (the caller re-dispatches the buffer's pending groups).
        Recorded rows are history: subscribers are not told."""
        with self.lock:
            self.trainer_version, self.data_position = state["trainer_version"], state["data_position"]
            self.exhausted = state["exhausted"]
            self.trace = [TraceRow(*row) for row in state["trace"]]
            self.metrics = [dict(row) for row in state["metrics"]]
            self.evaluations = [dict(row) for row in state["evaluations"]]
            self._pending.clear()


def _trimmed(row: TraceRow) -> list:
    values = list(row)
    while len(values) > _CORE_COLUMNS and values[-1] is None:
        values.pop()
    return values


_CORE_COLUMNS = TraceRow._fields.index("reason") + 1  # the columns every trace row has had


def _step_rows(trace: list[TraceRow], metrics: list[dict]) -> list[dict | None]:
    """For each trace row, the metrics row of its step when it is a ``step`` row (the i-th step row, the i-th
    metrics row), else None."""
    rows, i = [], 0
    for row in trace:
        if row.event == STEP and i < len(metrics):
            rows.append(metrics[i])
            i += 1
        else:
            rows.append(None)
    return rows
