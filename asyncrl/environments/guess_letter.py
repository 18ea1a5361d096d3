"""The built-in text environment task ``guess_letter``: the environment holds a secret letter of a small
alphabet; the model answers one letter a turn; the environment says ``higher``, ``lower`` or ``correct``; the
reward is 1 if the letter was found within ``max_turns`` model turns.

The bar: the best feedback-blind strategy (the same guesses whatever the replies) finds at most ``min(M, A)`` of
``A`` uniformly drawn secrets in ``M`` turns, so ``constant_answer_accuracy = min(M, A) / A``; an adaptive strategy
(binary search) finds ``min(2**M - 1, A)`` of them. The preset (A=8, M=3): 3/8 blind, 7/8 adaptive.
"""

from __future__ import annotations

import random

from asyncrl.prompts import Prompt

PROMPT = "guess:"


class GuessLetter:
    """The text environment (``reset(secret=..., alphabet=...)``, ``step(action)``)."""

    def reset(self, secret: str = "a", alphabet: str = "abcdefgh", **row) -> None:
        self.secret, self.alphabet = secret, alphabet
        return None

    def step(self, action: str) -> tuple[str | None, float, bool]:
        guess = action.strip()[:1]
        if guess == self.secret:
            return " correct", 1.0, True
        if not guess or guess not in self.alphabet:  # ("" is in every string)
            return " invalid ", 0.0, False
        word = "higher" if self.alphabet.index(self.secret) > self.alphabet.index(guess) else "lower"
        return f" {word} ", 0.0, False


class GuessLetterTask:
    """Prompts (the secret in the row's columns, never in the text), the held-out evaluation episodes (every
    letter once, under evaluation ids), a transcript's grade, and the blind bar."""

    name = "guess_letter"

    def __init__(self, alphabet: str = "abcdefgh", max_turns: int = 3, train_size: int = 512, seed: int = 0):
        if len(set(alphabet)) != len(alphabet) or len(alphabet) < 2:
            raise ValueError(f"alphabet {alphabet!r}: at least 2 distinct letters")
        self.alphabet, self.max_turns = alphabet, max_turns
        rng = random.Random(seed)
        self.train_prompts = [self._prompt("train", i, rng.choice(alphabet)) for i in range(train_size)]
        self.eval_prompts = [self._prompt("eval", i, c) for i, c in enumerate(alphabet)]
        self.held_out = True  # evaluation episodes are never trained on (each secret once, uniform)

    def _prompt(self, split: str, i: int, secret: str) -> Prompt:
        return Prompt(PROMPT, secret, f"{split}/{i}", columns={"secret": secret, "alphabet": self.alphabet})

    @property
    def constant_answer_accuracy(self) -> float:
        """The best feedback-blind strategy's success rate on uniform secrets: ``min(max_turns, A) / A``."""
        return min(self.max_turns, len(self.alphabet)) / len(self.alphabet)

    def is_correct(self, prompt: Prompt, completion_text: str) -> bool:
        """A transcript (the whole conversation after the prompt) that reached ``correct``."""
        return "correct" in completion_text

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return float(self.is_correct(prompt, completion_text))

    def __repr__(self) -> str:
        return f"GuessLetterTask(alphabet={self.alphabet!r}, max_turns={self.max_turns})"
