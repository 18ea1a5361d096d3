"""A run's pump threads on the CPU: how many torch threads each gets, and letting the caller's idle OpenMP pool go
(asyncrl/run_loop.py runs the pumps; benchmarks/README.md, "Two torch threads", measured why)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch


def torch_threads_per_pump(cfg: Any, pumps: int) -> int | None:
    """Torch intra-op threads for each pump thread of a run, or None to leave them as they are.

    Two pumps that both compute on this process's CPU (the torch generator in the rollout pump, the torch policy in
    the train pump) each with torch's default of a thread per core ask for twice the cores: their pools then wait
    on each other, and an asynchronous run on 2 cores was slower than stepping (benchmarks/README.md, "Two torch
    threads"). So when ``torch_threads`` is left unset, each of two such pumps gets half the caller's threads; a
    lockstep run (one pump) keeps them all. A set ``torch_threads`` is the person's choice and is kept."""
    if cfg.torch_threads is not None or pumps < 2:
        return None
    on_cpu = all(section.placement == "local" and str(section.device) == "cpu"
                 for section in (cfg.generation, cfg.trainer))
    return max(1, torch.get_num_threads() // 2) if on_cpu else None


def release_idle_openmp_workers() -> bool:
    """Let the calling thread's idle OpenMP workers go; True if a pool was let go.

    Why: GNU libgomp (torch's intra-op threads on Linux) spins a worker between two parallel regions only while it
    manages no more threads than there are CPUs; above that it puts them to sleep after each region, and every op
    then pays a wake-up. The person's thread keeps a pool from its own torch work (building the model, hand ticks);
    beside a pump thread's pool that is one pool too many: on 2 cores with 2 torch threads a lockstep run took
    1.2-1.45x the time of the same ticks by hand (benchmarks/README.md, "Two torch threads").
    ``omp_pause_resource_all`` in libgomp frees only the calling thread's pool (and refuses inside a parallel
    region); the next torch op on this thread builds a new one. A no-op where libgomp is not loaded (other OpenMP
    runtimes pause every thread's pool: not safe here)."""
    pause = _libgomp_pause()
    return pause is not None and pause(1) == 0  # 1: omp_pause_soft


@functools.cache
def _libgomp_pause():
    try:
        with open("/proc/self/maps") as maps:  # Linux: the libgomp torch loaded, wherever its wheel put it
            path = next((line.split()[-1] for line in maps if "/libgomp" in line), None)
        return ctypes.CDLL(path).omp_pause_resource_all if path else None
    except (OSError, AttributeError):
        return None
