"""LoRA adapters in vLLM's engine, one per weight version, for the vLLM generator of a ``model.lora`` run
(``asyncrl/backends/vllm.py``): the engine serves the frozen base model, and each weight sync registers the trained
adapter as a new vLLM adapter instead of loading merged weights.

Invariants:
- **One adapter per weight version.** ``add(adapter, version)`` writes the adapter as a peft directory (vLLM loads
  adapters from disk; ``add_lora`` from disk took 33-52 ms at the 0.5B shape, issue 48) under this generator's own
  temporary directory, gives it an id never used before (``lora_int_id`` > 0; a version loaded twice, as after a
  restore, gets a new id and its own directory) and registers it (``engine.add_lora``). It is the *current* adapter
  from then on: new groups start on it.
- **A group finishes on the adapter it started with.** A group takes its adapter once (``Entry``) and every request
  of it carries that ``LoRARequest``, so a later sync never changes the weights a group samples with: its
  ``gen_start_version`` and ``gen_end_version`` are both that adapter's version, and every token's version
  (``token_versions``) is the one that sampled it, as before.
- **Old adapters go.** ``prune(in_use)`` removes (``engine.remove_lora``, then its directory) every adapter that is
  neither current nor used by a queued or running group; so the engine holds at most one adapter per version a group
  in flight uses, plus the current one: at most the sampler's window W + 1 (``generation.max_loras``, checked
  against W by the configuration). vLLM reloads an adapter its LRU cache dropped from its directory, which stays
  until pruned.
- Before the first sync no adapter exists: groups run on the base model, which is version 0's weights (a new
  adapter's ``lora_B`` is zero).
- The caller holds the engine between two steps around ``add`` and ``prune`` (they call it).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from asyncrl.backends.device_lock import exclusive_device
from asyncrl.backends.lora import LoraAdapter, write_adapter_dir

@dataclass(frozen=True)
class Entry:
    """A registered adapter: the weight version it is, and the request object groups carry."""

    version: int
    request: Any  # vllm.lora.request.LoRARequest

    @property
    def lora_id(self) -> int:
        return int(self.request.lora_int_id)


class Adapters:
    """The adapters registered in one engine (module docstring). ``make_request(name, id, path)`` builds a
    ``LoRARequest`` (tests pass a fake)."""

    def __init__(self, engine: Any, make_request: Callable[[str, int, str], Any]) -> None:
        self.engine, self.make_request = engine, make_request
        self.root = Path(tempfile.mkdtemp(prefix="asyncrl-lora-"))
        self.registered: dict[int, Entry] = {}  # lora id -> entry
        self.current: Entry | None = None
        self._ids = 0

    def write(self, adapter: LoraAdapter, version: int) -> tuple[int, Path, float]:
        """Write ``adapter`` to a directory of its own (before taking the engine: the write needs none); returns
        its new id, the directory and the seconds the write took."""
        t0 = time.perf_counter()
        self._ids += 1
        path = write_adapter_dir(adapter, self.root / f"v{int(version)}-id{self._ids}")
        return self._ids, path, time.perf_counter() - t0

    def add(self, lora_id: int, path: Path, version: int) -> Entry:
        """Register the adapter ``write`` put at ``path`` as ``version``'s; it becomes the current one."""
        entry = Entry(int(version), self.make_request(f"v{int(version)}-id{lora_id}", lora_id, str(path)))
        if self.engine.add_lora(entry.request) is False:
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"vLLM refused LoRA adapter {entry.request.lora_name} (add_lora returned False)")
        self.registered[lora_id] = entry
        self.current = entry
        return entry

    def prune(self, in_use: set[int]) -> list[int]:
        """Remove every adapter neither current nor in ``in_use`` (lora ids); returns the ids removed."""
        keep = set(in_use) | ({self.current.lora_id} if self.current is not None else set())
        gone = [i for i in self.registered if i not in keep]
        for lora_id in gone:
            entry = self.registered.pop(lora_id)
            try:
                self.engine.remove_lora(lora_id)
            finally:
                shutil.rmtree(entry.request.lora_path, ignore_errors=True)
        return gone

    def close(self) -> None:
        self.registered, self.current = {}, None
        shutil.rmtree(self.root, ignore_errors=True)


