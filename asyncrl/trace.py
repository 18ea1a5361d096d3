"""The trace's vocabulary: its columns, their dtypes, the events a run records (``Controller.trace``, one row per
event), and the typed rows a subscriber receives (``Controller.subscribe``). A bottom module, so the controller,
the run loop, the CLI and the widgets all read the names from here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

# The events, one constant each: filter a trace with these (``trace[trace.event == SELECT]``), not with literals.
ADMIT = "admit"  # the sampler admitted a batch (``detail``: which batch; ``reason``: the gate's explanation)
REFUSE = "refuse"  # the gate is shut (once per distinct refusal)
DISPATCH = "dispatch"  # a group went to the generation backend (``detail``: its prompt)
COMMIT = "commit"  # a group came back, scored, and is ready in the buffer
EVICT = "evict"  # the sampler dropped a ready group
SELECT = "select"  # the sampler chose a group for the step in progress
TRAIN = "train"  # a chunk was trained (``detail``: groups and tokens)
SYNC = "sync"  # ``T`` moved and the generator holds the new weights
ABORT = "abort"  # an in-flight group was cancelled after ``T`` moved
STEP = "step"  # an optimizer step finished (subscribers get a ``StepEvent`` with its metrics row)
FAULT = "fault"  # an error was caught (``reason`` starts with ``retried:`` or ``not retried:``)
SKIP = "skip"  # a group was given up, with its reason
TURN = "turn"  # a model turn of a multi-turn trajectory finished (``detail``: "trajectory I turn K"; its version)

# The numbers a replay needs are typed columns, never words inside ``detail``/``reason`` (those are for people and
# may be reworded): ``dispatch_index`` on admit and dispatch rows, the generating versions and replica on commit rows.
TRACE_COLUMNS = [
    "seq", "event", "trainer_version", "group_id", "weight_version", "target_step", "lag", "detail", "reason",
    "gen_start_version", "gen_end_version", "replica", "dispatch_index",
]
TRACE_EVENTS = (ADMIT, REFUSE, DISPATCH, COMMIT, EVICT, SELECT, TRAIN, SYNC, ABORT, STEP, FAULT, SKIP, TURN)
TRACE_DTYPES = {"seq": "int64", "trainer_version": "int64", "group_id": "Int64", "weight_version": "Int64",
                "target_step": "Int64", "lag": "Int64", "gen_start_version": "Int64", "gen_end_version": "Int64",
                "replica": "Int64", "dispatch_index": "Int64"}


class TraceRow(NamedTuple):
    """One trace event, as recorded: ``seq`` (its index in the trace), ``event`` (one of ``TRACE_EVENTS``),
    ``trainer_version`` (``T`` when it happened), ``group_id``, ``weight_version``, ``target_step`` and ``lag``
    (``None`` when the event has none), ``detail`` and ``reason`` (text); ``gen_start_version``/``gen_end_version``
    (the weights a committed group was generated with), ``replica`` (which generation replica made it) and
    ``dispatch_index`` (the admitted batch an admit or dispatch row belongs to), ``None`` elsewhere. ``row.event``
    and ``row["event"]`` both work."""

    seq: int
    event: str
    trainer_version: int
    group_id: int | None
    weight_version: int | None
    target_step: int | None
    lag: int | None
    detail: str
    reason: str
    gen_start_version: int | None = None
    gen_end_version: int | None = None
    replica: int | None = None
    dispatch_index: int | None = None

    def __getitem__(self, key):  # row["event"] as well as row[1]
        return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)


@dataclass(frozen=True)
class StepEvent:
    """What a subscriber to ``step`` receives when an optimizer step finished: the step's trace ``row`` and its
    ``metrics`` row (the row ``Controller.metrics`` gains: ``asyncrl.metrics`` names its columns)."""

    row: TraceRow
    metrics: Mapping[str, object]

    event = STEP

    @property
    def seq(self) -> int:
        return self.row.seq
