"""The backend Protocols (the two a backend implements, and the optional ones): everything the controller (and its weight sync, evaluation and checkpoints) calls.

A generation backend turns prompt token ids into ``G`` sampled completions with per-token logprobs, under the
weights of its current ``version``. A policy backend computes logprobs and trains, one optimizer step per RL step.
Both are small ``typing.Protocol``s, so the controller runs any implementation (torch on CPU, Megatron-core +
vLLM on GPUs, a simulator), in-process or behind a Ray proxy that exposes exactly the same methods.

The data crossing them (``GenerationRequest``, ``GroupRollouts``, ``TrainBatch``) lives in ``asyncrl.data``.
Each method says when the controller calls it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from asyncrl.data import GenerationRequest, GroupRollouts, TrainBatch

if TYPE_CHECKING:
    import torch


@runtime_checkable
class GenerationBackend(Protocol):
    @property
    def version(self) -> int:
        """The weight version the backend generates with; set by ``load_weights`` once the load completed. Read
        at every dispatch (it stamps the reserved slots)."""
        ...

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue one admitted batch (rollout tick); never blocks on generation."""
        ...

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        """Finished groups (every rollout tick). ``timeout=0`` returns what is finished now (a synchronous
        backend generates what it has queued); ``None`` waits until at least one group finished or nothing is in
        flight."""
        ...

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        """Cancel unfinished groups after a weight sync, when the sampler allows; returns the ids actually
        cancelled (finished ones are not)."""
        ...

    def num_inflight(self) -> int:
        """Groups submitted and not yet returned by ``poll`` or cancelled."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Take the policy's weights (Hugging Face names) as version ``version``: at construction (0), after every
        optimizer step, and on restore. Never interleaves a generation."""
        ...

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Greedy completions under the current weights, for ``Controller.evaluate``; draws no sampling
        randomness (the rollouts after an evaluation are those of a run without it)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What an exact resume needs beyond the policy's weights (``Controller.save``, between steps)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (``Controller.restore``, after the weights were loaded)."""
        ...

    def close(self) -> None:
        """Release the engine (``Controller.close``); queued work is dropped."""
        ...


@runtime_checkable
class PolicyBackend(Protocol):
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, S] logprobs of ``batch.input_ids`` under the current weights (0 off ``loss_mask``), no grad. Called
        on every chunk before it is trained, unless the policy is a ``PrevLogprobsFromForward``: these are the
        loss's ``prev_logprobs``."""
        ...

    def begin_train_step(self) -> None:
        """Start an RL step (before its first chunk): zero gradients and the step's accumulators."""
        ...

    def train_microbatches(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward over one chunk in micro-batches with the backend's ``Loss``, accumulating
        un-normalised gradients. Returns this chunk's ``loss_sum``, ``normaliser`` and ``sequences`` (for its
        caller's information only: a Ray proxy pipelines this call and returns ``None``, and the step's metrics come
        from ``finish_train_step``)."""
        ...

    def finish_train_step(self) -> dict[str, float]:
        """When the step's groups are all trained: normalise over the whole step, clip, take exactly one optimizer
        step. Returns the step's metrics: its loss's (``Loss.metrics``) and ``asyncrl.metrics.ENGINE_METRICS``."""
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Current weights under Hugging Face parameter names (what a generation backend loads), after every
        optimizer step and at construction."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Weights and optimizer state, for ``Controller.save`` (between steps)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (``Controller.restore``)."""
        ...

    def close(self) -> None:
        """Release the model and optimizer (``Controller.close``)."""
        ...


@runtime_checkable
class StepMetrics(Protocol):
    """Optional for a generation backend: more columns for each step's row of ``Controller.metrics`` (a replica
    set's tokens and busy seconds per replica: asyncrl/backends/replicas.py)."""

    def step_metrics(self) -> dict[str, float]:
        """After each optimizer step: the columns, measured since the previous call."""
        ...


