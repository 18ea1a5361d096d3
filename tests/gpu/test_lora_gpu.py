"""LoRA on one GPU: the torch engine trains the adapter on CUDA (gradient checkpointing on), vLLM generates with
one adapter per weight version (``asyncrl/backends/vllm_lora.py``), asynchronously (``weight_fifo`` W=1), on a
small Qwen3-shaped directory built on the device (``benchmarks/model_dirs.py``): every sync registers a new adapter
and sends the adapter's bytes only, every group finishes on the adapter it started with, old adapters go, two
versions' tokens differ after training, nothing is lost. The ``gpu_lora_8b`` preset's settings at a small shape
(the 8B run is benchmarks/bench_lora_gpu.py). Skipped without CUDA, vLLM or peft."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from model_dirs import build_model_dir

    with tempfile.TemporaryDirectory(prefix="asyncrl-lora-gpu-") as tmp:
        yield str(build_model_dir(Path(tmp) / "small_qwen3", "small_qwen3", device="cuda"))


def test_lora_on_vllm_one_adapter_per_version_adapter_bytes_only_nothing_lost(model_dir):
    from asyncrl import Controller, load_config
    from tests.faults import check_accounting
    from tests.gpu.results import Results

    results = Results("lora_gpu")
    # A reward that varies between a random model's samples (the preset's copy_first gives them all 0, so every
    # advantage was 0 and the adapter never moved: the H100 run of 2026-12-05)
    cfg = load_config("gpu_lora_8b", eval_every=None, groups_per_step=8, group_size=4,
                      model={"hf_path": model_dir}, reward={"funcs": ["tests.reward_functions:even_token_share"]},
                      generation={"max_new_tokens": 32, "kv_cache_tokens": 16384, "max_num_seqs": 64,
                                  "enforce_eager": True, "gpu_memory_utilization": 0.2},
                      trainer={"lr": 1.0e-2, "micro_batch_tokens": 4096})
    assert cfg.model.lora.rank == 16 and cfg.trainer.gradient_checkpointing and cfg.generation.max_loras == 2
    prompts = [[257, 65 + i, 66 + i, 67 + i] for i in range(8)]
    with Controller.from_config(cfg) as ctrl:
        gen, policy = ctrl.generator, ctrl.policy
        before = gen.generate_greedy(prompts, 16)  # version 0's adapter (lora_B zero: the base model)
        ctrl.run(6, progress=False)
        after = gen.generate_greedy(prompts, 16)  # version 6's
        m = ctrl.metrics
        adapter = policy.export_adapter()
        base_bytes = sum(p.numel() * p.element_size() for n, p in policy.model.named_parameters() if "lora_" not in n)
        # the sync sent the adapter only, every step
        assert len(m) == 6 and (m.sync_bytes == adapter.nbytes).all() and adapter.nbytes < base_bytes / 10
        parts = gen.sync_parts()
        assert [p["version"] for p in parts] == list(range(7))  # one adapter per version: 0 at the start, 1 a step
        assert all(p["bytes"] == adapter.nbytes for p in parts)
        assert 1 <= len(gen.adapters()) <= cfg.generation.max_loras  # old ones removed
        assert max(gen.adapters().values()) == 6
        # every group finished on the adapter it started with; the run did use more than one version at once
        commits = ctrl.trace[ctrl.trace.event == "commit"]
        spans = [r.reason.split("weights ")[1].split("..") for r in commits.itertuples()]
        assert spans and all(a == b for a, b in spans)
        assert int(m.lag_max.max()) <= 1
        check_accounting(ctrl)  # nothing lost
        # the adapter trained (lora_B starts at zero), and two versions' tokens differ: vLLM generates with it
        assert any(float(p.abs().max()) > 0 for n, p in policy.model.named_parameters() if "lora_B" in n)
        assert before != after
        assert torch.isfinite(torch.tensor(m.loss.to_numpy())).all()
        results.record("lora_gpu_sync", {
            "adapter_bytes": adapter.nbytes, "base_bytes": base_bytes,
            "load_ms_median": 1e3 * sorted(p["load_s"] for p in parts)[len(parts) // 2],
            "write_ms_median": 1e3 * sorted(p["receive_s"] for p in parts)[len(parts) // 2],
            "sync_time_s_median": float(m.sync_time_s.median()), "steps_per_s": float(len(m) / m.step_time_s.sum()),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30})
