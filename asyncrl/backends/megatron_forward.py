"""Megatron's training forward without full-vocabulary logits or a materialised score matrix, and the memory a
pass of it needs.

- **The last hidden states, not the logits.** ``final_hidden`` runs ``GPTModel`` with its output layer left out
  (``post_process`` off for the call: the decoder, built with its final norm, still applies it) and returns the
  ``[S, B, H]`` hidden states; ``micro_batches.predicting_positions`` says which of them predict a token under the
  loss mask, and
  ``asyncrl.logprobs.chunked_logprobs`` turns those into logprobs and entropy ``logprob_chunk_tokens`` at a time
  (vocabulary-parallel under tensor parallelism). Only positions under the loss mask get a logit at all: a
  prompt's positions and padding cost nothing in the output layer. Every value the loss reads is what the full
  logits gave, up to float reassociation (tests/test_megatron_backend.py against transformers).
- **Fused attention for packed sequences** (``trainer.attention``): ``flex`` replaces the local layer spec's
  ``DotProductAttention`` by ``FlexAttention`` under a block mask built once a micro-batch (``block_mask``: causal,
  and within a packed row each position sees its own sequence only). The kernel skips blocks the mask empties and
  never materialises the ``[rows, heads, W, W]`` scores, so its memory is linear in the positions. ``unfused`` (and
  ``auto`` off CUDA) keeps Megatron's matmul-softmax-matmul with the boolean mask of ``micro_batches``; both see
  the same masks, so they compute the same function (tests/gpu/test_flex_attention.py on a GPU; the CPU tests run
  the unfused path and the flex one in eager mode). On CUDA the kernel is ``torch.compile``'d once, with dynamic
  shapes (a pass's rows and width change every step). ``varlen`` runs the same rule through the FlashAttention-2
  kernel torch ships (``aten._flash_attention_forward`` with cumulative sequence lengths, ``varlen_mask``): each
  sequence of a packed row (and each row's padding) is one causal sequence, so no mask is built at all and no
  kernel block is spent half-empty at a sequence's edge; CUDA with compute capability 8.0+ only.
- **Compiled layers** (``trainer.compile``, ``compile_layers``): off by default; ``layers`` compiles each transformer
  layer in place, so what eager PyTorch runs as separate kernels (RMSNorm, the rotary ``cat`` and multiplies, the
  residual adds, casts) fuses into a few, in the backward too. Same function, up to float reassociation.
- **Memory** (``activation_bytes``, ``fit_micro_batch_tokens``): what a pass of P positions keeps for its backward
  is counted from the architecture (per layer and position: the norms', projections' and MLP's saved inputs, plus
  ``heads x W`` scores per position unfused) plus one output-layer chunk's workspace; at the first step the budget
  is the most that fits the memory then free (the generator's pool and this policy's weights, gradients and master
  weights already allocated, Adam's moments reserved), or, when ``micro_batch_tokens`` is set above that, a
  ValueError naming it, before any pass runs.
"""

from __future__ import annotations

import copy
import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["attention_kind", "layer_spec", "block_mask", "varlen_mask", "VarlenMask", "varlen_attention", "pass_mask",
           "compile_layers", "final_hidden", "output_weight", "activation_bytes", "fit_micro_batch_tokens",
           "resolve_budget"]

SAFETY = 0.85  # of the free memory a budget may plan on: the allocator's fragmentation and what is not counted
MAX_AUTO_TOKENS = 65536  # an auto budget never plans passes larger than this (no gain past a few 10k positions)


