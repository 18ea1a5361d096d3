"""The embedded backend: a small Hugging Face Llama trained and sampled with plain torch, on CPU or one GPU.

- The model comes from ``asyncrl.backends.hf.build_model`` (the seeded HF init every engine shares).
- ``TorchPolicy``: the :class:`~asyncrl.backends.base.PolicyBackend` — logprobs, gradient accumulation over any
  number of chunks/micro-batches, one AdamW step per RL step with the loss normalised over the whole step.
- ``TorchGenerator``: the :class:`~asyncrl.backends.base.GenerationBackend` — its *own* model copy (a weight sync
  is a real copy), one batched sampling call per ``poll`` with a KV cache (``asyncrl/backends/torch_decode.py``),
  seeded by its own ``torch.Generator``; its queue is ``asyncrl/backends/submit_queue.py``'s, shared with the
  child-process placement.

Determinism: a policy and a generator built with the same ``seed`` start from identical weights (version 0).
Sampling draws come only from the generator's private ``torch.Generator`` (seeded with ``seed``), so a rollout
depends only on the seed, the sequence of ``submit``/``poll`` calls and the loaded weights. Greedy evaluation
(``generate_greedy``) draws nothing and never disturbs the sampling stream.

Logprobs: the generator reports, for each sampled token, its logprob under the model's own distribution at
temperature 1 without top-p (``log_softmax(logits)``), whatever temperature/top-p it sampled with. That is the
quantity ``TorchPolicy.logprobs`` computes, so ``exp(prev - gen)`` measures only weight staleness and numerical
differences between the two forward paths (KV-cached vs full sequence), which are ~1e-6 on CPU float32.

Threads: the backends leave torch's thread pool alone; ``Config.torch_threads`` sizes it (one thread per pump
avoids OpenMP oversubscription when generation and training overlap; measurements in ``benchmarks/README.md``).

Save/restore: ``TorchPolicy.state_dict()`` (weights, AdamW state, reference weights) and
``TorchGenerator.state_dict()`` (version, sampling RNG state, weights) restore a run exactly.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from asyncrl import micro_batches
from asyncrl.algorithms import Loss
from asyncrl.logprobs import chunked_logprobs
from asyncrl.backends.base import Capabilities, KeptVersions
import asyncrl.backends.lora as lora
from asyncrl.backends.device_lock import holds_device
from asyncrl.backends.hf import DTYPES, build_model, special_ids
from asyncrl.backends.lr_schedule import set_lr
from asyncrl.backends.sampling import group_max_tokens
from asyncrl.backends.submit_queue import SubmitQueue
from asyncrl.backends.torch_decode import _sample_from, decode, greedy_completions, stop_strings
from asyncrl.config import ModelConfig, TorchGenerationConfig, TorchTrainerConfig
from asyncrl.data import GenerationRequest, GroupRollouts, TrainBatch
from asyncrl.metrics import ENGINE_METRICS, Accumulator, peak_flops

# --- the policy's logprobs (every forward of training and scoring goes through here) ----------

def sequence_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, V] logits of a (right-padded) batch. Right padding cannot influence earlier positions under causal
    attention, so the mask is only passed when some row starts with padding (left padding)."""
    if attention_mask is not None and bool(attention_mask[:, 0].all()):
        attention_mask = None
    kwargs: dict[str, Any] = {"use_cache": False}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
        kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=input_ids, **kwargs).logits


def _logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, entropy_grad: bool):
    """``token_logprobs`` and ``token_entropy`` from one full log-softmax (for a model whose output layer is not a
    plain bias-free linear map, see ``policy_logprobs``); the entropy is detached unless ``entropy_grad``."""
    logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    src = logp_all if entropy_grad else logp_all.detach()
    entropy = -(src.exp() * src).sum(-1)
    pad = torch.nn.functional.pad
    return pad(picked, (1, 0)), pad(entropy, (1, 0))


def _chunkable(model) -> bool:
    """Whether the logits are ``last hidden state @ output weight.T`` and nothing more (Llama, Qwen, Mistral)."""
    head = model.get_output_embeddings()
    cfg = model.config
    return (isinstance(head, torch.nn.Linear) and head.bias is None and not getattr(cfg, "final_logit_softcapping", None)
            and getattr(cfg, "logit_scale", None) in (None, 1.0))


