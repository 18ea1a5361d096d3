"""The data that crosses the backend Protocols: what the controller sends to a generation backend, what comes
back, and the padded batch a policy backend trains on.

This module is the bottom layer: the GRPO maths (``algorithms``), the backends and the controller all import it,
and it imports nothing of asyncrl. Token tensors are only named in annotations, so it loads without torch.

Token tensors in a ``TrainBatch`` are aligned with ``input_ids``: the value at position ``t`` belongs to token
``input_ids[:, t]`` predicted from ``input_ids[:, :t]``. ``loss_mask`` is 1 exactly at completion tokens the model
sampled, so position 0, prompt tokens, an environment's observation tokens and right padding never count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class GenerationRequest:
    group_id: int
    prompt_ids: list[int]
    n: int  # completions per prompt (G)


@dataclass
class GroupRollouts:
    """One prompt group's completions, as the generation backend returns them and the buffer stores them.

    ``gen_start_version`` / ``gen_end_version`` are the generator's weight versions when the group's generation
    began and ended (weight syncs do not wait for rollouts). They are facts about generation; the buffer slot's
    ``weight_version`` (the generation version at *reservation*) is what staleness is judged by. ``token_versions``
    says which version sampled each completion token (a generator that loads weights under running groups fills
    it); None: every token was sampled by ``gen_start_version`` (``versions``)."""

    group_id: int
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]  # generator's logprob of each completion token
    gen_start_version: int
    gen_end_version: int
    finish_reasons: list[str] = field(default_factory=list)
    rewards: list[float] | None = None  # set by the controller when it scores the group
    texts: list[str] | None = None  # decoded completions, for people and for scoring
    replica: int | None = None  # which generation replica made it (asyncrl/backends/replicas.py); None: one engine
    token_versions: list[list[int]] | None = None  # per completion, the weight version that sampled each token
    # Each reward function's values (None where it does not apply), set when the group is committed: carried with
    # the group (into checkpoints), so ``reward/<name>`` is the mean over the groups a step trains.
    reward_parts: dict[str, list[float | None]] | None = None
    # Multi-turn (``asyncrl/turns.py``): a completion is a trajectory, model turns and observations after the prompt.
    # ``trained_mask``: per completion, 1 at a token the model sampled, 0 at an observation's (context: no loss, a
    # logprob of 0, no staleness); None: every token was sampled. ``token_versions`` then lists the versions of the
    # sampled tokens only, in order. ``turns``: per completion, its counts (``turns``, ``tool_calls``,
    # ``env_tokens``) and ``turn_versions`` (the version of each model turn).
    trained_mask: list[list[int]] | None = None
    turns: list[dict] | None = None
    # The prompt's text as the model was given it, when the backend rendered it itself (an environment run: the chat
    # template with the tools and ``reset``'s text, or the raw prompt with ``reset``'s text): its ``prompt_ids`` are
    # that text encoded. None: the task's prompt text is (``asyncrl.chat.prompt_ids``).
    prompt_text: str | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the model sampled (observation tokens are not counted: nothing generated or trains them)."""
        if self.trained_mask is not None:
            return sum(sum(m) for m in self.trained_mask)
        return sum(len(c) for c in self.completion_ids)

    def to_json(self) -> dict:
        """What a checkpoint writes: every field, the optional ones (``token_versions``, ``reward_parts``,
        ``trained_mask``, ``turns``, ``prompt_text``) only when set (older checkpoints stay byte for byte)."""
        out = asdict(self)
        for name in ("token_versions", "reward_parts", "trained_mask", "turns", "prompt_text"):
            if out[name] is None:
                del out[name]
        return out

    def versions(self) -> list[list[int]]:
        """The weight version that sampled each token of each completion (``token_versions``, or one version);
        with ``trained_mask``, of each sampled token."""
        if self.token_versions is not None:
            return self.token_versions
        if self.trained_mask is not None:
            return [[self.gen_start_version] * sum(m) for m in self.trained_mask]
        return [[self.gen_start_version] * len(c) for c in self.completion_ids]


@dataclass(frozen=True)
class TrainBatch:
    """Padded tensors for a list of groups (all completions of each group, groups in order). The padding is the
    layout, not the work: a policy trims or packs it away per micro-batch (``asyncrl/micro_batches.py``).

    Frozen: each side adds what it computed by making a new batch (``dataclasses.replace``), so a batch the
    controller holds is never changed behind its back. ``make_train_batch`` builds one; the controller adds
    ``prev_logprobs`` (the policy before this step's update), or a policy with ``prev_logprobs_from_forward``
    fills them from its training forward; a policy whose loss needs a reference fills ``ref_logprobs`` in its own
    copy. Either way a ``Loss`` always gets ``prev_logprobs``."""

    input_ids: torch.Tensor  # [B, S] long, right padded
    attention_mask: torch.Tensor  # [B, S]
    loss_mask: torch.Tensor  # [B, S] float, 1 at completion tokens
    gen_logprobs: torch.Tensor  # [B, S] float32, 0 off the mask
    advantages: torch.Tensor  # [B] float32
    group_sizes: list[int]
    prev_logprobs: torch.Tensor | None = None  # [B, S], policy before this step's update
    ref_logprobs: torch.Tensor | None = None  # [B, S], reference model (KL)
    # The two parts of the importance weight (the train pump fills these; asyncrl.algorithms.gap_contributions):
    # 1 at completion tokens that older weights sampled, and there the trainer's logprobs at those weights (NaN
    # where the trainer no longer holds them); at the other tokens the current weights sampled: prev is that.
    stale_mask: torch.Tensor | None = None  # [B, S] float
    version_logprobs: torch.Tensor | None = None  # [B, S] float32

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop`` (a micro-batch); ``group_sizes`` is not meaningful on a slice."""
        return self.map(lambda t: t[start:stop], group_sizes=[])

    def map(self, fn, group_sizes: list[int] | None = None) -> TrainBatch:
        """A batch with ``fn`` applied to every tensor (e.g. a move to a device); absent tensors stay ``None``."""
        cut = lambda t: None if t is None else fn(t)  # noqa: E731
        return TrainBatch(
            cut(self.input_ids), cut(self.attention_mask), cut(self.loss_mask), cut(self.gen_logprobs),
            cut(self.advantages), self.group_sizes if group_sizes is None else group_sizes,
            cut(self.prev_logprobs), cut(self.ref_logprobs), cut(self.stale_mask), cut(self.version_logprobs),
        )
