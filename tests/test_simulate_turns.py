"""Multi-turn runs on the simulated clock (``generation.turns``): turn events, per-turn versions, the sampler at turn
boundaries, and replays of multi-turn recordings (simulated and a real ``guess_letter`` CPU run)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest

import asyncrl
from asyncrl import Controller, cli, load_config
from asyncrl.backends.simulated import SimulatedGenerator
from asyncrl.data import GenerationRequest
from asyncrl.replay.recorded import schedule
from asyncrl.simulate import Simulation
from tests.test_replay import record, trained

TURNS = {"max_turns": 4, "mean_turns": 3, "env_latency_s": 0.5, "env_latency_tail": "pareto",
         "env_latency_max_s": 5.0, "env_tokens": 3}
FIFO = {"name": "weight_fifo", "max_staleness_versions": 1}


def simulate(steps: int, sampler: dict, **turns) -> Simulation:
    ctrl = Controller.from_config(load_config("what_if", sampler=sampler, generation={"turns": {**TURNS, **turns}}))
    sim = Simulation(ctrl)
    sim.run(steps)
    return sim


def test_a_simulated_multi_turn_run_has_turn_events_and_per_turn_versions():
    sim = simulate(12, FIFO)
    ctrl, trace = sim.ctrl, sim.trace
    turns = trace[trace.event == "turn"]
    assert turns.detail.str.fullmatch(r"trajectory \d+ turn [1-4]").all()
    assert turns.sim_time_s.notna().all() and turns.sim_time_s.is_monotonic_increasing  # timed by the loop
    rows = ctrl.completions
    assert rows.turns.between(1, 4).all() and (rows.turns > 1).any() and (rows.turns == 1).any()
    assert (rows.turn_versions.map(len) == rows.turns).all()
    assert (rows.env_tokens == 3 * (rows.turns - 1)).all()  # an observation after every turn but the last
    spanning = rows[rows.turn_versions.map(lambda v: len(set(v)) > 1)]
    assert len(spanning) > 0  # the weights moved between turns of one trajectory
    # every committed trajectory's turns are turn events, at the versions its completions row says
    committed = trace[trace.event == "commit"].group_id.astype(int)
    events = turns[turns.group_id.isin(committed)]
    per_trajectory = events.assign(i=events.detail.str.extract(r"trajectory (\d+)")[0].astype(int)) \
        .groupby(["group_id", "i"]).weight_version.agg(list)
    for (gid, i, versions) in zip(rows.group_id, rows.completion_index, rows.turn_versions):
        assert per_trajectory[gid, i] == list(versions)
    # in the buffer: sampled tokens carry their turn's version, observation tokens are untrained context
    slot = next(s for s in ctrl.buffer.ready_slots() if s.rollouts.turns and max(t["turns"] for t in s.rollouts.turns) > 1)
    r = slot.rollouts
    for ids, mask, versions, t in zip(r.completion_ids, r.trained_mask, r.token_versions, r.turns):
        assert len(ids) == len(mask) and sum(mask) == len(versions)
        assert len(ids) - sum(mask) == t["env_tokens"]
        assert sorted(set(versions)) == sorted(set(t["turn_versions"]))
    assert r.num_tokens == sum(map(sum, r.trained_mask))
    assert min(min(t["turn_versions"]) for t in r.turns) == r.gen_start_version


def test_the_sampler_is_asked_at_every_turn_boundary_and_stops_a_group_there():
    # windowed W=2 stops what fell out of its window at syncs; this one also stops every 7th group it is asked
    # about (a sampler whose verdict changes within a version), which only a turn boundary can act on
    windowed = {"name": "windowed", "max_staleness_versions": 2}
    ctrl = Controller.from_config(load_config("what_if", sampler=windowed, generation={"turns": TURNS}))
    asked: list[tuple[int, int]] = []
    plain = ctrl.sampler.should_abort_inflight

    def should_abort_inflight(weight_version: int, T: int) -> bool:
        asked.append((weight_version, T))
        return plain(weight_version, T) or len(asked) % 7 == 0

    ctrl.sampler.should_abort_inflight = should_abort_inflight
    sim = Simulation(ctrl)
    sim.run(8)
    trace = sim.trace
    stopped = trace[(trace.event == "abort") & trace.reason.str.contains("stopped at a turn boundary")]
    assert len(stopped) > 0 and stopped.sim_time_s.notna().all()
    committed = set(trace[trace.event == "commit"].group_id.astype(int))
    assert not committed & set(stopped.group_id.astype(int))  # a stopped group never commits
    turns = trace[trace.event == "turn"]
    for gid, reason in zip(stopped.group_id.astype(int), stopped.reason):
        k = int(reason.rsplit("after turn ", 1)[1])
        played = turns[turns.group_id == gid].detail.str.extract(r"turn (\d+)")[0].astype(int)
        assert played.max() == k and k < TURNS["max_turns"]  # stopped there: no later turn of it was played
    # asked once per turn boundary of a group not done (the syncs ask too: at least as many as the boundaries)
    boundaries = sum(1 for gid, g in turns.groupby("group_id")
                     for k in range(1, g.detail.str.extract(r"turn (\d+)")[0].astype(int).max()))
    assert len(asked) >= boundaries


def test_a_simulated_multi_turn_run_is_deterministic():
    a, b = (simulate(6, FIFO).trace for _ in range(2))
    pd.testing.assert_frame_equal(a, b)


def test_the_turns_knobs_are_checked_in_one_line():
    with pytest.raises(ValueError, match="mean_turns 5.0 exceeds turns.max_turns 3"):
        load_config("what_if", generation={"turns": {"max_turns": 3, "mean_turns": 5}})
    with pytest.raises(ValueError, match="env_latency_tail"):
        load_config("what_if", generation={"turns": {"env_latency_tail": "gamma"}})


def test_a_multi_turn_simulated_recording_replays_its_schedule_and_trajectories(tmp_path):
    # in_order trains in dispatch order, whatever the timing: its replay trains the same groups at the same steps
    # (the environment's seconds are redrawn: the recording keeps a trajectory's turns and tokens, not its waits)
    ahead = {"name": "in_order", "max_lookahead_versions": 1}
    record(tmp_path / "run", 10, simulated_clock=True, sampler=ahead, generation={"turns": TURNS})
    rec = asyncrl.Recording(tmp_path / "run")
    replayed = rec.replay(sampler=ahead)
    assert trained(replayed.schedule) == trained(schedule(rec.trace))
    assert replayed.controller.cfg.generation.turns.env_latency_s == TURNS["env_latency_s"]  # its own model
    # each replayed group was served a recorded group's trajectories: their turns, tokens, observations, rewards
    mine = replayed.controller.completions
    theirs = pd.read_json(tmp_path / "run" / "completions.jsonl", lines=True).set_index(["group_id", "completion_index"])
    served = replayed.controller.generator.served
    checked = 0
    for gid, rows in mine.groupby("group_id"):
        if served[gid].drawn:
            continue
        source = theirs.loc[served[gid].recorded_group].sort_index()
        rows = rows.sort_values("completion_index")
        for column in ("turns", "tokens", "env_tokens", "reward"):
            assert list(rows[column]) == list(source[column]), (gid, column)
        checked += 1
    assert checked >= 20


def test_a_recorded_guess_letter_run_replays_under_another_sampler(tmp_path):
    # a real multi-turn CPU run (pumps in threads, the environment in the pump's process), 20 steps
    sync = {"name": "in_order", "max_lookahead_versions": 0}
    settings = [f"sampler={json.dumps(sync)}", "eval_every=null", "torch_threads=1", "groups_per_step=4",
                "group_size=4"]
    assert cli.main(["run", "guess_letter", "--steps", "20", "--out", str(tmp_path / "run"), "--quiet", "--no-plot",
                     *[x for s in settings for x in ("--set", s)]]) == 0
    rec = asyncrl.Recording(tmp_path / "run")
    own = rec.replay(sampler=sync)
    assert trained(own.schedule) == trained(schedule(rec.trace))  # its own in_order: the same schedule
    assert own.fit["rule"].startswith("lockstep") and "multi-turn" in own.fit["rule"]
    other = rec.replay(sampler=FIFO)
    assert len(other.metrics) == 20
    assert (other.schedule.lag == 1).mean() > 0.5  # the asynchronous sampler trains one version behind
    served = other.controller.completions
    recorded = pd.read_json(tmp_path / "run" / "completions.jsonl", lines=True)
    assert served.turns.between(1, 3).all() and set(served.turns) <= set(recorded.turns)
    assert (served.turn_versions.map(len) == served.turns).all()
    assert other.drawn_fraction < 0.5


# --- free turns: an asynchronous sampler's trajectories go on as their environment answers -------------------------

SLOW = {"max_turns": 3, "env_latency_s": 0.2, "env_latency_tail": "pareto", "env_latency_alpha": 1.5,
        "env_latency_max_s": 5.0}  # a slow, long-tailed environment: its waits are the run's time
SYNC = {"name": "in_order", "max_lookahead_versions": 0}


class FixedTurns(SimulatedGenerator):
    """Every trajectory plays two one-token turns, each environment call takes 1 s."""

    def draw_turns(self, request, success):
        return [[1, 1] for _ in range(request.n)], [[1.0, 1.0] for _ in range(request.n)], [0.0] * request.n


def played(workers: int, free: bool = True) -> tuple[dict, list]:
    """Two groups of one trajectory on the simulated clock (decoding 0.1 s a turn): when each group finished and
    the turn events ``(time, group, turn)``, walking the generator's events as ``asyncrl.simulate`` does."""
    cfg = load_config("what_if", generation={"prefill_s": 0.0, "decode_s_per_token": 0.1, "concurrency": None,
                                             "turns": {"max_turns": 2, "env_latency_s": 1.0, "workers": workers}})
    gen = FixedTurns(cfg.model, cfg.generation, 0, SimpleNamespace(eos_token_id=0))
    gen.free_turns, gen.clock.stepping, gen.timed_updates = free, False, True
    turns = []
    gen.bind(lambda gid, i, turn, version, done: turns.append((round(gen.clock.now, 9), gid, turn)),
             lambda gid, turn: False, lambda gid, why: None)
    gen.submit([GenerationRequest(0, [1], 1), GenerationRequest(1, [1], 1)])
    finished = {}
    while (t := gen.next_event_time()) is not None:
        gen.clock.now = t
        finished.update({r.group_id: round(t, 9) for r in gen.poll()})
    return finished, turns


