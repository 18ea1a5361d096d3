"""TRL's loss switches (asyncrl/algorithms.py): ``loss_type``, ``importance_sampling_level``, ``scale_rewards``,
``mask_truncated_completions``, checked against losses written out by hand in numpy (TRL 1.16's
``GRPOTrainer._compute_loss`` and ``_generate_and_score_completions`` define them), and the older knobs they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.algorithms import LossConfig, grpo_loss, make_train_batch, mask_truncated
from asyncrl.data import GroupRollouts, TrainBatch

NO_IS = dict(importance_correction="none", truncation="none")
CURR = np.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
PREV = np.array([[-1.1, -1.9, -0.5], [-0.2, -0.8, 0.0]])  # row 1, token 1: ratio exp(-0.4) < 0.8, clipped
MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = np.array([1.5, -0.5])


def _batch(gen=PREV):
    curr = torch.tensor(CURR, dtype=torch.float32, requires_grad=True)
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    b = TrainBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), t(MASK), t(gen * MASK),
                   t(ADV), [2], t(PREV * MASK))
    return curr, b


def _token_surrogate():
    r = np.exp(CURR - PREV)
    return -np.minimum(r * ADV[:, None], np.clip(r, 0.8, 1.2) * ADV[:, None]) * MASK


def _step_loss(loss_type, level="token", L=None, **knobs):
    curr, b = _batch(knobs.pop("gen", PREV))
    loss_sum, norm, metrics = grpo_loss(curr, b, LossConfig(**{**NO_IS, **knobs}, loss_type=loss_type,
                                                            importance_sampling_level=level), None, L)
    return curr, loss_sum, float(norm), metrics


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_each_loss_type_normalises_tokens_as_trl_does(loss_type):
    pt, lengths = _token_surrogate(), MASK.sum(-1)
    expected = {"grpo": (pt.sum(-1) / lengths).mean(),        # each sequence's mean, then the mean over sequences
                "bnpo": pt.sum() / MASK.sum(),                   # the (whole step's) tokens
                "dr_grpo": pt.sum() / (2 * 4),                   # sequences x max_completion_length
                "dapo": pt.sum() / MASK.sum()}[loss_type]
    _, loss_sum, norm, _ = _step_loss(loss_type, L=4)
    assert loss_sum.item() / norm == pytest.approx(expected, rel=1e-6)
    assert norm == {"grpo": 2, "bnpo": 5, "dr_grpo": 8, "dapo": 5}[loss_type]


def test_dr_grpo_needs_the_completion_length_limit():
    with pytest.raises(ValueError, match="max_completion_length"):
        _step_loss("dr_grpo")


def test_sequence_level_ratio_is_the_geometric_mean_clipped_per_sequence():
    lengths = MASK.sum(-1)
    s = np.exp(((CURR - PREV) * MASK).sum(-1) / lengths)  # GSPO's sequence ratio
    per_seq = -np.minimum(s * ADV, np.clip(s, 0.8, 1.2) * ADV)
    assert s[1] < 0.8  # row 1 is clipped, row 0 is not
    for loss_type, expected in (("grpo", per_seq.mean()), ("dapo", (per_seq * lengths).sum() / lengths.sum())):
        curr, loss_sum, norm, metrics = _step_loss(loss_type, level="sequence")
        assert loss_sum.item() / norm == pytest.approx(expected, rel=1e-6)
    # the unclipped row 0 (dapo): its summed loss is len x (-A s), whose gradient is len x (-A s / len) per token
    loss_sum.backward()
    assert curr.grad[0].numpy() == pytest.approx(np.full(3, -ADV[0] * s[0]), rel=1e-5)
    assert curr.grad[1].abs().sum().item() == 0.0  # clipped: no gradient
    assert float(metrics["clip_frac"]) == 2  # the clipped sequence's two tokens


def test_sequence_level_composes_with_the_truncated_staleness_weight():
    gen = PREV - np.array([[0.0, 1.0, -0.2], [0.3, 0.0, 0.0]])  # exp(prev - gen): 1, e (capped at 2), 0.82, ...
    w = np.minimum(np.exp((PREV - gen) * MASK), 2.0) * MASK
    s = np.exp(((CURR - PREV) * MASK).sum(-1) / MASK.sum(-1))
    per_seq = -np.minimum(s * ADV, np.clip(s, 0.8, 1.2) * ADV)
    expected = (per_seq[:, None] * w).sum() / MASK.sum()
    _, loss_sum, norm, metrics = _step_loss("dapo", level="sequence", gen=gen, importance_correction="token",
                                            truncation="tis", is_cap=2.0)
    assert loss_sum.item() / norm == pytest.approx(expected, rel=1e-6)
    assert float(metrics["is_truncated_frac"]) == 1


def _groups(rewards, reasons=None):
    out = []
    for gid, r in enumerate(rewards):
        comps = [[5 + i, 6] for i in range(len(r))]
        out.append(GroupRollouts(gid, [1, 2], comps, [[-1.0, -1.0] for _ in comps], 0, 0,
                                 finish_reasons=list(reasons[gid]) if reasons else [], rewards=list(r)))
    return out


REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.4, 0.6, 0.9]]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scale_rewards(scale):
    r = np.array(REWARDS)
    centred = r - r.mean(-1, keepdims=True)
    std = {"group": r.std(-1, ddof=1, keepdims=True), "batch": np.full((2, 1), r.std(ddof=1)),
           "none": None}[scale]
    expected = centred if std is None else centred / (std + 1e-4)
    batch = make_train_batch(_groups(REWARDS), LossConfig(scale_rewards=scale), pad_id=0)
    assert batch.advantages.numpy() == pytest.approx(expected.flatten(), rel=1e-5)


def test_old_knobs_derive_the_trl_names_and_contradictions_are_one_line():
    assert LossConfig(scale_by_std=True).scale_rewards == "group"
    assert LossConfig(scale_by_std=False).scale_rewards == "none"
    assert LossConfig(normalisation="sequence").loss_type == "grpo"
    assert LossConfig(normalisation="token").loss_type == "dapo"
    assert LossConfig().loss_type == "dapo" and LossConfig().scale_rewards == "none"
    assert LossConfig(normalisation="sequence", loss_type="grpo").loss_type == "grpo"
    with pytest.raises(ValueError, match="loss.normalisation 'sequence' contradicts loss.loss_type 'dapo'"):
        LossConfig(normalisation="sequence", loss_type="dapo")
    with pytest.raises(ValueError, match="loss.scale_by_std True contradicts loss.scale_rewards 'batch'"):
        LossConfig(scale_by_std=True, scale_rewards="batch")


def test_batch_scaling_needs_the_whole_step_in_one_chunk():
    from asyncrl.config import load_config

    load_config("quickstart", loss={"scale_rewards": "batch"})
    with pytest.raises(ValueError, match="scale_rewards 'batch'"):
        load_config("quickstart", loss={"scale_rewards": "batch"}, min_groups_per_chunk=2)


def test_mask_truncated_completions_leaves_them_out_of_the_loss():
    groups = _groups(REWARDS, reasons=[["stop", "length", "stop", "stop"], ["length", "stop", "stop", "length"]])
    cfg = LossConfig(**NO_IS, mask_truncated_completions=True, loss_type="dapo")
    batch = mark = make_train_batch(groups, cfg, pad_id=0)
    masked = mask_truncated(batch, groups, cfg)
    kept = np.array([1, 0, 1, 1, 0, 1, 1, 0], dtype=np.float32)
    assert masked.loss_mask.sum(-1).numpy() == pytest.approx(mark.loss_mask.sum(-1).numpy() * kept)
    assert masked.advantages.numpy() == pytest.approx(batch.advantages.numpy())  # still in their groups' baselines
    curr = torch.full(batch.loss_mask.shape, -1.0, requires_grad=True)
    _, norm, metrics = grpo_loss(curr, replace_prev(masked, curr), cfg)
    assert float(norm) == 2 * kept.sum() and float(metrics["tokens"]) == 2 * kept.sum()
    _, norm, _ = grpo_loss(curr, replace_prev(masked, curr), cfg.model_copy(update={"loss_type": "grpo"}))
    assert float(norm) == 8  # TRL's grpo still counts a masked completion as a sequence
    off = LossConfig(**NO_IS)
    assert mask_truncated(batch, groups, off) is batch


def replace_prev(batch, curr):
    from dataclasses import replace

    return replace(batch, prev_logprobs=curr.detach() * batch.loss_mask, gen_logprobs=curr.detach() * batch.loss_mask)


def test_mask_truncated_in_a_run_trains_only_completions_that_ended():
    from asyncrl import Controller, load_config

    def one_step(mask):
        cfg = load_config("quickstart", generation={"max_new_tokens": 2}, loss={"mask_truncated_completions": mask},
                          sampler={"name": "in_order", "max_lookahead_versions": 0}, eval_every=None)
        ctrl = Controller.from_config(cfg)
        ctrl.run(1, progress=False)
        return ctrl.completions, ctrl.metrics.iloc[-1]

    rows, masked = one_step(True)
    assert (rows["finish_reason"] == "length").any()  # a random model rarely ends within 2 tokens
    assert masked["tokens"] == rows.loc[rows["finish_reason"] != "length", "tokens"].sum()
    assert masked["completion_tokens"] == rows["tokens"].sum()  # generated all the same
    _, plain = one_step(False)
    assert plain["tokens"] == plain["completion_tokens"] > masked["tokens"]
