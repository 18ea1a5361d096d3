"""Backends: generation (rollouts) and policy (training) behind two small Protocols (see ``base``)."""

from asyncrl.backends.base import GenerationBackend, GenerationRequest, GroupRollouts, PolicyBackend, TrainBatch

__all__ = ["GenerationBackend", "GenerationRequest", "GroupRollouts", "PolicyBackend", "TrainBatch"]
