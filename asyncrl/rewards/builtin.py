"""The built-in reward functions, named in ``reward.funcs`` by their bare names (``BUILTINS``).

Each is a plain function with TRL's GRPOTrainer signature, ``f(prompts=..., completions=..., completion_ids=...,
**columns) -> list[float | None]``, so it runs under TRL unchanged and a TRL function runs here unchanged.

Invariants:
- A completion is either standard (a ``str``) or conversational (a list of messages,
  ``[{"role": "assistant", "content": ...}]``, as TRL builds it for a conversational dataset); every built-in reads
  both through ``completion_text``.
- A built-in that needs a column the data lacks raises ``MissingColumn`` naming the function and the column (and
  the columns there are): a bug in the setup, never retried. Its ``required_columns`` attribute says which
  columns it reads, so a controller can check them against its data before the run starts.
- Pure functions of their arguments: no state, no randomness; the same inputs give the same rewards in any
  process. ``math_answer`` imports ``math-verify`` on first use (half a second), and bounds its own parsing time
  only in a main thread (``signal.alarm``, as TRL does): a worker process calls it in its main thread.
"""

from __future__ import annotations

import ast
import operator
import re
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import Any


class MissingColumn(ValueError):
    """A reward function needs a data column the prompts do not carry: a bug in the setup, not retried."""


def completion_text(completion: Any) -> str:
    """The text of one completion: the string itself, or the content of a conversational completion's messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, Sequence):
        return "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in completion)
    raise TypeError(f"a completion is a str or a list of messages, got {type(completion).__name__}")


def gold_column(function: str, columns: dict[str, Any], names: tuple[str, ...]) -> list:
    """The first of ``names`` the data carries (a list aligned with the completions), or ``MissingColumn``."""
    for name in names:
        if columns.get(name) is not None:
            return list(columns[name])
    wanted = " or ".join(repr(n) for n in names)
    there = sorted(k for k in columns if columns[k] is not None)
    raise MissingColumn(f"reward function {function!r} needs a {wanted} column, and the data has none "
                        f"(its columns: {there})")


def _aligned(function: str, column: str, values: list, completions: list) -> list:
    if len(values) != len(completions):
        raise MissingColumn(f"reward function {function!r}: column {column!r} has {len(values)} values for "
                            f"{len(completions)} completions (a column is a list aligned with the completions)")
    return values


# ------------------------------------------------------------------------------------------------ math_answer
def math_answer(prompts=None, completions=(), completion_ids=None, solution=None, answer=None,
                **columns) -> list[float | None]:
    """1.0 when ``math-verify`` finds the completion's answer equal to the gold one (the ``solution`` column, or
    ``answer``), else 0.0; ``None`` (does not apply) when the gold answer itself does not parse, as TRL's
    ``accuracy_reward`` does. The gold is parsed as LaTeX or a plain expression ("72", "\\frac{1}{3}"); the
    completion's answer is its first ``\\boxed{}``, else LaTeX or a plain expression (math-verify's defaults, with
    units normalised)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = gold_column("math_answer", {"solution": solution, "answer": answer, **columns}, ("solution", "answer"))
    completions = list(completions)
    gold = _aligned("math_answer", "solution" if solution is not None else "answer", gold, completions)
    main = threading.current_thread() is threading.main_thread()  # signal.alarm works only there
    parse_s, verify_s = (10, 5) if main else (None, None)
    predicted = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0),
                 ExprExtractionConfig()]
    out: list[float | None] = []
    for completion, truth in zip(completions, gold):
        gold_parsed = parse(str(truth), parsing_timeout=parse_s)
        if not gold_parsed:
            out.append(None)
            continue
        answer_parsed = parse(completion_text(completion), extraction_config=predicted,
                              extraction_mode="first_match", parsing_timeout=parse_s)
        out.append(float(verify(gold_parsed, answer_parsed, timeout_seconds=verify_s)))
    return out


