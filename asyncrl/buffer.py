"""The replay buffer of prompt groups.

Invariants (what every sampler and the controller rely on):
- Slots are kept in dispatch order (group ids only grow), so ``weight_version`` never decreases along the
  buffer; ``reserve`` refuses a version older than the newest slot's.
- A slot is *pending* from ``reserve`` until ``commit``, then *ready*. Only ``remove`` takes slots out, and it is
  atomic: every id is validated before anything is removed.
- Indexes by weight version and by target step are kept next to the slot table, so a sampler can find its
  candidates in O(candidates + versions) instead of scanning the buffer. Versions present are few (a window's
  worth), so a sorted list of them is enough.
- Every index bucket iterates in dispatch (``group_id``) order whatever order commits arrive in (rollouts finish
  out of order), so "buffer order" among a sampler's candidates is dispatch order.

The buffer holds metadata and whatever it is given as a group's rollouts; it never interprets the rollouts.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd

from asyncrl.sorted_ids import SortedIds


@dataclass(eq=False)
class Slot:
    group_id: int
    weight_version: int
    target_step: int | None = None
    prompt: Any = None
    ready: bool = False
    rollouts: Any = None
    end_weight_version: int | None = None

    @property
    def state(self) -> str:
        return "ready" if self.ready else "pending"

    def __repr__(self) -> str:
        target = "" if self.target_step is None else f", target_step={self.target_step}"
        return f"Slot(group_id={self.group_id}, weight_version={self.weight_version}{target}, {self.state})"


def _as_int(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as a plain int >= ``minimum`` (numpy integers welcome; bools are not versions)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class Bucket:
    """The slots of one index key in one state, in dispatch (``group_id``) order whatever order they arrive in.

    Iterating gives slots; do not change the bucket while iterating it (copy to a list first)."""

    __slots__ = ("_slots", "_order")

    def __init__(self) -> None:
        self._slots: dict[int, Slot] = {}
        self._order = SortedIds()

    def add(self, slot: Slot) -> None:
        self._slots[slot.group_id] = slot
        self._order.add(slot.group_id)

    def remove(self, slot: Slot) -> None:
        del self._slots[slot.group_id]
        self._order.remove(slot.group_id)

    def remove_many(self, group_ids: list[int]) -> None:
        slots = self._slots
        for gid in group_ids:
            del slots[gid]
        self._order.remove_many(sorted(group_ids))

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Slot]:
        return map(self._slots.__getitem__, self._order)

    def __repr__(self) -> str:
        return f"Bucket({[s.group_id for s in self]})"


class _Index:
    """Slots bucketed by an integer key (a version or a target step), each bucket split by state and kept in
    dispatch order (``Bucket``)."""

    def __init__(self) -> None:
        self.keys: list[int] = []  # sorted keys with at least one slot
        self.ready: dict[int, Bucket] = {}
        self.pending: dict[int, Bucket] = {}

    def add(self, key: int, slot: Slot) -> None:
        if key not in self.ready:
            bisect.insort(self.keys, key)
            self.ready[key], self.pending[key] = Bucket(), Bucket()
        (self.ready if slot.ready else self.pending)[key].add(slot)

    def mark_ready(self, key: int, slot: Slot) -> None:
        self.pending[key].remove(slot)
        self.ready[key].add(slot)

    def discard(self, key: int, slot: Slot) -> None:
        (self.ready if slot.ready else self.pending)[key].remove(slot)
        if not self.ready[key] and not self.pending[key]:
            del self.ready[key], self.pending[key]
            self.keys.pop(bisect.bisect_left(self.keys, key))

    def discard_many(self, key: int, ready: bool, group_ids: list[int]) -> None:
        (self.ready if ready else self.pending)[key].remove_many(group_ids)
        if not self.ready[key] and not self.pending[key]:
            del self.ready[key], self.pending[key]
            self.keys.pop(bisect.bisect_left(self.keys, key))

    def count(self, key: int) -> int:
        if key not in self.ready:
            return 0
        return len(self.ready[key]) + len(self.pending[key])

    def keys_between(self, lo: int | None = None, hi: int | None = None) -> list[int]:
        """Keys k with lo <= k <= hi (either bound may be open), ascending."""
        start = 0 if lo is None else bisect.bisect_left(self.keys, lo)
        stop = len(self.keys) if hi is None else bisect.bisect_right(self.keys, hi)
        return self.keys[start:stop]


def _discard_grouped(index: _Index, slots: list[Slot], keys: list[tuple[bool, int]]) -> None:
    """Take ``slots`` out of ``index``, one batch per (state, key); ``keys[i]`` is ``slots[i]``'s."""
    first = keys[0]
    if keys.count(first) == len(keys):  # the usual case: one version (or target step), one state
        index.discard_many(first[1], first[0], [s.group_id for s in slots])
        return
    groups: dict[tuple[bool, int], list[int]] = {}
    for slot, key in zip(slots, keys):
        groups.setdefault(key, []).append(slot.group_id)
    for (ready, key), gids in groups.items():
        index.discard_many(key, ready, gids)


