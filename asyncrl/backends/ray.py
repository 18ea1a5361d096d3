"""Place any backend in a Ray actor: ``placement: ray`` in its config section.

The actor hosts the backend object unchanged and the controller talks to a proxy with the same methods, so
nothing in the controller or the backends knows where a backend runs. An actor serves one call at a time, which
gives the generator the same "a weight load never interleaves a generation" guarantee as its in-process lock.
GPU placement: a backend whose ``device`` is CUDA asks Ray for one GPU (``ray_options`` may say otherwise).
"""

from __future__ import annotations

import logging
from typing import Any

PLACEMENT_TIMEOUT_S = 120.0


class _Host:
    """Runs inside the actor: owns the backend object."""

    def __init__(self, cls: type, args: tuple) -> None:
        self.obj = cls(*args)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.obj, name)(*args, **kwargs)

    def get(self, name: str) -> Any:
        return getattr(self.obj, name)

    def close(self) -> None:
        if hasattr(self.obj, "close"):
            self.obj.close()


class RemoteBackend:
    """Proxy: ``proxy.method(...)`` is ``ray.get(actor.call.remote("method", ...))``; ``proxy.version`` reads the
    attribute remotely."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    @property
    def version(self) -> int:
        import ray

        return ray.get(self._actor.get.remote("version"))

    def close(self) -> None:
        """Close the hosted backend (if it can be closed), then end the actor and free its resources."""
        import ray

        ray.get(self._actor.close.remote())
        ray.kill(self._actor)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        import ray

        def call(*args: Any, **kwargs: Any) -> Any:
            return ray.get(self._actor.call.remote(name, *args, **kwargs))

        call.__name__ = name
        return call


def ensure_ray(num_cpus: int | None = None) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.ERROR,
                 log_to_driver=False)


def remote(cls: type, args: tuple, section: Any) -> RemoteBackend:
    """Start ``cls(*args)`` in a Ray actor placed by ``section`` (a TrainerConfig or GenerationConfig)."""
    import ray

    ensure_ray()
    options = {"num_cpus": 1, "num_gpus": 1 if str(section.device).startswith("cuda") else 0}
    options.update(section.ray_options)
    actor = ray.remote(_Host).options(max_concurrency=1, **options).remote(cls, args)
    ready, _ = ray.wait([actor.get.remote("__class__")], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.kill(actor)
        raise RuntimeError(
            f"could not place {cls.__name__} in a Ray actor within {PLACEMENT_TIMEOUT_S:.0f} s: it asks for "
            f"{options} and the cluster has {ray.available_resources()} free; free resources or set ray_options"
        )
    ray.get(ready[0])  # surfaces a constructor error here, not at the first call
    return RemoteBackend(actor)
