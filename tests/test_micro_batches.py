"""Micro-batches from a token budget (asyncrl/micro_batches.py): every sequence trained exactly once, padding
trimmed or packed away, and a step's loss and gradients those of the whole chunk in one piece, whatever the
budget and the order of the sequences (the torch engine here; Megatron's in tests/test_megatron_backend.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import micro_batches
from asyncrl.algorithms import GRPOLoss, LossConfig
from asyncrl.config import ModelConfig, TorchTrainerConfig, load_config
from asyncrl.data import TrainBatch
from asyncrl.metrics import peak_flops

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1)


def long_tailed_batch(lengths, prompt=2, seed=0) -> TrainBatch:
    """Right-padded rows of ``prompt`` prompt tokens and ``length - prompt`` completion tokens each."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    pos = torch.arange(S)
    stop = torch.tensor(lengths).unsqueeze(-1)
    real = pos < stop
    ids = torch.where(real, torch.randint(3, 259, (B, S), generator=g), torch.zeros((), dtype=torch.long))
    loss_mask = ((pos >= prompt) & real).float()
    gen = -torch.rand(B, S, generator=g) * 3 * loss_mask
    return TrainBatch(ids, real.long(), loss_mask, gen, torch.randn(B, generator=g), [B])


LENGTHS = [3, 40, 5, 5, 17, 3, 9, 33, 4, 6, 12, 3]  # a long tail: most short, a few long


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is ~20x faster than two on a shared 2-core box (no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------ the plans
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(2, 30), min_size=1, max_size=24), budget=st.integers(1, 200),
       mode=st.sampled_from(["rows", "sorted", "packed"]), size=st.integers(1, 7))
def test_every_sequence_is_in_exactly_one_micro_batch_within_the_budget(lengths, budget, mode, size):
    batch = long_tailed_batch(lengths)
    plans = micro_batches.plan(batch, mode, size if mode == "rows" else None, None if mode == "rows" else budget)
    seen = torch.cat([torch.arange(len(lengths))[mb.rows] for mb in plans]).tolist()
    assert sorted(seen) == list(range(len(lengths)))
    assert sum(mb.real_tokens for mb in plans) == sum(lengths)
    for mb in plans:
        seqs = micro_batches.take(batch, mb)
        assert mb.width == (batch.input_ids.shape[1] if mode == "rows" else int(seqs.attention_mask.sum(-1).max()))
        if mode == "sorted":
            assert mb.positions == seqs.num_sequences * mb.width
            assert mb.positions <= budget or seqs.num_sequences == 1  # one sequence longer than the budget: alone
        if mode == "packed":
            R, W = mb.packed.shape
            assert W == max(lengths) and (R * W <= budget or R == 1) and mb.positions == R * W
            # each real token sits at exactly one packed place, and unpacking gives the sequence back
            assert int((mb.segments >= 0).sum()) == mb.real_tokens
            real = seqs.attention_mask > 0
            assert torch.equal(micro_batches.unpack(mb, micro_batches.packed_ids(batch, mb))[real],
                               seqs.input_ids[real])
            # a sequence occupies one contiguous run of one row
            for k in range(seqs.num_sequences):
                rows, cols = (mb.segments == k).nonzero(as_tuple=True)
                assert rows.unique().numel() == 1 and (cols.diff() == 1).all()


def test_packing_removes_nearly_all_padding_of_a_long_tail():
    batch = long_tailed_batch(LENGTHS)
    real = sum(LENGTHS)
    whole = micro_batches.plan(batch, "rows")
    packed = micro_batches.plan(batch, "packed", micro_batch_tokens=4096)
    assert sum(mb.positions for mb in whole) == len(LENGTHS) * 40
    assert len(packed) == 1 and sum(mb.positions for mb in packed) <= 1.25 * real  # 4 rows of 40 for 140 tokens


