"""One lock per CUDA device for the engines of one process: colocated vLLM and Megatron never interleave GPU work.

Colocated on one GPU (``gpu_quickstart``), the controller's two pumps drive vLLM (rollout pump) and Megatron (train
pump) from two threads of one process. Unserialised, their CUDA work interleaves: two engines issuing kernels,
allocations and an NCCL collective (Megatron's grad-norm ``all_reduce``, even in a world of one) from two threads at
once, which crashed with NCCL "unhandled cuda error" on an H200 and ran only with ``CUDA_LAUNCH_BLOCKING=1``.

Invariant kept here: a block of GPU work of one engine (``with exclusive_device(device, name)``) runs while no
other block on the same device runs in this process, and its work has *finished on the GPU* when the block ends
(the device is synchronised before the lock is released), so nothing of one engine is in flight while the other
issues work. That holds by construction, whatever the threads' timing. The lock is re-entrant (an engine method may
call another locked one). CPU devices take no lock. Across processes (one engine per Ray actor, one GPU each) the
lock is per process and so uncontended.

What it costs: colocated generation and training take turns on the GPU (they did in effect already: one GPU); what
still overlaps is everything outside the blocks (decoding, scoring, batch building, the controller).
``device_lock_stats()`` says how long each engine held the device and waited for it, which is how the one-GPU
benchmark measures the gap between asynchronous and synchronous runs.

Taking turns fairly: a lock released and taken again at once by the same thread (a generator stepping its engine in
a loop) is usually taken again before a waiting thread wakes up, so the waiter can starve. An engine that loops calls
``make_way(device)`` before each block: if another engine of the process waits for the device, it returns once that
one has taken it (or after a timeout), so the engines alternate block by block. ``device_waiters(device)`` says
whether anyone waits (a loop that holds the device across several steps stops at that point).

Overlap (``share_device(device, "overlap")``, which a run sets for config ``device_sharing: overlap``): decoding a
small model leaves the GPU mostly idle (vLLM's CPU loop), so the trainer's forward/backward passes (methods marked
``beside_device``) run outside the lock, on a CUDA stream of the device's own, beside whatever vLLM runs; each such
call synchronises that stream before it returns, and vLLM steps on a high-priority stream (``decode_stream``), so
that its short kernels are not queued behind the passes' long ones. Everything else still takes turns: the
optimizer step (Megatron's grad-norm ``all_reduce``, the collective that crashed unserialised), weight export and
load, a reward model. Kept invariant: locked blocks never run at once, and each ends with *its own* stream
finished (not the device's, which would wait for the passes beside it); nothing beside the lock is in flight when
its thread next takes the lock.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from typing import Any, Iterator

import torch

__all__ = ["exclusive_device", "holds_device", "beside_device", "decode_stream", "share_device", "device_sharing",
           "finish_own_work", "device_lock_stats", "device_lock_spans", "device_waiters", "make_way"]

_GUARD = threading.Lock()
_LOCKS: dict[int, threading.RLock] = {}
_STATS: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # name -> [held_s, waited_s, blocks]
_DEPTH = threading.local()
_WAITERS: dict[int, int] = defaultdict(int)  # device -> threads blocked in exclusive_device's outer acquire
_TAKEN: dict[int, int] = defaultdict(int)  # device -> outer blocks started (make_way watches it move)
# The latest blocks as (name, start, end) in time.perf_counter() seconds: CLOCK_MONOTONIC on Linux, one clock for
# every process of the host, so a benchmark can lay the GPU blocks of two actors beside the driver's calls.
_SPANS: deque[tuple[str, float, float]] = deque(maxlen=20_000)
_SHARING: dict[int, str] = {}  # device -> "overlap" while a run shares it so (share_device); absent: "turns"
_BESIDE: dict[int, Any] = {}  # device -> the CUDA stream that ``beside_device`` work runs on (made at first use)
_DECODE: dict[int, Any] = {}  # device -> the high-priority stream a generator steps on beside them (decode_stream)


@contextmanager
def exclusive_device(device: Any, name: str = "engine") -> Iterator[None]:
    """Hold ``device`` for a block of GPU work (see the module docstring); no-op off CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda":
        yield
        return
    index = _index(dev)
    with _GUARD:
        lock = _LOCKS.setdefault(index, threading.RLock())
    outer = getattr(_DEPTH, "n", 0) == 0
    asked = time.perf_counter()
    if outer:
        with _GUARD:
            _WAITERS[index] += 1
    try:
        lock.acquire()
    finally:
        if outer:
            with _GUARD:
                _WAITERS[index] -= 1
                _TAKEN[index] += 1
    try:
        got = time.perf_counter()
        _DEPTH.n = getattr(_DEPTH, "n", 0) + 1
        try:
            yield
        finally:
            try:
                finish_own_work(index)  # nothing of this block still runs when the other engine starts
            finally:
                _DEPTH.n -= 1
                if outer:
                    _record(name, asked, got, time.perf_counter())
    finally:
        lock.release()


def _record(name: str, asked: float, got: float, end: float) -> None:
    with _GUARD:  # read by device_lock_spans() and device_lock_stats() from other threads
        _SPANS.append((name, got, end))
        entry = _STATS[name]
        entry[0] += end - got
        entry[1] += got - asked
        entry[2] += 1


