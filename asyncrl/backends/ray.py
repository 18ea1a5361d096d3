"""Place any backend in a Ray actor: ``placement: ray`` in its config section.

The actor hosts the backend object unchanged and the controller talks to a proxy with the same methods, so
nothing in the controller or the backends knows where a backend runs. The proxy's class is made for the hosted
class: it has exactly that class's public methods and properties (a name the backend does not have is an
``AttributeError``), so ``hasattr`` and ``isinstance(proxy, GenerationBackend)`` tell the truth about the backend. An actor serves one call at a time, which
gives a generator the same "a weight load never interleaves a generation" guarantee as its in-process lock; a hosted
class that declares ``Capabilities(ray_max_concurrency=n)`` gets n at once (the vLLM generator: a weight receive runs during a
poll, and its own locks keep engine use serial).
Pipelined calls: a hosted class may name methods whose result no caller waits for (``Capabilities.ray_pipelined``: the
policies' ``begin_train_step`` and ``train_microbatches``). Through the proxy they return ``None`` at once, and the
proxy's next call waits for them first and raises the first of their errors, so a step's calls reach the actor back
to back instead of one round trip each (on two H200s that took ~5 ms off every training step's ~50). Only for an
actor that serves one call at a time: Ray runs one caller's calls to such an actor in the order they were made.
GPU placement: a backend whose ``device`` is CUDA asks Ray for one GPU (``ray_options`` may say otherwise), and Ray
makes that GPU the actor's only visible device, ``cuda`` / ``cuda:0``. Two such actors land on two GPUs. To pin
a trainer's device by index instead, give ``ray_options: {num_gpus: 0}`` and ``device: cuda:1`` (Ray then hides no
GPU); vLLM takes the first GPU its process sees, so a vLLM generator's ``device`` has no index.
Every CUDA actor gets NVLink multicast off in its runtime env (``NO_MULTICAST_ENV``).
Each actor also times its calls (``RemoteBackend.call_times()``: seconds and count per method), which is how a
benchmark tells how long each device was busy.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

from asyncrl.backends.base import Capabilities, capabilities

PLACEMENT_TIMEOUT_S = 120.0
# Ray gives a new local node's raylet a fixed 30 s to register with its GCS; on a loaded machine it can miss that
# ("The current node timed out during startup"), so a local start is tried this many times.
LOCAL_START_ATTEMPTS = 3
# NVLink multicast stays off in every CUDA actor: nothing here uses it, and on shared hosts a program that uses it
# can take the GPUs out of service. ``weight_sync`` sets it again before it makes an NCCL group.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class _Host:
    """Runs inside the actor: owns the backend object."""

    def __init__(self, cls: type, args: tuple, deferred: bool = False) -> None:
        self._cls, self._args = cls, args
        self.obj = None if deferred else cls(*args)
        self.times: dict[str, list] = defaultdict(lambda: [0.0, 0])  # method -> [seconds, calls]

    def _timed(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = self.times[name]
            entry[0] += time.perf_counter() - start
            entry[1] += 1

    def build(self) -> None:
        """Construct the backend now (an actor started with ``deferred``: e.g. a Megatron rank, built only once
        its process joined the rank group's ``torch.distributed`` group)."""
        self.obj = self._cls(*self._args)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._timed(name, getattr(self.obj, name), *args, **kwargs)

    def apply(self, fn: Any, *args: Any) -> Any:
        """``fn(host, *args)`` in this actor (``host.obj`` is the backend): used by ``weight_sync``."""
        return self._timed(fn.__name__, fn, self, *args)

    def call_times(self) -> dict[str, tuple[float, int]]:
        return {k: (v[0], v[1]) for k, v in self.times.items()}

    def get(self, name: str) -> Any:
        return getattr(self.obj, name)

    def close(self) -> None:
        if self.obj is not None and hasattr(self.obj, "close"):
            self.obj.close()


class RemoteBackend:
    """Base of the proxies ``proxy_class`` makes: ``proxy.method(...)`` is
    ``ray.get(actor.call.remote("method", ...))`` and ``proxy.prop`` reads the property in the actor. Its own
    members (``apply_remote``, ``call_times``, ``close``, ``restart``, ``actor_id``) are about the actor: it
    declares ``Capabilities(actor=True)``, with the hosted class's capabilities besides (``proxy_class``)."""

    hosted: type = object  # the backend class in the actor
    capabilities = Capabilities(actor=True)

    def __init__(self, actor: Any, start: Any = None) -> None:
        self._actor = actor
        self._start = start  # () -> a new actor hosting the same backend, built the same way (``restart``)
        self._pipelined: list[Any] = []  # refs of pipelined calls not yet waited for (module docstring)
        self._pipelined_lock = threading.Lock()

    def _wait(self, ref: Any) -> Any:
        """``ray.get(ref)``, after the pipelined calls made before it: the first of their errors is raised."""
        import ray

        with self._pipelined_lock:
            earlier, self._pipelined = self._pipelined, []
        if earlier:
            ray.get(earlier)
        return ray.get(ref)

    @property
    def actor_id(self) -> str:
        """The actor's id (hex), as ``RayActorError.actor_id`` names a dead one."""
        return self._actor._actor_id.hex()

    def restart(self) -> None:
        """Replace the actor with a fresh one built from the same class and arguments (what the controller does
        when this actor died: ``asyncrl/faults.py``). The new backend starts from its constructor's state."""
        import ray

        if self._start is None:
            raise RuntimeError("this RemoteBackend was not made by asyncrl.backends.ray.remote; it cannot restart")
        try:
            ray.kill(self._actor)
        except Exception:  # already dead: that is why we restart
            pass
        self._pipelined = []
        self._actor = self._start()

    def kill(self) -> None:
        """End the actor without closing the hosted backend: it died, or a start failed half-way."""
        import ray

        ray.kill(self._actor)

    def call_remote(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Start the hosted method ``name`` and return its ObjectRef without waiting (``ray.get`` it): how a replica
        set or a rank group drives several actors at once."""
        if not callable(getattr(self.hosted, name, None)):
            raise AttributeError(f"{self.hosted.__name__} has no method {name!r}")
        return self._actor.call.remote(name, *args, **kwargs)

    def apply_remote(self, fn: Any, *args: Any) -> Any:
        """Start ``fn(host, *args)`` in the actor and return its ObjectRef without waiting (``ray.get`` it)."""
        return self._actor.apply.remote(fn, *args)

    def call_times(self) -> dict[str, tuple[float, int]]:
        """Seconds spent inside each backend method (and ``apply`` function) in the actor, and call counts."""
        import ray

        return self._wait(self._actor.call_times.remote())

    def close(self) -> None:
        """Close the hosted backend (if it can be closed), then end the actor and free its resources."""
        import ray

        self._pipelined = []  # closing: their errors no longer matter (the close runs after them)
        ray.get(self._actor.close.remote())
        ray.kill(self._actor)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._actor!r})"


def _remote_method(name: str, doc: str | None, pipelined: bool = False):
    def call(self: RemoteBackend, *args: Any, **kwargs: Any) -> Any:
        ref = self._actor.call.remote(name, *args, **kwargs)
        if pipelined:
            with self._pipelined_lock:
                self._pipelined.append(ref)
            return None
        return self._wait(ref)

    call.__name__, call.__doc__ = name, doc
    return call


def _remote_property(name: str, doc: str | None) -> property:
    def get(self: RemoteBackend) -> Any:
        return self._wait(self._actor.get.remote(name))

    return property(get, doc=doc)


def proxy_class(cls: type) -> type[RemoteBackend]:
    """A ``RemoteBackend`` subclass with one member per public method or property of ``cls``, its public class
    constants (bool, int, str), and ``cls``'s ``Capabilities`` with ``actor`` (read without a call: the proxy has
    every member they promise, and it is one actor). Nothing else: public data attributes set in ``__init__`` are
    not part of a backend's contract."""
    declared = capabilities(cls)
    namespace: dict[str, Any] = {"hosted": cls, "__doc__": f"Ray proxy of {cls.__qualname__}.",
                                 "capabilities": replace(declared, actor=True)}
    pipelined = declared.ray_pipelined  # Capabilities checks it goes with one call at a time
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or name in vars(RemoteBackend):
            continue  # the proxy's own (close closes the hosted backend, then the actor)
        if isinstance(member, property):
            namespace[name] = _remote_property(name, member.__doc__)
        elif callable(member):
            namespace[name] = _remote_method(name, getattr(member, "__doc__", None), name in pipelined)
        elif isinstance(member, (bool, int, str)):
            namespace[name] = member
    return type(f"Remote{cls.__name__}", (RemoteBackend,), namespace)


def ensure_ray(num_cpus: int | None = None, address: str | None = None) -> None:
    """Start Ray, or join a cluster: ``address`` (the ``ray.address`` config knob), else ``RAY_ADDRESS``, joins
    that cluster (``auto``: the one ``ray start`` started on this machine); neither starts a local Ray with
    ``num_cpus`` CPUs. A Ray session already initialised in this process is used as it is."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
    if address is None:
        for attempt in range(LOCAL_START_ATTEMPTS):
            try:
                ray.init(address="local", num_cpus=num_cpus, **quiet)  # never joins a cluster by accident
                return
            except Exception as exc:  # Ray raises a bare Exception for it
                if "timed out during startup" not in str(exc) or attempt == LOCAL_START_ATTEMPTS - 1:
                    raise
                ray.shutdown()  # ends what the failed start left running, then try again
    quiet.pop("include_dashboard")  # the cluster's head decided that
    ray.init(address=address, **quiet)  # a cluster's resources are its own: num_cpus is not ours to set


def actor_options(section: Any) -> dict[str, Any]:
    """Ray actor options for a backend placed by ``section``: one CPU, one GPU when its device is CUDA, then the
    section's ``ray_options`` (which may say otherwise)."""
    cuda = str(section.device).startswith("cuda")
    options = {"num_cpus": 1, "num_gpus": 1 if cuda else 0}
    options.update(section.ray_options)
    if cuda:
        index = str(section.device).partition(":")[2]
        if index not in ("", "0") and options["num_gpus"]:
            raise ValueError(
                f"device {section.device!r} with Ray num_gpus {options['num_gpus']}: Ray shows the actor only the "
                "GPU(s) it assigned, numbered from 0; use device 'cuda', or pin by index with ray_options "
                "{num_gpus: 0}"
            )
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **NO_MULTICAST_ENV}  # multicast stays off
        options["runtime_env"] = runtime_env
    return options


