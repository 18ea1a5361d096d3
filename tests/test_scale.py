"""Scale-out on CPU: a data-parallel torch trainer (Ray rank actors over gloo) trains like one rank, and so does a
Megatron trainer with data_parallel 2 or tensor_parallel 2; generation replicas (Ray actors) all generate behind one
backend and the run learns, aborts reach the replica that holds the group, and save/restore with 2 ranks and 2
replicas resumes exactly. Actors ask half a CPU each, so two ranks and two replicas fit a 2-CPU Ray."""

from __future__ import annotations

import importlib.util

import pandas as pd
import pytest
import torch

from asyncrl import Controller, load_config
from asyncrl.backends.replicas import ReplicaFault
from asyncrl.data import GenerationRequest

ray = pytest.importorskip("ray")

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
HALF = {"ray_options": {"num_cpus": 0.5}}
RANKS = {"placement": "ray", "data_parallel": 2, **HALF}
REPLICAS = {"placement": "ray", "replicas": 2, **HALF}


def _steps(ctrl: Controller, steps: int) -> None:
    while ctrl.trainer_version < steps:
        ctrl.tick()


@pytest.fixture(scope="module")
def data_parallel(ray_session):
    """A one-rank and a two-rank controller after the same 6 synchronous steps (one in-process generator each).
    Shared: the comparison reads them, then the dead-rank test kills a rank of the two-rank one (it must come
    last), which saves starting two more rank actors."""
    ray_session()
    one = Controller.from_config(load_config("quickstart", seed=5, sampler=SYNC, eval_every=None))
    with Controller.from_config(load_config("quickstart", seed=5, sampler=SYNC, eval_every=None,
                                            trainer=RANKS)) as two:
        for ctrl in (one, two):
            _steps(ctrl, 6)
        yield one, two


@pytest.mark.slow
def test_two_data_parallel_ranks_train_like_one(ray_cluster, data_parallel):
    """Same rollouts (one in-process generator each), 6 synchronous steps: the 2-rank step is the 1-rank step up to
    float reassociation (each rank sums its share's gradients; the sums are all-reduced before the one division)."""
    one, two = data_parallel
    assert type(two.policy).__name__ == "RankGroupPolicy" and two.policy.world_size == 2
    a, b = one.metrics, two.metrics
    for column in ("loss", "grad_norm", "normaliser", "sequences", "reward_mean"):
        assert b[column].tolist() == pytest.approx(a[column].tolist(), rel=1e-4, abs=1e-7), column
    assert (b.sequences == 64).all()  # both ranks' shares counted once
    wa, wb = one.policy.export_weights(), two.policy.export_weights()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)
    # the ranks stay identical: rank 1 took the same optimizer steps as rank 0
    w1 = two.policy.ranks[1].export_weights()
    assert all(torch.equal(wb[k], w1[k]) for k in wb)
    assert one.trace.equals(two.trace)


def test_a_dead_trainer_rank_stops_the_run_naming_it(ray_cluster, data_parallel):
    """On the two-rank controller of the test above, after its 6 steps (a rank that dies after any finished step
    is the same fault; this one is shared to save starting two rank actors): it must run after that test."""
    from asyncrl.faults import TrainerFailed

    ctrl = data_parallel[1]
    done = ctrl.trainer_version
    _kill(ctrl.policy.ranks[1]._actor)
    with pytest.raises(TrainerFailed, match=r"trainer rank 1 of 2 \(data-parallel rank 1, tensor-parallel rank "
                                             r"0\) died during \w+.*restore the last checkpoint"):
        _steps(ctrl, done + 1)
    faults = ctrl.trace[ctrl.trace.event == "fault"]
    assert faults.reason.tolist() == [f"not retried: step {done} failed in the trainer"]
    assert "trainer rank 1 of 2" in faults.detail.iloc[0]
    assert ctrl.trainer_version == done
    with pytest.raises(TrainerFailed, match="trainer rank 1 of 2"):  # the group stays ended: no call hangs
        ctrl.policy.export_weights()
    survivor = ctrl.policy.ranks[0]._actor
    with pytest.raises(ray.exceptions.RayActorError):  # its collectives were broken: it was ended too
        ray.get(survivor.call_times.remote(), timeout=60)
    ctrl.policy.close()  # its placement group back now, not at the module's end: the next tests need every CPU


MEGATRON = {"backend": "megatron", "placement": "ray", **HALF}
MEGATRON_COLUMNS = ["loss", "grad_norm", "normaliser", "sequences", "reward_mean", "tokens", "is_weight_mean"]


