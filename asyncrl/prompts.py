"""Prompts as a run carries them, and the stream that serves them by data position.

Invariants:
- A ``Prompt`` is plain data: every field is a JSON value (``text``, ``answer``, ``id`` strings; ``messages`` a
  list of ``{"role", "content"}`` objects or None; ``columns`` an object of JSON values), so a checkpoint writes it
  with ``to_json`` and ``Prompt(**row)`` restores it equal, columns included. Nothing may subclass it
  to carry more: what a row has beyond its prompt goes in ``columns``.
- ``messages`` set means conversational (TRL's convention): the model sees ``messages`` rendered by the chat
  template, and ``text`` holds that rendering once a controller rendered it (``asyncrl.chat``), "" before. Its
  token ids are the template's own (no ``<bos>`` added again); a standard prompt's are ``tokenizer.encode(text)``.
- ``PromptStream`` position ``p`` is a pure function of ``(prompts, seed, p)``: resuming needs only the position.

Imports nothing of asyncrl (the bottom layer): the tasks, the dataset readers and the checkpoint all use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str  # what the model is given: a standard prompt, or a conversational one as its template rendered it
    answer: str = ""  # the reference answer a toy task grades by ("" when the task has none)
    id: str = ""  # unique within its task: "<split>/<row>", the row's 0-based index in its split ("train/17")
    messages: list[dict[str, Any]] | None = None  # conversational: the messages the chat template renders
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for the reward functions

    def __hash__(self) -> int:  # messages and columns are lists and dicts; the id and text identify a prompt
        return hash((self.id, self.text))

    def to_json(self) -> dict[str, Any]:
        """The prompt as a checkpoint writes it: ``messages`` and ``columns`` only when set, so a toy task's
        prompt is written as before they existed (``Prompt(**row)`` reads either)."""
        out: dict[str, Any] = {"text": self.text, "answer": self.answer, "id": self.id}
        if self.messages is not None:
            out["messages"] = self.messages
        if self.columns:
            out["columns"] = self.columns
        return out

    @property
    def split(self) -> str:
        """The split the prompt belongs to: the part of its id before the ``/`` ("train", "eval")."""
        return self.id.partition("/")[0]

    @property
    def row(self) -> int | None:
        """The row's 0-based index in its split (the part of its id after the ``/``), or None."""
        tail = self.id.rpartition("/")[2]
        return int(tail) if tail.isdigit() else None

    @property
    def conversational(self) -> bool:
        return self.messages is not None

    @property
    def prompt(self) -> str | list[dict[str, Any]]:
        """The prompt as TRL's reward functions get it (``prompts=``): the messages, or the standard text."""
        return self.messages if self.messages is not None else self.text


class PromptStream:
    """Training prompts by data position: position ``p`` is prompt ``order(p // n)[p % n]`` where each epoch's
    order is a permutation seeded by ``(seed, epoch)``. Random access, so resuming needs only the position.
    With ``max_epochs`` the stream ends after ``len(prompts) * max_epochs`` positions."""

    def __init__(self, prompts: Sequence[Prompt], seed: int, max_epochs: int | None = None, shuffle: bool = True):
        if not prompts:
            raise ValueError("PromptStream needs at least one prompt")
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1 or None, got {max_epochs}")
        self.prompts = list(prompts)
        self.seed = int(seed)
        self.max_epochs = max_epochs
        self.shuffle = shuffle
        self._orders: dict[int, np.ndarray] = {}

    @property
    def total(self) -> int | None:
        """Positions available (``None``: endless)."""
        return None if self.max_epochs is None else len(self.prompts) * self.max_epochs

    def exhausted(self, position: int) -> bool:
        """True when ``position`` is past the end (nothing more to serve)."""
        return self.total is not None and position >= self.total

    def remaining(self, position: int) -> int | None:
        return None if self.total is None else max(0, self.total - position)

    def epoch_order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            n = len(self.prompts)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            if len(self._orders) > 8:
                self._orders.clear()
            self._orders[epoch] = order
        return order

    def get(self, position: int) -> Prompt:
        """The prompt at ``position``; ``IndexError`` once the stream ran out (see ``exhausted``)."""
        if position < 0:
            raise IndexError(f"negative data position {position}")
        if self.exhausted(position):
            raise IndexError(f"prompt stream ran out at position {position} (total {self.total})")
        epoch, offset = divmod(position, len(self.prompts))
        return self.prompts[int(self.epoch_order(epoch)[offset])]

    def take(self, position: int, count: int) -> list[Prompt]:
        """Up to ``count`` prompts from ``position`` on (fewer at the end of the stream)."""
        if self.total is not None:
            count = min(count, max(0, self.total - position))
        return [self.get(position + i) for i in range(count)]
