"""The sampler's glue to the rest of the configuration: the checks that join ``sampler:`` to ``loss:`` and to
the buffer's size.

Invariants:
- A sampler that may train on stale data needs an importance-sampling correction in the loss.
- The buffer holds at least the sampler's required capacity for ``groups_per_step``, or the run deadlocks.
- ``model.lora`` on vLLM: the generator holds one adapter per weight version a group in flight uses, so
  ``generation.max_loras`` >= the sampler's window W + 1 (``check_lora_adapters``).
- Both are facts of the sampler's class and knobs, asked without building a sampler or a buffer (a custom
  target's class is imported, as validating its config already did); the controller builds the one sampler.
- Each rule raises one ``ValueError`` naming both sides; none changes the configuration.
"""

from __future__ import annotations

from typing import Any

from asyncrl.samplers import sampler_class, sampler_knobs


def check_stale_sampler_correction(sampler_config: Any, importance_correction: Any) -> None:
    """Before the loss section's own checks: a stale sampler with ``importance_correction: none`` is reported as
    the cause (the sampler rule), not as a truncation that has nothing to correct."""
    if importance_correction == "none" and sampler_config is not None:
        cls, knobs = sampler_class(sampler_config), sampler_knobs(sampler_config)
        _check_correction(cls.trains_on_policy(knobs), cls.describe(knobs), importance_correction)


def check_sampler_config(cfg: Any) -> None:
    """The sampler of ``cfg`` (asyncrl.config.Config) against the rest of ``cfg``."""
    cls, knobs = sampler_class(cfg.sampler), sampler_knobs(cfg.sampler)
    _check_fit(cls.trains_on_policy(knobs), cls.capacity_needed(knobs, cfg.groups_per_step), cls.describe(knobs), cfg)
    check_lora_adapters(cfg)


def check_lora_adapters(cfg: Any) -> None:
    """``model.lora`` with vLLM (one adapter per weight version, ``asyncrl/backends/vllm_lora.py``): the generator in
    the controller's process, the adapter sent by the driver, and room for the window's versions."""
    if cfg.model.lora is None or cfg.generation.backend != "vllm":
        return
    gen = cfg.generation
    if gen.placement != "local" or gen.replicas > 1 or gen.weight_sync != "driver":
        raise ValueError(f"model.lora with generation.backend 'vllm' sends the adapter to one engine in the "
                         f"controller's process: set generation.placement 'local', replicas 1, weight_sync 'driver' "
                         f"(got {gen.placement!r}, {gen.replicas}, {gen.weight_sync!r})")
    window = sampler_class(cfg.sampler).window_of(sampler_knobs(cfg.sampler))
    if window is not None and gen.max_loras < window + 1:
        raise ValueError(f"generation.max_loras {gen.max_loras} < the sampler's window {window} + 1: groups in flight "
                         f"may use {window + 1} weight versions, one adapter each; set max_loras >= {window + 1}")


def required_buffer_capacity(sampler_config: Any, groups_per_step: int) -> int | None:
    """The buffer size the configured sampler needs to never deadlock (None: no fixed bound)."""
    return sampler_class(sampler_config).capacity_needed(sampler_knobs(sampler_config), groups_per_step)


def check_sampler_fits(sampler: Any, cfg: Any) -> None:
    """A sampler built by hand (not from ``cfg.sampler``) against ``cfg``: the same rules, asked of it."""
    _check_fit(sampler.is_on_policy, sampler.required_buffer_capacity(cfg.groups_per_step), repr(sampler), cfg)


def _check_fit(on_policy: bool, required: int | None, sampler: str, cfg: Any) -> None:
    _check_correction(on_policy, sampler, cfg.loss.importance_correction)
    if required is not None and cfg.max_buffered_groups is not None and cfg.max_buffered_groups < required:
        raise ValueError(
            f"max_buffered_groups {cfg.max_buffered_groups} is smaller than the {required} groups sampler "
            f"{sampler} needs with groups_per_step {cfg.groups_per_step}; it would deadlock"
        )


def _check_correction(on_policy: bool, sampler: str, importance_correction: str) -> None:
    if not on_policy and importance_correction == "none":
        raise ValueError(
            f"sampler {sampler} may train on stale data, so the loss needs an importance-sampling correction: "
            "set loss.importance_correction to 'token' or 'sequence' (got 'none')"
        )
