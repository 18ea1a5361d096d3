"""Timing-independent schedules (docs/samplers.md, "Timing-independent schedules"): with a gated sampler that has
a fixed rule of what to train (``weight_fifo``, ``in_order``), which groups are trained at which step, generated
by which weights, does not depend on timing. A stepped run and a threaded run whose generator sleeps at random
(so the rollout pump stalls past train steps) train the same groups at the same versions, with the same losses."""

from __future__ import annotations

import random
import time

import pytest
import torch

from asyncrl import Controller, load_config
from asyncrl.backends import build_backends
from asyncrl.backends.torch import TorchGenerator
from asyncrl.tasks import build_task


class JitteryGenerator(TorchGenerator):
    """The torch generator with random stalls (from the OS's entropy, never the same twice) before each poll and
    weight load: the rollout pump falls behind the train pump by whole steps at random moments."""

    def __init__(self, *args, max_sleep_s: float = 0.15, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_sleep_s, self.jitter = max_sleep_s, random.Random()

    def poll(self, timeout=0.0):
        time.sleep(self.jitter.random() * self.max_sleep_s)
        return super().poll(timeout)

    def load_weights(self, weights, version):
        time.sleep(self.jitter.random() * self.max_sleep_s / 3)
        super().load_weights(weights, version)


def build(cfg, jitter: bool = False) -> Controller:
    """As ``Controller.from_config`` builds it, with the jittery generator when asked."""
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task)
    policy, generator, tokenizer = build_backends(cfg)
    if jitter:
        generator = JitteryGenerator(cfg.model, cfg.generation, cfg.seed, tokenizer)
    return Controller(cfg, task, policy, generator, tokenizer)


def schedule(ctrl: Controller) -> dict:
    """What a run trained: (step, group, weight version) of every select, the weights each commit was generated
    with, the admissions' versions, and the losses."""
    trace = ctrl.trace
    select = trace[trace.event == "select"]
    commit = trace[trace.event == "commit"].sort_values("group_id")
    admit = trace[trace.event == "admit"]
    return {
        "selected": list(zip(select.trainer_version, select.group_id, select.weight_version)),
        "generated": list(zip(commit.group_id, commit.weight_version, commit.reason)),
        "admitted": list(zip(admit.detail, admit.weight_version)),
        "loss": ctrl.metrics.loss.tolist(),
        "reward": ctrl.metrics.reward_mean.tolist(),
    }


@pytest.mark.parametrize("sampler", [
    {"name": "weight_fifo", "max_staleness_versions": 1},
    {"name": "in_order", "max_lookahead_versions": 1},
    {"name": "in_order", "max_lookahead_versions": 2},
], ids=["weight_fifo-W1", "in_order-L1", "in_order-L2"])
def test_the_schedule_does_not_depend_on_timing(sampler):
    cfg = load_config("quickstart", seed=4, sampler=sampler, eval_every=None, torch_threads=1)
    steps = 10
    stepped = build(cfg)
    pattern = ["rollout", "train", "train", "rollout", "rollout", "train"]  # any order of hand ticks
    i = 0
    while stepped.trainer_version < steps:
        getattr(stepped, f"{pattern[i % len(pattern)]}_tick")()
        i += 1
    threaded = build(cfg, jitter=True)
    threaded.run(steps, progress=False)
    a, b = schedule(stepped), schedule(threaded)
    n = steps * cfg.groups_per_step
    assert len(a["selected"]) == len(b["selected"]) == n
    assert a["selected"] == b["selected"]  # the same groups, at the same steps, of the same weight versions
    for gid, version, reason in b["generated"]:  # each group generated with the weights it was stamped with
        assert reason.startswith(f"generated with weights {version}..{version}"), (gid, version, reason)
    made_a, made_b = ({g: r for g, _, r in run["generated"]} for run in (a, b))
    assert [made_a[g] for _, g, _ in a["selected"]] == [made_b[g] for _, g, _ in b["selected"]]
    assert a["loss"] == b["loss"] and a["reward"] == b["reward"]  # the same data: bit-identical on CPU
    lags = {lag for (t, _, w) in a["selected"] for lag in [t - w]}
    assert max(lags) >= 1, "the run never trained ahead-generated data: nothing was asynchronous"
