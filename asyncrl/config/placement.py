"""Where the engines run: what every engine's section has (``Placement``: device, placement, Ray actor options),
``ray:`` (the Ray session they share), and the rules that join the ``generation`` and ``trainer`` placements.

Invariants:
- A section is a ``StrictModel``: an unknown key is an error listing the allowed ones.
- ``check_placement`` is given the two sections, never the whole config: it judges placement and nothing else.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.strict import StrictModel


class Placement(StrictModel):
    """What every engine's section has: the backend it names, and where it runs."""

    backend: str  # each variant narrows it to its Literal name (the discriminator)
    device: str = Field("cpu", description="torch device the engine runs on: 'cpu', 'cuda', 'cuda:1', ...")
    placement: Literal["local", "ray"] = Field(
        "local", description="'local': in the controller's process; 'ray': in a Ray actor of its own")
    ray_options: dict[str, Any] = Field(
        default_factory=dict, description="options of the Ray actor when placement is 'ray' (num_gpus, num_cpus, "
        "runtime_env, resources, ...); see asyncrl/backends/ray.py")


class RayConfig(BaseModel):
    """``ray:`` — the Ray session behind every ``placement: ray`` backend, generation replica and trainer rank."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None, description="join this Ray cluster ('auto': the one `ray start` started on this machine; "
        "'HOST:6379'); None: the RAY_ADDRESS environment variable, else a local Ray (docs/cluster.md)")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a locally started Ray (None: all)")
    placement_timeout_s: float = Field(
        60.0, gt=0, description="how long trainer ranks and generation replicas wait for their resources before "
        "the run fails with what was asked and what the cluster has")


def check_placement(gen: Any, trainer: Any) -> None:
    """The rules that join ``generation`` and ``trainer`` (ValueError naming both sides). Replicas and ranks are
    Ray actors (Megatron ranks may also come from torchrun, with placement 'local'); what is not built yet says
    so by its knob."""
    if gen.backend == "simulated" and trainer.backend == "simulated" and trainer.colocated:
        gpus = gen.replicas * gen.gpus_per_replica
        if trainer.data_parallel > gpus:
            raise ValueError(f"trainer.colocated with data_parallel {trainer.data_parallel}: the ranks share the "
                             f"generation replicas' {gpus} GPU(s); use data_parallel <= {gpus} or colocated false")
    if gen.replicas > 1 and gen.placement != "ray" and gen.backend != "simulated":  # simulated: modelled engines
        raise ValueError(f"generation.replicas {gen.replicas} starts each replica in a Ray actor: set "
                         f"generation.placement 'ray' (got {gen.placement!r})")
    ranks = trainer.ranks
    if trainer.backend == "torch" and ranks > 1 and trainer.placement != "ray":
        raise ValueError(f"trainer.data_parallel {trainer.data_parallel} starts each rank in a Ray actor: set "
                         f"trainer.placement 'ray' (got {trainer.placement!r})")
    if gen.weight_sync == "collective" and (gen.replicas > 1 or ranks > 1):
        raise ValueError(
            f"generation.weight_sync 'collective' joins one policy actor and one generator actor; with "
            f"generation.replicas {gen.replicas} and {ranks} trainer rank(s) use weight_sync 'driver'"
        )
    if gen.weight_sync == "collective":
        _check_collective_weight_sync(gen, trainer)


def shared_cuda_index(gen: Any, trainer: Any) -> int | None:
    """The CUDA device generation and training share in this process (both placed 'local'), else None. ``cuda``
    is the current device, taken as 0 (a process that moves it also names its devices)."""
    def index(device: Any) -> int | None:
        device = str(device)
        return int(device.partition(":")[2] or 0) if device.startswith("cuda") else None

    same = gen.placement == trainer.placement == "local" and index(gen.device) == index(trainer.device)
    return index(gen.device) if same else None


def check_overlap(gen: Any, trainer: Any) -> None:
    """``device_sharing: overlap`` runs Megatron's passes beside vLLM on the one CUDA device they share here."""
    if (gen.backend, trainer.backend) != ("vllm", "megatron") or shared_cuda_index(gen, trainer) is None:
        raise ValueError(
            f"device_sharing 'overlap' runs Megatron's passes beside vLLM on the CUDA device both use in this "
            f"process; got generation {gen.backend!r} on {gen.device!r} ({gen.placement}) and trainer "
            f"{trainer.backend!r} on {trainer.device!r} ({trainer.placement}): use device_sharing 'turns'")


def _check_collective_weight_sync(gen: Any, trainer: Any) -> None:
    placements = (trainer.placement, gen.placement)
    if placements != ("ray", "ray"):
        raise ValueError(
            "generation.weight_sync 'collective' sends weights from the policy's Ray actor to the generator's, so "
            f"both need placement 'ray'; got trainer.placement {placements[0]!r} and generation.placement "
            f"{placements[1]!r} (use weight_sync 'driver' otherwise)"
        )
    devices = (str(trainer.device), str(gen.device))
    if not (all(d.startswith("cuda") for d in devices) or all(d == "cpu" for d in devices)):
        raise ValueError(
            f"generation.weight_sync 'collective' needs both backends on CUDA (NCCL) or both on CPU (gloo); got "
            f"trainer.device {devices[0]!r} and generation.device {devices[1]!r}"
        )
