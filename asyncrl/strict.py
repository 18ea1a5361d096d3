"""Strict input, shared by the configuration, the samplers and the buffer: a typo is an error, never a default.

Invariants:
- ``StrictModel``: an unknown key is a ``ValueError`` that names the key and the allowed ones (pydantic's own
  "extra inputs are not permitted" names neither). Subclasses word it for what they are (``_unknown_keys``).
- ``check_int``: a plain int at or above a minimum; numpy integers are welcome, bools are not numbers here.
- Imports nothing from asyncrl and nothing heavy: ``asyncrl.samplers`` (importable without torch) stands on it.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

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