# ------------------------------------------------------------------------------------------------ exact_match
ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def tagged_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` in ``text`` (stripped), or None."""
    found = ANSWER_TAGS.findall(text)
    return found[-1].strip() if found else None


def exact_match(prompts=None, completions=(), completion_ids=None, solution=None, answer=None,
                **columns) -> list[float]:
    """1.0 when the completion's answer, stripped, equals the gold (``solution`` or ``answer`` column, stripped),
    else 0.0. The completion's answer is the inside of its last ``<answer>...</answer>`` when it has one, else
    the whole completion."""
    gold = gold_column("exact_match", {"solution": solution, "answer": answer, **columns}, ("solution", "answer"))
    completions = list(completions)
    gold = _aligned("exact_match", "solution" if solution is not None else "answer", gold, completions)
    out = []
    for completion, truth in zip(completions, gold):
        text = completion_text(completion)
        said = tagged_answer(text)
        out.append(1.0 if (text.strip() if said is None else said) == str(truth).strip() else 0.0)
    return out


# ------------------------------------------------------------------------------------------------ format_tags
FORMAT_TAGS = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def format_tags(prompts=None, completions=(), completion_ids=None, **columns) -> list[float]:
    """1.0 when the completion is ``<think>...</think>`` then ``<answer>...</answer>`` and nothing else (the
    DeepSeek-R1 / TinyZero format; whitespace around the tags allowed), else 0.0. For another format, write a
    two-line function with your own regex (docs/tasks.md)."""
    return [1.0 if FORMAT_TAGS.match(completion_text(c)) else 0.0 for c in completions]


# ------------------------------------------------------------------------------------------------ countdown
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """An arithmetic expression of integers with + - * / (and unary signs), exactly; anything else is a
    ValueError (no names, no calls, no powers: nothing ``eval`` could be made to do)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        return _OPERATORS[type(node.op)](left, right)  # ZeroDivisionError: not an equation that reaches anything
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, used)
        return value if isinstance(node.op, ast.UAdd) else -value
    raise ValueError(f"not allowed in an equation: {type(node).__name__}")


def countdown_score(text: str, nums: Sequence[int], target: float) -> float:
    """TinyZero's countdown verifier (``format_score`` 0): 1.0 when the last ``<answer>...</answer>`` of ``text``
    holds an equation that uses each number of ``nums`` exactly once, only ``+ - * /`` and parentheses, and
    equals ``target``; else 0.0. As in TinyZero, the answer is the expression alone (``(3+5)*2``; a trailing
    ``= 16`` is not an equation it accepts)."""
    equation = tagged_answer(text)
    if equation is None or not re.fullmatch(r"[\d+\-*/().\s]+", equation):
        return 0.0
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(equation, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    if sorted(used) != sorted(int(n) for n in nums):
        return 0.0
    return 1.0 if abs(value - Fraction(target)) < 1e-5 else 0.0


def countdown(prompts=None, completions=(), completion_ids=None, nums=None, target=None,
              **columns) -> list[float]:
    """The countdown task's reward (columns ``nums``, the numbers, and ``target``): ``countdown_score`` of each
    completion."""
    completions = list(completions)
    data = {"nums": nums, "target": target, **columns}
    nums = _aligned("countdown", "nums", gold_column("countdown", data, ("nums",)), completions)
    target = _aligned("countdown", "target", gold_column("countdown", data, ("target",)), completions)
    return [countdown_score(completion_text(c), n, t) for c, n, t in zip(completions, nums, target)]


BUILTINS = {f.__name__: f for f in (math_answer, exact_match, format_tags, countdown)}
# The columns each built-in reads (one of each tuple must be present), checked against the data before a run
# starts. Any reward function may declare its own the same way (``f.required_columns = [("solution", "answer")]``).
math_answer.required_columns = exact_match.required_columns = [("solution", "answer")]
format_tags.required_columns = []
countdown.required_columns = [("nums",), ("target",)]
