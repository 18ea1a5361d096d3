"""Environment classes the environment tests run in worker processes (kept light: a worker imports this module
to load them)."""

from __future__ import annotations

import os
import time

from asyncrl.environments.guess_letter import GuessLetter


class Faulty(GuessLetter):
    """A text environment that raises, hangs past its timeout or dies (``GUESS_FAULT``) on the secret
    ``GUESS_SECRET``; a slow one (``GUESS_SLEEP`` seconds a step) otherwise."""

    def step(self, action):
        if self.secret == os.environ.get("GUESS_SECRET"):
            mode = os.environ["GUESS_FAULT"]
            if mode == "raise":
                raise RuntimeError("broken environment")
            if mode == "hang":
                time.sleep(30)
            if mode == "die":
                os._exit(3)
        time.sleep(float(os.environ.get("GUESS_SLEEP", "0")))
        return super().step(action)


class Calculator:
    """A TRL-style tool environment: public methods are tools, get_reward the trajectory's reward."""

    def reset(self, **row):
        self.used = 0
        return None

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        self.used += 1
        return str(a + b)

    def get_reward(self) -> float:
        return float(self.used)


class Increment:
    """TRL's demo environment as written for TRL: ``reset(self)`` takes no row; a tool returns an int."""

    def __init__(self):
        self._counter = 0

    def reset(self) -> None:
        self._counter = 0

    def increment(self, a: int) -> int:
        """
        Increment the integer by a specified value

        Args:
            a: The value to increment by

        Returns:
            The incremented integer.
        """
        self._counter += a
        return self._counter


class Echo:
    """A TRL environment whose tool is named ``step`` (returns ``str``, as TRL's echo example)."""

    def reset(self, **kwargs) -> None:
        self.said = []

    def step(self, message: str) -> str:
        """
        Echo the message back from the environment.

        Args:
            message: The message to echo

        Returns:
            The echoed message.
        """
        self.said.append(message)
        return message

    def get_reward(self) -> float:
        return float(len(self.said))


class Guarded(Calculator):
    """A Calculator whose non-tools show in its reward when a model's tool call ran them: ``reset`` (a second time),
    ``get_reward``, a private method or ``__init__``."""

    def reset(self, **row):
        self.resets, self.rewarded, self.poked = getattr(self, "resets", 0) + 1, 0, 0
        return super().reset(**row)

    def __init__(self):
        self.inits = getattr(self, "inits", 0) + 1

    def _poke(self) -> str:
        self.poked = 1
        return "poked"

    def get_reward(self) -> float:
        self.rewarded += 1
        return float(self.used) + 100.0 * (self.resets - 1) + 1000.0 * self.poked + 10.0 * (self.inits - 1) \
            + 10000.0 * (self.rewarded - 1)


class HintedCalculator(Calculator):
    """A Calculator whose ``reset`` returns a hint (appended to the prompt's last message)."""

    HINT = "hint: add two numbers with the tool"

    def reset(self, **row):
        super().reset(**row)
        return self.HINT
