"""Token logprobs and entropy: from full logits (small models, references), and from the last hidden states and the
output layer a chunk of positions at a time (``chunked_logprobs``: what the engines train with, never a
``[positions, vocabulary]`` float32 tensor for a pass).

On CUDA with the vocabulary on one device, each chunk's float32 work (log-sum-exp, the picked logit, entropy; in
the backward ``d/dz``) is one compiled function over the chunk's logits in the weight's dtype (``_fused``): the
same formulas as the eager path, up to float reassociation, without the eager path's ~10 float32 passes over a
``[chunk, vocabulary]`` tensor each way, which at a 152k vocabulary cost more than the output layer's matrix
multiplies (issue 32). Elsewhere (CPU, tensor-parallel vocabularies, float64) the eager path runs, in place.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] logprob of each token given the ones before it (position 0 gets 0)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B, S] entropy of the next-token distribution that produced each token (position 0 gets 0)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0))


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 2048,
    entropy: bool = False, vocab_size: int | None = None, vocab_start: int = 0, group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of ``targets`` [N] (and, with ``entropy``, the next-token entropy) at N positions, from their last
    hidden states ``hidden`` [N, H] and the output layer's ``weight`` [V, H], ``chunk_tokens`` positions at a time:
    ``(logprobs [N], entropy [N] or None)``, float32 (float64 for float64 inputs), differentiable in ``hidden`` and ``weight``.

    What ``token_logprobs`` / ``token_entropy`` compute from the full logits, up to float reassociation, without a
    ``[N, V]`` tensor: at most ``chunk_tokens x V`` logits exist at once, in the forward *and* the backward (which
    recomputes each chunk's logits from the saved hidden states; ``_ChunkedLogprobs``). The logits are the output
    layer's product in ``weight``'s dtype, upcast to float32, as the full path does.

    Vocabulary-parallel (Megatron's tensor parallelism): ``weight`` is this rank's rows of the vocabulary,
    ``vocab_start`` the first one's id, ``group`` the tensor-parallel process group; the log-sum-exp, the picked
    logits and the entropy are all-reduced over it, and so is the hidden states' gradient (the hidden states are
    replicated over the group). ``vocab_size``: the real vocabulary (rows at or past it are padding, left out)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens {chunk_tokens!r}: must be a positive integer")
    rows = weight.shape[0] if vocab_size is None else max(0, min(weight.shape[0], vocab_size - vocab_start))
    lp, ent = _ChunkedLogprobs.apply(hidden, weight, targets, int(chunk_tokens), bool(entropy), rows,
                                     int(vocab_start), group)
    return lp, (ent if entropy else None)


def _all_reduce(t: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """A chunk's logits, upcast to float32 (float64 stays float64)."""
    return torch.nn.functional.linear(h, weight[:rows]).to(torch.promote_types(weight.dtype, torch.float32))


def _chunk_stats(z: torch.Tensor, t: torch.Tensor, start: int, group: Any, entropy: bool):
    """Log-sum-exp, picked logit and (optionally) ``sum p z`` of a chunk's float32 logits ``z`` [c, rows]."""
    m = z.max(-1).values if z.shape[-1] else z.new_full(z.shape[:1], -float("inf"))
    m = _all_reduce(m, group, "max")
    lse = _all_reduce(torch.exp(z - m.unsqueeze(-1)).sum(-1), group).log() + m
    local = t - start
    mine = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, max(0, z.shape[-1] - 1)).unsqueeze(-1)).squeeze(-1) if z.shape[-1] else m
    picked = _all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), group)
    pz = None
    if entropy:
        pz = _all_reduce((torch.exp(z - lse.unsqueeze(-1)) * z).sum(-1), group)
    return lse, picked, pz, local, mine


