"""Weight sync: how the generator gets the policy's weights after each optimizer step (``generation.weight_sync``).

- ``driver`` (the default): ``generator.load_weights(policy.export_weights(), T)`` called from the controller's
  process. In-process that passes tensors by reference; with backends in Ray actors the weights travel
  policy actor -> driver -> generator actor (two copies through the object store).
- ``collective``: both backends in Ray actors (``placement: ray`` for both) and the weights go straight from the
  policy actor to the generator actor over a two-rank ``torch.distributed`` process group: NCCL when both devices
  are CUDA, gloo when both are CPU (CPU tests stand two actors in for two GPUs). The driver sends no tensors.

The collective mechanism, in full:

Setup (once, ``CollectiveWeightSync.__init__``):
1. The policy actor (rank 0, the sender) opens a ``TCPStore`` on 127.0.0.1 and a free port and exports its weights
   once to fix the *metadata*: HF names in ``export_weights()``'s order, shapes, dtypes. It returns the port and
   the metadata to the driver (a few hundred bytes). 127.0.0.1: both actors must be on one host.
2. The driver launches ``connect`` on both actors at once (the rendezvous needs both): each builds its own
   process-group object on that store (``ProcessGroupNCCL`` / ``ProcessGroupGloo``, never the default group, which
   Megatron and vLLM own in those processes) and runs one small broadcast, so the NCCL communicator is created
   here and not in the first step. The generator (rank 1, the receiver) allocates one receive buffer per tensor.

A sync (``CollectiveWeightSync(version)``, one call on the driver): the driver launches ``send`` on the policy actor
and ``receive`` on the generator actor, both ``.remote()`` before either ``ray.get``, then waits for both.
- ``send``: ``export_weights()``, check it against the metadata, broadcast a header ``[ok, version]``, then each
  tensor in metadata order. If the export fails or no longer matches, the header says so (``ok = 0``), so the
  receiver raises instead of waiting for tensors that will never come.
- ``receive``: the header, then each tensor into its buffer, then the weights go to the generator:
  - a generator with ``stage_weights`` (vLLM) runs the receive *inside* ``stage_weights(buffers, version, fill)``,
    under its staging lock, while the engine may be generating (its actor serves two calls at once,
    ``ray_max_concurrency``): the trainer never waits for generation. The transfer runs on a CUDA stream of its
    own, so it neither waits for nor delays the engine's kernels; the receive returns once the buffers are full (the
    generator's ``version`` says the new one from then on) and the generator swaps them in between two engine
    steps (``generation.weight_update``: ``drain`` after the groups submitted before them, ``inflight`` at once;
    ``asyncrl/backends/vllm.py``);
  - any other generator: ``load_weights(received, version)`` after the receive (its actor serves one call at a
    time, so that waits for a running ``poll``).
  Either way the version is set only after the whole receive completed, and the generator must copy out of the
  buffers before the next sync writes them (``load_weights`` copies; the staging lock orders receive and swap).

NVLink multicast stays off: with NCCL, ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` are in the actors' runtime env (``asyncrl.backends.ray.remote`` puts them there for every
CUDA actor) and set again here before the NCCL group is made.

Limits: one host; the policy in one process (Megatron TP/DP > 1 in a Ray actor is not supported by the placement
itself); with a generator that cannot stage, the sync holds both actors for its duration (the sender waits for the
receiver to be free).
"""

from __future__ import annotations

import datetime
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.backends.base import capabilities
from asyncrl.backends.ray import NO_MULTICAST_ENV, RemoteBackend

GROUP_TIMEOUT_S = 300.0  # a broadcast waits at most this long for the other side
SENDER, RECEIVER = 0, 1


def collective_backend(cfg: Any) -> str:
    """``nccl`` when the devices are CUDA, ``gloo`` when they are CPU (``Config`` validated they agree)."""
    return "nccl" if str(cfg.trainer.device).startswith("cuda") else "gloo"


