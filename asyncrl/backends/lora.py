"""LoRA on a Hugging Face model (``model.lora``, through ``peft``): the adapter put in, the merged weights, the
adapter's own state, and the adapter written as a directory ``peft.PeftModel.from_pretrained`` loads.

Invariants:
- ``apply_lora`` puts the adapter into the model object itself (peft injects its layers in place and freezes every
  other parameter), so the engine keeps reading ``model`` as before: only the adapter's parameters require grad,
  hence only they have gradients and optimizer state. Its initialisation is seeded (``seed``) without touching the
  caller's RNG; ``lora_B`` starts at zero, so the merged weights at version 0 are the base model's.
- ``merged_weights`` are the base weights plus each adapted layer's ``get_delta_weight`` (peft's scale alpha /
  rank included), under the model's plain Hugging Face names: what a generator loads and an export writes.
- ``adapter_state`` is what a checkpoint keeps of the model: the adapter's tensors only (the base is named, not
  copied: ``model.hf_path`` or the seeded built-in model rebuilds it).
- ``export_adapter`` is what the weight sync sends a generator that serves adapters (vLLM, ``asyncrl/backends/vllm.py``):
  the adapter's tensors under peft's saved names (``base_model.model....lora_A.weight``, what
  ``adapter_model.safetensors`` holds) in the generator's dtype, on the CPU, with peft's ``adapter_config.json``
  as a dict; ``nbytes`` is what the sync moved. ``write_adapter_dir`` writes it as the directory peft and vLLM load.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"  # peft's name for the one adapter


def apply_lora(model: Any, cfg: Any, seed: int) -> Any:
    """The ``peft.PeftModel`` around ``model`` with a LoRA adapter of ``cfg`` (``LoraConfig``) injected into it."""
    import peft

    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                             target_modules=list(cfg.target_modules) if cfg.target_modules else "all-linear")
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        try:
            return peft.get_peft_model(model, config)
        except ValueError as exc:  # target modules that match nothing
            text = " ".join(str(exc).split())
            raise ValueError(f"model.lora.target_modules {cfg.target_modules}: {text[:200]}") from exc


def adapted_layers(model: Any) -> dict[str, Any]:
    """``{module name: peft LoRA layer}`` of a model with an adapter in it."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


@torch.no_grad()
def merged_weights(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights with the adapter merged in, under plain Hugging Face names (fresh tensors)."""
    state = model.state_dict()
    out = {key.replace(".base_layer.", "."): value.detach().clone() for key, value in state.items()
           if ".lora_" not in key}
    for name, layer in adapted_layers(model).items():
        weight = out[f"{name}.weight"]
        weight += layer.get_delta_weight(ADAPTER).to(weight.dtype)
    return out


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors (``state_dict`` keys holding ``.lora_``), copied."""
    return {key: value.detach().clone() for key, value in model.state_dict().items() if ".lora_" in key}


def load_adapter_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Load ``adapter_state``'s tensors into ``model``; a key missing or unknown is a ``KeyError`` naming it."""
    want = set(adapter_state(model))
    if set(state) != want:
        raise KeyError(f"adapter state: missing {sorted(want - set(state))[:3]}, unknown "
                       f"{sorted(set(state) - want)[:3]}")
    model.load_state_dict(state, strict=False)


def save_adapter(peft_model: Any, path: str | Path) -> Path:
    """Write the adapter as a directory (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained(base, path)`` loads. Atomic like a model export: ``path`` must not exist or be
    empty (a ``ValueError`` naming it, nothing written)."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{str(path)!r} exists and is not an empty directory: an adapter export writes a new one")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        peft_model.save_pretrained(str(tmp))
        if path.exists():
            path.rmdir()
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


@dataclass(frozen=True)
class LoraAdapter:
    """One version of the adapter as a generator receives it (module docstring): peft-named tensors and config."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@torch.no_grad()
def export_adapter(peft_model: Any, dtype: torch.dtype) -> LoraAdapter:
    """The adapter of ``peft_model`` as ``adapter_model.safetensors`` / ``adapter_config.json`` would hold it,
    tensors cast to ``dtype`` (the generator's) and copied to the CPU."""
    from peft.utils import get_peft_model_state_dict

    if peft_model is None:
        raise ValueError("export_adapter: this policy trains no adapter (model.lora is unset)")
    state = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER)
    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in state.items()}
    config = peft_model.peft_config[ADAPTER].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}  # as peft writes it
    return LoraAdapter(tensors, config)


def write_adapter_dir(adapter: LoraAdapter, path: str | Path) -> Path:
    """Write ``adapter`` as ``path/adapter_config.json`` + ``path/adapter_model.safetensors`` (created)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(adapter.config, indent=2, sort_keys=True, default=str))
    save_file(adapter.tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path
