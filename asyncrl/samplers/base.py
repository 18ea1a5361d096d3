"""What every sampler shares: the Protocol, admissions, verdicts, and the mechanics of select/evict/explain.

A built-in policy only says *which* slots are candidates (in its order), which are evictable, and why it keeps
the others; ``SamplerBase`` turns that into ``select``/``evict``/``explain`` so the three can never disagree.

Invariants:
- ``select`` and ``evict`` only ever remove ready slots, through ``ReplayBuffer.remove`` (atomic).
- ``explain`` calls the same ``_candidates``/``_evictable`` generators as ``select``/``evict`` and removes nothing.
- Candidates are produced lazily from the buffer's indexes, so a decision costs O(selected + evicted + versions),
  not O(buffer).
- Gated admission with window ``W``: batch ``k`` (the dispatch index after admission) is admitted once
  ``k <= T + W``; at most ``W + 1`` batches are ever admitted and not yet due, so the buffer needs
  ``groups_per_step * (W + 1)`` slots.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, model_validator

if TYPE_CHECKING:
    from asyncrl.buffer import ReplayBuffer, Slot


@dataclass(frozen=True)
class Admission:
    """Permission for the rollout pump to dispatch one batch."""

    dispatch_index: int
    target_step: int | None = None


Action = Literal["select", "evict", "keep"]


@dataclass(frozen=True)
class Verdict:
    """What ``evict``/``select`` would do to one slot now, and why.

    ``code`` is a stable keyword for filtering (``selected``, ``too_stale``, ``pending``, ``future_version``,
    ``wrong_target_step``, ``not_oldest_version``, ``below_min_groups``, ``beyond_max_groups``, ...);
    ``reason`` is the sentence a person reads.
    """

    group_id: int
    weight_version: int
    target_step: int | None
    state: str
    action: Action
    code: str
    reason: str


@runtime_checkable
class PromptGroupSampler(Protocol):
    """The policy that decides which prompt groups are admitted, trained, kept or dropped."""

    is_on_policy: bool

    def admit(self, trainer_version: int) -> Admission | None: ...

    def select(self, trainer_version: int, min_groups: int, max_groups: int) -> list[Slot] | None: ...

    def evict(self, trainer_version: int) -> list[Slot]: ...

    def should_abort_inflight(self, weight_version: int, trainer_version: int) -> bool: ...

    def explain(self, trainer_version: int) -> list[Verdict]: ...

    def required_buffer_capacity(self, groups_per_step: int) -> int | None: ...

    def set_dispatch_index(self, resume_step: int) -> None: ...


class KnobModel(BaseModel):
    """Base of the per-policy config models: unknown keys are errors (naming the policy's knobs); frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_knobs(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and cls.model_config.get("extra") == "forbid":
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                name = cls.model_fields["name"].default if "name" in cls.model_fields else cls.__name__
                knobs = [key for key in cls.model_fields if key != "name"]
                raise ValueError(f"unknown knob(s) {unknown} for sampler {name!r}; its knobs are {knobs}")
        return data


def check_version(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as a plain int >= ``minimum`` (numpy integers welcome, bools refused), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class SamplerBase:
    """Shared mechanics of the built-in policies. Subclasses set ``name``, ``stamps_target`` and ``gated``, hold
    their knobs in ``self.knobs`` (a validated ``KnobModel``), and implement ``_candidates``, ``_evictable`` and
    ``_keep``."""

    name: ClassVar[str]
    stamps_target: ClassVar[bool] = False
    gated: ClassVar[bool] = True
    knobs: KnobModel

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer
        self.dispatch_index = -1

    # The window that bounds admission (gated policies) and, for most policies, staleness.
    @property
    def window(self) -> int:
        raise NotImplementedError

    @property
    def is_on_policy(self) -> bool:
        return self.window == 0

    def lower_bound(self, trainer_version: int) -> int:
        """``lo = max(0, T - W)``: the oldest weight version a policy with a staleness window may train on."""
        return max(0, trainer_version - self.window)

    # ------------------------------------------------------------------------------------------- admission
    def admit(self, trainer_version: int) -> Admission | None:
        trainer_version = check_version("trainer_version", trainer_version)
        if self.gated and self.dispatch_index >= trainer_version + self.window:
            return None
        self.dispatch_index += 1
        return Admission(self.dispatch_index, self.dispatch_index if self.stamps_target else None)

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        groups_per_step = check_version("groups_per_step", groups_per_step, 1)
        return groups_per_step * (self.window + 1) if self.gated else None

    def set_dispatch_index(self, resume_step: int) -> None:
        self.dispatch_index = check_version("resume_step", resume_step) - 1

    def should_abort_inflight(self, weight_version: int, trainer_version: int) -> bool:
        return False

    # ------------------------------------------------------------------------------------ select and evict
    def select(self, trainer_version: int, min_groups: int, max_groups: int) -> list[Slot] | None:
        T = check_version("trainer_version", trainer_version)
        _check_chunk(min_groups, max_groups)
        picked = list(islice(self._candidates(T), max_groups))
        if len(picked) < min_groups:
            return None
        return self.buffer.remove([s.group_id for s in picked])

    def evict(self, trainer_version: int) -> list[Slot]:
        T = check_version("trainer_version", trainer_version)
        doomed = [s.group_id for s in self._evictable(T)]
        return self.buffer.remove(doomed) if doomed else []

    def explain(self, trainer_version: int, min_groups: int = 1, max_groups: int | None = None) -> list[Verdict]:
        """A verdict for every slot, in buffer order, as if ``evict`` then ``select(T, min_groups, max_groups)``
        ran now. Changes nothing."""
        T = check_version("trainer_version", trainer_version)
        _check_chunk(min_groups, max_groups if max_groups is not None else min_groups)
        evictable = {s.group_id for s in self._evictable(T)}
        order = {s.group_id: i for i, s in enumerate(self._candidates(T))}
        n = len(order)
        out = []
        for slot in self.buffer.slots():
            gid = slot.group_id
            if gid in evictable:
                action, (code, reason) = "evict", self._evict_reason(slot, T)
            elif gid in order:
                pos = order[gid]
                if n < min_groups:
                    action, code = "keep", "below_min_groups"
                    reason = (
                        f"eligible, but only {n} candidate(s) < min_groups {min_groups}: select waits"
                        f"{self._wait_hint(T)}"
                    )
                elif max_groups is not None and pos >= max_groups:
                    action, code = "keep", "beyond_max_groups"
                    reason = f"eligible, candidate #{pos + 1} of {n}; this chunk takes max_groups {max_groups}"
                else:
                    action, code = "select", "selected"
                    reason = f"selected as candidate #{pos + 1} of {n}: {self._select_reason(slot, T)}"
            else:
                action, (code, reason) = "keep", self._keep(slot, T)
            out.append(Verdict(gid, slot.weight_version, slot.target_step, slot.state, action, code, reason))
        return out

    # -------------------------------------------------------------------------------------- policy hooks
    def _candidates(self, T: int) -> Iterator[Slot]:
        raise NotImplementedError

    def _evictable(self, T: int) -> Iterator[Slot]:
        """Default eviction: ready slots with ``weight_version < lo``."""
        index = self.buffer.by_version
        for v in index.keys_between(hi=self.lower_bound(T) - 1):
            yield from list(index.ready[v])

    def _evict_reason(self, slot: Slot, T: int) -> tuple[str, str]:
        lo = self.lower_bound(T)
        return "too_stale", f"too stale: weight_version {slot.weight_version} < lo {lo} (T={T}, W={self.window})"

    def _select_reason(self, slot: Slot, T: int) -> str:
        return f"ready, weight_version {slot.weight_version} in [{self.lower_bound(T)}, {T}]"

    def _wait_hint(self, T: int) -> str:
        """What ``select`` is waiting for when it has too few candidates (appended to ``below_min_groups``)."""
        return ""

    def _keep(self, slot: Slot, T: int) -> tuple[str, str]:
        """Why a slot that is neither evictable nor a candidate stays. Shared cases first."""
        w = slot.weight_version
        if not slot.ready:
            if w < self.lower_bound(T):
                return "pending", (
                    f"pending (rollouts not committed); already too stale (weight_version {w} < lo "
                    f"{self.lower_bound(T)}): evicted once committed"
                )
            return "pending", f"pending: rollouts started at weight_version {w} are not committed yet"
        if w > T:
            return "future_version", f"future version: weight_version {w} > T={T}, kept for a later step"
        return "kept", "kept by the policy"

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.knobs.model_dump().items())
        return f"{type(self).__name__}({knobs}, dispatch_index={self.dispatch_index})"


def _check_chunk(min_groups: object, max_groups: object) -> None:
    if isinstance(min_groups, bool) or not isinstance(min_groups, int) or min_groups < 1:
        raise ValueError(f"min_groups must be an int >= 1, got {min_groups!r}")
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < min_groups:
        raise ValueError(f"max_groups must be an int >= min_groups ({min_groups}), got {max_groups!r}")
