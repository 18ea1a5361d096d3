"""What the rollout pump needs to score a group: the run's functions, a group's inputs, the per-step metrics.

Invariants:
- The run's functions, first found wins: the objects a caller passed (``reward_funcs=``), ``reward.funcs`` of the
  config, the task's own ``reward_funcs`` (a dataset task's verifier: countdown's), else the task's own
  ``reward(prompt, text)`` (the built-in toy tasks, bit for bit).
- A group's inputs are TRL's: ``prompts`` the prompt as the data holds it (messages for a conversational prompt,
  else its text), ``completions`` the decoded texts (as messages, ``[{"role": "assistant", "content": text}]``,
  for a conversational prompt), ``completion_ids``, and every column of the prompt's row repeated per completion.
- ``reward/<name>`` is the mean of a function's values over the completions it applied to, in the groups committed
  since the last step (as ``gen_reward_mean``); ``reward_time_s`` the seconds the functions took on every group
  scored since the last step, failed attempts included (the work, not the time a group queued for a worker).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from asyncrl.rewards.functions import RewardBatch, RewardFunctions, TaskReward, function_name
from asyncrl.rewards.runner import Scored

REWARD_TIME_S = "reward_time_s"


def run_functions(reward: Any, task: Any, reward_funcs: Sequence[Any] | None = None) -> RewardFunctions:
    """The run's ``RewardFunctions`` from its ``reward:`` section, its task and the functions a caller passed."""
    if reward_funcs:
        if reward.funcs:
            raise ValueError(f"reward functions given twice: reward_funcs={[function_name(f) for f in reward_funcs]} "
                             f"and reward.funcs={reward.model_dump(mode='json')['funcs']}; name them in one place")
        return RewardFunctions(reward_funcs, reward.weights)
    if reward.funcs:
        return reward.functions()
    own = getattr(task, "reward_funcs", None)
    if own:
        return RewardFunctions(own)
    return RewardFunctions([TaskReward(task)])


def group_batch(prompt: Any, texts: list[str], completion_ids: list[list[int]]) -> RewardBatch:
    """One group's inputs, as TRL passes them (see the module's invariants)."""
    n = len(texts)
    messages = getattr(prompt, "messages", None)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if messages is not None else list(texts)
    columns = {k: [v] * n for k, v in (getattr(prompt, "columns", None) or {}).items()}
    return RewardBatch([prompt.text if messages is None else messages] * n, completions, completion_ids, columns,
                       source=prompt)


class RewardMetrics:
    """The per-step ``reward/<name>`` means and ``reward_time_s`` (see the module's invariants)."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {}

    def scored(self, outcome: Scored) -> None:
        """Any scoring that ended (its time counts, whatever the outcome)."""
        self.totals[REWARD_TIME_S] = self.totals.get(REWARD_TIME_S, 0.0) + outcome.seconds

    def committed(self, parts: dict[str, list] | None) -> None:
        """A group committed with these per-function values."""
        for name, values in (parts or {}).items():
            applied = [v for v in values if v is not None]
            self.totals[f"sum/{name}"] = self.totals.get(f"sum/{name}", 0.0) + sum(applied)
            self.totals[f"n/{name}"] = self.totals.get(f"n/{name}", 0.0) + len(applied)

    def result(self) -> dict[str, float]:
        out = {REWARD_TIME_S: self.totals.get(REWARD_TIME_S, 0.0)}
        for name in self.names:
            n = self.totals.get(f"n/{name}", 0.0)
            out[f"reward/{name}"] = self.totals.get(f"sum/{name}", 0.0) / n if n else math.nan
        return out

    def take(self) -> dict[str, float]:
        out = self.result()
        self.reset()
        return out
