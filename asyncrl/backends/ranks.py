"""A multi-rank trainer: ``trainer.data_parallel`` x ``trainer.tensor_parallel`` ranks, each a Ray actor hosting
the policy backend, in one ``torch.distributed`` group (gloo on CPU, NCCL on GPUs), behind one ``PolicyBackend``
the controller drives exactly as it drives a single policy (``RankGroupPolicy``).

Two kinds of rank, one group:
- The torch engine (data parallel only) is built first; then the ranks join a standalone process group and each
  gets a ``DataParallel`` (``TorchPolicy.data_parallel``) over it.
- A policy class with ``Capabilities(needs_process_group=True)`` (Megatron) is built only once its actor joined
  ``torch.distributed``'s default group (the actor starts ``deferred``); the policy then makes Megatron's
  tensor-/data-parallel groups from it (``megatron_parallel.init_parallel``) and reduces over its own
  data-parallel group with the same ``DataParallel`` (or Megatron's DDP on GPUs). It is told that its caller shards
  (``keeps_own_rows = False``): under torchrun, where every rank gets the whole batch, it keeps its own rows.

How a step stays the 1-rank step (the invariant, kept here and in the engines' ``finish_train_step``):
- Every rank starts from the same weights (same config and seed) and ``load_state_dict`` goes to every rank.
- ``logprobs`` and ``train_microbatches`` shard each chunk across the data-parallel ranks by *whole groups*
  (contiguous, balanced by sequences); every tensor-parallel rank of a data-parallel rank gets the same share (they
  run one model together), and a data-parallel rank with no share of a chunk sits it out. Each rank accumulates
  gradients of the *un-normalised* loss sums, as a single policy does; one answer per data-parallel rank is kept.
- ``finish_train_step`` runs on every rank at once; before its one division each rank sums its gradients and its
  step's metric totals over the data-parallel ranks (``DataParallel``; extremes reduce by max/min), so every rank
  divides the same gradient sum by the whole step's normaliser, clips the same norm and takes the same optimizer
  step: the step equals the 1-rank step up to float reassociation of the sums.
- Weights are exported once per step from rank 0 (with tensor parallelism the tensor-parallel ranks of data-parallel
  rank 0 gather the shards together; only rank 0's copy crosses to the driver). ``state_dict`` is rank 0's, or with
  tensor parallelism one state per tensor-parallel rank.

A rank that dies breaks the group's collectives: the others are ended too and the call raises ``TrainerFailed``
naming the rank (the weights and optimizer state are gone; the last checkpoint is the way back).

Placement: the ranks are reserved together in a ``PACK`` placement group (``ray.reserve``); missing resources fail
within ``ray.placement_timeout_s`` with what was asked and what the cluster has. The group's rendezvous is a
``TCPStore`` on rank 0's node (its IP as Ray sees it), so ranks may span nodes.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from asyncrl.backends.base import Capabilities, capabilities
from asyncrl.backends.data_parallel import DataParallel
from asyncrl.data import TrainBatch
from asyncrl.faults import TrainerFailed, describe

GROUP_TIMEOUT_S = 300.0
DEATH_GRACE_S = 10.0  # after a rank's call failed, how long to wait for the others to show which rank died


# ---- run inside the rank actors through RemoteBackend.apply_remote (host.obj is the policy) ---------------------


def _listen(host: Any) -> tuple[str, int]:
    import ray
    import torch.distributed as dist

    address = ray.util.get_node_ip_address()
    host.rank_store = dist.TCPStore(address, 0, None, True, wait_for_workers=False)
    return address, host.rank_store.port


def _join(host: Any, rank: int, world: int, address: str, port: int, backend: str, timeout_s: float
          ) -> tuple[int, int]:
    """Join the group as ``rank``; returns this rank's (data-parallel rank, tensor-parallel rank)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = host.__dict__.pop("rank_store", None) if rank == 0 else dist.TCPStore(
        address, port, None, False, timeout=timeout)
    prefixed = dist.PrefixStore("asyncrl/ranks/", store)
    if host.obj is None:  # deferred: the policy makes its groups from torch.distributed's default one
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
        host.group_store = store  # the rendezvous lives as long as the actor
        host.build()
        host.obj.keeps_own_rows = False  # RankGroupPolicy hands each rank its data-parallel share
        return host.obj.dp_rank, host.obj.tp_rank
    if backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world, timeout)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
    device = getattr(host.obj, "device", "cpu")
    dp = DataParallel(group, rank, world, device, store)
    dp._all_reduce(torch.zeros(1, device=device), dist.ReduceOp.SUM)  # connect now
    host.obj.data_parallel = dp
    return rank, 0


