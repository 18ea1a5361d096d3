"""Hugging Face helpers shared by every engine (torch, Megatron-core, vLLM): the tokenizer, the model's HF
config, its one seeded initialisation, and checkpoint loading.

Every engine starts from the same weights for a seed because they all come from ``init_hf_model``: the HF model
class built under ``torch.manual_seed(seed)`` on the CPU, leaving the caller's RNG untouched. The torch engine
trains that model itself, Megatron copies it through its weight map, vLLM loads it from a directory
``write_model_dir`` (in ``vllm_build.py``) saved. ``transformers`` is imported inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_tokenizer(model_cfg: Any):
    """The embedded byte tokenizer, or the one in ``model_cfg.hf_path`` (a local directory, no downloads)."""
    if model_cfg.hf_path is None:
        from asyncrl.tokenizer import build_tokenizer

        return build_tokenizer(getattr(model_cfg, "vocab_size", None))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_cfg.hf_path)


def special_ids(tokenizer: Any) -> tuple[int, int, int, int]:
    """(pad, bos, eos, vocab size) of ``tokenizer``, or the embedded tokenizer's when it is ``None``."""
    if tokenizer is None:
        return PAD_ID, BOS_ID, EOS_ID, VOCAB_SIZE
    pick = lambda name, default: default if getattr(tokenizer, name, None) is None else getattr(tokenizer, name)  # noqa: E731
    return pick("pad_token_id", PAD_ID), pick("bos_token_id", BOS_ID), pick("eos_token_id", EOS_ID), len(tokenizer)


def build_hf_config(model_cfg: Any, tokenizer: Any = None) -> Any:
    """The Hugging Face config of ``model_cfg``: read from ``hf_path`` when set, else a ``LlamaConfig`` built from
    the ``ModelConfig`` fields and the tokenizer (vocabulary size and special token ids)."""
    from transformers import AutoConfig

    if model_cfg.hf_path:
        return AutoConfig.from_pretrained(model_cfg.hf_path)
    if tokenizer is None:
        raise ValueError("a model built from ModelConfig (no hf_path) needs the tokenizer for its vocabulary")
    return model_cfg.llama_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                                  tokenizer.eos_token_id)


def init_hf_model(hf_config: Any, seed: int) -> Any:
    """A freshly initialised fp32 HF causal LM on the CPU: ``torch.manual_seed(seed)`` then the model's own
    initialisation, without touching the caller's RNG state. Deterministic in ``seed`` on any machine."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if getattr(hf_config, "model_type", "llama") == "llama":
            model = LlamaForCausalLM(hf_config)
        else:
            model = AutoModelForCausalLM.from_config(hf_config)
    return model.float().eval()


def init_hf_state_dict(hf_config: Any, seed: int) -> dict[str, torch.Tensor]:
    """``init_hf_model(hf_config, seed).state_dict()``: the HF-named initial weights."""
    return dict(init_hf_model(hf_config, seed).state_dict())


def load_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files (or ``pytorch_model*.bin``) in a HF checkpoint directory."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(root.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    for f in bins:
        out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return out


def build_model(
    model_cfg: Any,
    vocab_size: int,
    seed: int,
    device: str | torch.device = "cpu",
    pad_token_id: int = PAD_ID,
    bos_token_id: int = BOS_ID,
    eos_token_id: int = EOS_ID,
):
    """A ``transformers`` causal LM for the torch engine: ``init_hf_model`` of ``model_cfg.llama_config(...)`` (no
    KV cache by default, SDPA attention), in ``model_cfg.dtype`` on ``device``. With ``model_cfg.hf_path`` the
    weights come from that local checkpoint instead (no downloads)."""
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[model_cfg.dtype]
    if model_cfg.hf_path is not None:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.hf_path, local_files_only=True, dtype=dtype)
        return model.to(device)
    config = model_cfg.llama_config(vocab_size, pad_token_id, bos_token_id, eos_token_id)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return init_hf_model(config, seed).to(device=device, dtype=dtype)