@runtime_checkable
class StagesWeights(Protocol):
    """Optional for a generation backend whose engine keeps running while weights arrive (vLLM): the collective
    weight sync hands it the weights to swap in between two engine steps instead of loading them now
    (asyncrl/backends/weight_sync.py)."""

    def stage_weights(self, weights: Mapping[str, torch.Tensor], version: int, fill: Any = None) -> None:
        """``fill()`` (if given) writes ``weights`` first; the backend swaps them in as ``version`` between two
        engine steps. ``weights`` stay untouched by the caller until the next call."""
        ...


@runtime_checkable
class PrevLogprobsFromForward(Protocol):
    """Optional for a policy backend: it fills a chunk's ``prev_logprobs`` itself, from its training forward's
    detached logprobs, when the batch comes without them, so the controller skips the separate ``logprobs`` pass.
    Only right for an engine whose weights do not change within an RL step (one optimizer step, in
    ``finish_train_step``) and whose training forward computes what ``logprobs`` does (``TorchPolicy``, and
    ``MegatronPolicy`` with its dropout off). A Ray proxy of such a class and a rank group of its actors are ones
    too (``asyncrl/backends/ray.py``, ``ranks.py``): the marker is a class constant, read without a call."""

    prev_logprobs_from_forward: Literal[True]


@dataclass(frozen=True)
class Capabilities:
    """What a backend class declares about how it may be hosted, read off the class without building it
    (``capabilities = Capabilities(...)``; a class that declares none has the defaults).

    ``ray_pipelined``: methods whose result no caller waits for; through a Ray proxy they return at once and the
    proxy's next call waits for them (``asyncrl/backends/ray.py``: the policies' ``begin_train_step`` and
    ``train_microbatches``). ``ray_max_concurrency``: calls its Ray actor may serve at once (the vLLM generator: 2, a
    weight receive runs during a poll); pipelining needs 1. ``needs_process_group``: built only once its actor
    joined the rank group's process group (Megatron, ``asyncrl/backends/ranks.py``)."""

    ray_pipelined: frozenset[str] = frozenset()
    ray_max_concurrency: int = 1
    needs_process_group: bool = False

    def __post_init__(self) -> None:
        if self.ray_pipelined and self.ray_max_concurrency != 1:
            raise ValueError(f"pipelined calls {sorted(self.ray_pipelined)} need one call at a time, not "
                             f"ray_max_concurrency={self.ray_max_concurrency}")


@runtime_checkable
class DeclaresCapabilities(Protocol):
    """Optional for a backend class: its ``Capabilities``."""

    capabilities: Capabilities


def capabilities(cls: type) -> Capabilities:
    """The ``Capabilities`` backend class ``cls`` declares, or the defaults."""
    return cls.capabilities if isinstance(cls, DeclaresCapabilities) else Capabilities()


@runtime_checkable
class ActorBackend(Protocol):
    """Optional for a backend: it is a proxy of one Ray actor (``asyncrl.backends.ray.RemoteBackend``). Only such a
    backend can die as an actor and be restarted; in-process, child-process, replica-set and rank-group backends
    are not one actor and do not have these members."""

    @property
    def actor_id(self) -> str:
        """The actor's id (hex), as ``ray.exceptions.RayActorError.actor_id`` names a dead one."""
        ...

    def restart(self) -> None:
        """Replace the dead actor with a fresh one built the same way (it starts from its constructor's state)."""
        ...


def is_dead_actor(exc: BaseException, backend: object) -> bool:
    """Is ``exc`` Ray saying that ``backend``'s actor died? (False without Ray or for a backend that is not one
    actor.)"""
    errors = sys.modules.get("ray.exceptions")
    if errors is None or not isinstance(backend, ActorBackend) or not isinstance(exc, errors.RayActorError):
        return False
    return exc.actor_id in (None, backend.actor_id)


__all__ = ["ActorBackend", "Capabilities", "DeclaresCapabilities", "capabilities", "is_dead_actor", "GenerationBackend", "PolicyBackend", "PrevLogprobsFromForward", "StepMetrics", "StagesWeights",
           "GenerationRequest", "GroupRollouts", "TrainBatch"]
