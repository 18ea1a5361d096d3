"""The sampler's glue to the rest of the configuration: the checks that join ``sampler:`` to ``loss:`` and to
the buffer's size.

Invariants:
- A sampler that may train on stale data needs an importance-sampling correction in the loss.
- The buffer holds at least the sampler's ``required_buffer_capacity(groups_per_step)``, or the run deadlocks.
- Each rule raises one ``ValueError`` naming both sides; none changes the configuration.
"""

from __future__ import annotations

from typing import Any

from asyncrl.samplers import CustomConfig, build_custom, build_sampler


def check_stale_sampler_correction(sampler_config: Any, importance_correction: Any) -> None:
    """Before the loss section's own checks: a stale sampler with ``importance_correction: none`` is reported as
    the cause (the sampler rule), not as a truncation that has nothing to correct."""
    if importance_correction == "none" and sampler_config is not None and not isinstance(sampler_config, CustomConfig):
        check_importance_correction(build_sampler(sampler_config, None), importance_correction)


def check_sampler_config(cfg: Any) -> None:
    """The sampler of ``cfg`` against the rest of ``cfg`` (asyncrl.config.Config)."""
    if isinstance(cfg.sampler, CustomConfig):  # built on an empty buffer, as its config validation did
        from asyncrl.buffer import ReplayBuffer

        sampler = build_custom(cfg.sampler, ReplayBuffer())
    else:
        sampler = build_sampler(cfg.sampler, None)
    check_sampler_fits(sampler, cfg)


def check_sampler_fits(sampler: Any, cfg: Any) -> None:
    """Reject a sampler the rest of the config cannot serve (raises ValueError naming both sides)."""
    check_importance_correction(sampler, cfg.loss.importance_correction)
    required = sampler.required_buffer_capacity(cfg.groups_per_step)
    if required is not None and cfg.max_buffered_groups is not None and cfg.max_buffered_groups < required:
        raise ValueError(
            f"max_buffered_groups {cfg.max_buffered_groups} is smaller than the {required} groups sampler "
            f"{sampler!r} needs with groups_per_step {cfg.groups_per_step}; it would deadlock"
        )


def check_importance_correction(sampler: Any, importance_correction: str) -> None:
    if not sampler.is_on_policy and importance_correction == "none":
        raise ValueError(
            f"sampler {sampler!r} may train on stale data, so the loss needs an importance-sampling correction: "
            "set loss.importance_correction to 'token' or 'sequence' (got 'none')"
        )
