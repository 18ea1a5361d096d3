"""The GPU presets validate on any machine (no CUDA, vLLM or Megatron-core needed to load them); running them needs
the H200 path (benchmarks/bench_gpu.py, benchmarks/bench_two_gpus.py, notebooks/gpu_quickstart.ipynb)."""

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


def test_the_real_shape_preset_is_a_qwen2_5_0_5b_shaped_model_with_a_152k_vocabulary():
    """``gpu_real_shape``: the architecture of Qwen2.5-0.5B built in code (no download), its 151,936-id output layer
    from the byte tokenizer padded with unused ids (prompts encode as with 259), 32 x 8 long-tailed completions up
    to 1,024 tokens that fit the context, on one GPU colocated, training without full-vocabulary logits and with
    fused attention, the micro-batch budget left to the memory."""
    import statistics

    from transformers import AutoModelForCausalLM

    from asyncrl.backends.hf import load_tokenizer
    from asyncrl.backends.sampling import group_max_tokens
    from asyncrl.tokenizer import ENDOFTEXT, build_tokenizer

    cfg = load_config("gpu_real_shape")
    m = cfg.model
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
            m.intermediate_size, m.rope_theta, m.tie_word_embeddings) == (896, 24, 14, 2, 4864, 1e6, True)
    assert m.hf_path is None and m.dtype == "bfloat16" and m.vocab_size == 151936
    tok = load_tokenizer(m)
    assert len(tok) == 151936 and tok.convert_ids_to_tokens(151935) == ENDOFTEXT
    prompt = build_task(cfg.task).train_prompts[0].text
    assert tok.encode(prompt) == build_tokenizer().encode(prompt)  # the padding ids are never produced
    assert len(tok.encode(prompt)) + cfg.generation.max_new_tokens <= m.max_position_embeddings
    with torch_device_meta():
        model = AutoModelForCausalLM.from_config(m.llama_config(len(tok), tok.pad_token_id, tok.bos_token_id,
                                                                tok.eos_token_id))
    assert 490e6 < sum(p.numel() for p in model.parameters()) < 500e6  # Qwen2.5-0.5B: 494M
    g = cfg.generation
    assert (g.backend, g.device, cfg.trainer.backend, cfg.trainer.device) == ("vllm", "cuda", "megatron", "cuda")
    assert cfg.groups_per_step == 32 and cfg.group_size == 8 and g.max_new_tokens == 1024
    limits = [group_max_tokens(g, cfg.seed, i) for i in range(2000)]
    assert max(limits) == 1024 and statistics.median(limits) < 200  # long-tailed: most short, a few at the cap
    assert g.kv_cache_tokens >= 2 * 256 * (len(tok.encode(prompt)) + 1024)  # two steps in flight (W=1)
    assert cfg.trainer.micro_batch_tokens is None and cfg.trainer.attention == "varlen"  # fused, packed sequences
    assert cfg.trainer.logprob_chunk_tokens * 151936 * 4 < 2 * 2**30  # one chunk's float32 logits: < 2 GiB
    assert cfg.sampler.name == "weight_fifo" and not build_sampler(cfg.sampler, None).is_on_policy
    assert load_config("gpu_real_shape", model={"hf_path": "/some/dir"}).model.hf_path == "/some/dir"


def torch_device_meta():
    import torch

    return torch.device("meta")


def test_knobs_of_the_logprob_path_and_attention_are_checked():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="logprob_chunk_tokens"):
        load_config("gpu_real_shape", trainer={"logprob_chunk_tokens": 0})
    with pytest.raises(ValidationError, match="attention"):
        load_config("gpu_real_shape", trainer={"attention": "flash"})
    with pytest.raises(ValidationError, match="vocab_size"):
        load_config("gpu_real_shape", model={"vocab_size": 100})
    assert load_config("quickstart").trainer.logprob_chunk_tokens == 2048


def test_the_lora_8b_preset_validates_and_its_recipe_trains_a_tiny_qwen3_on_cpu(tmp_path):
    """``gpu_lora_8b``: an 8B-shaped Qwen3 directory built first (``benchmarks/model_dirs.py``), LoRA r=16 on every
    linear layer, vLLM serving one adapter per version (max_loras = W + 1), the torch engine on CUDA with gradient
    checkpointing, no reference copy. Its recipe (a Qwen3 directory, LoRA, checkpointing, sorted micro-batches)
    trains on CPU at a tiny shape, and the directory builder keeps a directory of the same shape."""
    import sys
    from pathlib import Path

    pytest.importorskip("peft")
    from asyncrl import Controller

    cfg = load_config("gpu_lora_8b")
    assert cfg.model.hf_path == "/tmp/asyncrl-qwen3-8b" and cfg.model.dtype == "bfloat16"
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (16, 32.0) and cfg.model.lora.target_modules is None
    assert (cfg.trainer.backend, cfg.trainer.device, cfg.trainer.gradient_checkpointing) == ("torch", "cuda", True)
    assert (cfg.generation.backend, cfg.generation.device) == ("vllm", "cuda")
    assert cfg.generation.max_loras == cfg.sampler.max_staleness_versions + 1 == 2
    assert cfg.loss.kl == "none" and not cfg.loss.gap_metrics  # neither a reference nor a kept copy of the base
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from model_dirs import SHAPES, build_model_dir

    assert SHAPES["qwen3_8b"][1]["num_hidden_layers"] == 36 and SHAPES["qwen3_8b"][1]["head_dim"] == 128
    path = build_model_dir(tmp_path / "tiny", "tiny_qwen3")
    written = (path / "model.safetensors").stat().st_mtime_ns
    assert build_model_dir(path, "tiny_qwen3") == path and (path / "model.safetensors").stat().st_mtime_ns == written
    tiny = load_config("gpu_lora_8b", eval_every=None, groups_per_step=2, group_size=2, torch_threads=1,
                       model={"hf_path": str(path), "dtype": "float32"},
                       generation={"backend": "torch", "device": "cpu", "max_new_tokens": 4},
                       trainer={"device": "cpu", "micro_batch_tokens": 64})
    with Controller.from_config(tiny) as ctrl:
        m = ctrl.run(2, progress=False)
    assert len(m) == 2 and m.loss.notna().all() and (m.sync_bytes > 0).all()
