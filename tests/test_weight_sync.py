"""Weight sync straight between the two actors (``generation.weight_sync: collective``): two Ray actors with the torch
backend over gloo stand in for two GPUs over NCCL. The weights never pass through the driver, a synchronous run
matches the in-process one bit for bit, an asynchronous run keeps its lag bound, and bad configs are rejected."""

from __future__ import annotations

import pytest
import torch

from asyncrl import Controller, load_config

ray = pytest.importorskip("ray")

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
ACTORS = {"trainer": {"placement": "ray"}, "generation": {"placement": "ray", "weight_sync": "collective"}}


@pytest.mark.slow
def test_collective_sync_matches_in_process_and_bypasses_the_driver(ray_cluster, monkeypatch):
    import asyncrl.backends.ray as placement

    driver_calls: list[str] = []  # every backend method the controller calls through a proxy
    make_method = placement._remote_method

    def recording(name, doc, *flags):
        call = make_method(name, doc, *flags)
        return lambda self, *args, **kwargs: driver_calls.append(name) or call(self, *args, **kwargs)

    monkeypatch.setattr(placement, "_remote_method", recording)

    local = Controller.from_config(load_config("quickstart", seed=4, sampler=SYNC, eval_every=None))
    with Controller.from_config(load_config("quickstart", seed=4, sampler=SYNC, eval_every=None, **ACTORS)) as remote:
        assert remote.sync_weights.mode == "collective" and remote.sync_weights.backend == "gloo"
        for ctrl in (local, remote):
            while ctrl.trainer_version < 4:
                ctrl.tick()
        # the driver never asked for or handed over weights; the weights went over the group, 5 times (0..4)
        assert "poll" in driver_calls
        assert "export_weights" not in driver_calls and "load_weights" not in driver_calls
        a = local.policy.export_weights()
        assert remote.sync_weights.syncs == 5
        assert remote.sync_weights.bytes_sent == 5 * sum(t.numel() * t.element_size() for t in a.values())
        assert local.trace.equals(remote.trace)
        assert remote.generation_version == 4
        b = remote.policy.export_weights()
        g = remote.generator.state_dict()["weights"]  # what the generator actor received and loaded
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], g[k]) for k in a)
        times = remote.generator.call_times()
        assert times["_receive"][1] == 5 and "load_weights" not in times  # loaded inside _receive, in the actor


def _break_export(host):  # runs in the policy actor: the next export gains a tensor the receiver does not expect
    export = host.obj.export_weights
    host.obj.export_weights = lambda: {**export(), "extra.weight": torch.zeros(1)}


@pytest.mark.slow
def test_async_run_with_collective_sync_then_a_failed_export_is_an_error_not_a_hang(ray_cluster):
    cfg = load_config("quickstart", sampler={"name": "weight_fifo", "max_staleness_versions": 1}, eval_every=None,
                      **ACTORS)
    with Controller.from_config(cfg) as ctrl:
        ctrl.run(6, progress=False)
        assert ctrl.trainer_version == 6 and ctrl.generation_version == 6
        assert ctrl.metrics.lag_max.max() <= 1
        assert ctrl.sync_weights.syncs == 7
        ray.get(ctrl.policy.apply_remote(_break_export))
        with pytest.raises(Exception, match="no longer matches"):
            ctrl.sync_weights(7)
        assert ctrl.generation_version == 6  # the version moves only after a completed receive


def test_bad_weight_sync_configs_are_rejected(ray_cluster):
    from asyncrl.backends import build_backends
    from asyncrl.backends.ray import remote
    from asyncrl.backends.torch import TorchPolicy
    from asyncrl.backends.weight_sync import build_weight_sync

    with pytest.raises(ValueError, match="both need placement 'ray'"):
        load_config("quickstart", generation={"weight_sync": "collective"})
    with pytest.raises(ValueError, match="both need placement 'ray'"):
        load_config("quickstart", generation={"placement": "ray", "weight_sync": "collective"})
    with pytest.raises(ValueError, match="both backends on CUDA .* or both on CPU"):
        load_config("quickstart", **{**ACTORS, "trainer": {"placement": "ray", "device": "cuda"}})
    with pytest.raises(ValueError, match="weight_sync"):
        load_config("quickstart", generation={"weight_sync": "nccl"})
    # a collective config handed in-process backends (Controller(...) built by hand)
    cfg = load_config("quickstart", **ACTORS)
    local = load_config("quickstart")
    policy, generator, _ = build_backends(local)
    with pytest.raises(ValueError, match="needs both backends in Ray actors"):
        build_weight_sync(cfg, policy, generator)
    # explicit device ids need Ray's GPU accounting off (Ray renumbers the GPUs it assigns from 0)
    section = load_config("quickstart", trainer={"device": "cuda:1", "placement": "ray"}).trainer
    with pytest.raises(ValueError, match="num_gpus: 0"):
        remote(TorchPolicy, (), section)


def test_two_device_preset_validates():
    cfg = load_config("gpu_two_devices")
    assert (cfg.trainer.placement, cfg.generation.placement) == ("ray", "ray")
    assert cfg.generation.weight_sync == "collective"
    assert cfg.trainer.ray_options.get("num_gpus", 1) == 1 and cfg.generation.ray_options.get("num_gpus", 1) == 1
    # the KV pool from a token budget and no prefix cache: a sync does not walk a whole GPU's worth of KV blocks
    assert cfg.generation.kv_cache_tokens is not None and not cfg.generation.enable_prefix_caching
    heavy = load_config("gpu_two_devices_gen_heavy")
    assert (heavy.trainer.placement, heavy.generation.placement, heavy.generation.weight_sync) == (
        "ray", "ray", "collective")
    assert heavy.model == load_config("gpu_gen_heavy").model and heavy.groups_per_step * heavy.group_size >= 256
    # the balanced preset is gpu_two_devices with fewer completions a step (its stage times measured within 25%)
    balanced = load_config("gpu_two_devices_balanced")
    assert balanced.group_size < cfg.group_size
    assert balanced.model_dump(exclude={"group_size"}) == cfg.model_dump(exclude={"group_size"})
