"""The ordered group ids of one buffer bucket: a minimal blocked sorted list.

Invariants: ``blocks`` hold ascending distinct ints, every block is non-empty and at most ``2 * LOAD`` long,
and ``maxes[i] == blocks[i][-1]``.

Why not ``sortedcontainers.SortedList``, which is the same structure: ``select`` removes its chunk, the first
``N`` ids of a bucket, and ``remove_many`` does that in one slice deletion, where ``SortedList`` deletes id by
id (also for ``del sl[:N]``). With ``SortedList`` buckets, ``benchmarks/bench_sampler.py`` missed its bar
(under 100 us per decision at 100k buffered groups) for ``N = 64``; ``benchmarks/README.md`` has both runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from itertools import chain


class SortedIds:
    """Ascending distinct ints in blocks of at most ``2 * LOAD``.

    ``add`` is O(1) when ids arrive in order (the common case: rollouts mostly finish in dispatch order) and
    O(log n + LOAD) otherwise; ``remove`` is O(log n + LOAD); iteration is in ascending order."""

    __slots__ = ("blocks", "maxes")
    LOAD = 256

    def __init__(self) -> None:
        self.blocks: list[list[int]] = []
        self.maxes: list[int] = []  # maxes[i] == blocks[i][-1]; no block is ever empty

    def add(self, x: int) -> None:
        blocks, maxes = self.blocks, self.maxes
        if not maxes:
            blocks.append([x])
            maxes.append(x)
            return
        if x > maxes[-1]:
            i = len(maxes) - 1
            block = blocks[i]
            block.append(x)
            maxes[i] = x
        else:
            i = bisect.bisect_left(maxes, x)
            block = blocks[i]
            bisect.insort(block, x)
        if len(block) > 2 * self.LOAD:
            half = self.LOAD
            blocks[i : i + 1] = [block[:half], block[half:]]
            maxes[i : i + 1] = [block[half - 1], block[-1]]

    def remove(self, x: int) -> None:
        maxes = self.maxes
        i = bisect.bisect_left(maxes, x)
        block = self.blocks[i]
        j = bisect.bisect_left(block, x)
        del block[j]
        if not block:
            del self.blocks[i], maxes[i]
        elif j == len(block):
            maxes[i] = block[-1]

    def remove_many(self, xs: list[int]) -> None:
        """Remove ``xs`` (ascending, all present). A run of ids that sit next to each other in a block (what
        ``select`` takes: the first candidates of a bucket) goes in one slice deletion."""
        blocks, maxes = self.blocks, self.maxes
        n, p, i = len(xs), 0, 0
        while p < n:
            x = xs[p]
            i = bisect.bisect_left(maxes, x, i)
            block = blocks[i]
            q = bisect.bisect_right(xs, maxes[i], p)  # xs[p:q] all lie in this block
            j = bisect.bisect_left(block, x)
            if block[j + q - p - 1] == xs[q - 1]:  # contiguous in the block
                del block[j : j + q - p]
            else:
                drop = set(xs[p:q])
                block[:] = [y for y in block if y not in drop]
            if block:
                maxes[i] = block[-1]
                i += 1
            else:
                del blocks[i], maxes[i]
            p = q

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self.blocks)
