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

TRL's switches, same names and meaning (``GRPOConfig``; docs/staleness.md, "The loss", says how they compose):
- ``loss_type`` is the token normalisation: ``grpo`` each sequence's mean then the mean over sequences; ``bnpo`` and
  ``dapo`` the sum over the step's tokens divided by their number; ``dr_grpo`` the sum divided by the step's
  sequences x ``max_completion_length`` (``generation.max_new_tokens``). The normaliser is always the whole step's
  (summed over chunks, micro-batches and data-parallel ranks), so a step never depends on how it was split.
- ``importance_sampling_level``: the surrogate ratio ``curr / prev`` per token, or (``sequence``, GSPO) one ratio a
  sequence, ``exp(mean over its tokens of (curr - prev))``, clipped as the token ratio is. The staleness weight
  ``w`` above multiplies the clipped surrogate either way.
- ``scale_rewards``: advantages divided by the group's reward std, the batch's, or not at all (+1e-4, as TRL).
- ``mask_truncated_completions``: completions cut at ``max_new_tokens`` (finish reason ``length``) leave the loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import chain, repeat
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl import metrics as M
from asyncrl.data import GroupRollouts, TrainBatch
from asyncrl.logprobs import chunked_logprobs, token_entropy, token_logprobs  # noqa: F401  (their old home)
from asyncrl.metrics import Metric


class LossConfig(BaseModel):
    """The GRPO loss (``loss:`` in a config)."""

    model_config = ConfigDict(extra="forbid")

    advantage: Literal["group_mean", "leave_one_out"] = Field(
        "group_mean", description="baseline per group: the group's mean reward, or the mean of the other completions")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "none", description="TRL's scale_rewards: advantages divided by (the reward std of the group, or of the "
        "batch (the step's groups), + 1e-4), or not scaled ('none')")
    scale_by_std: bool | None = Field(
        None, description="older spelling of scale_rewards: true is 'group', false 'none' (a contradicting "
        "scale_rewards is an error)")
    clip_eps_low: float = Field(0.2, ge=0, description="surrogate ratio clipped below at 1 - clip_eps_low")
    clip_eps_high: float = Field(0.2, ge=0, description="surrogate ratio clipped above at 1 + clip_eps_high")
    importance_correction: Literal["none", "token", "sequence"] = Field(
        "token", description="importance weight exp(prev - gen) per token or per sequence; 'none' only on-policy")
    truncation: Literal["none", "tis", "icepop", "seq-mask-tis"] = Field(
        "tis", description="how large importance weights are truncated (see the module docstring)")
    is_cap: float = Field(2.0, gt=0, description="tis / seq-mask-tis: weights clamped at this value")
    is_low: float = Field(0.5, ge=0, description="icepop / seq-mask-tis: weights below are masked")
    is_high: float = Field(2.0, gt=0, description="icepop / seq-mask-tis: weights above are masked")
    kl: Literal["none", "k1", "k2", "k3"] = Field("none", description="KL estimator to the initial weights")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty coefficient (set together with kl)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="TRL's loss_type, the token normalisation over the whole step: 'grpo' each sequence's "
        "mean, then the mean over sequences; 'bnpo' / 'dapo' the sum over tokens / the step's tokens; 'dr_grpo' the "
        "sum / (sequences x generation.max_new_tokens)")
    normalisation: Literal["token", "sequence"] | None = Field(
        None, description="older spelling of loss_type: 'token' is 'dapo', 'sequence' is 'grpo' (a contradicting "
        "loss_type is an error)")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="TRL's importance_sampling_level: the clipped surrogate ratio curr/prev per token, or "
        "per sequence (GSPO: exp of the mean over its tokens of curr - prev), clipped alike")
    mask_truncated_completions: bool = Field(
        False, description="TRL's mask_truncated_completions: completions that reached max_new_tokens without eos "
        "(finish reason 'length') are left out of the loss (they still count in their group's advantages)")
    gap_metrics: bool = Field(
        True, description="split stale tokens' importance weights into staleness and mismatch (mismatch_kl, "
        "is_mismatch_*, is_staleness_*): the policy keeps the weights of the versions buffered groups were sampled "
        "with and takes one no-grad pass per stale version per chunk (docs/replay.md measures the cost); false: "
        "those metrics cover the fresh tokens only")
    gap_completions: int | None = Field(
        1, ge=1, description="completions of each group whose stale tokens the gap metrics read (the first ones; "
        "null: all). The pass under older weights costs in proportion: with 1 it is one row a group, so keeping the "
        "metrics on does not eat the time asynchrony buys")

    @model_validator(mode="after")
    def _consistent(self) -> LossConfig:
        if self.is_low >= self.is_high:
            raise ValueError(f"is_low ({self.is_low}) must be < is_high ({self.is_high})")
        if (self.kl == "none") != (self.kl_coef == 0):
            raise ValueError(f"kl={self.kl!r} with kl_coef={self.kl_coef}: set both or neither")
        if self.importance_correction == "none" and self.truncation != "none":
            raise ValueError(f"truncation {self.truncation!r} needs an importance_correction ('token' or 'sequence')")
        # The older knobs derive the TRL-named ones; set together, they must agree.
        for old, new, table in (("normalisation", "loss_type", _LOSS_TYPE_OF),
                                ("scale_by_std", "scale_rewards", _SCALE_OF)):
            value = getattr(self, old)
            if value is None:
                continue
            if new in self.model_fields_set and getattr(self, new) != table[value]:
                raise ValueError(f"loss.{old} {value!r} contradicts loss.{new} {getattr(self, new)!r} (it means "
                                 f"{new} {table[value]!r}): set only loss.{new}")
            object.__setattr__(self, new, table[value])
        return self


