"""What every sampler shares: the Protocol, admissions, verdicts, and the mechanics of select/evict/explain.

A built-in policy only says *which* slots are candidates (in its order), which are evictable, and why it keeps
the others; ``SamplerBase`` turns that into ``select``/``evict``/``explain`` so the three can never disagree.

Invariants:
- ``select`` and ``evict`` only ever remove ready slots, through ``ReplayBuffer.remove`` (atomic).
- ``explain`` calls the same ``_candidates``/``_evictable`` generators as ``select``/``evict`` and removes nothing;
  ``select_reasoned``/``evict_reasoned`` (what the controller calls) word each decision with the same hooks, so the
  trace says what ``explain`` said.
- Candidates are produced lazily from the buffer's indexes, so a decision costs O(selected + evicted + versions),
  not O(buffer).
- Gated admission with window ``W``: batch ``k`` (the dispatch index after admission) is admitted once
  ``k <= T + W``; at most ``W + 1`` batches are ever admitted and not yet due, so the buffer needs
  ``groups_per_step * (W + 1)`` slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import ConfigDict

from asyncrl.strict import StrictModel, check_int

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
    """The policy that decides which prompt groups are admitted, trained, kept or dropped (docs/samplers.md).

    The pumps follow it and encode no policy of their own. ``dispatch_index`` is saved in checkpoints.
    """

    name: str  # the policy's name, as configurations and reasons write it
    is_on_policy: bool  # true exactly when the policy trains only on data from the current weights
    dispatch_index: int  # batches admitted so far minus one: -1 before the first admission

    def admit(self, trainer_version: int) -> Admission | None:
        """Each rollout tick, before dispatching: an ``Admission`` for one batch, or None (the gate is shut)."""

    def explain_admission(self, trainer_version: int) -> str:
        """When ``admit`` said None (and for the trace): why the gate is open or shut now, in the policy's words.
        Changes nothing."""

    def select(self, trainer_version: int, min_groups: int, max_groups: int) -> list[Slot] | None:
        """Each train tick, after ``evict``: remove and return up to ``max_groups`` ready slots in the policy's
        order, or None (buffer untouched) when fewer than ``min_groups`` qualify. Never waits."""

    def evict(self, trainer_version: int) -> list[Slot]:
        """Each train tick, first: remove and return the ready slots the policy drops. Never a pending one."""

    def should_abort_inflight(self, weight_version: int, trainer_version: int) -> bool:
        """After each optimizer step, per group in flight: may a rollout started at ``weight_version`` be
        cancelled now."""

    def explain(self, trainer_version: int, min_groups: int = 1, max_groups: int | None = None) -> list[Verdict]:
        """Whenever asked: a ``Verdict`` for every slot, in buffer order, as if ``evict`` then
        ``select(trainer_version, min_groups, max_groups)`` ran now. Changes nothing."""

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        """Once, when the controller is built: the buffer size that never deadlocks (None: no fixed bound)."""

    def set_dispatch_index(self, resume_step: int) -> None:
        """On resume: ``dispatch_index = resume_step - 1``. Negative: ``ValueError``."""


@runtime_checkable
class ReasonedDecisions(Protocol):
    """Optional: a sampler that words each decision as it makes it, in the words its ``explain`` gives that slot,
    so the trace's select, evict and abort rows say them (``SamplerBase`` provides it; ``reasoned`` adapts any
    other sampler)."""

    def select_reasoned(self, trainer_version: int, min_groups: int,
                        max_groups: int) -> list[tuple[Slot, str]] | None:
        """``select``, each slot with the reason of its ``selected`` verdict."""

    def evict_reasoned(self, trainer_version: int) -> list[tuple[Slot, str]]:
        """``evict``, each slot with the reason of its eviction verdict."""

    def abort_reason(self, slot: Slot, trainer_version: int) -> str:
        """Why an in-flight group that ``should_abort_inflight`` let go is cancelled."""


def reasoned(sampler: PromptGroupSampler) -> ReasonedDecisions:
    """``sampler`` itself when it words its decisions; else an adapter that takes the words from its ``explain``."""
    return sampler if isinstance(sampler, ReasonedDecisions) else _ExplainedDecisions(sampler)


class _ExplainedDecisions:
    """A sampler without ``ReasonedDecisions``: its verdicts are asked for just before it decides (a pass over the
    buffer per decision, which a sampler that words its own decisions avoids)."""

    def __init__(self, sampler: PromptGroupSampler) -> None:
        self.sampler = sampler

    def _words(self, T: int, min_groups: int = 1, max_groups: int | None = None) -> dict[int, str]:
        return {v.group_id: v.reason for v in self.sampler.explain(T, min_groups, max_groups)}

    def select_reasoned(self, trainer_version, min_groups, max_groups):
        words = self._words(trainer_version, min_groups, max_groups)
        chunk = self.sampler.select(trainer_version, min_groups, max_groups)
        return None if chunk is None else [(s, words.get(s.group_id, f"{self.sampler.name} selected it"))
                                           for s in chunk]

    def evict_reasoned(self, trainer_version):
        words = self._words(trainer_version)
        return [(s, words.get(s.group_id, f"{self.sampler.name} dropped it"))
                for s in self.sampler.evict(trainer_version)]

    def abort_reason(self, slot, trainer_version):
        return (f"{self.sampler.name}: should_abort_inflight({slot.weight_version}, {trainer_version}) let it go "
                "while in flight")


@runtime_checkable
class StalenessWindow(Protocol):
    """Optional: a sampler with a window of weight versions. The buffer view shades ``[lower_bound(T), T]``."""

    window: int

    def lower_bound(self, trainer_version: int) -> int: ...


@runtime_checkable
class TargetStamping(Protocol):
    """Optional: whether the sampler's admissions stamp ``target_step`` (``in_order``: batch ``k`` is for step
    ``k``, and only groups stamped ``T`` train at ``T``). A restore under another sampler reads it: unstamped
    groups cannot be trained by a stamping sampler, and its dispatch index follows the stamps. Without it: False."""

    stamps_target: bool


@runtime_checkable
class AdmitsAhead(Protocol):
    """Optional: whether the sampler may admit a batch before the step it feeds has started. False (``in_order``
    with ``max_lookahead_versions: 0``, any gated sampler with a window of 0) means generation can never run ahead
    of training, so a run drives both pumps in lockstep on one thread (``asyncrl/run_loop.py``). Without it: True."""

    admits_ahead: bool


@runtime_checkable
class GatedAdmission(Protocol):
    """Optional: whether the sampler's gate admits batch ``k`` only once ``k <= T + W`` (``SamplerBase.gated``).
    The section that moves ``T`` then admits every batch still due at the old ``T`` before the weight sync, so a
    batch's weight version never depends on how fast the rollout pump is (docs/samplers.md). Without it: False."""

    gated: bool


