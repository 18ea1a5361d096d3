"""``trainer.gradient_checkpointing`` on the Megatron trainer: Megatron-core's full activation recompute
(``recompute_granularity 'full'``, ``recompute_method 'uniform'``, one layer a group) computes the same step as
without it, through its own ``tensor_parallel.checkpoint``, with the unfused attention and with FlexAttention's
block mask (which ``save_for_backward`` cannot take: ``megatron_forward._hand_over_block_mask``).

The configuration refuses it off CUDA (tests/test_gradient_checkpointing.py): Megatron's checkpoint saves and
restores the CUDA RNG state around each recompute, which a CPU-only torch cannot read. Here those two calls are
stubbed (every dropout of the model is 0, so no random number is drawn), which runs the rest of Megatron's
recompute on the CPU as the GPU runs it. On a GPU, unpatched, with its memory: tests/gpu/test_recompute_gpu.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'asyncrl[megatron]')")

from asyncrl.algorithms import GRPOLoss, LossConfig  # noqa: E402
from asyncrl.backends.megatron import MegatronPolicy  # noqa: E402
from asyncrl.backends.megatron_forward import (activation_bytes, final_hidden, fit_micro_batch_tokens,  # noqa: E402
                                               pass_mask)
from asyncrl.config import MegatronTrainerConfig, ModelConfig  # noqa: E402
from tests.test_megatron_backend import LONG_TAIL, long_tailed_batch, megatron_cpu, tok  # noqa: E402,F401


@pytest.fixture
def cpu_rng(monkeypatch):
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: None)
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)


def _policy(tok, recompute: bool, attention: str = "unfused") -> MegatronPolicy:
    cfg = MegatronTrainerConfig(device="cpu", grad_clip=None, optimizer="torch", micro_batch_tokens=64,
                                attention=attention)
    cfg = cfg.model_copy(update={"gradient_checkpointing": recompute})  # past the CUDA-only check (docstring)
    return MegatronPolicy(ModelConfig(num_hidden_layers=3), cfg, GRPOLoss(LossConfig(entropy_coef=0.05)), 3, tok)


def _step(policy, batch):
    batch = replace(batch, prev_logprobs=policy.logprobs(batch), gen_logprobs=policy.logprobs(batch))
    policy.begin_train_step()
    out = policy.train_microbatches(batch)
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    return out, grads, policy.finish_train_step()


def _kept_bytes(policy, batch) -> int:
    """Bytes a training forward of the first pass keeps for its backward, the parameters left out."""
    from asyncrl import micro_batches

    params = {p.data_ptr() for p in policy.model.parameters()}
    mb = micro_batches.plan(batch, "packed", None, 64)[0]
    ids = micro_batches.packed_ids(batch, mb)
    mask = pass_mask(policy.attention, mb, *ids.shape, policy.device, {})
    sizes = []
    keep = lambda t: sizes.append(0 if t.data_ptr() in params else t.numel() * t.element_size()) or t  # noqa: E731
    policy.model.train()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        final_hidden(policy.model, policy._forward_module, ids, mask)
    return sum(sizes)


def test_megatron_recompute_gives_the_same_loss_and_gradients(megatron_cpu, tok, cpu_rng):  # noqa: F811
    batch = long_tailed_batch(LONG_TAIL, seed=4)  # packed rows holding several sequences: several passes
    plain, recomputed = _policy(tok, False), _policy(tok, True)
    config = recomputed.transformer_config
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full",
                                                                                                  "uniform", 1)
    assert plain.transformer_config.recompute_granularity is None
    (p_out, p_grads, p_m), (r_out, r_grads, r_m) = _step(plain, batch), _step(recomputed, batch)
    assert _kept_bytes(recomputed, batch) < 0.5 * _kept_bytes(plain, batch)  # the layers' activations not kept
    assert r_m["loss"] == pytest.approx(p_m["loss"], rel=1e-6, abs=1e-7)
    assert r_m["grad_norm"] == pytest.approx(p_m["grad_norm"], rel=1e-6) and p_m["grad_norm"] > 0
    assert p_grads.keys() == r_grads.keys() and len(p_grads) > 5
    for name, grad in p_grads.items():
        torch.testing.assert_close(r_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_megatron_recompute_takes_flex_attention_s_block_mask(megatron_cpu, tok, cpu_rng):  # noqa: F811
    """With FlexAttention the pass's mask is a ``BlockMask``, which Megatron's checkpoint would hand to
    ``save_for_backward`` ("can only save variables"); handed over beside the call, the recomputed forward (with
    gradients on) computes the hidden states of the plain one. (No FlexAttention backward on a CPU: the GPU test.)"""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from asyncrl import micro_batches

    batch = long_tailed_batch(LONG_TAIL, seed=4)
    hidden = {}
    for recompute in (False, True):
        policy = _policy(tok, recompute, attention="flex")
        policy.model.train()
        mb = micro_batches.plan(batch, "packed", None, 64)[0]
        ids = micro_batches.packed_ids(batch, mb)
        mask = pass_mask("flex", mb, *ids.shape, policy.device, {})
        with torch.set_grad_enabled(recompute):  # the plain forward with gradients would need flex's backward
            out = final_hidden(policy.model, policy._forward_module, ids, mask)
        assert out.requires_grad == recompute
        hidden[recompute] = out.detach()
    torch.testing.assert_close(hidden[True], hidden[False], rtol=0, atol=0)


def test_the_micro_batch_budget_counts_what_recompute_keeps():
    """With recompute a pass keeps each layer's input and one layer's activations at a time, so the budget that
    fits the same memory is several times larger (the auto budget: larger passes, fewer of them)."""
    from types import SimpleNamespace

    spec = SimpleNamespace(hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2, head_dim=64,
                           num_layers=24)  # Qwen2.5-0.5B's shape
    for attention in ("flex", "unfused"):
        plain = activation_bytes(spec, torch.bfloat16, attention, 1024)
        kept = activation_bytes(spec, torch.bfloat16, attention, 1024, recompute=True)
        layer = plain / spec.num_layers
        assert kept == pytest.approx(layer + (spec.num_layers + 2) * 896 * 2)
        assert kept < plain / 5
    gib = 2 ** 30
    per, per_rc = (activation_bytes(spec, torch.bfloat16, "flex", 1024, recompute=r) for r in (False, True))
    assert (fit_micro_batch_tokens(None, 20 * gib, per_rc, 2 * gib, 1024, "cuda:0")
            > 5 * fit_micro_batch_tokens(None, 20 * gib, per, 2 * gib, 1024, "cuda:0"))
