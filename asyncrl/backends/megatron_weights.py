"""Megatron-core's weight map: Hugging Face Llama (2 and 3) / Qwen2 / Qwen3 / Mistral tensors <-> Megatron
``GPTModel`` tensors, and their tensor-parallel sharding. Pure tensor code (no Megatron import), used by
``MegatronPolicy`` and the tests.

- HF's separate q/k/v projections become Megatron's fused ``linear_qkv`` with the per-group interleaving GQA needs
  (for each KV group: its query heads, then its key head, then its value head); the head size is the config's
  ``head_dim`` when it has one (Qwen3's is not hidden / heads), so the projections are ``heads x head_dim`` wide;
- Qwen3's per-head q/k RMSNorms (``q_norm`` / ``k_norm``) are Megatron's ``q_layernorm`` / ``k_layernorm``
  (``ArchSpec.qk_norm``: the model is built with ``qk_layernorm``), replicated over TP ranks;
- HF's gate/up projections become the fused SwiGLU ``linear_fc1`` (``[gate; up]``, per tensor-parallel shard);
- the vocabulary is padded to a multiple of the TP size on the Megatron side and cut back on the way out.

``ArchSpec`` reads the shape facts from a HF config and refuses, in one line naming the field, what the Megatron
model would compute differently (another activation, biases Megatron's layer has no place for, sliding windows,
a rope scaling other than Llama 3's). Llama 3's ``rope_type: llama3`` is Megatron's ``rope_scaling`` with its
factor; Megatron fixes the other three parameters at Llama 3's values, so other values are refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["ArchSpec", "hf_to_megatron", "megatron_to_hf", "partition_dim", "shard_for_tp", "unshard_from_tp"]




# Megatron's rope scaling (RotaryEmbedding._apply_scaling) takes only the factor; these are its fixed values.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class ArchSpec:
    """The shape facts the weight mapping needs, read from a HF config."""

    def __init__(self, hf_config: Any):
        c = hf_config
        model_type = getattr(c, "model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"MegatronPolicy supports {'/'.join(MODEL_TYPES)} models, not model_type={model_type!r}")
        self.model_type = model_type
        self.vocab_size = int(c.vocab_size)
        self.hidden_size = int(c.hidden_size)
        self.intermediate_size = int(c.intermediate_size)
        self.num_layers = int(c.num_hidden_layers)
        self.num_heads = int(c.num_attention_heads)
        self.num_kv_heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        self.rms_norm_eps = float(getattr(c, "rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", False))
        self.max_position_embeddings = int(getattr(c, "max_position_embeddings", 2048))
        self.initializer_range = float(getattr(c, "initializer_range", 0.02))
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        rope = rope if isinstance(rope, dict) else {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        self.rope_scaling_factor: float | None = None  # Llama 3's: Megatron's rope_scaling with this factor
        if rope_type == "llama3":
            other = {k: rope.get(k) for k in LLAMA3_ROPE if float(rope.get(k, LLAMA3_ROPE[k])) != LLAMA3_ROPE[k]}
            if other:
                raise ValueError(f"rope_scaling {other} is not supported: Megatron's Llama 3 rope scaling fixes "
                                 f"{LLAMA3_ROPE}")
            self.rope_scaling_factor = float(rope["factor"])
        elif rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (plain rotary embeddings, or Llama 3's "
                             "'llama3' scaling)")
        theta = rope.get("rope_theta")
        self.rope_theta = float(theta if theta is not None else getattr(c, "rope_theta", 10000.0))
        act = getattr(c, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
        # Qwen2 has q/k/v biases; Llama and Qwen3 have them (and an o_proj bias) only with attention_bias.
        self.qkv_bias = model_type == "qwen2" or bool(getattr(c, "attention_bias", False))
        if model_type in ("llama", "qwen3") and getattr(c, "attention_bias", False):
            raise ValueError(f"{model_type} attention_bias=True (an o_proj bias) is not supported")
        self.qk_norm = model_type == "qwen3"  # per-head RMSNorm of queries and keys, before rope
        if getattr(c, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported (Megatron's layer attends to the whole row)")
        if getattr(c, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of {self.num_kv_heads}")

    @property
    def rope_kwargs(self) -> dict[str, Any]:
        """``GPTModel``'s rope-scaling arguments: Llama 3's scaling, or none."""
        if self.rope_scaling_factor is None:
            return {}
        return {"rope_scaling": True, "rope_scaling_factor": self.rope_scaling_factor}

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _qk_norm_names(i: int) -> dict[str, str]:
    hf, mg = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
    return {hf + "q_norm.weight": mg + "q_layernorm.weight", hf + "k_norm.weight": mg + "k_layernorm.weight"}


def _layer_names(i: int) -> dict[str, str]:
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    return {
        hf + "input_layernorm.weight": mg + "input_layernorm.weight",
        hf + "self_attn.o_proj.weight": mg + "self_attention.linear_proj.weight",
        hf + "post_attention_layernorm.weight": mg + "pre_mlp_layernorm.weight",
        hf + "mlp.down_proj.weight": mg + "mlp.linear_fc2.weight",
    }


def hf_to_megatron(hf: Mapping[str, torch.Tensor], spec: ArchSpec) -> dict[str, torch.Tensor]:
    """HF tensors -> *full* (unsharded) Megatron tensors. ``linear_fc1`` is ``[gate; up]`` over the whole
    intermediate size (``shard_for_tp`` re-splits it per rank); the vocabulary is not padded here."""
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    ng, rep, d = spec.num_kv_heads, spec.heads_per_group, spec.head_dim
    for i in range(spec.num_layers):
        for h, m in _layer_names(i).items():
            out[m] = hf[h]
        p, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        if spec.qk_norm:
            for h, m in _qk_norm_names(i).items():
                out[m] = hf[h]
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q = hf[p + f"self_attn.q_proj.{kind}"]
            k = hf[p + f"self_attn.k_proj.{kind}"]
            v = hf[p + f"self_attn.v_proj.{kind}"]
            tail = q.shape[1:]
            fused = torch.cat([q.reshape(ng, rep * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], 1)
            out[mp + f"self_attention.linear_qkv.{kind}"] = fused.reshape(ng * (rep + 2) * d, *tail)
        out[mp + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], 0)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not spec.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(mg: Mapping[str, torch.Tensor], spec: ArchSpec) -> dict[str, torch.Tensor]:
    """Full Megatron tensors (as ``hf_to_megatron`` makes them) -> HF tensors under exactly the names
    ``LlamaForCausalLM.state_dict()`` has (``lm_head.weight`` included, tied or not)."""
    emb = mg["embedding.word_embeddings.weight"][: spec.vocab_size]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": emb}
    ng, rep, d = spec.num_kv_heads, spec.heads_per_group, spec.head_dim
    for i in range(spec.num_layers):
        p, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            fused = mg[mp + f"self_attention.linear_qkv.{kind}"]
            tail = fused.shape[1:]
            q, k, v = fused.reshape(ng, (rep + 2) * d, *tail).split([rep * d, d, d], dim=1)
            out[p + f"self_attn.q_proj.{kind}"] = q.reshape(ng * rep * d, *tail)
            out[p + f"self_attn.k_proj.{kind}"] = k.reshape(ng * d, *tail)
            out[p + f"self_attn.v_proj.{kind}"] = v.reshape(ng * d, *tail)
        names = _layer_names(i)
        out[p + "self_attn.o_proj.weight"] = mg[names[p + "self_attn.o_proj.weight"]]
        if spec.qk_norm:
            out.update({h: mg[m] for h, m in _qk_norm_names(i).items()})
        gate, up = mg[mp + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[p + "mlp.gate_proj.weight"] = gate
        out[p + "mlp.up_proj.weight"] = up
        out[p + "mlp.down_proj.weight"] = mg[names[p + "mlp.down_proj.weight"]]
        out[p + "input_layernorm.weight"] = mg[names[p + "input_layernorm.weight"]]
        out[p + "post_attention_layernorm.weight"] = mg[names[p + "post_attention_layernorm.weight"]]
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = emb if spec.tie_word_embeddings else mg["output_layer.weight"][: spec.vocab_size]
    return _hf_order(out, spec)


def _hf_order(sd: dict[str, torch.Tensor], spec: ArchSpec) -> dict[str, torch.Tensor]:
    """The order ``*ForCausalLM.state_dict()`` uses (keys are what matters; order helps people reading)."""
    keys = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v"):
            keys.append(p + f"self_attn.{proj}_proj.weight")
            if spec.qkv_bias:
                keys.append(p + f"self_attn.{proj}_proj.bias")
        keys.append(p + "self_attn.o_proj.weight")
        if spec.qk_norm:
            keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        keys += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                 p + "mlp.down_proj.weight", p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    keys += ["model.norm.weight", "lm_head.weight"]
    return {k: sd[k] for k in keys}


# Tensor-parallel layout of each Megatron parameter, by name: the dimension it is split along (None: replicated).
_COLUMN = re.compile(r"(linear_qkv|linear_fc1)\.(weight|bias)$|^output_layer\.weight$|word_embeddings\.weight$")
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")


def partition_dim(name: str) -> int | None:
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def _is_vocab(name: str) -> bool:
    return name.endswith("word_embeddings.weight") or name == "output_layer.weight"


def shard_for_tp(name: str, full: torch.Tensor, rank: int, size: int, padded_vocab: int) -> torch.Tensor:
    """This TP rank's piece of a full Megatron tensor (vocab rows padded to ``padded_vocab`` with zeros)."""
    if _is_vocab(name) and full.shape[0] < padded_vocab:
        full = torch.cat([full, full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])], 0)
    dim = partition_dim(name)
    if dim is None or size == 1:
        return full
    if name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0)
    return full.chunk(size, dim)[rank]


def unshard_from_tp(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard_for_tp`` over all ranks' pieces (vocab padding is left for ``megatron_to_hf``)."""
    dim = partition_dim(name)
    if dim is None or len(pieces) == 1:
        return pieces[0]
    if name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias"):
        halves = [p.chunk(2, 0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(pieces, dim)