def _megatron_run(steps: int = 3, save=None, **trainer) -> tuple[pd.DataFrame, dict, pd.DataFrame, list]:
    """3 synchronous steps of seed 5 (``save``: a checkpoint there after step 1, and the tensor-parallel ranks of
    the policy's state then)."""
    cfg = load_config("quickstart", seed=5, sampler=SYNC, eval_every=None, trainer={**MEGATRON, **trainer})
    with Controller.from_config(cfg) as ctrl:
        tp_ranks = None
        if save is not None:
            _steps(ctrl, 1)
            ctrl.save(save)
            tp_ranks = [s["tp_rank"] for s in ctrl.policy.state_dict()["tensor_parallel_states"]]
        _steps(ctrl, steps)
        return ctrl.metrics[MEGATRON_COLUMNS], ctrl.policy.export_weights(), ctrl.trace, tp_ranks


@pytest.fixture(scope="module")
def megatron(ray_session):
    if importlib.util.find_spec("megatron") is None:  # (not imported here: only the rank actors need it)
        pytest.skip("megatron-core is not installed (pip install 'asyncrl[megatron]')")
    ray_session()


@pytest.fixture(scope="module")
def megatron_one_rank(megatron):
    return _megatron_run()  # one Megatron actor: a world of one


@pytest.fixture(scope="module")
def megatron_tensor_parallel(megatron, tmp_path_factory):
    """The tensor_parallel 2 run, saved after step 1: both the like-one-rank comparison and the save/restore test
    read it (one run of two rank actors fewer). That the save in it changes nothing is then checked too: the run
    must still match the one-rank run."""
    ckpt = tmp_path_factory.mktemp("tp2") / "ckpt"
    return (*_megatron_run(save=ckpt, tensor_parallel=2), ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"data_parallel": 2}, {"tensor_parallel": 2}], ids=["dp2", "tp2"])
def test_megatron_ranks_train_like_one(ray_cluster, megatron_one_rank, layout, request):
    """Megatron ranks as Ray actors in one gloo group, 3 synchronous steps through the controller: each chunk's
    groups split over the 2 data-parallel ranks (gradients and step sums reduced before the one division), or one
    model split over 2 tensor-parallel ranks (weights exported once, gathered over them), train like one rank."""
    a, wa, trace_a, _ = megatron_one_rank
    if "tensor_parallel" in layout:
        b, wb, trace_b = request.getfixturevalue("megatron_tensor_parallel")[:3]
    else:
        b, wb, trace_b, _ = _megatron_run(**layout)
    for column in MEGATRON_COLUMNS:
        assert b[column].tolist() == pytest.approx(a[column].tolist(), rel=1e-4, abs=1e-7), column
    assert list(wb) == list(wa)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)
    assert trace_a.equals(trace_b)


@pytest.mark.slow
def test_megatron_tensor_parallel_save_and_restore_resumes_exactly(ray_cluster, megatron_tensor_parallel):
    """A checkpoint of a tensor_parallel 2 trainer holds each tensor-parallel rank's shard state; restoring it into
    the same layout resumes exactly (the run and its checkpoint after step 1: ``megatron_tensor_parallel``)."""
    expected_metrics, expected, _, tp_ranks, ckpt = megatron_tensor_parallel
    assert tp_ranks == [0, 1]
    with Controller.restore(ckpt) as restored:
        assert restored.policy.tensor_parallel == 2 and restored.trainer_version == 1
        _steps(restored, 3)
        weights = restored.policy.export_weights()
        assert all(torch.equal(weights[k], expected[k]) for k in expected)
        pd.testing.assert_frame_equal(restored.metrics[MEGATRON_COLUMNS], expected_metrics)


@pytest.mark.slow
def test_two_replicas_both_generate_and_the_run_learns(ray_cluster):
    cfg = load_config("quickstart", seed=0, eval_every=None, generation=REPLICAS, trainer={"lr": 1e-3})
    with Controller.from_config(cfg) as ctrl:
        before = ctrl.evaluate()["accuracy"]
        ctrl.run(120, progress=False)
        after = ctrl.evaluate()["accuracy"]
        m = ctrl.metrics
        # which replica returns what within one step depends on timing in a run; over the run each did a share
        total = m.tokens_replica_0.sum() + m.tokens_replica_1.sum()
        assert m.tokens_replica_0.sum() > total / 4 and m.tokens_replica_1.sum() > total / 4
        assert (m.busy_s_replica_0 > 0).any() and (m.busy_s_replica_1 > 0).any()
        commits = ctrl.trace[ctrl.trace.event == "commit"].reason
        assert commits.str.endswith("on replica 0").sum() > len(commits) / 4
        assert commits.str.endswith("on replica 1").sum() > len(commits) / 4
        bar = ctrl.task.constant_answer_accuracy
        assert after > max(before, bar), (before, after, bar)


