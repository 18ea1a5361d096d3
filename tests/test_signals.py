"""``asyncrl run`` under SIGTERM and SIGHUP (what ``timeout``, job schedulers, container stops and a closed terminal
send), in a subprocess: the run stops at a safe point as it does on Ctrl-C, every finished step is written whole,
summary.json says ``"status": "terminated"``, control.sock is gone, and the exit status is 128 + the signal (what a
shell reports for a process the signal killed; Ctrl-C gives 130 the same way)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 120
# The simulated backends on the wall clock: a step every few ms, no model to build (seconds, not minutes).
SIMULATED = ["--set", "generation.backend=simulated", "--set", "generation.clock=wall",
             "--set", "generation.prefill_s=0.01", "--set", "trainer.backend=simulated", "--set", "eval_every=null"]


def default_signals() -> None:
    """In the child: SIGHUP and SIGINT as a terminal gives them, whatever this test runner inherited (a suite
    started under ``nohup`` or in a background job ignores them, and the run keeps an inherited ignore)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_run(out: Path, *extra: str, preexec_fn=default_signals) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--steps", "100000",
                             "--out", str(out), "--quiet", *SIMULATED, *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec_fn)


def rows(out: Path) -> int:
    path = out / "metrics.csv"
    return len(path.read_text().splitlines()) - 1 if path.exists() else 0


def wait_for_steps(proc: subprocess.Popen, out: Path, steps: int) -> None:
    deadline = time.monotonic() + HANG_S
    while rows(out) < steps:
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {steps} steps: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"no {steps} steps in metrics.csv within {HANG_S} s"
        time.sleep(0.02)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_stop_the_run_cleanly_like_ctrl_c(tmp_path, signum):
    out = tmp_path / "run"
    proc = start_run(out)
    try:
        wait_for_steps(proc, out, 3)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, (proc.returncode, stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "terminated" and summary["steps"] >= 3, summary
    assert summary["signal"] == signal.Signals(signum).name
    assert json.loads(stdout.splitlines()[0]) == summary
    assert not (out / "control.sock").exists()
    text = (out / "metrics.csv").read_text()
    assert text.endswith("\n")  # no row cut mid-line
    metrics, trace = pd.read_csv(out / "metrics.csv"), pd.read_csv(out / "trace.csv")
    assert metrics.step.tolist() == list(range(summary["steps"]))
    assert (trace.event == "step").sum() == summary["steps"] and trace.seq.tolist() == list(range(len(trace)))
    assert "Traceback" not in stderr


def test_a_hangup_the_run_inherited_as_ignored_stays_ignored(tmp_path):
    """``nohup asyncrl run ...``: SIGHUP is ignored when the run starts, and a closed terminal must not stop it."""
    out = tmp_path / "run"
    proc = start_run(out, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        wait_for_steps(proc, out, 2)
        proc.send_signal(signal.SIGHUP)
        at = rows(out)
        wait_for_steps(proc, out, at + 3)  # still going
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == 143
    assert json.loads((out / "summary.json").read_text())["status"] == "terminated"