class _ChunkedLogprobs(torch.autograd.Function):
    """``chunked_logprobs``' autograd: the forward keeps only the hidden states (its input), the log-sum-exp and
    the entropy per position; the backward recomputes each chunk's logits and turns them into that chunk's
    gradient at once (d logprob / d z = onehot - p; d entropy / d z = -p (log p + H)), so memory is bounded by one
    chunk both ways. A pass of one chunk keeps that chunk's logits for its backward instead of recomputing them (the
    same numbers; the bound holds): on CPU-sized models that matmul was a third of the backward. The weight's
    gradient is accumulated over chunks in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, entropy, rows, start, group):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.promote_types(weight.dtype, torch.float32), device=hidden.device)
        lses = torch.empty_like(lp)
        ent = torch.empty_like(lp) if entropy else None
        ctx.logits = None
        fused = _use_fused(weight, group)
        for a in range(0, n, chunk):
            if fused:  # the logits stay in the weight's dtype; the compiled function upcasts as it reads them
                z = torch.nn.functional.linear(hidden[a:a + chunk], weight[:rows])
                local = (targets[a:a + chunk] - start).clamp(0, max(0, rows - 1))
                lse, picked, pz = _fused_fn("stats", z.device)(z, local, entropy)
            else:
                z = _chunk_logits(hidden[a:a + chunk], weight, rows)
                lse, picked, pz, _, _ = _chunk_stats(z, targets[a:a + chunk], start, group, entropy)
            if n <= chunk and any(ctx.needs_input_grad[:2]):
                ctx.logits = z  # the whole pass is one chunk: the backward reuses its logits (the same numbers)
            del z
            lp[a:a + chunk] = picked - lse
            lses[a:a + chunk] = lse
            if entropy:
                ent[a:a + chunk] = lse - pz
        ctx.save_for_backward(hidden, weight, targets, lses, ent if entropy else lses)
        ctx.cfg = (chunk, entropy, rows, start, group)
        return lp, (ent if entropy else lp.new_zeros(0))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lses, ents = ctx.saved_tensors
        chunk, entropy, rows, start, group = ctx.cfg
        if not entropy:
            g_ent = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        if g_lp is None and g_ent is None:
            return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None
        fused = _use_fused(weight, group)
        for a in range(0, hidden.shape[0], chunk):
            h = hidden[a:a + chunk]
            if fused:
                z = ctx.logits if ctx.logits is not None else torch.nn.functional.linear(h, weight[:rows])
                ctx.logits = None
                local = (targets[a:a + chunk] - start).clamp(0, max(0, rows - 1))
                dz = _fused_fn("grad", z.device)(z, lses[a:a + chunk], None if g_ent is None else ents[a:a + chunk],
                                                 None if g_lp is None else g_lp[a:a + chunk],
                                                 None if g_ent is None else g_ent[a:a + chunk], local)
                del z
                _accumulate(dz, h, weight, rows, grad_h, grad_w, a, chunk, acc)
                continue
            z = ctx.logits if ctx.logits is not None else _chunk_logits(h, weight, rows)
            ctx.logits = None
            logp = z.sub_(lses[a:a + chunk].unsqueeze(-1))  # log p, in place
            p = logp.exp()
            if g_ent is not None:  # d H / d z = -p (log p + H), into log p's buffer
                grad = logp.add_(ents[a:a + chunk].unsqueeze(-1)).mul_(p).mul_(-g_ent[a:a + chunk].unsqueeze(-1))
            else:
                grad = logp.zero_()
            if g_lp is not None:  # d logprob / d z = onehot(target) - p
                gl = g_lp[a:a + chunk]
                grad.sub_(p.mul_(gl.unsqueeze(-1)))
                local = targets[a:a + chunk] - start
                mine = (local >= 0) & (local < rows)
                grad.scatter_add_(-1, local.clamp(0, max(0, rows - 1)).unsqueeze(-1),
                                  torch.where(mine, gl, torch.zeros_like(gl)).unsqueeze(-1))
            del p
            dz = grad.to(weight.dtype)
            del grad, logp
            _accumulate(dz, h, weight, rows, grad_h, grad_w, a, chunk, acc)
        if need_h:
            grad_h = _all_reduce(grad_h, group)  # each rank's vocabulary rows gave a part of it
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def _accumulate(dz, h, weight, rows, grad_h, grad_w, a, chunk, acc) -> None:
    """A chunk's ``d/dz`` into the hidden states' gradient (its rows) and the weight's (summed in ``acc``)."""
    if grad_h is not None:
        grad_h[a:a + chunk] = dz @ weight[:rows]
    if grad_w is not None:
        grad_w[:rows].add_((dz.t() @ h).to(acc))



# ---- the fused chunk (CUDA, one vocabulary shard) ---------------------------------------------------------------

FUSED_DEVICES = {"cuda"}  # where a chunk's float32 work is one compiled function (tests set it to run it on CPU)
_compiled: dict[str, Any] = {}


def _fused_stats(z: torch.Tensor, local: torch.Tensor, entropy: bool):
    """``_chunk_stats`` of a chunk's logits ``z`` [c, V] in the weight's dtype, upcast inside: one read of them."""
    zf = z.float()
    m = zf.amax(-1)
    lse = (zf - m.unsqueeze(-1)).exp().sum(-1).log() + m
    picked = zf.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    pz = (torch.exp(zf - lse.unsqueeze(-1)) * zf).sum(-1) if entropy else None
    return lse, picked, pz


def _fused_grad(z: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None, g_lp: torch.Tensor | None,
                g_ent: torch.Tensor | None, local: torch.Tensor) -> torch.Tensor:
    """d (logprob . g_lp + entropy . g_ent) / d z for a chunk, in ``z``'s dtype (``_ChunkedLogprobs.backward``)."""
    logp = z.float() - lse.unsqueeze(-1)
    p = logp.exp()
    grad = torch.zeros_like(logp)
    if g_ent is not None:
        grad = (logp + ent.unsqueeze(-1)) * p * -g_ent.unsqueeze(-1)
    if g_lp is not None:
        onehot = torch.arange(z.shape[-1], device=z.device) == local.unsqueeze(-1)
        grad = grad - p * g_lp.unsqueeze(-1) + torch.where(onehot, g_lp.unsqueeze(-1), 0.0)
    return grad.to(z.dtype)


def _fused_fn(name: str, device: torch.device):
    """The compiled function on CUDA (``compile_chunk_fn``), the plain one elsewhere (the CPU tests run these
    formulas eagerly)."""
    fn = {"stats": _fused_stats, "grad": _fused_grad}[name]
    if device.type != "cuda":
        return fn
    if name not in _compiled:
        _compiled[name] = compile_chunk_fn(fn)
    return _compiled[name]


def compile_chunk_fn(fn, **compile_kwargs):
    """``fn`` compiled once for any chunk length: every tensor argument's first dimension (the chunk's positions)
    is marked dynamic at the first call. Why: compiled for the first chunk's length alone, the first shorter last
    chunk recompiled both functions, 1.3 s inside a timed training step on an H100 (2026-12-06); a pass's last
    chunk is shorter whenever its positions are not a multiple of ``logprob_chunk_tokens``."""
    import torch._dynamo

    compiled = torch.compile(fn, fullgraph=True, **compile_kwargs)

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 1:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)

    return call


def _use_fused(weight: torch.Tensor, group: Any) -> bool:
    return (weight.device.type in FUSED_DEVICES and group is None and weight.dtype != torch.float64
            and (weight.device.type != "cuda" or _can_compile()))


@functools.cache
def _can_compile() -> bool:
    """Whether torch.compile can build CUDA kernels here (Triton): without it the eager chunk runs, not an error."""
    from torch.utils._triton import has_triton

    return bool(has_triton())
