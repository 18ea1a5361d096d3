"""The run state has one owner (asyncrl/state.py): ``Controller.state_dict`` / ``load_state_dict`` continue a run
exactly, a checkpoint written by the format before them still loads, and observers get typed events through
``Controller.subscribe`` instead of reading the controller's privates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncrl import Controller, checkpoint, load_config
from asyncrl.trace import SELECT, STEP, TRACE_COLUMNS, StepEvent, TraceRow
from tests.faults import check_accounting, small_config

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
# Written by asyncrl on main 1eef95c (before state_dict): a tiny model, windowed W=1, two steps and a rollout
# tick ahead (two groups buffered ready). Its files are the checkpoint format this code must keep reading.
OLD_CHECKPOINT = Path(__file__).parent / "data" / "checkpoint_main_1eef95c"


def stepped(cfg, steps: int) -> Controller:
    ctrl = Controller.from_config(cfg)
    while ctrl.trainer_version < steps:
        ctrl.tick()
    return ctrl


def test_load_state_dict_continues_a_run_exactly():
    cfg = small_config(sampler=SYNC)
    a = stepped(cfg, 2)
    b = Controller.from_config(cfg)
    b.load_state_dict(a.state_dict())
    assert (b.trainer_version, b.data_position, len(b.metrics), len(b.trace)) == (
        a.trainer_version, a.data_position, len(a.metrics), len(a.trace))
    for ctrl in (a, b):
        while ctrl.trainer_version < 4:
            ctrl.tick()
    assert a.metrics.loss.tolist() == b.metrics.loss.tolist()
    assert a.trace.drop(columns="seq").equals(b.trace.drop(columns="seq"))


def test_state_dict_is_refused_in_the_middle_of_a_step():
    ctrl = stepped(small_config(sampler=SYNC, min_groups_per_chunk=2, max_groups_per_chunk=2), 1)
    ctrl.rollout_tick()
    ctrl.train_tick()  # half the step's groups trained
    with pytest.raises(RuntimeError, match="in the middle of step 1: 2 of 4 groups trained"):
        ctrl.state_dict()


def test_a_checkpoint_in_the_format_before_state_dict_still_loads(tmp_path):
    old = tmp_path / "old"
    shutil.copytree(OLD_CHECKPOINT, old)
    saved = json.loads((old / "state.json").read_text())
    ctrl = Controller.restore(old)
    assert ctrl.trainer_version == 2 and ctrl.data_position == 6 and len(ctrl.buffer) == 2
    assert ctrl.metrics.loss.tolist() == [row["loss"] for row in saved["metrics"]]
    rows = [list(row) for row in ctrl.trace.astype(object).where(ctrl.trace.notna(), None).itertuples(index=False)]
    assert [row[:9] for row in rows] == saved["trace"]  # the typed columns added since are empty
    assert all(value is None for row in rows for value in row[9:])
    again = ctrl.save(tmp_path / "again")  # written back, it is the same checkpoint
    assert (again / "state.json").read_text() == (old / "state.json").read_text()
    # meta.json: the old one's keys and values, and the digests of its files that every checkpoint now records
    meta = json.loads((again / "meta.json").read_text())
    assert checkpoint.digest_damage(again, meta) is None and set(meta.pop("digests")) == {"tensors.pt", "state.json"}
    assert meta == json.loads((old / "meta.json").read_text())
    # the same configuration; its dump also lists the keys added since, at their defaults
    assert load_config(again / "config.yaml") == load_config(old / "config.yaml")
    a, b = (torch.load(p / "tensors.pt", weights_only=True) for p in (old, again))
    assert all(torch.equal(a["policy"]["model"][k], v) for k, v in b["policy"]["model"].items())
    while ctrl.trainer_version < 4:
        ctrl.tick()
    check_accounting(ctrl)


# ------------------------------------------------------------------------------------------------ subscribe
def test_subscribers_get_typed_rows_and_step_events_in_trace_order():
    ctrl = Controller.from_config(small_config(sampler=SYNC))
    everything, selects = [], []
    ctrl.subscribe(everything.append)
    ctrl.subscribe(selects.append, events=[SELECT])
    while ctrl.trainer_version < 2:
        ctrl.tick()
    rows = [e.row if isinstance(e, StepEvent) else e for e in everything]
    assert all(isinstance(r, TraceRow) for r in rows)
    assert [r.seq for r in rows] == list(range(len(ctrl.trace)))  # each once, in order
    assert [list(r) for r in rows] == [list(r) for r in ctrl.trace.astype(object).where(ctrl.trace.notna(), None)
                                       .itertuples(index=False)]
    steps = [e for e in everything if isinstance(e, StepEvent)]
    assert [e.event for e in steps] == [STEP, STEP]
    assert [e.metrics["loss"] for e in steps] == ctrl.metrics.loss.tolist()
    assert selects and all(r.event == SELECT and r["event"] == SELECT for r in selects)
    assert list(TraceRow._fields) == TRACE_COLUMNS


def test_a_subscription_can_replay_history_and_be_cancelled():
    ctrl = stepped(small_config(sampler=SYNC), 1)
    seen = []
    sub = ctrl.subscribe(seen.append, events=STEP, history=True)
    assert len(seen) == 1 and seen[0].metrics["step"] == 0
    ctrl.tick()
    assert len(seen) == 2
    sub.cancel()
    ctrl.tick()
    assert len(seen) == 2


def test_subscribe_refuses_an_unknown_event_and_changes_nothing():
    ctrl = Controller.from_config(small_config(sampler=SYNC))
    with pytest.raises(ValueError, match="events must name trace events .*admit.*got \\['selct'\\]"):
        ctrl.subscribe(print, events=["selct"])
    ctrl.tick()  # no subscriber was left behind


def test_a_run_hands_on_step_the_typed_rows_since_the_last_step():
    ctrl = Controller.from_config(small_config(sampler=SYNC))
    calls = []
    ctrl.start(3, progress=False, on_step=lambda row, events: calls.append((row, events))).wait()
    assert [row["step"] for row, _ in calls] == [0, 1, 2]
    handed = [r for _, events in calls for r in events]
    assert all(isinstance(r, TraceRow) for r in handed)
    assert [r.seq for r in handed] == list(range(len(handed)))
    assert all(events[-1].event == STEP or STEP in [r.event for r in events] for _, events in calls)