_LOSS_TYPE_OF = {"token": "dapo", "sequence": "grpo"}
_SCALE_OF = {True: "group", False: "none"}


@runtime_checkable
class Loss(Protocol):
    """What a policy backend trains with: the engine runs the forward pass and calls the loss on each
    micro-batch; the loss says which inputs it needs and how its metrics reduce over a step.

    A new loss is one class satisfying this (and a new metric one ``Metric`` line in its ``metrics``)."""

    metrics: tuple[Metric, ...]
    """The metrics the loss contributes to on every call, with how each reduces over the step."""

    needs_reference: bool
    """Whether the engine must supply ``batch.ref_logprobs`` (a frozen copy of the initial weights)."""

    entropy_grad: bool
    """Whether the loss differentiates through the entropy (otherwise the engine may pass it detached)."""

    def __call__(
        self, logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, float | torch.Tensor, dict[str, float | torch.Tensor]]:
        """Called once per micro-batch with the [B, S] token logprobs (with grad) under the current weights:
        ``(loss_sum, normaliser, contributions)``. ``batch.prev_logprobs`` is always set: from a separate no-grad
        pass, or, by an engine with ``prev_logprobs_from_forward`` (``PolicyBackend``), from this very forward,
        detached. Both are the weights before this step's update; with one optimizer step per batch they equal
        ``logprobs`` bit for bit, so the surrogate ratio is exactly 1 (``clip_frac`` 0) and only the importance
        weight ``exp(prev - gen)`` differs from 1: staleness and engine mismatch show there. The engine back-propagates ``loss_sum``, divides the step's
        gradients by the step's summed ``normaliser`` in ``finish_train_step``, and adds ``contributions`` (keys
        from ``metrics``) to the step's accumulator. The normaliser and the contributions may be 0-dim tensors (on
        the engine's device: no sync per micro-batch); a max/min contribution of -inf/+inf means "none"."""
        ...


GRPO_METRICS: tuple[Metric, ...] = (
    Metric("tokens", "sum", "completion tokens under the loss mask"),
    Metric("is_weight_mean", "mean", "mean importance weight after truncation", over="tokens"),
    Metric("is_weight_max", "max", "largest importance weight after truncation"),
    Metric("is_weight_min", "min", "smallest importance weight after truncation"),
    Metric("is_truncated_frac", "mean", "fraction of tokens whose importance weight truncation changed",
           over="tokens"),
    Metric("clip_frac", "mean", "fraction of tokens whose surrogate ratio was clipped", over="tokens"),
    Metric("kl", "mean", "KL estimate to the reference per token (0 without kl)", over="tokens"),
    Metric("entropy", "mean", "entropy of the next-token distribution per token", over="tokens"),
    *M.GAP_METRICS,  # the importance weight's two parts (gap_contributions), named with the vocabulary
)


class GRPOLoss:
    """The :class:`Loss` of GRPO: ``grpo_loss`` under a ``LossConfig``."""

    metrics = GRPO_METRICS

    def __init__(self, cfg: LossConfig | None = None, max_completion_length: int | None = None) -> None:
        self.cfg = cfg if cfg is not None else LossConfig()
        self.max_completion_length = max_completion_length  # dr_grpo's constant (generation.max_new_tokens)
        self.needs_reference = self.cfg.kl != "none"
        self.entropy_grad = self.cfg.entropy_coef > 0

    def __call__(self, logprobs, batch, entropy=None):
        return grpo_loss(logprobs, batch, self.cfg, entropy, self.max_completion_length)

    def __repr__(self) -> str:
        return f"GRPOLoss({self.cfg!r})"


