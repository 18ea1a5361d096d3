"""The reduction a data-parallel rank runs before its step's one division (``DataParallel``), shared by the torch
engine (whose rank group ``asyncrl/backends/ranks.py`` builds) and the Megatron engine (over Megatron's
data-parallel group, under torchrun or in Ray rank actors).

Invariant: every rank of the group calls the same reductions in the same order at the end of each step (a rank
with no share of the step included: it contributes zeros and neutral extremes), so after them every rank holds the
same gradient sum and the same step totals, divides by the whole step's normaliser and takes the same step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["DataParallel"]


class DataParallel:
    """A rank's data-parallel process group (a ``torch.distributed`` ``ProcessGroup``) and its reductions."""

    def __init__(self, group: Any, rank: int, world: int, device: Any = "cpu", store: Any = None) -> None:
        self.group, self.rank, self.world, self.device = group, rank, world, torch.device(device)
        self.store = store  # the rendezvous store, kept alive while the group lives (ranks.py makes one)

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.group.allreduce([tensor], opts).wait()

    def all_reduce(self, params: list[torch.nn.Parameter], step: Any) -> None:
        """``reduce_grads(params)`` then ``reduce_step(step)``."""
        self.reduce_grads(params)
        self.reduce_step(step)

    def reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum ``params``' gradients over the ranks, in one flat all-reduce (a rank without a share has none:
        zeros)."""
        import torch.distributed as dist

        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._all_reduce(flat, dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def reduce_step(self, step: Any) -> None:
        """Reduce a step's ``Accumulator`` totals over the ranks: sums add, maxima/minima take the extreme."""
        import torch.distributed as dist

        def summed(values: list[float]) -> list[float]:
            t = torch.tensor(values, dtype=torch.float64, device=self.device)
            self._all_reduce(t, dist.ReduceOp.SUM)
            return t.tolist()

        step.sum_across(summed)
        for reduce, op, none in (("max", dist.ReduceOp.MAX, -math.inf), ("min", dist.ReduceOp.MIN, math.inf)):
            names = [m.name for m in step.metrics.values() if m.reduce == reduce]
            if names:  # no contribution on a rank: the neutral element, and none anywhere stays none
                t = torch.tensor([step.totals.get(n, none) for n in names], dtype=torch.float64, device=self.device)
                self._all_reduce(t, op)
                for n, v in zip(names, t.tolist()):
                    if v == none:
                        step.totals.pop(n, None)
                    else:
                        step.totals[n] = v