class KnobModel(StrictModel):
    """Base of the per-policy config models: unknown keys are errors (naming the policy's knobs); frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def _unknown_keys(cls, unknown: list[str], data: Mapping) -> str:
        name = cls.model_fields["name"].default if "name" in cls.model_fields else cls.__name__
        knobs = [key for key in cls.model_fields if key != "name"]
        return f"unknown knob(s) {unknown} for sampler {name!r}; its knobs are {knobs}"


class SamplerBase:
    """The mechanics every built-in policy shares; subclass it to write your own (docs/samplers.md).

    A subclass sets ``name`` and ``Knobs`` (a ``KnobModel`` whose fields are its keyword arguments), names the knob
    that is its window in ``window_knob``, and implements ``_candidates`` (the slots ``select`` may take, in order)
    and, when it drops differently from the default, ``_evictable``. ``select``, ``evict`` and ``explain`` are
    derived from those generators, so they cannot disagree; ``_select_reason``, ``_evict_reason``, ``_keep`` and
    ``_wait_hint`` word the verdicts. ``gated`` and ``stamps_target`` choose the admission rule.
    """

    name: ClassVar[str]
    Knobs: ClassVar[type[KnobModel]]
    window_knob: ClassVar[str] = "max_staleness_versions"
    stamps_target: ClassVar[bool] = False  # admissions carry target_step = dispatch index (in_order)
    gated: ClassVar[bool] = True  # admit while dispatch_index < T + window; False: always admit
    buffer: ReplayBuffer
    knobs: KnobModel
    dispatch_index: int

    def __init__(self, buffer: ReplayBuffer, **knobs: Any) -> None:
        self.buffer = buffer
        self.knobs = self.Knobs(**knobs)
        self.dispatch_index = -1

    @property
    def window(self) -> int:
        """``W``: bounds gated admission (batches ahead of ``T``) and, for most policies, staleness."""
        return getattr(self.knobs, self.window_knob)

    @property
    def is_on_policy(self) -> bool:
        return self.window == 0

    @property
    def admits_ahead(self) -> bool:
        """Can a batch be admitted before ``T`` reaches its step? Not when gated with a window of 0."""
        return not self.gated or self.window > 0

    def lower_bound(self, trainer_version: int) -> int:
        """``max(0, T - W)``: the oldest weight version a policy with a staleness window may train on."""
        return max(0, trainer_version - self.window)

    # ------------------------------------------------------------------------------------------- admission
    def _gate_open(self, T: int) -> bool:
        return not self.gated or self.dispatch_index < T + self.window

    def admit(self, trainer_version: int) -> Admission | None:
        T = check_int("trainer_version", trainer_version)
        if not self._gate_open(T):
            return None
        self.dispatch_index += 1
        return Admission(self.dispatch_index, self.dispatch_index if self.stamps_target else None)

    def explain_admission(self, trainer_version: int) -> str:
        T = check_int("trainer_version", trainer_version)
        if not self.gated:
            return f"`{self.name}` always admits: only the buffer capacity and the in-flight limit bound dispatch"
        W, k = self.window, self.dispatch_index + 1
        ahead = "no batch" if W == 0 else "at most " + ("one batch" if W == 1 else _plural(W, "batch"))
        batch = f"batch {k} (for step {k})" if self.stamps_target else f"batch {k}"
        rule = f"`{self.name}` with {self.window_knob}={W} admits {ahead} ahead of T"
        if self._gate_open(T):
            return f"{rule}: {batch} may go at T={T}"
        return f"{rule}: {batch} waits for T >= {k - W}"

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        groups_per_step = check_int("groups_per_step", groups_per_step, 1)
        return groups_per_step * (self.window + 1) if self.gated else None

    def set_dispatch_index(self, resume_step: int) -> None:
        self.dispatch_index = check_int("resume_step", resume_step) - 1

    def should_abort_inflight(self, weight_version: int, trainer_version: int) -> bool:
        return False

    # ------------------------------------------------------------------------------------ select and evict
    def select(self, trainer_version: int, min_groups: int, max_groups: int) -> list[Slot] | None:
        T, picked = self._pick(trainer_version, min_groups, max_groups)
        return None if picked is None else self.buffer.remove([s.group_id for s in picked])

    def select_reasoned(self, trainer_version: int, min_groups: int,
                        max_groups: int) -> list[tuple[Slot, str]] | None:
        """``select``, each slot with its ``selected`` verdict's reason (worded before the slots leave the buffer)."""
        T, picked = self._pick(trainer_version, min_groups, max_groups)
        if picked is None:
            return None
        n = self._candidate_count(T)
        words = [self._selected_words(slot, T, pos, n) for pos, slot in enumerate(picked)]
        return list(zip(self.buffer.remove([s.group_id for s in picked]), words))

    def _pick(self, trainer_version: int, min_groups: int, max_groups: int) -> tuple[int, list[Slot] | None]:
        T = check_int("trainer_version", trainer_version)
        _check_chunk(min_groups, max_groups)
        picked = list(islice(self._candidates(T), max_groups))
        return T, (picked if len(picked) >= min_groups else None)

    def evict(self, trainer_version: int) -> list[Slot]:
        return [slot for slot, _ in self.evict_reasoned(trainer_version)]

    def evict_reasoned(self, trainer_version: int) -> list[tuple[Slot, str]]:
        """``evict``, each slot with its eviction verdict's reason."""
        T = check_int("trainer_version", trainer_version)
        doomed = list(self._evictable(T))
        if not doomed:
            return []
        words = [self._evict_reason(slot, T)[1] for slot in doomed]
        return list(zip(self.buffer.remove([s.group_id for s in doomed]), words))

    def abort_reason(self, slot: Slot, trainer_version: int) -> str:
        """The words its eviction verdict would give it: a group is aborted because it could only be evicted."""
        return self._evict_reason(slot, check_int("trainer_version", trainer_version))[1]

    def explain(self, trainer_version: int, min_groups: int = 1, max_groups: int | None = None) -> list[Verdict]:
        """A verdict for every slot, in buffer order, as if ``evict`` then ``select(T, min_groups, max_groups)``
        ran now. Changes nothing."""
        T = check_int("trainer_version", trainer_version)
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
                        f"eligible, but a chunk needs {min_groups} group(s) (min_groups) and only {n} qualify: "
                        f"select waits{self._wait_hint(T)}"
                    )
                elif max_groups is not None and pos >= max_groups:
                    action, code = "keep", "beyond_max_groups"
                    reason = (
                        f"eligible (candidate #{pos + 1} of {n}), but this chunk takes only the first {max_groups} "
                        "(max_groups): left for a later chunk"
                    )
                else:
                    action, code = "select", "selected"
                    reason = self._selected_words(slot, T, pos, n)
            else:
                action, (code, reason) = "keep", self._keep(slot, T)
            out.append(Verdict(gid, slot.weight_version, slot.target_step, slot.state, action, code, reason))
        return out

    def _selected_words(self, slot: Slot, T: int, pos: int, n: int) -> str:
        return f"selected as candidate #{pos + 1} of {n}: {self._select_reason(slot, T)}"

    # -------------------------------------------------------------------------------------- policy hooks
    def _candidates(self, T: int) -> Iterator[Slot]:
        """The slots ``select`` may take now, in the order it takes them (only ready ones)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _candidates(T): the ready slots select "
                                  "may take now, in order (docs/samplers.md, 'Writing your own')")

    def _candidate_count(self, T: int) -> int:
        """How many slots ``_candidates(T)`` yields (the "of n" of a selected verdict). A policy that reads its
        candidates off the buffer's indexes counts them there, in O(versions) rather than O(candidates)."""
        return sum(1 for _ in self._candidates(T))

    def _evictable(self, T: int) -> Iterator[Slot]:
        """Default eviction: ready slots with ``weight_version < lower_bound(T)``."""
        index = self.buffer.by_version
        for v in index.keys_between(hi=self.lower_bound(T) - 1):
            yield from list(index.ready[v])

    def _window_words(self, T: int) -> str:
        return f"the window [{self.lower_bound(T)}, {T}]"

    def _evict_reason(self, slot: Slot, T: int) -> tuple[str, str]:
        return "too_stale", (
            f"too stale: weight version {slot.weight_version} is older than {self._window_words(T)} "
            f"(at most {_plural(self.window, 'version')} behind T={T})"
        )

    def _select_reason(self, slot: Slot, T: int) -> str:
        return f"ready, weight version {slot.weight_version} is inside {self._window_words(T)}"

    def _wait_hint(self, T: int) -> str:
        """What ``select`` is waiting for when it has too few candidates (appended to ``below_min_groups``)."""
        return ""

    def _keep(self, slot: Slot, T: int) -> tuple[str, str]:
        """Why a slot that is neither evictable nor a candidate stays. Shared cases first."""
        w = slot.weight_version
        if not slot.ready:
            if w < self.lower_bound(T):
                return "pending", (
                    f"pending (rollouts not committed yet) and already too stale (weight version {w} is older than "
                    f"{self._window_words(T)}): evicted once committed"
                )
            return "pending", f"pending: rollouts started with weight version {w} are not committed yet"
        if w > T:
            return "future_version", f"future version: weight version {w} is newer than T={T}, kept for a later step"
        return "kept", "kept by the policy"

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.knobs.model_dump().items())
        return f"{type(self).__name__}({knobs}, dispatch_index={self.dispatch_index})"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('ch') else 's'}"


def _check_chunk(min_groups: object, max_groups: object) -> None:
    if isinstance(min_groups, bool) or not isinstance(min_groups, int) or min_groups < 1:
        raise ValueError(f"min_groups must be an int >= 1, got {min_groups!r}")
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < min_groups:
        raise ValueError(f"max_groups must be an int >= min_groups ({min_groups}), got {max_groups!r}")
