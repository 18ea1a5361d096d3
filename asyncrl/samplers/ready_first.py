"""``ready_first``: train whatever is ready, oldest first, and never drop anything.

Candidates: every ready slot with ``w <= T`` in buffer order, with no lower bound on its version; only the gated
admission (window ``W``) bounds how stale data can get, and the buffer to ``N (W + 1)``. Never evicts, never
aborts: the policy of choice when no sample may be wasted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from asyncrl.samplers.base import KnobModel, SamplerBase

if TYPE_CHECKING:
    from asyncrl.buffer import Slot


class ReadyFirstConfig(KnobModel):
    name: Literal["ready_first"] = "ready_first"
    max_staleness_versions: int = Field(
        1, ge=0, strict=True, description="W: weight versions admission may run ahead of training (the gate); "
        "nothing is dropped")


class ReadyFirstSampler(SamplerBase):
    name: ClassVar[str] = "ready_first"
    Knobs: ClassVar[type[KnobModel]] = ReadyFirstConfig

    def lower_bound(self, trainer_version: int) -> int:
        return 0  # no lower bound: nothing is ever too stale

    def _candidates(self, T: int) -> Iterator[Slot]:
        index = self.buffer.by_version
        for v in index.keys_between(hi=T):
            yield from index.ready[v]

    def _candidate_count(self, T: int) -> int:
        index = self.buffer.by_version
        return sum(len(index.ready[v]) for v in index.keys_between(hi=T))

    def _evictable(self, T: int) -> Iterator[Slot]:
        return iter(())

    def _select_reason(self, slot: Slot, T: int) -> str:
        return f"ready, weight version {slot.weight_version} is not newer than T={T} (ready_first takes any ready one)"
