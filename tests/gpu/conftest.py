"""What lets ``pytest tests/gpu`` run every file in one process on an 80 GB card (an H100) as on a 143 GB one (an
H200): each file gives the GPU back before the next file builds its own engines, and the check below says so.

Where a file's engines live: module fixtures (``test_megatron_vllm.py``'s ``policy`` and ``generator``), a
test's locals (``test_weight_sync.py``, ``test_gap.py``, ``test_colocated_async.py``: a ``Controller`` or the two
backends, closed in ``finally``/``with``), and two things a file never names: Megatron's process groups and NCCL
communicators (``asyncrl/backends/megatron_parallel.py`` makes them once a process) and torch.compile's caches. On
2026-12-05, on one H100 80GB, vLLM's free memory at each engine start fell 75.8 -> 76.9 -> 56.3 -> 28.8 GiB (on
the H200 of 2026-12-04 136.4 -> 137.6 -> 101.7 -> 56.1 GiB, benchmarks/data/gpu_checks/2026-12-04-one-h200-a99b0ce/
pytest_gpu.log): the engines sized by ``gpu_memory_utilization`` (their KV pool a share of the card: test_gap's,
test_megatron_vllm's) stayed held after their files, the one sized by ``kv_cache_tokens`` (test_colocated_async's)
did not. So every engine here is sized by a token budget as well (its pool is what
its test needs, ~0.1-1 GB), and at the end of each file this fixture

1. collects garbage and empties torch's cache; if the file still holds more than ``HELD_GIB`` over what the
   process held when the file started, it also drops torch.compile's caches (they can keep a compiled model's
   parameters alive) and the process groups (Megatron's, then vLLM's and torch's default group: the next file's
   ``init_parallel`` makes them again), and collects again;
2. records what the file held before and after (a ``RESULT gpu_memory_<file>`` line; ``gpu_memory.json`` under
   ``ASYNCRL_GPU_RESULTS``);
3. fails the file's last test (a teardown error) if it still holds more than ``HELD_GIB``, naming the largest CUDA
   tensors still alive, so a leak shows where it starts instead of as an out-of-memory error two files later.

Without CUDA every GPU file skips at import and this fixture does nothing; what the check decides is tested
without a GPU (``test_give_back.py``)."""

from __future__ import annotations

import gc
import json
import sys
import warnings

import pytest
import torch

HELD_GIB = 3.0  # what a file may leave behind: the CUDA context's growth, cuBLAS workspaces, compiled kernels' code


def used_gib() -> float:
    """Device memory in use on the current GPU, by every process (what vLLM's start-up check reads as not free)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def release(deep: bool) -> None:
    """Collect and empty torch's cache; ``deep`` also drops torch.compile's caches and every process group."""
    gc.collect()
    if deep:
        torch._dynamo.reset()
        try:
            drop_process_groups()
        except Exception as exc:  # noqa: BLE001 - the memory check below is what the file is judged by
            print(f"RESULT gpu_memory_drop_process_groups_failed = {json.dumps(repr(exc))}", flush=True)
        gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def drop_process_groups() -> None:
    """Megatron's model-parallel groups, then vLLM's groups and torch's default group (vLLM's own teardown,
    ``cleanup_dist_env_and_memory``, where vLLM is loaded); a later ``init_parallel`` makes them again."""
    import torch.distributed as dist

    core = sys.modules.get("megatron.core.parallel_state")
    if core is not None and core.model_parallel_is_initialized():
        core.destroy_model_parallel()
    vllm_state = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_state is not None and hasattr(vllm_state, "cleanup_dist_env_and_memory"):
        vllm_state.cleanup_dist_env_and_memory()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def largest_cuda_tensors(n: int = 5) -> list[str]:
    """The ``n`` largest CUDA tensors still reachable, as ``shape dtype GiB`` (what a leak holds)."""
    found = []
    with warnings.catch_warnings():  # some of gc's objects warn when isinstance() looks at them (deprecated aliases)
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.is_cuda:
                    size = obj.numel() * obj.element_size()
                    if type(size) is int:  # torch.compile's fake tensors have symbolic sizes: comparing them raises
                        found.append((size, f"{tuple(obj.shape)} {obj.dtype}"))
            except Exception:  # noqa: BLE001 - some objects raise on isinstance/attribute access
                continue
    found.sort(reverse=True)
    return [f"{what} {size / 2**30:.2f} GiB" for size, what in found[:n]]


_RESULTS: list = []  # one Results("gpu_memory") for the session: gpu_memory.json holds every file's record


def give_back(name: str, before: float) -> dict:
    """After file ``name`` (which started with ``before`` GiB in use): release, record, and fail if it keeps more
    than ``HELD_GIB`` (module docstring). The record: GiB in use before and after, and whether the deep release
    was needed."""
    release(deep=False)
    after, deep = used_gib(), False
    if after - before > HELD_GIB:
        release(deep=True)
        after, deep = used_gib(), True
    if not _RESULTS:
        from tests.gpu.results import Results

        _RESULTS.append(Results("gpu_memory", held_gib_allowed=HELD_GIB))
    record = {"used_gib_before": round(before, 2), "used_gib_after": round(after, 2), "deep_release": deep}
    _RESULTS[0].record(f"gpu_memory_{name}", record)
    assert after - before <= HELD_GIB, (
        f"{name} left {after - before:.1f} GiB of GPU memory held after its engines were closed (at most "
        f"{HELD_GIB} GiB may stay for the next file); largest CUDA tensors alive: {largest_cuda_tensors()}")
    return record


@pytest.fixture(autouse=True, scope="module")
def _give_the_gpu_back_after_each_file(request):
    if not torch.cuda.is_available():
        yield
        return
    before = used_gib()
    yield
    give_back(request.module.__name__.rsplit(".", 1)[-1], before)