def policy_logprobs(model, seqs: TrainBatch, mb, chunk_tokens: int, entropy: str | None):
    """``(logprobs, entropy or None)`` [n, width] of a micro-batch's sequences (values under the loss mask, 0
    elsewhere): from the last hidden states through ``logprobs.chunked_logprobs``, ``chunk_tokens`` positions at
    a time, never the whole pass's full-vocabulary logits. ``entropy``: None, ``"detached"`` or ``"grad"``. A model
    whose logits are more than that product (a bias, a soft cap, a scale) takes the full-logits path."""
    if not _chunkable(model):
        logits = sequence_logits(model, seqs.input_ids, seqs.attention_mask)
        lp, ent = _logprobs_and_entropy(logits, seqs.input_ids, entropy == "grad")
        return lp * seqs.loss_mask, None if entropy is None else ent * seqs.loss_mask
    kwargs: dict[str, Any] = {"use_cache": False}
    mask = seqs.attention_mask
    if mask is not None and not bool(mask[:, 0].all()):  # left padding (sequence_logits' rule)
        kwargs["attention_mask"] = mask
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = model.base_model(input_ids=seqs.input_ids, **kwargs).last_hidden_state
    n, width, _ = hidden.shape
    src, dst, targets = micro_batches.predicting_positions(mb, seqs, n, width)
    lp, ent = chunked_logprobs(hidden.reshape(n * width, -1)[src], model.get_output_embeddings().weight, targets,
                               chunk_tokens, entropy is not None)
    if ent is not None and entropy != "grad":
        ent = ent.detach()
    shape = (n, width)
    return (micro_batches.scatter_positions(lp, dst, shape),
            None if ent is None else micro_batches.scatter_positions(ent, dst, shape))


# --- policy --------------------------------------------------------------------------------------------------------

