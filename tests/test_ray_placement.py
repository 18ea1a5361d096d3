"""Placement is configuration: the same run with both backends in Ray actors (two actors standing in for two
devices) gives the same weights as in-process, and a concurrent run through actors works."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from asyncrl import Controller, load_config

ray = pytest.importorskip("ray")


def test_backends_in_ray_actors_match_in_process_bit_for_bit(ray_cluster):
    sampler = {"name": "in_order", "max_lookahead_versions": 0}
    local = Controller.from_config(load_config("quickstart", seed=4, sampler=sampler, eval_every=None))
    remote = Controller.from_config(load_config(
        "quickstart", seed=4, sampler=sampler, eval_every=None,
        trainer={"placement": "ray"}, generation={"placement": "ray"},
    ))
    assert type(remote.policy).__name__ == "RemoteTorchPolicy" and type(remote.generator).__name__ == "RemoteTorchGenerator"
    for ctrl in (local, remote):
        while ctrl.trainer_version < 4:
            ctrl.tick()
    a, b = local.policy.export_weights(), remote.policy.export_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert local.trace.equals(remote.trace)
    assert remote.generation_version == 4
    remote.close()  # frees the actors' CPUs for the next test


def test_pipelined_training_calls_return_at_once_and_their_error_comes_with_the_next_call(ray_cluster):
    """``begin_train_step``/``train_microbatches`` through the proxy do not wait for the actor (the bit-for-bit test
    above shows they train the same); a failure among them is raised by the proxy's next call, then it is spent."""
    from asyncrl.backends.hf import load_tokenizer
    from asyncrl.backends.ray import remote
    from asyncrl.backends.torch import TorchPolicy
    from asyncrl.algorithms import GRPOLoss

    cfg = load_config("quickstart", trainer={"placement": "ray"})
    policy = remote(TorchPolicy, (cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, load_tokenizer(cfg.model)),
                    cfg.trainer)
    try:
        assert policy.train_microbatches(None) is None  # before begin_train_step: fails in the actor, later
        with pytest.raises(RuntimeError, match="train_microbatches before begin_train_step"):
            policy.export_weights()
        assert policy.begin_train_step() is None
        assert policy.export_weights()  # the failure was raised once; the next call is answered as usual
    finally:
        policy.close()


@pytest.mark.slow
def test_async_run_through_ray_actors(ray_cluster):
    ctrl = Controller.from_config(load_config(
        "quickstart", sampler={"name": "weight_fifo", "max_staleness_versions": 1}, eval_every=3,
        trainer={"placement": "ray"}, generation={"placement": "ray"},
    ))
    with ctrl:
        ctrl.run(6, progress=False)
    assert ctrl.trainer_version == 6
    assert ctrl.metrics.lag_max.max() <= 1
    assert ctrl.metrics.eval_accuracy.notna().sum() == 2


@pytest.mark.slow
def test_the_proxy_has_exactly_the_backends_methods(ray_cluster):
    from asyncrl.backends.base import GenerationBackend, PolicyBackend

    ctrl = Controller.from_config(load_config(
        "quickstart", trainer={"backend": "simulated", "placement": "ray"},
        generation={"backend": "simulated", "placement": "ray"},
    ))
    with ctrl:
        policy, generator = ctrl.policy, ctrl.generator
        assert isinstance(policy, PolicyBackend) and isinstance(generator, GenerationBackend)
        assert not isinstance(policy, GenerationBackend)  # a policy has no submit, poll, version property, ...
        assert not hasattr(policy, "version") and hasattr(generator, "version")
        assert hasattr(policy, "export_weights") and not hasattr(generator, "export_weights")
        with pytest.raises(AttributeError):
            generator.no_such_method()
        assert not hasattr(policy, "model")  # instance attributes are not part of the contract
        assert generator.version == 0 and generator.num_inflight() == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "simulated"])
