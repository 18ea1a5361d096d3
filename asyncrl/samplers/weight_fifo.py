"""``weight_fifo``: train weight versions strictly oldest first, waiting for a version to finish.

The target version is the oldest ``w`` among *all* in-window slots (``lo <= w <= T``), ready or pending; only
ready slots of exactly that version are candidates. It never skips ahead: while the oldest in-window version
still has pending rollouts and too few ready ones, ``select`` waits rather than mixing in newer data. Once that
version has nothing pending, its ready groups are all it will ever have (a skipped group's replacement is generated,
and stamped, with the newer weights), so they are taken as a chunk even below ``min_groups``: a chunk never mixes
versions, and a step can always finish. Gated admission bounds the buffer to ``N (W + 1)``. Never aborts in-flight
work: every admitted batch is waited for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from asyncrl.samplers.base import KnobModel, SamplerBase

if TYPE_CHECKING:
    from asyncrl.buffer import Slot


class WeightFifoConfig(KnobModel):
    name: Literal["weight_fifo"] = "weight_fifo"
    max_staleness_versions: int = Field(
        1, ge=0, strict=True, description="W: groups older than T - W weight versions are evicted; versions "
        "are trained oldest first")


class WeightFifoSampler(SamplerBase):
    name: ClassVar[str] = "weight_fifo"
    Knobs: ClassVar[type[KnobModel]] = WeightFifoConfig

    def target_version(self, T: int) -> int | None:
        """The oldest weight version among in-window slots, ready or pending; None when the window is empty."""
        versions = self.buffer.by_version.keys_between(self.lower_bound(T), T)
        return versions[0] if versions else None

    def _candidates(self, T: int) -> Iterator[Slot]:
        target = self.target_version(T)
        if target is not None:
            yield from self.buffer.by_version.ready[target]

    def _candidates_final(self, T: int) -> bool:
        target = self.target_version(T)
        return target is not None and not self.buffer.by_version.pending[target]

    def _candidate_count(self, T: int) -> int:
        target = self.target_version(T)
        return 0 if target is None else len(self.buffer.by_version.ready[target])

    def _select_reason(self, slot: Slot, T: int) -> str:
        return f"ready at weight version {slot.weight_version}, the oldest version in {self._window_words(T)}"

    def _wait_hint(self, T: int) -> str:
        target = self.target_version(T)
        waiting = 0 if target is None else len(self.buffer.by_version.pending[target])
        if waiting:
            return (
                f" for the {waiting} pending group(s) of version {target}, the oldest in {self._window_words(T)} "
                "(weight_fifo never skips ahead to a newer version)"
            )
        return ""

    def _keep(self, slot: Slot, T: int) -> tuple[str, str]:
        target = self.target_version(T)
        w = slot.weight_version
        if target is not None and self.lower_bound(T) <= w <= T and w != target:
            waiting = len(self.buffer.by_version.pending[target])
            state = "ready" if slot.ready else "pending"
            return "not_oldest_version", (
                f"{state}, not the oldest version: weight version {w} waits until version {target} is trained "
                f"({waiting} group(s) of it still pending)"
            )
        return super()._keep(slot, T)
