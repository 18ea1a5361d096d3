"""Faults are contained and recorded (asyncrl/faults.py): every scenario of the shared harness (tests/faults.py)
ends with each dispatched group ended exactly once or still live, permits held only by live groups, and a trace
that explains each fault; budgets that are spent stop the run with an error that says what and why."""

from __future__ import annotations

import pandas as pd
import pytest

from tests.faults import SCENARIOS, close, flaky_controller, run_scenario, small_config

PLAIN = [n for n, s in SCENARIOS.items() if s.kill is None]


@pytest.mark.parametrize("name", PLAIN)
def test_scenario_stepped(name):
    sc, result = SCENARIOS[name], run_scenario(name)
    try:
        if sc.error is None:
            assert result["error"] is None, result["error"]
            assert result["steps"] == sc.steps
        else:
            assert type(result["error"]).__name__ == sc.error, result["error"]
        assert result["inflight"] == 0
        if set(result["injected"]) - {"straggler"}:  # a straggler is slow, not an error
            assert result["faults"] > 0  # every injected failure that was caught shows in the trace
    finally:
        close(result)


@pytest.mark.parametrize("name", ["poll_errors", "lost_groups", "reward_raises", "stragglers", "submit_errors"])
def test_scenario_run_mode(name):
    result = run_scenario(name, mode="run")
    try:
        assert result["error"] is None, result["error"]
        assert result["steps"] == SCENARIOS[name].steps
        assert result["inflight"] == 0
    finally:
        close(result)


def test_retries_keep_stepping_deterministic():
    a, b = run_scenario("lost_groups", seed=3), run_scenario("lost_groups", seed=3)
    assert a["faults"] > 0
    assert a["ctrl"].trace.equals(b["ctrl"].trace)
    assert a["ctrl"].metrics.loss.tolist() == b["ctrl"].metrics.loss.tolist()


def test_faults_and_skips_say_what_and_why():
    result = run_scenario("lost_no_retry")
    trace = result["ctrl"].trace
    skips = trace[trace.event == "skip"]
    assert len(skips) > 0
    assert skips.reason.str.contains("max_dispatch_attempts").all()
    replaced = skips.detail.str.extract(r"replaced by group (\d+)")[0].dropna().astype(int)
    dispatches = trace[trace.event == "dispatch"].set_index("group_id")
    for old, new in zip(skips.group_id.astype(int), replaced):  # a replacement keeps the lost group's step
        assert dispatches.loc[new, "target_step"] == skips.set_index("group_id").loc[old, "target_step"]
        assert dispatches.loc[new, "reason"] == f"replaces group {old}"
    faults = trace[trace.event == "fault"]
    assert faults.detail.str.contains("InjectedError").any()


def test_a_replacement_is_dispatched_in_the_lost_groups_batch():
    trace = run_scenario("lost_no_retry")["ctrl"].trace
    skips = trace[trace.event == "skip"].set_index("group_id")
    dispatches = trace[trace.event == "dispatch"].set_index("group_id")
    replaced = skips.detail.str.extract(r"replaced by group (\d+)")[0].dropna().astype(int)
    assert len(replaced) > 0
    for old, new in replaced.items():  # its typed column says which batch it delivers for, as the lost one's did
        assert dispatches.loc[new, "dispatch_index"] == dispatches.loc[old, "dispatch_index"]
        assert not pd.isna(dispatches.loc[new, "dispatch_index"])


def test_spent_generation_budget_names_backend_budget_and_error_and_stepping_continues():
    result = run_scenario("budget_spent")
    message = str(result["error"])
    assert "torch, placement local" in message and "generation_retries=3" in message
    assert "injected poll failure" in message
    ctrl = result["ctrl"]  # healed and drained by the harness: stepping again finishes the steps
    ctrl.exhausted = False
    for _ in range(30):
        ctrl.tick()
    assert ctrl.trainer_version >= 3


def test_data_running_out_names_the_step_and_the_shortfall():
    message = str(run_scenario("data_runs_out")["error"])
    assert "step 0 cannot complete" in message or "step 1 cannot complete" in message
    assert "short by" in message and "exhausted" in message


def test_non_number_reward_is_a_clear_error():
    message = str(run_scenario("reward_not_a_number")["error"])
    assert "'yes' (str)" in message and "real number" in message


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_input_is_rejected_with_the_value_and_what_is_allowed():
    with pytest.raises(ValueError, match="group_size 1.*>= 2"):
        small_config(group_size=1)
    with pytest.raises(ValueError, match="max_position_embeddings 8"):
        flaky_controller(small_config(model={"max_position_embeddings": 8}, generation={"max_new_tokens": 4}))

    class Empty:
        name, train_prompts, eval_prompts = "empty", [], []

    from asyncrl import Controller
    from asyncrl.backends import build_backends

    cfg = small_config()
    with pytest.raises(ValueError, match="no training prompts"):
        Controller(cfg, Empty(), *build_backends(cfg))


# ------------------------------------------------------------------------------------------------- Ray actors
ray = pytest.importorskip("ray")


def test_killed_generator_actor_is_restarted_and_its_groups_redispatched(ray_cluster):
    result = run_scenario("generator_actor_killed")
    try:
        assert result["error"] is None, result["error"]
        assert result["steps"] == 6
        trace = result["ctrl"].trace
        restart = trace[(trace.event == "fault") & trace.reason.str.contains("restarted")]
        assert len(restart) == 1 and "trainer's weights 2" in restart.reason.iloc[0]
        assert result["ctrl"].generation_version == 6
    finally:
        close(result)


def test_killed_trainer_actor_stops_the_run_pointing_at_the_checkpoint(ray_cluster):
    result = run_scenario("trainer_actor_killed")
    try:
        message = str(result["error"])
        assert "trainer actor" in message and "died" in message and "--resume" in message
    finally:
        close(result)
