"""Reward functions as a run holds them: loaded from names, checked, called the way TRL calls them, combined.

A reward function has TRL's GRPOTrainer signature and is called with keyword arguments only:
``f(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None]``, every list aligned
with the group's completions (a prompt's columns repeated once per completion). ``None`` means "does not apply";
``async def`` functions are awaited. The total reward of a completion is the weighted sum over the functions that
apply to it (TRL's ``nansum``; 0.0 when none does).

Invariants:
- Loading is the one place a name becomes a function (``load_function``): a bare name is a built-in
  (``asyncrl.rewards.builtin.BUILTINS``), ``package.module:function`` is imported; a failed import, a missing
  attribute or a signature that cannot take ``completions=`` is a ``ValueError`` of one line naming it.
- A function's name is its ``__name__`` (TRL's convention: the metric is ``reward/<name>``); two functions of one
  name are refused (their metrics would be one column).
- A result is checked in one place (``check_result``): not a list, the wrong length or a non-number is a
  ``RewardBug`` (a programming error: never retried, the run stops with its line); NaN or inf is a ``Problem``
  (a data fault: retried within ``faults.reward_retries``, like an exception).
- A built-in toy task's ``reward(prompt, completion_text)`` is wrapped (``TaskReward``), not changed: one call per
  completion in order, its float the total, bit for bit.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from asyncrl.faults import describe
from asyncrl.rewards.builtin import BUILTINS, MissingColumn
from asyncrl.rewards.models import RewardModel, is_reward_model

RESERVED = ("prompts", "completions", "completion_ids")  # what every call passes besides the columns
TRL_ARGUMENTS = (*RESERVED, "trainer_state", "log_extra", "log_metric", "environments")  # never columns (TRL passes them)
SIGNATURE = "f(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]"


class RewardBug(TypeError):
    """A reward function broke its contract (wrong length, a non-number, a missing column): not retried."""


class Problem(Exception):
    """A reward call failed in a way worth retrying (NaN/inf, an exception, a timeout, a dead worker)."""


@dataclass
class RewardBatch:
    """One group's inputs, as every function of the run is called with them (all lists aligned with the
    completions). ``source`` is the ``Prompt`` the group came from (a task's own reward takes it)."""

    prompts: list
    completions: list
    completion_ids: list[list[int]]
    columns: dict[str, list] = field(default_factory=dict)
    source: Any = None

    def kwargs(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "completions": self.completions, "completion_ids": self.completion_ids,
                **self.columns}


def function_name(func: Any) -> str:
    """TRL's name for a reward function: its ``__name__`` (a ``functools.partial``: its function's)."""
    name = getattr(func, "__name__", None) or getattr(getattr(func, "func", None), "__name__", None)
    return name if isinstance(name, str) else type(func).__name__


def spec_of(func: Any) -> str | dict:
    """How a config names ``func``: its built-in name, a reward model's ``{model: PATH, batch_size: N}``, else
    ``module:qualname``."""
    if is_reward_model(func):
        return RewardModel.from_spec(func).spec()
    name = function_name(func)
    if BUILTINS.get(name) is func:
        return name
    return f"{getattr(func, '__module__', '?')}:{getattr(func, '__qualname__', name)}"


def load_function(spec: Any) -> Callable:
    """A reward function from a config entry: a callable (checked), a built-in's bare name, or
    ``package.module:function`` (imported). Every failure is one ``ValueError`` line naming ``spec``."""
    if isinstance(spec, TaskReward):
        return spec
    if is_reward_model(spec):  # a model directory or object: a RewardModel (asyncrl/rewards/models.py)
        return RewardModel.from_spec(spec)
    if callable(spec) and not isinstance(spec, str):
        check_signature(spec, repr(function_name(spec)))
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward function {spec!r}: name a built-in ({sorted(BUILTINS)}), "
                         "'package.module:function' or a reward model {model: PATH}, or pass a function")
    if ":" not in spec:
        if spec not in BUILTINS:
            raise ValueError(f"unknown reward function {spec!r}: the built-ins are {sorted(BUILTINS)}; name your own "
                             "as 'package.module:function'")
        return BUILTINS[spec]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a module that raises while importing does not import either
        hint = "; is its folder on PYTHONPATH?" if isinstance(exc, ModuleNotFoundError) else ""
        raise ValueError(f"reward function {spec!r}: module {module_name!r} does not import "
                         f"({type(exc).__name__}: {exc}){hint}") from exc
    func: Any = module
    for part in attr.split("."):
        func = getattr(func, part, None)
    if func is None or not callable(func):
        found = "nothing" if func is None else f"a {type(func).__name__}"
        raise ValueError(f"reward function {spec!r}: module {module_name!r} has no function {attr!r} (found {found})")
    check_signature(func, repr(spec))
    return func


