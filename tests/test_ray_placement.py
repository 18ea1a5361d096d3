"""Placement is configuration: the same run with both backends in Ray actors (two actors standing in for two
devices) gives the same weights as in-process, and a concurrent run through actors works."""

from __future__ import annotations

import pytest
import torch

from asyncrl import Controller, load_config

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    from asyncrl.backends.ray import ensure_ray

    ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_backends_in_ray_actors_match_in_process_bit_for_bit(ray_cluster):
    sampler = {"name": "in_order", "max_lookahead_versions": 0}
    local = Controller.from_config(load_config("quickstart", seed=4, sampler=sampler, eval_every=None))
    remote = Controller.from_config(load_config(
        "quickstart", seed=4, sampler=sampler, eval_every=None,
        trainer={"placement": "ray"}, generation={"placement": "ray"},
    ))
    assert type(remote.policy).__name__ == "RemoteBackend" and type(remote.generator).__name__ == "RemoteBackend"
    for ctrl in (local, remote):
        while ctrl.trainer_version < 4:
            ctrl.tick()
    a, b = local.policy.export_weights(), remote.policy.export_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert local.trace.equals(remote.trace)
    assert remote.generation_version == 4
    remote.close()  # frees the actors' CPUs for the next test


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
