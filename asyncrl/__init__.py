"""asyncrl: asynchronous GRPO under a single controller you can step, inspect and run at full speed.

Heavy parts (torch, the controller) load on first use, so ``import asyncrl.samplers`` stays light.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "Controller": "asyncrl.controller",
    "load_config": "asyncrl.config",
    "Config": "asyncrl.config",
    "ReplayBuffer": "asyncrl.buffer",
    "TraceRow": "asyncrl.trace",  # what Controller.subscribe delivers for each trace event
    "StepEvent": "asyncrl.trace",  # ... and for each finished step, with its metrics row
    "Recording": "asyncrl.recording",  # scrub a run directory or a live controller
    "attach": "asyncrl.remote",  # control a live `asyncrl run` through its socket
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")


__all__ = list(_LAZY)
