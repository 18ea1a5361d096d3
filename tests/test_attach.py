"""Attach (asyncrl/remote.py) against a real ``asyncrl run`` subprocess: pause holds metrics.csv still, a hand tick
moves it by at most one step, resume and stop work (exit 0, ``"status": "stopped"``, the socket removed), the
socket is the owner's only, and the bad inputs (no live run, a stale socket, a second controller, a tick while
running) are clear errors that leave the run unharmed."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from asyncrl import Recording, attach
from asyncrl.read_view import ReadView
from asyncrl.remote import SOCKET, AttachError


def rows(out: Path) -> int:
    try:
        return len(pd.read_csv(out / "metrics.csv"))
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return 0


def wait_for(predicate, timeout: float, what: str, proc=None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def test_attach_pauses_steps_resumes_and_stops_a_live_run(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--steps", "100000", "--out",
                             str(out), "--quiet", "--no-plot", "--set", "eval_every=null", "--set", "torch_threads=1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / SOCKET).exists() and rows(out) >= 2, 300, "socket and two steps", proc)
        assert stat.S_IMODE((out / SOCKET).stat().st_mode) == 0o600 and stat.S_ISSOCK((out / SOCKET).stat().st_mode)
        remote = attach(out)
        with pytest.raises(RuntimeError, match="pause it"):  # a hand tick while the pumps go: refused, run unharmed
            remote.train_tick()
        remote.pause()
        assert remote.paused
        held = rows(out)
        time.sleep(0.5)
        assert rows(out) == held  # paused: nothing moves
        with pytest.raises(AttachError, match="another controller is attached"):
            attach(out)
        for _ in range(6):  # hand ticks: each moves metrics.csv by at most one step
            before = rows(out)
            remote.rollout_tick()
            remote.train_tick()
            assert rows(out) - before <= 1
        assert rows(out) > held, "six rollout+train ticks should finish a step"
        verdicts = remote.explain()
        assert list(verdicts.columns[:3]) == ["group_id", "weight_version", "target_step"]
        state = remote.state()
        assert state.trainer_version == rows(out) and state.sampler == "in_order"
        assert verdicts.attrs["trainer_version"] == state.trainer_version  # one T, as for a controller
        assert isinstance(remote, ReadView)
        assert remote.trace.event.isin(["step"]).sum() == rows(out)
        remote.resume()
        resumed_at = rows(out)
        wait_for(lambda: rows(out) > resumed_at + 1, 120, "steps after resume", proc)
        rec = Recording(out)  # a live run's directory scrubs too (its steps grow while we look: read them once)
        last = rec.steps[-1]
        assert rec.at(last).trainer_version == last + 1
        remote.stop()
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] == rows(out)
    assert not (out / SOCKET).exists()
    with pytest.raises(AttachError, match="no live run .* summary.json says 'stopped'"):
        attach(out)


def test_attach_to_no_run_or_a_stale_socket_is_a_clear_error(tmp_path):
    with pytest.raises(AttachError, match="no live run in .*: there is no control.sock"):
        attach(tmp_path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # what a killed run leaves: a socket nobody serves
    stale.bind(str(tmp_path / SOCKET))
    stale.close()
    with pytest.raises(AttachError, match="stale socket .*killed"):
        attach(tmp_path)


def _client(out: Path, keep_paused: bool) -> subprocess.CompletedProcess:
    """Another process attaches, pauses the run and exits without resuming it (as a crashed notebook would)."""
    code = (f"import sys\nfrom asyncrl import attach\nremote = attach(sys.argv[1], keep_paused={keep_paused})\n"
            "remote.pause()\nassert remote.paused\nprint(remote.trainer_version)\n")
    return subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_a_pause_ends_when_the_client_that_paused_goes_unless_it_keeps_it(tmp_path):
    """The pause belongs to the attached client that asked for it: when that process exits, the run resumes within
    seconds and says so on its stderr; a client that attached with ``keep_paused=True`` leaves it paused."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--steps", "100000", "--out",
                             str(out), "--quiet", "--no-plot", "--set", "eval_every=null",
                             "--set", "generation.backend=simulated", "--set", "generation.clock=wall",
                             "--set", "generation.prefill_s=0.01", "--set", "trainer.backend=simulated"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / SOCKET).exists() and rows(out) >= 2, 120, "socket and two steps", proc)
        client = _client(out, keep_paused=False)
        assert client.returncode == 0, client.stderr
        paused_at = int(client.stdout.strip())
        wait_for(lambda: rows(out) > paused_at + 2, 10, "steps after the pausing client exited", proc)

        client = _client(out, keep_paused=True)
        assert client.returncode == 0, client.stderr
        held = rows(out)
        time.sleep(1.5)
        assert rows(out) == held  # kept paused past the client, as it asked
        remote = attach(out)  # the next client finds it paused and takes it from there
        assert remote.paused
        remote.stop()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr, stderr
    warnings = [line for line in stderr.splitlines() if "that paused the run disconnected" in line]
    assert len(warnings) == 2, stderr
    assert warnings[0].startswith("asyncrl run: warning:") and "the run resumes" in warnings[0]
    assert "stays paused" in warnings[1] and "keep_paused=True" in warnings[1]
    assert json.loads((out / "summary.json").read_text())["status"] == "stopped"
