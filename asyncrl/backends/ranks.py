"""A data-parallel trainer: ``trainer.data_parallel: R`` ranks, each a Ray actor hosting the policy backend, in one
``torch.distributed`` group (gloo on CPU, NCCL on GPUs), behind one ``PolicyBackend`` the controller drives
exactly as it drives a single policy (``RankGroupPolicy``).

How a step stays the 1-rank step (the invariant, kept here and in the engine's ``finish_train_step`` hook):
- Every rank starts from the same weights (same config and seed) and ``load_state_dict`` goes to every rank.
- ``logprobs`` and ``train_microbatches`` shard each chunk across ranks by *whole groups* (contiguous, balanced by
  sequences); a rank with no share of a chunk sits it out. Each rank accumulates gradients of the *un-normalised*
  loss sums, as a single policy does.
- ``finish_train_step`` runs on every rank at once; before its one division each rank all-reduces (sums) its
  gradients and its step's metric totals (``DataParallel.all_reduce``; extremes reduce by max/min), so every rank
  divides the same gradient sum by the whole step's normaliser, clips the same norm and takes the same optimizer
  step: the ranks stay identical, and the step equals the 1-rank step up to float reassociation of the sums.
- Weights and state are read from rank 0 (``export_weights`` once per step, ``state_dict``).

Placement: the ranks are reserved together in a ``PACK`` placement group (``ray.reserve``); missing resources fail
within ``ray.placement_timeout_s`` with what was asked and what the cluster has. The group's rendezvous is a
``TCPStore`` on rank 0's node (its IP as Ray sees it), so ranks may span nodes.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import torch

from asyncrl.data import TrainBatch

GROUP_TIMEOUT_S = 300.0


class DataParallel:
    """Lives in a rank's actor (``TorchPolicy.data_parallel``): the rank's process group and the reduction the
    engine calls before dividing its gradients."""

    def __init__(self, group: Any, rank: int, world: int, store: Any) -> None:
        self.group, self.rank, self.world, self.store = group, rank, world, store

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.group.allreduce([tensor], opts).wait()

    def all_reduce(self, params: list[torch.nn.Parameter], step: Any) -> None:
        """Sum ``params``' gradients over the ranks (a rank without a share has zeros) and reduce the step's
        ``Accumulator`` totals: sums add, maxima/minima take the extreme over ranks."""
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

        def summed(values: list[float]) -> list[float]:
            t = torch.tensor(values, dtype=torch.float64, device=flat.device)
            self._all_reduce(t, dist.ReduceOp.SUM)
            return t.tolist()

        step.sum_across(summed)
        for reduce, op, none in (("max", dist.ReduceOp.MAX, -math.inf), ("min", dist.ReduceOp.MIN, math.inf)):
            names = [m.name for m in step.metrics.values() if m.reduce == reduce]
            if names:  # no contribution on a rank: the neutral element, and none anywhere stays none
                t = torch.tensor([step.totals.get(n, none) for n in names], dtype=torch.float64, device=flat.device)
                self._all_reduce(t, op)
                for n, v in zip(names, t.tolist()):
                    if v == none:
                        step.totals.pop(n, None)
                    else:
                        step.totals[n] = v


# ---- run inside the rank actors through RemoteBackend.apply_remote (host.obj is the policy) ---------------------


def _listen(host: Any) -> tuple[str, int]:
    import ray
    import torch.distributed as dist

    address = ray.util.get_node_ip_address()
    host.rank_store = dist.TCPStore(address, 0, None, True, wait_for_workers=False)
    return address, host.rank_store.port


def _join(host: Any, rank: int, world: int, address: str, port: int, backend: str, timeout_s: float) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = host.__dict__.pop("rank_store", None) if rank == 0 else dist.TCPStore(
        address, port, None, False, timeout=timeout)
    prefixed = dist.PrefixStore("asyncrl/ranks/", store)
    if backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world, timeout)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
    dp = DataParallel(group, rank, world, store)
    dp._all_reduce(torch.zeros(1, device=getattr(host.obj, "device", "cpu")), dist.ReduceOp.SUM)  # connect now
    host.obj.data_parallel = dp


# ---- the driver's side --------------------------------------------------------------------------------------------


def shard_rows(group_sizes: list[int], parts: int) -> list[tuple[int, int, list[int]]]:
    """Split a batch's groups (``group_sizes`` rows each, in order) into ``parts`` contiguous runs of whole groups
    with balanced rows: ``(first row, end row, sizes)`` per part; a part may be empty when groups are few."""
    total, out, start, g = sum(group_sizes), [], 0, 0
    for part in range(parts):
        goal = round(total * (part + 1) / parts)
        end, sizes = start, []
        while g < len(group_sizes) and (end + group_sizes[g] / 2 <= goal or part == parts - 1):
            end += group_sizes[g]
            sizes.append(group_sizes[g])
            g += 1
        out.append((start, end, sizes))
        start = end
    return out


class RankGroupPolicy:
    """The ``PolicyBackend`` over R data-parallel rank actors (see the module docstring)."""

    def __init__(self, ranks: list[Any], placement_group: Any = None) -> None:
        self.ranks, self._placement_group = ranks, placement_group

    @classmethod
    def start(cls, policy_cls: type, args: tuple, cfg: Any) -> RankGroupPolicy:
        """``cfg.trainer.data_parallel`` actors of ``policy_cls(*args)`` packed in one placement group, joined in
        one process group (NCCL when the trainer's device is CUDA, else gloo)."""
        import ray

        from asyncrl.backends.ray import actor_options, remote, reserve

        world, section = cfg.trainer.data_parallel, cfg.trainer
        group = reserve(actor_options(section), world, "PACK", f"{world} trainer ranks", cfg.ray.placement_timeout_s)
        ranks: list[Any] = []
        try:
            for r in range(world):
                ranks.append(remote(policy_cls, args, section, group, r if group is not None else None))
            address, port = ray.get(ranks[0].apply_remote(_listen))
            backend = "nccl" if str(section.device).startswith("cuda") else "gloo"
            ray.get([rank.apply_remote(_join, r, world, address, port, backend, GROUP_TIMEOUT_S)
                     for r, rank in enumerate(ranks)])
        except BaseException:
            for rank in ranks:
                ray.kill(rank._actor)
            if group is not None:
                ray.util.remove_placement_group(group)
            raise
        return cls(ranks, group)

    def _all(self, name: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([rank.call_remote(name, *args) for rank in self.ranks])

    def _sharded(self, name: str, batch: TrainBatch) -> list[tuple[int, Any]]:
        """``name(shard)`` on every rank with a share of ``batch``, at once: ``[(first row, result)]``."""
        import ray

        calls = []
        for rank, (start, end, sizes) in zip(self.ranks, shard_rows(batch.group_sizes, len(self.ranks))):
            if end > start:
                shard = batch.map(lambda t, a=start, b=end: t[a:b], group_sizes=sizes)
                calls.append((start, rank.call_remote(name, shard)))
        return [(start, out) for (start, _), out in zip(calls, ray.get([ref for _, ref in calls]))]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return torch.cat([out for _, out in self._sharded("logprobs", batch)])

    def begin_train_step(self) -> None:
        self._all("begin_train_step")

    def train_microbatches(self, batch: TrainBatch) -> dict[str, float]:
        total: dict[str, float] = {}
        for _, out in self._sharded("train_microbatches", batch):
            for k, v in out.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def finish_train_step(self) -> dict[str, float]:
        return self._all("finish_train_step")[0]  # every rank reduced the same totals

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.ranks[0].export_weights()

    def state_dict(self) -> dict[str, Any]:
        return self.ranks[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import ray

        self._all("load_state_dict", ray.put(state))  # one copy in the object store for all ranks

    def close(self) -> None:
        import ray

        for rank in self.ranks:
            rank.close()
        if self._placement_group is not None:
            ray.util.remove_placement_group(self._placement_group)
            self._placement_group = None

    def __repr__(self) -> str:
        return f"RankGroupPolicy({len(self.ranks)} ranks of {self.ranks[0].hosted.__name__})"
