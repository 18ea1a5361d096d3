"""Staleness as the tokens saw it and the training-inference gap, apart (issue 33): ``token_staleness_mean`` /
``_max``, ``spanning_fraction`` and the ``token_staleness/k`` histogram from the train pump; ``mismatch_kl`` and the
importance weight's two parts (``is_mismatch_*``, ``is_staleness_*``) from the loss, with the trainer's logprobs at
the sampling version from the weights the policy kept; in metrics.csv, recordings, TensorBoard, W&B and the
dashboard; carried by what-if runs and replays."""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest

import asyncrl
from asyncrl import Controller, cli, load_config
from asyncrl import metrics as M
from asyncrl.data import GroupRollouts
from asyncrl.metrics import Accumulator
from asyncrl.simulate import Simulation, simulate
from asyncrl.trace import COMMIT, SELECT

NEW = [M.TOKEN_STALENESS_MEAN.name, M.TOKEN_STALENESS_MAX.name, M.SPANNING_FRACTION.name,
       *[m.name for m in M.TOKEN_STALENESS_SHARES], M.MISMATCH_KL.name, M.IS_MISMATCH_MEAN.name,
       M.IS_MISMATCH_MAX.name, M.IS_STALENESS_MEAN.name, M.IS_STALENESS_MAX.name]
CPU = {"eval_every": None, "torch_threads": 1, "generation": {"max_new_tokens": 4}}


def reduce(contributions: dict, tokens: int, completions: int) -> dict:
    acc = Accumulator(M.STEP_METRICS)
    acc.add({**contributions, "completion_tokens": tokens, "completions": completions})
    return acc.result()


def test_token_staleness_of_a_hand_made_chunk():
    # T = 5. The first completion's tokens were sampled by versions 3, 3, 4, 4 (weights loaded under it), the
    # second's by 4: staleness 2, 2, 1, 1, 1 -> mean 7 / 5 = 1.4, max 2, one of two completions spans versions.
    # The group's lag (by its oldest version, what lag_mean counts) is 2.
    group = GroupRollouts(0, [1], [[7, 7, 7, 7], [7]], [[-1.0] * 4, [-1.0]], 3, 4, token_versions=[[3, 3, 4, 4], [4]])
    out = reduce(M.token_staleness([group], 5), tokens=5, completions=2)
    assert out["token_staleness_mean"] == pytest.approx(1.4) and out["token_staleness_max"] == 2
    assert out["spanning_fraction"] == 0.5
    assert [out[f"token_staleness/{k}"] for k in range(4)] == pytest.approx([0, 0.6, 0.4, 0])
    assert out["token_staleness/4+"] == 0
    # one version, as a generator that does not span says it: every token the group's, staleness = its lag
    plain = dataclasses.replace(group, gen_end_version=3, token_versions=None)
    out = reduce(M.token_staleness([plain], 5), tokens=5, completions=2)
    assert out["token_staleness_mean"] == 2 and out["spanning_fraction"] == 0
    # spanning without saying where: upper bounds (the oldest version, every completion spanning)
    unsaid = dataclasses.replace(group, token_versions=None)
    out = reduce(M.token_staleness([unsaid], 7), tokens=5, completions=2)
    assert out["token_staleness_mean"] == 4 and out["spanning_fraction"] == 1 and out["token_staleness/4+"] == 1


