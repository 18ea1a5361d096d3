"""The ``reward:`` section of a run's configuration: which reward functions, their weights, where they run.

Invariants:
- Checked when the config loads: every function named is imported (or found among the built-ins) and its
  signature checked, the weights match the functions, the names differ; a mistake is one line naming it, before
  anything is built or written.
- Written back as data: a function object given in Python is stored as ``module:qualname`` (its built-in name
  for a built-in), so ``config.yaml`` names what ran. ``imported_functions`` lists what restoring a config
  would import (a restore imports nothing its caller did not name: ``asyncrl/checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field, field_serializer, model_validator

from asyncrl.rewards.builtin import BUILTINS
from asyncrl.rewards.functions import RewardFunctions, spec_of
from asyncrl.strict import StrictModel


class RewardConfig(StrictModel):
    """``reward:`` — the run's reward functions (TRL's signature; docs/tasks.md) and how they are run."""

    funcs: list[str | dict[str, Any] | Callable[..., Any] | Any] = Field(
        default_factory=list, description="reward functions: a built-in's name (math_answer, exact_match, "
        "format_tags, countdown), 'package.module:function', a reward model {model: PATH, batch_size: 32} (a "
        "sequence-classification model directory with one label), or in Python a function or a transformers model "
        "(alone or as (model, tokenizer)); empty: the task's own reward")
    weights: list[float] | None = Field(
        None, description="one weight per function (None: 1 each); a completion's reward is the weighted sum over "
        "the functions that apply to it (a function returns None where it does not)")
    workers: int = Field(
        0, ge=0, description="workers that score groups off the rollout pump's thread, a group at a time (0: "
        "inline, on the pump's thread): local processes, or Ray actors when the run uses Ray (an engine with "
        "placement 'ray')")
    ray_options: dict[str, Any] = Field(
        default_factory=dict, description="options of each reward worker's Ray actor when the run uses Ray "
        "(num_cpus, resources, runtime_env, ...); none: Ray's default, no CPU held")
    timeout_s: float | None = Field(
        60.0, gt=0, description="seconds one function may take on one group; a call past it is a fault, retried "
        "within faults.reward_retries (None: no limit)")
    accuracy: str | None = Field(
        None, description="the reward function (its name) whose value is an evaluation's accuracy (None: the "
        "total reward at its maximum)")

    @model_validator(mode="after")
    def _loads(self) -> RewardConfig:
        if not self.funcs:  # weights (and accuracy) may name functions given as objects: checked with them
            if self.weights is not None:
                RewardFunctions.check_weights(self.weights, None)
            return self
        functions = RewardFunctions(self.funcs, self.weights)  # imports, signatures, weights, names
        if self.accuracy is not None and self.accuracy not in functions.names:
            raise ValueError(f"reward.accuracy {self.accuracy!r} is not one of the reward functions "
                             f"{functions.names}")
        return self

    @field_serializer("funcs")
    def _named(self, funcs: list) -> list[str | dict]:
        return [f if isinstance(f, str) else spec_of(f) for f in funcs]

    def with_funcs(self, funcs: list, weights: list[float] | None = None) -> RewardConfig:
        """This section with ``funcs`` (objects a caller passed: ``Controller.from_config(cfg, reward_funcs=...)``)
        and, when given, ``weights`` (``reward_weights=``, TRL's name) in place of ``reward.weights``."""
        if self.funcs and funcs:
            raise ValueError(f"reward functions given twice: reward_funcs= and reward.funcs={self._named(self.funcs)}; "
                             "name them in one place")
        if weights is not None and self.weights is not None and list(weights) != list(self.weights):
            raise ValueError(f"reward weights given twice: reward_weights={list(weights)} and reward.weights="
                             f"{self.weights}; give them in one place")
        return RewardConfig.model_validate({**self.model_dump(), "funcs": list(funcs or self.funcs),
                                            "weights": self.weights if weights is None else list(weights)})

    def check_unused(self) -> None:
        """No reward function is named or given (the task's own reward scores): weights or an accuracy function
        would name functions that do not exist, so they are one line here."""
        if self.weights is not None:
            raise ValueError(f"reward.weights {self.weights} has {len(self.weights)} values for 0 reward functions: "
                             "name the functions (reward.funcs, or reward_funcs= in Python), one weight each")
        if self.accuracy is not None:
            raise ValueError(f"reward.accuracy {self.accuracy!r} names a function, and no reward function is named "
                             "(reward.funcs, or reward_funcs= in Python)")

    def functions(self, task: Any = None) -> RewardFunctions:
        """The run's ``RewardFunctions``: the functions named, or ``task``'s own reward when none is."""
        if self.funcs:
            return RewardFunctions(self.funcs, self.weights)
        if task is None:
            raise ValueError("reward.funcs is empty and there is no task whose reward to use")
        return RewardFunctions.of_task(task)


def imported_functions(data: Any) -> list[str]:
    """The ``package.module:function`` entries of a config's ``reward.funcs`` (plain data, not validated): what
    validating it would import. Built-ins import nothing of the user's, nor does a reward model (its weights are
    data: loaded without remote code)."""
    reward = data.get("reward") if isinstance(data, dict) else None
    funcs = reward.get("funcs") if isinstance(reward, dict) else None
    return [f for f in funcs or [] if not (isinstance(f, str) and f in BUILTINS or isinstance(f, dict))]
