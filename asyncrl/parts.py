"""The controller's parts are fixed at construction.

``Controller`` builds its pumps holding the parts it was given (``policy``, ``generator``, ``task``, ``sampler``,
``buffer``), so a part assigned afterwards would be silently ignored: a wrapped generator would measure nothing, a new
sampler would decide nothing. ``FixedParts`` makes the attribute assignable once (in ``__init__``) and turns a later
assignment or deletion into an ``AttributeError`` of one line saying what to do instead.
"""

from __future__ import annotations

from typing import Any

PARTS = ("policy", "generator", "task", "sampler", "buffer")


class FixedParts:
    """A base for ``Controller``: each name in ``PARTS`` is set once, by its ``__init__``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in PARTS and name in self.__dict__:
            raise AttributeError(fixed_part(name))
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in PARTS:
            raise AttributeError(fixed_part(name))
        super().__delattr__(name)


def fixed_part(name: str) -> str:
    return (f"Controller.{name} is fixed at construction (its pumps hold the {name} they were built with); to use "
            f"another {name}, build a new Controller(cfg, task, policy, generator, tokenizer) with it")
