"""The reward worker process: it loads the run's reward functions once, then scores one call at a time.

Started by ``asyncrl.rewards.runner`` as ``python -c BOOT FD`` (not ``multiprocessing``'s spawn, which would
import the caller's ``__main__`` script again in every worker): ``BOOT`` reads the caller's ``sys.path`` from the
connection before importing anything of asyncrl, so a worker imports what the caller would.

Invariants:
- One call at a time, answered in order: ``("ok" | "problem" | "bug", value, seconds)`` per call
  (``asyncrl.rewards.functions.outcome``); a function that cannot be loaded here is ``("init_error", why)``.
- Ctrl-C in the terminal is the caller's to handle (SIGINT ignored here); a worker whose caller is gone (its
  connection closed, or its parent process replaced by init) exits, so no worker outlives its run.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

# Runs in a bare interpreter: standard library only until sys.path is the caller's.
BOOT = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
kind, path, payload = conn.recv()
sys.path[:] = path
from asyncrl.rewards.worker import serve
serve(conn, payload)
"""


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def serve(conn, payload: bytes) -> None:
    """Load ``payload`` (``{index: (name, function)}``, pickled with cloudpickle) and answer calls
    ``("call", index, batch)`` until ``("stop",)`` or the caller goes away."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    from asyncrl.faults import describe
    from asyncrl.rewards.builtin import math_answer
    from asyncrl.rewards.functions import outcome

    try:
        funcs = pickle.loads(payload)
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the caller must hear it, in one line
        conn.send(("init_error", f"{describe(exc)} (sys.path {sys.path[:3]}...)"))
        return
    if any(func is math_answer for _, func in funcs.values()):
        import math_verify  # noqa: F401 - half a second, paid before the first call's clock starts
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            return
        _, index, batch = message
        name, func = funcs[index]
        conn.send(outcome(func, name, batch))
