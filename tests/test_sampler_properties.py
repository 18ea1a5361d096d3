"""Property-based tests: random sequences of reserve / commit / admit / select / evict / version bumps / aborts,
for every policy, against a brute-force model of the rules in docs/samplers.md.

A small controller drives the sampler the way ``asyncrl.Controller`` does: an admission reserves one batch of
``N`` groups at the generation version ``G`` (stamped when the policy stamps); a train tick runs
``evict(T)`` then ``select(T, min(min_chunk, remaining), remaining)`` and, once the step has ``N`` groups,
``T += 1``; a weight sync moves ``G`` towards ``T``; an abort removes the in-flight (pending) groups the sampler
allows. Bare ``evict``/``select`` calls with arbitrary bounds, out-of-order commits, and (rarely) a generation
version that runs ahead of ``T``, or a stray reservation outside any admission, are mixed in.

Checked after every operation:
- every committed group is trained once, evicted once, or still in the buffer: never lost, never twice;
- ``select`` and ``evict`` never return a pending group, and return exactly what the brute-force model of the
  policy says (candidates in the policy's order, the first ``min(n, max)`` of them, or ``None`` below ``min``);
  so every selected group met its policy's staleness rule at that moment (``in_order``: ``target_step == T``);
- ``explain`` changes nothing and predicts ``evict`` then ``select`` exactly;
- gated policies never hold more than ``required_buffer_capacity(N)`` groups, nor more than ``W + 1`` admitted
  batches ahead of the step being trained (while every group came through an admission);
- ``ready_first`` never drops anything;
- the buffer's indexes agree with a scan of its slots.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer import ReplayBuffer
from asyncrl.samplers import build_sampler

POLICIES = {
    "windowed": ("max_staleness_versions", {}),
    "windowed_freshest_first": ("max_staleness_versions", {"freshest_first": True}),
    "weight_fifo": ("max_staleness_versions", {}),
    "in_order": ("max_lookahead_versions", {}),
    "ready_first": ("max_staleness_versions", {}),
}

# (name, pick, min_groups, extra): a commit finishes 1 + extra pending groups from the pick-th on (out of order on
# purpose); a bare select is select(T, min_groups, min_groups + extra). Names repeat to weight the mix towards a
# busy run (hypothesis keeps lists short unless told otherwise).
OP_NAMES = (
    ["train_tick"] * 5 + ["admit"] * 3 + ["commit"] * 5 + ["sync"] * 3 + ["select"] * 2
    + ["commit_all", "evict", "abort", "bump_ahead", "reserve"]
)
OPS = st.tuples(st.sampled_from(OP_NAMES), st.integers(0, 10_000), st.integers(1, 4), st.integers(0, 4))


# ------------------------------------------------------------------------------------------ the model
def reference_candidates(policy: str, W: int, slots: list, T: int) -> list:
    """Candidates for select, in the policy's order, by a scan of the slots (in dispatch order)."""
    lo = max(0, T - W)
    ready = [s for s in slots if s.ready]
    if policy in ("windowed", "windowed_freshest_first"):
        out = [s for s in ready if lo <= s.weight_version <= T]
        if policy == "windowed_freshest_first":
            out.sort(key=lambda s: (T - s.weight_version, s.group_id))
        return out
    if policy == "weight_fifo":
        in_window = [s.weight_version for s in slots if lo <= s.weight_version <= T]
        return [s for s in ready if in_window and s.weight_version == min(in_window)]
    if policy == "in_order":
        return [s for s in ready if s.target_step == T]
    if policy == "ready_first":
        return [s for s in ready if s.weight_version <= T]
    raise AssertionError(policy)


def reference_evictable(policy: str, W: int, slots: list, T: int) -> list:
    lo = max(0, T - W)
    if policy == "ready_first":
        return []
    if policy == "in_order":
        return [s for s in slots if s.ready and s.target_step is not None and s.target_step < T]
    return [s for s in slots if s.ready and s.weight_version < lo]


def staleness_rule_holds(policy: str, W: int, slot, T: int) -> bool:
    lo = max(0, T - W)
    if policy == "in_order":
        return slot.target_step == T
    if policy == "ready_first":
        return slot.weight_version <= T
    return lo <= slot.weight_version <= T  # windowed, weight_fifo (which also takes the oldest such version)


