"""The backend Protocols (the two a backend implements) and ``Capabilities`` (what else it declares): everything the
controller (and its weight sync, evaluation and checkpoints) calls.

A generation backend turns prompt token ids into ``G`` sampled completions with per-token logprobs, under the
weights of its current ``version``. A policy backend computes logprobs and trains, one optimizer step per RL step.
Both are small ``typing.Protocol``s, so the controller runs any implementation (torch on CPU, Megatron-core +
vLLM on GPUs, a simulator), in-process or behind a Ray proxy that exposes exactly the same methods.

The data crossing them (``GenerationRequest``, ``GroupRollouts``, ``TrainBatch``) lives in ``asyncrl.data``.
Each method says when the controller calls it. Whatever a backend has beyond them is declared (``Capabilities``)
and read with ``capabilities(backend)``: nothing asks a backend with ``isinstance`` what it can do (a wrapper
answers for what it wraps, which a structural check of its members cannot see).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

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
        on every chunk before it is trained, unless the policy declares ``prev_logprobs_from_forward``
        (``Capabilities``): these are the loss's ``prev_logprobs``."""
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
        step. Returns the step's metrics: its loss's (``Loss.metrics``) and ``asyncrl.metrics.ENGINE_METRICS``.
        When the step's ``loss`` or ``grad_norm`` is not finite, no update is taken (weights, optimizer state and
        the learning-rate schedule stay as they were; the gradients are dropped) and both are reported as they
        are: the train pump records the fault (``faults.max_nonfinite_steps``)."""
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


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares beyond the two Protocols: how it may be hosted, and which optional members it has.
    A class declares it (``capabilities = Capabilities(...)``; one that declares none has the defaults) and it is
    read off the class without building it, or off the object, with ``capabilities(backend)``: never by probing
    for the members. A backend that wraps others answers for what it wraps, on the instance where that depends on
    it: a Ray proxy declares its hosted class's and ``actor``, a child process and a rank group what they pass on,
    a replica set ``step_metrics`` (``ray.py``, ``process.py``, ``ranks.py``, ``replicas.py``).

    Hosting. ``ray_pipelined``: methods whose result no caller waits for; through a Ray proxy they return at once
    and the proxy's next call waits for them (``asyncrl/backends/ray.py``: the policies' ``begin_train_step`` and
    ``train_microbatches``). ``ray_max_concurrency``: calls its Ray actor may serve at once (the vLLM generator: 2,
    a weight receive runs during a poll); pipelining needs 1. ``needs_process_group``: built only once its actor
    joined the rank group's process group (Megatron, ``asyncrl/backends/ranks.py``).

    Optional members (a declared one must exist: ``capabilities`` says which is missing).
    ``prev_logprobs_from_forward`` (a policy): it fills a chunk's ``prev_logprobs`` itself, from its training
    forward's detached logprobs, when the batch comes without them, so the controller skips the separate
    ``logprobs`` pass. Only right for an engine whose weights do not change within an RL step (one optimizer step,
    in ``finish_train_step``) and whose training forward computes what ``logprobs`` does (``TorchPolicy``, and
    ``MegatronPolicy`` with its dropout off).
    ``stages_weights`` (a generator whose engine keeps running while weights arrive, vLLM): it has
    ``stage_weights(weights, version, fill=None)``: ``fill()`` (if given) writes ``weights`` first, and the backend
    swaps them in as ``version`` between two engine steps; ``weights`` stay untouched by the caller until the next
    call. The collective weight sync hands it the weights that way instead of loading them now (``weight_sync.py``).
    ``step_metrics`` (a generator): it has ``step_metrics() -> dict[str, float]``, more columns for each step's row
    of ``Controller.metrics``, measured since the previous call (a replica set's tokens and busy seconds per replica).
    ``keeps_versions`` (a policy): it can keep the weights of earlier versions and compute logprobs under them, so
    the train pump can split a stale token's importance weight into staleness and mismatch
    (``asyncrl.algorithms.gap_contributions``): ``keep_versions(versions, current) -> list[int]`` (before each
    optimizer step, its weights being version ``current``: keep those of ``versions`` it has, the current ones
    included if listed, drop the rest; returns the versions it now holds) and ``logprobs_at(batch, version,
    current)`` (``logprobs`` under a held version). ``KeptVersions`` below is one way to have them.
    ``concurrent_logprobs_at`` (a policy with ``keeps_versions``): its ``logprobs_at`` for a kept version reads a
    copy of the model of its own, never the parameters being trained, so it may run on another thread while the
    policy trains; the train pump then measures buffered groups beside training during a run
    (``asyncrl/gap_pass.py``), for an in-process policy only (a Ray actor serves one call at a time).
    ``sampled_evaluation`` (a generator): it has ``generate_sampled(prompts, n, temperature, seed,
    max_new_tokens)``, ``n`` sampled completions of each prompt from a random stream of their own seeded by ``seed``
    (the rollouts' is not touched): ``Controller.evaluate`` with a temperature (``asyncrl/evaluation.py``).
    ``actor``: it is a proxy of one Ray actor (``asyncrl.backends.ray.RemoteBackend``), with ``actor_id`` (hex, as
    ``ray.exceptions.RayActorError.actor_id`` names a dead one) and ``restart()`` (a fresh actor built the same way,
    from its constructor's state). Only such a backend can die as an actor and be restarted."""

    ray_pipelined: frozenset[str] = frozenset()
    ray_max_concurrency: int = 1
    needs_process_group: bool = False
    prev_logprobs_from_forward: bool = False
    stages_weights: bool = False
    step_metrics: bool = False
    keeps_versions: bool = False
    concurrent_logprobs_at: bool = False
    sampled_evaluation: bool = False
    actor: bool = False

    def __post_init__(self) -> None:
        if self.ray_pipelined and self.ray_max_concurrency != 1:
            raise ValueError(f"pipelined calls {sorted(self.ray_pipelined)} need one call at a time, not "
                             f"ray_max_concurrency={self.ray_max_concurrency}")


