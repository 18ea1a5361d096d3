"""GRPO: group-relative advantages and the clipped, importance-corrected policy loss.

The loss is returned as a *sum* with its normaliser (tokens or sequences) so a policy backend can accumulate
gradients over any number of chunks and micro-batches and divide once, in ``finish_train_step``: the step's
result then does not depend on how it was chunked (up to floating-point summation order).

Importance weight: rollouts come from the generator's weights (``gen``), the surrogate ratio is taken against the
policy before this step (``prev``); their mismatch — staleness, or two engines computing the same weights
differently — is corrected by ``w = exp(prev - gen)`` per token (or per sequence), with truncation:
- ``tis``: clamp ``w`` at ``is_cap`` (truncated importance sampling);
- ``icepop``: zero tokens whose ``w`` is outside ``[is_low, is_high]``;
- ``seq-mask-tis``: drop whole sequences whose sequence-level ``w`` (geometric mean over its tokens) is outside
  ``[is_low, is_high]``, and clamp the kept tokens' ``w`` at ``is_cap``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.backends.base import GroupRollouts, TrainBatch


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    advantage: Literal["group_mean", "leave_one_out"] = "group_mean"
    scale_by_std: bool = False
    clip_eps_low: float = Field(0.2, ge=0)
    clip_eps_high: float = Field(0.2, ge=0)
    importance_correction: Literal["none", "token", "sequence"] = "token"
    truncation: Literal["none", "tis", "icepop", "seq-mask-tis"] = "tis"
    is_cap: float = Field(2.0, gt=0)
    is_low: float = Field(0.5, ge=0)
    is_high: float = Field(2.0, gt=0)
    kl: Literal["none", "k1", "k2", "k3"] = "none"
    kl_coef: float = Field(0.0, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    normalisation: Literal["token", "sequence"] = "token"

    @model_validator(mode="after")
    def _consistent(self) -> LossConfig:
        if self.is_low >= self.is_high:
            raise ValueError(f"is_low ({self.is_low}) must be < is_high ({self.is_high})")
        if (self.kl == "none") != (self.kl_coef == 0):
            raise ValueError(f"kl={self.kl!r} with kl_coef={self.kl_coef}: set both or neither")
        if self.importance_correction == "none" and self.truncation != "none":
            raise ValueError(f"truncation {self.truncation!r} needs an importance_correction ('token' or 'sequence')")
        return self


def group_advantages(
    rewards: torch.Tensor, estimator: str = "group_mean", scale_by_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages for a [groups, G] reward tensor: reward minus the group's mean (or the mean of the *other*
    completions, ``leave_one_out``), optionally divided by the group's std."""
    rewards = rewards.to(torch.float32)
    G = rewards.shape[-1]
    mean = rewards.mean(dim=-1, keepdim=True)
    if estimator == "group_mean":
        adv = rewards - mean
    elif estimator == "leave_one_out":
        if G < 2:
            raise ValueError(f"leave_one_out needs a group size >= 2, got {G}")
        adv = (rewards - mean) * (G / (G - 1))
    else:
        raise ValueError(f"advantage estimator must be 'group_mean' or 'leave_one_out', got {estimator!r}")
    if scale_by_std:
        # unbiased std; a group of one has no spread (its advantage is 0 anyway)
        std = rewards.std(dim=-1, keepdim=True) if G > 1 else torch.zeros_like(mean)
        adv = adv / (std + eps)
    return adv


def make_train_batch(groups: Sequence[GroupRollouts], cfg: LossConfig, pad_id: int) -> TrainBatch:
    """Pad the completions of ``groups`` into one batch and compute their advantages (per group).

    Built from Python lists with one tensor per field: this runs on the controller's hot path every chunk."""
    for group in groups:
        if group.rewards is None:
            raise ValueError(f"group {group.group_id} has no rewards; score it before training")
    sizes = [len(g.completion_ids) for g in groups]
    if len(set(sizes)) == 1:
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        adv = group_advantages(rewards, cfg.advantage, cfg.scale_by_std).flatten()
    else:
        adv = torch.cat([group_advantages(torch.tensor([g.rewards]), cfg.advantage, cfg.scale_by_std)[0] for g in groups])
    rows = [(g.prompt_ids, c, lp) for g in groups for c, lp in zip(g.completion_ids, g.logprobs)]
    width = max(len(p) + len(c) for p, c, _ in rows)
    ids, gen, starts, stops = [], [], [], []
    for prompt, completion, lps in rows:
        p, n = len(prompt), len(completion)
        ids.append([*prompt, *completion] + [pad_id] * (width - p - n))
        gen.append([0.0] * p + list(lps) + [0.0] * (width - p - n))
        starts.append(p)
        stops.append(p + n)
    pos = torch.arange(width)
    start, stop = torch.tensor(starts).unsqueeze(-1), torch.tensor(stops).unsqueeze(-1)
    return TrainBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        attention_mask=(pos < stop).long(),
        loss_mask=((pos >= start) & (pos < stop)).float(),
        gen_logprobs=torch.tensor(gen, dtype=torch.float32),
        advantages=adv.to(torch.float32),
        group_sizes=sizes,
    )


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