def reserve(options: dict[str, Any], count: int, strategy: str, what: str, timeout_s: float) -> Any:
    """A placement group of ``count`` bundles, each the CPUs/GPUs/custom resources of one actor with ``options``
    (``PACK``: as few nodes as possible, for trainer ranks; ``SPREAD``: across nodes, for generation replicas),
    ready within ``timeout_s`` or a ``RuntimeError`` naming what was asked and what the cluster has (nothing stays
    reserved). ``None`` when the actors ask for no resources at all (nothing to reserve)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    bundle = {k: v for k, v in bundle.items() if v}
    if not bundle:
        return None
    group = placement_group([dict(bundle) for _ in range(count)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"could not reserve {count} x {bundle} ({strategy}) for {what} within {timeout_s:g} s: the Ray cluster "
            f"has {_resources(ray.cluster_resources())} in all, {_resources(ray.available_resources())} free; lower "
            "the count or the per-actor resources (ray_options), or add nodes (docs/cluster.md)"
        )
    return group


class ActorGroup:
    """``count`` actors hosting one backend class, reserved together in one placement group: what generation
    replicas (``replicas.py``, ``SPREAD``) and trainer ranks (``ranks.py``, ``PACK``) are made of. ``start`` builds
    them (a start that fails half-way, ``then`` included, kills what it built and leaves nothing reserved);
    ``close`` closes their backends (or kills them) and gives the placement group back. ``actors`` is the list of
    ``RemoteBackend``s, in bundle order."""

    def __init__(self, actors: list[RemoteBackend], placement_group: Any = None) -> None:
        self.actors, self.placement_group = actors, placement_group

    @classmethod
    def start(cls, hosted: type, args_of: Any, section: Any, count: int, strategy: str, what: str, timeout_s: float,
              deferred: bool = False, then: Any = None) -> ActorGroup:
        """Actor ``i`` hosts ``hosted(*args_of(i))``; ``then(actors)`` runs before the start counts as done."""
        group = reserve(actor_options(section), count, strategy, what, timeout_s)
        actors: list[RemoteBackend] = []
        try:
            for i in range(count):
                actors.append(remote(hosted, args_of(i), section, group, i if group is not None else None, deferred))
            if then is not None:
                then(actors)
        except BaseException:
            cls(actors, group).close(kill=True)
            raise
        return cls(actors, group)

    def close(self, kill: bool = False) -> None:
        """Close each actor's backend (one that died is killed instead); ``kill``: kill them all without closing
        (a start failed, or a death broke the group). Then release the placement group."""
        import ray
        from ray.exceptions import RayActorError

        for actor in self.actors:
            if kill:
                actor.kill()
                continue
            try:
                actor.close()
            except RayActorError:  # died (or was retired): nothing left to close
                actor.kill()
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None


def _resources(res: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in sorted(res.items()) if not k.startswith(("node:", "memory", "object_store"))}


def remote(cls: type, args: tuple, section: Any, group: Any = None, bundle: int | None = None,
           deferred: bool = False) -> RemoteBackend:
    """Start ``cls(*args)`` in a Ray actor placed by ``section`` (a trainer or generation config), in bundle
    ``bundle`` of placement group ``group`` when given (``reserve``). ``deferred``: the actor starts empty and
    builds the backend when ``apply_remote``'d code calls ``host.build()`` (after setting up its process)."""
    import ray

    ensure_ray()
    options = actor_options(section)
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
    # One call at a time, unless the hosted class says it is safe with more (``ray_max_concurrency``: the vLLM
    # generator, so a weight receive runs during a poll; its own locks keep engine use serial).
    concurrency = capabilities(cls).ray_max_concurrency
    actor = ray.remote(_Host).options(max_concurrency=concurrency, **options).remote(cls, args, deferred)
    ready, _ = ray.wait([actor.get.remote("__class__")], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.kill(actor)
        raise RuntimeError(
            f"could not place {cls.__name__} in a Ray actor within {PLACEMENT_TIMEOUT_S:.0f} s: it asks for "
            f"{options} and the cluster has {ray.available_resources()} free; free resources or set ray_options"
        )
    ray.get(ready[0])  # surfaces a constructor error here, not at the first call
    return proxy_class(cls)(actor, start=lambda: remote(cls, args, section, group, bundle, deferred)._actor)