_SIGNATURES: dict[int, tuple[Callable, list[inspect.Parameter] | None]] = {}  # id -> (function, parameters)


def _parameters(func: Callable) -> list[inspect.Parameter] | None:
    """``func``'s parameters (None: it has no signature to read), read once per function: a call asks every time."""
    known = _SIGNATURES.get(id(func))
    if known is not None and known[0] is func:
        return known[1]
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # a C function without a signature: trusted as called
        params = None
    _SIGNATURES[id(func)] = (func, params)
    return params


def check_signature(func: Callable, label: str) -> None:
    """``func`` can be called as TRL calls a reward function, or a ``ValueError`` naming it and its signature."""
    params = _parameters(func)
    if params is None:
        return
    by_name = {p.name: p for p in params}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes = by_name.get("completions") is not None and by_name["completions"].kind in keyword
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if not (takes or var_kw) or positional_only:
        why = (f"its positional-only parameter(s) {positional_only} cannot be passed by keyword" if positional_only
               else "it takes no completions= keyword")
        raise ValueError(f"reward function {label} has the signature {function_name(func)}"
                         f"{inspect.signature(func)}: {why}; a reward function is called with keywords, as TRL calls "
                         f"it: {SIGNATURE}")


def needed_columns(func: Callable) -> tuple[tuple[str, ...], ...]:
    """The columns ``func`` cannot run without (for each tuple, one of them): its ``required_columns`` attribute
    when it has one (the built-ins do), else its parameters without a default that TRL would not pass itself."""
    declared = getattr(func, "required_columns", None)
    if declared is not None:
        return tuple((c,) if isinstance(c, str) else tuple(c) for c in declared)
    params = _parameters(func) or []
    return tuple((p.name,) for p in params if p.default is p.empty and p.name not in TRL_ARGUMENTS
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def accepted(func: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What of ``kwargs`` ``func`` takes: all of it with ``**kwargs``, else the names it declares (TRL passes every
    column, so a function without ``**kwargs`` would fail there on the first column it does not name)."""
    params = _parameters(func)
    if params is None or any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def _await(awaitable) -> Any:
    """The result of a coroutine, also from a thread whose event loop runs (a notebook's): then on a new loop in
    a helper thread."""
    async def wrap():
        return await awaitable
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wrap())
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wrap()).result()


class TaskReward:
    """A task's own ``reward(prompt, completion_text) -> float`` as a reward function over a group: called once
    per completion, in order, with the group's ``Prompt`` (the built-in toy tasks score exactly as before)."""

    def __init__(self, task: Any):
        self.task = task
        self.__name__ = str(getattr(task, "name", "reward"))  # the metric reward/<task name>

    def score(self, batch: RewardBatch) -> list:
        return [self.task.reward(batch.source, text) for text in batch.completions]


def call(func: Callable, name: str, batch: RewardBatch) -> list[float | None]:
    """Call one reward function on one group and check what it returned (``check_result``)."""
    if isinstance(func, TaskReward):
        return check_result(name, func.score(batch), len(batch.completions), task=True)
    out = func(**accepted(func, batch.kwargs()))
    if inspect.isawaitable(out):
        out = _await(out)
    return check_result(name, out, len(batch.completions))


def outcome(func: Callable, name: str, batch: RewardBatch) -> tuple[str, Any, float]:
    """One call as data that crosses a process boundary: ``("ok", values, seconds)``, ``("problem", why,
    seconds)`` (retried) or ``("bug", why, seconds)`` (the run stops). The same in a worker and in-process."""
    start = time.perf_counter()
    try:
        values = call(func, name, batch)
    except (RewardBug, MissingColumn) as exc:
        return "bug", str(exc), time.perf_counter() - start
    except Problem as exc:
        return "problem", str(exc), time.perf_counter() - start
    except Exception as exc:  # a fault of this call (the verifier, the data): retried within the budget
        why = describe(exc) if isinstance(func, TaskReward) else f"reward function {name!r} raised {describe(exc)}"
        return "problem", why, time.perf_counter() - start
    return "ok", values, time.perf_counter() - start


def check_result(name: str, out: Any, n: int, task: bool = False) -> list[float | None]:
    """``out`` as a list of ``n`` floats or None; ``RewardBug`` for a non-list, a wrong length or a non-number
    (None too, from a task's reward), ``Problem`` for NaN or inf."""
    who = "the task's reward" if task else f"reward function {name!r}"
    if isinstance(out, (str, bytes, dict)) or not isinstance(out, Sequence) and not hasattr(out, "tolist"):
        raise RewardBug(f"{who} returned {_short(out)} ({type(out).__name__}); it must return a list of {n} rewards, "
                        "one per completion (float, or None where it does not apply)")
    values = out.tolist() if hasattr(out, "tolist") else list(out)
    if len(values) != n:
        raise RewardBug(f"{who} returned {len(values)} rewards for {n} completions; it must return one per "
                        "completion (float, or None where it does not apply)")
    result: list[float | None] = []
    for i, value in enumerate(values):
        if value is None and not task:
            result.append(None)
            continue
        if not isinstance(value, numbers.Real):
            allowed = "(int or float, finite)" if task else "or None (int or float, finite)"
            raise RewardBug(f"{who} returned {_short(value)} ({type(value).__name__}) for completion {i}; a reward "
                            f"must be a real number {allowed}")
        if not math.isfinite(value):
            raise Problem(f"non-finite reward {value!r}" if task else
                          f"reward function {name!r} returned {value!r} for completion {i} (non-finite)")
        result.append(float(value))
    return result


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class RewardFunctions:
    """The run's reward functions, their names and weights: ``combine`` turns their results into totals."""

    def __init__(self, funcs: Sequence[Any], weights: Sequence[float] | None = None):
        if not funcs:
            raise ValueError("reward functions: none given (name at least one, or use the task's own reward)")
        self.funcs = [load_function(f) for f in funcs]
        self.names = [function_name(f) for f in self.funcs]
        twice = sorted({n for n in self.names if self.names.count(n) > 1})
        if twice:
            raise ValueError(f"reward functions named twice: {twice}; each function's metric is reward/<__name__>, "
                             "so names must differ (give one a different __name__)")
        self.weights = [1.0] * len(self.funcs) if weights is None else self.check_weights(weights, self.names)

    @staticmethod
    def check_weights(weights: Sequence[float], names: Sequence[str] | None) -> list[float]:
        """``weights`` as floats: finite numbers, one per function of ``names`` (None: the functions are not known
        yet, only the numbers are checked); else one ``ValueError`` line naming both counts or the bad values."""
        if names is not None and len(weights) != len(names):
            raise ValueError(f"reward.weights has {len(weights)} values for {len(names)} functions "
                             f"{list(names)}: give one weight per function (or none: 1 each)")
        bad = [w for w in weights if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w)]
        if bad:
            raise ValueError(f"reward.weights {list(weights)}: each weight must be a finite number, got {bad}")
        return [float(w) for w in weights]

    @classmethod
    def of_task(cls, task: Any) -> RewardFunctions:
        """A task's own ``reward`` as the run's one function (weight 1)."""
        return cls([TaskReward(task)])

    @property
    def is_task(self) -> bool:
        return len(self.funcs) == 1 and isinstance(self.funcs[0], TaskReward)

    def check_columns(self, columns: Sequence[str], where: str = "the data") -> None:
        """Every column a function needs is among ``columns``, or one ``ValueError`` naming function and column."""
        have = set(columns)
        for func, name in zip(self.funcs, self.names):
            if isinstance(func, TaskReward):
                continue
            for options in needed_columns(func):
                if not have & set(options):
                    wanted = " or ".join(repr(o) for o in options)
                    raise ValueError(f"reward function {name!r} needs a {wanted} column, and {where} has none "
                                     f"(its columns: {sorted(have)})")

    def combine(self, results: Sequence[list[float | None]]) -> list[float]:
        """Each completion's total: the weighted sum over the functions that apply (None skipped; 0.0 when none
        does). One function of weight 1: its values as they are (a task's reward, bit for bit)."""
        if len(results) == 1 and self.weights == [1.0]:
            return [0.0 if r is None else r for r in results[0]]
        totals = []
        for values in zip(*results):
            total = 0.0
            for w, r in zip(self.weights, values):
                if r is not None:
                    total += w * r
            totals.append(total)
        return totals

    def parts(self, results: Sequence[list[float | None]]) -> dict[str, list[float | None]]:
        """Each function's values by name (``reward/<name>`` in the completions log and the metrics)."""
        return {name: list(values) for name, values in zip(self.names, results)}


__all__ = ["MissingColumn", "Problem", "RewardBatch", "RewardBug", "RewardFunctions", "TaskReward", "call",
           "check_result", "check_signature", "function_name", "load_function", "needed_columns", "outcome",
           "spec_of"]