def test_free_turns_queue_calls_on_the_workers_as_worked_out_by_hand():
    # 2 workers: each group's calls have a worker of their own; each trajectory decodes (0.1 s), waits 1 s, again
    finished, turns = played(2)
    assert finished == {0: 2.2, 1: 2.2}
    assert turns == [(1.1, 0, 1), (1.1, 1, 1), (2.2, 0, 2), (2.2, 1, 2)]
    # 1 worker: both first calls arrive at 0.1, group 0's runs first (0.1-1.1), group 1's waits (1.1-2.1); group 0's
    # second turn decodes 1.1-1.2 and its call waits for the worker (2.1-3.1); group 1's decodes 2.1-2.2, calls 3.1-4.1
    finished, turns = played(1)
    assert finished == {0: 3.1, 1: 4.1}
    assert turns == [(1.1, 0, 1), (2.1, 1, 1), (3.1, 0, 2), (4.1, 1, 2)]
    # lockstep (a synchronous sampler's, or no workers): each group plays its turns on its own, as before
    assert played(1, free=False)[0] == played(0)[0] == {0: 2.2, 1: 2.2}


def steps_per_s(sampler: dict, workers: int, steps: int = 16) -> tuple[float, Simulation]:
    cfg = load_config("what_if", sampler=sampler, groups_per_step=4, group_size=4,
                      generation={"turns": {**SLOW, "workers": workers}, "prefill_s": 0.0, "decode_s_per_token": 0.001,
                                  "max_new_tokens": 16},
                      trainer={"train_s_per_token": 0.0, "train_s_per_step": 0.01, "sync_s": 0.0})
    sim = Simulation(Controller.from_config(cfg))
    m = sim.run(steps)
    return len(m) / float(m.step_time_s.sum()), sim