def group_advantages(
    rewards: torch.Tensor, estimator: str = "group_mean", scale_by_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages for a [groups, G] reward tensor: reward minus the group's mean (or the mean of the *other*
    completions, ``leave_one_out``), optionally divided by the group's std (``scale_advantages`` scales as TRL's
    ``scale_rewards`` does)."""
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


def scale_advantages(adv: torch.Tensor, rewards: Sequence[Sequence[float]], scale: str) -> torch.Tensor:
    """``adv`` (flat, groups in order) divided as TRL's ``scale_rewards`` divides it: by each group's reward std
    (``group``) or the std of all of ``rewards`` (``batch``), unbiased, + 1e-4; ``none`` leaves it."""
    if scale == "none":
        return adv
    if scale == "group":
        std = torch.cat([torch.full((len(r),), float(np.std(r, ddof=1)) if len(r) > 1 else 0.0) for r in rewards])
    elif scale == "batch":
        flat = [x for r in rewards for x in r]
        std = torch.full((len(flat),), float(np.std(flat, ddof=1)) if len(flat) > 1 else 0.0)
    else:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale!r}")
    return adv / (std.to(adv.dtype) + 1e-4)


def mask_truncated(batch: TrainBatch, groups: Sequence[GroupRollouts], cfg: LossConfig) -> TrainBatch:
    """``batch`` with the loss mask of every truncated completion (finish reason ``length``: it reached
    max_new_tokens without eos) zeroed when ``cfg.mask_truncated_completions``; otherwise ``batch`` itself.
    Applied after ``mark_versions``, whose token bookkeeping reads the unmasked layout; the rows stay (``grpo`` and
    ``dr_grpo`` count them as sequences, as TRL does)."""
    if not cfg.mask_truncated_completions:
        return batch
    cut = [reason == "length" for g in groups for reason in (g.finish_reasons or [""] * len(g.completion_ids))]
    if not any(cut):
        return batch
    keep = torch.tensor([not c for c in cut], dtype=batch.loss_mask.dtype).unsqueeze(-1)
    return replace(batch, loss_mask=batch.loss_mask * keep)


def _tensor(values: list, dtype: type) -> torch.Tensor:
    """``torch.tensor(values, dtype=...)`` through numpy: the same values (Python ints to int64, floats rounded to
    float32 alike), in a quarter of the time (``torch.tensor`` inspects a list element by element)."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def make_train_batch(groups: Sequence[GroupRollouts], cfg: LossConfig, pad_id: int) -> TrainBatch:
    """Pad the completions of ``groups`` into one batch and compute their advantages (per group).

    On the controller's hot path every chunk: the real tokens go into one flat tensor per field (built by
    ``itertools.chain``, no Python loop over positions) and are scattered into the padded ``[B, S]`` layout at once
    (a boolean mask fills in row-major order). Policies trim or pack the padding away (``asyncrl.micro_batches``)."""
    for group in groups:
        if group.rewards is None:
            raise ValueError(f"group {group.group_id} has no rewards; score it before training")
    sizes = [len(g.completion_ids) for g in groups]
    if len(set(sizes)) == 1:
        rewards = _tensor([g.rewards for g in groups], np.float32)
        adv = group_advantages(rewards, cfg.advantage).flatten()
    else:
        adv = torch.cat([group_advantages(torch.tensor([g.rewards]), cfg.advantage)[0] for g in groups])
    adv = scale_advantages(adv, [g.rewards for g in groups], cfg.scale_rewards)
    rows = [(g.prompt_ids, c, lp) for g in groups for c, lp in zip(g.completion_ids, g.logprobs)]
    starts = [len(p) for p, _, _ in rows]
    stops = [len(p) + len(c) for p, c, _ in rows]
    width = max(stops)
    pos = torch.arange(width)
    start, stop = _tensor(starts, np.int64).unsqueeze(-1), _tensor(stops, np.int64).unsqueeze(-1)
    real = pos < stop
    ids = torch.full(real.shape, pad_id, dtype=torch.long)
    ids[real] = _tensor(list(chain.from_iterable(chain(p, c) for p, c, _ in rows)), np.int64)
    gen = torch.zeros(real.shape, dtype=torch.float32)
    gen[real] = _tensor(list(chain.from_iterable(chain(repeat(0.0, len(p)), lp) for p, _, lp in rows)), np.float32)
    loss_mask = ((pos >= start) & real).float()
    if any(g.trained_mask is not None for g in groups):  # multi-turn: observation tokens are context, never trained
        sampled = torch.zeros(real.shape, dtype=torch.float32)
        sampled[real] = _tensor(list(chain.from_iterable(
            chain(repeat(0, len(g.prompt_ids)), m if g.trained_mask is not None else repeat(1, len(c)))
            for g in groups for c, m in zip(g.completion_ids, g.trained_mask or g.completion_ids))), np.float32)
        loss_mask = loss_mask * sampled
        gen = gen * sampled
    return TrainBatch(
        input_ids=ids,
        attention_mask=real.long(),
        loss_mask=loss_mask,
        gen_logprobs=gen,
        advantages=adv.to(torch.float32),
        group_sizes=sizes,
    )


