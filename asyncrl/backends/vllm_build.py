"""Building the vLLM engine the generator streams through (``asyncrl/backends/vllm.py``): the model directory it
loads, the ``vllm.LLM`` arguments a ``VLLMGenerationConfig`` stands for, and the build's timings.

- The engine needs a model directory: ``model_cfg.hf_path``, or a temporary one holding the HF config, the
  tokenizer and the initial weights of ``ModelConfig`` (``write_model_dir``: the weights ``TorchPolicy`` /
  ``MegatronPolicy`` start from with that seed, the policies' version 0).
- The KV pool: ``gen_cfg.kv_cache_tokens`` sizes it from a token budget (vLLM's ``kv_cache_memory_bytes``,
  ``kv_cache_bytes``), otherwise ``gpu_memory_utilization`` does; ``max_num_seqs`` bounds sequences decoded at once.
- ``model.lora``: LoRA on (``enable_lora``, ``max_lora_rank`` the adapter's rank rounded up to one vLLM takes,
  ``max_loras`` from ``gen_cfg.max_loras``); the engine loads the base model, adapters come per weight version.
- CUDA graphs unless ``enforce_eager``: vLLM then also compiles the model; ``build_timings`` reads the compile and
  graph-capture seconds from vLLM's own build log (they are kept nowhere else).
- Shutting it down (``shutdown_llm``): the engine lives in the caller's process, so its memory comes back only once
  its requests are gone and its core has shut down; a failed shutdown is a warning naming it, not silence.
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from asyncrl.backends.hf import build_hf_config, init_hf_model

__all__ = ["build_llm", "shutdown_llm", "write_model_dir", "kv_cache_bytes"]


def write_model_dir(model_cfg: Any, tokenizer: Any, seed: int, path: str | Path) -> Path:
    """Write what ``vllm.LLM`` loads for a model built from ``ModelConfig``: ``config.json`` (+ generation
    config), the tokenizer, and the initial weights (safetensors, in ``model_cfg.dtype``) — the weights
    ``init_hf_model(build_hf_config(model_cfg, tokenizer), seed)`` gives, i.e. the policies' version 0."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = build_hf_config(model_cfg, tokenizer)
    model = init_hf_model(hf_config, seed)
    dtype = torch.bfloat16 if model_cfg.dtype == "bfloat16" else torch.float32
    model = model.to(dtype)
    model.config.torch_dtype = dtype
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


def kv_cache_bytes(model_cfg: Any, hf_config: Any, tokens: int) -> int:
    """Bytes of vLLM's KV pool for ``tokens`` tokens: keys and values, every layer, every KV head."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim
    return int(tokens) * per_token * (2 if model_cfg.dtype == "bfloat16" else 4)


VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.26's LoRAConfig.max_lora_rank choices


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"model.lora.rank {rank}: vLLM serves adapters of rank <= {VLLM_RANKS[-1]}")


def lora_engine_kwargs(lora_cfg: Any, max_loras: int) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of an engine serving ``max_loras`` adapters of ``lora_cfg``'s rank at once."""
    return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora_cfg.rank), "max_loras": max_loras,
            "max_cpu_loras": max_loras + 1}  # + the newest while the oldest still finishes


class _BuildTimings(logging.Handler):
    """Reads vLLM's own build log records (torch.compile seconds, CUDA-graph capture seconds) while the engine is
    built; they are not kept anywhere else."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.found: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        try:
            if msg.startswith("Graph capturing finished in"):
                self.found["graph_capture_s"] = float(record.args[0])
            elif msg.startswith("init engine (profile, create kv cache, warmup model) took"):
                self.found["engine_core_init_s"] = float(record.args[0])
                if "compilation" in msg:
                    self.found["compile_s"] = float(record.args[1])
        except (TypeError, ValueError, IndexError):
            pass


def build_llm(vllm: Any, model_cfg: Any, gen_cfg: Any, seed: int, tokenizer: Any):
    """``(llm, model_dir, tmpdir, build_timings)``: the engine for ``gen_cfg`` (``tmpdir``: the temporary model
    directory to remove at close, or None); ``build_timings`` in seconds: ``write_model_dir_s``, ``engine_s`` (the
    whole ``vllm.LLM(...)``), ``compile_s`` and ``graph_capture_s`` (0 with ``enforce_eager``), ``engine_core_init_s``."""
    t0 = time.perf_counter()
    tmpdir = None
    if model_cfg.hf_path:
        model_dir = model_cfg.hf_path
    else:
        if tokenizer is None:
            raise ValueError("a model built from ModelConfig (no hf_path) needs the tokenizer")
        tmpdir = tempfile.mkdtemp(prefix="asyncrl-vllm-")
        model_dir = str(write_model_dir(model_cfg, tokenizer, seed, tmpdir))
    write_s = time.perf_counter() - t0
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        dtype=model_cfg.dtype,
        seed=seed,
        gpu_memory_utilization=gen_cfg.gpu_memory_utilization,
        enforce_eager=gen_cfg.enforce_eager,
        enable_prefix_caching=gen_cfg.enable_prefix_caching,
    )
    if not model_cfg.hf_path:
        kwargs["max_model_len"] = model_cfg.max_position_embeddings
    if gen_cfg.kv_cache_tokens is not None:
        from transformers import AutoConfig

        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(
            model_cfg, AutoConfig.from_pretrained(model_dir), gen_cfg.kv_cache_tokens)
    if gen_cfg.max_num_seqs is not None:
        kwargs["max_num_seqs"] = gen_cfg.max_num_seqs
    if model_cfg.lora is not None:  # the base model, and one adapter per weight version (vllm_lora.py)
        kwargs.update(lora_engine_kwargs(model_cfg.lora, gen_cfg.max_loras))
    kwargs.update(gen_cfg.llm_kwargs)
    timings = _BuildTimings()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(timings)
    level = vllm_logger.level
    if vllm_logger.getEffectiveLevel() > logging.INFO:  # the records must reach the handler
        vllm_logger.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        llm = vllm.LLM(**kwargs)
    finally:
        vllm_logger.removeHandler(timings)
        vllm_logger.setLevel(level)
    return llm, model_dir, tmpdir, {"write_model_dir_s": write_s, "engine_s": time.perf_counter() - t0,
                                    "compile_s": 0.0, "graph_capture_s": 0.0, **timings.found}


def shutdown_llm(llm: Any, request_ids: list[str]) -> None:
    """Abort ``request_ids`` (what the engine still runs) and shut the engine's core down, best effort (the process
    may be exiting): a failure is a ``RuntimeWarning`` naming it, since the engine's GPU memory may then stay held
    until the process ends."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    try:
        if request_ids and engine is not None:
            engine.abort_request(request_ids)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception as exc:  # noqa: BLE001 - reported, not raised: closing must go on
        warnings.warn(f"vLLM engine shutdown failed ({type(exc).__name__}: {exc}); its GPU memory may stay held "
                      "until the process ends", RuntimeWarning, stacklevel=3)
