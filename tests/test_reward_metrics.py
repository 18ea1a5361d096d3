"""Per-function reward metrics (``reward/<name>``): defined over the groups a step trained, as ``reward_mean`` is
(never NaN when a step trained groups the function applied to, whichever step generated them), and carried with the
groups a checkpoint restores, so a resumed run's columns are the uninterrupted run's."""

from __future__ import annotations

import pandas as pd
import pytest

from asyncrl import Controller
from tests.faults import small_config

F = "tests.reward_functions:"
NAMES = ("first_char", "length")
COLUMNS = [f"reward/{name}" for name in NAMES]
ASYNC = {"in_order-L1": {"name": "in_order", "max_lookahead_versions": 1},
         "weight_fifo-W1": {"name": "weight_fifo", "max_staleness_versions": 1}}


def config(sampler: dict):
    return small_config(sampler=sampler, reward={"funcs": [F + name for name in NAMES], "weights": [1.0, 0.1]})


def stepped(ctrl: Controller, steps: int) -> Controller:
    while ctrl.trainer_version < steps:
        ctrl.tick()
    return ctrl


def assert_trained_means(trace: pd.DataFrame, completions: pd.DataFrame, metrics: pd.DataFrame) -> None:
    """Each step's ``reward/<name>`` is the mean of the function's values (the completions log's columns) over the
    completions of the groups the step selected, as ``reward_mean`` is of the rewards; none is NaN."""
    for step, ids in trace[trace.event == "select"].groupby("trainer_version").group_id:
        trained = completions[completions.group_id.isin(ids)]
        assert len(trained) == metrics.completions[step]
        for column in COLUMNS:
            assert metrics[column][step] == pytest.approx(trained[column].mean(), rel=1e-12, abs=1e-12), (step, column)
        assert metrics.reward_mean[step] == pytest.approx(trained.reward.mean(), rel=1e-12)
    assert metrics[COLUMNS].notna().all().all()


@pytest.mark.parametrize("sampler", list(ASYNC.values()), ids=list(ASYNC))
def test_reward_per_function_is_the_mean_over_the_groups_the_step_trained(sampler):
    with Controller.from_config(config(sampler)) as ctrl:
        stepped(ctrl, 5)
        trace = ctrl.trace
        commits = trace[trace.event == "commit"].set_index("group_id").trainer_version
        selects = trace[trace.event == "select"]
        # what the test is about: steps that trained groups committed (generated) during an earlier step
        assert (selects.trainer_version.to_numpy() > commits.loc[selects.group_id].to_numpy()).any()
        assert_trained_means(trace, ctrl.completions, ctrl.metrics)


@pytest.mark.parametrize("sampler", list(ASYNC.values()), ids=list(ASYNC))
def test_a_restored_run_has_the_uninterrupted_reward_per_function(tmp_path, sampler):
    cfg = config(sampler)
    with Controller.from_config(cfg) as straight:
        want, completions = stepped(straight, 5).metrics, straight.completions
    with Controller.from_config(cfg) as first:
        path = stepped(first, 2).save(tmp_path / "ckpt")
    with Controller.restore(path, config=cfg) as resumed:
        got = stepped(resumed, 5).metrics
        # the groups trained after the restore carried their values through it (the completions logged before the
        # save are in the straight run's log)
        assert_trained_means(resumed.trace, completions, got)
    pd.testing.assert_frame_equal(got[COLUMNS + ["reward_mean", "loss"]], want[COLUMNS + ["reward_mean", "loss"]])
