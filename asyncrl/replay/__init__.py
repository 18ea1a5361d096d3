"""Counterfactual replay: a recorded run's own completions served to another sampler on the simulated clock.

    replayed = asyncrl.Recording("runs/q").replay(sampler={"name": "windowed", "max_staleness_versions": 2})
    table = asyncrl.replay.compare(asyncrl.Recording("runs/q"), ["in_order", "weight_fifo", "windowed"])

The parts: ``recorded`` (what a replay reads of a recording), ``latency`` (the latency model fitted from its step
timings), ``generator`` (the simulated generator serving recorded completions), ``replayed`` (one replay, read like
a controller), ``comparison`` (several samplers side by side: one table, one figure) and ``command`` (``asyncrl
replay``). A replay predicts schedules and data, not learning: the rewards are the recorded policy's.
"""

from importlib import import_module

_LAZY = {  # loaded on first use, so ``asyncrl --help`` (which registers ``asyncrl replay``) loads no torch
    "replay": "asyncrl.replay.replayed",
    "ReplayedRun": "asyncrl.replay.replayed",
    "compare": "asyncrl.replay.comparison",
    "Comparison": "asyncrl.replay.comparison",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'asyncrl.replay' has no attribute {name!r}")


__all__ = list(_LAZY)
