"""``in_order`` (the default): each batch is stamped with the step it is for, and step ``T`` trains exactly the
groups stamped ``target_step == T``.

Admission is gated by the lookahead ``L``: batch ``k`` is admitted once ``k <= T + L`` and stamped
``target_step = k``. ``L = 0`` is synchronous GRPO (generate batch ``T`` with weights ``T``, then train on it).
The staleness window is not consulted: the stamp alone decides. Evicts ready slots whose target step has passed,
which is exactly what ``select`` will never take. Capacity ``N (L + 1)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from asyncrl.samplers.base import KnobModel, SamplerBase

if TYPE_CHECKING:
    from asyncrl.buffer import Slot


class InOrderConfig(KnobModel):
    name: Literal["in_order"] = "in_order"
    max_lookahead_versions: int = Field(
        1, ge=0, strict=True, description="L: batches admitted ahead of the step being trained; each group is "
        "trained exactly at the step it was stamped for (0: synchronous GRPO)")


class InOrderSampler(SamplerBase):
    name: ClassVar[str] = "in_order"
    Knobs: ClassVar[type[KnobModel]] = InOrderConfig
    window_knob: ClassVar[str] = "max_lookahead_versions"
    stamps_target: ClassVar[bool] = True

    def _candidates(self, T: int) -> Iterator[Slot]:
        yield from self.buffer.by_target.ready.get(T, ())

    def _candidate_count(self, T: int) -> int:
        return len(self.buffer.by_target.ready.get(T, ()))

    def _evictable(self, T: int) -> Iterator[Slot]:
        index = self.buffer.by_target
        doomed = [slot for t in index.keys_between(hi=T - 1) for slot in index.ready[t]]
        # Buffer order: target steps follow dispatch order for what the controller admits, but not necessarily
        # for slots reserved by hand.
        return iter(sorted(doomed, key=lambda slot: slot.group_id))

    def _evict_reason(self, slot: Slot, T: int) -> tuple[str, str]:
        return "past_target_step", f"its step has passed: made for step {slot.target_step}, the trainer is at T={T}"

    def _select_reason(self, slot: Slot, T: int) -> str:
        return f"ready, made for this step (target step {slot.target_step} = T)"

    def _wait_hint(self, T: int) -> str:
        pending = self.buffer.by_target.pending.get(T, ())
        return f" for the {len(pending)} pending group(s) made for step {T}" if pending else ""

    def _keep(self, slot: Slot, T: int) -> tuple[str, str]:
        t = slot.target_step
        if not slot.ready:
            if t is not None and t < T:
                return "pending", (
                    f"pending (rollouts not committed yet) and its step has passed (made for step {t}, the trainer "
                    f"is at T={T}): evicted once committed"
                )
            return "pending", f"pending: rollouts made for step {t} are not committed yet"
        if t is None:
            return "no_target_step", "ready but made for no particular step; in_order trains only groups made for one"
        return "wrong_target_step", f"made for step {t}, not this step (T={T}): kept until step {t}"
