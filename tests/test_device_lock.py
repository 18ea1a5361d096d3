"""The per-device lock that keeps colocated vLLM and Megatron from interleaving GPU work
(asyncrl/backends/device_lock.py).

On CPU the CUDA calls it makes (``synchronize``, ``current_device``) are replaced by recorders, so what is checked is
the ordering it guarantees: one block at a time per device, the device synchronised before the next block starts."""

from __future__ import annotations

import threading
import time

import torch

from asyncrl.backends import device_lock
from asyncrl.backends.device_lock import device_lock_stats, exclusive_device, holds_device


def test_blocks_on_one_device_never_overlap_and_each_ends_synchronised(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: log.append(f"sync{index}"))
    inside = threading.Event()
    release = threading.Event()

    def first():
        with exclusive_device("cuda:0", "vllm"):
            log.append("vllm-start")
            inside.set()
            assert release.wait(5)
            log.append("vllm-end")

    def second():
        with exclusive_device(torch.device("cuda", 0), "megatron"):
            log.append("megatron-start")

    t1 = threading.Thread(target=first)
    t1.start()
    assert inside.wait(5)
    t2 = threading.Thread(target=second)
    t2.start()
    time.sleep(0.2)
    assert "megatron-start" not in log  # waits for the device, whatever the threads' timing
    release.set()
    t1.join(5)
    t2.join(5)
    assert log == ["vllm-start", "vllm-end", "sync0", "megatron-start", "sync0"]
    stats = device_lock_stats()
    assert stats["megatron"]["waited_s"] >= 0.15 and stats["vllm"]["held_s"] >= 0.15


def test_other_devices_and_the_cpu_are_independent_and_nesting_is_allowed(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: log.append(f"sync{index}"))
    with exclusive_device("cuda:0"):
        done = threading.Event()

        def other():
            with exclusive_device("cuda:1"):
                with exclusive_device("cpu"):
                    done.set()

        threading.Thread(target=other).start()
        assert done.wait(5)  # cuda:1 and the CPU are not held by a block on cuda:0
        with exclusive_device("cuda:0"):  # re-entrant: an engine method may call another locked one
            log.append("nested")
    assert log == ["sync1", "nested", "sync0", "sync0"]


def test_holds_device_uses_the_engines_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: None)
    seen = []

    class Engine:
        device = torch.device("cuda", 3)

        @holds_device
        def step(self, x):
            seen.append(device_lock._LOCKS[3]._is_owned())
            return x + 1

    assert Engine().step(1) == 2 and seen == [True]


class _Streams:
    """CPU stand-ins for the CUDA stream calls ``beside_device`` makes, logging what happens to which stream."""

    def __init__(self, monkeypatch, log: list[str]) -> None:
        from contextlib import contextmanager

        self.log = log
        monkeypatch.setattr(device_lock, "_SHARING", {})
        monkeypatch.setattr(device_lock, "_BESIDE", {})
        monkeypatch.setattr(device_lock, "_DECODE", {})
        monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: log.append(f"sync-device{index}"))
        def stream(index=None, priority=0):
            return self.Stream(f"{'decode' if priority < 0 else 'beside'}{index}")

        monkeypatch.setattr(torch.cuda, "Stream", stream)
        self.current = threading.local()
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda index=None: getattr(self.current, "stream", None) or self.Stream("current"))

        @contextmanager
        def on(stream):
            log.append(f"on-{stream.name}")
            before, self.current.stream = getattr(self.current, "stream", None), stream
            try:
                yield
            finally:
                self.current.stream = before

        monkeypatch.setattr(torch.cuda, "stream", on)

    def Stream(self, name: str):
        log = self.log

        class Stream:
            def wait_stream(self, other):
                log.append(f"{name}-waits-{other.name}")

            def synchronize(self):
                log.append(f"sync-{name}")

        stream = Stream()
        stream.name = name
        return stream


class _Trainer:
    device = torch.device("cuda", 0)

    def __init__(self, log: list[str]) -> None:
        self.log = log

    @device_lock.beside_device
    def passes(self):
        lock = device_lock._LOCKS.get(0)
        self.log.append(f"passes (lock held: {lock is not None and lock._is_owned()})")
        return "done"


def test_overlap_runs_the_passes_beside_a_held_block_on_their_own_stream(monkeypatch):
    log: list[str] = []
    _Streams(monkeypatch, log)
    device_lock.share_device("cuda:0", "overlap")
    assert device_lock.device_sharing("cuda:0") == "overlap" and device_lock.device_sharing("cpu") == "turns"
    inside, release = threading.Event(), threading.Event()

    def vllm():
        with device_lock.decode_stream("cuda:0"), exclusive_device("cuda:0", "VLLMGenerator"):
            inside.set()
            assert release.wait(5)

    t = threading.Thread(target=vllm)
    t.start()
    assert inside.wait(5)
    assert _Trainer(log).passes() == "done"  # while vLLM holds the device: it would deadlock under "turns"
    release.set()
    t.join(5)
    # vLLM steps on its high-priority stream; the passes after what their thread issued before, on the beside
    # stream, that stream finished before returning; the held block ends with its own stream finished, not the
    # device's (which would wait for the passes)
    assert log == ["decode0-waits-current", "on-decode0", "beside0-waits-current", "on-beside0",
                   "passes (lock held: False)", "sync-beside0", "sync-decode0"]
    assert device_lock.device_lock_stats()["_Trainer beside"]["blocks"] >= 1


def test_taking_turns_again_the_passes_wait_for_the_device(monkeypatch):
    log: list[str] = []
    _Streams(monkeypatch, log)
    device_lock.share_device("cuda:0", "overlap")
    device_lock.share_device("cuda:0", "turns")
    assert _Trainer(log).passes() == "done"
    with device_lock.decode_stream("cuda:0"), exclusive_device("cuda:0", "VLLMGenerator"):
        log.append("steps")
    assert log == ["passes (lock held: True)", "sync-device0", "steps", "sync-device0"]  # the thread's own stream
    try:
        device_lock.share_device("cuda:0", "sometimes")
    except ValueError as err:
        assert str(err) == "device sharing 'sometimes': use 'turns' or 'overlap'"
    else:
        raise AssertionError("an unknown sharing mode was accepted")
