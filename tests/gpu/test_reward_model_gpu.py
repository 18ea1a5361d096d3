"""A reward model on a GPU run (issue 47): it scores on the GPU in the trainer's process, each forward under the
device lock that vLLM and Megatron take turns on (asyncrl/backends/device_lock.py), not in the reward workers.

A small colocated run (``gpu_quickstart``: vLLM and Megatron in one process, two pump threads, ``reward.workers:
1``) whose one reward function is a tiny sequence-classification model directory: after four steps the model's
weights are on cuda, the device lock counted the reward model's blocks beside the two engines', no worker holds
it, and every completion's ``reward/<directory>`` is what the same model scores on the CPU (fp32 both sides).

Numbers go to stdout and, when ``ASYNCRL_GPU_RESULTS`` names a folder, to ``reward_model_gpu.json`` there.
Run: ``pytest tests/gpu/test_reward_model_gpu.py -s`` (~1-2 min on an H100: vLLM's start is most of it)."""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from asyncrl import Controller, load_config  # noqa: E402
from asyncrl.backends.device_lock import device_lock_stats  # noqa: E402
from asyncrl.rewards.models import RewardModel  # noqa: E402
from tests.gpu.results import Results  # noqa: E402
from tests.test_reward_models import reward_model_dir  # noqa: E402

RESULTS = Results("reward_model_gpu")
record = RESULTS.record
STEPS, BATCH_SIZE = 4, 8


def test_a_reward_model_scores_on_the_gpu_under_the_device_lock(tmp_path):
    path = tmp_path / "my-rm"
    reward_model_dir(path)
    # The KV pool from a token budget, not the preset's share of the card (tests/gpu/conftest.py says why)
    cfg = load_config("gpu_quickstart", eval_every=None, pump_threads=2,
                      generation={"kv_cache_tokens": 65536},
                      reward={"funcs": [{"model": str(path), "batch_size": BATCH_SIZE}], "workers": 1})
    device_lock_stats(reset=True)
    t0 = time.perf_counter()
    with Controller.from_config(cfg) as ctrl:
        record("build_s", round(time.perf_counter() - t0, 1))
        rm = ctrl.reward_functions.funcs[0]
        assert isinstance(rm, RewardModel) and rm.in_process and rm.device == "cuda"
        t0 = time.perf_counter()
        ctrl.run(STEPS, progress=False)
        record("run_s", round(time.perf_counter() - t0, 2))
        model, _ = rm.load()
        assert next(model.parameters()).is_cuda
        stats = device_lock_stats()
        record("device_lock_stats", stats)
        assert stats["VLLMGenerator"]["blocks"] > 0 and stats["MegatronPolicy"]["blocks"] > 0
        forwards = STEPS * cfg.groups_per_step * -(-cfg.group_size // BATCH_SIZE)  # at least: every group trained
        assert stats["RewardModel"]["blocks"] >= forwards, (stats["RewardModel"], forwards)
        rows = ctrl.completions
        metrics = ctrl.metrics
    assert "reward/my-rm" in rows.columns and len(rows) >= STEPS * cfg.groups_per_step * cfg.group_size
    assert "reward/my-rm" in metrics.columns and metrics["reward/my-rm"].notna().all()
    cpu = RewardModel(str(path), batch_size=64)(prompts=rows.prompt.tolist(), completions=rows.completion.tolist())
    diff = (torch.tensor(rows["reward/my-rm"].tolist()) - torch.tensor(cpu)).abs().max().item()
    record("max_abs_diff_vs_cpu", diff)
    assert diff < 1e-3
    assert rows.reward.tolist() == rows["reward/my-rm"].tolist()  # the one function, weight 1