class ReplayBuffer:
    """Prompt-group slots in dispatch order. ``capacity`` (optional) bounds ``len(buffer)``."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = None if capacity is None else _as_int("capacity", capacity, 1)
        self._slots: dict[int, Slot] = {}
        self._next_id = 0
        self._pending = 0
        self.by_version = _Index()
        self.by_target = _Index()

    # ----------------------------------------------------------------------------------------------- writes
    def reserve(self, weight_version: int, target_step: int | None = None, prompt: Any = None) -> int:
        weight_version = _as_int("weight_version", weight_version)
        if target_step is not None:
            target_step = _as_int("target_step", target_step)
        newest = self.by_version.keys[-1] if self.by_version.keys else None
        if newest is not None and weight_version < newest:
            raise ValueError(
                f"weight_version {weight_version} is older than the newest slot's ({newest}); slots are kept in "
                "dispatch order and generation versions never go back"
            )
        if self.capacity is not None and len(self._slots) >= self.capacity:
            raise ValueError(f"buffer is full: {len(self._slots)} slots, capacity {self.capacity}")
        slot = Slot(self._next_id, weight_version, target_step, prompt)
        self._next_id += 1
        self._slots[slot.group_id] = slot
        self._pending += 1
        self.by_version.add(weight_version, slot)
        if target_step is not None:
            self.by_target.add(target_step, slot)
        return slot.group_id

    def commit(self, group_id: int, rollouts: Any, end_weight_version: int | None = None) -> Slot:
        slot = self._slots.get(group_id)
        if slot is None:
            raise KeyError(f"commit of unknown group_id {group_id!r}: it was never reserved or was already removed")
        if slot.ready:
            raise ValueError(f"group_id {group_id} is already committed; a group is committed exactly once")
        if end_weight_version is not None:
            end_weight_version = _as_int("end_weight_version", end_weight_version, slot.weight_version)
        slot.rollouts = rollouts
        slot.end_weight_version = slot.weight_version if end_weight_version is None else end_weight_version
        self.by_version.mark_ready(slot.weight_version, slot)
        if slot.target_step is not None:
            self.by_target.mark_ready(slot.target_step, slot)
        slot.ready = True
        self._pending -= 1
        return slot

    def remove(self, group_ids: Iterable[int]) -> list[Slot]:
        """Remove the given groups and return their slots, in the order given. All or nothing."""
        ids = list(group_ids)
        unknown = [g for g in ids if g not in self._slots]
        if unknown:
            raise KeyError(f"cannot remove unknown group_id(s) {unknown}; nothing was removed")
        if len(set(ids)) != len(ids):
            dup = sorted({g for g in ids if ids.count(g) > 1})
            raise ValueError(f"group_id(s) {dup} given more than once; nothing was removed")
        if not ids:
            return []
        slots = self._slots
        removed = [slots.pop(gid) for gid in ids]
        _discard_grouped(self.by_version, removed, [(s.ready, s.weight_version) for s in removed])
        stamped = [s for s in removed if s.target_step is not None]
        if stamped:
            _discard_grouped(self.by_target, stamped, [(s.ready, s.target_step) for s in stamped])
        self._pending -= sum(not s.ready for s in removed)
        return removed

    # ------------------------------------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(list(self._slots.values()))

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._slots

    def __getitem__(self, group_id: int) -> Slot:
        return self._slots[group_id]

    def slots(self) -> list[Slot]:
        return list(self._slots.values())

    def ready_slots(self) -> list[Slot]:
        return [s for s in self._slots.values() if s.ready]

    def pending_slots(self) -> list[Slot]:
        return [s for s in self._slots.values() if not s.ready]

    @property
    def num_pending(self) -> int:
        return self._pending

    @property
    def num_ready(self) -> int:
        return len(self._slots) - self._pending

    @property
    def next_group_id(self) -> int:
        return self._next_id

    def count(self, target_step: int | None = None) -> int:
        """Slots (pending or ready) stamped for ``target_step``; all slots when it is None."""
        return len(self._slots) if target_step is None else self.by_target.count(target_step)

    def summary(self) -> pd.DataFrame:
        """Slot counts by weight version (rows) and state (columns ``pending``, ``ready``), plus ``total``."""
        versions = self.by_version.keys
        frame = pd.DataFrame(
            {
                "pending": [len(self.by_version.pending[v]) for v in versions],
                "ready": [len(self.by_version.ready[v]) for v in versions],
            },
            index=pd.Index(versions, name="weight_version", dtype="int64"),
            dtype="int64",
        )
        frame["total"] = frame["pending"] + frame["ready"]
        return frame

    # ----------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Everything needed to rebuild the buffer exactly (rollouts included, as given)."""
        return {
            "capacity": self.capacity,
            "next_group_id": self._next_id,
            "slots": [
                {
                    "group_id": s.group_id,
                    "weight_version": s.weight_version,
                    "target_step": s.target_step,
                    "prompt": s.prompt,
                    "ready": s.ready,
                    "rollouts": s.rollouts,
                    "end_weight_version": s.end_weight_version,
                }
                for s in self._slots.values()
            ],
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> ReplayBuffer:
        buf = cls(state["capacity"])
        for row in state["slots"]:
            slot = Slot(**row)
            buf._slots[slot.group_id] = slot
            buf._pending += not slot.ready
            buf.by_version.add(slot.weight_version, slot)
            if slot.target_step is not None:
                buf.by_target.add(slot.target_step, slot)
        buf._next_id = state["next_group_id"]
        return buf

    def load_state_dict(self, state: dict) -> None:
        """Become the buffer ``state`` describes, in place (a sampler built on this buffer keeps judging it)."""
        self.__dict__.update(ReplayBuffer.from_state_dict(state).__dict__)

    def __repr__(self) -> str:
        return f"ReplayBuffer({len(self)} slots: {self.num_ready} ready, {self.num_pending} pending)"