def finish_own_work(device: Any) -> None:
    """Wait until the GPU work this thread issued on ``device`` has finished: the whole device under "turns", the
    thread's current stream under "overlap" (the device would also wait for the passes running beside)."""
    index = device if isinstance(device, int) else _index(torch.device(device))
    if _SHARING.get(index) == "overlap":
        torch.cuda.current_stream(index).synchronize()
    else:
        torch.cuda.synchronize(index)


def share_device(device: Any, mode: str) -> None:
    """How the engines of this process share ``device`` from now on: "turns" (every block of GPU work exclusive)
    or "overlap" (``beside_device`` work outside the lock: module docstring). No-op off CUDA."""
    if mode not in ("turns", "overlap"):
        raise ValueError(f"device sharing {mode!r}: use 'turns' or 'overlap'")
    dev = torch.device(device)
    if dev.type != "cuda" or device_sharing(dev) == mode:
        return
    with _GUARD:
        if mode == "overlap":
            _SHARING[_index(dev)] = mode
        else:
            _SHARING.pop(_index(dev), None)
    # The caching allocator keeps freed blocks per stream, and the trainer's passes change stream here: give back
    # what the other stream cached, or a micro-batch budget fitted to the memory free at the first step (Megatron
    # on CUDA) would need its activations' memory twice.
    torch.cuda.empty_cache()


def device_sharing(device: Any) -> str:
    """"turns" or "overlap" (``share_device``); "turns" off CUDA."""
    dev = torch.device(device)
    return _SHARING.get(_index(dev), "turns") if dev.type == "cuda" else "turns"


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def device_waiters(device: Any) -> int:
    """Threads of this process waiting to start a block on ``device`` now (0 off CUDA)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    with _GUARD:
        return _WAITERS[_index(dev)]


def make_way(device: Any, timeout_s: float = 1.0) -> None:
    """If another thread waits for ``device``, return once it has started its block (or after ``timeout_s``);
    otherwise at once. Called by an engine that loops over blocks, before each, so that a waiter is never starved
    (module docstring)."""
    dev = torch.device(device)
    if dev.type != "cuda" or getattr(_DEPTH, "n", 0):
        return  # inside a block of its own a thread cannot let another one in
    index = _index(dev)
    with _GUARD:
        if not _WAITERS[index]:
            return
        taken = _TAKEN[index]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.0002)
        with _GUARD:
            if _TAKEN[index] != taken or not _WAITERS[index]:
                return


def holds_device(method):
    """Method decorator: run the method inside ``exclusive_device(self.device, <class name>)``."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with exclusive_device(self.device, type(self).__name__):
            return method(self, *args, **kwargs)

    return wrapper


def _stream(streams: dict[int, Any], index: int, **kwargs: Any) -> Any:
    """The stream of ``streams`` for device ``index``, made at first use (``torch.cuda.Stream`` keyword arguments)."""
    with _GUARD:
        if index not in streams:
            streams[index] = torch.cuda.Stream(index, **kwargs)
        return streams[index]


@contextmanager
def decode_stream(device: Any) -> Iterator[None]:
    """The generator's engine steps while the device is shared by "overlap": on a high-priority stream of the
    device's own, so that the GPU's scheduler starts a decode step's kernels before the pending blocks of the passes
    beside it (a step's latency is what paces vLLM's loop); otherwise on the thread's stream. Enter it before the
    step's ``exclusive_device``, whose end then waits for this stream."""
    dev = torch.device(device)
    if device_sharing(dev) != "overlap":
        yield
        return
    index = _index(dev)
    stream = _stream(_DECODE, index, priority=-1)
    stream.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(stream):
        yield


def beside_device(method):
    """Method decorator for a trainer's forward/backward passes: as ``holds_device``, except while the device is
    shared by "overlap" (and the thread holds no block): then outside the lock, on the device's beside stream
    (after the work this thread issued before), synchronised before returning, recorded as "<class> beside"."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        dev = torch.device(self.device)
        if device_sharing(dev) != "overlap" or getattr(_DEPTH, "n", 0):
            with exclusive_device(dev, type(self).__name__):
                return method(self, *args, **kwargs)
        index = _index(dev)
        stream = _stream(_BESIDE, index)
        start = time.perf_counter()
        stream.wait_stream(torch.cuda.current_stream(index))  # its inputs, copied on the thread's stream, first
        try:
            with torch.cuda.stream(stream):
                return method(self, *args, **kwargs)
        finally:
            stream.synchronize()
            _record(f"{type(self).__name__} beside", start, start, time.perf_counter())

    return wrapper


def device_lock_stats(reset: bool = False) -> dict[str, dict[str, float]]:
    """Per engine (class name): seconds it held a device, seconds it waited for one, and blocks, in this process."""
    with _GUARD:
        out = {k: {"held_s": v[0], "waited_s": v[1], "blocks": v[2]} for k, v in _STATS.items()}
        if reset:
            _STATS.clear()
    return out


def device_lock_spans() -> list[tuple[str, float, float]]:
    """The latest blocks of GPU work in this process (at most 20,000): ``(engine, start, end)``, perf_counter
    seconds, oldest first."""
    with _GUARD:
        return list(_SPANS)