def attention_kind(choice: str, device: torch.device) -> str:
    """``trainer.attention`` resolved: 'varlen', 'flex' or 'unfused'."""
    if choice == "auto":
        return "flex" if device.type == "cuda" and _flex_available() else "unfused"
    if choice == "flex" and not _flex_available():
        raise ValueError("trainer.attention 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    if choice == "varlen" and not _varlen_available(device):
        raise ValueError(f"trainer.attention 'varlen' needs a CUDA device of compute capability 8.0 or more and a "
                         f"torch built with FlashAttention; got trainer.device {str(device)!r}: use 'flex' or 'auto'")
    return choice


def _varlen_available(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    return bool(built) and torch.cuda.get_device_capability(device) >= (8, 0)


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# ---- fused attention ---------------------------------------------------------------------------------------------

_FLEX: dict[str, Any] = {}


def _flex_fn(device: torch.device):
    """flex_attention, compiled once on CUDA (dynamic shapes); eager elsewhere (materialises the scores: tests)."""
    key = device.type
    if key not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        if device.type == "cuda":
            # one compiled kernel family for every pass shape; past dynamo's recompile limit (8: dtypes, grad and
            # no-grad, a row count of 1) a call would fall back to eager flex, which materialises the scores
            _raise_recompile_limit()
            _FLEX[key] = torch.compile(flex_attention, dynamic=True)
        else:
            _FLEX[key] = flex_attention
    return _FLEX[key]


def _raise_recompile_limit(limit: int = 64) -> None:
    import torch._dynamo.config as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), limit))


@functools.cache
def _flex_core_attention():
    """The core-attention module class: Megatron's ``DotProductAttention`` (same constructor, so any megatron-core
    of the supported range builds it), whose forward takes a FlexAttention ``BlockMask`` where the unfused one
    takes a boolean mask. One class per process: compiled layers guard on their modules' types, so a class made
    anew for each model recompiled the layers of a rebuilt policy (the TRL comparison's asynchronous mode, whose
    policy is built again, trained its first step in 9.7 s against 1.2 s on an H100, 2026-12-06)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from torch.nn.attention.flex_attention import BlockMask

    class FlexCoreAttention(DotProductAttention):
        pass_block_mask = None  # the running pass's mask, set by final_hidden (why: _hand_over_block_mask)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_mask is None:
                attention_mask = self.pass_block_mask
            if isinstance(attention_mask, VarlenMask):
                if attention_bias is not None or packed_seq_params is not None:
                    raise ValueError("the varlen attention takes neither an attention bias nor packed_seq_params")
                return varlen_attention(query, key, value, attention_mask, self.softmax_scale)
            if not isinstance(attention_mask, BlockMask):
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("FlexCoreAttention takes neither an attention bias nor packed_seq_params")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
            out = _flex_fn(q.device)(q, k, v, block_mask=attention_mask, scale=self.softmax_scale,
                                     enable_gqa=q.shape[1] != k.shape[1])
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)  # [s, b, h * d]

    return FlexCoreAttention


def layer_spec(spec: Any, attention: str) -> Any:
    """The local layer spec with its core attention swapped for ``FlexCoreAttention`` (which also runs the varlen
    kernel) when ``attention`` is flex or varlen."""
    if attention not in ("flex", "varlen"):
        return spec
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = _flex_core_attention()
    return spec


def block_mask(segments: torch.Tensor | None, rows: int, width: int, device: torch.device):
    """The FlexAttention mask of a pass: causal; with ``segments`` [R, W] (a packed micro-batch's sequence of each
    position, -1 for padding) also within each sequence only, the rule ``micro_batches.block_causal_mask`` gives
    as a boolean matrix."""
    from torch.nn.attention.flex_attention import create_block_mask

    if segments is None:
        def causal(b, h, q, kv):
            return q >= kv

        return create_block_mask(causal, None, None, width, width, device=device)
    seg = segments

    def document(b, h, q, kv):
        return (seg[b, q] == seg[b, kv]) & (q >= kv)

    return create_block_mask(document, rows, None, width, width, device=device)


@dataclass(frozen=True)
class VarlenMask:
    """A pass's sequences for the varlen kernel: ``cu_seqlens`` [n + 1] int32, where each of the n sequences starts
    in the pass's positions flattened row by row (a packed row's sequences, then its padding as one more), and the
    longest one's length (the kernel's grid is sized by it)."""
    cu_seqlens: torch.Tensor
    max_len: int


def varlen_mask(segments: torch.Tensor | None, rows: int, width: int, device: torch.device) -> VarlenMask:
    """The varlen kernel's view of a pass: with ``segments`` [R, W] (a packed micro-batch's sequence of each
    position, -1 for padding) a sequence starts at every row's start and wherever the segment changes; without,
    each row is one sequence (right-padded: under a causal rule no real position sees its padding)."""
    if segments is None:
        return VarlenMask(torch.arange(0, rows * width + 1, width, dtype=torch.int32, device=device), width)
    flat = segments.reshape(-1).to(device)
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1]
    start[::width] = True
    ends = torch.tensor([flat.numel()], device=device)
    cu = torch.cat([torch.nonzero(start).flatten(), ends]).to(torch.int32)
    return VarlenMask(cu, int((cu[1:] - cu[:-1]).max()))


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: VarlenMask,
                     scale: float | None) -> torch.Tensor:
    """Causal attention within each of ``mask``'s sequences; ``query``/``key``/``value`` [W, R, heads, d] as
    Megatron passes them (grouped-query: fewer key/value heads), the result [W, R, heads * d]. ``final_hidden``
    runs a varlen pass as one row (R = 1), where both reshapes are views: no copy of q, k, v or the output."""
    width, rows = query.shape[0], query.shape[1]

    def flat(t: torch.Tensor) -> torch.Tensor:  # [W, R, h, d] -> [R * W, h, d], each row's positions in order
        return t.transpose(0, 1).reshape(rows * width, t.shape[2], t.shape[3])

    out = _VARLEN_KERNEL(flat(query), flat(key), flat(value), mask.cu_seqlens, mask.max_len, scale)
    return out.view(rows, width, -1).transpose(0, 1).contiguous()


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                  scale: float | None) -> torch.Tensor:
    """torch's FlashAttention-2 over packed sequences (differentiable: aten's own backward), causal, no dropout."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True,
                                                   False, scale=scale)[0]