def test_token_staleness_equals_the_group_lag_when_no_completion_spans_versions():
    # in_order L=1 on the CPU engines: every group of a step has one lag, and one version made all its tokens
    ctrl = Controller.from_config(load_config("quickstart", **CPU))
    for _ in range(5):
        ctrl.tick()
    ctrl.run(4, progress=False)  # and threaded
    m = ctrl.metrics
    assert m.token_staleness_mean.tolist() == m.lag_mean.tolist() == [0.0] + [1.0] * 8
    assert m.token_staleness_max.tolist() == m.lag_max.tolist()
    assert (m.spanning_fraction == 0).all() and (m["token_staleness/1"].iloc[1:] == 1).all()
    # ready_first W=2 mixes lags within a step (the simulated engines, groups of long-tailed lengths finishing out of
    # order, drained weight loads: one version a group): token-weighted, the mean is each group's lag weighted by
    # its tokens, the lag by the version that generated it (a group queued past a weight load starts on newer weights
    # than it was stamped with, never older: lag_max, by the stamp, bounds it)
    ctrl = Controller.from_config(load_config("what_if", sampler={"name": "ready_first", "max_staleness_versions": 2},
                                              generation={"weight_update": "drain", "lengths": "lognormal"}))
    tokens = {}
    ctrl.subscribe(lambda row: tokens.update({row.group_id: ctrl.buffer[row.group_id].rollouts.num_tokens}),
                   events=[COMMIT])
    Simulation(ctrl).run(20)  # one thread: each commit's group is still in the buffer when it is heard of
    trace, m = ctrl.trace, ctrl.metrics
    made = trace[trace.event == COMMIT].set_index("group_id").gen_start_version
    assert (m.spanning_fraction == 0).all()
    mixed = 0
    for step, rows in trace[trace.event == SELECT].groupby("trainer_version"):
        if step >= len(m):
            continue
        n, lags = [tokens[g] for g in rows.group_id], [step - made[g] for g in rows.group_id]
        assert m.token_staleness_mean.iloc[step] == pytest.approx(sum(k * lag for k, lag in zip(n, lags)) / sum(n))
        assert m.token_staleness_max.iloc[step] == max(lags) <= m.lag_max.iloc[step]
        mixed += len(set(lags)) > 1
    assert mixed >= 3
    assert (m.lag_max > m.lag_mean).any()  # lags were mixed in some step


def test_token_staleness_differs_from_the_lag_when_completions_span_versions():
    # the simulated engines on the virtual clock, weights loaded under running groups (inflight)
    ctrl = Controller.from_config(load_config("what_if", sampler={"name": "weight_fifo", "max_staleness_versions": 1}))
    versions = {}
    ctrl.subscribe(lambda row: versions.update({row.group_id: ctrl.buffer[row.group_id].rollouts.versions()}),
                   events=[COMMIT])
    Simulation(ctrl).run(12)
    m, selected = ctrl.metrics, ctrl.trace[ctrl.trace.event == SELECT]
    spans = 0
    for step, rows in selected.groupby("trainer_version"):
        if step >= len(m):
            continue
        tokens = [step - v for g in rows.group_id for completion in versions[g] for v in completion]
        completions = [c for g in rows.group_id for c in versions[g]]
        assert m.token_staleness_mean.iloc[step] == pytest.approx(sum(tokens) / len(tokens))
        assert m.token_staleness_max.iloc[step] == max(tokens)
        assert m.spanning_fraction.iloc[step] == pytest.approx(
            sum(len(set(c)) > 1 for c in completions) / len(completions))
        spans += m.spanning_fraction.iloc[step] > 0
        if m.spanning_fraction.iloc[step] > 0:  # a spanning completion's later tokens are fresher than its group
            assert m.token_staleness_mean.iloc[step] < m.lag_mean.iloc[step]
    assert spans >= 2


def test_mismatch_kl_is_zero_for_the_torch_engines_and_the_weight_splits_into_its_two_parts():
    # in_order L=1: from step 1 on, lag 1; every completion read (the default reads one a group)
    ctrl = Controller.from_config(load_config("quickstart", **CPU, loss={"gap_completions": None}))
    for _ in range(6):
        ctrl.tick()
    m = ctrl.metrics
    # the torch generator and the torch trainer compute the same weights' logprobs: no mismatch but float noise
    assert (m.mismatch_kl.abs() < 1e-6).all()
    assert (m.is_mismatch_mean - 1).abs().max() < 1e-5 and (m.is_mismatch_max < 1 + 1e-4).all()
    # every stale token's weights were kept: all tokens counted; the importance weight is its staleness part
    assert (m.gap_tokens == m.completion_tokens).all()
    assert m.is_staleness_mean.tolist() == pytest.approx(m.is_weight_mean.tolist(), rel=1e-5)
    assert (m.is_staleness_max.iloc[1:] > 1 + 1e-3).all()  # the weights moved since: the staleness part is not 1
    assert m.is_staleness_mean.iloc[0] == pytest.approx(1.0, abs=1e-6)  # step 0 trained fresh data
    assert ctrl.policy.kept_bytes() > 0 and len(ctrl.policy._kept) <= 2


def test_by_default_the_gap_reads_one_completion_a_group():
    ctrl = Controller.from_config(load_config("quickstart", **CPU))
    for _ in range(3):
        ctrl.tick()
    m = ctrl.metrics
    G, N = ctrl.cfg.group_size, ctrl.cfg.groups_per_step
    assert m.gap_tokens.iloc[0] == m.completion_tokens.iloc[0]  # fresh tokens cost nothing: all of them
    stale_rows = [row for step in (1, 2) for row in ctrl.trace[(ctrl.trace.event == "select")
                                                                 & (ctrl.trace.trainer_version == step)].itertuples()]
    assert len(stale_rows) == 2 * N
    assert (m.gap_tokens.iloc[1:] < m.completion_tokens.iloc[1:] / G * 2).all()  # one completion of G a group
    assert (m.gap_tokens.iloc[1:] > 0).all() and (m.mismatch_kl.iloc[1:].abs() < 1e-6).all()


