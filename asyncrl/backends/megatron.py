"""Policy backend on Megatron-core's ``GPTModel`` (Llama / Qwen2-style: RMSNorm, SwiGLU, rotary, GQA).

``MegatronPolicy(model_cfg, trainer_cfg, loss, seed, tokenizer)`` mirrors ``TorchPolicy``:
- The architecture comes from a Hugging Face config (``hf.build_hf_config``): ``model_cfg.hf_path``'s when given
  (and its safetensors are loaded), else the ``LlamaConfig`` of ``ModelConfig`` with ``hf.init_hf_model``'s
  seeded weights, so every engine built from the same config and seed starts from the same weights.
- Weights cross the HF <-> Megatron boundary through one mapping, ``megatron_weights`` (fused qkv with GQA
  interleaving, fused SwiGLU ``linear_fc1``, tensor-parallel shards).
- Training: bf16 (or fp32) parameters; on CUDA the model is wrapped in Megatron's ``DistributedDataParallel`` and
  stepped by ``get_megatron_optimizer`` (fp32 master weights, TP-aware grad clipping); elsewhere (CPU) a torch
  AdamW steps the bare model. ``trainer_cfg.optimizer`` (``"megatron"`` / ``"torch"``) overrides.
- The split step: ``begin_train_step`` zeroes gradients and the step's accumulator, ``train_microbatches``
  accumulates gradients of the ``Loss``'s *un-normalised* ``loss_sum``, ``finish_train_step`` divides the gradients once by
  the step's normaliser (all-reduced over data-parallel ranks), clips and steps. The result does not depend on
  how the step was split into chunks or micro-batches.
- Parallelism through ``megatron.core.parallel_state``: ``trainer_cfg.tensor_parallel`` x ``data_parallel`` must
  equal the world size (setup in ``megatron_parallel``). The process group comes from torchrun (one controller per
  rank: every rank is given the whole batch and keeps its data-parallel share of the rows) or from a Ray rank group
  (``asyncrl/backends/ranks.py`` builds each rank after joining it and hands it only its share:
  ``keeps_own_rows = False``). Before the step's one division the data-parallel ranks sum their gradients (Megatron's
  DDP, or ``DataParallel`` with the torch optimizer) and their step totals (``DataParallel``), so every rank takes
  the same step; ``export_weights`` gathers tensor-parallel shards into full HF tensors.

- Previous-policy logprobs come from the training forward (``prev_logprobs_from_forward``): a chunk without
  ``prev_logprobs`` gets its forward's own, detached. Exact for the reason ``TorchPolicy`` gives (one optimizer step
  per RL step, in ``finish_train_step``), and because dropout is off (``hidden_dropout``/``attention_dropout`` 0), so
  train mode computes what ``logprobs``' eval mode does. It saves a forward pass and a call: on two H200s the
  separate pass was 14 of an asynchronous step's 59 ms on the trainer's side (benchmarks/README.md).
- Micro-batches (``asyncrl/micro_batches.py``, its invariants there): by default ``packed``, the chunk's sequences
  packed into rows as wide as its longest one, each seeing only itself (rotary embeddings are relative, so no
  per-sequence positions are needed), ``micro_batch_tokens`` positions a pass (on CUDA by default the most that fit
  the memory free at the first step). ``sorted`` pads each length-sorted micro-batch to its own longest, ``rows``
  (with ``micro_batch_size``) is the old fixed-size cut. The chunk goes to the device once, the loss's values come
  back once a chunk; ``train_tokens`` / ``train_padded_tokens`` / ``train_flops`` count the work.
- The forward (``megatron_forward``): the last hidden states, never the full-vocabulary logits (token logprobs
  and entropy from ``logprobs.chunked_logprobs``, ``logprob_chunk_tokens`` positions at a time, only where the
  loss mask is); on CUDA FlexAttention under a document mask (``trainer.attention``), a fused SwiGLU, ``trainer.compile``.
- Colocated with vLLM in one process (two pump threads): every method that runs GPU work holds the process's lock
  for the device (``device_lock``), so the two engines' kernels, allocations and NCCL calls never interleave.

Megatron-core is imported lazily (inside functions), so ``asyncrl`` imports without it. On a machine without CUDA
``megatron_parallel.init_parallel`` applies the two workarounds Megatron-core needs there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from asyncrl import micro_batches
from asyncrl.algorithms import Loss
from asyncrl.logprobs import chunked_logprobs
from asyncrl.backends.base import Capabilities, KeptVersions
from asyncrl.backends.data_parallel import DataParallel
from asyncrl.backends.device_lock import beside_device, holds_device
from asyncrl.backends.hf import build_hf_config, init_hf_state_dict, load_hf_state_dict
from asyncrl.backends.lr_schedule import set_lr
from asyncrl.backends.megatron_forward import (attention_kind, compile_layers, final_hidden, layer_spec, output_weight,
                                               pass_mask, resolve_budget)
from asyncrl.backends.megatron_parallel import init_parallel, resolve_device
from asyncrl.backends.megatron_step import megatron_optimizer_step
from asyncrl.backends.megatron_weights import ArchSpec, hf_to_megatron, megatron_to_hf, partition_dim, shard_for_tp, unshard_from_tp
from asyncrl.config import MegatronTrainerConfig, ModelConfig
from asyncrl.data import TrainBatch
from asyncrl.metrics import ENGINE_METRICS, Accumulator, peak_flops
__all__ = ["MEGATRON_CORE", "MegatronPolicy", "check_megatron_core"]

# The megatron-core releases this backend is run against: 0.16.1 in CI (Python 3.11, CPU), 0.19.2 on the H200s
# (docs/gpu.md). pyproject.toml's ``megatron`` extra declares the same range (tests/test_megatron_backend.py).
MEGATRON_CORE = ">=0.16.1,<0.20"


def check_megatron_core(version: str | None = None) -> str:
    """The installed megatron-core version, or a clear ImportError when it is outside ``MEGATRON_CORE``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        import megatron.core

        version = megatron.core.__version__
    try:
        ok = Version(version) in SpecifierSet(MEGATRON_CORE)
    except InvalidVersion:
        ok = False
    if not ok:
        raise ImportError(f"megatron-core {version} is not supported: asyncrl's Megatron backend runs on megatron-core"
                          f"{MEGATRON_CORE} (pip install 'megatron-core{MEGATRON_CORE}')")
    return version


