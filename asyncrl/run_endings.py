"""How ``asyncrl run`` ends when it does not complete: a signal stops it at a safe point, a failure is one line.

- ``RunSignals``: SIGINT, SIGTERM and SIGHUP (Ctrl-C, ``timeout``, job schedulers, container stops, a closed
  terminal) all stop a run at its next safe point, so every file is written, summary.json says ``interrupted`` or
  ``terminated`` and control.sock is removed; the exit status is 128 + the signal (130, 143, 129), what a shell
  reports for a process the signal killed.
- ``failure_line``: a run that failed (user code that broke its contract or raised, a backend's error) prints the
  error's own line and where its whole traceback went (``error.log`` in the run directory), not the traceback.
"""

from __future__ import annotations

import signal
import traceback
from pathlib import Path


class Terminated(BaseException):
    """SIGTERM or SIGHUP before the run's pumps started: it unwinds as Ctrl-C's ``KeyboardInterrupt`` does."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunSignals:
    """SIGINT, SIGTERM and SIGHUP for ``asyncrl run`` (what Ctrl-C, ``timeout``, job schedulers, container stops and
    a closed terminal send).

    Invariants:
    - Before the pumps start nothing is running to stop: SIGINT raises ``KeyboardInterrupt`` (Python's own
      handler), SIGTERM and SIGHUP raise ``Terminated``; ``run`` catches both, writes nothing, and exits 128 + the
      signal.
    - From ``running(stop)`` on, each of the three asks the run to stop at its next safe point (``asked``: the first
      signal's number), so every file is written, summary.json is written and control.sock removed; the same signal
      again kills at once (its default action).
    - A signal the process inherited as ignored (``nohup``'s SIGHUP, a scheduler's) stays ignored, SIGINT aside,
      which a run always took as Ctrl-C. Every handler is put back on exit (``cli.main`` runs in tests' processes).
    """

    TERMINATING = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.asked: int | None = None
        self._previous: dict[int, object] = {}
        self._stop = None

    def __enter__(self) -> RunSignals:
        for signum in self.TERMINATING:
            self._install(signum, self._raise)
        return self

    def _install(self, signum: int, handler) -> None:
        current = signal.getsignal(signum)
        if current == signal.SIG_IGN and signum != signal.SIGINT:
            return
        previous = signal.signal(signum, handler)
        self._previous.setdefault(signum, signal.SIG_DFL if previous is None else previous)

    def _raise(self, signum, frame) -> None:
        raise Terminated(signum)

    def running(self, stop) -> None:
        """The pumps are about to start: from now on a signal calls ``stop()`` (a safe-point stop, no wait)."""
        self._stop = stop
        for signum in (signal.SIGINT, *self.TERMINATING):
            self._install(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.asked = self.asked or signum
        signal.signal(signum, signal.SIG_DFL)  # the same signal again: killed at once
        self._stop()

    @property
    def status(self) -> str | None:
        """What summary.json says of a run a signal stopped: ``interrupted`` (Ctrl-C) or ``terminated``."""
        return None if self.asked is None else "interrupted" if self.asked == signal.SIGINT else "terminated"

    @property
    def name(self) -> str | None:
        """The first signal's name (``SIGTERM``), or None."""
        return None if self.asked is None else signal.Signals(self.asked).name

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def failure_line(out: Path | None, exc: BaseException) -> str:
    """The one line a failed run prints: the error's type and message (its first line: a ``StallError`` goes on
    with a table; summary.json has all of it), and where the full traceback was written: ``error.log`` in the run
    directory. Where that cannot be written either (a full disk), the line says why instead."""
    text = "".join(traceback.format_exception(exc))
    lines = str(exc).strip().splitlines() or [""]
    more = f" ({len(lines) - 1} more lines)" if len(lines) > 1 else ""
    line = f"asyncrl run: failed: {type(exc).__name__}: {lines[0]}{more}"
    try:
        if out is None:
            raise OSError("no run directory")
        out.mkdir(parents=True, exist_ok=True)
        (out / "error.log").write_text(text)
    except OSError as write_error:
        return f"{line} (no traceback: error.log could not be written: {write_error})"
    return f"{line}; the full traceback is in {out / 'error.log'}"
