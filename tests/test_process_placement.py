"""``generation.placement: process``: the generator in a child process keeps the in-process generator's contract —
the same tokens for a seed, version moves with the load, abort of queued groups, close, and a dead child is an
error naming it — and synchronous GRPO through it is still bit-identical to the plain loop."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from examples.plain_grpo import plain_grpo

from asyncrl import Controller, load_config
from asyncrl.backends.base import Capabilities, capabilities
from asyncrl.backends.process import ProcessGenerator
from asyncrl.backends.torch import TorchGenerator
from asyncrl.data import GenerationRequest
from asyncrl.tokenizer import build_tokenizer

SYNC = {"name": "in_order", "max_lookahead_versions": 0}


def requests(tokenizer, first_id: int, texts=("abc=", "xyz=", "qrs=")) -> list[GenerationRequest]:
    return [GenerationRequest(first_id + i, tokenizer.encode(t), 4) for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def pair():
    """An in-process generator and a child-process one, built from the same config and seed, one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_config("quickstart", seed=7, generation={"max_new_tokens": 4})
    tokenizer = build_tokenizer()
    args = (cfg.model, cfg.generation, cfg.seed, tokenizer)
    local, child = TorchGenerator(*args), ProcessGenerator(TorchGenerator, args)
    yield local, child, tokenizer
    child.close()
    torch.set_num_threads(threads)


def test_child_generates_the_same_tokens_and_logprobs_as_in_process(pair):
    local, child, tokenizer = pair
    assert child.version == local.version == 0
    for first in (0, 3):  # two polls: the sampling stream goes on identically
        for gen in (local, child):
            gen.submit(requests(tokenizer, first))
        a, b = local.poll(), child.poll()
        assert [g.group_id for g in b] == [first, first + 1, first + 2]
        assert [g.completion_ids for g in a] == [g.completion_ids for g in b]
        assert [g.logprobs for g in a] == [g.logprobs for g in b]
        assert [g.gen_start_version for g in b] == [0, 0, 0]
    prompts = [r.prompt_ids for r in requests(tokenizer, 0)]
    assert local.generate_greedy(prompts, 4) == child.generate_greedy(prompts, 4)


def test_version_moves_with_the_load_and_the_child_generates_with_the_new_weights(pair):
    local, child, tokenizer = pair
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in local.model.state_dict().items()}
    for gen in (local, child):
        gen.load_weights(new, 5)
        assert gen.version == 5
        gen.submit(requests(tokenizer, 10))
    a, b = local.poll(), child.poll()
    assert [g.gen_start_version for g in b] == [5, 5, 5] and [g.gen_end_version for g in b] == [5, 5, 5]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]  # the new weights, bit for bit
    assert child.state_dict()["version"] == 5
    with pytest.raises(KeyError, match="differ from the first load"):
        child.load_weights({"nope": torch.zeros(1)}, 6)
    assert child.version == 5


def test_abort_cancels_queued_groups_only_and_poll_returns_the_rest(pair):
    _, child, tokenizer = pair
    child.submit(requests(tokenizer, 20))
    child.submit(requests(tokenizer, 23))
    assert child.num_inflight() == 6
    assert sorted(child.abort([23, 24, 25, 99])) == [23, 24, 25]
    assert [g.group_id for g in child.poll()] == [20, 21, 22]
    assert child.num_inflight() == 0 and child.poll() == [] and child.abort([20]) == []


def test_an_error_in_the_child_is_raised_with_its_traceback_and_the_child_serves_on(pair):
    _, child, tokenizer = pair
    child.submit([GenerationRequest(30, [], 2)])  # an empty prompt cannot be decoded
    with pytest.raises(RuntimeError, match=r"generator process \(pid \d+\) failed in generate"):
        child.poll()
    child.submit(requests(tokenizer, 31))
    assert len(child.poll()) == 3


class MeteredGenerator(TorchGenerator):
    """A generator with step metrics of its own (the child builds it: a module-level class)."""

    capabilities = Capabilities(step_metrics=True)

    def step_metrics(self) -> dict[str, float]:
        return {"child_pid": float(os.getpid())}


def test_the_child_process_passes_on_the_step_metrics_its_generator_declares(pair):
    """A process placement answers what its generator declares, as far as it crosses the pipe: step metrics, read
    in the child; not staged weights (shared memory) nor an actor's restart."""
    _, child, _ = pair
    assert capabilities(child) == Capabilities(sampled_evaluation=True) == capabilities(TorchGenerator)
    cfg = load_config("quickstart", seed=0)
    metered = ProcessGenerator(MeteredGenerator, (cfg.model, cfg.generation, cfg.seed, build_tokenizer()))
    try:
        assert capabilities(metered) == Capabilities(step_metrics=True)
        assert metered.step_metrics() == {"child_pid": float(metered.pid)} != {"child_pid": float(os.getpid())}
    finally:
        metered.close()


def test_close_ends_the_child_a_dead_child_is_an_error_naming_it_and_sigint_is_the_parents():
    cfg = load_config("quickstart", seed=0)
    tokenizer = build_tokenizer()
    child = ProcessGenerator(TorchGenerator, (cfg.model, cfg.generation, cfg.seed, tokenizer))
    os.kill(child.pid, signal.SIGKILL)
    child.submit(requests(tokenizer, 0))
    with pytest.raises(RuntimeError, match=rf"TorchGenerator generator process \(pid {child.pid}\) died: it exited"):
        child.poll()
    child.close()  # closing a dead child is fine

    child = ProcessGenerator(TorchGenerator, (cfg.model, cfg.generation, cfg.seed, tokenizer))
    os.kill(child.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group: the child leaves it to the parent
    child.submit(requests(tokenizer, 0))
    assert len(child.poll()) == 3
    process = child._process
    child.close()
    assert not process.is_alive() and process.exitcode == 0
    child.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        child.load_weights({}, 1)


@pytest.mark.parametrize("mode", ["stepped", "run"])
def test_in_order_without_lookahead_through_a_child_process_is_synchronous_grpo_bit_for_bit(mode):
    cfg = load_config("quickstart", seed=3, sampler=SYNC, torch_threads=1, generation={"placement": "process"})
    steps = 5
    with Controller.from_config(cfg) as ctrl:
        assert isinstance(ctrl.generator, ProcessGenerator)
        if mode == "stepped":
            while ctrl.trainer_version < steps:
                ctrl.tick()
        else:
            ctrl.run(steps, progress=False)
        assert ctrl.generation_version == steps
    policy, _, history = plain_grpo(cfg, steps)
    a, b = ctrl.policy.export_weights(), policy.export_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert ctrl.metrics.reward_mean.tolist() == [h["reward_mean"] for h in history]
    assert (ctrl.metrics.lag_max == 0).all()


def test_async_run_through_a_child_process_keeps_the_window_and_evaluates():
    cfg = load_config("quickstart", seed=1, sampler={"name": "weight_fifo", "max_staleness_versions": 1},
                      torch_threads=1, eval_every=4, generation={"placement": "process"})
    with Controller.from_config(cfg) as ctrl:
        ctrl.run(8, progress=False)
    assert ctrl.trainer_version == 8 and ctrl.metrics.lag_max.max() <= 1
    assert ctrl.metrics.eval_accuracy.notna().sum() == 2
    assert not ctrl.generator._process.is_alive()  # the controller's close ended the child
