"""GRPO maths (asyncrl/algorithms.py): advantages, the clipped importance-corrected loss and its variants, KL estimators,
and whole-step normalisation — a step's update must not depend on how it was chunked or micro-batched."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from asyncrl.algorithms import (
    GRPOLoss,
    chunked_logprobs,
    LossConfig,
    group_advantages,
    grpo_loss,
    make_train_batch,
    token_entropy,
    token_logprobs,
)
from asyncrl.config import ModelConfig, TorchTrainerConfig
from asyncrl.data import GroupRollouts, TrainBatch
from asyncrl.metrics import Metric

NO_IS = dict(importance_correction="none", truncation="none")


# ------------------------------------------------------------------------------------------- advantages
def test_group_mean_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(r)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))


def test_leave_one_out_baseline_is_the_mean_of_the_others():
    r = torch.tensor([[1.0, 0.0, 0.3, 0.9, 0.2]])
    adv = group_advantages(r, "leave_one_out")
    G = r.shape[1]
    expected = torch.tensor([[r[0, i] - (r[0].sum() - r[0, i]) / (G - 1) for i in range(G)]])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_std_scaling_divides_by_the_group_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(r, scale_by_std=True)
    assert torch.allclose(adv[0], (r[0] - r[0].mean()) / (r[0].std() + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4))  # no spread: zero advantages, not nan
    single = group_advantages(torch.tensor([[1.0]]), scale_by_std=True)
    assert torch.equal(single, torch.zeros(1, 1))


def test_advantage_errors():
    with pytest.raises(ValueError, match="leave_one_out"):
        group_advantages(torch.tensor([[1.0]]), "leave_one_out")
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(torch.tensor([[1.0, 0.0]]), "median")


# ---------------------------------------------------------------------------------------- batch building
def _group(gid, prompt, completions, rewards, logprob=-1.0):
    return GroupRollouts(gid, prompt, completions, [[logprob - 0.1 * j for j in range(len(c))] for c in completions],
                         0, 0, rewards=rewards)


def test_make_train_batch_aligns_tokens_masks_and_logprobs():
    groups = [_group(0, [257, 10], [[1, 2, 258], [3]], [1.0, 0.0]), _group(1, [257, 10, 11], [[4, 5]], [0.5])]
    b = make_train_batch(groups, LossConfig(), pad_id=256)
    assert b.input_ids.tolist() == [[257, 10, 1, 2, 258], [257, 10, 3, 256, 256], [257, 10, 11, 4, 5]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 1, 1]]
    assert b.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0], [1] * 5]
    assert torch.allclose(b.gen_logprobs[0, 2:], torch.tensor([-1.0, -1.1, -1.2]))
    assert b.gen_logprobs[1, 3:].abs().sum() == 0
    assert b.advantages.tolist() == [0.5, -0.5, 0.0]
    assert b.group_sizes == [2, 1] and b.num_tokens == 6 and b.num_sequences == 3


def test_make_train_batch_needs_rewards():
    with pytest.raises(ValueError, match="rewards"):
        make_train_batch([_group(0, [1], [[2]], None)], LossConfig(), 0)


def test_token_logprobs_and_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    lp = token_logprobs(logits, ids)
    assert lp[:, 0].abs().sum() == 0
    manual = torch.log_softmax(logits, -1)[0, 1, ids[0, 2]]
    assert torch.allclose(lp[0, 2], manual)
    ent = token_entropy(logits)
    p = torch.softmax(logits[1, 2], -1)
    assert torch.allclose(ent[1, 3], -(p * p.log()).sum())


def _full_logprobs(hidden, weight, targets, rows=None):
    """The full-vocabulary reference: every logit at once, then ``token_logprobs``' and ``token_entropy``'s sums."""
    logits = hidden @ weight[:rows].t()
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_logprobs_equal_the_full_logits_forward_and_gradients(chunk, dtype):
    """The chunked path computes what the full ``[positions, vocab]`` logits give, in the forward and in both
    gradients (hidden states and output weights), entropy included, for any chunk size (one that divides the
    positions, one that does not, one larger than them): equal up to float reassociation."""
    g = torch.Generator().manual_seed(chunk)
    N, H, V = 13, 8, 37
    hidden = torch.randn(N, H, generator=g, dtype=dtype).mul(2).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    a, b = torch.randn(N, generator=g, dtype=dtype), torch.randn(N, generator=g, dtype=dtype)

    lp, ent = chunked_logprobs(hidden, weight, targets, chunk, entropy=True)
    (lp * a + ent * b).sum().backward()
    got = lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_lp, ref_ent = _full_logprobs(hidden, weight, targets)
    (ref_lp * a + ref_ent * b).sum().backward()
    ref = ref_lp.detach(), ref_ent.detach(), hidden.grad, weight.grad

    # float reassociation: |x - y| / |y| (norms) far below the precision's unit roundoff times the sums' lengths
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert lp.dtype == dtype
    for name, x, y in zip(("logprobs", "entropy", "d hidden", "d weight"), got, ref):
        assert float((x - y).norm() / y.norm()) < tol, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [4, 64])
def test_fused_chunk_equals_the_eager_path_forward_and_gradients(monkeypatch, chunk, dtype):
    """The fused chunk (what CUDA runs compiled: one function over a chunk's logits in the weight's dtype) computes
    the eager path's logprobs, entropy and both gradients, up to float reassociation, with the output layer padded
    past the vocabulary, and with only one of the two outputs used (the other's gradient None)."""
    from asyncrl import logprobs as L

    g = torch.Generator().manual_seed(chunk)
    N, H, V, real = 21, 16, 50, 45
    hidden0 = torch.randn(N, H, generator=g).mul(2).to(dtype)
    weight0 = torch.randn(V, H, generator=g).to(dtype)
    targets = torch.randint(0, real, (N,), generator=g)
    a = torch.randn(N, generator=g)

    def run(fused, use):
        monkeypatch.setattr(L, "FUSED_DEVICES", {"cpu"} if fused else set())
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        lp, ent = chunked_logprobs(hidden, weight, targets, chunk, entropy=True, vocab_size=real)
        loss = {"both": (lp * a).sum() + (ent * a).sum(), "lp": (lp * a).sum(), "ent": (ent * a).sum()}[use]
        loss.backward()
        return lp.detach(), ent.detach(), hidden.grad.float(), weight.grad.float()

    # bf16: the two paths round the weight's gradient to bf16 from float32 sums taken in another order
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for use in ("both", "lp", "ent"):
        got, ref = run(True, use), run(False, use)
        for name, x, y in zip(("logprobs", "entropy", "d hidden", "d weight"), got, ref):
            assert x.dtype == y.dtype, name
            assert float((x - y).norm() / y.norm()) < tol, (use, name)
        assert float(got[3][real:].abs().max()) == 0.0  # rows past the vocabulary get no gradient


def test_the_compiled_chunk_is_compiled_once_for_every_chunk_length():
    """The fused chunk functions (compiled on CUDA) take a shorter last chunk without compiling again (a recompile
    cost 1.3 s inside a timed training step on an H100) and compute what they compute eagerly."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from asyncrl import logprobs as L

    torch._dynamo.reset()
    counters.clear()
    stats, grad = (L.compile_chunk_fn(f, backend="aot_eager") for f in (L._fused_stats, L._fused_grad))
    g = torch.Generator().manual_seed(0)
    for rows in (64, 64, 40, 64, 7):
        z, local = torch.randn(rows, 50, generator=g).to(torch.bfloat16), torch.randint(0, 50, (rows,), generator=g)
        got, ref = stats(z, local, True), L._fused_stats(z, local, True)
        for x, y in zip(got, ref):
            torch.testing.assert_close(x, y)
        lse, ent, g_lp = ref[0], torch.randn(rows, generator=g), torch.randn(rows, generator=g)
        torch.testing.assert_close(grad(z, lse, ent, g_lp, g_lp, local), L._fused_grad(z, lse, ent, g_lp, g_lp, local))
    assert counters["stats"]["unique_graphs"] == 2  # one graph per function, whatever the chunk's length
    torch._dynamo.reset()


def test_chunked_logprobs_without_entropy_and_with_a_padded_vocabulary():
    """Rows past ``vocab_size`` (a vocabulary padded for tensor parallelism) are left out of the softmax and get
    no gradient; without ``entropy`` none is returned; under no_grad nothing is kept for a backward."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, 6, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 10, (9,), generator=g)
    lp, ent = chunked_logprobs(hidden, weight, targets, 4, vocab_size=10)
    assert ent is None
    lp.sum().backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    assert ref_w[10:].abs().max() == 0
    hidden.grad = weight.grad = None
    _full_logprobs(hidden, weight, targets, rows=10)[0].sum().backward()
    torch.testing.assert_close(lp.detach().double(), _full_logprobs(hidden, weight, targets, 10)[0].detach())
    torch.testing.assert_close(ref_h, hidden.grad)
    torch.testing.assert_close(ref_w, weight.grad)
    with torch.no_grad():
        assert not chunked_logprobs(hidden, weight, targets, 4)[0].requires_grad
    with pytest.raises(ValueError, match="chunk_tokens 0"):
        chunked_logprobs(hidden, weight, targets, 0)


def test_chunked_logprobs_in_bf16_round_like_the_full_path():
    """In bf16 the logits are the output layer's bf16 product upcast to float32, as the full path's are: the two
    agree to float32 rounding of the same bf16 logits, far inside bf16's own error."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(20, 16, generator=g).to(torch.bfloat16)
    weight = torch.randn(50, 16, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 50, (20,), generator=g)
    lp, ent = chunked_logprobs(hidden, weight, targets, 6, entropy=True)
    ref_lp, ref_ent = _full_logprobs(hidden, weight, targets)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------- loss
def _batch(curr, prev=None, gen=None, adv=(1.0,), mask=None, ref=None):
    curr = torch.tensor(curr, dtype=torch.float32)
    B, S = curr.shape
    mask = torch.ones(B, S) if mask is None else torch.tensor(mask, dtype=torch.float32)
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.float32)  # noqa: E731
    gen = t(gen) if gen is not None else (t(prev) if prev is not None else curr.clone())
    b = TrainBatch(torch.zeros(B, S, dtype=torch.long), torch.ones(B, S, dtype=torch.long), mask, gen,
                   torch.tensor(adv, dtype=torch.float32), [B], t(prev), t(ref))
    return curr.requires_grad_(True), b


def test_on_policy_loss_is_minus_mean_advantage_and_its_gradient_is_policy_gradient():
    curr, b = _batch([[-1.0, -2.0], [-0.5, -0.7]], prev=[[-1.0, -2.0], [-0.5, -0.7]], adv=(2.0, -1.0))
    loss_sum, norm, m = grpo_loss(curr, b, LossConfig(**NO_IS))
    assert norm == 4 and m["tokens"] == 4
    assert loss_sum.item() == pytest.approx(-(2 + 2 - 1 - 1))
    loss_sum.backward()
    assert torch.allclose(curr.grad, torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))


def test_ratio_clipping_stops_the_gradient_outside_the_trust_region():
    # ratio e^0.5 > 1.2 with a positive advantage: clipped, no gradient; negative advantage: not clipped.
    curr, b = _batch([[-0.5], [-0.5]], prev=[[-1.0], [-1.0]], adv=(1.0, -1.0))
    loss_sum, _, m = grpo_loss(curr, b, LossConfig(**NO_IS))
    loss_sum.backward()
    assert curr.grad[0, 0] == 0 and curr.grad[1, 0] != 0
    assert m["clip_frac"] == 2
    assert loss_sum.item() == pytest.approx(-1.2 + math.exp(0.5))


def test_tis_clamps_the_importance_weight():
    # prev - gen = [2, 0.1]: w = [e^2 -> capped at 2, e^0.1]
    curr, b = _batch([[-1.0, -1.0]], prev=[[-1.0, -1.0]], gen=[[-3.0, -1.1]])
    loss_sum, _, m = grpo_loss(curr, b, LossConfig(importance_correction="token", truncation="tis", is_cap=2.0))
    assert loss_sum.item() == pytest.approx(-(2.0 + math.exp(0.1)), rel=1e-6)
    assert m["is_truncated_frac"] == 1 and m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_weight_min"] == pytest.approx(math.exp(0.1), rel=1e-6)


def test_no_truncation_keeps_the_raw_weight():
    curr, b = _batch([[-1.0]], prev=[[-1.0]], gen=[[-3.0]])
    loss_sum, _, m = grpo_loss(curr, b, LossConfig(importance_correction="token", truncation="none"))
    assert loss_sum.item() == pytest.approx(-math.exp(2.0), rel=1e-6) and m["is_truncated_frac"] == 0


def test_icepop_masks_tokens_outside_the_band():
    # w = [e^2 (too high), 1, e^-1 (too low)]
    curr, b = _batch([[-1.0, -1.0, -1.0]], prev=[[-1.0, -1.0, -1.0]], gen=[[-3.0, -1.0, 0.0]])
    loss_sum, _, m = grpo_loss(curr, b, LossConfig(truncation="icepop", is_low=0.5, is_high=2.0))
    assert loss_sum.item() == pytest.approx(-1.0)
    assert m["is_truncated_frac"] == 2 and m["is_weight_min"] == 0.0


def test_seq_mask_tis_drops_whole_sequences_by_their_geometric_mean_weight():
    # row 0: log w = [1.2, 1.2] -> geo-mean e^1.2 > 2: dropped; row 1: log w = [1.0, -0.8] -> e^0.1 kept,
    # its first token capped at 2.
    curr, b = _batch([[-1.0, -1.0], [-1.0, -1.0]], prev=[[-1.0, -1.0], [-1.0, -1.0]],
                     gen=[[-2.2, -2.2], [-2.0, -0.2]], adv=(1.0, 1.0))
    loss_sum, _, m = grpo_loss(curr, b, LossConfig(truncation="seq-mask-tis", is_low=0.5, is_high=2.0, is_cap=2.0))
    assert loss_sum.item() == pytest.approx(-(2.0 + math.exp(-0.8)), rel=1e-6)
    assert m["is_truncated_frac"] == 3  # two dropped tokens, one capped


def test_sequence_level_importance_weight_is_the_product_over_tokens():
    curr, b = _batch([[-1.0, -1.0]], prev=[[-1.0, -1.0]], gen=[[-1.3, -1.2]])
    loss_sum, _, _ = grpo_loss(curr, b, LossConfig(importance_correction="sequence", truncation="none"))
    assert loss_sum.item() == pytest.approx(-2 * math.exp(0.5), rel=1e-6)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators(kind):
    curr_v, ref_v = [[-1.0, -2.0]], [[-1.5, -1.0]]
    curr, b = _batch(curr_v, prev=curr_v, adv=(0.0,), ref=ref_v)
    loss_sum, _, m = grpo_loss(curr, b, LossConfig(**NO_IS, kl=kind, kl_coef=0.5))
    delta = torch.tensor(ref_v) - torch.tensor(curr_v)
    kl = {"k1": -delta, "k2": 0.5 * delta**2, "k3": delta.exp() - delta - 1}[kind]
    assert m["kl"] == pytest.approx(float(kl.sum()), rel=1e-6)
    assert loss_sum.item() == pytest.approx(0.5 * float(kl.sum()), rel=1e-6)
    # zero at the reference
    curr, b = _batch(curr_v, prev=curr_v, adv=(0.0,), ref=curr_v)
    assert grpo_loss(curr, b, LossConfig(**NO_IS, kl=kind, kl_coef=0.5))[2]["kl"] == pytest.approx(0.0, abs=1e-7)


def test_kl_needs_reference_logprobs():
    curr, b = _batch([[-1.0]])
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(curr, b, LossConfig(**NO_IS, kl="k3", kl_coef=0.1))


def test_padding_never_produces_nan():
    # off the mask the policy's logprob is hugely negative and the reference's 0: exp would overflow
    curr, b = _batch([[-1.0, -500.0]], prev=[[-1.0, 0.0]], gen=[[-1.2, 0.0]], mask=[[1, 0]], ref=[[-1.1, 0.0]])
    loss_sum, norm, m = grpo_loss(curr, b, LossConfig(kl="k3", kl_coef=0.1), entropy=torch.ones(1, 2))
    loss_sum.backward()
    assert torch.isfinite(loss_sum) and torch.isfinite(curr.grad).all() and norm == 1
    assert all(math.isfinite(v) for v in m.values())


def test_sequence_normalisation_averages_tokens_within_each_sequence():
    curr, b = _batch([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], adv=(1.0, 3.0), mask=[[1, 1, 1], [0, 0, 1]])
    loss_sum, norm, _ = grpo_loss(curr, b, LossConfig(**NO_IS, normalisation="sequence"))
    assert norm == 2 and loss_sum.item() == pytest.approx(-(1.0 + 3.0))
    loss_sum, norm, _ = grpo_loss(curr, b, LossConfig(**NO_IS, normalisation="token"))
    assert norm == 4 and loss_sum.item() == pytest.approx(-(3 * 1.0 + 3.0))


def test_entropy_bonus_lowers_the_loss():
    curr, b = _batch([[-1.0, -1.0]], adv=(0.0,))
    entropy = torch.tensor([[2.0, 1.0]])
    loss_sum, _, m = grpo_loss(curr, b, LossConfig(**NO_IS, entropy_coef=0.1), entropy=entropy)
    assert loss_sum.item() == pytest.approx(-0.3) and m["entropy"] == pytest.approx(3.0)


def test_loss_config_rejects_inconsistent_settings():
    with pytest.raises(ValueError):
        LossConfig(is_low=2.0, is_high=1.0)
    with pytest.raises(ValueError):
        LossConfig(kl="k3")
    with pytest.raises(ValueError):
        LossConfig(importance_correction="none", truncation="tis")


# ------------------------------------------------------------------------------- whole-step normalisation
TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1)


def _random_groups(seed, n_groups=6, G=4):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid in range(n_groups):
        plen = int(torch.randint(2, 5, (1,), generator=g))
        prompt = [257] + torch.randint(0, 256, (plen,), generator=g).tolist()
        comps = [torch.randint(0, 259, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(G)]
        lps = [(-torch.rand(len(c), generator=g) * 3).tolist() for c in comps]
        rewards = torch.rand(G, generator=g).round().tolist()
        groups.append(GroupRollouts(gid, prompt, comps, lps, 0, 0, rewards=rewards))
    return groups


def _train_step(loss_cfg, chunks, micro_batch_size=None, steps=2):
    from asyncrl.backends.torch import TorchPolicy

    policy = TorchPolicy(TINY, TorchTrainerConfig(lr=1e-2, micro_batch_size=micro_batch_size), GRPOLoss(loss_cfg), seed=0)
    out = []
    for step in range(steps):
        groups = _random_groups(step)
        policy.begin_train_step()
        for lo, hi in chunks:
            batch = make_train_batch(groups[lo:hi], loss_cfg, pad_id=256)
            batch = replace(batch, prev_logprobs=policy.logprobs(batch))
            # generator logprobs off by a deterministic per-token amount in [-1, 1]: some importance weights
            # inside the truncation band, some outside, independent of how the step is cut into chunks
            pos = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)
            batch = replace(batch, gen_logprobs=(batch.prev_logprobs + torch.sin(batch.input_ids * 0.37 + pos)) * batch.loss_mask)
            policy.train_microbatches(batch)
        out.append(policy.finish_train_step())
    return policy.export_weights(), out


@pytest.mark.parametrize("loss_cfg", [
    LossConfig(),
    LossConfig(normalisation="sequence", entropy_coef=0.01),
    LossConfig(truncation="icepop", kl="k3", kl_coef=0.05),
], ids=["token-tis", "sequence-entropy", "icepop-k3"])
def test_a_step_does_not_depend_on_chunking_or_micro_batching(loss_cfg):
    whole_w, whole_m = _train_step(loss_cfg, [(0, 6)])
    for chunks, mbs in [([(0, 2), (2, 3), (3, 6)], None), ([(0, 6)], 5), ([(0, 1), (1, 6)], 3)]:
        w, m = _train_step(loss_cfg, chunks, mbs)
        for name in whole_w:
            assert torch.allclose(w[name], whole_w[name], atol=1e-5, rtol=1e-4), (chunks, mbs, name)
        for a, b in zip(m, whole_m):
            for key in ("loss", "grad_norm", "tokens", "entropy", "kl", "is_weight_mean", "is_truncated_frac"):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (chunks, mbs, key)
    assert whole_m[0]["tokens"] > 0 and whole_m[0]["grad_norm"] > 0 and whole_m[1]["grad_norm"] > 0
    assert 0 < whole_m[0]["is_truncated_frac"] < 1


# ------------------------------------------------------------------------------------------- a loss of your own
class Reinforce:
    """A loss of one's own, in one class: REINFORCE on the group advantages, with a metric of its own."""

    metrics = (Metric("advantage_abs", "mean", "mean |advantage| per sequence trained", over="sequences"),)
    needs_reference = False
    entropy_grad = False

    def __call__(self, logprobs, batch, entropy=None):
        per_sequence = (logprobs * batch.loss_mask).sum(-1)
        loss_sum = -(batch.advantages * per_sequence).sum()
        return loss_sum, float(batch.num_sequences), {"advantage_abs": float(batch.advantages.abs().sum())}


def test_a_new_loss_is_one_class_and_its_metric_reaches_the_step_row():
    from asyncrl import Controller, load_config
    from asyncrl.algorithms import Loss

    assert isinstance(Reinforce(), Loss)
    cfg = load_config("quickstart", groups_per_step=2, group_size=4, eval_every=None)
    ctrl = Controller.from_config(cfg, loss=Reinforce())
    try:
        for _ in range(2):
            ctrl.tick()
        metrics = ctrl.metrics
        assert len(metrics) == 2 and "is_weight_mean" not in metrics  # GRPO's metrics are GRPOLoss's, not the engine's
        assert (metrics.advantage_abs >= 0).all() and metrics.loss.notna().all()
        assert (metrics.sequences == 2 * 4).all()  # ENGINE_METRICS still come with any loss
    finally:
        ctrl.close()
