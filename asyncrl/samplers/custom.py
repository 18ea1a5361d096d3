"""``custom``: a sampler class of your own, named ``"package.module:ClassName"``.

When the configuration is validated (before anything is built or written) the class is imported, checked
against the ``PromptGroupSampler`` Protocol (and, for a ``SamplerBase`` subclass, for what a subclass must define:
``name``, ``Knobs``, ``_candidates``), and built once on an empty buffer with its kwargs, so a mistake is one line
naming the class and what it lacks. ``build_sampler`` then constructs it as ``ClassName(buffer, **kwargs)``. Its
``required_buffer_capacity`` is honoured like a built-in's. The short way to write one is to subclass
``SamplerBase`` (see ``docs/samplers.md`` and ``notebooks/my_sampler.py``).
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import ConfigDict, ValidationError, field_validator, model_validator

from asyncrl.samplers.base import KnobModel, PromptGroupSampler, SamplerBase

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
    lacks = _subclass_lacks(cls) if issubclass(cls, SamplerBase) else []
    if lacks:
        raise ValueError(
            f"custom sampler {cls.__name__} ({target!r}) lacks {'; '.join(lacks)}: a SamplerBase subclass defines "
            "name, Knobs and _candidates (docs/samplers.md, 'Writing your own')"
        )
    return cls


def _subclass_lacks(cls: type[SamplerBase]) -> list[str]:
    """What a ``SamplerBase`` subclass must define and ``cls`` does not (the base only annotates them)."""
    lacks = []
    if not isinstance(getattr(cls, "name", None), str):
        lacks.append("`name` (a str: the policy's name in reasons)")
    knobs = getattr(cls, "Knobs", None)
    if not (isinstance(knobs, type) and issubclass(knobs, KnobModel)):
        lacks.append("`Knobs` (a KnobModel subclass: the pydantic model of its keyword arguments)")
    elif cls.window_knob not in knobs.model_fields:
        lacks.append(f"a knob {cls.window_knob!r} in its Knobs, which window_knob names as its window "
                     f"(its knobs: {list(knobs.model_fields)})")
    if cls._candidates is SamplerBase._candidates:
        lacks.append("`_candidates(T)` (the ready slots select may take, in order)")
    return lacks


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

    @model_validator(mode="after")
    def _builds(self) -> CustomConfig:
        """Built once on an empty buffer: its kwargs, its ``__init__`` and the instance are checked before a run."""
        from asyncrl.buffer import ReplayBuffer

        build_custom(self, ReplayBuffer())
        return self

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


def build_custom(config: CustomConfig, buffer) -> PromptGroupSampler:
    cls = load_target(config.target)
    try:
        sampler = cls(buffer, **config.kwargs)
    except ValidationError as exc:  # a SamplerBase's Knobs model: one line per knob
        errors = "; ".join(e["msg"].removeprefix("Value error, ") if not e["loc"] else
                           f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
        raise ValueError(f"custom sampler {config.target!r} rejected kwargs {config.kwargs}: {errors}") from exc
    except Exception as exc:  # a plain class's signature, or any error of its own __init__
        raise ValueError(f"custom sampler {config.target!r} rejected kwargs {config.kwargs}: "
                         f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(sampler, PromptGroupSampler):
        missing = [m for m in PROTOCOL_MEMBERS if not hasattr(sampler, m)]
        raise ValueError(
            f"custom sampler {config.target!r} built an object that does not satisfy PromptGroupSampler: "
            f"missing {missing}"
        )
    return sampler
