"""Generation replicas: ``generation.replicas: K`` engines, each a Ray actor hosting the configured generation
backend, behind one ``GenerationBackend`` the controller drives exactly as it drives a single engine
(``ReplicaSet``).

Invariants (kept by ``ReplicaSet``, under its lock, so the rollout pump's ``poll`` and the train pump's
``load_weights``/``abort`` may overlap):
- Every submitted group is owned by exactly one replica from ``submit`` until ``poll`` returns it or ``abort``
  cancels it; ``num_inflight`` is the number of owned groups. ``abort`` asks only the owner of each group. A group
  already owned is not submitted again (``submit`` is idempotent, so a caller may re-submit a batch that failed
  part-way).
- ``submit`` gives each group to the least loaded replica (fewest owned groups; ties to the lowest index), so an
  idle set deals a batch out round-robin. The choice depends only on the set's own bookkeeping, never on timing,
  so stepped runs stay deterministic for a seed.
- ``version`` is the weight version every replica holds: ``load_weights`` sends the weights to all replicas at once
  (one copy in Ray's object store) and moves ``version`` only after every load completed. A replica's own version
  (each group's ``gen_start_version``/``gen_end_version``) moves when its own load completed.
- Each finished group says which replica generated it (``GroupRollouts.replica``; the trace's commit reason names
  it), and ``step_metrics`` reports per replica the completion tokens and the seconds spent generating (``poll``
  inside the actor) since the previous step: ``tokens_replica_<i>``, ``busy_s_replica_<i>``.

A replica that dies (its actor, as Ray reports it in any call) loses nothing: the set restarts it (a fresh actor
built the same way) with the last weights it was sent, while ``faults.restart_generator`` and
``faults.max_generator_restarts`` (restarts over the whole set) allow, and re-submits to it every group it owned;
past the budget it retires the replica and deals its groups to the others (with none left, every call fails).
Groups being aborted when their owner died count as cancelled. The set then raises ``ReplicaFault`` from the
next ``poll`` (at once when that poll has nothing else to return), which the controller records as a ``fault``
event with the story: which replica, during what, restarted or retired, which groups went where.

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

from asyncrl.backends.base import Capabilities
from asyncrl.data import GenerationRequest, GroupRollouts
from asyncrl.faults import describe

REPLICA_SEED_STRIDE = 1_000_003


class ReplicaFault(RuntimeError):
    """A generation replica died and was restarted or retired; its groups were re-submitted (nothing lost)."""


def _ids(ids: list[int]) -> str:
    return str(ids) if len(ids) <= 8 else f"[{', '.join(map(str, ids[:8]))}, ... {len(ids)} in all]"


class ReplicaSet:
    """The ``GenerationBackend`` over K generation actors (see the module docstring)."""

    # Columns per replica (step_metrics). Not one actor (it restarts its replicas itself), and no stage_weights: the
    # collective weight sync is between two actors.
    capabilities = Capabilities(step_metrics=True)

    def __init__(self, group: Any, version: int = 0, restarts: int = 0) -> None:
        self._group = group  # an ActorGroup (asyncrl/backends/ray.py): starts, closes, releases the actors
        self.replicas = replicas = group.actors
        self._version = version
        self._lock = threading.Lock()
        self._owner: dict[int, int] = {}  # group id -> replica index, while the group is in flight
        self._requests: dict[int, GenerationRequest] = {}  # group id -> its request, while in flight
        self._load = [0] * len(replicas)
        self._tokens = [0] * len(replicas)  # completion tokens returned since the last step_metrics
        self._busy = [0.0] * len(replicas)  # the replicas' poll seconds at the last step_metrics
        # Dead replicas: one recovery at a time; the weights a fresh replica loads; what the next poll reports.
        self._recovery = threading.RLock()
        self._restarts_left = restarts
        self._retired: set[int] = set()
        self._weights: tuple[Any, int] | None = None  # (ObjectRef of the last weights sent, their version)
        self._reports: list[str] = []
        self._held: list[GroupRollouts] = []  # finished groups a failed poll collected: returned by the next one

    @classmethod
    def start(cls, generator_cls: type, args: tuple, cfg: Any) -> ReplicaSet:
        """``cfg.generation.replicas`` actors of ``generator_cls(model, generation, seed_i, tokenizer)``, spread."""
        from asyncrl.backends.ray import ActorGroup

        k = cfg.generation.replicas
        model, gen, seed, tokenizer = args
        group = ActorGroup.start(generator_cls, lambda i: (model, gen, seed + i * REPLICA_SEED_STRIDE, tokenizer),
                                 cfg.generation, k, "SPREAD", f"{k} generation replicas", cfg.ray.placement_timeout_s)
        restarts = cfg.faults.max_generator_restarts if cfg.faults.restart_generator else 0
        return cls(group, 0, restarts)

    @property
    def version(self) -> int:
        return self._version

    def owner(self, group_id: int) -> int | None:
        """The replica generating ``group_id``; None when it is not in flight."""
        with self._lock:
            return self._owner.get(group_id)

    # ---- dead replicas -----------------------------------------------------------------------------------------

    def _living(self) -> list[int]:
        return [i for i in range(len(self.replicas)) if i not in self._retired]

    def _least_loaded(self) -> int:
        living = self._living()
        if not living:
            raise ReplicaFault(f"every generation replica died and the restart budget is spent "
                               f"(faults.max_generator_restarts); retired: {sorted(self._retired)}")
        return min(living, key=lambda r: (self._load[r], r))

    def _own(self, request: GenerationRequest, i: int) -> None:
        self._owner[request.group_id] = i
        self._requests[request.group_id] = request
        self._load[i] += 1

    def _disown(self, gid: int) -> int | None:
        i = self._owner.pop(gid, None)
        self._requests.pop(gid, None)
        if i is not None:
            self._load[i] -= 1
        return i

    def _results(self, calls: list[tuple[int, Any]], what: str, cancel: Sequence[int] = ()
                 ) -> tuple[list[tuple[int, Any]], Exception | None]:
        """Each call's result, ``[(replica, result)]``, for the replicas that answered; a replica that died is
        recovered (``_recover``) and left out; the first other error is returned, not raised (the others'
        results are kept)."""
        import ray
        from ray.exceptions import RayActorError

        out, error = [], None
        for i, ref in calls:
            try:
                out.append((i, ray.get(ref)))
            except RayActorError as exc:
                self._recover(i, what, exc, cancel)
            except Exception as exc:  # noqa: BLE001 - the caller raises it once the others are accounted for
                error = error or exc
        return out, error

    def _recover(self, i: int, what: str, exc: Exception, cancel: Sequence[int] = ()) -> None:
        """Replica ``i`` died during ``what``: restart it with the last weights (or retire it) and re-submit the
        groups it owned (those in ``cancel`` are dropped: their abort is done). Recorded for the next ``poll``."""
        import ray

        replica = self.replicas[i]
        with self._recovery:
            if i in self._retired or getattr(exc, "actor_id", None) not in (None, replica.actor_id):
                return  # another call already recovered this replica
            with self._lock:
                for gid in [g for g in cancel if self._owner.get(g) == i]:
                    self._disown(gid)
                lost = [self._requests[g] for g, o in self._owner.items() if o == i]
                for request in lost:
                    self._disown(request.group_id)
            story = f"generation replica {i} died during {what} ({describe(exc)[:120]}); "
            if self._restarts_left > 0:
                self._restarts_left -= 1
                replica.restart()
                self._busy[i] = 0.0  # a fresh actor's timers start at zero
                if self._weights is not None:
                    ray.get(replica.call_remote("load_weights", *self._weights))
                story += (f"restarted with weights {self._weights[1] if self._weights else 'of its constructor'} "
                          f"({self._restarts_left} restart(s) left)")
            else:
                self._retired.add(i)
                replica.kill()
                story += "retired (faults.max_generator_restarts spent): the others go on"
            with self._lock:
                shares: dict[int, list[GenerationRequest]] = {}
                for request in lost:
                    j = i if i not in self._retired else self._least_loaded()
                    self._own(request, j)
                    shares.setdefault(j, []).append(request)
            if lost:
                story += "; its group(s) " + "; ".join(
                    f"{_ids([r.group_id for r in share])} re-submitted to replica {j}" for j, share in shares.items())
            self._reports.append(story)
            done, error = self._results([(j, self.replicas[j].call_remote("submit", share))
                                         for j, share in shares.items()], "re-submit")
            if error is not None:
                raise error

    # ---- the GenerationBackend ---------------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        shares: dict[int, list[GenerationRequest]] = {}
        with self._lock:
            for request in requests:
                if request.group_id in self._owner:
                    continue  # already in flight: a re-submitted batch that had reached this replica set
                i = self._least_loaded()
                self._own(request, i)
                shares.setdefault(i, []).append(request)
        calls = [(i, self.replicas[i].call_remote("submit", share)) for i, share in shares.items()]
        done, error = self._results(calls, "submit")
        if error is not None:  # not submitted where the call failed: not in flight (the controller re-submits)
            answered = {i for i, _ in done}
            with self._lock:
                for i, share in shares.items():
                    if i not in answered and i not in self._retired:
                        for request in share:
                            if self._owner.get(request.group_id) == i:
                                self._disown(request.group_id)
            raise error

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        """Finished groups from every replica with groups in flight, polled at once (each with ``timeout``). After
        a replica died, raises ``ReplicaFault`` saying what was done (see the module docstring)."""
        with self._recovery:
            if self._reports and not self._held:
                reports, self._reports = self._reports, []
                raise ReplicaFault("; ".join(reports))
        with self._lock:
            busy = [i for i, load in enumerate(self._load) if load and i not in self._retired]
            out, self._held = self._held, []
        results, error = self._results([(i, self.replicas[i].call_remote("poll", timeout)) for i in busy], "poll")
        with self._lock:
            for i, groups in results:
                for group in groups:
                    if self._owner.get(group.group_id) == i:
                        self._disown(group.group_id)
                    self._tokens[i] += group.num_tokens
                    group.replica = i
                    out.append(group)
        with self._recovery:
            if error is not None or (self._reports and not out):
                self._held = out  # returned by the next poll
                if error is not None:
                    raise error
                reports, self._reports = self._reports, []
                raise ReplicaFault("; ".join(reports))
        return out

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        """Ask each group's owner (and only it) to cancel it; returns the ids actually cancelled (a group whose
        owner died meanwhile counts as cancelled: it is not re-submitted)."""
        by_owner: dict[int, list[int]] = {}
        with self._lock:
            for gid in group_ids:
                if gid in self._owner:
                    by_owner.setdefault(self._owner[gid], []).append(gid)
        calls = [(i, self.replicas[i].call_remote("abort", gids)) for i, gids in by_owner.items()]
        results, error = self._results(calls, "abort", cancel=list(group_ids))
        answered = {i for i, _ in results}
        cancelled = [gid for i, gids in by_owner.items() if i not in answered for gid in gids
                     if gid not in self._owner]  # dropped by the recovery of their dead owner
        with self._lock:
            for i, ids in results:
                for gid in ids:
                    if self._owner.get(gid) == i:
                        self._disown(gid)
                    cancelled.append(gid)
        if error is not None:
            raise error
        return cancelled

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._owner)

    def load_weights(self, weights: Mapping[str, Any], version: int) -> None:
        import ray

        ref = ray.put(dict(weights))  # one copy for all replicas
        # Held through the load: a replica recovered meanwhile (by a poll) is restarted after it, with these weights.
        with self._recovery:
            self._weights = (ref, int(version))
            calls = [(i, self.replicas[i].call_remote("load_weights", ref, version)) for i in self._living()]
            _, error = self._results(calls, "load_weights")
            if error is not None:
                raise error
            self._version = int(version)  # only once every replica holds it

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Greedy completions, the prompts dealt out to the living replicas in contiguous shares (all hold
        ``version``); a share whose replica died is generated again once the replica was recovered."""
        living = self._living()
        k = len(living)
        bounds = [round(len(prompts) * n / k) for n in range(k + 1)]
        shares = {i: list(prompts[bounds[n]:bounds[n + 1]]) for n, i in enumerate(living) if bounds[n + 1] > bounds[n]}
        calls = [(i, self.replicas[i].call_remote("generate_greedy", share, max_new_tokens))
                 for i, share in shares.items()]
        results, error = self._results(calls, "generate_greedy")
        if error is not None:
            raise error
        done = dict(results)
        for i in shares:
            if i not in done:
                j = i if i not in self._retired else self._living()[0]
                done[i] = self.replicas[j].generate_greedy(shares[i], max_new_tokens)
        return [c for i in shares for c in done[i]]

    def step_metrics(self) -> dict[str, float]:
        """Per replica, since the previous call (the controller calls it once per step): completion tokens it
        returned (``tokens_replica_<i>``) and seconds it spent generating (``busy_s_replica_<i>``)."""
        living = self._living()
        times, _ = self._results([(i, self.replicas[i]._actor.call_times.remote()) for i in living], "call_times")
        times = dict(times)
        out: dict[str, float] = {}
        with self._lock:
            for i in range(len(self.replicas)):
                busy = times.get(i, {}).get("poll", (self._busy[i], 0))[0]
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
        self._group.close()
        with self._lock:
            self._owner.clear()
            self._requests.clear()
            self._load = [0] * len(self.replicas)

    def __repr__(self) -> str:
        return f"ReplicaSet({len(self.replicas)} x {self.replicas[0].hosted.__name__}, version {self._version})"
