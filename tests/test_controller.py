"""The controller: synchronous equivalence, determinism, staleness bounds, exactly-once accounting, permits,
running and stopping, evaluation, save/restore, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch
from examples.plain_grpo import plain_grpo

from asyncrl import Controller, load_config

SYNC = {"name": "in_order", "max_lookahead_versions": 0}


def weights(ctrl_or_policy) -> dict[str, torch.Tensor]:
    policy = getattr(ctrl_or_policy, "policy", ctrl_or_policy)
    return policy.export_weights()


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def accounting(ctrl: Controller) -> Counter:
    """How each dispatched group ended: select / evict / abort events, or still buffered / in flight."""
    trace = ctrl.trace
    dispatched = trace.loc[trace.event == "dispatch", "group_id"].astype(int).tolist()
    ends = trace[trace.event.isin(["select", "evict", "abort"])]
    count = Counter(ends.group_id.astype(int).tolist())
    for gid in dispatched:
        alive = int(gid in ctrl.buffer or gid in ctrl.inflight)
        assert count[gid] + alive == 1, f"group {gid}: {count[gid]} end events, alive={alive}"
    assert set(count) <= set(dispatched)
    return Counter(ends.event)


# --------------------------------------------------------------------------------------- synchronous GRPO
@pytest.mark.parametrize("mode", ["stepped", "run"])
def test_in_order_without_lookahead_is_synchronous_grpo_bit_for_bit(mode):
    cfg = load_config("quickstart", seed=3, sampler=SYNC)
    steps = 6
    ctrl = Controller.from_config(cfg)
    if mode == "stepped":
        while ctrl.trainer_version < steps:
            ctrl.tick()
    else:
        ctrl.run(steps, progress=False)
    policy, _, history = plain_grpo(cfg, steps)
    assert ctrl.trainer_version == steps
    assert_same_weights(weights(ctrl), weights(policy))
    assert ctrl.metrics.reward_mean.tolist() == [h["reward_mean"] for h in history]
    assert (ctrl.metrics.lag_max == 0).all()


def test_sync_mode_trains_each_batch_at_the_step_it_was_dispatched_for():
    ctrl = Controller.from_config(load_config("quickstart", sampler=SYNC))
    first = ctrl.rollout_tick()
    assert first.dispatched == list(range(8)) and first.committed == list(range(8))
    assert ctrl.rollout_tick().dispatched == []  # gate closed until the step is trained
    assert ctrl.last_report.note.startswith("no dispatch: buffer holds 8")  # capacity N(L+1) = 8
    report = ctrl.train_tick()
    assert report.selected == list(range(8)) and report.step_finished and ctrl.trainer_version == 1
    assert ctrl.generation_version == 1


# ------------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("sampler", [
    {"name": "weight_fifo", "max_staleness_versions": 1},
    {"name": "windowed", "max_staleness_versions": 1, "freshest_first": True},
])
def test_two_stepped_runs_with_one_seed_are_identical(sampler):
    def stepped():
        ctrl = Controller.from_config(load_config("quickstart", seed=5, sampler=sampler))
        pattern = ["rollout", "rollout", "train", "rollout", "train", "train", "rollout", "rollout", "train"] * 3
        for kind in pattern:
            getattr(ctrl, f"{kind}_tick")()
        return ctrl

    a, b = stepped(), stepped()
    assert a.trainer_version == b.trainer_version > 0
    assert a.trace.equals(b.trace)
    assert_same_weights(weights(a), weights(b))


# ------------------------------------------------------------------------------------ staleness and loss
@pytest.mark.parametrize("sampler,bound", [
    ({"name": "weight_fifo", "max_staleness_versions": 1}, 1),
    ({"name": "windowed", "max_staleness_versions": 1}, 1),
    ({"name": "in_order", "max_lookahead_versions": 2}, 2),
])
def test_async_run_respects_the_staleness_window_and_loses_nothing(sampler, bound):
    ctrl = Controller.from_config(load_config("quickstart", seed=1, sampler=sampler, eval_every=None))
    ctrl.run(12, progress=False)
    assert ctrl.trainer_version == 12
    selected = ctrl.trace[ctrl.trace.event == "select"]
    assert len(selected) == 12 * ctrl.cfg.groups_per_step
    assert selected.lag.max() <= bound
    assert (ctrl.metrics.lag_max <= bound).all()
    accounting(ctrl)


def test_windowed_evicts_and_aborts_stale_groups_with_reasons_and_loses_none():
    # Stepped: the rollout pump runs far ahead (windowed admission is always open), then training catches up.
    ctrl = Controller.from_config(load_config(
        "quickstart", sampler={"name": "windowed", "max_staleness_versions": 0}, max_buffered_groups=32,
        loss={"importance_correction": "none", "truncation": "none"},
    ))
    for _ in range(4):
        ctrl.rollout_tick()
    assert len(ctrl.buffer) == 32  # the permit: never more than max_buffered_groups
    assert ctrl.rollout_tick().dispatched == []
    ctrl.train_tick()  # trains 8 of the 32 at version 0; T = 1
    report = ctrl.train_tick()  # the other 24 are now stale
    assert len(report.evicted) == 24
    ends = accounting(ctrl)
    assert ends["evict"] == 24 and ends["select"] == 8
    evicts = ctrl.trace[ctrl.trace.event == "evict"]
    assert (evicts.reason.str.len() > 0).all()


@pytest.mark.parametrize("sampler, aborts", [
    ({"name": "windowed", "max_staleness_versions": 0}, True),
    ({"name": "weight_fifo", "max_staleness_versions": 1}, False),
    ({"name": "custom", "target": "tests.custom_sampler_fixture:Worded", "max_staleness_versions": 0}, True),
    ({"name": "custom", "target": "tests.custom_sampler_fixture:NewestFirstSampler"}, False),
], ids=["windowed", "weight_fifo", "custom-SamplerBase", "custom-plain"])
def test_the_traces_reasons_are_the_samplers_verdicts(sampler, aborts):
    """Each select, evict and abort row says what ``explain()`` said of that group just before the decision."""
    from asyncrl.buffer import ReplayBuffer
    from asyncrl.samplers import build_sampler

    cfg = load_config(
        "quickstart", sampler=sampler, max_buffered_groups=40, max_inflight_groups=16, eval_every=None,
        generation={"backend": "simulated", "prefill_s": 1.5}, trainer={"backend": "simulated"},
    )
    ctrl = Controller.from_config(cfg)
    checked = Counter()
    for _ in range(30):  # generation ahead of training: some groups go stale while ready, some while in flight
        for _ in range(3):
            ctrl.rollout_tick()
        said = dict(zip(ctrl.explain().group_id, ctrl.explain().reason))  # what the next train tick will do
        start = len(ctrl.trace)
        ctrl.train_tick()
        rows = ctrl.trace.iloc[start:]
        for row in rows[rows.event.isin(["select", "evict"])].itertuples():
            assert row.reason == said[row.group_id], (row.event, row.reason)
            checked[row.event] += 1
        for row in rows[rows.event == "abort"].itertuples():  # what a verdict says of a group of that version
            buffer = ReplayBuffer()
            buffer.commit(buffer.reserve(int(row.weight_version)), None)
            (verdict,) = build_sampler(cfg.sampler, buffer).explain(int(row.trainer_version))
            assert verdict.action == "evict" and row.reason == verdict.reason, row.reason
            checked["abort"] += 1
    assert checked["select"] > 0 and (checked["evict"] > 0 and checked["abort"] > 0) == aborts, checked
    if aborts:
        assert any(text.startswith("too stale: weight version") or text.startswith("worded drop")
                   for text in ctrl.trace.reason[ctrl.trace.event == "evict"])
    accounting(ctrl)


def test_buffer_and_inflight_permits_hold_with_slow_simulated_generation():
    cfg = load_config(
        "quickstart", sampler={"name": "windowed", "max_staleness_versions": 2}, max_buffered_groups=40,
        max_inflight_groups=16, generation={"backend": "simulated", "prefill_s": 2.5},
        trainer={"backend": "simulated"}, eval_every=None,
    )
    ctrl = Controller.from_config(cfg)
    seen_buffer, seen_inflight = 0, 0
    for _ in range(60):
        ctrl.tick()
        seen_buffer, seen_inflight = max(seen_buffer, len(ctrl.buffer)), max(seen_inflight, len(ctrl.inflight))
    assert seen_buffer <= 40 and seen_inflight <= 16
    ctrl.run(5, progress=False)
    accounting(ctrl)


def test_config_rejects_a_buffer_smaller_than_the_sampler_needs():
    with pytest.raises(ValueError, match="max_buffered_groups 15 .* 16"):
        load_config("quickstart", sampler={"name": "weight_fifo", "max_staleness_versions": 1},
                    max_buffered_groups=15)


@pytest.mark.parametrize("knob", ["min_groups_per_chunk", "max_groups_per_chunk"])
def test_config_rejects_a_chunk_larger_than_a_step(knob):
    with pytest.raises(ValueError, match=rf"{knob} 9 > groups_per_step 8: a chunk is part of one step"):
        load_config("quickstart", **{knob: 9})
    assert load_config("quickstart", **{knob: 8}).chunk_bounds == (8, 8)


def test_config_rejects_stale_sampler_without_importance_correction():
    with pytest.raises(ValueError, match="importance"):
        load_config("quickstart", sampler={"name": "weight_fifo"},
                    loss={"importance_correction": "none", "truncation": "none"})
    load_config("quickstart", sampler=SYNC, loss={"importance_correction": "none", "truncation": "none"})


# --------------------------------------------------------------------------------------- reading the run
def test_metrics_and_trace_columns():
    ctrl = Controller.from_config(load_config("quickstart", eval_every=2))
    ctrl.run(4, progress=False)
    m = ctrl.metrics
    for col in ["step", "reward_mean", "loss", "lag_mean", "lag_max", "groups_evicted", "step_time_s",
                "tokens_per_s", "eval_reward", "eval_accuracy"]:
        assert col in m.columns, col
    assert m.step.tolist() == [0, 1, 2, 3]
    assert m.eval_accuracy.notna().tolist() == [False, True, False, True]
    assert set(ctrl.trace.event) >= {"admit", "dispatch", "commit", "select", "train", "sync", "step"}
    state = ctrl.state()
    assert state.trainer_version == 4 and list(state.buffer.columns) == ["pending", "ready", "total", "spanning"]
    ev = ctrl.evaluate()
    assert 0.0 <= ev["accuracy"] <= 1.0 and "reward_mean" in ev


def test_the_readme_snippet_has_verdicts_to_explain():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    snippet = readme.split("## Step it, and read why", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(snippet[: snippet.index("ctrl.train_tick()")], namespace)  # up to its explain(), as a reader runs it
    verdicts = namespace["ctrl"].explain()
    assert verdicts.code.value_counts().to_dict() == {"selected": 8, "beyond_max_groups": 8}


def test_trace_ids_versions_steps_and_lags_are_nullable_integers():
    ctrl = Controller.from_config(load_config("quickstart", eval_every=None))
    ctrl.tick()
    trace = ctrl.trace
    assert {c: str(trace[c].dtype) for c in ("group_id", "weight_version", "target_step", "lag")} == dict.fromkeys(
        ("group_id", "weight_version", "target_step", "lag"), "Int64")
    select = trace[trace.event == "select"]
    assert select.group_id.tolist() == list(range(8)) and select.target_step.tolist() == [0] * 8
    assert trace[trace.event == "train"].group_id.isna().all()
    assert str(ctrl.explain().target_step.dtype) == "Int64"


def test_state_is_a_frozen_snapshot_and_verdicts_are_computed_only_when_asked(monkeypatch):
    import dataclasses

    from asyncrl.controller import ControllerState

    ctrl = Controller.from_config(load_config("quickstart", eval_every=None))
    ctrl.rollout_tick()
    explained = []
    original = ctrl.sampler.explain
    monkeypatch.setattr(ctrl.sampler, "explain", lambda *args: explained.append(args) or original(*args))
    state = ctrl.state()
    assert explained == []  # a snapshot costs no pass over the buffer
    assert isinstance(state, ControllerState)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.trainer_version = 5
    assert (state.sampler, state.window, state.lower_bound, state.capacity) == ("in_order", 1, 0, 16)
    assert state.buffer.ready.sum() == 8 and state.last_report.dispatched == list(range(8))
    assert len(ctrl.explain()) == 8 and explained == [(0, 8, 8)]  # this step's chunk bounds


def test_a_refused_admission_says_why_in_the_samplers_words_and_is_traced_once():
    ctrl = Controller.from_config(load_config(
        "quickstart", sampler={"name": "weight_fifo", "max_staleness_versions": 1}, max_buffered_groups=48,
        eval_every=None,
    ))
    ctrl.rollout_tick(), ctrl.rollout_tick()  # batches 0 and 1: one batch ahead of T = 0
    why = ("`weight_fifo` with max_staleness_versions=1 admits at most one batch ahead of T: "
           "batch 2 waits for T >= 1")
    for _ in range(3):  # a pump polling a shut gate
        report = ctrl.rollout_tick()
        assert report.dispatched == [] and report.note == f"gate closed: {why}"
    refused = ctrl.trace[ctrl.trace.event == "refuse"]
    assert refused.reason.tolist() == [why] and refused.detail.tolist() == ["batch 2"]
    admits = ctrl.trace[ctrl.trace.event == "admit"]
    assert admits.reason.iloc[1].endswith("batch 1 may go at T=0")
    ctrl.train_tick()  # T = 1: batch 2 is due
    assert len(ctrl.rollout_tick().dispatched) == 8
    ctrl.rollout_tick()
    assert ctrl.trace[ctrl.trace.event == "refuse"].detail.tolist() == ["batch 2", "batch 3"]


def test_a_running_pump_traces_each_refusal_once():
    ctrl = Controller.from_config(load_config(
        "quickstart", sampler={"name": "weight_fifo", "max_staleness_versions": 1}, max_buffered_groups=48,
        generation={"backend": "simulated", "prefill_s": 2.5}, trainer={"backend": "simulated"},
        eval_every=None,
    ))
    ctrl.run(8, progress=False)
    refused = ctrl.trace[ctrl.trace.event == "refuse"]
    assert refused.reason.is_unique and len(refused) <= 10  # at most once per batch, however often it polled


@pytest.mark.parametrize("target", ["my_sampler:NewestFirst", "tests.custom_sampler_fixture:NewestFirstSampler"])
def test_a_custom_sampler_runs_in_the_controller(target, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "notebooks"))
    ctrl = Controller.from_config(load_config("quickstart", sampler={"name": "custom", "target": target},
                                              eval_every=None))
    for _ in range(6):
        ctrl.tick()
    assert ctrl.trainer_version >= 3
    assert len(ctrl.explain()) == len(ctrl.buffer)
    state = ctrl.state()
    assert state.sampler == ctrl.sampler.name
    assert (state.window is None) == target.startswith("tests.")  # the fixture has no staleness window
    accounting(ctrl)


def test_run_stops_cleanly_when_the_data_runs_out():
    ctrl = Controller.from_config(load_config(
        "quickstart", max_epochs=1, sampler={"name": "weight_fifo", "max_staleness_versions": 1}, eval_every=None
    ))
    total = len(ctrl.task.train_prompts)
    ctrl.run(10_000, progress=False)
    assert ctrl.exhausted
    assert ctrl.trainer_version == total // ctrl.cfg.groups_per_step
    accounting(ctrl)


def test_run_rejects_bad_steps_and_changes_nothing():
    ctrl = Controller.from_config(load_config("quickstart"))
    for bad in (0, -1, 2.5, "3"):
        with pytest.raises(ValueError, match="steps"):
            ctrl.run(bad, progress=False)
    assert ctrl.trainer_version == 0 and len(ctrl.trace) == 0


def test_arun_from_a_running_event_loop():
    import asyncio

    async def main():
        ctrl = Controller.from_config(load_config("quickstart", eval_every=None))
        await ctrl.arun(3, progress=False)
        return ctrl.trainer_version

    assert asyncio.run(main()) == 3


# ---------------------------------------------------------------------------------------- save / restore
def test_save_and_restore_resume_exactly(tmp_path):
    sampler = {"name": "in_order", "max_lookahead_versions": 1}

    def fresh():
        return Controller.from_config(load_config("quickstart", seed=2, sampler=sampler, eval_every=None))

    straight = fresh()
    while straight.trainer_version < 6:
        straight.tick()

    first = fresh()
    while first.trainer_version < 3:
        first.tick()
    first.save(tmp_path / "ckpt")
    resumed = Controller.restore(tmp_path / "ckpt")
    assert resumed.trainer_version == 3 and len(resumed.buffer) == len(first.buffer)
    while resumed.trainer_version < 6:
        resumed.tick()
    assert_same_weights(weights(resumed), weights(straight))
    assert resumed.trace.equals(straight.trace)


def test_save_refuses_mid_step():
    ctrl = Controller.from_config(load_config("quickstart", min_groups_per_chunk=2, max_groups_per_chunk=2))
    ctrl.rollout_tick()
    ctrl.train_tick()
    with pytest.raises(RuntimeError, match="middle of step"):
        ctrl.save("unused")


# --------------------------------------------------------------------------------------------------- CLI
def test_cli_run_writes_metrics_trace_and_plot(tmp_path):
    out = tmp_path / "q"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--steps", "4", "--out", str(out), "--quiet",
         "--set", "sampler.name=weight_fifo"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4
    import pandas as pd

    assert len(pd.read_csv(out / "metrics.csv")) == 4
    assert (pd.read_csv(out / "trace.csv").event == "select").sum() == 32
    import csv

    rows = list(csv.DictReader((out / "trace.csv").open()))
    select = next(r for r in rows if r["event"] == "select")
    assert [select[c] for c in ("group_id", "weight_version", "lag")] == ["0", "0", "0"]  # not 0.0
    assert next(r for r in rows if r["event"] == "train")["group_id"] == ""
    assert (out / "config.yaml").exists() and (out / "reward.png").stat().st_size > 1000
