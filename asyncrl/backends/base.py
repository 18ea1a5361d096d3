"""The two backend protocols and the data that crosses them.

A generation backend turns prompt token ids into ``G`` sampled completions with per-token logprobs, under the
weights of its current ``version``. A policy backend computes logprobs and trains. Both are small Protocols so
the controller can be tested with any implementation (torch on CPU, Megatron-core + vLLM on GPUs, a simulator).

Token tensors in a ``TrainBatch`` are aligned with ``input_ids``: the value at position ``t`` belongs to token
``input_ids[:, t]`` predicted from ``input_ids[:, :t]``. ``loss_mask`` is 1 exactly at completion tokens, so
position 0, prompt tokens and right padding never count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass
class GenerationRequest:
    group_id: int
    prompt_ids: list[int]
    n: int  # completions per prompt (G)


@dataclass
class GroupRollouts:
    """One prompt group's completions, as the generation backend returns them and the buffer stores them."""

    group_id: int
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]  # generator's logprob of each completion token
    weight_version: int  # generator version when the group started
    end_weight_version: int  # generator version when it finished
    finish_reasons: list[str] = field(default_factory=list)
    rewards: list[float] | None = None  # set by the controller when it scores the group
    texts: list[str] | None = None  # decoded completions, for people and for scoring

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


@runtime_checkable
class GenerationBackend(Protocol):
    @property
    def version(self) -> int:
        """The weight version the backend generates with; set by ``load_weights`` once the load completed."""
        ...

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue requests; never blocks on generation."""
        ...

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        """Finished groups. ``timeout=0`` returns what is finished now (a synchronous backend generates what it
        has queued); ``None`` waits until at least one group finished or nothing is in flight."""
        ...

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        """Cancel unfinished groups; returns the ids actually cancelled (finished ones are not)."""
        ...

    def num_inflight(self) -> int: ...

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None: ...

    def close(self) -> None: ...


@dataclass
class TrainBatch:
    """Padded tensors for a list of groups (all completions of each group, groups in order)."""

    input_ids: torch.Tensor  # [B, S] long, right padded
    attention_mask: torch.Tensor  # [B, S]
    loss_mask: torch.Tensor  # [B, S] float, 1 at completion tokens
    gen_logprobs: torch.Tensor  # [B, S] float32, 0 off the mask
    advantages: torch.Tensor  # [B] float32
    group_sizes: list[int]
    prev_logprobs: torch.Tensor | None = None  # [B, S], policy before this step's update
    ref_logprobs: torch.Tensor | None = None  # [B, S], reference model (KL)

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop`` (a micro-batch); ``group_sizes`` is not meaningful on a slice."""
        cut = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return TrainBatch(
            cut(self.input_ids), cut(self.attention_mask), cut(self.loss_mask), cut(self.gen_logprobs),
            cut(self.advantages), [], cut(self.prev_logprobs), cut(self.ref_logprobs),
        )


@runtime_checkable
class PolicyBackend(Protocol):
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, S] logprobs of ``batch.input_ids`` under the current weights (0 off ``loss_mask``), no grad."""
        ...

    def begin_train_step(self) -> None:
        """Start an RL step: zero gradients and the step's loss accumulators."""
        ...

    def train_microbatches(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward over ``batch`` in micro-batches, accumulating un-normalised gradients."""
        ...

    def finish_train_step(self) -> dict[str, float]:
        """Normalise over the whole step, clip, take exactly one optimizer step. Returns ``loss`` and friends."""
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Current weights under Hugging Face parameter names (what a generation backend loads)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Weights and optimizer state, for ``Controller.save``."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
