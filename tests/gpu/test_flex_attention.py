"""FlexAttention for packed sequences in the Megatron engine (the GPU default, ``trainer.attention: auto``) and torch's
FlashAttention-2 over the same sequences (``varlen``, ``gpu_real_shape``'s) against Megatron's unfused
matmul-softmax-matmul path, on one GPU, in bf16 (flex run on the H200 and the H100).

The same weights, the same packed micro-batches (several sequences a row, long-tailed lengths, a row width that is
no multiple of the kernel's 128-position blocks): the logprobs and one step's gradient of the two bf16 paths, each against the fp32 unfused path as the exact reference (TF32 off).
Criterion: the flex path's error at most twice the unfused path's, plus bf16's roundoff; they are two roundings of
one function. And the memory a pass keeps: flex's is linear in its positions, the unfused path's holds
``rows x heads x W x W`` scores.

Numbers go to stdout and, when ``ASYNCRL_GPU_RESULTS`` names a folder, to ``flex_attention.json`` there.
Skipped without CUDA or Megatron-core (CI has neither; the CPU tests cover the unfused path and flex's forward).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("torch.nn.attention.flex_attention")

from asyncrl.algorithms import GRPOLoss  # noqa: E402
from tests.gpu.results import Results  # noqa: E402
from asyncrl.backends.megatron import MegatronPolicy  # noqa: E402
from asyncrl.config import MegatronTrainerConfig, ModelConfig  # noqa: E402
from asyncrl.data import TrainBatch  # noqa: E402
from asyncrl.tokenizer import build_tokenizer  # noqa: E402

MODEL = ModelConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                    num_key_value_heads=2, max_position_embeddings=320, tie_word_embeddings=True, dtype="bfloat16")
LENGTHS = [300, 17, 45, 120, 9, 260, 33, 33, 80, 12, 150, 61, 7, 200, 95, 40]  # widest row 300: not 128k
U = 2.0 ** -8
RESULTS = Results("flex_attention")
record = RESULTS.record


def batch_of(lengths, prompt=6, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    ids = torch.randint(3, 256, (B, S), generator=g)
    attn = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
        mask[i, prompt:n] = 1
        ids[i, n:] = 0
    return TrainBatch(ids, attn, mask, torch.zeros(B, S), torch.randn(B, generator=g), [B])


def policy(attention: str, dtype: str = "bfloat16"):
    cfg = MegatronTrainerConfig(device="cuda", attention=attention, optimizer="torch", grad_clip=None,
                                micro_batch_tokens=1024)
    p = MegatronPolicy(MODEL.model_copy(update={"dtype": dtype}), cfg, GRPOLoss(), 0, build_tokenizer())
    p.optimizer = torch.optim.SGD(p.model.parameters(), lr=1.0)
    return p


def logprobs_and_update(p, batch):
    """The logprobs, the step's accumulated gradient (before the step divides it: bf16 weights would round an lr-1
    update of small entries away) and the step's metrics."""
    lp = p.logprobs(batch)
    b = replace(batch, gen_logprobs=(lp - 0.1) * batch.loss_mask, prev_logprobs=lp)
    p.begin_train_step()
    p.train_microbatches(b)
    grad = torch.cat([v.grad.detach().float().flatten() for v in p.model.parameters() if v.grad is not None])
    m = p.finish_train_step()
    return lp, grad, m


def test_flex_equals_the_unfused_path_within_bf16(monkeypatch):
    batch = batch_of(LENGTHS)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    ref_lp, ref_delta, _ = logprobs_and_update(policy("unfused", "float32"), batch)
    out = {}
    for kind in ("unfused", "flex", "varlen"):
        p = policy(kind)
        assert p.attention == kind
        t0 = time.perf_counter()
        lp, delta, m = logprobs_and_update(p, batch)
        mask = batch.loss_mask > 0
        out[kind] = {"logprob_err": float((lp - ref_lp).abs()[mask].mean()),
                     "update_rel_err": float((delta - ref_delta).norm() / ref_delta.norm()),
                     "grad_norm": m["grad_norm"], "first_step_s": time.perf_counter() - t0}
        p.close()
    record("flex_vs_unfused", out)
    assert out["flex"]["logprob_err"] <= 2 * out["unfused"]["logprob_err"] + U
    assert out["flex"]["update_rel_err"] <= 2 * out["unfused"]["update_rel_err"] + U
    assert out["flex"]["logprob_err"] < 0.05 and out["flex"]["update_rel_err"] < 0.1
    for key in ("logprob_err", "update_rel_err"):  # torch's FlashAttention-2 over the same packed sequences
        assert out["varlen"][key] <= 2 * out["unfused"][key] + U, key


def test_varlen_in_compiled_layers_computes_what_it_does_eagerly():
    """``gpu_real_shape``'s pair: each layer compiled whole (``trainer.compile: layers``) around the varlen kernel
    gives the eager layers' logprobs and update, within bf16."""
    batch = batch_of(LENGTHS, seed=3)
    out = {}
    for how in ("none", "layers"):
        cfg = MegatronTrainerConfig(device="cuda", attention="varlen", optimizer="torch", grad_clip=None,
                                    micro_batch_tokens=1024, compile=how)
        p = MegatronPolicy(MODEL, cfg, GRPOLoss(), 0, build_tokenizer())
        p.optimizer = torch.optim.SGD(p.model.parameters(), lr=1.0)
        out[how] = logprobs_and_update(p, batch)
        p.close()
    mask = batch.loss_mask > 0
    lp_err = float((out["layers"][0] - out["none"][0]).abs()[mask].mean())
    upd_err = float((out["layers"][1] - out["none"][1]).norm() / out["none"][1].norm())
    record("varlen_compiled_vs_eager", {"logprob_err": lp_err, "update_rel_err": upd_err})
    assert lp_err < 0.01 and upd_err < 0.05


def test_flex_keeps_memory_linear_in_positions():
    """A pass of 8 rows of 1,024 positions: the unfused path keeps each layer's [8, 6, 1024, 1024] scores (fp32
    softmax and bf16 probabilities), flex keeps its inputs and outputs."""
    big = MODEL.model_copy(update={"max_position_embeddings": 1100})
    batch = batch_of([1024] * 8, seed=1)
    peaks = {}
    for kind in ("unfused", "flex", "varlen"):
        cfg = MegatronTrainerConfig(device="cuda", attention=kind, optimizer="torch", micro_batch_tokens=8192)
        p = MegatronPolicy(big, cfg, GRPOLoss(), 0, build_tokenizer())
        b = replace(batch, prev_logprobs=torch.zeros_like(batch.gen_logprobs))
        p.begin_train_step()
        p.train_microbatches(b)  # once to compile and warm the allocator
        p.finish_train_step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        p.begin_train_step()
        p.train_microbatches(b)
        torch.cuda.synchronize()
        peaks[kind] = (torch.cuda.max_memory_allocated() - base) / 2**30
        p.finish_train_step()
        p.close()
    record("pass_peak_gib", peaks)
    assert peaks["flex"] < 0.5 * peaks["unfused"] and peaks["varlen"] < 0.5 * peaks["unfused"]
