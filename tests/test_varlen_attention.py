"""``trainer.attention: varlen`` on the CPU: the sequences a pass hands torch's FlashAttention-2 kernel, and the
Megatron engine's plumbing around it (the [W, R, heads, d] layout Megatron passes, flattened row by row and back),
with a reference kernel that attends within each sequence by ``scaled_dot_product_attention`` standing in for the
CUDA-only one. The kernel itself against the unfused path runs on a GPU (tests/gpu/test_flex_attention.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from asyncrl import micro_batches
from asyncrl.backends import megatron_forward
from asyncrl.backends.megatron_forward import attention_kind, varlen_mask
from asyncrl.config import MegatronTrainerConfig
from tests.test_megatron_backend import (LONG_TAIL, _policy, long_tailed_batch, megatron_cpu,  # noqa: F401
                                         tok, weights)


def reference_varlen(q, k, v, cu_seqlens, max_len, scale):
    """Causal attention within each sequence of ``cu_seqlens``: [total, heads, d] in and out, grouped-query."""
    bounds = cu_seqlens.tolist()
    assert max(b - a for a, b in zip(bounds, bounds[1:])) <= max_len  # the bound the kernel's grid is sized by
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
    segments = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, 2, 2]])
    assert varlen_mask(segments, 2, 6, torch.device("cpu")).cu_seqlens.tolist() == [0, 3, 5, 6, 12]
    assert varlen_mask(segments, 2, 6, torch.device("cpu")).cu_seqlens.dtype == torch.int32
    # two rows each ending in padding and the next starting a sequence with the same id as none before: still cut
    segments = torch.tensor([[0, -1, -1], [-1, -1, -1]])
    assert varlen_mask(segments, 2, 3, torch.device("cpu")).cu_seqlens.tolist() == [0, 1, 3, 6]
    # unpacked rows (sorted / rows micro-batching): one sequence a row, right-padded
    assert varlen_mask(None, 3, 4, torch.device("cpu")).cu_seqlens.tolist() == [0, 4, 8, 12]


def test_varlen_needs_a_cuda_device_of_compute_capability_8_and_says_so():
    with pytest.raises(ValueError, match=r"trainer.attention 'varlen' needs a CUDA device.*'cpu'.*'flex' or 'auto'"):
        attention_kind("varlen", torch.device("cpu"))
    assert attention_kind("auto", torch.device("cpu")) == "unfused"
    with pytest.raises(ValueError, match="attention"):
        MegatronTrainerConfig(attention="flash")


def test_varlen_computes_what_the_unfused_path_does(megatron_cpu, tok, varlen_on_cpu):  # noqa: F811
    """Logprobs on packed rows holding several sequences and on length-sorted ones, and one step's weight change
    (plain SGD at lr 1: the gradient through the kernel's layout), against Megatron's unfused attention."""
    batch = long_tailed_batch(LONG_TAIL, seed=4)
    plans = micro_batches.plan(batch, "packed", micro_batch_tokens=64)
    assert any((mb.segments.max(-1).values > 0).any() for mb in plans)  # rows really hold several sequences
    for mode in ("packed", "sorted"):
        lp = {kind: _policy(tok, attention=kind, micro_batching=mode).logprobs(batch) for kind in ("unfused", "varlen")}
        assert lp["varlen"].abs().sum() > 0
        torch.testing.assert_close(lp["varlen"], lp["unfused"], atol=2e-5, rtol=0, msg=lambda s: f"{mode}: {s}")
    deltas = {}
    for kind in ("unfused", "varlen"):
        policy = _policy(tok, attention=kind)
        assert policy.attention == kind
        policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
        w0 = weights(policy)
        lp = policy.logprobs(batch)
        b = replace(batch, gen_logprobs=(lp - 0.1 * torch.cos(batch.input_ids * 0.3)) * batch.loss_mask)
        policy.begin_train_step()
        policy.train_microbatches(b)
        policy.finish_train_step()
        deltas[kind] = {k: v - w0[k] for k, v in weights(policy).items()}
    moved = sum(float(d.abs().sum()) for d in deltas["varlen"].values())
    assert moved > 0
    for k in deltas["unfused"]:
        torch.testing.assert_close(deltas["varlen"][k], deltas["unfused"][k], atol=1e-6, rtol=1e-4,
                                   msg=lambda s: f"{k}: {s}")