def mark_versions(batch: TrainBatch, groups: Sequence[GroupRollouts], trainer_version: int,
                  logprobs_at: Callable[[TrainBatch, int], torch.Tensor | None],
                  known: Sequence[float | None] | None = None, per_group: int | None = None) -> TrainBatch:
    """``batch`` (``make_train_batch(groups, ...)``) with what ``gap_contributions`` needs: ``stale_mask``, 1 at the
    completion tokens weights older than ``trainer_version`` sampled (``GroupRollouts.versions``), and there
    ``version_logprobs``, the trainer's logprobs under those weights, ``logprobs_at(batch, version)`` for each such
    version (None: not held; those tokens stay NaN, unless ``known``, one value or None per completion token in
    order, has them: a row whose tokens of a version are all known is not passed again). ``per_group``: only the
    first that many completions of each group are passed to ``logprobs_at`` (its rows, as a smaller batch); the
    other rows' stale tokens stay NaN (``loss.gap_completions``)."""
    on = batch.loss_mask > 0
    if all(g.token_versions is None for g in groups):  # one version a group: per row, not per token (hot path)
        per_row = _tensor([g.gen_start_version for g in groups for _ in g.completion_ids], np.int64)
        versions = torch.where(on, per_row.unsqueeze(-1), trainer_version)
        flat = set(per_row.tolist())
    else:
        flat = [v for g in groups for completion in g.versions() for v in completion]
        versions = torch.full(on.shape, trainer_version, dtype=torch.long)
        versions[on] = _tensor(flat, np.int64)  # completion tokens in row-major order (make_train_batch)
    stale = on & (versions < trainer_version)
    held = torch.full(on.shape, float("nan"), dtype=torch.float32)
    if known is not None:
        held[on] = _tensor([math.nan if x is None else x for x in known], np.float32)
    rows = torch.ones(on.shape[0], dtype=torch.bool)
    if per_group is not None:  # the first per_group rows of each group (make_train_batch keeps groups in order)
        rows[:] = False
        start = 0
        for size in batch.group_sizes:
            rows[start:start + min(size, per_group)] = True
            start += size
    for version in sorted({v for v in flat if v < trainer_version}):
        take = rows & ((versions == version) & on & torch.isnan(held)).any(-1)
        if not take.any():
            continue
        index = take.nonzero().squeeze(-1)
        sub = batch if bool(take.all()) else batch.map(lambda t: t[index], group_sizes=[1] * len(index))
        logprobs = logprobs_at(sub, version)
        if logprobs is not None:
            here = versions[index] == version
            part = held[index]
            part[here] = logprobs.to(torch.float32)[here]
            held[index] = part
    return replace(batch, stale_mask=stale.float(), version_logprobs=held)


