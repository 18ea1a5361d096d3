"""Reward functions for ``examples/word_problems.jsonl``, written as for TRL's GRPOTrainer: each takes the
completions (strings for standard prompts, ``[{"role": "assistant", "content": ...}]`` for conversational ones)
and the dataset's columns as keyword arguments, and returns one float (or None: does not apply) per completion.
They run unchanged under TRL and under asyncrl (``reward: {funcs: ["examples.rewards:correct_answer", ...]}``).
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+")


def _text(completion) -> str:
    """The completion's text, standard or conversational."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """1 when the first number in the completion is the answer, else 0."""
    out = []
    for completion, expected in zip(completions, answer):
        found = NUMBER.search(_text(completion))
        out.append(1.0 if found is not None and found.group() == str(expected) else 0.0)
    return out


def starts_with_a_number(completions, **kwargs) -> list[float]:
    """A small format reward: 1 when the completion opens with a number (after spaces), else 0."""
    return [1.0 if re.match(r"\s*-?\d", _text(c)) else 0.0 for c in completions]
