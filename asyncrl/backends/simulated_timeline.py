"""The simulated generator's time: the virtual clock a simulation's parts share (``SimClock``; ``WallClock`` makes
its seconds real) and each simulated engine's weights over time (``Replica``: which version it decodes with from
when, and what holds its next group back).

Invariants: a replica's ``versions`` are in time order and never decrease (so a bisection answers ``version_at``);
virtual time never goes back.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field


class SimClock:
    """Virtual seconds shared by a simulation's parts. ``stepping``: each generator poll advances ``now``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stepping = True


class WallClock:
    """Real seconds since the generator was built (``clock: wall``)."""

    stepping = False

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    @property
    def now(self) -> float:
        return time.perf_counter() - self._origin


@dataclass
class Replica:
    """One simulated engine's weights over time and what holds its next starts back."""

    versions: list[tuple[float, int]]  # (from when, version) of the weights it decodes with, in time order
    free_at: float = 0.0  # no group starts before this (a weight load, a pause)
    pending: list[tuple[float, float, int]] = field(default_factory=list)  # timed updates: (begin, load s, version)
    draining: tuple[float, int] | None = None  # drain: (load s, version) once it stopped taking groups

    def version_at(self, t: float) -> int:
        return self.versions[bisect.bisect_right(self.versions, t, key=lambda entry: entry[0]) - 1][1]

    def versions_at(self, times: Sequence[float]) -> list[int]:
        """``version_at`` of each of ``times`` (ascending): one pass along both."""
        out, i, versions = [], bisect.bisect_right(self.versions, times[0], key=lambda e: e[0]) - 1, self.versions
        for t in times:
            while i + 1 < len(versions) and versions[i + 1][0] <= t:
                i += 1
            out.append(versions[i][1])
        return out

    def ready(self, version: int) -> float:
        """When this replica first holds ``version`` or newer (inf while that update is still to come)."""
        when = math.inf
        for w, v in reversed(self.versions):  # versions never decrease: the newest entries answer
            if v < version:
                break
            when = w
        return when


def busy_seconds(spans: Sequence[tuple[float, float, int]], replicas: int, start: float, end: float) -> list[float]:
    """Seconds each of ``replicas`` was busy between ``start`` and ``end``: the union of its ``(from, to,
    replica)`` spans (decoded groups, weight loads) there."""
    mine: list[list[tuple[float, float]]] = [[] for _ in range(replicas)]
    for a, b, r in spans:
        if b > start and a < end:
            mine[r].append((max(a, start), min(b, end)))
    out = []
    for intervals in mine:
        total, cur_a, cur_b = 0.0, None, None
        for a, b in sorted(intervals):
            if cur_b is None or a > cur_b:
                total += 0.0 if cur_b is None else cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        out.append(total + (0.0 if cur_b is None else cur_b - cur_a))
    return out