def build_weight_sync(cfg: Any, policy: Any, generator: Any):
    """The callable ``sync(version)`` the controller uses, as ``cfg.generation.weight_sync`` says (a LoRA run on
    vLLM: the adapter alone, ``AdapterWeightSync``)."""
    if serves_adapters(cfg):
        return AdapterWeightSync(policy, generator)
    if cfg.generation.weight_sync == "driver":
        return DriverWeightSync(policy, generator)
    if not (isinstance(policy, RemoteBackend) and isinstance(generator, RemoteBackend)):
        raise ValueError(
            "generation.weight_sync 'collective' needs both backends in Ray actors (trainer.placement and "
            f"generation.placement 'ray'); got {type(policy).__name__} and {type(generator).__name__}"
        )
    return CollectiveWeightSync(policy, generator, collective_backend(cfg), cfg.trainer.device, cfg.generation.device)


def serves_adapters(cfg: Any) -> bool:
    """Whether the generator takes the LoRA adapter itself (``model.lora`` with vLLM) rather than merged weights."""
    return cfg.model.lora is not None and cfg.generation.backend == "vllm"


def payload_bytes(tensors: Any) -> int:
    """Bytes of a dict of tensors (arrays: their ``nbytes``; anything else counts 0): what a sync moved."""
    return sum(int(getattr(t, "nbytes", 0)) for t in tensors.values())


class DriverWeightSync:
    """``generator.load_weights(policy.export_weights(), version)``, from the calling process. ``last_bytes``: the
    payload of the last sync (the ``sync_bytes`` metric)."""

    mode = "driver"

    def __init__(self, policy: Any, generator: Any) -> None:
        self.policy, self.generator = policy, generator
        self.last_bytes = 0

    def __call__(self, version: int) -> None:
        weights = self.policy.export_weights()
        self.last_bytes = payload_bytes(weights)
        self.generator.load_weights(weights, version)


class AdapterWeightSync:
    """A LoRA run on vLLM: ``generator.load_adapter(policy.export_adapter(), version)``, from the calling process.
    Only the adapter travels (``last_bytes``: its tensors' bytes, not the model's); the generator registers it as
    version ``version``'s adapter beside the older ones its groups still use (``asyncrl/backends/vllm_lora.py``)."""

    mode = "adapter"

    def __init__(self, policy: Any, generator: Any) -> None:
        self.policy, self.generator = policy, generator
        self.last_bytes = 0

    def __call__(self, version: int) -> None:
        adapter = self.policy.export_adapter()
        self.last_bytes = adapter.nbytes
        self.generator.load_adapter(adapter, version)


class CollectiveWeightSync:
    """Policy actor -> generator actor over a two-rank process group (see the module docstring).

    ``syncs``, ``bytes_sent`` (payload bytes of all syncs) and ``last_send_s`` / ``last_receive_s`` (time inside
    the two actors' calls of the last sync, as they measured it) are for benchmarks."""

    mode = "collective"

    def __init__(self, policy: Any, generator: Any, backend: str, policy_device: str, generator_device: str,
                 timeout_s: float = GROUP_TIMEOUT_S) -> None:
        import ray

        self.policy, self.generator, self.backend = policy, generator, backend
        port, meta = ray.get(policy.apply_remote(_listen))
        ray.get([
            policy.apply_remote(_connect, SENDER, port, meta, backend, policy_device, timeout_s),
            generator.apply_remote(_connect, RECEIVER, port, meta, backend, generator_device, timeout_s),
        ])
        self.meta = meta
        self.syncs, self.bytes_sent, self.last_bytes = 0, 0, 0
        self.last_send_s = self.last_receive_s = float("nan")

    def __call__(self, version: int) -> None:
        import ray

        send = self.policy.apply_remote(_send, int(version))  # both launched before waiting on either
        receive = self.generator.apply_remote(_receive, int(version))
        nbytes, self.last_send_s = ray.get(send)
        self.last_receive_s = ray.get(receive)
        self.syncs += 1
        self.bytes_sent += nbytes
        self.last_bytes = nbytes

    def __repr__(self) -> str:
        return f"CollectiveWeightSync({self.backend}, {len(self.meta)} tensors, {self.syncs} syncs)"


# ---- what runs inside the actors: fn(host, ...) via RemoteBackend.apply_remote; host.obj is the backend --------