class TorchPolicy(KeptVersions):
    """The PolicyBackend on plain torch: AdamW over a ``LlamaForCausalLM`` (see ``hf.build_model``).

    A step is ``begin_train_step()``, any number of ``train_microbatches(batch)`` (each cut into micro-batches by
    ``trainer_cfg.micro_batching``, ``asyncrl/micro_batches.py``: ``rows`` of ``micro_batch_size`` sequences, by
    default the whole chunk, or ``sorted`` by length under a ``micro_batch_tokens`` budget, each trimmed to its own
    longest; gradients of the *un-normalised* loss sums accumulate, the loss's values come back once a chunk), then
    ``finish_train_step()``: gradients divided by the whole step's normaliser (tokens or sequences), clipped at
    ``grad_clip``, one AdamW step. The result does not depend on how the step was chunked (up to float summation
    order). The loss is the ``Loss`` object given at construction; its metrics and ``ENGINE_METRICS`` are
    reduced over the step by one ``Accumulator``.

    Previous-policy logprobs: it declares ``prev_logprobs_from_forward`` (``Capabilities``): the controller leaves
    a chunk's ``prev_logprobs`` unset and ``train_microbatches`` takes them from its own forward (detached, 0 off
    the mask). That is exact: the weights change only in ``finish_train_step`` (one AdamW step per RL step, never
    between a step's chunks), so during a step the current weights *are* the policy before this step's update, and
    the training forward computes bit for bit what a separate no-grad pass would (same micro-batches, same kernels
    on CPU; ``tests/test_torch_backend.py`` checks it). It saves that pass (about a quarter of a CPU train step). A
    batch that comes with ``prev_logprobs`` (a caller that computed them) is trained against those. Were this
    policy ever to take more than one optimizer step per batch, it would have to stop being one: after the first
    update the forward is no longer the previous policy.

    Reference: when ``loss.needs_reference`` a frozen copy of the initial weights is the reference; a batch that
    comes without ``ref_logprobs`` gets them from it (in this policy's copy of the batch; ``ref_logprobs(batch)``
    is public too).
    """

    # prev_logprobs_from_forward: one optimizer step per RL step makes it exact (docstring). Through a Ray proxy the
    # pipelined calls return at once and the proxy's next call waits for them (asyncrl/backends/ray.py): nothing
    # reads what they return, and a step's calls reach the actor back to back.
    capabilities = Capabilities(prev_logprobs_from_forward=True, keeps_versions=True, concurrent_logprobs_at=True,
                                ray_pipelined=frozenset({"begin_train_step", "train_microbatches"}))

    def __init__(self, model_cfg: ModelConfig, trainer_cfg: TorchTrainerConfig, loss: Loss, seed: int, tokenizer=None):
        self.model_cfg, self.trainer_cfg, self.loss = model_cfg, trainer_cfg, loss
        self.seed = seed
        self.tokenizer = tokenizer
        self.pad_id, bos_id, self.eos_id, vocab = special_ids(tokenizer)
        self.device = torch.device(trainer_cfg.device)
        self.model = build_model(model_cfg, vocab, seed, self.device, self.pad_id, bos_id, self.eos_id)
        self.peft = None  # model.lora: the adapter is injected into self.model; only it trains (backends/lora.py)
        if model_cfg.lora is not None:
            self.peft = lora.apply_lora(self.model, model_cfg.lora, seed)
        self.model.train()
        if trainer_cfg.gradient_checkpointing:  # each decoder layer recomputed in backward (torch.utils.checkpoint)
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x's name for it
                self.model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.num_parameters = sum(p.numel() for p in self.model.parameters())  # a pass runs through all of them
        peak = peak_flops(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
        self.peak_flops = 0.0 if math.isnan(peak) else peak  # 0: unknown (mfu then stays empty)
        # fused: one kernel over all parameters (CPU and CUDA): 0.7 ms a step for the quickstart model on one CPU
        # thread against 2.3 ms for foreach, whose per-op dispatch dominates at this size.
        fused = self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=trainer_cfg.lr, betas=tuple(trainer_cfg.betas), weight_decay=trainer_cfg.weight_decay,
            fused=fused, foreach=not fused,
        )
        self.ref_model = None
        if loss.needs_reference:
            self.ref_model = copy.deepcopy(self.model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self._copy, self._copy_lock = None, threading.Lock()  # logprobs_at's model: one pass at a time
        self.steps_done = 0
        self._step = Accumulator(loss.metrics + ENGINE_METRICS)
        self._in_step = False
        # Set on each rank of a data-parallel group (asyncrl.backends.ranks): it sums gradients and the step's
        # metric totals over all ranks before the one division, so R ranks take the 1-rank step.
        self.data_parallel = None

    # -- reading ---------------------------------------------------------------------------------------------------
    def _to_device(self, batch: TrainBatch) -> TrainBatch:
        return batch if self.device.type == "cpu" else batch.map(lambda t: t.to(self.device))

    def _plan(self, batch: TrainBatch):
        tc = self.trainer_cfg
        return micro_batches.plan(batch, tc.micro_batching, tc.micro_batch_size, tc.micro_batch_tokens)

    @torch.no_grad()
    def _logprobs_with(self, model, batch: TrainBatch) -> torch.Tensor:
        plans = self._plan(batch)  # the training forward's micro-batches: the same numbers (class docstring)
        batch = self._to_device(batch)
        out = torch.zeros(batch.input_ids.shape, device=self.device)
        training = model.training
        if self._dropout:  # LoRA dropout: a logprob is the policy's, without it
            model.eval()
        try:
            for mb in plans:
                mb = mb.to(self.device)
                seqs = micro_batches.take(batch, mb)
                lp, _ = policy_logprobs(model, seqs, mb, self.trainer_cfg.logprob_chunk_tokens, None)
                out[mb.rows, :mb.width] = lp * seqs.loss_mask
        finally:
            model.train(training)
        return out.cpu()

    @property
    def _dropout(self) -> bool:
        """Whether the training forward is random (LoRA dropout): then it is not the previous policy's."""
        return self.model_cfg.lora is not None and self.model_cfg.lora.dropout > 0

    def _parameters(self) -> list:
        """What a kept version copies (``KeptVersions``): the trained parameters (a LoRA run's frozen base is the
        same in every version)."""
        return self.params

    @holds_device  # GPU work colocated with vLLM: one engine's kernels at a time (device_lock.py)
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, S] logprobs of ``batch.input_ids`` under the current weights, 0 off ``loss_mask``; no grad."""
        return self._logprobs_with(self.model, batch)

    def logprobs_at(self, batch: TrainBatch, version: int, current: int) -> torch.Tensor:
        """``KeptVersions.logprobs_at`` on a copy of the model (built once; its parameters are the kept tensors),
        never the one being trained: it may run on another thread while this policy trains
        (``Capabilities.concurrent_logprobs_at``). The same modules and weights as the swap: the same numbers."""
        kept = getattr(self, "_kept", {}).get(version)
        if kept is None:
            if version == current:
                return self.logprobs(batch)
            raise KeyError(f"weights {version} are not kept (kept: {sorted(getattr(self, '_kept', {}))})")
        with self._copy_lock:
            if self._copy is None:
                self._copy = copy.deepcopy(self.model)
                # listed once, in self.params' order: zipped with a kept version per call
                self._copy_params = [p for p in self._copy.parameters() if p.requires_grad]
                for p in self._copy_params:
                    p.grad = None
                    p.requires_grad_(False)
            for p, tensor in zip(self._copy_params, kept):
                p.data = tensor
            return self._logprobs_with(self._copy, batch)

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, S] logprobs under the frozen reference (initial) weights; only when the loss needs a reference."""
        if self.ref_model is None:
            raise ValueError(f"no reference model: {self.loss!r} needs none")
        return self._logprobs_with(self.ref_model, batch)

    # -- training --------------------------------------------------------------------------------------------------
    def begin_train_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._step.reset()
        self._step.add({"peak_flops": self.peak_flops})  # before the DP reduction: the step's devices add up
        self._in_step = True

    @holds_device
    def train_microbatches(self, batch: TrainBatch) -> dict[str, float]:
        if not self._in_step:
            raise RuntimeError("train_microbatches before begin_train_step")
        if self.ref_model is not None and batch.ref_logprobs is None:
            batch = replace(batch, ref_logprobs=self.ref_logprobs(batch))
        if self._dropout and batch.prev_logprobs is None:  # the forward below is not the previous policy's
            batch = replace(batch, prev_logprobs=self.logprobs(batch))
        plans = self._plan(batch)
        batch = self._to_device(batch)
        parts = []  # every micro-batch's contributions, on the device: one transfer at the end of the chunk
        for mb in plans:
            mb = mb.to(self.device)
            seqs = micro_batches.take(batch, mb)
            logp, entropy = policy_logprobs(self.model, seqs, mb, self.trainer_cfg.logprob_chunk_tokens,
                                            "grad" if self.loss.entropy_grad else "detached")
            if seqs.prev_logprobs is None:  # the weights before this step's update are these (class docstring)
                seqs = replace(seqs, prev_logprobs=logp.detach() * seqs.loss_mask)
            loss_sum, normaliser, contributions = self.loss(logp, seqs, entropy)
            if loss_sum.requires_grad:
                loss_sum.backward()
            parts.append({**contributions, "loss": loss_sum.detach(), "normaliser": normaliser,
                          "train_tokens": mb.real_tokens, "train_padded_tokens": mb.positions})
        totals = micro_batches.add_all(self._step, parts)
        self._step.add({"sequences": batch.num_sequences,
                        "train_flops": 6.0 * self.num_parameters * totals.get("train_tokens", 0.0)})
        return {"loss_sum": totals.get("loss", 0.0), "normaliser": totals.get("normaliser", 0.0),
                "sequences": float(batch.num_sequences)}

    @holds_device
    def finish_train_step(self) -> dict[str, float]:
        if not self._in_step:
            raise RuntimeError("finish_train_step before begin_train_step")
        if self.data_parallel is not None:
            self.data_parallel.all_reduce(self.params, self._step)
        norm = self._step.total("normaliser")
        grads = [p.grad for p in self.params if p.grad is not None]
        if norm > 0 and grads:
            torch._foreach_div_(grads, norm)
        # the norm first (clipping to inf scales by exactly 1), then the clip only if the step is taken
        total = torch.nn.utils.clip_grad_norm_(self.params, math.inf, foreach=True) if grads else None
        grad_norm = 0.0 if total is None else float(total)
        lr = set_lr(self.optimizer.param_groups, self.trainer_cfg, self.steps_done)  # trainer.lr_schedule
        if math.isfinite(grad_norm) and math.isfinite(self._step.total("loss")):
            if total is not None and self.trainer_cfg.grad_clip is not None:  # clip_grad_norm_'s own scaling
                torch._foreach_mul_(grads, torch.clamp(self.trainer_cfg.grad_clip / (total + 1e-6), max=1.0))
            self.optimizer.step()
            self.steps_done += 1
        else:  # the contract (PolicyBackend.finish_train_step): no update, the numbers reported as they are
            self.optimizer.zero_grad(set_to_none=True)
        self._step.add({"grad_norm": grad_norm, "lr": lr})
        metrics = self._step.result()
        self._step.reset()
        self._in_step = False
        return metrics

    # -- weights and state -----------------------------------------------------------------------------------------
    @holds_device
    def export_weights(self) -> dict[str, torch.Tensor]:
        """Detached copies of the current weights under Hugging Face names (``model.state_dict()`` keys; with tied
        embeddings ``lm_head.weight`` is present too, as a copy of ``model.embed_tokens.weight``); a LoRA run's
        with the adapter merged in."""
        if self.peft is not None:
            return lora.merged_weights(self.model)
        with torch.no_grad():
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @holds_device
    def export_adapter(self):
        """A LoRA run's adapter alone (``lora.export_adapter``): what the sync sends vLLM instead of merged weights."""
        return lora.export_adapter(self.peft, DTYPES[self.model_cfg.dtype])

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions under the current (trained) weights; draws no randomness."""
        return greedy_completions(self.model, prompts, max_new_tokens, self.eos_id, self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs: weights, AdamW state, the reference weights (KL), steps done. A LoRA
        run's ``model`` is the adapter alone and ``base`` names the model it adapts (the reference is the base)."""
        if self.peft is not None:
            return {"model": lora.adapter_state(self.model), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                    "steps_done": self.steps_done, "base": self.model_cfg.hf_path or f"built-in (seed {self.seed})"}
        state = {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "steps_done": self.steps_done,
        }
        if self.ref_model is not None:
            state["ref_model"] = {k: v.detach().clone() for k, v in self.ref_model.state_dict().items()}
        return state

    def close(self) -> None:
        """Nothing to release: the model lives in this process and goes with the object."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.peft is not None:
            lora.load_adapter_state(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ref_model is not None and "ref_model" in state:
            self.ref_model.load_state_dict(state["ref_model"])
        self.steps_done = int(state.get("steps_done", 0))
        self._step.reset()
        self._in_step = False


# --- generator -----------------------------------------------------------------------------------------------------

class TorchGenerator:
    """The GenerationBackend on plain torch. Holds its own model; ``load_weights`` copies weights into it.

    ``submit`` only queues. ``poll`` takes everything queued and generates it, one batched call (all prompts ×
    ``n`` samples, KV cache) per ``submit`` call, returning the groups in submission order. With
    ``min_new_tokens_tail`` each group stops at its own long-tailed limit (``sampling.group_max_tokens``, the vLLM
    generator's), so CPU runs have the length spread the padding-free training is for; off (the default) nothing
    changes in what is sampled. ``load_weights`` and generation are serialised by a lock, so a weight load never
    interleaves a generation (``poll`` may run in another thread), and a load first generates what is still queued
    (drain): a group is generated with the weights the generator held when it was submitted, however late ``poll``
    comes. With one decode per submit call, in submission order, what a rollout is depends on the seed, the
    submissions and the weights, not on timing.
    """

    capabilities = Capabilities(sampled_evaluation=True)

    def __init__(self, model_cfg: ModelConfig, gen_cfg: TorchGenerationConfig, seed: int, tokenizer=None):
        self.model_cfg, self.gen_cfg, self.seed = model_cfg, gen_cfg, seed
        self.tokenizer = tokenizer
        self.pad_id, bos_id, self.eos_id, vocab = special_ids(tokenizer)
        self.device = torch.device(gen_cfg.device)
        self.model = build_model(model_cfg, vocab, seed, self.device, self.pad_id, bos_id, self.eos_id).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._rng = torch.Generator(device=self.device)
        self._rng.manual_seed(seed)
        self._stop = stop_strings(gen_cfg.stop, tokenizer)  # generation.stop (None: only eos and limits end one)
        self._version = 0
        self._queue = SubmitQueue()
        self._done: list[GroupRollouts] = []  # generated by a weight load's drain, not yet polled
        self._model_lock = threading.RLock()

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_new_tokens(self) -> int:
        return self.gen_cfg.max_new_tokens

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self._queue.submit(requests)

    def num_inflight(self) -> int:
        return self._queue.inflight() + len(self._done)

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        """Remove still-queued groups; a group already being generated finishes (and is not listed)."""
        return self._queue.abort(group_ids)

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        """Generate everything queued now; ``[]`` when nothing is queued. (Synchronous: ``timeout`` never makes it
        wait longer than the generation itself.)"""
        with self._model_lock:  # taken before the queue: a weight load cannot come between taking and generating
            done, self._done = self._done, []
            return done + self._queue.generate(self._decode)  # one batched decode per submit call, in order

    def _decode(self, requests: list[GenerationRequest]) -> list[GroupRollouts]:
        prompts = [list(r.prompt_ids) for r in requests for _ in range(r.n)]
        limits = None  # long-tailed lengths: a limit per group, from the seed and the group id only
        if self.gen_cfg.min_new_tokens_tail is not None:
            limits = [group_max_tokens(self.gen_cfg, self.seed, r.group_id) for r in requests for _ in range(r.n)]
        version = self._version
        completions, logprobs, reasons = decode(self.model, prompts, self.gen_cfg.max_new_tokens, self._choose,
                                                self.eos_id, self.pad_id, limits, self._stop)
        out, row = [], 0
        for r in requests:
            out.append(GroupRollouts(
                group_id=r.group_id, prompt_ids=list(r.prompt_ids),
                completion_ids=completions[row:row + r.n], logprobs=logprobs[row:row + r.n],
                gen_start_version=version, gen_end_version=version, finish_reasons=reasons[row:row + r.n],
            ))
            row += r.n
        return out

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        return _sample_from(logits, self.gen_cfg.temperature, self.gen_cfg.top_p, self._rng, self.gen_cfg.top_k)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Greedy completions under the generator's current weights; draws no randomness."""
        with self._model_lock:
            return greedy_completions(self.model, prompts, max_new_tokens or self.gen_cfg.max_new_tokens,
                                      self.eos_id, self.pad_id, self._stop)  # evaluation stops as sampling does

    def generate_sampled(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, seed: int,
                         max_new_tokens: int | None = None) -> list[list[int]]:
        """``n`` sampled completions of each prompt (rows in prompt order) at ``temperature``, with this generator's
        ``top_p``/``top_k``/stop strings, from a random stream of their own seeded by ``seed``: the rollouts' stream
        is not touched (``Controller.evaluate``)."""
        if not prompts:
            return []
        rng = torch.Generator(device=self.device)
        rng.manual_seed(seed)
        rows = [list(p) for p in prompts for _ in range(n)]
        choose = lambda lg: _sample_from(lg, temperature, self.gen_cfg.top_p, rng, self.gen_cfg.top_k)  # noqa: E731
        with self._model_lock:
            completions, _, _ = decode(self.model, rows, max_new_tokens or self.gen_cfg.max_new_tokens, choose,
                                       self.eos_id, self.pad_id, stop=self._stop)
        return completions

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``weights`` (HF names, as ``TorchPolicy.export_weights`` gives) into this generator's own model,
        then set ``version``. Every parameter must be present. What is still queued is generated first, with the
        weights it was submitted for (``poll`` returns it)."""
        with self._model_lock:
            self._done += self._queue.generate(self._decode)
            with torch.no_grad():
                missing = []
                for name, tensor in self.model.state_dict(keep_vars=True).items():
                    src = weights.get(name)
                    if src is None:
                        missing.append(name)
                    else:
                        tensor.copy_(src)
                if missing:
                    raise KeyError(f"load_weights: missing weights {missing}")
            self._version = int(version)

    # -- save / restore --------------------------------------------------------------------------------------------
    def state_dict(self, include_weights: bool = True) -> dict[str, Any]:
        """The version, the sampling RNG state and (by default) the weights: restoring these makes the next
        rollouts identical to an uninterrupted run. Queued requests are not included. A LoRA run's checkpoint
        holds the adapter, not merged weights: a restore's weight sync loads them here again."""
        with self._model_lock:
            state: dict[str, Any] = {"version": self._version, "rng": self._rng.get_state()}
            if include_weights and self.model_cfg.lora is None:
                state["weights"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._model_lock:
            if "weights" in state:
                self.load_weights(state["weights"], state["version"])
            self._version = int(state["version"])
            self._rng.set_state(state["rng"])

    def close(self) -> None:
        self._queue.clear()
        self._done = []
