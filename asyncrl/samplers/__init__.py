"""Prompt-group samplers: the policy that decides which groups are admitted, trained, kept or dropped.

Importable without torch, Ray or Jupyter. Pick a policy by config::

    sampler = build_sampler({"name": "weight_fifo", "max_staleness_versions": 2}, buffer)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter

from asyncrl.samplers.base import Admission, PromptGroupSampler, SamplerBase, Verdict
from asyncrl.samplers.custom import CustomConfig, build_custom
from asyncrl.samplers.in_order import InOrderConfig, InOrderSampler
from asyncrl.samplers.ready_first import ReadyFirstConfig, ReadyFirstSampler
from asyncrl.samplers.weight_fifo import WeightFifoConfig, WeightFifoSampler
from asyncrl.samplers.windowed import WindowedConfig, WindowedSampler

SamplerConfig = Annotated[
    Union[WindowedConfig, WeightFifoConfig, InOrderConfig, ReadyFirstConfig, CustomConfig],
    Field(discriminator="name"),
]
SAMPLERS: dict[str, type[SamplerBase]] = {
    cls.name: cls for cls in (WindowedSampler, WeightFifoSampler, InOrderSampler, ReadyFirstSampler)
}
_adapter = TypeAdapter(SamplerConfig)


def sampler_config(config: Any) -> Any:
    """Validate a mapping (or pass through a config model) into one of the sampler config models."""
    if isinstance(config, (WindowedConfig, WeightFifoConfig, InOrderConfig, ReadyFirstConfig, CustomConfig)):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"sampler config must be a mapping or a sampler config model, got {type(config).__name__}")
    config = dict(config)
    if "name" not in config:
        raise ValueError(f"sampler config needs a 'name', one of {[*SAMPLERS, 'custom']}; got keys {list(config)}")
    return _adapter.validate_python(config)


def build_sampler(config: Any, buffer) -> PromptGroupSampler:
    cfg = sampler_config(config)
    if isinstance(cfg, CustomConfig):
        return build_custom(cfg, buffer)
    knobs = cfg.model_dump(exclude={"name"})
    return SAMPLERS[cfg.name](buffer, **knobs)


def explain_frame(verdicts: list[Verdict]):
    """The verdicts as a pandas DataFrame (one row per slot), the table a person reads."""
    import pandas as pd

    columns = ["group_id", "weight_version", "target_step", "state", "action", "code", "reason"]
    return pd.DataFrame([v.__dict__ for v in verdicts], columns=columns)


__all__ = [
    "Admission", "PromptGroupSampler", "Verdict", "SamplerConfig", "build_sampler", "sampler_config",
    "explain_frame", "WindowedSampler", "WeightFifoSampler", "InOrderSampler", "ReadyFirstSampler",
    "WindowedConfig", "WeightFifoConfig", "InOrderConfig", "ReadyFirstConfig", "CustomConfig",
]
