"""``custom``: a sampler class of your own, named ``"package.module:ClassName"``.

The class is imported and checked against the ``PromptGroupSampler`` Protocol when the configuration is
validated (before any run starts), constructed as ``ClassName(buffer, **kwargs)`` by ``build_sampler``, and
checked again as an instance. Its ``required_buffer_capacity`` is honoured like a built-in's.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import ConfigDict, field_validator

from asyncrl.samplers.base import KnobModel, PromptGroupSampler

# Members the Protocol requires; checked on the class so a bad target fails at configuration time.
PROTOCOL_MEMBERS = (
    "admit", "select", "evict", "should_abort_inflight", "explain", "is_on_policy",
    "required_buffer_capacity", "set_dispatch_index",
)


def load_target(target: str) -> type:
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"custom sampler target must look like 'package.module:ClassName', got {target!r}")
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"custom sampler target {target!r}: module {module_name!r} does not import ({exc})") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"custom sampler target {target!r}: module {module_name!r} has no class {class_name!r}")
    missing = [m for m in PROTOCOL_MEMBERS if not hasattr(cls, m) and m not in getattr(cls, "__annotations__", {})]
    if missing:
        raise ValueError(
            f"custom sampler target {target!r} does not satisfy PromptGroupSampler: missing {missing}"
        )
    return cls


class CustomConfig(KnobModel):
    """``target`` plus any keyword arguments for the class, given flat: ``{"name": "custom", "target": ..., "k": 1}``."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: Literal["custom"] = "custom"
    target: str

    @field_validator("target")
    @classmethod
    def _importable(cls, target: str) -> str:
        load_target(target)
        return target

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


def build_custom(config: CustomConfig, buffer) -> PromptGroupSampler:
    cls = load_target(config.target)
    try:
        sampler = cls(buffer, **config.kwargs)
    except TypeError as exc:
        raise ValueError(f"custom sampler {config.target!r} rejected kwargs {config.kwargs}: {exc}") from exc
    if not isinstance(sampler, PromptGroupSampler):
        raise ValueError(f"custom sampler {config.target!r} built an object that does not satisfy PromptGroupSampler")
    return sampler
