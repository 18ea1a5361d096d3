"""The submit/poll/abort queue of a generator that generates on ``poll`` (the torch generator, and the child-process
placement of any generator): ``submit`` only queues, ``poll`` takes everything queued and generates it.

Invariants:
- One batch per ``submit`` call, kept in submission order: generating batch by batch draws the same random numbers
  in the same order whatever the placement, so what a rollout is depends on the submissions, not on timing.
- ``abort`` removes still-queued groups only; a group being generated finishes (and is not listed as removed).
- ``inflight`` counts queued groups and groups being generated; a group is counted from ``submit`` until the
  ``generate`` call holding it returns (or raises), never twice and never zero times in between.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


class SubmitQueue:
    """Requests submitted and not yet generated, one list per ``submit`` call, and how many are being generated."""

    def __init__(self) -> None:
        self._batches: list[list[Any]] = []
        self._lock = threading.Lock()
        self._running = 0

    def submit(self, requests: Sequence[Any]) -> None:
        with self._lock:
            self._batches.append(list(requests))

    def inflight(self) -> int:
        """Groups queued or being generated."""
        with self._lock:
            return sum(map(len, self._batches)) + self._running

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        """Remove still-queued groups; a group already being generated finishes (and is not listed)."""
        wanted = set(group_ids)
        with self._lock:
            removed = [r.group_id for batch in self._batches for r in batch if r.group_id in wanted]
            if removed:
                batches = ([r for r in batch if r.group_id not in wanted] for batch in self._batches)
                self._batches = [batch for batch in batches if batch]
        return removed

    def generate(self, generate_batch: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """Take everything queued and return ``generate_batch(batch)`` of each batch, concatenated, in submission
        order. The caller serialises this against its weight loads (a load must not come between taking a batch
        and generating it)."""
        with self._lock:
            batches, self._batches = self._batches, []
            self._running += sum(map(len, batches))
        out: list[Any] = []
        try:
            for requests in batches:
                out += generate_batch(requests)
        finally:
            with self._lock:
                self._running -= sum(map(len, batches))
        return out

    def clear(self) -> None:
        with self._lock:
            self._batches = []
