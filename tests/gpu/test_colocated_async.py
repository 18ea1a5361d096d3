"""Colocated asynchronous GRPO on one GPU, on the generation-heavy shape: vLLM and Megatron in one process, driven
by the controller's two pump threads (``pump_threads: 2``; on one GPU ``auto`` drives both pumps from one thread,
which bench_two_gpus.py measures against two). Before the per-device lock (asyncrl/backends/device_lock.py) this crashed with
NCCL "unhandled cuda error" in Megatron's grad-norm all_reduce within a few steps; it must now run, and the default
micro-batching (a token budget) must carry the 256-sequence chunk. Skipped without CUDA, vLLM and Megatron-core."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def stack():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")


def test_colocated_async_runs_the_generation_heavy_shape(stack):
    from asyncrl import Controller, load_config
    from asyncrl.backends.device_lock import device_lock_stats

    cfg = load_config("gpu_gen_heavy", eval_every=None, pump_threads=2)
    assert cfg.sampler.name == "weight_fifo" and cfg.trainer.micro_batch_size is None
    with Controller.from_config(cfg) as ctrl:
        assert not ctrl.lockstep
        ctrl.run(8, progress=False)
        m = ctrl.metrics
        assert len(m) == 8 and int(m.lag_max.max()) <= 1
        assert (m.completion_tokens > cfg.groups_per_step * cfg.group_size * 16).all()  # long completions
        # vLLM's own rate (per second its engine stepped, the sync's drain included): generation is most of a step
        # here, so it is near the step's tokens per second, never the absurd rate of tokens over poll time alone
        rate, step_rate = m.gen_tokens_per_s.median(), m.tokens_per_s.median()
        assert step_rate < rate < 5 * step_rate, (rate, step_rate)
        stats = device_lock_stats()
        assert stats["VLLMGenerator"]["blocks"] > 0 and stats["MegatronPolicy"]["blocks"] > 0