def test_free_turns_hide_a_slow_environment_as_far_as_the_workers_allow():
    sync = {w: steps_per_s(SYNC, w)[0] for w in (0, 4, 8)}
    assert sync[0] == sync[4] == sync[8]  # a synchronous sampler's turns stay lockstep, whatever the workers
    fast, sim = steps_per_s(FIFO, 8)
    # 8 workers: the two versions' groups the sampler keeps in flight (8) each have a worker and no trajectory
    # waits for its siblings' calls: most of the environment's wait is hidden
    assert fast / sync[8] >= 1.5
    # 4 workers: the same calls queue on half the workers, so the worker pool bounds the speed-up
    slow = steps_per_s(FIFO, 4)[0]
    assert fast / slow >= 1.2
    turns = sim.trace[sim.trace.event == "turn"]
    assert turns.sim_time_s.is_monotonic_increasing
    rows = sim.ctrl.completions
    assert (rows.turn_versions.map(len) == rows.turns).all()
    assert (rows.turn_versions.map(lambda v: len(set(v)) > 1)).any()  # trajectories span versions turn by turn


def test_free_turns_are_deterministic_and_stepped_ticks_stay_lockstep():
    a, b = (steps_per_s(FIFO, 4, steps=6)[1] for _ in range(2))
    pd.testing.assert_frame_equal(a.trace, b.trace)
    pd.testing.assert_frame_equal(a.metrics, b.metrics)

    def stepped(workers: int) -> pd.DataFrame:  # rollout ticks by hand: the lockstep poll of a stepped run
        ctrl = Controller.from_config(load_config("what_if", sampler=FIFO, generation={"turns": {**TURNS,
                                                                                                 "workers": workers}}))
        for _ in range(150):
            ctrl.rollout_tick()
            ctrl.train_tick()
        assert ctrl.trainer_version >= 2
        return ctrl.trace

    pd.testing.assert_frame_equal(stepped(0), stepped(8))