def test_without_kept_weights_only_the_fresh_tokens_are_measured():
    ctrl = Controller.from_config(load_config("quickstart", **CPU, loss={"gap_metrics": False}))
    for _ in range(3):
        ctrl.tick()
    m = ctrl.metrics
    assert m.gap_tokens.tolist() == [m.completion_tokens.iloc[0], 0.0, 0.0]  # stale tokens: nothing to compare with
    assert math.isnan(m.mismatch_kl.iloc[1]) and m.mismatch_kl.iloc[0] < 1e-6
    assert ctrl.policy.kept_bytes() == 0  # no copy kept, no extra pass
    assert m.token_staleness_mean.tolist() == [0.0, 1.0, 1.0]  # token staleness needs no weights: still there


def test_every_new_metric_reaches_metrics_csv_a_recording_tensorboard_and_wandb(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = types.SimpleNamespace(name="wandb")
    fake.init = lambda **kw: types.SimpleNamespace(log=lambda data, step: calls.append(data), finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    assert cli.main(["run", "quickstart", "--steps", "3", "--out", str(out), "--quiet", "--no-plot",
                     "--tensorboard", str(tmp_path / "tb"), "--wandb", "asyncrl",
                     "--set", "tracking.wandb_mode=offline", "--set", "eval_every=null", "--set", "torch_threads=1"]) == 0
    rec = asyncrl.Recording(out)
    assert set(NEW) <= set(rec.metrics.columns) and set(NEW) <= set(rec.at(2).metrics.columns)
    assert rec.metrics.token_staleness_mean.iloc[1:].tolist() == rec.metrics.lag_mean.iloc[1:].tolist()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for name in NEW:
        assert [e.step for e in events.Scalars(name)] == [0, 1, 2], name
    assert all(set(NEW) <= set(row) for row in calls) and len(calls) == 3


def test_the_dashboard_shows_token_staleness_and_the_gap():
    widgets = pytest.importorskip("widgets")
    from asyncrl import plots

    ctrl = Controller.from_config(load_config("what_if", sampler={"name": "windowed", "max_staleness_versions": 2}))
    for _ in range(12):
        ctrl.tick()
    board = widgets.Dashboard(ctrl)
    assert bytes(board.metrics.staleness.value).startswith(b"\x89PNG")
    fig = plots.staleness_figure(ctrl)
    staleness, gap, kl = fig.axes
    assert (staleness.get_title(), gap.get_title()) == ("token staleness, by step", "the training-inference gap, apart")
    assert len(staleness.collections) == len(M.TOKEN_STALENESS_SHARES)  # one band per staleness
    assert [line.get_label() for line in gap.lines] == ["staleness part", "mismatch part"]
    empty = plots.staleness_figure(Controller.from_config(load_config("what_if")))  # no step yet: no crash
    assert "no steps yet" in [t.get_text() for t in empty.axes[0].texts]


def test_what_if_runs_and_replays_carry_the_new_metrics(tmp_path):
    # the simulated engines: no mismatch (one engine), the staleness part exp(-DRIFT * lag) (their logprobs' drift)
    from asyncrl.backends.simulated import DRIFT

    sim = simulate("what_if", 8, sampler={"name": "in_order", "max_lookahead_versions": 1},
                   generation={"weight_update": "drain"})
    m = sim.metrics
    assert set(NEW) <= set(m.columns)
    assert (m.mismatch_kl == 0).all() and (m.is_mismatch_mean == 1).all()
    assert m.is_staleness_mean.iloc[1:].tolist() == pytest.approx([math.exp(-DRIFT)] * 7)
    assert m.token_staleness_mean.tolist() == m.lag_mean.tolist()
    ctrl = Controller.from_config(load_config("what_if"))
    rec = asyncrl.Recording(ctrl)
    for _ in range(10):
        ctrl.tick()
    replayed = rec.replay(sampler={"name": "windowed", "max_staleness_versions": 1})
    assert set(NEW) <= set(replayed.metrics.columns) and replayed.metrics.token_staleness_mean.notna().all()
