"""What the controller reports: ``TickReport`` (what one tick did; ``str()`` is the line a notebook shows) and
``ControllerState`` (``Controller.state()``: a frozen snapshot for widgets, without the verdicts, which cost a pass
over the buffer and are computed only by ``Controller.explain()``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from asyncrl.samplers import Admission


@dataclass
class TickReport:
    """What one tick did. ``str(report)`` is the one line a notebook shows."""

    kind: str
    trainer_version: int
    admitted: Admission | None = None
    dispatched: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    selected: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    step_finished: bool = False
    note: str = ""
    filtered: list[int] = field(default_factory=list)  # skipped by filter_uniform_groups (also in ``skipped``)

    @property
    def progressed(self) -> bool:
        return bool(self.dispatched or self.committed or self.evicted or self.selected or self.aborted
                    or self.skipped)

    def merge(self, other: TickReport) -> TickReport:
        return TickReport(
            "tick", other.trainer_version, self.admitted, self.dispatched + other.dispatched,
            self.committed + other.committed, self.evicted + other.evicted, self.selected + other.selected,
            self.aborted + other.aborted, self.skipped + other.skipped, other.step_finished,
            "; ".join(n for n in (self.note, other.note) if n), self.filtered + other.filtered,
        )

    def __str__(self) -> str:
        parts = [f"{self.kind} T={self.trainer_version}"]
        for name, ids in (("dispatched", self.dispatched), ("committed", self.committed), ("evicted", self.evicted),
                          ("selected", self.selected), ("aborted", self.aborted), ("skipped", self.skipped)):
            if ids:
                parts.append(f"{name} {len(ids)} {_ids(ids)}")
        if self.step_finished:
            parts.append("step finished")
        if self.note:
            parts.append(self.note)
        return " | ".join(parts)


def _ids(ids: list[int]) -> str:
    return "[" + ",".join(map(str, ids[:8])) + (",…]" if len(ids) > 8 else "]")


@dataclass(frozen=True)
class ControllerState:
    """What ``Controller.state()`` returns: one consistent snapshot of the controller for widgets."""

    trainer_version: int
    generation_version: int
    sampler: str  # the policy's name
    sampler_repr: str
    window: int | None  # None when the sampler has no window (``window_knob = None``)
    lower_bound: int | None  # the window's oldest version at this T
    buffer: pd.DataFrame  # slot counts by weight version x state (ReplayBuffer.summary())
    capacity: int
    inflight: int
    step_groups_trained: int  # groups trained so far in the current step
    groups_per_step: int
    data_position: int
    exhausted: bool
    last_report: TickReport | None
