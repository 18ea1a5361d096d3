"""The ``gpu_quickstart`` preset validates on any machine (no CUDA, vLLM or Megatron-core needed to load it);
running it needs the H200 path (benchmarks/bench_gpu.py, notebooks/gpu_quickstart.ipynb)."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config, presets
from asyncrl.samplers import build_sampler
from asyncrl.tasks import build_task


def test_gpu_preset_loads_and_validates():
    assert "gpu_quickstart" in presets()
    cfg = load_config("gpu_quickstart")
    assert (cfg.trainer.backend, cfg.trainer.device) == ("megatron", "cuda")
    assert (cfg.generation.backend, cfg.generation.device) == ("vllm", "cuda")
    assert 0 < cfg.generation.gpu_memory_utilization <= 0.5  # colocated: Megatron keeps the rest of the GPU
    assert cfg.model.dtype == "bfloat16" and cfg.model.hf_path is None  # built from config, no downloads
    assert 256 <= cfg.model.hidden_size <= 512 and cfg.model.num_hidden_layers == 4
    assert cfg.sampler.name == "weight_fifo" and cfg.sampler.max_staleness_versions == 1
    assert (cfg.loss.importance_correction, cfg.loss.truncation) == ("token", "tis")
    assert cfg.eval_every
    sampler = build_sampler(cfg.sampler, None)
    assert not sampler.is_on_policy
    task = build_task(cfg.task)
    assert task.held_out and task.constant_answer_accuracy < 0.3


def test_gpu_preset_model_fits_the_embedded_tokenizer():
    from asyncrl.tokenizer import VOCAB_SIZE, build_tokenizer

    cfg = load_config("gpu_quickstart")
    assert len(build_tokenizer()) == VOCAB_SIZE == 259
    prompt = build_task(cfg.task).train_prompts[0].text
    assert len(build_tokenizer().encode(prompt)) + cfg.generation.max_new_tokens <= cfg.model.max_position_embeddings


def test_gpu_preset_rejects_dropping_the_importance_correction():
    with pytest.raises(ValueError, match="importance"):
        load_config("gpu_quickstart", loss={"importance_correction": "none", "truncation": "none"})


def test_a_vllm_device_index_is_refused_since_the_engine_would_not_use_it():
    """vLLM builds its engine on the first GPU its process sees: ``generation.device: cuda:1`` only keyed the device
    lock while the engine ran on GPU 0. The index is refused, naming how to choose the GPU."""
    from pydantic import ValidationError

    refused = "generation.device 'cuda:1': vLLM runs on the first GPU.*placement 'ray'"
    with pytest.raises(ValidationError, match=refused):
        load_config("gpu_two_devices", generation={"device": "cuda:1"})
    assert load_config("gpu_two_devices", generation={"device": "cuda:0"}).generation.device == "cuda:0"
    assert load_config("gpu_two_devices").generation.device == "cuda"