_VARLEN_KERNEL = _flash_varlen  # tests on the CPU swap in a reference that loops over the sequences


def pass_mask(attention: str, mb, rows: int, width: int, device: torch.device, cache: dict) -> Any:
    """A pass's attention mask: the varlen kernel's sequences, FlexAttention's block mask, or Megatron's boolean
    one (True: masked; the causal one of each width cached in ``cache``)."""
    if attention == "varlen":
        return varlen_mask(mb.segments, rows, width, device)
    if attention == "flex":
        return block_mask(mb.segments, rows, width, device)
    if mb.packed is not None:
        from asyncrl.micro_batches import block_causal_mask

        return block_causal_mask(mb)
    if width not in cache:
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), 1)
        cache[width] = causal.view(1, 1, width, width)
    return cache[width]


# ---- torch.compile of the layers (trainer.compile) -----------------------------------------------------------------

COMPILE = ("none", "layers", "modules")
MODULES = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")  # what 'modules' compiles in a layer


def compile_layers(model, how: str, attention: str, device: torch.device) -> list[str]:
    """``trainer.compile``: ``torch.compile`` each transformer layer of ``model`` whole (``layers``: its RMSNorms,
    rotary embedding, residual adds and casts fused with their neighbours, forward and backward; the GEMMs stay
    cuBLAS's) or each layer's norms, attention and MLP separately (``modules``: the layer's own code, with its
    context managers, stays eager; no residual adds fused), or nothing (``none``). In place
    (``nn.Module.compile``): parameter names and the modules' tree are unchanged, so the weights' mapping, the
    optimizer, checkpoints and the export see the same model. Dynamic shapes: a pass's rows and width change every
    step. The compiled FlexAttention is made first, so a traced layer inlines it. Returns the names compiled."""
    if how not in COMPILE:
        raise ValueError(f"trainer.compile {how!r}: allowed {', '.join(map(repr, COMPILE))}")
    if how == "none":
        return []
    if attention == "flex":
        _flex_fn(device)
    _raise_recompile_limit()
    _quiet_default_group()
    names = []
    for i, layer in enumerate(model.decoder.layers):
        parts = [("", layer)] if how == "layers" else [(f".{n}", getattr(layer, n)) for n in MODULES]
        for suffix, module in parts:
            module.compile(dynamic=True)
            names.append(f"decoder.layers.{i}{suffix}")
    return names


