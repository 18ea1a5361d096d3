"""Prompt-group samplers: the policy that decides which groups are admitted, trained, kept or dropped.

Importable without torch, Ray or Jupyter. Pick a policy by config::

    sampler = build_sampler({"name": "weight_fifo", "max_staleness_versions": 2}, buffer)

The rules of each policy are in ``docs/samplers.md``. A policy of your own subclasses ``SamplerBase`` with a
``KnobModel`` for its knobs and is named by ``{"name": "custom", "target": "package.module:ClassName", ...}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter

from asyncrl.samplers.base import (
    Admission,
    KnobModel,
    PromptGroupSampler,
    SamplerBase,
    Verdict,
)
from asyncrl.samplers.custom import CustomConfig, build_custom
from asyncrl.samplers.in_order import InOrderConfig, InOrderSampler
from asyncrl.samplers.ready_first import ReadyFirstConfig, ReadyFirstSampler
from asyncrl.samplers.weight_fifo import WeightFifoConfig, WeightFifoSampler
from asyncrl.samplers.windowed import WindowedConfig, WindowedSampler

# The built-in policies. A new one is a file with its class and its Knobs model, and one entry here: the config
# union, the name lookup and the error messages below are all derived from this tuple.
BUILT_IN: tuple[type[SamplerBase], ...] = (WindowedSampler, WeightFifoSampler, InOrderSampler, ReadyFirstSampler)

SAMPLERS: dict[str, type[SamplerBase]] = {cls.name: cls for cls in BUILT_IN}
CONFIGS: tuple[type[KnobModel], ...] = (*(cls.Knobs for cls in BUILT_IN), CustomConfig)
SamplerConfig = Annotated[Union[CONFIGS], Field(discriminator="name")]  # noqa: UP007 (a tuple needs Union[...])
_adapter = TypeAdapter(SamplerConfig)


def sampler_config(config: Any) -> Any:
    """Validate a mapping (or pass through a config model) into one of the sampler config models."""
    if isinstance(config, CONFIGS):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"sampler config must be a mapping or a sampler config model, got {type(config).__name__}")
    config = dict(config)
    if "name" not in config:
        raise ValueError(f"sampler config needs a 'name', one of {[*SAMPLERS, 'custom']}; got keys {list(config)}")
    return _adapter.validate_python(config)


def build_sampler(config: Any, buffer) -> SamplerBase:
    """The sampler a config names, on ``buffer``: the controller builds its one sampler here."""
    cfg = sampler_config(config)
    if isinstance(cfg, CustomConfig):
        return build_custom(cfg, buffer)
    return SAMPLERS[cfg.name](buffer, **cfg.model_dump(exclude={"name"}))


def sampler_class(config: Any) -> type[SamplerBase]:
    """The class a sampler config names (a custom target is imported, as validating its config already did)."""
    cfg = sampler_config(config)
    return cfg.sampler_class if isinstance(cfg, CustomConfig) else SAMPLERS[cfg.name]


def sampler_knobs(config: Any) -> KnobModel:
    """The knobs a sampler config builds its class with; with ``sampler_class`` they answer, without a sampler or
    a buffer, what the configuration asks: ``cls.trains_on_policy(knobs)``, ``cls.capacity_needed(knobs, N)``."""
    cfg = sampler_config(config)
    return cfg.knobs if isinstance(cfg, CustomConfig) else cfg


def explain_frame(verdicts: list[Verdict]):
    """The verdicts as a pandas DataFrame (one row per slot), the table a person reads: a ``VerdictFrame``, which
    prints every reason whole."""
    from asyncrl.samplers.verdict_frame import VerdictFrame

    columns = ["group_id", "weight_version", "target_step", "state", "action", "code", "reason"]
    frame = VerdictFrame([v.__dict__ for v in verdicts], columns=columns)
    return frame.astype({"group_id": "Int64", "weight_version": "Int64", "target_step": "Int64"})


__all__ = [
    "Admission", "PromptGroupSampler", "Verdict", "SamplerBase", "KnobModel", "SamplerConfig",
    "SAMPLERS", "BUILT_IN", "build_sampler", "sampler_class", "sampler_knobs", "sampler_config", "explain_frame",
    "CustomConfig",
    *(cls.__name__ for cls in BUILT_IN), *(cls.Knobs.__name__ for cls in BUILT_IN),
]