def test_save_and_restore_with_backends_in_ray_actors(ray_cluster, tmp_path, backend):
    """Policy and generator each in an actor of their own: save between steps, restore into fresh actors, and
    the restored run continues exactly as the uninterrupted one."""
    cfg = dict(eval_every=None, trainer={"backend": backend, "placement": "ray"},
               generation={"backend": backend, "placement": "ray"})
    columns = ["step", "reward_mean", "loss", "lag_mean", "tokens"]
    with Controller.from_config(load_config("quickstart", seed=3, **cfg)) as ctrl:
        while ctrl.trainer_version < 2:
            ctrl.tick()
        ctrl.save(tmp_path / "ckpt")
        while ctrl.trainer_version < 4:
            ctrl.tick()
        expected_weights, expected = ctrl.policy.export_weights(), ctrl.metrics[columns]
        expected_trace = ctrl.trace
    with Controller.restore(tmp_path / "ckpt") as restored:
        assert type(restored.generator).__name__ == f"Remote{'Torch' if backend == 'torch' else 'Simulated'}Generator"
        assert restored.trainer_version == 2 and restored.generation_version == 2
        while restored.trainer_version < 4:
            restored.tick()
        weights = restored.policy.export_weights()
        assert all(torch.equal(weights[k], expected_weights[k]) for k in expected_weights)
        pd.testing.assert_frame_equal(restored.metrics[columns], expected)
        pd.testing.assert_frame_equal(restored.trace, expected_trace)


def test_a_proxy_a_rank_group_and_a_replica_set_declare_what_they_wrap_and_a_bad_declaration_is_an_error():
    """What a backend may do beyond its Protocol is declared (``Capabilities``) and read without a call or an actor:
    a proxy answers its hosted class's declaration and is one actor; a rank group of a policy that takes its
    ``prev_logprobs`` from its forward does too, and is no actor; a replica set has per-replica step metrics."""
    from dataclasses import replace
    from types import SimpleNamespace

    from asyncrl.backends.base import Capabilities, capabilities, is_dead_actor
    from asyncrl.backends.ranks import RankGroupPolicy
    from asyncrl.backends.ray import proxy_class
    from asyncrl.backends.replicas import ReplicaSet
    from asyncrl.backends.simulated import SimulatedPolicy
    from asyncrl.backends.torch import TorchGenerator, TorchPolicy
    from asyncrl.backends.vllm import VLLMGenerator

    assert capabilities(TorchPolicy).prev_logprobs_from_forward and not capabilities(TorchPolicy).actor
    assert capabilities(VLLMGenerator).stages_weights
    assert capabilities(TorchGenerator) == Capabilities(sampled_evaluation=True)
    for cls in (TorchPolicy, TorchGenerator, VLLMGenerator, SimulatedPolicy):
        assert capabilities(proxy_class(cls)) == replace(capabilities(cls), actor=True), cls
    torch_ranks = RankGroupPolicy(SimpleNamespace(actors=[proxy_class(TorchPolicy)(None)] * 2))
    simulated_ranks = RankGroupPolicy(SimpleNamespace(actors=[proxy_class(SimulatedPolicy)(None)]))
    assert capabilities(torch_ranks) == Capabilities(prev_logprobs_from_forward=True, keeps_versions=True)
    assert capabilities(simulated_ranks) == Capabilities(keeps_versions=True)  # the ranks keep earlier weights
    assert capabilities(RankGroupPolicy) == Capabilities()
    assert capabilities(ReplicaSet) == Capabilities(step_metrics=True)
    assert not is_dead_actor(ray.exceptions.RayActorError(), torch_ranks)  # a group of actors is not one

    class Undeclared(TorchGenerator):
        prev_logprobs_from_forward = True  # how a backend said so before the declaration

    class Missing(TorchGenerator):
        capabilities = Capabilities(step_metrics=True)

    class NotCapabilities(TorchGenerator):
        capabilities = {"step_metrics": True}

    with pytest.raises(TypeError, match=r"Undeclared sets prev_logprobs_from_forward = True; declare it instead"):
        capabilities(Undeclared)
    with pytest.raises(TypeError, match=r"Missing declares Capabilities\(step_metrics=True\) but has no step_metrics"):
        proxy_class(Missing)
    with pytest.raises(TypeError, match=r"NotCapabilities.capabilities is \{'step_metrics': True\}"):
        capabilities(NotCapabilities)
