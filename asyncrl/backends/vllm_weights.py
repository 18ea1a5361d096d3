"""New weights into vLLM's running engine, for the vLLM generator (``asyncrl/backends/vllm.py``): the staged set
a receive writes while the engine runs, and the in-place load between two engine steps.

- **In place** (``gen_cfg.weight_load``): ``collective_rpc("reload_weights", weights_iterator=...)`` with HF names
  (vLLM's layerwise reload, which handles quantised models), or ``load_weights``: the model's own ``load_weights``
  called directly. One of them for the engine's lifetime: the first reload wraps the loaders. The device is
  synchronised before the load counts as done; ``reset_prefix_cache()`` follows only if the prefix cache is on.
- **Staged** (``Staged``): a set received into staging buffers *while the engine runs*, with its version, when it
  was staged and how long the receive took. Invariants the generator keeps with it: the engine never runs on a
  partly loaded set (the swap holds the engine lock); staged buffers are never written while being loaded (one
  staging lock around the receive and around the swap); a newer staged set replaces an older one not yet swapped
  in (the version may then skip one).
- vLLM logs a WARNING and INFO lines at every in-place load (``RotaryEmbedding: Failed to load weights``, ...):
  the ``vllm`` logger is held at ERROR during loads, so a notebook's progress bar stays readable; errors show.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from asyncrl.backends.device_lock import exclusive_device


class Staged(NamedTuple):
    """A weight set received and not yet swapped in."""

    weights: Mapping[str, torch.Tensor]
    version: int
    staged_at: float  # time.perf_counter() when the receive ended
    receive_s: float  # seconds the receive (``fill``) took


@contextmanager
def quiet_vllm() -> Iterator[None]:
    """The ``vllm`` logger at ERROR for a block (its per-load WARNING and INFO lines); errors still show."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


def load_in_place(llm: Any, weights: Mapping[str, torch.Tensor], weight_load: str, device: torch.device,
                  reset_prefix_cache: bool, owner: str) -> tuple[float, float]:
    """Load HF-named ``weights`` into ``llm``'s model in place (the caller holds the engine between two steps);
    returns ``(load_s, reset_s)``: the load, device synchronised, and the prefix-cache reset (0 when off)."""
    items = list(weights.items())
    with exclusive_device(device, owner), quiet_vllm():
        t0 = time.perf_counter()
        if weight_load == "reload_weights":
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        else:  # the model's own load_weights, directly (unquantized models need no re-processing)
            llm.apply_model(lambda model: model.load_weights(items) and None)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t1 = t2 = time.perf_counter()
        if reset_prefix_cache:
            llm.reset_prefix_cache()
            t2 = time.perf_counter()
    return t1 - t0, t2 - t1
