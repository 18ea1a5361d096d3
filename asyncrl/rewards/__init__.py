"""Reward functions: TRL's signature, the built-ins, and the runner that scores groups off the rollout pump.

A reward function is ``f(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]``,
called with keywords as TRL's GRPOTrainer calls it (so a TRL reward function runs unchanged); ``None`` means
"does not apply"; ``async def`` is allowed. The built-ins are plain functions of that signature:
``math_answer`` (math-verify against a ``solution`` or ``answer`` column), ``exact_match``, ``format_tags`` (the
``<think>``/``<answer>`` format) and ``countdown`` (TinyZero's verifier; columns ``nums`` and ``target``).

The parts, bottom up: ``builtin`` (the built-ins), ``functions`` (loading, checking, calling, combining:
``RewardFunctions``), ``worker`` (a worker process), ``runner`` (``RewardRunner``: inline or in worker processes,
a group at a time, every outcome reported), ``config`` (the ``reward:`` section). This package imports nothing
heavy: math-verify when ``math_answer`` first runs, cloudpickle when workers start.
"""

from asyncrl.rewards.builtin import BUILTINS, MissingColumn, completion_text, countdown, exact_match, format_tags, \
    math_answer
from asyncrl.rewards.config import RewardConfig, imported_functions
from asyncrl.rewards.functions import Problem, RewardBatch, RewardBug, RewardFunctions, TaskReward, function_name, \
    load_function
from asyncrl.rewards.runner import RewardRunner, Scored

__all__ = ["BUILTINS", "MissingColumn", "Problem", "RewardBatch", "RewardBug", "RewardConfig", "RewardFunctions",
           "RewardRunner", "Scored", "TaskReward", "completion_text", "countdown", "exact_match", "format_tags",
           "function_name", "imported_functions", "load_function", "math_answer"]
