"""Megatron-core's distributed setup: ``torch.distributed`` and the model-parallel groups, created only if nobody
did yet (a lone process gets a world of one on a free local port), and the training device.

Who makes the process group: ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment, one controller per rank),
a Ray rank group (``asyncrl/backends/ranks.py`` joins every rank actor into one group before it builds the
policy), or, for a single rank, ``init_parallel`` itself.

Groups outlive whoever tore their world down: vLLM's engine, colocated in the same process, destroys the default
process group when it shuts down (``cleanup_dist_env_and_memory``: ``destroy_process_group()``, every group and its
NCCL communicators with it), while Megatron's ``parallel_state`` still holds its groups. A later policy in that
process would train on aborted communicators (``NCCL communicator was aborted`` in DDP's gradient sync, as
``pytest tests/gpu`` in one process did). So ``init_parallel`` remembers the default group it made Megatron's groups
under and makes them again when that group is gone; groups someone else made are left as they are."""

from __future__ import annotations

import os
import socket

import torch

__all__ = ["init_parallel", "resolve_device"]

_MADE_UNDER: list = []  # the default process group init_parallel made Megatron's groups under (module docstring)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Megatron-core on a machine without CUDA runs with two workarounds (measured with 0.16.1): several of its
# modules ask ``torch.cuda.current_device()`` for the device, which raises without CUDA, so it answers "cpu"; and
# the model-parallel RNG tracker is the inference one (dropout is 0, so it is never asked for randomness). Only a
# CPU trainer on a machine without CUDA gets them; on GPUs the library runs unpatched.


def init_parallel(tensor_parallel: int, data_parallel: int, device: torch.device, seed: int) -> None:
    """Initialise ``torch.distributed`` (if nobody did) and Megatron's model-parallel groups (if nobody did).

    Under a launcher (``RANK``/``WORLD_SIZE`` in the environment) the process group comes from ``env://``;
    a lone process gets a world of one on a free local port. NCCL on CUDA, gloo otherwise."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if device.type != "cuda" and not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if tensor_parallel * data_parallel != world:
        raise ValueError(
            f"tensor_parallel {tensor_parallel} x data_parallel {data_parallel} != world size {world}"
            " (pipeline parallelism is not supported)"
        )
    if parallel_state.model_parallel_is_initialized() and _MADE_UNDER and _MADE_UNDER[0] is not dist.group.WORLD:
        parallel_state.destroy_model_parallel()  # made under a world that was torn down since: stale
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
        _MADE_UNDER[:] = [dist.group.WORLD]
    have_tp = parallel_state.get_tensor_model_parallel_world_size()
    have_dp = parallel_state.get_data_parallel_world_size()
    if (have_tp, have_dp) != (tensor_parallel, data_parallel):
        raise ValueError(
            f"model parallelism is already initialised with TP={have_tp}, DP={have_dp}; "
            f"the trainer config asks for TP={tensor_parallel}, DP={data_parallel}"
        )
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def resolve_device(spec: str) -> torch.device:
    device = torch.device(spec)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        torch.cuda.set_device(device)
    return device