def test_free_turns_ask_the_sampler_at_each_trajectory_boundary_and_stop_the_group_there():
    windowed = {"name": "windowed", "max_staleness_versions": 2}
    ctrl = Controller.from_config(load_config("what_if", sampler=windowed,
                                              generation={"turns": {**TURNS, "workers": 4}}))
    asked: list[int] = []
    plain = ctrl.sampler.should_abort_inflight

    def should_abort_inflight(weight_version: int, T: int) -> bool:  # also stops every 7th group it is asked about
        asked.append(T)
        return plain(weight_version, T) or len(asked) % 7 == 0

    ctrl.sampler.should_abort_inflight = should_abort_inflight
    sim = Simulation(ctrl)
    sim.run(8)
    trace = sim.trace
    stopped = trace[(trace.event == "abort") & trace.reason.str.contains("stopped at a turn boundary")]
    assert len(stopped) > 0 and stopped.sim_time_s.notna().all()
    assert not set(trace[trace.event == "commit"].group_id.astype(int)) & set(stopped.group_id.astype(int))
    turns = trace[trace.event == "turn"]
    for gid, reason, when in zip(stopped.group_id.astype(int), stopped.reason, stopped.sim_time_s):
        mine = turns[turns.group_id == gid]
        assert (mine.sim_time_s <= when).all()  # no turn of it ended after it was stopped
        assert mine.detail.str.extract(r"turn (\d+)")[0].astype(int).max() == int(reason.rsplit("after turn ", 1)[1])