@pytest.mark.slow
def test_aborts_reach_the_replica_that_holds_the_group(ray_cluster):
    with Controller.from_config(load_config("quickstart", eval_every=None, generation=REPLICAS)) as ctrl:
        replicas = ctrl.generator
        replicas.submit([GenerationRequest(gid, [1, 2, 3], 2) for gid in (100, 101, 102, 103)])
        owners = {gid: replicas.owner(gid) for gid in (100, 101, 102, 103)}
        assert owners == {100: 0, 101: 1, 102: 0, 103: 1}  # least loaded first: an idle set deals round-robin
        assert [r.num_inflight() for r in replicas.replicas] == [2, 2]
        assert sorted(replicas.abort([101, 103, 999])) == [101, 103]  # 999 is nobody's
        assert [r.num_inflight() for r in replicas.replicas] == [2, 0]
        assert "abort" not in replicas.replicas[0].call_times()  # only the owner was asked
        assert replicas.replicas[1].call_times()["abort"][1] == 1
        assert replicas.num_inflight() == 2 and replicas.owner(101) is None
        finished = replicas.poll()
        assert sorted(g.group_id for g in finished) == [100, 102] and {g.replica for g in finished} == {0}
        assert replicas.num_inflight() == 0
        # an abort that meets a dead owner: its group counts as cancelled, the owner's other group is re-submitted
        replicas.submit([GenerationRequest(gid, [1, 2, 3], 2) for gid in (200, 201, 202, 203)])
        _kill(replicas.replicas[1]._actor)
        assert sorted(replicas.abort([201, 202])) == [201, 202]
        with pytest.raises(ReplicaFault, match=r"replica 1 died during abort .*restarted .*\[203\] re-submitted to "
                                               r"replica 1"):
            replicas.poll()
        assert sorted((g.group_id, g.replica) for g in replicas.poll()) == [(200, 0), (203, 1)]
        assert replicas.num_inflight() == 0


