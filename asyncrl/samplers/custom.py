"""``custom``: a sampler class of your own, named ``"package.module:ClassName"``.

The class is imported and checked against the ``PromptGroupSampler`` Protocol when the configuration is
validated (before any run starts), constructed as ``ClassName(buffer, **kwargs)`` by ``build_sampler``, and
checked again as an instance. Its ``required_buffer_capacity`` is honoured like a built-in's. The short way to
write one is to subclass ``SamplerBase`` (see ``docs/samplers.md`` and ``notebooks/my_sampler.py``).
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import ConfigDict, ValidationError, field_validator

from asyncrl.samplers.base import KnobModel, PromptGroupSampler

# The Protocol's members, read off the Protocol itself; checked on the class so a bad target fails at configuration
# time. Attributes may be class attributes, properties, or at least annotations on the class (set per instance).
PROTOCOL_ATTRIBUTES = tuple(PromptGroupSampler.__annotations__)
PROTOCOL_METHODS = tuple(
    name for name, value in vars(PromptGroupSampler).items() if callable(value) and not name.startswith("_")
)
PROTOCOL_MEMBERS = PROTOCOL_METHODS + PROTOCOL_ATTRIBUTES


def _declares(cls: type, name: str) -> bool:
    return hasattr(cls, name) or any(name in vars(k).get("__annotations__", {}) for k in cls.__mro__)


def load_target(target: str) -> type:
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"custom sampler target must look like 'package.module:ClassName', got {target!r}")
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # not only ImportError: a module that raises while importing does not import either
        raise ValueError(
            f"custom sampler target {target!r}: module {module_name!r} does not import "
            f"({type(exc).__name__}: {exc}){'; is its folder on PYTHONPATH?' if isinstance(exc, ModuleNotFoundError) else ''}"
        ) from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        found = "nothing" if cls is None else f"a {type(cls).__name__}"
        raise ValueError(
            f"custom sampler target {target!r}: module {module_name!r} has no class {class_name!r} (found {found})"
        )
    missing = [m for m in PROTOCOL_METHODS if not callable(getattr(cls, m, None))]
    missing += [m for m in PROTOCOL_ATTRIBUTES if not _declares(cls, m)]
    if missing:
        raise ValueError(
            f"custom sampler target {target!r} does not satisfy PromptGroupSampler: missing or not callable "
            f"{missing} (required: methods {list(PROTOCOL_METHODS)} and attributes {list(PROTOCOL_ATTRIBUTES)}, an "
            "attribute set in __init__ declared on the class, e.g. `dispatch_index: int`; subclassing "
            "asyncrl.samplers.SamplerBase provides all of them)"
        )
    return cls


class CustomConfig(KnobModel):
    """``target`` plus any keyword arguments for the class, given flat:
    ``{"name": "custom", "target": "pkg.mod:Cls", "k": 1}``."""

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
    except (TypeError, ValidationError) as exc:  # a plain class's signature, or a SamplerBase's Knobs model
        raise ValueError(f"custom sampler {config.target!r} rejected kwargs {config.kwargs}: {exc}") from exc
    if not isinstance(sampler, PromptGroupSampler):
        missing = [m for m in PROTOCOL_MEMBERS if not hasattr(sampler, m)]
        raise ValueError(
            f"custom sampler {config.target!r} built an object that does not satisfy PromptGroupSampler: "
            f"missing {missing}"
        )
    return sampler
