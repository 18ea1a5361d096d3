"""Generation replicas: ``generation.replicas: K`` engines, each a Ray actor hosting the configured generation
backend, behind one ``GenerationBackend`` the controller drives exactly as it drives a single engine
(``ReplicaSet``).

Invariants (kept by ``ReplicaSet``, under its lock, so the rollout pump's ``poll`` and the train pump's
``load_weights``/``abort`` may overlap):
- Every submitted group is owned by exactly one replica from ``submit`` until ``poll`` returns it or ``abort``
  cancels it; ``num_inflight`` is the number of owned groups. ``abort`` asks only the owner of each group.
- ``submit`` gives each group to the least loaded replica (fewest owned groups; ties to the lowest index), so an
  idle set deals a batch out round-robin. The choice depends only on the set's own bookkeeping, never on timing,
  so stepped runs stay deterministic for a seed.
- ``version`` is the weight version every replica holds: ``load_weights`` sends the weights to all replicas at once
  (one copy in Ray's object store) and moves ``version`` only after every load completed. A replica's own version
  (each group's ``gen_start_version``/``gen_end_version``) moves when its own load completed.
- Each finished group says which replica generated it (``GroupRollouts.replica``; the trace's commit reason names
  it), and ``step_metrics`` reports per replica the completion tokens and the seconds spent generating (``poll``
  inside the actor) since the previous step: ``tokens_replica_<i>``, ``busy_s_replica_<i>``.

Determinism: replica ``i`` samples from its own stream, seeded ``seed + i * REPLICA_SEED_STRIDE`` (replica 0 has
the run's seed), and gets its groups by the deterministic rule above; so a stepped run with K replicas is
reproducible for a seed, but it differs from a run with another K (a group's samples depend on its replica and on
what else that replica generates in the same call). Restoring a checkpoint into the same K resumes exactly.
Placement: the replicas are reserved in one ``SPREAD`` placement group (``ray.reserve``): on a cluster they land on
different nodes where they can.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from asyncrl.data import GenerationRequest, GroupRollouts

REPLICA_SEED_STRIDE = 1_000_003


class ReplicaSet:
    """The ``GenerationBackend`` over K generation actors (see the module docstring)."""

    def __init__(self, replicas: list[Any], version: int = 0, placement_group: Any = None) -> None:
        self.replicas = replicas
        self._placement_group = placement_group
        self._version = version
        self._lock = threading.Lock()
        self._owner: dict[int, int] = {}  # group id -> replica index, while the group is in flight
        self._load = [0] * len(replicas)
        self._tokens = [0] * len(replicas)  # completion tokens returned since the last step_metrics
        self._busy = [0.0] * len(replicas)  # the replicas' poll seconds at the last step_metrics

    @classmethod
    def start(cls, generator_cls: type, args: tuple, cfg: Any) -> ReplicaSet:
        """``cfg.generation.replicas`` actors of ``generator_cls(model, generation, seed_i, tokenizer)``, spread."""
        import ray

        from asyncrl.backends.ray import actor_options, remote, reserve

        section, k = cfg.generation, cfg.generation.replicas
        group = reserve(actor_options(section), k, "SPREAD", f"{k} generation replicas", cfg.ray.placement_timeout_s)
        model, gen, seed, tokenizer = args
        replicas: list[Any] = []
        try:
            for i in range(k):
                replicas.append(remote(generator_cls, (model, gen, seed + i * REPLICA_SEED_STRIDE, tokenizer),
                                       section, group, i if group is not None else None))
        except BaseException:
            for replica in replicas:
                ray.kill(replica._actor)
            if group is not None:
                ray.util.remove_placement_group(group)
            raise
        return cls(replicas, 0, group)

    @property
    def version(self) -> int:
        return self._version

    def owner(self, group_id: int) -> int | None:
        """The replica generating ``group_id``; None when it is not in flight."""
        with self._lock:
            return self._owner.get(group_id)

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        import ray

        shares: dict[int, list[GenerationRequest]] = {}
        with self._lock:
            for request in requests:
                i = min(range(len(self.replicas)), key=lambda r: (self._load[r], r))
                self._load[i] += 1
                self._owner[request.group_id] = i
                shares.setdefault(i, []).append(request)
        try:
            ray.get([self.replicas[i].call_remote("submit", share) for i, share in shares.items()])
        except BaseException:  # not submitted: not in flight (the controller re-submits what it lost)
            with self._lock:
                for i, share in shares.items():
                    for request in share:
                        if self._owner.pop(request.group_id, None) is not None:
                            self._load[i] -= 1
            raise

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        """Finished groups from every replica with groups in flight, polled at once (each with ``timeout``)."""
        import ray

        with self._lock:
            busy = [i for i, load in enumerate(self._load) if load]
        results = ray.get([self.replicas[i].call_remote("poll", timeout) for i in busy])
        out = []
        with self._lock:
            for i, groups in zip(busy, results):
                for group in groups:
                    if self._owner.pop(group.group_id, None) is not None:
                        self._load[i] -= 1
                    self._tokens[i] += group.num_tokens
                    group.replica = i
                    out.append(group)
        return out

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        """Ask each group's owner (and only it) to cancel it; returns the ids actually cancelled."""
        import ray

        by_owner: dict[int, list[int]] = {}
        with self._lock:
            for gid in group_ids:
                if gid in self._owner:
                    by_owner.setdefault(self._owner[gid], []).append(gid)
        results = ray.get([self.replicas[i].call_remote("abort", gids) for i, gids in by_owner.items()])
        cancelled = []
        with self._lock:
            for i, ids in zip(by_owner, results):
                for gid in ids:
                    if self._owner.pop(gid, None) is not None:
                        self._load[i] -= 1
                    cancelled.append(gid)
        return cancelled

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._owner)

    def load_weights(self, weights: Mapping[str, Any], version: int) -> None:
        import ray

        ref = ray.put(dict(weights))  # one copy for all replicas
        ray.get([replica.call_remote("load_weights", ref, version) for replica in self.replicas])
        self._version = int(version)  # only once every replica holds it

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Greedy completions, the prompts dealt out to the replicas in contiguous shares (all hold ``version``)."""
        import ray

        k = len(self.replicas)
        bounds = [round(len(prompts) * i / k) for i in range(k + 1)]
        calls = [self.replicas[i].call_remote("generate_greedy", list(prompts[bounds[i]:bounds[i + 1]]), max_new_tokens)
                 for i in range(k) if bounds[i + 1] > bounds[i]]
        return [c for share in ray.get(calls) for c in share]

    def step_metrics(self) -> dict[str, float]:
        """Per replica, since the previous call (the controller calls it once per step): completion tokens it
        returned (``tokens_replica_<i>``) and seconds it spent generating (``busy_s_replica_<i>``)."""
        times = [replica.call_times() for replica in self.replicas]
        out: dict[str, float] = {}
        with self._lock:
            for i, t in enumerate(times):
                busy = t.get("poll", (0.0, 0))[0]
                out[f"tokens_replica_{i}"] = float(self._tokens[i])
                out[f"busy_s_replica_{i}"] = busy - self._busy[i]
                self._tokens[i], self._busy[i] = 0, busy
        return out

    def state_dict(self) -> dict[str, Any]:
        """Every replica's state (its sampling stream, version, ...) and the set's version."""
        import ray

        return {"version": self._version, "replicas": ray.get([r.call_remote("state_dict") for r in self.replicas])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replica ``i`` takes saved state ``i`` (a single generator's checkpoint is replica 0's); replicas beyond
        the saved ones keep their fresh streams, so only the same K resumes exactly."""
        import ray

        saved = state["replicas"] if "replicas" in state else [state]
        ray.get([r.call_remote("load_state_dict", s) for r, s in zip(self.replicas, saved)])
        self._version = int(state["version"])

    def close(self) -> None:
        import ray

        for replica in self.replicas:
            replica.close()
        if self._placement_group is not None:
            ray.util.remove_placement_group(self._placement_group)
            self._placement_group = None
        with self._lock:
            self._owner.clear()
            self._load = [0] * len(self.replicas)

    def __repr__(self) -> str:
        return f"ReplicaSet({len(self.replicas)} x {self.replicas[0].hosted.__name__}, version {self._version})"