def _kill(actor) -> None:
    """Kill a Ray actor the way a crash would and return once it is dead (``ray.kill`` does not wait)."""
    ray.kill(actor, no_restart=True)
    try:
        while True:
            ray.get(actor.call_times.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        return


def _events_after(trace: pd.DataFrame, row: int, event: str) -> pd.DataFrame:
    return trace.iloc[row + 1:][trace.iloc[row + 1:].event == event]


@pytest.mark.slow
def test_a_dead_replica_is_restarted_with_the_current_weights_and_loses_nothing(ray_cluster):
    from tests.faults import check_accounting

    with Controller.from_config(load_config("quickstart", seed=1, eval_every=None, sampler=SYNC,
                                            generation=REPLICAS)) as ctrl:
        replicas = ctrl.generator
        _steps(ctrl, 2)
        first = replicas.replicas[1].actor_id
        _kill(replicas.replicas[1]._actor)  # dies before the next batch is submitted to it
        _steps(ctrl, 3)
        while ctrl.buffer.num_ready < 8:
            ctrl.rollout_tick()  # step 3's batch is buffered
        _kill(replicas.replicas[0]._actor)  # dies before step 3's weights reach it
        ctrl.train_tick()
        _steps(ctrl, 5)
        assert replicas.replicas[1].actor_id != first and ctrl.trainer_version == 5
        trace = ctrl.trace
        faults = trace[trace.event == "fault"]
        assert len(faults) == 2, faults
        one, zero = faults.detail.tolist()
        assert one.startswith("ReplicaFault: generation replica 1 died during submit")
        assert "re-submitted to replica 1" in one
        assert "restarted with weights 2 (2 restart(s) left)" in one
        assert zero.startswith("ReplicaFault: generation replica 0 died during load_weights")
        assert "restarted with weights 4 (1 restart(s) left)" in zero
        assert faults.reason.str.startswith("retried: poll failure 1 of").all()
        assert replicas.version == 5
        commits = _events_after(trace, faults.index[-1], "commit").reason  # both replicas generate again
        assert commits.str.endswith("on replica 0").any() and commits.str.endswith("on replica 1").any()
        ends = check_accounting(ctrl)  # every dispatched group ended exactly once, or is live
        assert ends["select"] == 5 * 8 and not ends["skip"] and not ends["abort"]


@pytest.mark.slow
def test_a_dead_replica_past_the_restart_budget_is_retired_and_the_others_go_on(ray_cluster):
    from tests.faults import check_accounting

    cfg = load_config("quickstart", seed=1, eval_every=None, sampler=SYNC, generation=REPLICAS,
                      faults={"max_generator_restarts": 0})
    with Controller.from_config(cfg) as ctrl:
        _steps(ctrl, 1)
        _kill(ctrl.generator.replicas[0]._actor)
        _steps(ctrl, 3)
        trace = ctrl.trace
        faults = trace[trace.event == "fault"]
        assert len(faults) == 1 and "generation replica 0 died during submit" in faults.detail.iloc[0]
        assert "retired (faults.max_generator_restarts spent)" in faults.detail.iloc[0]
        assert "re-submitted to replica 1" in faults.detail.iloc[0]
        commits = _events_after(trace, faults.index[0], "commit").reason
        assert len(commits) == 16 and commits.str.endswith("on replica 1").all()
        assert ctrl.metrics.tokens_replica_0.iloc[-1] == 0 and ctrl.metrics.tokens_replica_1.iloc[-1] > 0
        check_accounting(ctrl)


@pytest.mark.slow
def test_save_and_restore_with_two_ranks_and_two_replicas(ray_cluster, tmp_path):
    cfg = load_config("quickstart", seed=3, sampler=SYNC, eval_every=None, trainer=RANKS, generation=REPLICAS)
    columns = ["step", "reward_mean", "loss", "grad_norm", "tokens_replica_0", "tokens_replica_1"]
    with Controller.from_config(cfg) as ctrl:
        _steps(ctrl, 1)
        ctrl.rollout_tick()  # the next batch buffered: explain, state and the dashboard see it as with one engine
        verdicts = ctrl.explain()
        assert len(verdicts) == 8 and ctrl.state().generation_version == 1
        assert sorted(verdicts.replica.tolist()) == [0] * 4 + [1] * 4  # which replica generated each group
        pytest.importorskip("ipywidgets")
        from widgets import Dashboard

        board = Dashboard(ctrl)
        board.refresh()
        assert "<th>replica</th>" in board.verdicts.table.value  # the dashboard's verdict table shows it
        _steps(ctrl, 2)
        ctrl.save(tmp_path / "ckpt")
        _steps(ctrl, 4)
        expected_weights, expected = ctrl.policy.export_weights(), ctrl.metrics[columns]
        expected_trace = ctrl.trace
    with Controller.restore(tmp_path / "ckpt") as restored:
        assert type(restored.policy).__name__ == "RankGroupPolicy"
        assert type(restored.generator).__name__ == "ReplicaSet"
        assert restored.trainer_version == 2 and restored.generation_version == 2
        _steps(restored, 4)
        weights = restored.policy.export_weights()
        assert all(torch.equal(weights[k], expected_weights[k]) for k in expected_weights)
        pd.testing.assert_frame_equal(restored.metrics[columns], expected)
        pd.testing.assert_frame_equal(restored.trace, expected_trace)


def test_scale_knobs_say_what_they_need():
    with pytest.raises(ValueError, match="generation.replicas 2 starts each replica in a Ray actor"):
        load_config("quickstart", generation={"replicas": 2})
    with pytest.raises(ValueError, match="trainer.data_parallel 2 starts each rank in a Ray actor"):
        load_config("quickstart", trainer={"data_parallel": 2})
    with pytest.raises(ValueError, match="tensor_parallel 2: the torch backend"):
        load_config("quickstart", trainer={"tensor_parallel": 2, "placement": "ray"})
    megatron = load_config("quickstart", trainer={"backend": "megatron", "placement": "ray", "data_parallel": 2,
                                                  "tensor_parallel": 2})
    assert (megatron.trainer.data_parallel, megatron.trainer.tensor_parallel) == (2, 2)
    with pytest.raises(ValueError, match="weight_sync 'collective' joins one policy actor"):
        load_config("quickstart", trainer={"backend": "megatron", "placement": "ray", "tensor_parallel": 2},
                    generation={"placement": "ray", "weight_sync": "collective"})
