"""Remote control of a live ``asyncrl run``: the run listens on ``control.sock`` in its run directory and
``asyncrl.attach(run_dir)`` returns a ``Remote`` that drives it as a notebook drives its own controller.

The wire: one JSON object per line each way over a Unix stream socket, ``{"cmd": ...}`` in, ``{"ok": true,
"value": ...}`` or ``{"ok": false, "error": ...}`` out. Commands: ``hello``, ``status``, ``pause``, ``resume``,
``stop``, and while paused ``rollout_tick``, ``train_tick``, ``explain``, ``state``. They go through the run's
``RunHandle`` and the controller's public API only (a hand tick is refused while the pumps go, as in a notebook).

Invariants:
- Owner only, no network: the socket is created in a fresh 0700 directory, made 0600, and only then renamed into
  the run directory, so nobody else can ever connect; there is no TCP listener. It is removed when the run exits;
  one left behind by a killed run is stale (``attach`` says so; the next run in that directory replaces it).
- One attached controller at a time: a second ``attach`` is refused with an error naming the first, and the run
  and the first connection go on unharmed. An error in a command is the reply, never the run's error.
- A pause has an owner: the attached controller that paused the run. When it disconnects (it exited, crashed, or
  closed) with the run still paused, the run resumes at once and says so on its stderr, so a client that died never
  leaves a run paused for ever; ``attach(..., keep_paused=True)`` is a client that means its pause to outlive it.
- ``stop`` asks the run to end at its next safe point and replies at once; the run writes every file, exits 0 and
  says ``"status": "stopped"`` in ``summary.json``; the socket closes last, so a ``Remote`` that saw it close knows
  everything is on disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd

from asyncrl import read_view
from asyncrl.reports import ControllerState
from asyncrl.trace import STEP

SOCKET = "control.sock"
_PATH_MAX = 100  # sun_path holds 108 bytes; longer paths go through /proc/self/fd (Linux)


class AttachError(RuntimeError):
    """``attach`` could not reach a live run: none in the directory, a stale socket, or another controller attached."""


def _address(directory: Path, name: str) -> tuple[str, int | None]:
    """A path for bind/connect that fits ``sun_path``, and a directory descriptor to close afterwards."""
    path = str(directory / name)
    if len(path.encode()) <= _PATH_MAX:
        return path, None
    fd = os.open(directory, os.O_RDONLY)
    return f"/proc/self/fd/{fd}/{name}", fd


def _connect(directory: Path, timeout: float | None = None) -> socket.socket:
    address, fd = _address(directory, SOCKET)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return sock


# ------------------------------------------------------------------------------------------------- server
class ControlServer:
    """What ``asyncrl run`` listens with. ``handle()`` gives the run's ``RunHandle`` (None before it started);
    ``on_stop()`` is told before a remote stop, so the CLI can write ``"status": "stopped"``; ``warn(line)`` says
    what the run did on its own (a pause whose owner went away), by default on stderr."""

    def __init__(self, run_dir: str | Path, ctrl, handle, on_stop, warn=None):
        self.run_dir, self.ctrl, self.handle, self.on_stop = Path(run_dir), ctrl, handle, on_stop
        self.warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        self._sock: socket.socket | None = None
        self._client: tuple[socket.socket, str] | None = None  # the attached controller and who it is
        self._paused_by: socket.socket | None = None  # the connection whose pause holds the run (guarded by _lock)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> ControlServer:
        path = self.run_dir / SOCKET
        if path.exists() or path.is_symlink():
            try:
                _connect(self.run_dir, timeout=1.0).close()
            except OSError:
                path.unlink()  # stale: left by a run that was killed
            else:
                raise RuntimeError(f"another run is live in {self.run_dir} (it answers on {path}); give another --out")
        private = Path(tempfile.mkdtemp(prefix=".control-", dir=self.run_dir))  # 0700: nobody else gets in
        address, fd = _address(private, SOCKET)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(address)
            sock.listen(4)
            os.chmod(private / SOCKET, 0o600)
            os.rename(private / SOCKET, path)  # listening already: whoever finds it can connect
        finally:
            if fd is not None:
                os.close(fd)
            private.rmdir()
        sock.settimeout(0.2)
        self._sock = sock
        self._spawn(self._accept, "asyncrl-control")
        return self

    def _spawn(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            conn.settimeout(None)
            self._spawn(self._serve, "asyncrl-control-client", conn)

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("r", encoding="utf-8")
        mine, keep_paused = False, False
        try:
            for line in reader:
                request = json.loads(line)
                if request.get("cmd") == "hello" and not mine:
                    with self._lock:
                        if self._client is not None:
                            _send(conn, {"ok": False, "error": f"another controller is attached to the run in "
                                         f"{self.run_dir} ({self._client[1]}); detach it (remote.close()) first"})
                            return
                        self._client, mine = (conn, str(request.get("who", "a client"))), True
                        keep_paused = bool(request.get("keep_paused", False))
                if not mine:
                    _send(conn, {"ok": False, "error": "say hello first"})
                    return
                try:
                    reply = {"ok": True, "value": self._do(request)}
                except Exception as exc:  # the caller's mistake (or a tick refused): the reply, not the run's error
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                else:
                    if request.get("cmd") in ("pause", "resume", "stop"):
                        with self._lock:
                            self._paused_by = conn if request["cmd"] == "pause" else None
                _send(conn, reply)
        except (OSError, ValueError):
            pass
        finally:
            with self._lock:
                who = self._client[1] if mine and self._client is not None and self._client[0] is conn else None
                if who is not None:
                    self._client = None
                owned = self._paused_by is conn
                if owned:
                    self._paused_by = None
            conn.close()
            if owned and not self._closed.is_set():
                self._orphaned_pause(who or "a client", keep_paused)

    def _orphaned_pause(self, who: str, keep_paused: bool) -> None:
        """The client whose pause holds the run went away: resume, unless it attached with ``keep_paused``."""
        handle = self.handle()
        if handle is None or not handle.paused:
            return
        if keep_paused:
            self.warn(f"asyncrl run: warning: the attached controller ({who}) that paused the run disconnected; "
                      "the run stays paused (it attached with keep_paused=True): attach and resume it")
            return
        handle.resume()
        self.warn(f"asyncrl run: warning: the attached controller ({who}) that paused the run disconnected; the "
                  "run resumes (attach with keep_paused=True to keep a pause past the client)")

    def _do(self, request: dict) -> Any:
        cmd, handle, ctrl = request.get("cmd"), self.handle(), self.ctrl
        if cmd in ("hello", "status"):
            return self._status(handle)
        if handle is None:
            raise RuntimeError("the run has not started its pumps yet; try again in a moment")
        if cmd == "state":
            return read_view.encode_state(ctrl.state()) | self._status(handle)
        if cmd == "explain":
            return read_view.encode_verdicts(ctrl.explain(timeout=5.0))
        if cmd in ("rollout_tick", "train_tick"):  # refused by the controller unless the pumps are parked
            return str(getattr(ctrl, cmd)())
        if cmd == "pause":
            handle.pause()
        elif cmd == "resume":
            handle.resume()
        elif cmd == "stop":
            self.on_stop()
            handle.stop(wait=False)
        else:
            raise ValueError(f"unknown command {cmd!r}; commands: hello, status, pause, resume, stop, rollout_tick, "
                             "train_tick, explain, state")
        return self._status(handle)

    def _status(self, handle) -> dict:
        return {"pid": os.getpid(), "status": handle.status if handle is not None else "starting",
                "running": handle.running if handle is not None else True,
                "target": handle.target if handle is not None else None,
                "trainer_version": self.ctrl.trainer_version,
                "constant_answer_accuracy": self.ctrl.task.constant_answer_accuracy}

    def close(self) -> None:
        """Stop listening, remove the socket, hang up on the attached controller (its sign that all is written)."""
        self._closed.set()
        if self._sock is not None:
            self._sock.close()
        (self.run_dir / SOCKET).unlink(missing_ok=True)
        with self._lock:
            if self._client is not None:
                try:
                    self._client[0].shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


# ------------------------------------------------------------------------------------------------- client
def attach(run_dir: str | Path, keep_paused: bool = False) -> Remote:
    """Control the live ``asyncrl run`` writing ``run_dir``: a ``Remote`` (``AttachError`` when there is no live
    run there, its socket is stale, or another controller is attached). A run this ``Remote`` paused resumes when it
    disconnects (closes, or its process exits), unless ``keep_paused``: then it stays paused for the next client."""
    return Remote(run_dir, keep_paused=keep_paused)


class _Task:
    def __init__(self, constant_answer_accuracy: float):
        self.constant_answer_accuracy = constant_answer_accuracy


class Remote:
    """A live ``asyncrl run``, driven from here: ``pause()``, ``resume()``, ``stop()``, and while paused
    ``rollout_tick()``, ``train_tick()``, ``tick()``, ``explain()``, ``state()``. ``metrics`` and ``trace`` read the
    run's live files (a ``read_view.ReadView``, as a controller is). It also stands in for the run's handle (``last_run``: ``running``, ``paused``, ``status``,
    ``target``), so ``widgets.Dashboard(remote)`` works with the same buttons. ``close()`` detaches (and a run it
    paused resumes, unless ``keep_paused``)."""

    error = None
    breakpoint = None

    def __init__(self, run_dir: str | Path, keep_paused: bool = False):
        self.run_dir, self.keep_paused = Path(run_dir), bool(keep_paused)
        path = self.run_dir / SOCKET
        if not path.exists():
            summary = self.run_dir / "summary.json"
            ended = f" (it ended: summary.json says {json.loads(summary.read_text()).get('status')!r})" \
                if summary.is_file() else ""
            raise AttachError(f"no live run in {str(self.run_dir)!r}: there is no {SOCKET}{ended}; attach to the "
                              "--out directory of a running `asyncrl run`")
        try:
            self._sock = _connect(self.run_dir, timeout=10.0)
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise AttachError(f"stale socket {str(path)!r}: no run listens on it (the run that made it was killed); "
                              "the run is gone, its files hold what it finished") from exc
        self._sock.settimeout(None)  # a tick of a paused run takes what it takes
        self._file = self._sock.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._status = self._call("hello", who=f"pid {os.getpid()}", keep_paused=self.keep_paused)
        except AttachError:
            self.close()
            raise
        self.task = _Task(self._status["constant_answer_accuracy"])

    # ------------------------------------------------------------------------------------------------ wire
    def _call(self, cmd: str, **args) -> Any:
        with self._lock:
            if self._closed:
                raise AttachError(f"detached from the run in {str(self.run_dir)!r}")
            try:
                self._sock.sendall((json.dumps({"cmd": cmd, **args}) + "\n").encode())
                line = self._file.readline()
            except OSError as exc:
                line, error = "", exc
            else:
                error = None
            if not line:
                self._closed = True
                raise AttachError(f"the run in {str(self.run_dir)!r} has ended (the connection closed)") from error
        reply = json.loads(line)
        if not reply["ok"]:
            raise AttachError(reply["error"]) if cmd == "hello" else RuntimeError(reply["error"])
        return reply["value"]

    # ---------------------------------------------------------------------------------------------- control
    def pause(self) -> None:
        """Park the run's pumps at a safe point (returns once they are parked)."""
        self._status = self._call("pause")

    def resume(self) -> None:
        self._status = self._call("resume")

    def stop(self, wait: bool = True, timeout: float = 120.0) -> None:
        """End the run at its next safe point; with ``wait``, return once it wrote everything and hung up."""
        self._status = self._call("stop")
        if wait:
            deadline = time.monotonic() + timeout
            while not self._closed and time.monotonic() < deadline:
                try:
                    self._status = self._call("status")
                except AttachError:
                    break
                time.sleep(0.05)

    def rollout_tick(self) -> str:
        """One rollout tick of the paused run; the line its report prints."""
        return self._call("rollout_tick")

    def train_tick(self) -> str:
        return self._call("train_tick")

    def tick(self) -> str:
        return f"{self.rollout_tick()} || {self.train_tick()}"

    def start(self, *args, **kwargs):
        raise RuntimeError(f"the run in {str(self.run_dir)!r} is already going: pause, resume or stop it")

    # ---------------------------------------------------------------------------------------------- reading
    def explain(self, timeout: float | None = None) -> pd.DataFrame:
        """The run's controller's ``explain()`` (computed there, while paused)."""
        return read_view.decode_verdicts(self._call("explain"))

    def state(self) -> ControllerState:
        """The run's controller's ``state()``; its status comes with it."""
        value = self._call("state")
        names = {f.name for f in dataclasses.fields(ControllerState)}
        self._status = {k: value[k] for k in value if k not in names or k == "trainer_version"}
        return read_view.decode_state(value)

    @property
    def metrics(self) -> pd.DataFrame:
        """``metrics.csv`` as it is now."""
        try:
            return pd.read_csv(self.run_dir / "metrics.csv")
        except pd.errors.EmptyDataError:
            return pd.DataFrame()

    @property
    def trace(self) -> pd.DataFrame:
        """``trace.csv`` as it is now (the rows through the last finished step)."""
        from asyncrl.trace import TRACE_DTYPES

        return pd.read_csv(self.run_dir / "trace.csv", keep_default_na=False,
                           na_values={c: [""] for c in TRACE_DTYPES}).astype(TRACE_DTYPES)

    @property
    def evaluations(self) -> pd.DataFrame:
        """The held-out evaluations in ``metrics.csv`` so far."""
        return read_view.evaluations_from_metrics(self.metrics)

    @property
    def trainer_version(self) -> int:
        return self._refresh()["trainer_version"]

    # ------------------------------------------------------------------ the run's handle, for the widgets
    def _refresh(self) -> dict:
        if not self._closed:
            try:
                self._status = self._call("status")
            except AttachError:
                pass
        return self._status

    @property
    def last_run(self) -> Remote:
        return self

    @property
    def running(self) -> bool:
        status = self._refresh()
        return not self._closed and status["running"]

    @property
    def paused(self) -> bool:
        return self._refresh()["status"] == "paused"

    @property
    def status(self) -> str:
        status = self._refresh()["status"]
        return "ended" if self._closed and status in ("running", "paused", "starting") else status

    @property
    def target(self) -> int | None:
        return self._status["target"]

    def subscribe(self, callback, events=None, history: bool = False):
        """``callback(None)`` whenever ``metrics.csv`` gained a step (polled every 0.25 s); ``cancel()`` stops it.
        Only ``step`` events: the run's other events are in ``trace.csv``."""
        if events not in (None, STEP, (STEP,), [STEP]):
            raise ValueError(f"a Remote delivers only {STEP!r} events (read trace.csv for the others), got {events!r}")
        return _MetricsWatch(self.run_dir / "metrics.csv", callback)

    # ---------------------------------------------------------------------------------------------- closing
    def close(self) -> None:
        """Detach (the run goes on; paused by this ``Remote``, it resumes unless ``keep_paused``)."""
        with self._lock:
            self._closed = True
            try:
                self._sock.close()
            except OSError:
                pass

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Remote({str(self.run_dir)!r}, {self._status['status']}, T={self._status['trainer_version']})"


class _MetricsWatch:
    def __init__(self, path: Path, callback):
        self.path, self.callback = path, callback
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="asyncrl-remote-watch").start()

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _watch(self) -> None:
        seen = self._size()
        while not self._stop.wait(0.25):
            size = self._size()
            if size != seen:
                seen = size
                self.callback(None)

    def cancel(self) -> None:
        self._stop.set()