def grpo_loss(
    logprobs: torch.Tensor, batch: TrainBatch, cfg: LossConfig, entropy: torch.Tensor | None = None,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, float | torch.Tensor, dict[str, float | torch.Tensor]]:
    """The step's loss contribution of ``batch``: ``(loss_sum, normaliser, contributions)``.

    ``loss_sum / normaliser`` summed over a step's micro-batches is the step's loss. ``contributions`` are this
    micro-batch's share of each of ``GRPO_METRICS`` (sums over tokens for the means; max/min over its tokens, -inf/+inf
    without any), as 0-dim tensors, for an ``Accumulator`` to reduce over the whole step. ``max_completion_length``:
    ``dr_grpo``'s constant (``generation.max_new_tokens``).
    """
    mask = batch.loss_mask
    on = mask > 0
    # Off the mask every input is set to 0, so padding can never turn into inf * 0 = nan (e.g. k3's exp).
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(on, logprobs, zero)
    prev = batch.prev_logprobs if batch.prev_logprobs is not None else logprobs.detach()
    prev = torch.where(on, prev, zero)
    adv = batch.advantages.unsqueeze(-1)

    log_ratio = logprobs - prev
    if cfg.importance_sampling_level == "sequence":  # GSPO: one ratio a sequence, the geometric mean of its tokens'
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv).expand_as(logprobs)

    weight, truncated = _importance_weight(prev, batch.gen_logprobs, mask, cfg)
    per_token = per_token * weight

    kl_sum = 0.0
    if cfg.kl != "none":
        if batch.ref_logprobs is None:
            raise ValueError(f"kl={cfg.kl!r} needs ref_logprobs in the batch")
        delta = torch.where(on, batch.ref_logprobs, zero) - logprobs
        kl = {"k1": -delta, "k2": 0.5 * delta**2, "k3": torch.exp(delta) - delta - 1}[cfg.kl]
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = (kl.detach() * mask).sum()
    entropy_sum = 0.0
    if entropy is not None:
        if cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * entropy
        entropy_sum = (entropy.detach() * mask).sum()

    tokens = mask.sum()
    if cfg.loss_type in ("dapo", "bnpo"):  # the step's tokens (one normaliser for the whole step: "local" is it)
        loss_sum = (per_token * mask).sum()
        normaliser = tokens
    elif cfg.loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss.loss_type 'dr_grpo' divides by sequences x max_completion_length: build the loss "
                             "as GRPOLoss(cfg.loss, max_completion_length=cfg.generation.max_new_tokens)")
        loss_sum = (per_token * mask).sum()
        normaliser = float(mask.shape[0] * max_completion_length)
    else:  # grpo
        lengths = mask.sum(-1).clamp(min=1)
        loss_sum = ((per_token * mask).sum(-1) / lengths).sum()
        normaliser = float(mask.shape[0])

    # Tensors, not floats: a float() is a device sync, and an engine transfers a chunk's values at once
    # (micro_batches.add_all). Off the mask the max/min see -inf/+inf, which the Accumulator ignores.
    w = weight.detach()
    inf = torch.tensor(float("inf"), dtype=w.dtype, device=w.device)
    metrics = {
        "tokens": tokens,
        "is_weight_mean": (w * mask).sum(),
        "is_truncated_frac": (truncated & on).sum(),
        "clip_frac": (((ratio - clipped).abs() > 0).expand_as(on) & on).sum(),
        "kl": kl_sum,
        "entropy": entropy_sum,
        "is_weight_max": torch.where(on, w, -inf).max(),
        "is_weight_min": torch.where(on, w, inf).min(),
        **gap_contributions(prev, batch),
    }
    return loss_sum, normaliser, metrics


def gap_contributions(prev: torch.Tensor, batch: TrainBatch) -> dict[str, torch.Tensor]:
    """The importance weight's two parts per token (``asyncrl.metrics.GAP_METRICS``): with ``v`` the trainer's
    logprob at the weights that sampled the token, ``exp(prev - gen) = exp(prev - v) * exp(v - gen)``, staleness
    times the engines' mismatch, and ``mismatch_kl`` the k3 estimate of KL(behaviour || trainer at those weights)
    (``r - 1 - log r``, ``r = exp(v - gen)``: >= 0, 0 where the two engines agree). ``v`` is ``prev`` where the
    current weights sampled the token and ``batch.version_logprobs`` where older ones did (``batch.stale_mask``);
    NaN there (weights the trainer no longer held) leaves the token out. Nothing for a batch without
    ``stale_mask`` (not made by the train pump). 0-dim tensors, detached; max over no token is -inf."""
    if batch.stale_mask is None:
        return {}
    prev = prev.detach()
    on = batch.loss_mask > 0
    stale = (batch.stale_mask > 0) & on
    older = batch.version_logprobs if batch.version_logprobs is not None else torch.full_like(prev, float("nan"))
    v = torch.where(stale, older.to(prev.dtype), prev)
    known = on & ~torch.isnan(v)
    zero = torch.zeros((), dtype=prev.dtype, device=prev.device)
    v, gen, prev = (torch.where(known, t.to(prev.dtype), zero) for t in (v, batch.gen_logprobs, prev))
    log_mismatch = v - gen
    mismatch, staleness = torch.exp(log_mismatch), torch.exp(prev - v)
    k3 = mismatch - 1 - log_mismatch
    m = known.to(prev.dtype)
    none = torch.tensor(-float("inf"), dtype=prev.dtype, device=prev.device)
    return {M.GAP_TOKENS.name: m.sum(), M.MISMATCH_KL.name: (k3 * m).sum(),
            M.IS_MISMATCH_MEAN.name: (mismatch * m).sum(),
            M.IS_MISMATCH_MAX.name: torch.where(known, mismatch, none).max(),
            M.IS_STALENESS_MEAN.name: (staleness * m).sum(),
            M.IS_STALENESS_MAX.name: torch.where(known, staleness, none).max()}


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
