"""Strict input, shared by the configuration, the samplers and the buffer: a typo is an error, never a default.

Invariants:
- ``StrictModel``: an unknown key is a ``ValueError`` that names the key and the allowed ones (pydantic's own
  "extra inputs are not permitted" names neither). Subclasses word it for what they are (``_unknown_keys``).
- ``check_int``: a plain int at or above a minimum; numpy integers are welcome, bools are not numbers here.
- ``booleans_for_numbers``: the keys of a model's input that give a bool to a field taking no bool (pydantic's lax
  mode would read YAML's ``true`` as 1); the configuration refuses them.
- Imports nothing from asyncrl and nothing heavy: ``asyncrl.samplers`` (importable without torch) stands on it.
"""

from __future__ import annotations

import numbers
import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    """A pydantic model whose unknown keys are one error listing the allowed ones."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and cls.model_config.get("extra") == "forbid":
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                raise ValueError(cls._unknown_keys(unknown, data))
        return data

    @classmethod
    def _unknown_keys(cls, unknown: list[str], data: Mapping) -> str:
        """The error's wording: what was given, and every key this model allows."""
        given = ", ".join(f"{key}={data[key]!r}" for key in unknown)
        return f"unknown key(s) {given} for {cls.__name__}; allowed: {list(cls.model_fields)}"


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as a plain int >= ``minimum`` (numpy integers welcome, bools refused), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def booleans_for_numbers(model: type[BaseModel], data: Any, where: str = "") -> list[str]:
    """``key = True`` for every key of ``data`` (``model``'s input, nested sections followed) whose field takes no
    bool: ``--set groups_per_step=true`` is a mistake, not 1. A tagged union's section is read as the variant whose
    fields hold all its keys (the first such)."""
    if not isinstance(data, Mapping):
        return []
    found = []
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue  # an unknown key is the model's own error
        if isinstance(value, bool):
            if not _takes_bool(field.annotation):
                found.append(f"{where}{key} = {value!r}")
            continue
        items = [(f"{where}{key}.", value)] if isinstance(value, Mapping) else \
            [(f"{where}{key}[{i}].", item) for i, item in enumerate(value)] if isinstance(value, (list, tuple)) else []
        for at, item in items:
            fits = [m for m in _models(field.annotation)
                    if isinstance(item, Mapping) and set(item) <= set(m.model_fields)]
            if fits:
                found += booleans_for_numbers(fits[0], item, at)
    return found


def _leaves(annotation: Any) -> list[Any]:
    origin = get_origin(annotation)
    if origin is Annotated:
        return _leaves(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [leaf for arg in get_args(annotation) for leaf in _leaves(arg)]
    return [annotation]


def _takes_bool(annotation: Any) -> bool:
    return any(leaf in (bool, Any, object)
               or (get_origin(leaf) is Literal and any(isinstance(v, bool) for v in get_args(leaf)))
               for leaf in _leaves(annotation))


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's value may be: the field's own, or its list's elements'."""
    out = []
    for leaf in _leaves(annotation):
        if get_origin(leaf) in (list, tuple):
            out += [m for arg in get_args(leaf) for m in _models(arg)]
        elif isinstance(leaf, type) and issubclass(leaf, BaseModel):
            out.append(leaf)
    return out
