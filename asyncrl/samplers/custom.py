"""``custom``: a sampler class of your own, named ``"package.module:ClassName"``, a subclass of ``SamplerBase``.

When the configuration is validated (before anything is built or written) the class is imported and checked for
what a subclass must define (``name``, ``Knobs``, ``_candidates``, the knob ``window_knob`` names), and its kwargs
are validated by its ``Knobs``, so a mistake is one line naming the class and what it lacks. No sampler is built
then: what the configuration needs of it (``trains_on_policy``, ``capacity_needed``) is asked of the class and
its knobs. ``build_sampler`` constructs it once, as ``ClassName(buffer, **kwargs)``, for the controller. See
``docs/samplers.md`` and ``notebooks/my_sampler.py``.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from asyncrl.samplers.base import KnobModel, SamplerBase

REQUIRED = "subclass asyncrl.samplers.SamplerBase (docs/samplers.md, 'Writing your own')"


def load_target(target: str) -> type[SamplerBase]:
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
    if not issubclass(cls, SamplerBase):
        raise ValueError(f"custom sampler target {target!r}: class {class_name} does not subclass SamplerBase; a "
                         f"custom sampler must {REQUIRED}")
    lacks = _subclass_lacks(cls)
    if lacks:
        raise ValueError(
            f"custom sampler {cls.__name__} ({target!r}) lacks {'; '.join(lacks)}: a SamplerBase subclass defines "
            "name, Knobs and _candidates (docs/samplers.md, 'Writing your own')"
        )
    overridden = [f"{member} (override the classmethod {instead} instead)"
                  for member, instead in (("is_on_policy", "trains_on_policy(knobs)"),
                                          ("required_buffer_capacity", "capacity_needed(knobs, groups_per_step)"))
                  if getattr(cls, member) is not getattr(SamplerBase, member)]
    if overridden:
        raise ValueError(
            f"custom sampler {cls.__name__} ({target!r}) overrides {'; '.join(overridden)}: the configuration asks "
            "the class and its knobs before any sampler is built"
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
    elif cls.window_knob is None and cls.gated:
        lacks.append("a `window_knob` (gated admission lets batch k go once k <= T + W; a policy without a window "
                     "sets gated = False)")
    elif cls.window_knob is not None and cls.window_knob not in knobs.model_fields:
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
    target: str = Field(description="the sampler class, 'package.module:Class' (a SamplerBase subclass); its "
                        "keyword arguments are the section's other keys")

    @field_validator("target")
    @classmethod
    def _importable(cls, target: str) -> str:
        load_target(target)
        return target

    @model_validator(mode="after")
    def _knobs_fit(self) -> CustomConfig:
        """Its kwargs are checked by its ``Knobs`` before a run (no sampler is built)."""
        self.knobs  # noqa: B018 (raises naming the kwargs it rejects)
        return self

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @property
    def sampler_class(self) -> type[SamplerBase]:
        return load_target(self.target)

    @property
    def knobs(self) -> KnobModel:
        """The class's ``Knobs`` with these kwargs: what its ``trains_on_policy`` and ``capacity_needed`` read."""
        return _rejecting(self, lambda: self.sampler_class.Knobs(**self.kwargs))


def build_custom(config: CustomConfig, buffer) -> SamplerBase:
    cls = load_target(config.target)
    return _rejecting(config, lambda: cls(buffer, **config.kwargs))


def _rejecting(config: CustomConfig, make):
    """``make()``, or one line naming the target and the kwargs it rejected."""
    try:
        return make()
    except ValidationError as exc:  # its Knobs model: one line per knob
        errors = "; ".join(e["msg"].removeprefix("Value error, ") if not e["loc"] else
                           f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
        raise ValueError(f"custom sampler {config.target!r} rejected kwargs {config.kwargs}: {errors}") from exc
    except Exception as exc:  # any error of its own __init__
        raise ValueError(f"custom sampler {config.target!r} rejected kwargs {config.kwargs}: "
                         f"{type(exc).__name__}: {exc}") from exc
