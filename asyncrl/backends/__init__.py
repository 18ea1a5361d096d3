"""Backends: generation (rollouts) and policy (training) behind two small Protocols (see ``base``).

``build_backends(cfg)`` picks the implementations the config names (one registry: ``asyncrl.config``'s
``GENERATION_CONFIGS`` / ``TRAINER_CONFIGS``, each section class naming its ``engine``) and places them in-process, as Ray
actors (``placement: ray``) or, the generator, in a child process (``placement: process``): placement is
configuration, not code.
Layout: ``base`` (the Protocols), ``hf`` (Hugging Face helpers every engine shares), one module per engine
(``torch`` with ``torch_decode``, ``megatron`` with ``megatron_weights`` and ``megatron_parallel``, ``vllm`` with
``vllm_build``, ``vllm_requests``, ``vllm_weights`` and ``vllm_lora``, ``simulated``), the placements (``ray``, ``process``; the
queue of generators that generate on poll is ``submit_queue``), ``replicas`` (K generation engines as one backend), ``ranks`` (a multi-rank
trainer as one backend; its ranks reduce with ``data_parallel``) and ``weight_sync`` (how weights reach the
generator). Engines never import each other.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from asyncrl.backends.base import GenerationBackend, PolicyBackend
from asyncrl.config import GENERATION_CONFIGS, TRAINER_CONFIGS

if TYPE_CHECKING:
    from asyncrl.algorithms import Loss


def engine(section) -> type:
    """The engine class of a ``generation:`` or ``trainer:`` config section: the one registry is
    ``asyncrl.config.GENERATION_CONFIGS`` / ``TRAINER_CONFIGS``, whose classes name their engine (``engine``)."""
    return _load(section.engine)


def _load(target: str) -> type:
    module, name = target.split(":")
    return getattr(import_module(module), name)


POLICIES = {name: c.engine for name, c in TRAINER_CONFIGS.items()}  # read off the registry, for scripts
GENERATORS = {name: c.engine for name, c in GENERATION_CONFIGS.items()}


def build_backends(cfg, loss: Loss | None = None):
    """``(policy, generator, tokenizer)`` for a ``Config``; the policy trains with ``loss`` (default
    ``GRPOLoss(cfg.loss)``)."""
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends.hf import check_model, load_tokenizer

    if cfg.model.lora is not None and cfg.trainer.backend != "torch":
        raise ValueError(f"model.lora trains an adapter on the torch engine; trainer.backend is "
                         f"{cfg.trainer.backend!r} (set trainer.backend: torch, or leave model.lora unset)")
    tokenizer = load_tokenizer(cfg.model)
    if "simulated" not in (cfg.trainer.backend, cfg.generation.backend):  # the simulated engines build no model
        check_model(cfg.model, tokenizer)  # a bad model directory or architecture: one line, before any engine starts
    if cfg.trainer.backend != "simulated":
        from asyncrl.backends.lr_schedule import check_schedule

        check_schedule(cfg.trainer)
    policy_cls, generator_cls = engine(cfg.trainer), engine(cfg.generation)
    if loss is None:  # dr_grpo's normaliser is the completion length limit
        loss = GRPOLoss(cfg.loss, max_completion_length=cfg.generation.max_new_tokens)
    policy_args = (cfg.model, cfg.trainer, loss, cfg.seed, tokenizer)
    generator_args = (cfg.model, cfg.generation, cfg.seed, tokenizer)
    if "ray" in (cfg.trainer.placement, cfg.generation.placement):
        from asyncrl.backends.ray import ensure_ray

        ensure_ray(cfg.ray.num_cpus, cfg.ray.address)
    if cfg.trainer.ranks > 1 and cfg.trainer.placement == "ray":
        from asyncrl.backends.ranks import RankGroupPolicy

        policy = RankGroupPolicy.start(policy_cls, policy_args, cfg)
    elif cfg.trainer.placement == "ray":
        from asyncrl.backends.ray import remote

        policy = remote(policy_cls, policy_args, cfg.trainer)
    else:
        policy = policy_cls(*policy_args)
    try:
        if cfg.generation.replicas > 1 and cfg.generation.placement == "ray":  # else simulated: modelled engines
            from asyncrl.backends.replicas import ReplicaSet

            generator = ReplicaSet.start(generator_cls, generator_args, cfg)
        elif cfg.generation.placement == "ray":
            from asyncrl.backends.ray import remote

            generator = remote(generator_cls, generator_args, cfg.generation)
        elif cfg.generation.placement == "process":
            from asyncrl.backends.process import ProcessGenerator

            generator = ProcessGenerator(generator_cls, generator_args)
        else:
            generator = generator_cls(*generator_args)
    except BaseException:
        policy.close()  # no actor outlives a failed start (PolicyBackend.close)
        raise
    return policy, generator, tokenizer


def reward_model_device(cfg) -> str | None:
    """The CUDA device reward models score on in this process: the trainer's when it trains here (placement
    'local') on CUDA, else the generator's when it generates here on CUDA; None (a CPU run, or no engine of the run
    in this process on a GPU): they score on the CPU, in the reward workers."""
    for section in (cfg.trainer, cfg.generation):
        if section.backend != "simulated" and section.placement == "local" and str(section.device).startswith("cuda"):
            return str(section.device)
    return None


def place_reward_models(cfg, functions) -> list[str]:
    """On a GPU run, the run's reward models (``functions``: its ``RewardFunctions``) score on that GPU in this
    process, each forward under the device lock the engines take turns on (``device_lock.exclusive_device``, as
    the engine "RewardModel" in ``device_lock_stats``); the names of those placed."""
    device = reward_model_device(cfg)
    if device is None:
        return []
    from functools import partial

    from asyncrl.backends.device_lock import exclusive_device
    from asyncrl.rewards.models import place_models

    return place_models(functions.funcs, device, partial(exclusive_device, device, "RewardModel"))


__all__ = ["GenerationBackend", "PolicyBackend", "build_backends", "engine", "place_reward_models",
           "reward_model_device"]