def _export_weights(host: Any, keep: bool) -> Any:
    weights = host.obj.export_weights()  # a collective over the tensor-parallel ranks when there are several
    return weights if keep else None


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
    """The ``PolicyBackend`` over the rank actors (see the module docstring). ``layout[i]`` is actor ``i``'s
    (data-parallel rank, tensor-parallel rank)."""

    capabilities = Capabilities()  # the instance's says what its ranks declare (not actor: a group of them)

    def __init__(self, group: Any, layout: list[tuple[int, int]] | None = None) -> None:
        self._group = group  # an ActorGroup (asyncrl/backends/ray.py): starts, closes, releases the actors
        self.ranks = ranks = group.actors
        self.layout = layout or [(r, 0) for r in range(len(ranks))]
        self.data_parallel = 1 + max(d for d, _ in self.layout)
        self.tensor_parallel = 1 + max(t for _, t in self.layout)
        self._ended: str | None = None  # why the group ended (a rank died), once it did
        # Each rank takes its rows' prev_logprobs from its forward when its class does: the controller skips logprobs.
        theirs = capabilities(ranks[0])
        self.capabilities = Capabilities(prev_logprobs_from_forward=theirs.prev_logprobs_from_forward,
                                         keeps_versions=theirs.keeps_versions)

    @classmethod
    def start(cls, policy_cls: type, args: tuple, cfg: Any) -> RankGroupPolicy:
        """``data_parallel`` x ``tensor_parallel`` actors of ``policy_cls(*args)`` packed in one placement group,
        joined in one process group (NCCL when the trainer's device is CUDA, else gloo)."""
        import ray

        from asyncrl.backends.ray import ActorGroup

        section = cfg.trainer
        world = section.ranks
        deferred = capabilities(policy_cls).needs_process_group
        layout: list = []

        def join(ranks: list[Any]) -> None:  # one process group (NCCL on CUDA, else gloo); rank 0 listens
            address, port = ray.get(ranks[0].apply_remote(_listen))
            backend = "nccl" if str(section.device).startswith("cuda") else "gloo"
            layout.extend(ray.get([rank.apply_remote(_join, r, world, address, port, backend, GROUP_TIMEOUT_S)
                                   for r, rank in enumerate(ranks)]))

        group = ActorGroup.start(policy_cls, lambda r: args, section, world, "PACK", f"{world} trainer ranks",
                                 cfg.ray.placement_timeout_s, deferred, then=join)
        return cls(group, [tuple(x) for x in layout])

    # ---- calls, and what a dead rank does to them ------------------------------------------------------------------

    def _get(self, calls: list[tuple[int, Any]], what: str) -> list[Any]:
        """The results of ``calls`` (``(actor index, ObjectRef)``), in order. When one fails, the others get
        ``DEATH_GRACE_S`` to show whether a rank died (a survivor blocked in a collective with it fails or hangs);
        a dead rank ends the group and raises ``TrainerFailed`` naming it; any other error is re-raised."""
        import ray
        from ray.exceptions import RayActorError

        if self._ended is not None:
            raise TrainerFailed(self._ended)
        pending, error = [ref for _, ref in calls], None
        while pending and error is None:  # as they finish: a rank that dies shows while others still wait on it
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except Exception as exc:  # noqa: BLE001 - looked at below, with the other ranks' outcomes
                error = exc
        if error is None:
            return ray.get([ref for _, ref in calls])
        ray.wait([ref for _, ref in calls], num_returns=len(calls), timeout=DEATH_GRACE_S)
        for i, ref in calls:
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                self._end(f"trainer rank {i} of {len(self.ranks)} (data-parallel rank {self.layout[i][0]}, "
                          f"tensor-parallel rank {self.layout[i][1]}) died during {what}: {describe(exc)}")
                raise TrainerFailed(
                    f"{self._ended}. The rank group cannot go on without it (its collectives are broken; the other "
                    "ranks were ended too): restore the last checkpoint (Controller.restore(path), or asyncrl run "
                    "CONFIG --steps N --resume DIR)") from exc
            except Exception:
                pass
        raise error

    def _end(self, why: str) -> None:
        self._ended = why
        for rank in self.ranks:
            rank.kill()

    def _all(self, name: str, *args: Any) -> list[Any]:
        return self._get([(i, rank.call_remote(name, *args)) for i, rank in enumerate(self.ranks)], name)

    def _sharded(self, name: str, batch: TrainBatch, *args: Any) -> list[tuple[int, Any]]:
        """``name(share, *args)`` on every rank whose data-parallel rank has a share of ``batch``, at once:
        ``[(first row, result)]``, one per data-parallel share (its tensor-parallel rank 0's)."""
        shards = shard_rows(batch.group_sizes, self.data_parallel)
        calls, starts = [], []
        for i, (rank, (d, t)) in enumerate(zip(self.ranks, self.layout)):
            start, end, sizes = shards[d]
            if end > start:
                shard = batch.map(lambda x, a=start, b=end: x[a:b], group_sizes=sizes)
                calls.append((i, rank.call_remote(name, shard, *args)))
                starts.append((start, t))
        results = self._get(calls, name)
        return sorted((start, out) for (start, t), out in zip(starts, results) if t == 0)

    # ---- the PolicyBackend ---------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return torch.cat([out for _, out in self._sharded("logprobs", batch)])

    def keep_versions(self, versions, current: int) -> list[int]:  # Capabilities.keeps_versions, if the ranks' is
        return self._all("keep_versions", list(versions), current)[0]  # every rank holds the same versions

    def logprobs_at(self, batch: TrainBatch, version: int, current: int) -> torch.Tensor:
        return torch.cat([out for _, out in self._sharded("logprobs_at", batch, version, current)])

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
        if self.tensor_parallel == 1:
            return self._get([(0, self.ranks[0].call_remote("export_weights"))], "export_weights")[0]
        calls = [(i, rank.apply_remote(_export_weights, i == 0))
                 for i, (rank, (d, _)) in enumerate(zip(self.ranks, self.layout)) if d == 0]
        return self._get(calls, "export_weights")[0]

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's state (every data-parallel rank holds the same); with tensor parallelism, the states of the
        tensor-parallel ranks of data-parallel rank 0, in order, under ``tensor_parallel_states``."""
        if self.tensor_parallel == 1:
            return self._get([(0, self.ranks[0].call_remote("state_dict"))], "state_dict")[0]
        owners = sorted((t, i) for i, (d, t) in enumerate(self.layout) if d == 0)
        states = self._get([(i, self.ranks[i].call_remote("state_dict")) for _, i in owners], "state_dict")
        return {"tensor_parallel_states": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import ray

        pieces = state.get("tensor_parallel_states") or [state]
        if len(pieces) != self.tensor_parallel:
            raise ValueError(f"the state holds {len(pieces)} tensor-parallel piece(s); this trainer has "
                             f"tensor_parallel {self.tensor_parallel}")
        refs = [ray.put(piece) for piece in pieces]  # one copy in the object store per piece, for all its ranks
        self._get([(i, rank.call_remote("load_state_dict", refs[t]))
                   for i, (rank, (_, t)) in enumerate(zip(self.ranks, self.layout))], "load_state_dict")

    def close(self) -> None:
        self._group.close(kill=self._ended is not None)  # ended: a rank died, the others were killed with it

    def __repr__(self) -> str:
        return (f"RankGroupPolicy({len(self.ranks)} ranks of {self.ranks[0].hosted.__name__}: data_parallel "
                f"{self.data_parallel} x tensor_parallel {self.tensor_parallel})")
