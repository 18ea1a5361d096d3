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
- What the pumps read off a sampler besides the Protocol is declared on ``SamplerBase`` with a default, never
  probed; ``is_on_policy`` and the required capacity are facts of the class and its knobs (``trains_on_policy``,
  ``capacity_needed``), so the configuration asks them without building a sampler.
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

    The pumps follow it and encode no policy of their own. ``dispatch_index`` is saved in checkpoints. Every
    sampler is a ``SamplerBase``, which satisfies it and declares, with defaults, what else the pumps, restores and
    views read (``gated``, ``stamps_target``, ``window``, ``admits_ahead``, the reasoned decisions).
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


class KnobModel(StrictModel):
    """Base of the per-policy config models: unknown keys are errors (naming the policy's knobs); frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def _unknown_keys(cls, unknown: list[str], data: Mapping) -> str:
        name = cls.model_fields["name"].default if "name" in cls.model_fields else cls.__name__
        knobs = [key for key in cls.model_fields if key != "name"]
        return f"unknown knob(s) {unknown} for sampler {name!r}; its knobs are {knobs}"


class SamplerBase:
    """The mechanics every sampler shares; a sampler of your own subclasses it (docs/samplers.md).

    A subclass sets ``name`` and ``Knobs`` (a ``KnobModel`` whose fields are its keyword arguments), names the knob
    that is its window in ``window_knob``, and implements ``_candidates`` (the slots ``select`` may take, in order)
    and, when it drops differently from the default, ``_evictable``. ``select``, ``evict`` and ``explain`` are
    derived from those generators, so they cannot disagree; ``_select_reason``, ``_evict_reason``, ``_keep`` and
    ``_wait_hint`` word the verdicts.

    What the controller, restores and views read off a sampler is declared here, each with its default, and read
    off the class where it is a fact of the knobs (``trains_on_policy``, ``capacity_needed``: the configuration asks
    them before any sampler or buffer exists):
    - ``gated``: batch ``k`` is admitted only once ``k <= T + W``; the section that moves ``T`` then admits every
      batch still due at the old ``T`` before the weight sync, so a batch's weight version never depends on how
      fast the rollout pump is. ``False``: always admit (capacity ``None``).
    - ``stamps_target``: admissions carry ``target_step = dispatch index`` (``in_order``). A restore under such a
      sampler skips unstamped groups, and ``resume_schedule`` follows the stamps.
    - ``window_knob``: the knob that is the window ``W``; ``None``: the policy has none (``window`` is None, nothing
      is too stale, the buffer view shades no window); a gated sampler needs one.
    - ``admits_ahead``: whether a batch may be admitted before its step starts; not when gated with ``W = 0``,
      and then a run drives both pumps in lockstep on one thread (``asyncrl/run_loop.py``).
    """

    name: ClassVar[str]
    Knobs: ClassVar[type[KnobModel]]
    window_knob: ClassVar[str | None] = "max_staleness_versions"
    stamps_target: ClassVar[bool] = False
    gated: ClassVar[bool] = True
    buffer: ReplayBuffer
    knobs: KnobModel
    dispatch_index: int

    def __init__(self, buffer: ReplayBuffer, **knobs: Any) -> None:
        self.buffer = buffer
        self.knobs = self.Knobs(**knobs)
        self.dispatch_index = -1

    # ------------------------------------------------------------- facts of the knobs, asked of the class
    @classmethod
    def window_of(cls, knobs: KnobModel) -> int | None:
        """``W`` for these knobs (None without a ``window_knob``)."""
        return None if cls.window_knob is None else getattr(knobs, cls.window_knob)

    @classmethod
    def trains_on_policy(cls, knobs: KnobModel) -> bool:
        """``is_on_policy`` for these knobs: ``W == 0`` (a policy without a window may train on stale data)."""
        return cls.window_of(knobs) == 0

    @classmethod
    def capacity_needed(cls, knobs: KnobModel, groups_per_step: int) -> int | None:
        """``required_buffer_capacity(groups_per_step)`` for these knobs: ``N (W + 1)`` when gated, else None."""
        groups_per_step = check_int("groups_per_step", groups_per_step, 1)
        return groups_per_step * (cls.window_of(knobs) + 1) if cls.gated else None

    @classmethod
    def describe(cls, knobs: KnobModel) -> str:
        """The policy and its knobs, as errors name it: ``WeightFifoSampler(max_staleness_versions=1)``."""
        return f"{cls.__name__}({_knob_words(knobs)})"

    # ------------------------------------------------------------------------------ the same, of this one
    @property
    def window(self) -> int | None:
        """``W``: bounds gated admission (batches ahead of ``T``) and, for most policies, staleness."""
        return self.window_of(self.knobs)

    @property
    def is_on_policy(self) -> bool:
        return self.trains_on_policy(self.knobs)

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        return self.capacity_needed(self.knobs, groups_per_step)

    @property
    def admits_ahead(self) -> bool:
        """Can a batch be admitted before ``T`` reaches its step? Not when gated with a window of 0."""
        return not self.gated or self.window > 0

    def lower_bound(self, trainer_version: int) -> int:
        """``max(0, T - W)``: the oldest weight version a policy with a staleness window may train on (0 without
        a window)."""
        return 0 if self.window is None else max(0, trainer_version - self.window)

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

    def set_dispatch_index(self, resume_step: int) -> None:
        self.dispatch_index = check_int("resume_step", resume_step) - 1

    def resume_schedule(self, kept: list[Slot], trainer_version: int, groups_per_step: int) -> None:
        """Restored at step ``T`` over a buffer another sampler filled (``kept``: the slots this one keeps): the
        batches it holds count as admitted. A stamping sampler resumes after the last stamp it holds (``T - 1``
        when none is ahead); any other after ``ceil(len(kept) / N)`` batches past ``T - 1``."""
        T = check_int("trainer_version", trainer_version)
        N = check_int("groups_per_step", groups_per_step, 1)
        if self.stamps_target:
            self.dispatch_index = max([T - 1] + [s.target_step for s in kept if s.target_step is not None])
        else:
            self.dispatch_index = T - 1 + -(-len(kept) // N)

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
        return T, (picked if len(picked) >= min_groups or (picked and self._candidates_final(T)) else None)

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
                if n < min_groups and not self._candidates_final(T):
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

    def _candidates_final(self, T: int) -> bool:
        """True when no further candidate can join ``_candidates(T)`` before something is trained: ``select`` then
        takes what there is even below ``min_groups``, since waiting could never end (default: False, a policy's
        candidates may still grow)."""
        return False

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
        return f"{type(self).__name__}({_knob_words(self.knobs)}, dispatch_index={self.dispatch_index})"


def _knob_words(knobs: KnobModel) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in knobs.model_dump().items())


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('ch') else 's'}"


def _check_chunk(min_groups: object, max_groups: object) -> None:
    if isinstance(min_groups, bool) or not isinstance(min_groups, int) or min_groups < 1:
        raise ValueError(f"min_groups must be an int >= 1, got {min_groups!r}")
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < min_groups:
        raise ValueError(f"max_groups must be an int >= min_groups ({min_groups}), got {max_groups!r}")
