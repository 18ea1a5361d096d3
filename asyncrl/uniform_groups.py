"""``filter_uniform_groups`` (DAPO's dynamic sampling): a group whose completions all got one reward has advantage 0
everywhere (no learning signal); the rollout pump skips it, replaced like any skipped group, and counts it
(``groups_uniform``). When every group keeps coming back uniform for longer than ``stall_timeout_s`` the run stops
with one line (``UniformGroupsError``): no group could ever be trained."""

from __future__ import annotations

import time
from typing import Any


class UniformGroupsError(RuntimeError):
    """Every group kept coming back uniform under ``filter_uniform_groups`` for ``stall_timeout_s``."""


class UniformFilter:
    """The rollout pump's: ``reason(group)`` for each scored group, ``check()`` after each collection."""

    def __init__(self, enabled: bool, stall_timeout_s: float) -> None:
        self.enabled, self.stall_timeout_s = enabled, stall_timeout_s
        self.streak: tuple[float, int] | None = None  # (since, count) of the groups that came back uniform in a row

    def reason(self, group: Any) -> str | None:
        """Why ``group`` is skipped (it is uniform, and counts in the streak), or None (it is not: the streak ends)."""
        if not self.enabled or len(set(group.rewards)) > 1:
            self.streak = None
            return None
        since, count = self.streak or (time.monotonic(), 0)
        self.streak = (since, count + 1)
        return (f"filter_uniform_groups: all {len(group.rewards)} completions got reward {group.rewards[0]:g}, so "
                "every advantage is 0 (no learning signal)")

    def check(self) -> None:
        """Stop the run when the streak lasted longer than ``stall_timeout_s``."""
        if self.streak is not None and time.monotonic() - self.streak[0] > self.stall_timeout_s:
            raise UniformGroupsError(
                f"filter_uniform_groups: the last {self.streak[1]} groups all came back uniform (every completion "
                f"of each got the same reward) for over {self.stall_timeout_s:g} s (stall_timeout_s), so none could "
                "be trained: the task is too hard or too easy for the model as it is; set filter_uniform_groups "
                "false, or change the task or its rewards")
