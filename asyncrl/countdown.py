"""Countdown (TinyZero's task): reach a target number with the given numbers, each used once, ``+ - * /``.

Rows are generated from a seed (``countdown_rows``), each with the columns ``nums`` (the numbers, in the order the
prompt lists them) and ``target``, and a conversational ``prompt``: TinyZero's system and user messages, which ask
for the reasoning in ``<think> </think>`` and the equation in ``<answer> </answer>`` tags. Its verifier is
``asyncrl.rewards.countdown`` (1 for a correct equation in the answer tags, else 0).

Invariants:
- Every row is solvable: its target is what folding its numbers with random operations gives, keeping every
  intermediate a positive integer (a division only where it is exact), and the target within ``1..max_target``.
- No two rows share their numbers (as a multiset) and target, so the evaluation rows are held out.
- The rows are a pure function of the options (``seed`` included), not of the run's seed.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from asyncrl.datasets import DatasetTask, Table, table_prompts
from asyncrl.prompts import Prompt
from asyncrl.rewards.builtin import completion_text, countdown, countdown_score

SYSTEM_PROMPT = ("You are a helpful assistant. You first think about the reasoning process in the mind and then "
                 "provide the user with the answer.")
USER_PROMPT = ("Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
               "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
               "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 "
               "</answer>.")
MAX_INTERMEDIATE = 10_000  # a product beyond this is not tried: the targets stay small and the rows varied


def _fold(nums: list[int], rng: np.random.Generator) -> tuple[int, str]:
    """A random order and random operations over all of ``nums``: (value, equation)."""
    order = rng.permutation(len(nums))
    value, equation = nums[order[0]], str(nums[order[0]])
    for x in (nums[i] for i in order[1:]):
        ops = ["+", "*"] if value * x <= MAX_INTERMEDIATE else ["+"]
        if value != x:
            ops.append("-")
        if value % x == 0 and x > 1:
            ops.append("/")
        elif x % value == 0 and value > 1:
            ops.append("\\")  # x / value
        op = ops[int(rng.integers(len(ops)))]
        if op == "+":
            value, equation = value + x, f"({equation} + {x})"
        elif op == "*":
            value, equation = value * x, f"({equation} * {x})"
        elif op == "-":
            value, equation = (value - x, f"({equation} - {x})") if value > x else (x - value, f"({x} - {equation})")
        elif op == "/":
            value, equation = value // x, f"({equation} / {x})"
        else:
            value, equation = x // value, f"({x} / {equation})"
    return value, equation[1:-1] if equation.startswith("(") else equation


def countdown_rows(n: int, seed: int = 0, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 99,
                   max_target: int = 100) -> list[dict]:
    """``n`` distinct solvable rows ``{"nums", "target", "solution"}`` (``solution``: one equation that works)."""
    rng = np.random.default_rng(seed)
    rows, seen = [], set()
    for _ in range(200 * n + 1000):
        if len(rows) == n:
            return rows
        k = int(rng.integers(min_numbers, max_numbers + 1))
        nums = rng.integers(1, max_number + 1, size=k).tolist()
        value, equation = _fold(nums, rng)
        key = (tuple(sorted(nums)), value)
        if 1 <= value <= max_target and key not in seen:
            seen.add(key)
            rows.append({"nums": nums, "target": value, "solution": equation})
    raise ValueError(f"countdown: found only {len(rows)} distinct rows of {n} with numbers 1..{max_number} and "
                     f"targets 1..{max_target}; ask for fewer rows or widen the ranges")


class CountdownTask(DatasetTask):
    """Countdown's rows as a dataset task, scored by its verifier (``asyncrl.rewards.countdown``'s) unless the
    run names reward functions of its own."""

    reward_funcs = [countdown]  # the run's reward functions when the config names none: reward/countdown

    def reward(self, prompt: Prompt, completion: str | list) -> float:
        return countdown_score(completion_text(completion), prompt.columns["nums"], prompt.columns["target"])

    def is_correct(self, prompt: Prompt, completion: str | list) -> bool:
        return self.reward(prompt, completion) == 1.0

    @property
    def constant_answer_accuracy(self) -> float:
        """One equation uses one multiset of numbers, and no two evaluation rows share theirs and their target:
        a constant answer solves at most one row."""
        return 1.0 / len(self.eval_prompts)


def countdown_task(train_size: int = 2000, eval_size: int = 200, seed: int = 0, min_numbers: int = 3,
                   max_numbers: int = 4, max_number: int = 99, max_target: int = 100,
                   system_prompt: str | None = SYSTEM_PROMPT) -> DatasetTask:
    """The ``countdown`` task: ``train_size`` training rows and ``eval_size`` held-out ones, from ``seed``."""
    for knob, value, low in (("train_size", train_size, 1), ("eval_size", eval_size, 1), ("min_numbers", min_numbers, 2),
                             ("max_number", max_number, 2), ("max_target", max_target, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{knob} must be an integer >= {low}, got {value!r}")
    if not isinstance(max_numbers, int) or not min_numbers <= max_numbers <= 6:
        raise ValueError(f"max_numbers must be an integer in min_numbers..6 ({min_numbers}..6), got {max_numbers!r}")
    rows = countdown_rows(train_size + eval_size, seed, min_numbers, max_numbers, max_number, max_target)
    for row in rows:
        row["prompt"] = [{"role": "user", "content": USER_PROMPT.format(nums=row["nums"], target=row["target"])}]
        del row["solution"]  # the columns are the task's: nums and target (a reference equation would be a hint)
    name = f"countdown(seed={seed})"
    digest = hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()
    table = Table(name, rows, "sha256:" + digest)
    train = table_prompts(table, "train", system_prompt=system_prompt, rows=range(train_size))
    held = table_prompts(table, "eval", system_prompt=system_prompt, rows=range(train_size, len(rows)))
    return CountdownTask(train, held, {"train": name, "eval": name}, {"train": table.fingerprint, "eval": table.fingerprint},
                       {"eval": list(range(train_size, len(rows)))}, name="countdown")
