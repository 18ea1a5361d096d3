"""The rollout pump's side of multi-turn rollouts (``asyncrl/turns.py``): what happens to a group at a turn
boundary, and to one whose trajectory failed for good. Kept apart from ``asyncrl/rollout.py``, which knows nothing
of turns: a ``TurnGenerator`` is a generation backend to it.

Invariants:
- Every finished model turn is a ``turn`` trace row: the group, ``detail`` ``"trajectory I turn K"``, the version
  that generated it (``weight_version``, ``gen_start_version``/``gen_end_version``).
- At every turn boundary the sampler is asked ``should_abort_inflight(slot version, T)``, as after a weight sync;
  a doomed group is released and recorded as ``abort``, its reason saying the turn it reached, and counted in the
  step's ``groups_aborted`` as a weight sync's abort is (once: released, no sync sees it again).
- A group whose trajectory failed for good (an environment's exception, timeout, wrong type, dead worker, or a
  template that re-renders earlier turns) is a ``fault`` and regenerated through the pump's re-dispatch budget
  (``faults.max_dispatch_attempts``), then skipped: never committed with a reward of 0, so never in a baseline.
"""

from __future__ import annotations

from typing import Any

from asyncrl.trace import ABORT, TURN


class TurnHooks:
    """Binds ``turns`` (a ``TurnGenerator``) to ``pump`` (the ``RolloutPump`` that polls it) and ``train`` (the
    ``TrainPump`` whose step counts the groups stopped at a turn boundary in ``groups_aborted``; None: none)."""

    def __init__(self, pump: Any, turns: Any, train: Any = None):
        self.pump, self.train = pump, train
        turns.bind(self.on_turn, self.at_boundary, self.on_failed)

    def on_turn(self, gid: int, trajectory: int, turn: int, version: int, done: bool) -> None:
        s = self.pump.state
        with s.lock:
            slot = self.pump.buffer[gid] if gid in self.pump.buffer else None
            if slot is not None and not slot.ready:  # what explain() and trajectories() say of it in flight
                slot.turns = dict(slot.turns or {})
                slot.turns[trajectory] = ([*slot.turns.get(trajectory, ([], False))[0], version], done)
            s.record(TURN, gid, version, slot.target_step if slot is not None else None, None,
                     f"trajectory {trajectory} turn {turn}", f"generated with weights {version}",
                     gen_start_version=version, gen_end_version=version)

    def at_boundary(self, gid: int, turn: int) -> bool:
        pump, s = self.pump, self.pump.state
        with s.lock:
            if not pump.in_flight(gid):
                return True  # released meanwhile (aborted after a weight sync)
            slot, T = pump.buffer[gid], s.trainer_version
            if not pump.sampler.should_abort_inflight(slot.weight_version, T):
                return False
            reason = pump.sampler.abort_reason(slot, T)
            pump.release(gid)
            s.record(ABORT, gid, slot.weight_version, slot.target_step, T - slot.weight_version, "",
                     f"{reason}; stopped at a turn boundary after turn {turn}")
            if self.train is not None:  # released here, so a weight sync's abort never sees it: counted once
                self.train.count_aborted()
            return True

    def on_failed(self, gid: int, why: str) -> None:
        pump = self.pump
        with pump.state.lock:
            if pump.in_flight(gid):
                pump._redispatch([gid], f"environment: {why}")
