"""ReplayBuffer (asyncrl/buffer.py): reserve / commit / atomic remove, ordered views, counts, summary, indexes."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.buffer import Bucket, ReplayBuffer, Slot
from asyncrl.sorted_ids import SortedIds


def ids(slots):
    return [s.group_id for s in slots]


def snapshot(buf: ReplayBuffer):
    """Everything observable about a buffer, to show an error changed nothing."""
    return (
        [(s.group_id, s.weight_version, s.target_step, s.ready, s.rollouts, s.end_weight_version) for s in buf],
        buf.next_group_id,
        buf.num_pending,
        buf.summary().to_dict(),
        {t: buf.count(target_step=t) for t in range(10)},
    )


def check_indexes(buf: ReplayBuffer) -> None:
    """The version and target-step indexes agree with a scan of the slots, and iterate in dispatch order."""
    slots = buf.slots()
    assert ids(slots) == sorted(ids(slots))
    for index, key in ((buf.by_version, "weight_version"), (buf.by_target, "target_step")):
        keys = sorted({getattr(s, key) for s in slots if getattr(s, key) is not None})
        assert index.keys == keys
        for k in keys:
            assert ids(index.ready[k]) == [s.group_id for s in slots if getattr(s, key) == k and s.ready]
            assert ids(index.pending[k]) == [s.group_id for s in slots if getattr(s, key) == k and not s.ready]
    assert buf.num_pending == len(buf.pending_slots())
    assert buf.num_ready == len(buf.ready_slots())


# ------------------------------------------------------------------------------------------------- reserve
def test_reserve_adds_pending_slots_in_dispatch_order():
    buf = ReplayBuffer()
    a = buf.reserve(0, prompt="p0")
    b = buf.reserve(0, target_step=3)
    c = buf.reserve(2)
    assert (a, b, c) == (0, 1, 2)
    assert len(buf) == 3 and buf.num_pending == 3 and buf.num_ready == 0
    assert ids(buf.slots()) == ids(buf) == ids(buf.pending_slots()) == [0, 1, 2]
    assert buf.ready_slots() == []
    slot = buf[b]
    assert (slot.group_id, slot.weight_version, slot.target_step, slot.ready, slot.state) == (1, 0, 3, False, "pending")
    assert slot.rollouts is None and slot.end_weight_version is None
    assert buf[a].prompt == "p0" and buf[a].target_step is None
    assert a in buf and 99 not in buf
    assert "pending" in repr(slot) and "target_step=3" in repr(slot)
    check_indexes(buf)


def test_reserve_refuses_an_older_weight_version():
    buf = ReplayBuffer()
    buf.reserve(3)
    buf.reserve(3)
    with pytest.raises(ValueError, match=r"weight_version 2 is older than the newest slot's \(3\)"):
        buf.reserve(2)
    assert len(buf) == 2
    buf.reserve(5)
    assert [s.weight_version for s in buf] == [3, 3, 5]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True])
def test_reserve_rejects_bad_weight_version(bad):
    buf = ReplayBuffer()
    with pytest.raises(ValueError, match=rf"weight_version must be an int >= 0, got {bad!r}"):
        buf.reserve(bad)
    assert len(buf) == 0 and buf.next_group_id == 0


@pytest.mark.parametrize("bad", [-1, 2.0, False])
def test_reserve_rejects_bad_target_step(bad):
    buf = ReplayBuffer()
    with pytest.raises(ValueError, match=rf"target_step must be an int >= 0, got {bad!r}"):
        buf.reserve(0, target_step=bad)
    assert len(buf) == 0


def test_numpy_integers_are_versions():
    buf = ReplayBuffer()
    gid = buf.reserve(np.int64(2), target_step=np.int32(1))
    assert type(buf[gid].weight_version) is int and type(buf[gid].target_step) is int
    assert buf.count(target_step=1) == 1


def test_capacity_bounds_len():
    buf = ReplayBuffer(capacity=2)
    buf.reserve(0)
    gid = buf.reserve(0)
    with pytest.raises(ValueError, match="buffer is full: 2 slots, capacity 2"):
        buf.reserve(0)
    buf.remove([gid])
    buf.reserve(0)
    assert len(buf) == 2


@pytest.mark.parametrize("bad", [0, -3, 1.5])
def test_capacity_must_be_positive(bad):
    with pytest.raises(ValueError, match=rf"capacity must be an int >= 1, got {bad!r}"):
        ReplayBuffer(capacity=bad)


# -------------------------------------------------------------------------------------------------- commit
def test_commit_marks_ready_and_stores_rollouts_as_given():
    buf = ReplayBuffer()
    a, b = buf.reserve(1), buf.reserve(1)
    payload = object()
    slot = buf.commit(b, payload, end_weight_version=3)
    assert slot is buf[b] and slot.ready and slot.state == "ready"
    assert slot.rollouts is payload and slot.end_weight_version == 3
    assert buf.commit(a, [1, 2]).end_weight_version == 1  # defaults to the start version
    assert buf.num_pending == 0 and ids(buf.ready_slots()) == [a, b]
    check_indexes(buf)


def test_commit_unknown_id_is_an_error_and_changes_nothing():
    buf = ReplayBuffer()
    buf.reserve(0)
    before = snapshot(buf)
    with pytest.raises(KeyError, match="unknown group_id 7"):
        buf.commit(7, "r")
    assert snapshot(buf) == before


def test_commit_of_a_removed_id_is_an_error():
    buf = ReplayBuffer()
    gid = buf.reserve(0)
    buf.remove([gid])
    with pytest.raises(KeyError, match=f"unknown group_id {gid}"):
        buf.commit(gid, "r")


def test_commit_twice_is_an_error_and_changes_nothing():
    buf = ReplayBuffer()
    gid = buf.reserve(0)
    buf.commit(gid, "first", end_weight_version=1)
    before = snapshot(buf)
    with pytest.raises(ValueError, match=f"group_id {gid} is already committed"):
        buf.commit(gid, "second", end_weight_version=2)
    assert snapshot(buf) == before and buf[gid].rollouts == "first"


def test_commit_end_version_older_than_start_is_an_error():
    buf = ReplayBuffer()
    gid = buf.reserve(4)
    before = snapshot(buf)
    with pytest.raises(ValueError, match="end_weight_version must be an int >= 4, got 3"):
        buf.commit(gid, "r", end_weight_version=3)
    assert snapshot(buf) == before


# -------------------------------------------------------------------------------------------------- remove
def test_remove_returns_slots_in_the_order_given():
    buf = ReplayBuffer()
    gids = [buf.reserve(0, target_step=0) for _ in range(4)]
    buf.commit(gids[1], "r")
    removed = buf.remove([gids[3], gids[1]])  # a pending slot may be removed (an aborted rollout)
    assert ids(removed) == [3, 1]
    assert ids(buf) == [0, 2] and buf.count(target_step=0) == 2
    assert buf.remove([]) == []
    check_indexes(buf)


def test_remove_with_an_unknown_id_removes_nothing():
    buf = ReplayBuffer()
    gids = [buf.reserve(0) for _ in range(3)]
    buf.commit(gids[0], "r")
    before = snapshot(buf)
    with pytest.raises(KeyError, match=r"unknown group_id\(s\) \[42\]; nothing was removed"):
        buf.remove([gids[0], 42, gids[2]])
    assert snapshot(buf) == before
    check_indexes(buf)


def test_remove_with_a_duplicate_id_removes_nothing():
    buf = ReplayBuffer()
    gids = [buf.reserve(0) for _ in range(3)]
    before = snapshot(buf)
    with pytest.raises(ValueError, match=r"group_id\(s\) \[1\] given more than once; nothing was removed"):
        buf.remove([gids[1], gids[0], gids[1]])
    assert snapshot(buf) == before


def test_remove_accepts_any_iterable():
    buf = ReplayBuffer()
    for _ in range(5):
        buf.reserve(0)
    assert ids(buf.remove(g for g in (4, 0))) == [4, 0]
    assert ids(buf) == [1, 2, 3]


# --------------------------------------------------------------------------------------------------- views
def test_count_by_target_step():
    buf = ReplayBuffer()
    a = buf.reserve(0, target_step=1)
    buf.reserve(0, target_step=1)
    buf.reserve(0, target_step=2)
    buf.reserve(0)
    buf.commit(a, "r")
    assert buf.count(target_step=1) == 2  # pending and ready alike
    assert buf.count(target_step=2) == 1
    assert buf.count(target_step=9) == 0
    assert buf.count() == len(buf) == 4


def test_summary_by_weight_version_and_state():
    buf = ReplayBuffer()
    for v, n_ready, n_pending in ((0, 2, 1), (2, 0, 3), (3, 1, 0)):
        for gid in [buf.reserve(v) for _ in range(n_ready + n_pending)][:n_ready]:
            buf.commit(gid, None)
    frame = buf.summary()
    assert isinstance(frame, pd.DataFrame)
    assert frame.index.name == "weight_version" and list(frame.index) == [0, 2, 3]
    assert list(frame.columns) == ["pending", "ready", "total", "spanning"]
    assert frame.loc[0].tolist() == [1, 2, 3, 0]
    assert frame.loc[2].tolist() == [3, 0, 3, 0]
    assert frame.loc[3].tolist() == [0, 1, 1, 0]


def test_a_group_generated_across_versions_is_counted_and_never_judged_newer_than_its_tokens():
    """In-flight weight updates: a group reserved at 1 whose tokens came from weights 1..3 spans versions, and
    stays judged at 1; a commit saying its tokens are older than its stamp is refused, changing nothing."""
    buf = ReplayBuffer()
    a, b, c = buf.reserve(1), buf.reserve(1), buf.reserve(1)
    before = snapshot(buf)
    with pytest.raises(ValueError, match="start_weight_version must be an int >= 1, got 0"):
        buf.commit(a, None, end_weight_version=1, start_weight_version=0)
    with pytest.raises(ValueError, match="end_weight_version must be an int >= 2, got 1"):
        buf.commit(a, None, end_weight_version=1, start_weight_version=2)
    assert snapshot(buf) == before
    buf.commit(a, None, end_weight_version=3, start_weight_version=1)
    buf.commit(b, None, end_weight_version=2, start_weight_version=2)  # entered the engine late: one version
    assert buf[a].spans_versions and not buf[b].spans_versions and not buf[c].spans_versions
    assert buf.summary().loc[1].tolist() == [1, 2, 3, 1] and buf[a].weight_version == 1
    restored = ReplayBuffer.from_state_dict(buf.state_dict())
    assert restored.summary().equals(buf.summary())
    buf.remove([a])
    assert buf.summary().loc[1, "spanning"] == 0


def test_summary_of_an_empty_buffer():
    frame = ReplayBuffer().summary()
    assert frame.empty and list(frame.columns) == ["pending", "ready", "total", "spanning"]
    assert frame.index.name == "weight_version"


def test_iteration_is_a_snapshot():
    buf = ReplayBuffer()
    for _ in range(3):
        buf.reserve(0)
    for slot in buf:  # removing while iterating is safe
        buf.remove([slot.group_id])
    assert len(buf) == 0


def test_indexes_iterate_in_dispatch_order_whatever_the_commit_order():
    """Rollouts finish out of order; "buffer order" must still be dispatch order (a bug once: commit order)."""
    rng = random.Random(0)
    buf = ReplayBuffer()
    gids = [buf.reserve(v // 700, target_step=v // 300) for v in range(3000)]
    order = gids[:]
    rng.shuffle(order)
    for gid in order[:2000]:
        buf.commit(gid, None)
    check_indexes(buf)
    doomed = rng.sample(gids, 900)
    buf.remove(doomed)
    check_indexes(buf)
    for gid in order[2000:]:
        if gid in buf:
            buf.commit(gid, None)
    check_indexes(buf)
    assert buf.num_pending == 0


def test_state_dict_round_trip():
    buf = ReplayBuffer(capacity=10)
    gids = [buf.reserve(v, target_step=v + 1, prompt=f"p{v}") for v in (0, 0, 1, 2)]
    buf.commit(gids[2], {"tokens": [1, 2]}, end_weight_version=2)
    buf.commit(gids[0], "r0")
    buf.remove([gids[1]])
    restored = ReplayBuffer.from_state_dict(buf.state_dict())
    assert snapshot(restored) == snapshot(buf)
    assert restored.capacity == 10 and restored[gids[0]].prompt == "p0"
    check_indexes(restored)
    assert restored.reserve(2) == buf.reserve(2) == 4  # ids keep growing after a restore
    assert repr(buf) == "ReplayBuffer(4 slots: 2 ready, 2 pending)"


# ------------------------------------------------------------------------------------- the ordered buckets
@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add"] * 3 + ["remove", "remove_many"]), st.integers(0, 60), st.integers(1, 8)),
        min_size=30,
        max_size=150,
    )
)
def test_a_bucket_iterates_in_dispatch_order_whatever_order_slots_arrive(ops):
    bucket, model = Bucket(), {}
    for op, x, k in ops:
        if op == "add" and x not in model:
            model[x] = Slot(x, 0)
            bucket.add(model[x])
        elif op == "remove" and model:
            y = sorted(model)[x % len(model)]
            bucket.remove(model.pop(y))
        elif op == "remove_many" and model:
            present = sorted(model)
            start = x % len(present)
            run = present[start : start + k] if x % 2 else present[start :: max(1, k)][:k]  # runs and scatters
            bucket.remove_many(run[::-1] if k % 2 else run)  # in any order
            for gid in run:
                del model[gid]
        assert [s.group_id for s in bucket] == sorted(model) and len(bucket) == len(model)


class _SmallBlocks(SortedIds):
    LOAD = 2  # splits and empties blocks often


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add"] * 3 + ["remove", "remove_many"]), st.integers(0, 60), st.integers(1, 8)),
        min_size=30,
        max_size=150,
    )
)
def test_sorted_ids_match_a_sorted_set(ops):
    ordered, model = _SmallBlocks(), set()
    for op, x, k in ops:
        if op == "add" and x not in model:
            ordered.add(x)
            model.add(x)
        elif op == "remove" and model:
            y = sorted(model)[x % len(model)]
            ordered.remove(y)
            model.discard(y)
        elif op == "remove_many" and model:
            present = sorted(model)
            start = x % len(present)
            run = present[start : start + k] if x % 2 else present[start :: max(1, k)][:k]  # runs and scatters
            ordered.remove_many(run)
            model.difference_update(run)
        assert list(ordered) == sorted(model)
        assert all(ordered.blocks) and ordered.maxes == [b[-1] for b in ordered.blocks]
        assert all(len(b) <= 2 * ordered.LOAD for b in ordered.blocks)