# --------------------------------------------------------------------------------------------------------------
# The policy backend
# --------------------------------------------------------------------------------------------------------------


class MegatronPolicy(KeptVersions):
    """A ``PolicyBackend`` on Megatron-core's ``GPTModel``. See the module docstring."""

    # prev_logprobs_from_forward: exact with dropout off (module docstring). A Ray rank group builds it only after
    # its actor joined torch.distributed's default group (ranks.py). Through a Ray proxy the pipelined calls return
    # at once and the proxy's next call waits for them (asyncrl/backends/ray.py): nothing reads what they return,
    # and a step's calls reach the actor back to back.
    capabilities = Capabilities(prev_logprobs_from_forward=True, needs_process_group=True, keeps_versions=True,
                                ray_pipelined=frozenset({"begin_train_step", "train_microbatches"}))

    def __init__(self, model_cfg: ModelConfig, trainer_cfg: MegatronTrainerConfig, loss: Loss, seed: int = 0,
                 tokenizer: Any = None):
        check_megatron_core()
        from megatron.core import parallel_state

        self.model_cfg, self.trainer_cfg, self.loss = model_cfg, trainer_cfg, loss
        self.seed = seed
        self.tokenizer = tokenizer
        self.device = resolve_device(trainer_cfg.device)
        self.dtype = torch.bfloat16 if model_cfg.dtype == "bfloat16" else torch.float32
        self.tp = trainer_cfg.tensor_parallel
        self.dp = trainer_cfg.data_parallel
        self.attention = attention_kind(trainer_cfg.attention, self.device)
        init_parallel(self.tp, self.dp, self.device, seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.keeps_own_rows = True  # torchrun: the whole batch comes to every rank (ranks.py sets False)
        self.data_parallel = DataParallel(
            parallel_state.get_data_parallel_group(), self.dp_rank, self.dp, self.device) if self.dp > 1 else None

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

        self.optimizer_kind = trainer_cfg.optimizer or ("megatron" if self.device.type == "cuda" else "torch")
        self.compute_entropy = trainer_cfg.compute_entropy
        self._build_optimizer()
        self.steps = 0
        self._masks: dict[int, torch.Tensor] = {}
        self._budget: int | None = None  # micro_batch_tokens, resolved at the first pass (_fit_budget), and why:
        self.memory_plan: dict[str, Any] = {}
        self._step = Accumulator(loss.metrics + ENGINE_METRICS)
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
            add_qkv_bias=s.qkv_bias, qk_layernorm=s.qk_norm,  # Qwen3's per-head q/k RMSNorm
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
            bias_activation_fusion=self.device.type == "cuda",  # one compiled SwiGLU kernel each way
            bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
            persist_layer_norm=False, gradient_accumulation_fusion=False,
            **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
               if self.trainer_cfg.gradient_checkpointing else {}),  # trainer.gradient_checkpointing
        )

    def _build_model(self) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        self.transformer_config = self._transformer_config()
        model = GPTModel(
            config=self.transformer_config,
            transformer_layer_spec=layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=self.spec.qk_norm), self.attention),
            vocab_size=self.padded_vocab,
            max_sequence_length=self.spec.max_position_embeddings,
            share_embeddings_and_output_weights=self.spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=self.spec.rope_theta, **self.spec.rope_kwargs,  # Llama 3's rope scaling
        )
        # Torch's norm fallback keeps fp32 parameters: cast the whole model (FACTS: megatron-core on GPU).
        model = model.to(device=self.device, dtype=self.dtype)
        self.compiled = compile_layers(model, self.trainer_cfg.compile, self.attention, self.device)  # in place
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
        # the whole model's (a tensor-parallel shard counts tp times): what 6 x parameters x tokens counts
        self.full_parameters = sum(p.numel() * (self.tp if getattr(p, "tensor_model_parallel", False) else 1)
                                   for p in params)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak_flops = 0.0 if math.isnan(peak_flops(name)) else peak_flops(name) * self.tp  # 0: unknown
        b1, b2 = tc.betas
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
                adam_eps=tc.adam_eps, clip_grad=float(tc.grad_clip or 0.0),
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
                eps=tc.adam_eps,
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

    @holds_device
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

    def _fit_budget(self) -> None:
        """Resolve ``micro_batch_tokens`` once, before the first pass (``megatron_forward.resolve_budget``)."""
        moments = 8.0 * self.num_parameters if self.steps == 0 else 0.0  # Adam's fp32 moments, made at step 1
        self._budget, self.memory_plan = resolve_budget(self.trainer_cfg, self.spec, self.dtype, self.attention,
                                                        self.tp, self.device, moments)

    def _passes(self, batch: TrainBatch, entropy: bool):
        """``(micro-batch, its sequences [n, width], logprobs [n, width], entropy [n, width] or None)`` for every
        micro-batch of ``batch`` (moved to the device once; the plan is ``micro_batches.plan``'s, so ``logprobs``
        and training cut a chunk alike). Values only under the loss mask (0 elsewhere): the output layer runs on
        those positions alone, ``logprob_chunk_tokens`` at a time."""
        from megatron.core import parallel_state

        tc = self.trainer_cfg
        if self._budget is None and self.device.type == "cuda":
            self._fit_budget()
        budget = self._budget if self.device.type == "cuda" else tc.micro_batch_tokens
        plans = micro_batches.plan(batch, tc.micro_batching, tc.micro_batch_size, budget)
        on_device = batch.map(lambda t: t.to(self.device, non_blocking=True))
        weight = output_weight(self.model)
        group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        for mb in plans:
            mb = mb.to(self.device)
            seqs = micro_batches.take(on_device, mb)
            ids = seqs.input_ids if mb.packed is None else micro_batches.packed_ids(on_device, mb)
            rows, width = ids.shape
            mask = pass_mask(self.attention, mb, rows, width, self.device, self._masks)
            hidden = final_hidden(self.model, self._forward_module, ids, mask)
            src, dst, targets = micro_batches.predicting_positions(mb, seqs, rows, width, seq_first=True)
            lp, ent = chunked_logprobs(hidden.reshape(rows * width, -1)[src], weight, targets,
                                       tc.logprob_chunk_tokens, entropy, self.spec.vocab_size,
                                       self.tp_rank * weight.shape[0], group)
            shape = tuple(seqs.loss_mask.shape)
            yield (mb, seqs, micro_batches.scatter_positions(lp, dst, shape),
                   None if ent is None else micro_batches.scatter_positions(ent, dst, shape))

    @beside_device  # beside vLLM's decoding under device_sharing 'overlap' (device_lock.py), else its turn
    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, S] float32 logprobs of ``batch.input_ids`` (0 off ``loss_mask``), on the CPU: of the whole batch it
        is given (under torchrun every DP rank gets and computes the whole batch)."""
        self.model.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        for mb, seqs, lp, _ in self._passes(batch, entropy=False):
            out[mb.rows, :mb.width] = lp.float() * seqs.loss_mask
        return out.cpu()

    # ---- the split train step ------------------------------------------------------------------------------------

    @holds_device
    def begin_train_step(self) -> None:
        if self._budget is None and self.device.type == "cuda":  # before the first pass: fits, or names the knob
            self._fit_budget()
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._step.reset()
        self._step.add({"peak_flops": self.peak_flops})  # before the DP reduction: the step's devices add up
        self._in_step = True

    def _dp_rows(self, batch: TrainBatch) -> TrainBatch:
        if self.dp == 1 or not self.keeps_own_rows:
            return batch
        B = batch.num_sequences
        lo, hi = B * self.dp_rank // self.dp, B * (self.dp_rank + 1) // self.dp
        return batch.slice(lo, hi)

    @beside_device
    def train_microbatches(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward over this DP rank's rows of ``batch`` in micro-batches; gradients of the un-normalised
        loss accumulate until ``finish_train_step``."""
        if not self._in_step:
            raise RuntimeError("train_microbatches before begin_train_step")
        if self.loss.needs_reference and batch.ref_logprobs is None:
            raise ValueError(f"{self.loss!r} needs ref_logprobs in the batch: MegatronPolicy has no reference model")
        self.model.train()
        local = self._dp_rows(batch)
        if local.num_sequences == 0:
            return {"loss_sum": 0.0, "normaliser": 0.0, "sequences": 0.0}
        parts = []  # every micro-batch's contributions, on the device: one transfer at the end of the chunk
        for mb, seqs, lp, entropy in self._passes(local, self.loss.entropy_grad or self.compute_entropy):
            if seqs.prev_logprobs is None:  # this step's weights are the previous policy (module docstring)
                seqs = replace(seqs, prev_logprobs=lp.detach() * seqs.loss_mask)
            if entropy is not None and not self.loss.entropy_grad:
                entropy = entropy.detach()
            loss_sum, normaliser, contributions = self.loss(lp, seqs, entropy)
            loss_sum.backward()
            parts.append({**contributions, "loss": loss_sum.detach(), "normaliser": normaliser,
                          "train_tokens": mb.real_tokens, "train_padded_tokens": mb.positions})
        totals = micro_batches.add_all(self._step, parts)
        self._step.add({"sequences": local.num_sequences,
                        "train_flops": 6.0 * self.full_parameters * totals["train_tokens"]})
        return {"loss_sum": totals["loss"], "normaliser": totals["normaliser"],
                "sequences": float(local.num_sequences)}

    @holds_device
    def finish_train_step(self) -> dict[str, float]:
        """Divide the accumulated gradients by the step's normaliser, clip, take one optimizer step."""
        if not self._in_step:
            raise RuntimeError("finish_train_step before begin_train_step")
        if self.data_parallel is not None:  # every DP rank normalises by the whole step's tokens
            self.data_parallel.reduce_step(self._step)
        normaliser = self._step.total("normaliser")
        scale = 1.0 / normaliser if normaliser > 0 else 0.0
        lr = set_lr(self.optimizer.param_groups, self.trainer_cfg, self.steps)  # trainer.lr_schedule at this step
        finite_loss = math.isfinite(self._step.total("loss"))  # else no update (PolicyBackend.finish_train_step)
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
            self.ddp.scale_gradients(scale)
        grad_norm, stepped = (megatron_optimizer_step(self.optimizer, finite_loss) if self.ddp is not None
                              else self._torch_step(scale, finite_loss))
        self.steps += int(stepped)  # a skipped update leaves the learning-rate schedule where it was
        self._in_step = False
        self._step.add({"grad_norm": grad_norm, "lr": lr})
        metrics = self._step.result()
        self._step.reset()
        return metrics

    def _torch_step(self, scale: float, finite_loss: bool) -> tuple[float, bool]:
        """DP all-reduce (sum), normalise, TP-aware clip, AdamW step (none when the loss or the norm is not finite).
        Returns the (pre-clip) gradient norm and whether it stepped."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.data_parallel is not None:  # a rank that sat the step out adds zeros
            self.data_parallel.reduce_grads(params)
        params = [p for p in params if p.grad is not None]
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
        norm, clip = float((sharded + replicated).sqrt()), self.trainer_cfg.grad_clip
        if not (finite_loss and math.isfinite(norm)):
            return norm, False  # the gradients are zeroed by the next begin_train_step
        for p in params if clip and norm > clip else ():
            p.grad.mul_(clip / (norm + 1e-6))
        self.optimizer.step()
        return norm, True

    def close(self) -> None:
        """Release the model, the optimizer and the weights kept of older versions (the process groups stay:
        others may share them)."""
        for name in ("optimizer", "ddp", "model", "_forward_module", "_kept"):
            self.__dict__.pop(name, None)
        self._masks = {}
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
