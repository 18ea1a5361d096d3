"""``windowed``: train on any ready group whose weights are at most ``W`` versions old.

Admission is always open (only the buffer and in-flight limits bound dispatch), so it needs no fixed buffer
capacity. Candidates: ready slots with ``lo <= w <= T``, in buffer order, or freshest first (sorted by
``(T - w, position)``). Evicts ready slots with ``w < lo``; an in-flight rollout that started below ``lo`` can only
be evicted later, so it may be aborted now.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from asyncrl.samplers.base import KnobModel, SamplerBase

if TYPE_CHECKING:
    from asyncrl.buffer import Slot


class WindowedConfig(KnobModel):
    name: Literal["windowed"] = "windowed"
    max_staleness_versions: int = Field(
        1, ge=0, strict=True, description="W: ready groups older than T - W weight versions are evicted")
    freshest_first: bool = Field(False, strict=True, description="select the freshest ready groups first "
                                 "(default: buffer order)")


class WindowedSampler(SamplerBase):
    name: ClassVar[str] = "windowed"
    Knobs: ClassVar[type[KnobModel]] = WindowedConfig
    gated: ClassVar[bool] = False
    knobs: WindowedConfig

    def should_abort_inflight(self, weight_version: int, trainer_version: int) -> bool:
        return weight_version < self.lower_bound(trainer_version)

    def _candidates(self, T: int) -> Iterator[Slot]:
        index = self.buffer.by_version
        versions = index.keys_between(self.lower_bound(T), T)
        if self.knobs.freshest_first:
            versions = versions[::-1]
        for v in versions:
            yield from index.ready[v]

    def _candidate_count(self, T: int) -> int:
        index = self.buffer.by_version
        return sum(len(index.ready[v]) for v in index.keys_between(self.lower_bound(T), T))

    def _select_reason(self, slot: Slot, T: int) -> str:
        order = "freshest first" if self.knobs.freshest_first else "buffer order"
        return f"{super()._select_reason(slot, T)}, {order}"
