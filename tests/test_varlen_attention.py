"""``trainer.attention: varlen`` on the CPU: the sequences a pass hands torch's FlashAttention-2 kernel, and the
Megatron engine's plumbing around it (the [W, R, heads, d] layout Megatron passes, flattened row by row and back),
with a reference kernel that attends within each sequence by ``scaled_dot_product_attention`` standing in for the
CUDA-only one. The kernel itself against the unfused path runs on a GPU (tests/gpu/test_flex_attention.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncrl import micro_batches
from asyncrl.backends import megatron_forward
from asyncrl.backends.megatron_forward import attention_kind, varlen_mask
from asyncrl.config import MegatronTrainerConfig
from tests.test_megatron_backend import (LONG_TAIL, _policy, long_tailed_batch, megatron_cpu,  # noqa: F401
                                         sgd_step, tok)


def reference_varlen(q, k, v, cu_seqlens, max_len, scale):
    """Causal attention within each sequence of ``cu_seqlens``: [total, heads, d] in and out, grouped-query."""
    bounds = cu_seqlens.tolist()
    assert max(b - a for a, b in zip(bounds, bounds[1:])) == max_len  # the kernel's grid is sized by it: exact
    parts = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                            scale=scale, enable_gqa=True).transpose(0, 1)
             for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts)


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    monkeypatch.setattr(megatron_forward, "_varlen_available", lambda device: True)
    monkeypatch.setattr(megatron_forward, "_VARLEN_KERNEL", reference_varlen)


def test_a_packed_pass_is_cut_at_every_row_start_and_sequence_change():
    """Row 0 holds sequences 0 and 1 then padding, row 1 sequence 2 filling it: the kernel sees four sequences
    (the padding one of its own, which no real position attends to)."""
    cpu = torch.device("cpu")
    mask = varlen_mask(torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, 2, 2]]), 2, 6, cpu)
    assert mask.cu_seqlens.tolist() == [0, 3, 5, 6, 12] and mask.max_len == 6
    assert mask.cu_seqlens.dtype == torch.int32
    # a row of padding after a row that ends in padding: cut at the row's start all the same
    mask = varlen_mask(torch.tensor([[0, -1, -1], [-1, -1, -1]]), 2, 3, cpu)
    assert mask.cu_seqlens.tolist() == [0, 1, 3, 6] and mask.max_len == 3
    # unpacked rows (sorted / rows micro-batching): one sequence a row, right-padded
    mask = varlen_mask(None, 3, 4, cpu)
    assert mask.cu_seqlens.tolist() == [0, 4, 8, 12] and mask.max_len == 4


def test_varlen_needs_a_cuda_device_of_compute_capability_8_and_says_so():
    with pytest.raises(ValueError, match=r"trainer.attention 'varlen' needs a CUDA device.*'cpu'.*'flex' or 'auto'"):
        attention_kind("varlen", torch.device("cpu"))
    assert attention_kind("auto", torch.device("cpu")) == "unfused"
    with pytest.raises(ValueError, match="attention"):
        MegatronTrainerConfig(attention="flash")


def test_varlen_computes_what_the_unfused_path_does(megatron_cpu, tok, varlen_on_cpu, monkeypatch):  # noqa: F811
    """Logprobs on packed rows holding several sequences and on length-sorted ones, and one step's weight change
    (plain SGD at lr 1: the gradient through the kernel's layout), against Megatron's unfused attention."""
    batch = long_tailed_batch(LONG_TAIL, seed=4)
    plans = micro_batches.plan(batch, "packed", micro_batch_tokens=64)
    assert any((mb.segments.max(-1).values > 0).any() for mb in plans)  # rows really hold several sequences
    seen = []
    monkeypatch.setattr(megatron_forward, "_VARLEN_KERNEL",
                        lambda q, *a: seen.append(q.shape) or reference_varlen(q, *a))
    for mode in ("packed", "sorted"):
        lp = {kind: _policy(tok, attention=kind, micro_batching=mode).logprobs(batch) for kind in ("unfused", "varlen")}
        assert lp["varlen"].abs().sum() > 0
        torch.testing.assert_close(lp["varlen"], lp["unfused"], atol=2e-5, rtol=0, msg=lambda s: f"{mode}: {s}")
    # a pass of R rows reaches the kernel as one row of R x W positions (final_hidden): q is [R * W, heads, d]
    assert any(shape[0] > batch.input_ids.shape[1] for shape in seen)
    deltas = {}
    for kind in ("unfused", "varlen"):
        policy = _policy(tok, attention=kind)
        assert policy.attention == kind
        deltas[kind] = sgd_step(policy, batch)[2]
    moved = sum(float(d.abs().sum()) for d in deltas["varlen"].values())
    assert moved > 0
    for k in deltas["unfused"]:
        torch.testing.assert_close(deltas["varlen"][k], deltas["unfused"][k], atol=1e-6, rtol=1e-4,
                                   msg=lambda s: f"{k}: {s}")


def traceable_varlen(q, k, v, cu_seqlens, max_len, scale):
    """The reference as one dense masked attention dynamo can trace (no ``.tolist()``): what the real kernel's
    ``torch.ops.aten`` call is to a compiled layer."""
    pos = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_seqlens, pos, right=True)
    allowed = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), attn_mask=allowed, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1).contiguous()  # as the kernel returns it


def test_compiled_layers_trace_the_varlen_pass(megatron_cpu, tok, monkeypatch):  # noqa: F811
    """``gpu_real_shape``'s pair, compiled layers with varlen attention: dynamo traces a layer holding the pass's
    ``VarlenMask`` (its tensor and its int) and gives the eager layers' logprobs."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(megatron_forward, "_varlen_available", lambda device: True)
    monkeypatch.setattr(megatron_forward, "_VARLEN_KERNEL", traceable_varlen)
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: real(fn, **{**kw, "backend": "eager"}))
    monkeypatch.setattr(torch.cuda, "current_device", torch._dynamo.assume_constant_result(lambda: "cpu"))
    try:
        batch = long_tailed_batch(LONG_TAIL, seed=2)
        eager = _policy(tok, attention="varlen").logprobs(batch)
        counters.clear()
        compiled = _policy(tok, attention="varlen", compile="layers")
        assert compiled.compiled
        torch.testing.assert_close(compiled.logprobs(batch), eager, atol=1e-5, rtol=1e-5)
        assert counters["stats"]["unique_graphs"] > 0
        breaks = {str(k) for k in counters["graph_break"]}
        assert not any("varlen" in b.lower() or "VarlenMask" in b for b in breaks), breaks
    finally:
        torch._dynamo.reset()



@pytest.mark.parametrize("attention", ["varlen", "flex"])
def test_every_model_gets_the_same_core_attention_class(megatron_cpu, attention):  # noqa: F811
    """Compiled layers guard on their modules' types: a policy built again (a benchmark's second mode, a restart)
    reuses the compiled layers only if its core attention is of the same class."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    specs = [megatron_forward.layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"), attention)
             for _ in range(2)]
    a, b = (s.submodules.self_attention.submodules.core_attention for s in specs)
    assert a is b and a.__name__ == "FlexCoreAttention"
