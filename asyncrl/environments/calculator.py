"""The countdown tool task's environment: a TRL-style tool environment with one tool, ``calculate``.

``Calculator`` is written as a TRL user writes an ``environment_factory`` class: ``reset(self, **row)`` gets the
countdown row's columns (``nums``, ``target``) and returns a hint that extends the prompt; its one public method,
``calculate(expression: str) -> str``, is the tool (its schema from the type hints and the docstring). It has no
``get_reward``: the trajectory's reward is the countdown verifier's grade of the final ``<answer>`` in the
conversation (``reward.funcs: [countdown]``, what the ``gpu_countdown_tools`` preset names), since the environment
never sees the model's text, only its tool calls (TRL's convention).

Invariants of ``evaluate``:
- Never ``eval``: the expression is parsed (``ast``) and walked; only numbers (integers, decimals), ``+ - * /``,
  unary signs and parentheses are evaluated, exactly (fractions). Names, calls, attributes, powers, comparisons or
  anything else are refused.
- Bounded: at most ``MAX_CHARS`` characters, and every intermediate value's numerator and denominator below
  ``MAX_VALUE``, so no input costs more than a few microseconds of arithmetic.
- Every failure is an ``error: ...`` string for the model to read, never an exception the run dies of.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

MAX_CHARS = 200  # an expression longer than this is refused before it is parsed
MAX_VALUE = 10 ** 15  # a value (numerator or denominator) beyond this is refused
HINT = "Check an expression with the calculate tool before you answer."
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOLS = {ast.Pow: "**", ast.FloorDiv: "//", ast.Mod: "%", ast.MatMult: "@", ast.BitXor: "^", ast.LShift: "<<",
            ast.RShift: ">>", ast.BitOr: "|", ast.BitAnd: "&"}


class Refused(ValueError):
    """An expression the calculator does not evaluate (the message is what the model reads)."""


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(repr(node.value)) if type(node.value) is float else Fraction(node.value)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise Refused("division by zero")
        value = _OPERATORS[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        value = -value if isinstance(node.op, ast.USub) else value
    else:
        what = _SYMBOLS.get(type(getattr(node, "op", None)), type(node).__name__)
        raise Refused(f"only numbers, + - * / and parentheses are allowed (found {what})")
    if abs(value.numerator) >= MAX_VALUE or value.denominator >= MAX_VALUE:
        raise Refused(f"a value is too large (at most {MAX_VALUE:.0e})")
    return value


def evaluate(expression: object) -> str:
    """The value of an arithmetic expression as text (an integer, else a decimal of up to 10 significant digits),
    or ``error: ...`` saying why it was not evaluated (module invariants)."""
    if isinstance(expression, (int, float)) and not isinstance(expression, bool):
        expression = repr(expression)
    if not isinstance(expression, str):
        return f"error: the expression must be text, got {type(expression).__name__}"
    if len(expression) > MAX_CHARS:
        return f"error: the expression is longer than {MAX_CHARS} characters"
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except Refused as exc:
        return f"error: {exc}"
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # also the parser's nesting limit
        return "error: not an arithmetic expression"
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.10g}"


class Calculator:
    """The countdown tool environment (module docstring): ``reset`` takes the row's ``nums`` and ``target`` and
    returns ``HINT``; ``calculate`` is the tool. ``calls`` lists ``(expression, result)`` of every call of the
    trajectory (what a reward function reads through TRL's ``environments=`` keyword)."""

    def reset(self, nums: list | None = None, target: int | None = None, **row) -> str | None:
        self.nums, self.target = list(nums or []), target
        self.calls: list[tuple[str, str]] = []
        return HINT

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression of numbers with + - * / and parentheses.

        Args:
            expression: the expression to evaluate, for example "(25 - 5) * 3"

        Returns:
            The value, or an error saying why the expression was not evaluated.
        """
        result = evaluate(expression)
        self.calls.append((str(expression), result))
        return result


__all__ = ["Calculator", "HINT", "MAX_CHARS", "MAX_VALUE", "evaluate"]
