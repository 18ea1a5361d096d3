"""Backends: generation (rollouts) and policy (training) behind two small Protocols (see ``base``).

``build_backends(cfg)`` picks the implementations named in the config and places them in-process, as Ray
actors (``placement: ray``) or, the generator, in a child process (``placement: process``): placement is
configuration, not code.
Layout: ``base`` (the Protocols), ``hf`` (Hugging Face helpers every engine shares), one module per engine
(``torch``, ``megatron`` with ``megatron_weights`` and ``megatron_parallel``, ``vllm``, ``simulated``), the
placements (``ray``, ``process``) and ``weight_sync`` (how weights reach the generator). Engines never import each
other.
"""

from __future__ import annotations

from importlib import import_module

from asyncrl.backends.base import GenerationBackend, PolicyBackend

POLICIES = {
    "torch": "asyncrl.backends.torch:TorchPolicy",
    "megatron": "asyncrl.backends.megatron:MegatronPolicy",
    "simulated": "asyncrl.backends.simulated:SimulatedPolicy",
}
GENERATORS = {
    "torch": "asyncrl.backends.torch:TorchGenerator",
    "vllm": "asyncrl.backends.vllm:VLLMGenerator",
    "simulated": "asyncrl.backends.simulated:SimulatedGenerator",
}


def _load(target: str) -> type:
    module, name = target.split(":")
    return getattr(import_module(module), name)


def build_backends(cfg):
    """``(policy, generator, tokenizer)`` for a ``Config``; the policy trains with ``GRPOLoss(cfg.loss)``."""
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends.hf import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    policy_cls = _load(POLICIES[cfg.trainer.backend])
    generator_cls = _load(GENERATORS[cfg.generation.backend])
    policy_args = (cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tokenizer)
    generator_args = (cfg.model, cfg.generation, cfg.seed, tokenizer)
    if cfg.trainer.placement == "ray" or cfg.generation.placement == "ray":
        from asyncrl.backends.ray import remote

        policy = remote(policy_cls, policy_args, cfg.trainer) if cfg.trainer.placement == "ray" else policy_cls(*policy_args)
        generator = (
            remote(generator_cls, generator_args, cfg.generation)
            if cfg.generation.placement == "ray"
            else generator_cls(*generator_args)
        )
        return policy, generator, tokenizer
    if cfg.generation.placement == "process":
        from asyncrl.backends.process import ProcessGenerator

        return policy_cls(*policy_args), ProcessGenerator(generator_cls, generator_args), tokenizer
    return policy_cls(*policy_args), generator_cls(*generator_args), tokenizer


__all__ = ["GenerationBackend", "PolicyBackend", "build_backends"]