class KeptVersions:
    """``keep_versions`` / ``logprobs_at`` (``Capabilities.keeps_versions``) for a policy whose ``logprobs(batch)``
    reads ``self.model``'s parameters. A kept version is a copy of every parameter, taken before the optimizer step
    that leaves it, where the parameters live (the GPU for a GPU policy: one model's parameters per kept version,
    ``kept_bytes``). ``logprobs_at`` swaps the copies' tensors into the parameters for one ``logprobs`` pass and
    the current ones back, even if the pass fails: nothing is copied per call, the optimizer's parameter objects
    never change, no gradient is taken under kept weights. Copies are not checkpointed: a checkpoint holds the
    buffered groups' logprobs under their versions instead (``TrainPump.version_state``)."""

    def keep_versions(self, versions: Sequence[int], current: int) -> list[int]:
        wanted, kept = set(versions), getattr(self, "_kept", {})
        self._kept = {v: w for v, w in kept.items() if v in wanted}
        if current in wanted and current not in self._kept:
            self._kept[current] = [p.detach().clone() for p in self._parameters()]
        return sorted(self._kept)

    def _parameters(self) -> list:
        """``self.model``'s parameters, listed once per model object: ``parameters()`` walks every submodule (a few
        hundred calls a step for a small Llama), while loads and optimizer steps change the tensors in place."""
        listed = getattr(self, "_listed", None)
        if listed is None or listed[0] is not self.model:
            listed = self._listed = (self.model, list(self.model.parameters()))
        return listed[1]

    def logprobs_at(self, batch: TrainBatch, version: int, current: int) -> torch.Tensor:
        if version == current:
            return self.logprobs(batch)
        params = self._parameters()
        now = [p.data for p in params]
        try:
            for p, kept in zip(params, self._kept[version]):
                p.data = kept
            return self.logprobs(batch)
        finally:
            for p, data in zip(params, now):
                p.data = data

    def kept_bytes(self) -> int:
        """Bytes the kept copies take: what keeping versions costs in memory."""
        return sum(t.numel() * t.element_size() for copies in getattr(self, "_kept", {}).values() for t in copies)


DEFAULTS = Capabilities()
MEMBERS = {"stages_weights": ("stage_weights",), "step_metrics": ("step_metrics",),
           "keeps_versions": ("keep_versions", "logprobs_at"), "sampled_evaluation": ("generate_sampled",),
           "actor": ("actor_id", "restart")}


def capabilities(backend: object) -> Capabilities:
    """The ``Capabilities`` that ``backend`` (a backend class or object) declares, or the defaults. A declaration
    missing a member it promises, or a ``prev_logprobs_from_forward = True`` marker left undeclared (how a backend
    said so before), is a ``TypeError`` naming it."""
    declared = getattr(backend, "capabilities", DEFAULTS)
    name = getattr(backend, "__name__", type(backend).__name__)
    if not isinstance(declared, Capabilities):
        raise TypeError(f"{name}.capabilities is {declared!r}; declare a Capabilities(...)")
    for flag, members in MEMBERS.items():
        # the class first: an object's property (a proxy's actor_id) is not run to learn that it exists
        missing = [m for m in members if getattr(declared, flag)
                   and not (hasattr(type(backend), m) or hasattr(backend, m))]
        if missing:
            raise TypeError(f"{name} declares Capabilities({flag}=True) but has no {' or '.join(missing)}")
    if getattr(backend, "prev_logprobs_from_forward", False) is True and not declared.prev_logprobs_from_forward:
        raise TypeError(f"{name} sets prev_logprobs_from_forward = True; declare it instead: capabilities = "
                        "Capabilities(prev_logprobs_from_forward=True, ...)")
    return declared


def is_dead_actor(exc: BaseException, backend: object) -> bool:
    """Is ``exc`` Ray saying that ``backend``'s actor died? (False without Ray or for a backend that is not one
    actor.)"""
    errors = sys.modules.get("ray.exceptions")
    if errors is None or not capabilities(backend).actor or not isinstance(exc, errors.RayActorError):
        return False
    return exc.actor_id in (None, backend.actor_id)


__all__ = ["Capabilities", "KeptVersions", "capabilities", "is_dead_actor", "GenerationBackend", "PolicyBackend",
           "GenerationRequest", "GroupRollouts", "TrainBatch"]
