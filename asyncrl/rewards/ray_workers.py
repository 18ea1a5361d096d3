"""Reward workers as Ray actors, for a run that uses Ray (an engine with ``placement: ray``, replicas or ranks):
``RayWorker`` is the dispatcher's handle (``asyncrl/rewards/pool.py``) on one ``RewardActor``.

Invariants:
- The same protocol as a worker process (``asyncrl/rewards/worker.py``): the actor loads the pickled functions
  once (cloudpickle's bytes: a notebook function by value, a ``module:function`` by name, imported with the
  caller's ``sys.path`` put first), answers ``("ready", pid)`` or ``("init_error", why)``, then one call at a time
  (``max_concurrency=1``), each answered ``("ok" | "problem" | "bug", value, seconds)``.
- Answers reach the dispatcher through Ray's callbacks (``ObjectRef.future``), posted to its wake pipe: no
  ``ray.wait`` poll. A call that fails at the Ray level (the actor died: killed, out of memory, its node gone) is
  ``("died", why)``: the dispatcher faults the call it was running and replaces the actor.
- Stopping is ``ray.kill`` (a timeout cuts the call off; ``close`` ends them all). The actors ask Ray for
  nothing unless ``reward.ray_options`` says so (Ray's default for an actor: no CPU held while it runs), so they
  never wait for resources the engines hold; ``runtime_env`` in those options reaches a cluster's other nodes,
  where the caller's paths may not exist (docs/tasks.md).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

from asyncrl.faults import describe


def check_ray() -> None:
    import ray

    if not ray.is_initialized():
        raise RuntimeError("reward workers on Ray need the run's Ray session, and Ray is not initialised (the "
                           "controller starts it for an engine with placement 'ray')")


class RewardActor:
    """Runs inside the actor: the run's reward functions, one call at a time."""

    def __init__(self, path: list[str], payload: bytes):
        sys.path[:] = path + [p for p in sys.path if p not in path]
        self.error = None
        try:
            self.funcs = pickle.loads(payload)
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the caller must hear it, in one line
            self.error = f"{describe(exc)} (sys.path {sys.path[:3]}...)"
            return
        from asyncrl.rewards.builtin import math_answer

        if any(func is math_answer for _, func in self.funcs.values()):
            import math_verify  # noqa: F401 - half a second, paid before the first call's clock starts

    def ready(self) -> tuple:
        return ("init_error", self.error) if self.error else ("ready", os.getpid())

    def call(self, message: bytes) -> tuple:
        from asyncrl.rewards.functions import outcome

        _, index, batch = pickle.loads(message)
        name, func = self.funcs[index]
        return outcome(func, name, batch)


class RayWorker:
    """One ``RewardActor`` as the dispatcher sees a worker: ``send`` a pickled call, answers ``post``ed back."""

    where = "Ray actor"
    conn = None  # nothing to wait on: answers are posted

    def __init__(self, payload: bytes, post: Callable[[Any, tuple], None], options: dict | None = None):
        import ray

        self.ready, self.calls, self.since, self.pid = False, [], time.monotonic(), None
        self._post = post
        path = [p or os.getcwd() for p in sys.path]  # '' is the caller's working directory, not the actor's
        options = {**(options or {}), "max_concurrency": 1}  # one call at a time: a death is one call's fault
        self.actor = ray.remote(RewardActor).options(**options).remote(path, payload)
        self.label = f"Ray actor {self.actor._actor_id.hex()[:12]}"
        self._watch(self.actor.ready.remote())

    def _watch(self, ref: Any) -> None:
        ref.future().add_done_callback(self._answered)

    def _answered(self, future: Any) -> None:  # on Ray's thread
        try:
            message = future.result()
        except BaseException as exc:  # noqa: BLE001 - the actor is gone (or the call cannot run): replaced
            message = ("died", describe(exc))
        if message[0] == "ready":
            self.pid = message[1]
        self._post(self, message)

    def send(self, message: bytes) -> None:
        self._watch(self.actor.call.remote(message))

    def stop(self, grace_s: float = 0.0) -> str:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - Ray already shut down: nothing left to stop
            return f"stopped ({describe(exc)})"
        return "stopped"