@dataclass
class _Endpoint:
    rank: int
    group: Any
    meta: list[tuple[str, tuple[int, ...], torch.dtype]]
    device: torch.device
    store: Any = None  # the sender keeps the TCPStore server alive
    stream: Any = None  # the receiver's own CUDA stream: a transfer never queues behind the engine's kernels
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def _metadata(weights: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in weights.items()]


def _listen(host: Any) -> tuple[int, list]:
    """Sender: a TCPStore on a free port (kept until ``_connect``) and the metadata of the exported weights."""
    import torch.distributed as dist

    host.weight_sync_store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    return host.weight_sync_store.port, _metadata(host.obj.export_weights())


def _device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _connect(host: Any, rank: int, port: int, meta: list, backend: str, device: str, timeout_s: float) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = host.__dict__.pop("weight_sync_store", None) if rank == SENDER else (
        dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout))
    prefixed = dist.PrefixStore("asyncrl/weight_sync/", store)
    dev = _device(device)
    if backend == "nccl":
        os.environ.update(NO_MULTICAST_ENV)
        torch.cuda.set_device(dev)
        group = dist.ProcessGroupNCCL(prefixed, rank, 2, timeout)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    ep = _Endpoint(rank, group, meta, dev, store=store)
    if rank == RECEIVER:
        ep.buffers = {name: torch.empty(shape, dtype=dtype, device=dev) for name, shape, dtype in meta}
        if dev.type == "cuda":
            ep.stream = torch.cuda.Stream(dev)
            ep.stream.wait_stream(torch.cuda.current_stream(dev))  # the buffers' allocation comes first
    _broadcast(ep, [torch.zeros(2, dtype=torch.int64, device=dev)])  # creates the NCCL communicator now
    host.weight_sync = ep


def _broadcast(ep: _Endpoint, tensors: list[torch.Tensor]) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = SENDER
    stream = ep.stream if ep.stream is not None else (
        torch.cuda.current_stream(ep.device) if ep.device.type == "cuda" else None)
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        works = [ep.group.broadcast([t], opts) for t in tensors]  # in order on both ranks; waited together
        for work in works:
            work.wait()
    if stream is not None:
        stream.synchronize()  # the tensors must outlive the transfer; the receiver reads them next (any stream)


def _send(host: Any, version: int) -> tuple[int, float]:
    """Sender: export, check against the metadata, header ``[ok, version]``, then the tensors. Returns
    ``(payload bytes, seconds)``."""
    ep: _Endpoint = host.weight_sync
    start = time.perf_counter()
    header = torch.tensor([1, version], dtype=torch.int64, device=ep.device)
    try:
        weights = host.obj.export_weights()
        if _metadata(weights) != ep.meta:
            raise RuntimeError(
                "export_weights() no longer matches the names/shapes/dtypes agreed at setup: "
                f"{_metadata(weights)[:3]}... vs {ep.meta[:3]}..."
            )
        tensors = [weights[name].to(ep.device).contiguous() for name, _, _ in ep.meta]
    except BaseException:
        header[0] = 0  # tell the receiver not to wait for tensors
        _broadcast(ep, [header])
        raise
    _broadcast(ep, [header] + tensors)
    return sum(t.numel() * t.element_size() for t in tensors), time.perf_counter() - start


def _receive(host: Any, version: int) -> float:
    """Receiver: the header, the tensors into the buffers, then the weights to the generator (staged, or
    ``load_weights``; see the module docstring)."""
    ep: _Endpoint = host.weight_sync
    start = time.perf_counter()

    def fill() -> None:
        header = torch.zeros(2, dtype=torch.int64, device=ep.device)
        _broadcast(ep, [header])
        ok, sent_version = (int(x) for x in header.tolist())
        if not ok:
            raise RuntimeError("weight sync: the policy actor failed to export its weights (its error is raised there)")
        _broadcast(ep, [ep.buffers[name] for name, _, _ in ep.meta])
        if sent_version != version:  # received in full first, so the group stays in step
            raise RuntimeError(
                f"weight sync: the policy sent version {sent_version}, the controller asked for {version}")

    if capabilities(host.obj).stages_weights:
        host.obj.stage_weights(ep.buffers, version, fill)
    else:
        fill()
        host.obj.load_weights(ep.buffers, version)
    return time.perf_counter() - start