class Run:
    """The sampler under test, the buffer, and the bookkeeping the invariants need."""

    def __init__(self, policy: str, W: int, N: int, min_chunk: int):
        knob, extra = POLICIES[policy]
        name = "windowed" if policy.startswith("windowed") else policy
        self.policy, self.W, self.N, self.min_chunk = policy, W, N, min_chunk
        self.buffer = ReplayBuffer()
        self.sampler = build_sampler({"name": name, knob: W, **extra}, self.buffer)
        self.gated = name != "windowed"
        self.T = 0  # trainer version
        self.G = 0  # generation version
        self.step_trained = 0  # groups trained in the current step
        self.admitted = 0  # batches admitted
        self.committed: set[int] = set()
        self.fate: dict[int, str] = {}  # group id -> "trained" | "evicted"
        self.aborted: set[int] = set()
        self.strays = 0  # groups reserved outside any admission

    # ---------------------------------------------------------------------------------------- operations
    def reserve(self, pick: int) -> None:
        """A reservation outside any admission, stamped (in_order) for a past, current or future step or not
        at all. The controller never does this; the sampler's rules must still hold (not its capacity bound)."""
        target = None
        if self.policy == "in_order":
            target = [None, max(0, self.T - 1), self.T, self.T + 1][pick % 4]
        self.buffer.reserve(self.G, target_step=target)
        self.strays += 1

    def admit(self) -> None:
        adm = self.sampler.admit(self.T)
        if self.gated:
            assert (adm is not None) == (self.admitted <= self.T + self.W), "gated admission rule"
        if adm is None:
            return
        assert adm.dispatch_index == self.admitted
        assert adm.target_step == (adm.dispatch_index if self.policy == "in_order" else None)
        self.admitted += 1
        for _ in range(self.N):
            self.buffer.reserve(self.G, target_step=adm.target_step)

    def commit(self, pick: int | None = None, count: int = 1) -> None:
        """Commit ``count`` pending groups from the ``pick``-th on (all of them when ``pick`` is None)."""
        pending = self.buffer.pending_slots()
        chosen = pending if pick is None else pending[pick % len(pending):][:count]
        for slot in chosen:
            self.buffer.commit(slot.group_id, ("rollouts", slot.group_id), end_weight_version=self.G)
            self.committed.add(slot.group_id)

    def evict(self) -> None:
        expected = [s.group_id for s in reference_evictable(self.policy, self.W, self.buffer.slots(), self.T)]
        evicted = self.sampler.evict(self.T)
        assert [s.group_id for s in evicted] == expected
        for slot in evicted:
            assert slot.ready, "evict returned a pending slot"
            assert slot.group_id not in self.buffer
            self._settle(slot.group_id, "evicted")
        if self.policy == "ready_first":
            assert evicted == [], "ready_first dropped something"

    def select(self, min_groups: int, max_groups: int) -> list | None:
        T = self.T
        candidates = reference_candidates(self.policy, self.W, self.buffer.slots(), T)
        predicted = self.sampler.explain(T, min_groups, max_groups)
        final = self.policy == "weight_fifo" and candidates and not any(  # a complete version: taken even if short
            not s.ready and s.weight_version == candidates[0].weight_version for s in self.buffer.slots())
        short = len(candidates) < min_groups and not final
        expected = None if short else [s.group_id for s in candidates[:max_groups]]
        assert sorted(v.group_id for v in predicted if v.action == "select") == sorted(expected or [])
        chunk = self.sampler.select(T, min_groups, max_groups)
        assert (None if chunk is None else [s.group_id for s in chunk]) == expected
        for slot in chunk or []:
            assert slot.ready, "select returned a pending slot"
            assert staleness_rule_holds(self.policy, self.W, slot, T), (slot, T)
            assert slot.group_id not in self.buffer
            self._settle(slot.group_id, "trained")
        return chunk

    def train_tick(self) -> None:
        T = self.T
        remaining = self.N - self.step_trained
        lo_hi = (min(self.min_chunk, remaining), remaining)
        predicted = self.sampler.explain(T, *lo_hi)
        would_evict = sorted(v.group_id for v in predicted if v.action == "evict")
        self.evict_checked(would_evict)
        chunk = self.select(*lo_hi)
        if chunk:
            self._trained_in_step(len(chunk))

    def evict_checked(self, would_evict: list[int]) -> None:
        before = {s.group_id for s in self.buffer.slots()}
        self.evict()
        after = {s.group_id for s in self.buffer.slots()}
        assert sorted(before - after) == would_evict, "explain did not predict evict"

    def bare_select(self, min_groups: int, extra: int) -> None:
        chunk = self.select(min_groups, min_groups + extra)
        if chunk:
            self._trained_in_step(len(chunk))

    def sync(self) -> None:
        if self.G < self.T:  # generation versions never go back
            self.G += 1

    def bump_ahead(self) -> None:
        """The generation version passes T (never happens in a healthy run; the rules must still hold)."""
        self.G += 1

    def abort(self) -> None:
        doomed = [
            s.group_id
            for s in self.buffer.pending_slots()
            if self.sampler.should_abort_inflight(s.weight_version, self.T)
        ]
        if self.policy != "windowed" and self.policy != "windowed_freshest_first":
            assert doomed == [], "only windowed aborts in-flight rollouts"
        for gid in doomed:
            assert self.buffer[gid].weight_version < max(0, self.T - self.W)
        self.buffer.remove(doomed)
        self.aborted.update(doomed)

    def _trained_in_step(self, n: int) -> None:
        self.step_trained += n
        if self.step_trained >= self.N:  # finish_train_step: one optimizer step
            self.T += 1
            self.step_trained = 0

    def _settle(self, gid: int, fate: str) -> None:
        assert gid in self.committed, f"group {gid} left the buffer as {fate} without being committed"
        assert gid not in self.fate, f"group {gid} {fate} after being {self.fate.get(gid)}"
        self.fate[gid] = fate

    # ---------------------------------------------------------------------------------------- invariants
    def check(self) -> None:
        in_buffer = {s.group_id for s in self.buffer.slots()}
        for gid in self.committed:
            assert (gid in self.fate) != (gid in in_buffer), f"committed group {gid} lost or counted twice"
            assert self.buffer[gid].ready if gid in in_buffer else True
        for gid in range(self.buffer.next_group_id):
            if gid not in self.committed:  # reserved, never committed: in flight or aborted, nothing else
                assert (gid in in_buffer) != (gid in self.aborted)
        if self.gated and not self.strays:
            capacity = self.sampler.required_buffer_capacity(self.N)
            assert capacity == self.N * (self.W + 1)
            assert len(self.buffer) <= capacity, (len(self.buffer), capacity)
            assert self.admitted - self.T <= self.W + 1
        if self.policy == "ready_first":
            assert "evicted" not in self.fate.values() and not self.aborted
        self._check_indexes()

    def _check_indexes(self) -> None:
        slots = self.buffer.slots()
        versions = self.buffer.by_version
        assert versions.keys == sorted({s.weight_version for s in slots})
        for v in versions.keys:
            assert [s.group_id for s in versions.ready[v]] == [
                s.group_id for s in slots if s.weight_version == v and s.ready
            ]
        assert self.buffer.num_pending == sum(not s.ready for s in slots)
        assert [s.weight_version for s in slots] == sorted(s.weight_version for s in slots)