def _quiet_default_group() -> None:
    """megatron-core's ``RowParallelLinear`` (attention's output projection, the MLP's second) passes ``tp_group``
    None at every call, and ``get_tensor_model_parallel_group_if_none`` answers None with a deprecation
    ``warnings.warn``, a call dynamo cannot trace: every compiled layer would break its graph there twice (seen
    tracing 0.19.2's layers). Under compilation the same default group comes back without the warning; eager
    calls go to megatron-core's function unchanged. Installed once, in the modules that call it in a layer."""
    import importlib

    import torch.distributed as dist
    from megatron.core import parallel_state

    for name in ("megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings"):
        module = importlib.import_module(name)
        original = getattr(module, "get_tensor_model_parallel_group_if_none", None)
        if original is None or getattr(original, "quiet_under_compile", False):
            continue

        def quiet(tp_group, is_expert=False, check_initialized=True, _original=original):
            if (tp_group is None and torch.compiler.is_compiling() and dist.is_initialized()
                    and parallel_state.is_initialized()):
                get = (parallel_state.get_expert_tensor_parallel_group if is_expert
                       else parallel_state.get_tensor_model_parallel_group)
                return get(check_initialized=check_initialized)
            return _original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

        quiet.quiet_under_compile = True
        setattr(module, "get_tensor_model_parallel_group_if_none", quiet)


# ---- hidden states and the positions that predict a token -------------------------------------------------------

@contextmanager
def _without_output_layer(model):
    saved = model.post_process
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = saved


def _hand_over_block_mask(model, mask: Any) -> Any:
    """What to pass as the model's ``attention_mask``: a boolean mask as it is; a FlexAttention ``BlockMask`` is
    set on every ``FlexCoreAttention`` instead, and None passed. Why: Megatron's activation recompute
    (``trainer.gradient_checkpointing``) hands the layers' inputs to ``save_for_backward``, which takes tensors only
    ("argument 1 is of type BlockMask"). The mask stays set until the next pass's, so the recompute in this pass's
    backward (after ``final_hidden`` returned) still finds it; a policy's passes run one at a time, forward then
    backward, under the device lock."""
    if mask is None or isinstance(mask, torch.Tensor):
        return mask
    for module in model.modules():
        if hasattr(module, "pass_block_mask"):
            module.pass_block_mask = mask
    return None


def final_hidden(model, forward_module, input_ids: torch.Tensor, mask: Any) -> torch.Tensor:
    """[S, B, H] hidden states after the final norm (what the output layer would multiply), through
    ``forward_module`` (the model or its DDP wrapper). A varlen pass of R rows runs as one row of R x S positions
    (its sequences already cut by ``cu_seqlens``), so Megatron's [S, B] layout is the kernel's packed one and no
    layer transposes q, k, v or its output; rotary embeddings depend only on the distance between two positions,
    so a sequence's offset in that row changes nothing but float rounding (fp32 angles: ~1e-3 rad at 65k)."""
    B, S = input_ids.shape
    if isinstance(mask, VarlenMask) and B > 1:
        return final_hidden(model, forward_module, input_ids.reshape(1, B * S), mask).view(B, S, -1).transpose(0, 1)
    pos = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    with _without_output_layer(model):
        return forward_module(input_ids, pos, _hand_over_block_mask(model, mask))


def output_weight(model) -> torch.Tensor:
    """This rank's vocabulary rows of the output layer (the embedding when the two are tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


# ---- memory ------------------------------------------------------------------------------------------------------

def activation_bytes(spec: Any, dtype: torch.dtype, attention: str, width: int, tp: int = 1,
                     recompute: bool = False) -> float:
    """Bytes a pass keeps for its backward per position (``spec``: ``megatron_weights.ArchSpec``). Per layer: the
    two norms' inputs and outputs (4H each, as the torch fallback's decomposed ops save), the projections' inputs
    (qkv, attention output, fc1, fc2) and rotated q/k, the attention kernel's q/k/v/output, the MLP's gate and up
    halves and their product; unfused attention adds the fp32 softmax and the bf16 probabilities and scores of
    ``heads x width`` per position. Sharded parts divide by ``tp``. An upper estimate, checked against the peak
    measured on the H200 (benchmarks/README.md). With ``recompute`` (``trainer.gradient_checkpointing``: Megatron's
    full recompute, one layer a group) a pass keeps each layer's input (H) and, while the backward recomputes a
    layer, that one layer's activations, beside the last hidden states and their gradient (2H)."""
    b = torch.finfo(dtype).bits // 8
    H, inter = spec.hidden_size, spec.intermediate_size
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    per_layer = 13 * H + (2 * q + 4 * kv + 4 * inter) / tp
    if attention == "unfused":
        per_layer += spec.num_heads / tp * width * (4 + 2 * b) / b
    if recompute:
        return float(((spec.num_layers + 2) * H + per_layer) * b)
    return float(spec.num_layers * per_layer * b)


