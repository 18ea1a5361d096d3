"""Policy backend on Megatron-core's ``GPTModel`` (Llama / Qwen2-style: RMSNorm, SwiGLU, rotary, GQA).

``MegatronPolicy(model_cfg, trainer_cfg, loss_cfg, seed, tokenizer)`` mirrors ``TorchPolicy``:
- The architecture comes from a Hugging Face config: ``model_cfg.hf_path``'s ``config.json`` when given (and its
  safetensors are loaded), else a ``LlamaConfig`` built from ``ModelConfig`` and the tokenizer, initialised the
  way ``transformers`` initialises ``LlamaForCausalLM`` under ``torch.manual_seed(seed)`` on the CPU (so a
  generation backend built from the same config and seed starts from the same weights).
- Weights cross the HF <-> Megatron boundary through one mapping (``hf_to_megatron`` / ``megatron_to_hf``): HF's
  separate q/k/v projections become Megatron's fused ``linear_qkv`` with the per-group interleaving GQA needs
  (for each KV group: its query heads, then its key head, then its value head), HF's gate/up projections become
  the fused SwiGLU ``linear_fc1`` (``[gate; up]``, per tensor-parallel shard).
- Training: bf16 (or fp32) parameters; on CUDA the model is wrapped in Megatron's ``DistributedDataParallel`` and
  stepped by ``get_megatron_optimizer`` (fp32 master weights, TP-aware grad clipping); elsewhere (CPU) a torch
  AdamW steps the bare model. ``trainer_cfg.options["optimizer"]`` (``"megatron"`` / ``"torch"``) overrides.
- The split step: ``begin_train_step`` zeroes gradients and the step's sums, ``train_microbatches`` accumulates
  gradients of ``grpo_loss``'s *un-normalised* ``loss_sum``, ``finish_train_step`` divides the gradients once by
  the step's normaliser (all-reduced over data-parallel ranks), clips and steps. The result does not depend on
  how the step was split into chunks or micro-batches.
- Parallelism through ``megatron.core.parallel_state``: ``trainer_cfg.tensor_parallel`` x ``data_parallel`` must
  equal the world size. ``torch.distributed`` and the model-parallel groups are initialised only if nobody did
  yet (a single process gets a world of one on a free local port). Data-parallel ranks train on their share of
  each batch's rows; ``export_weights`` gathers tensor-parallel shards into full HF tensors.

Megatron-core is imported lazily (inside functions), so ``asyncrl`` imports without it. Megatron-core on a CPU
needs workarounds that live in the tests (see ``tests/test_megatron_backend.py``), not here.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

import torch

from asyncrl.algorithms import LossConfig, grpo_loss, token_entropy, token_logprobs
from asyncrl.backends.base import TrainBatch

__all__ = [
    "MegatronPolicy",
    "build_hf_config",
    "init_hf_state_dict",
    "load_hf_state_dict",
    "hf_to_megatron",
    "megatron_to_hf",
    "ArchSpec",
]


# --------------------------------------------------------------------------------------------------------------
# Hugging Face side: config, initial weights, checkpoint loading (no Megatron needed; vllm.py uses these too)
# --------------------------------------------------------------------------------------------------------------


def build_hf_config(model_cfg: Any, tokenizer: Any = None) -> Any:
    """The Hugging Face config of ``model_cfg``: read from ``hf_path`` when set, else a ``LlamaConfig`` built from
    the ``ModelConfig`` fields and the tokenizer (vocabulary size and special token ids)."""
    from transformers import AutoConfig

    if getattr(model_cfg, "hf_path", None):
        return AutoConfig.from_pretrained(model_cfg.hf_path)
    if tokenizer is None:
        raise ValueError("a model built from ModelConfig (no hf_path) needs the tokenizer for its vocabulary")
    return model_cfg.llama_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                                  tokenizer.eos_token_id)


def _hf_model_class(hf_config: Any) -> Any:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if getattr(hf_config, "model_type", "llama") == "llama":
        return LlamaForCausalLM
    return lambda cfg: AutoModelForCausalLM.from_config(cfg)


def init_hf_model(hf_config: Any, seed: int) -> Any:
    """A freshly initialised fp32 HF causal LM on the CPU: ``torch.manual_seed(seed)`` then the model's own
    initialisation, without touching the caller's RNG state. Deterministic in ``seed`` on any machine."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _hf_model_class(hf_config)(hf_config)
    return model.float().eval()