def test_the_block_mask_keeps_each_sequence_to_itself():
    mb = micro_batches.plan(long_tailed_batch([4, 2, 2]), "packed", micro_batch_tokens=100)[0]
    assert mb.segments.tolist() == [[0, 0, 0, 0], [1, 1, 2, 2]]  # best fit: the two short ones share a row
    allowed = ~micro_batches.block_causal_mask(mb)[:, 0]
    assert allowed[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


@pytest.mark.parametrize("knobs, message", [
    ({"micro_batching": "sorted", "micro_batch_size": 4}, "micro_batch_size 4 applies to micro_batching 'rows'"),
    ({"micro_batching": "rows", "micro_batch_tokens": 512}, "micro_batch_tokens 512 applies to"),
    ({"micro_batching": "packed"}, "micro_batching"),  # the torch engine does not pack
    ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
])
def test_bad_micro_batch_knobs_are_clear_errors(knobs, message):
    with pytest.raises(ValueError, match=message):
        load_config("quickstart", trainer=knobs)


def test_micro_batch_size_alone_still_means_rows():
    assert load_config("quickstart", trainer={"micro_batch_size": 4}).trainer.micro_batching == "rows"
    assert load_config("quickstart").trainer.micro_batching == "rows"  # the CPU default: the old path
    gen_heavy = load_config("gpu_gen_heavy").trainer
    assert gen_heavy.micro_batching == "packed" and gen_heavy.micro_batch_tokens is not None


def test_a_plan_refuses_to_pack_a_sequence_that_starts_with_a_trained_token():
    batch = long_tailed_batch([3, 4])
    batch = replace(batch, loss_mask=batch.attention_mask.float())
    with pytest.raises(ValueError, match="prompt token"):
        micro_batches.plan(batch, "packed", micro_batch_tokens=64)


def test_peak_flops_by_device_name():
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert math.isnan(peak_flops(None)) and math.isnan(peak_flops("Some Future GPU"))


# --------------------------------------------------------------------------- the torch engine trains alike
def _step(trainer: dict, loss_cfg: LossConfig, perm=None, steps=2):
    """Two steps with plain SGD at lr 1 (the weight change is the normalised gradient), generator logprobs off
    the policy's so importance weights and truncation are exercised."""
    from asyncrl.backends.torch import TorchPolicy

    policy = TorchPolicy(TINY, TorchTrainerConfig(lr=1.0, grad_clip=None, **trainer), GRPOLoss(loss_cfg), seed=0)
    policy.optimizer = torch.optim.SGD(policy.params, lr=1.0)
    start = policy.export_weights()
    metrics = []
    for step in range(steps):
        batch = long_tailed_batch(LENGTHS, seed=step)
        if perm is not None:
            batch = batch.map(lambda t: t[perm])
        batch = replace(batch, gen_logprobs=(policy.logprobs(batch) - torch.sin(batch.input_ids * 0.7))
                        * batch.loss_mask)
        policy.begin_train_step()
        policy.train_microbatches(batch)
        metrics.append(policy.finish_train_step())
    end = policy.export_weights()
    return {k: end[k] - start[k] for k in end}, metrics


@pytest.mark.parametrize("loss_cfg", [
    LossConfig(),
    LossConfig(normalisation="sequence", importance_correction="sequence", truncation="seq-mask-tis",
               entropy_coef=0.01),
], ids=["token-tis", "sequence-level"])
def test_sorted_micro_batches_train_the_step_of_the_whole_chunk(loss_cfg):
    whole, whole_m = _step({}, loss_cfg)
    perm = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(3))
    for trainer, order in [({"micro_batching": "sorted", "micro_batch_tokens": 64}, None),
                           ({"micro_batching": "sorted", "micro_batch_tokens": 1}, None),  # one sequence a pass
                           ({"micro_batching": "sorted", "micro_batch_tokens": 64}, perm),
                           ({"micro_batch_size": 5}, perm)]:
        delta, m = _step(trainer, loss_cfg, order)
        for k in whole:
            torch.testing.assert_close(delta[k], whole[k], atol=1e-6, rtol=1e-4, msg=lambda s: f"{trainer} {k}: {s}")
        for a, b in zip(m, whole_m):
            for key in ("loss", "grad_norm", "tokens", "entropy", "is_weight_mean", "is_truncated_frac",
                        "is_weight_max", "normaliser", "train_tokens"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (trainer, key)
    assert 0 < whole_m[0]["is_truncated_frac"] < 1 and whole_m[0]["grad_norm"] > 0


def test_the_step_counts_real_and_padded_positions():
    _, (m, _) = _step({}, LossConfig())
    assert m["train_tokens"] == sum(LENGTHS) and m["train_padded_tokens"] == len(LENGTHS) * max(LENGTHS)
    _, (s, _) = _step({"micro_batching": "sorted", "micro_batch_tokens": 64}, LossConfig())
    assert s["train_tokens"] == sum(LENGTHS) and s["train_padded_tokens"] < 0.6 * m["train_padded_tokens"]
    assert s["train_flops"] == 6 * sum(p.numel() for p in _policy_params()) * sum(LENGTHS)
    assert s["peak_flops"] == 0  # a CPU has no entry: mfu stays empty


def _policy_params():
    from asyncrl.backends.torch import TorchPolicy

    return TorchPolicy(TINY, TorchTrainerConfig(), GRPOLoss(), seed=0).params


def test_logprobs_and_the_training_forward_agree_bit_for_bit_under_sorted_micro_batches():
    """The controller skips the separate logprobs pass for this engine: that is exact only if ``logprobs`` cuts a
    chunk into the same micro-batches as training."""
    from asyncrl.backends.torch import TorchPolicy

    cfg = TorchTrainerConfig(lr=1e-2, micro_batching="sorted", micro_batch_tokens=48)
    given, forward = (TorchPolicy(TINY, cfg, GRPOLoss(), seed=0) for _ in range(2))
    for step in range(2):
        batch = long_tailed_batch(LENGTHS, seed=10 + step)
        gen = (given.logprobs(batch) - 0.1) * batch.loss_mask
        given.begin_train_step(), forward.begin_train_step()
        given.train_microbatches(replace(batch, gen_logprobs=gen, prev_logprobs=given.logprobs(batch)))
        forward.train_microbatches(replace(batch, gen_logprobs=gen))
        assert given.finish_train_step() == forward.finish_train_step()
    wa, wb = given.export_weights(), forward.export_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_long_tailed_cpu_run_reports_its_throughput():
    """The torch generator's long tail and the sorted micro-batches through the controller: the step rows carry
    real and padded positions, useful TFLOP/s, generation tokens/s, and an empty MFU on a CPU."""
    from asyncrl import Controller

    cfg = load_config("quickstart", eval_every=None, generation={"max_new_tokens": 16, "min_new_tokens_tail": 2},
                      trainer={"micro_batching": "sorted", "micro_batch_tokens": 96})
    ctrl = Controller.from_config(cfg)
    try:
        ctrl.run(2, progress=False)
        m = ctrl.metrics
    finally:
        ctrl.close()
    assert (m.train_tokens > m.completion_tokens).all()  # prompts are computed too
    assert (m.train_tokens <= m.train_padded_tokens).all()
    assert (m.train_tflops > 0).all() and m.mfu.isna().all()
    # gen_tokens_per_s counts what the generator returned since the previous step: a step in which the running
    # rollout pump returned nothing (its batch came back before the previous step ended) has none, so NaN
    generated = m.gen_tokens_per_s.dropna()
    assert len(generated) >= 1 and (generated > 0).all()