def run_ops(policy: str, W: int, N: int, min_chunk: int, ops: list) -> Run:
    run = Run(policy, W, N, min(min_chunk, N))
    for op, pick, min_groups, extra in ops:
        if op == "admit":
            run.admit()
        elif op == "reserve":
            run.reserve(pick)
        elif op == "commit":
            if run.buffer.num_pending:
                run.commit(pick, 1 + extra)
        elif op == "commit_all":
            run.commit()
        elif op == "train_tick":
            run.train_tick()
        elif op == "sync":
            run.sync()
        elif op == "bump_ahead":
            run.bump_ahead()
        elif op == "evict":
            run.evict()
        elif op == "select":
            run.bare_select(min_groups, extra)
        elif op == "abort":
            run.abort()
        run.check()
    summary = run.buffer.summary()  # once per run: pandas is slow next to everything else here
    assert summary["pending"].sum() == run.buffer.num_pending and summary["total"].sum() == len(run.buffer)
    return run


@pytest.mark.parametrize("policy", list(POLICIES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    W=st.integers(0, 2),
    N=st.integers(1, 4),
    min_chunk=st.integers(1, 4),
    ops=st.lists(OPS, min_size=20, max_size=120),
)
def test_random_operation_sequences(policy, W, N, min_chunk, ops):
    run_ops(policy, W, N, min_chunk, ops)


@pytest.mark.parametrize("policy", list(POLICIES))
@settings(max_examples=12, deadline=None)
@given(W=st.integers(0, 2), N=st.integers(1, 4))
def test_a_controller_loop_makes_progress_and_loses_nothing(policy, W, N):
    """A well-behaved loop (admit, commit everything, train, sync) never stalls, and loses nothing."""
    ops = [(op, 0, 1, 0) for op in ("admit", "admit", "commit_all", "train_tick", "sync")] * 12
    run = run_ops(policy, W, N, N, ops)
    assert run.T >= 6, f"{policy} stalled at T={run.T}"
    run.commit()
    for _ in range(4):
        run.train_tick()
    run.check()
    trained = sum(fate == "trained" for fate in run.fate.values())
    assert trained >= run.T * N