def output_layer_bytes(spec: Any, dtype: torch.dtype, chunk: int, tp: int = 1) -> float:
    """One output-layer chunk's workspace (fp32 logits and their exp, the bf16 product, the gradient) and the
    float32 accumulator of the output weight's gradient."""
    b = torch.finfo(dtype).bits // 8
    rows = math.ceil(spec.vocab_size / tp)
    return float(chunk * rows * (3 * 4 + 2 * b) + rows * spec.hidden_size * (4 + b))


def fit_micro_batch_tokens(knob: int | None, free_bytes: float, per_position: float, fixed: float,
                           width: int, device: Any) -> int:
    """The micro-batch budget (positions a pass) for ``free_bytes`` of memory: ``knob`` when it fits (else a
    ValueError naming it and what fits), or with ``knob`` None the most that fits (at most ``MAX_AUTO_TOKENS``).
    A budget smaller than one row of ``width`` positions cannot fit any pass: an error either way."""
    room = free_bytes * SAFETY - fixed
    fits = int(room // per_position) if room > 0 else 0
    gib = 2 ** 30
    if fits < width:
        raise ValueError(
            f"trainer.micro_batch_tokens: not even one row of {width} positions fits on {device}: "
            f"{free_bytes / gib:.1f} GiB free at the first step, ~{per_position * width / gib:.2f} GiB a row of "
            f"activations and {fixed / gib:.1f} GiB for the optimizer's moments and the output layer's chunk "
            "(lower trainer.logprob_chunk_tokens, the generator's memory, or the completion length)")
    if knob is None:
        return min(fits, MAX_AUTO_TOKENS)
    if knob > fits:
        raise ValueError(
            f"trainer.micro_batch_tokens {knob} does not fit on {device}: a pass of that many positions keeps "
            f"~{knob * per_position / gib:.1f} GiB of activations and {free_bytes / gib:.1f} GiB are free at the "
            f"first step (the generator and this policy's weights in; {fixed / gib:.1f} GiB more for the optimizer's "
            f"moments and the output layer); set trainer.micro_batch_tokens <= {fits}, or null for the most that fits")
    return knob


def resolve_budget(tc: Any, spec: Any, dtype: torch.dtype, attention: str, tp: int, device: torch.device,
                   reserve: float) -> tuple[int | None, dict]:
    """A trainer's micro-batch budget and the plan behind it: on CUDA (``sorted`` / ``packed``) the
    ``fit_micro_batch_tokens`` of the memory free now (the driver's free memory plus what torch's allocator holds
    unused) less ``reserve`` (what is still to be allocated, e.g. Adam's moments); elsewhere the knob as given."""
    if device.type != "cuda" or tc.micro_batching == "rows":
        return tc.micro_batch_tokens, {}
    free = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))
    width = spec.max_position_embeddings
    recompute = bool(getattr(tc, "gradient_checkpointing", False))
    per = activation_bytes(spec, dtype, attention, width, tp, recompute)
    fixed = output_layer_bytes(spec, dtype, tc.logprob_chunk_tokens, tp) + reserve
    budget = fit_micro_batch_tokens(tc.micro_batch_tokens, free, per, fixed, width, device)
    return budget, {"free_gib": free / 2**30, "per_position_mib": per / 2**20, "fixed_gib": fixed / 2**30,
                    "micro_batch_tokens": budget, "attention": attention, "recompute": recompute}