def init_hf_state_dict(hf_config: Any, seed: int) -> dict[str, torch.Tensor]:
    """``init_hf_model(hf_config, seed).state_dict()``: the HF-named initial weights."""
    return dict(init_hf_model(hf_config, seed).state_dict())


def load_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files (or ``pytorch_model*.bin``) in a HF checkpoint directory."""
    from pathlib import Path

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


# --------------------------------------------------------------------------------------------------------------
# The HF <-> Megatron mapping (pure tensor code, also used by the tests)
# --------------------------------------------------------------------------------------------------------------


class ArchSpec:
    """The shape facts the weight mapping needs, read from a HF config."""

    def __init__(self, hf_config: Any):
        c = hf_config
        model_type = getattr(c, "model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"MegatronPolicy supports Llama/Qwen2-style models, not model_type={model_type!r}")
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
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise ValueError(f"rope_type {rope_type!r} is not supported (only plain rotary embeddings)")
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        self.rope_theta = float(theta if theta is not None else getattr(c, "rope_theta", 10000.0))
        act = getattr(c, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
        # Qwen2 has q/k/v biases; Llama has them (and an o_proj bias) only with attention_bias.
        self.qkv_bias = model_type == "qwen2" or bool(getattr(c, "attention_bias", False))
        if model_type == "llama" and getattr(c, "attention_bias", False):
            raise ValueError("Llama attention_bias=True (an o_proj bias) is not supported")
        if getattr(c, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of {self.num_kv_heads}")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


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
    """The order ``LlamaForCausalLM.state_dict()`` uses (keys are what matters; order helps people reading)."""
    keys = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v"):
            keys.append(p + f"self_attn.{proj}_proj.weight")
            if spec.qkv_bias:
                keys.append(p + f"self_attn.{proj}_proj.bias")
        keys += [p + "self_attn.o_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
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


# --------------------------------------------------------------------------------------------------------------
# Distributed setup
# --------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_parallel(tensor_parallel: int, data_parallel: int, device: torch.device, seed: int) -> None:
    """Initialise ``torch.distributed`` (if nobody did) and Megatron's model-parallel groups (if nobody did).

    Under a launcher (``RANK``/``WORLD_SIZE`` in the environment) the process group comes from ``env://``;
    a lone process gets a world of one on a free local port. NCCL on CUDA, gloo otherwise."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if tensor_parallel * data_parallel != world:
        raise ValueError(
            f"tensor_parallel {tensor_parallel} x data_parallel {data_parallel} != world size {world}"
            " (pipeline parallelism is not supported)"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    have_tp = parallel_state.get_tensor_model_parallel_world_size()
    have_dp = parallel_state.get_data_parallel_world_size()
    if (have_tp, have_dp) != (tensor_parallel, data_parallel):
        raise ValueError(
            f"model parallelism is already initialised with TP={have_tp}, DP={have_dp}; "
            f"the trainer config asks for TP={tensor_parallel}, DP={data_parallel}"
        )
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def _resolve_device(spec: str) -> torch.device:
    device = torch.device(spec)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        torch.cuda.set_device(device)
    return device


# --------------------------------------------------------------------------------------------------------------
# The policy backend
# --------------------------------------------------------------------------------------------------------------


class MegatronPolicy:
    """A ``PolicyBackend`` on Megatron-core's ``GPTModel``. See the module docstring."""

    def __init__(self, model_cfg: Any, trainer_cfg: Any, loss_cfg: LossConfig | None = None, seed: int = 0,
                 tokenizer: Any = None):
        from megatron.core import parallel_state

        self.model_cfg, self.trainer_cfg = model_cfg, trainer_cfg
        self.loss_cfg = loss_cfg if loss_cfg is not None else LossConfig()
        self.seed = seed
        self.tokenizer = tokenizer
        self.options = dict(getattr(trainer_cfg, "options", {}) or {})
        self.device = _resolve_device(getattr(trainer_cfg, "device", "cpu"))
        self.dtype = torch.bfloat16 if model_cfg.dtype == "bfloat16" else torch.float32
        self.tp = int(getattr(trainer_cfg, "tensor_parallel", 1))
        self.dp = int(getattr(trainer_cfg, "data_parallel", 1))
        init_parallel(self.tp, self.dp, self.device, seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()

        self.hf_config = build_hf_config(model_cfg, tokenizer)
        self.spec = ArchSpec(self.hf_config)
        self.padded_vocab = math.ceil(self.spec.vocab_size / self.tp) * self.tp
        self.model = self._build_model()
        if model_cfg.hf_path:
            hf_sd = load_hf_state_dict(model_cfg.hf_path)
        else:
            hf_sd = init_hf_state_dict(self.hf_config, seed)
        self.load_hf_weights(hf_sd)
        del hf_sd

        self.optimizer_kind = self.options.get("optimizer", "megatron" if self.device.type == "cuda" else "torch")
        if self.optimizer_kind not in ("megatron", "torch"):
            raise ValueError(f"trainer.options.optimizer must be 'megatron' or 'torch', got {self.optimizer_kind!r}")
        self.compute_entropy = bool(self.options.get("compute_entropy", True))
        self._build_optimizer()
        self.steps = 0
        self._masks: dict[int, torch.Tensor] = {}
        self._reset_step_sums()
        self._in_step = False

    # ---- construction ------------------------------------------------------------------------------------------

    def _transformer_config(self) -> Any:
        import torch.nn.functional as F
        from megatron.core.transformer.transformer_config import TransformerConfig

        s = self.spec
        return TransformerConfig(
            num_layers=s.num_layers,
            hidden_size=s.hidden_size,
            ffn_hidden_size=s.intermediate_size,
            num_attention_heads=s.num_heads,
            num_query_groups=s.num_kv_heads,
            kv_channels=s.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=s.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=s.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=s.initializer_range,
            tensor_model_parallel_size=self.tp,
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            pipeline_dtype=self.dtype,
            use_cpu_initialization=self.device.type != "cuda",
            perform_initialization=False,  # the weights come from HF (checkpoint or HF's own init)
            calculate_per_token_loss=True,  # DDP sums gradients over DP ranks; we normalise once per step
            attention_softmax_in_fp32=True,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
        )

    def _build_model(self) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        self.transformer_config = self._transformer_config()
        model = GPTModel(
            config=self.transformer_config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=self.padded_vocab,
            max_sequence_length=self.spec.max_position_embeddings,
            share_embeddings_and_output_weights=self.spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=self.spec.rope_theta,
        )
        # Torch's norm fallback keeps fp32 parameters: cast the whole model (FACTS: megatron-core on GPU).
        model = model.to(device=self.device, dtype=self.dtype)
        for name, p in model.named_parameters():
            dim = partition_dim(name)
            if dim is not None and not getattr(p, "tensor_model_parallel", False):
                # megatron-core < 0.17 leaves these unset when perform_initialization=False; the grad norm needs them
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
        return model

    def _build_optimizer(self) -> None:
        tc = self.trainer_cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.num_parameters = sum(p.numel() for p in params)
        b1, b2 = tuple(getattr(tc, "betas", (0.9, 0.999)))
        if self.optimizer_kind == "megatron":
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ddp_cfg = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False,
                average_in_collective=False,
            )
            self.ddp = DistributedDataParallel(config=self.transformer_config, ddp_config=ddp_cfg, module=self.model)
            opt_cfg = OptimizerConfig(
                optimizer="adam", lr=tc.lr, min_lr=tc.lr, weight_decay=tc.weight_decay, adam_beta1=b1, adam_beta2=b2,
                adam_eps=float(self.options.get("adam_eps", 1e-8)), clip_grad=float(tc.grad_clip or 0.0),
                bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype, use_distributed_optimizer=False,
            )
            self.optimizer = get_megatron_optimizer(opt_cfg, [self.ddp])
            for group in self.optimizer.param_groups:
                group["lr"] = tc.lr
            self._forward_module: torch.nn.Module = self.ddp
        else:
            self.ddp = None
            self.optimizer = torch.optim.AdamW(
                params, lr=tc.lr, betas=(b1, b2), weight_decay=tc.weight_decay,
                eps=float(self.options.get("adam_eps", 1e-8)),
            )
            self._forward_module = self.model

    # ---- weights -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_hf_weights(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named full tensors into this rank's Megatron parameters."""
        full = hf_to_megatron(hf_state, self.spec)
        params = dict(self.model.named_parameters())
        missing = sorted(set(params) - set(full))
        if missing:
            raise KeyError(f"no HF weights for Megatron parameters {missing[:5]}")
        for name, p in params.items():
            piece = shard_for_tp(name, full[name], self.tp_rank, self.tp, self.padded_vocab)
            if piece.shape != p.shape:
                raise ValueError(f"{name}: HF weights give shape {tuple(piece.shape)}, the model has {tuple(p.shape)}")
            p.copy_(piece.to(device=p.device, dtype=p.dtype))
        if self.__dict__.get("optimizer") is not None and self.optimizer_kind == "megatron":
            self._reload_main_params()

    def _reload_main_params(self) -> None:
        """After writing model params directly, refresh the Megatron optimizer's fp32 master copies."""
        for opt in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            for model_group, main_group in zip(getattr(opt, "float16_groups", []),
                                               getattr(opt, "fp32_from_float16_groups", [])):
                for mp, fp in zip(model_group, main_group):
                    fp.data.copy_(mp.data)

    @torch.no_grad()
    def _full_megatron_state(self) -> dict[str, torch.Tensor]:
        """Full (TP-gathered) Megatron tensors on this rank's device."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        out = {}
        group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        for name, p in self.model.named_parameters():
            t = p.detach()
            if self.tp > 1 and partition_dim(name) is not None:
                pieces = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(pieces, t.contiguous(), group=group)
                t = unshard_from_tp(name, pieces)
            out[name] = t
        return out

    @torch.no_grad()
    def export_weights(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None
                       ) -> dict[str, torch.Tensor]:
        """Current weights under HF names (``LlamaForCausalLM.state_dict()``'s), full tensors on every TP rank,
        as fresh contiguous tensors (training does not change them afterwards). Default: the model's device and
        dtype (what an in-process vLLM loads fastest)."""
        hf = megatron_to_hf(self._full_megatron_state(), self.spec)
        tied: dict[int, torch.Tensor] = {}
        out = {}
        for k, v in hf.items():
            key = id(v) if self.spec.tie_word_embeddings and k in ("model.embed_tokens.weight", "lm_head.weight") else None
            if key is not None and key in tied:
                out[k] = tied[key]
                continue
            t = v.to(device=device or v.device, dtype=dtype or v.dtype).contiguous().clone()
            if key is not None:
                tied[key] = t
            out[k] = t
        return out

    def state_dict(self) -> dict[str, Any]:
        """This rank's Megatron parameters (CPU copies), optimizer state and step count."""
        model = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()
                 if isinstance(v, torch.Tensor)}
        return {
            "format": "asyncrl.megatron/1",
            "tp": self.tp, "tp_rank": self.tp_rank, "dp": self.dp,
            "optimizer_kind": self.optimizer_kind,
            "model": model,
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != "asyncrl.megatron/1":
            raise ValueError(f"not a MegatronPolicy state (format {state.get('format')!r})")
        if (state["tp"], state["tp_rank"]) != (self.tp, self.tp_rank):
            raise ValueError(f"state saved at TP={state['tp']} rank {state['tp_rank']}, loading into TP={self.tp} "
                             f"rank {self.tp_rank}")
        if state["optimizer_kind"] != self.optimizer_kind:
            raise ValueError(f"state has a {state['optimizer_kind']!r} optimizer, this policy a {self.optimizer_kind!r}")
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for k, v in state["model"].items():
                if k in params:
                    params[k].copy_(v.to(device=params[k].device, dtype=params[k].dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    # ---- forward -----------------------------------------------------------------------------------------------

    def _causal_mask(self, S: int) -> torch.Tensor:
        mask = self._masks.get(S)
        if mask is None:
            mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=self.device), 1).view(1, 1, S, S)
            self._masks[S] = mask
        return mask

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S, V] logits (full vocabulary on every TP rank). Right padding needs no mask beyond causal."""
        B, S = input_ids.shape
        pos = torch.arange(S, device=self.device).unsqueeze(0).expand(B, S)
        logits = self._forward_module(input_ids, pos, self._causal_mask(S), runtime_gather_output=True)
        return logits[..., : self.spec.vocab_size]

    def _micro_batches(self, batch: TrainBatch):
        mbs = getattr(self.trainer_cfg, "micro_batch_size", None) or batch.num_sequences
        for start in range(0, batch.num_sequences, mbs):
            yield batch.slice(start, min(start + mbs, batch.num_sequences))

    def _to_device(self, batch: TrainBatch) -> TrainBatch:
        mv = lambda t: None if t is None else t.to(self.device, non_blocking=True)  # noqa: E731
        return TrainBatch(mv(batch.input_ids), mv(batch.attention_mask), mv(batch.loss_mask.float()),
                          mv(batch.gen_logprobs.float()), mv(batch.advantages.float()), list(batch.group_sizes),
                          mv(batch.prev_logprobs), mv(batch.ref_logprobs))

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, S] float32 logprobs of ``batch.input_ids`` (0 off ``loss_mask``), on the CPU. Every DP rank computes
        the whole batch."""
        self.model.eval()
        out = []
        for mb in self._micro_batches(batch):
            ids = mb.input_ids.to(self.device)
            lp = token_logprobs(self._logits(ids), ids).float()
            out.append((lp * mb.loss_mask.to(self.device)).cpu())
        return torch.cat(out, 0)

    # ---- the split train step ------------------------------------------------------------------------------------

    def _reset_step_sums(self) -> None:
        self._loss_sum = 0.0
        self._normaliser = 0.0
        self._sequences = 0
        self._sums: dict[str, float] = {}
        self._max = -math.inf
        self._min = math.inf

    def begin_train_step(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._reset_step_sums()
        self._in_step = True

    def _dp_rows(self, batch: TrainBatch) -> TrainBatch:
        if self.dp == 1:
            return batch
        B = batch.num_sequences
        lo, hi = B * self.dp_rank // self.dp, B * (self.dp_rank + 1) // self.dp
        return batch.slice(lo, hi)

    def train_microbatches(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward over this DP rank's rows of ``batch`` in micro-batches; gradients of the un-normalised
        loss accumulate until ``finish_train_step``."""
        if not self._in_step:
            raise RuntimeError("train_microbatches before begin_train_step")
        self.model.train()
        chunk_loss, chunk_norm, chunk_tokens = 0.0, 0.0, 0.0
        local = self._dp_rows(batch)
        if local.num_sequences == 0:
            return {"loss_sum": 0.0, "normaliser": 0.0, "tokens": 0.0, "sequences": 0}
        for mb in self._micro_batches(local):
            mb = self._to_device(mb)
            logits = self._logits(mb.input_ids)
            lp = token_logprobs(logits, mb.input_ids)
            entropy = None
            if self.loss_cfg.entropy_coef > 0:
                entropy = token_entropy(logits)
            elif self.compute_entropy:
                with torch.no_grad():
                    entropy = token_entropy(logits.detach())
            loss_sum, normaliser, metrics = grpo_loss(lp, mb, self.loss_cfg, entropy)
            loss_sum.backward()
            chunk_loss += float(loss_sum.detach())
            chunk_norm += normaliser
            chunk_tokens += metrics["tokens"]
            for k, v in metrics.items():
                if k == "is_weight_max":
                    self._max = max(self._max, v) if metrics["tokens"] else self._max
                elif k == "is_weight_min":
                    self._min = min(self._min, v) if metrics["tokens"] else self._min
                else:
                    self._sums[k] = self._sums.get(k, 0.0) + v
            self._sequences += mb.num_sequences
        self._loss_sum += chunk_loss
        self._normaliser += chunk_norm
        return {"loss_sum": chunk_loss, "normaliser": chunk_norm, "tokens": chunk_tokens,
                "sequences": local.num_sequences}

    def _dp_sum(self, values: list[float]) -> list[float]:
        if self.dp == 1:
            return values
        import torch.distributed as dist
        from megatron.core import parallel_state

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return t.tolist()

    def finish_train_step(self) -> dict[str, float]:
        """Divide the accumulated gradients by the step's normaliser, clip, take one optimizer step."""
        if not self._in_step:
            raise RuntimeError("finish_train_step before begin_train_step")
        keys = sorted(self._sums)
        totals = self._dp_sum([self._loss_sum, self._normaliser, float(self._sequences)] + [self._sums[k] for k in keys])
        loss_sum, normaliser, sequences = totals[:3]
        sums = dict(zip(keys, totals[3:]))
        scale = 1.0 / normaliser if normaliser > 0 else 0.0
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
            self.ddp.scale_gradients(scale)
            ok, grad_norm, _ = self.optimizer.step()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            if not ok:
                raise RuntimeError("the Megatron optimizer skipped its step (non-finite gradients?)")
        else:
            grad_norm = self._torch_step(scale)
        self.steps += 1
        self._in_step = False
        tokens = sums.get("tokens", 0.0)
        per_tok = lambda k: sums.get(k, 0.0) / tokens if tokens else 0.0  # noqa: E731
        return {
            "loss": loss_sum * scale,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": tokens,
            "sequences": sequences,
            "is_weight_mean": per_tok("is_weight_sum"),
            "is_weight_max": self._max if self._max > -math.inf else 0.0,
            "is_weight_min": self._min if self._min < math.inf else 0.0,
            "is_truncated_frac": per_tok("is_truncated_sum"),
            "clip_frac": per_tok("clipped_sum"),
            "kl": per_tok("kl_sum"),
            "entropy": per_tok("entropy_sum"),
        }

    def _torch_step(self, scale: float) -> float:
        """DP all-reduce (sum), normalise, TP-aware clip, AdamW step. Returns the (pre-clip) gradient norm."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.dp > 1:
            group = parallel_state.get_data_parallel_group()
            for p in params:
                dist.all_reduce(p.grad, group=group)
        for p in params:
            p.grad.mul_(scale)
        sharded = torch.zeros((), dtype=torch.float32, device=self.device)
        replicated = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:
            sq = p.grad.float().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.tp > 1:
            dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        norm = float((sharded + replicated).sqrt())
        clip = getattr(self.trainer_cfg, "grad_clip", None)
        if clip and norm > clip and math.isfinite(norm):
            for p in params:
                p.grad.mul_(clip / (norm + 1e-6))
        self.optimizer.step()
        return norm

    def close(self) -> None:
        """Release the model and optimizer (the process groups stay: others may share them)."""
        self.__dict__.pop("optimizer", None)
        self.__dict__.pop("ddp", None)
        self.__dict__.pop("model", None)
        self.__dict__.pop("_forward_module", None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