class ServesAdapters:
    """The LoRA half of ``VLLMGenerator`` (a mixin; the generator's engine lock, state lock and version are its own):
    ``load_adapter`` (the weight sync of a ``model.lora`` run), which adapter a group takes and keeps, and pruning.
    Without ``model.lora`` every member is a no-op and ``_adapters`` is None."""

    _adapters: Adapters | None

    def _serve_adapters(self, model_cfg: Any, lora_request_cls: Any) -> Adapters | None:
        if model_cfg.lora is None:
            return None
        if lora_request_cls is None:  # the real engine (tests pass a fake of vLLM's class)
            from vllm.lora.request import LoRARequest as lora_request_cls
        return Adapters(self.engine, lambda name, lora_id, path: lora_request_cls(
            lora_name=name, lora_int_id=lora_id, lora_path=path))

    def load_adapter(self, adapter: LoraAdapter, version: int) -> None:
        """A LoRA run's sync: register ``adapter`` as ``version``'s vLLM adapter between two engine steps and make it
        the one new groups start on; groups already running keep theirs (module docstring). Adapters nobody uses
        any more are removed. ``sync_parts`` records ``receive_s`` (writing its directory), ``load_s``
        (``add_lora``) and ``bytes``. On failure the version stays what it was."""
        if self._adapters is None:
            raise ValueError("load_adapter: this vLLM generator serves no adapters (model.lora is unset)")
        lora_id, path, write_s = self._adapters.write(adapter, version)  # no engine needed for the write
        with self._engine_turn():
            t0 = time.perf_counter()
            with exclusive_device(self.device, type(self).__name__):
                self._adapters.add(lora_id, path, version)
                load_s = time.perf_counter() - t0
                with self._state:
                    self._version = int(version)
                self._prune_adapters()
            self.last_sync_seconds = write_s + load_s
            self._sync_parts.append({"version": int(version), "receive_s": write_s, "swap_wait_s": 0.0,
                                     "load_s": load_s, "reset_s": 0.0, "bytes": float(adapter.nbytes)})

    def adapters(self) -> dict[int, int]:
        """The registered adapters: vLLM lora id -> weight version ({} without ``model.lora``)."""
        if self._adapters is None:
            return {}
        with self._state:
            return {i: e.version for i, e in self._adapters.registered.items()}

    def _refuse_weights(self) -> None:
        if self._adapters is not None:
            raise ValueError("this vLLM generator serves LoRA adapters (model.lora): the weight sync sends "
                             "load_adapter(policy.export_adapter(), version), not merged weights")

    def _pin(self, group: Any, submitted: bool) -> Any:
        """Fix ``group``'s adapter once: the current one at submit under ``drain`` (``submitted``), when it enters
        the engine under ``inflight``; returns the group."""
        if self._adapters is not None and not group.pinned and (
                not submitted or self.gen_cfg.weight_update == "drain"):
            group.adapter, group.pinned = self._adapters.current, True
        return group

    def _lora_kwargs(self, adapter: Any = False) -> dict[str, Any]:
        """``add_request``'s adapter argument (``False``: the current adapter); none for the base model."""
        if adapter is False:
            adapter = self._adapters.current if self._adapters is not None else None
        return {} if adapter is None else {"lora_request": adapter.request}

    def _end_version(self, group: Any) -> int:
        """A finished group's last weights: its adapter's version (it ran on that one), else the engine's now."""
        return group.start_version if self._adapters is not None else self._version

    def _prune_adapters(self, locked: bool = False) -> None:
        """Remove adapters neither current nor used by a queued or running group; the caller holds the engine
        (and the state lock, if ``locked``)."""
        if self._adapters is None:
            return
        if locked:
            groups = (*self._queue, *self._running.values())
        else:
            with self._state:
                groups = (*self._queue, *self._running.values())
        self._adapters.prune({g.adapter.lora_id for g in groups if g.adapter is not None})