def grpo_loss(
    logprobs: torch.Tensor, batch: TrainBatch, cfg: LossConfig, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, float, dict[str, float]]:
    """The step's loss contribution of ``batch``: ``(loss_sum, normaliser, metric_sums)``.

    ``loss_sum / normaliser`` summed over a step's micro-batches is the step's loss. ``metric_sums`` are sums over
    tokens (``*_sum``) and counts, for the caller to aggregate over the whole step.
    """
    mask = batch.loss_mask
    on = mask > 0
    # Off the mask every input is set to 0, so padding can never turn into inf * 0 = nan (e.g. k3's exp).
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(on, logprobs, zero)
    prev = batch.prev_logprobs if batch.prev_logprobs is not None else logprobs.detach()
    prev = torch.where(on, prev, zero)
    adv = batch.advantages.unsqueeze(-1)

    ratio = torch.exp(logprobs - prev)
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)

    weight, truncated = _importance_weight(prev, batch.gen_logprobs, mask, cfg)
    per_token = per_token * weight

    kl_sum = 0.0
    if cfg.kl != "none":
        if batch.ref_logprobs is None:
            raise ValueError(f"kl={cfg.kl!r} needs ref_logprobs in the batch")
        delta = torch.where(on, batch.ref_logprobs, zero) - logprobs
        kl = {"k1": -delta, "k2": 0.5 * delta**2, "k3": torch.exp(delta) - delta - 1}[cfg.kl]
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    entropy_sum = 0.0
    if entropy is not None:
        if cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * entropy
        entropy_sum = float((entropy.detach() * mask).sum())

    if cfg.normalisation == "token":
        loss_sum = (per_token * mask).sum()
        normaliser = float(mask.sum())
    else:
        lengths = mask.sum(-1).clamp(min=1)
        loss_sum = ((per_token * mask).sum(-1) / lengths).sum()
        normaliser = float(mask.shape[0])

    w_on = weight.detach()[on]
    metrics = {
        "tokens": float(mask.sum()),
        "is_weight_sum": float(w_on.sum()),
        "is_weight_max": float(w_on.max()) if w_on.numel() else 0.0,
        "is_weight_min": float(w_on.min()) if w_on.numel() else 0.0,
        "is_truncated_sum": float((truncated & on).sum()),
        "clipped_sum": float((((ratio - clipped).abs() > 0) & on).sum()),
        "kl_sum": kl_sum,
        "entropy_sum": entropy_sum,
    }
    return loss_sum, normaliser, metrics


def _importance_weight(
    prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached importance weight per token and a bool mask of the tokens truncation changed."""
    no_change = torch.zeros_like(mask, dtype=torch.bool)
    if cfg.importance_correction == "none":
        return torch.ones_like(prev), no_change
    log_w = ((prev - gen) * mask).detach()
    if cfg.importance_correction == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(prev)
    w = torch.exp(log_w)
    if cfg.truncation == "none":
        return w, no_change
    if cfg.truncation == "tis":
        return torch.clamp(w, max=cfg.is_cap), w > cfg.is_cap
    if cfg.truncation == "icepop":
        outside = (w < cfg.is_low) | (w > cfg.is_high)
        return torch.where(outside, torch.zeros_like(w), w), outside
    # seq-mask-tis: the sequence's geometric-mean weight decides whether it is kept at all
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_w = torch.exp(((prev - gen) * mask).sum(-1, keepdim=True) / lengths).expand_as(prev)
    drop = (seq_w < cfg.is_low) | (seq_w > cfg.is_high)
    capped = torch.clamp(w, max=cfg.is_cap)
    return torch.where(drop, torch.zeros_like(w), capped), drop | (w > cfg.is_cap)
