"""Attacks on ``asyncrl`` as a user and their machine make them: at the command line and on disk (issue 45's list).
docs/make_reliability.py runs every one and writes the "At the CLI and on disk" table of docs/reliability.md; the
tests assert the behaviours one by one (tests/test_signals.py, tests/test_user_mistakes.py, tests/test_attach.py,
...), so this is a record, not a test.

Each ``Attack`` runs the real CLI (or a few lines of Python) in a subprocess in a fresh directory and returns an
``Outcome``: the exit status, the line a person reads first (stderr's first line; for Python code, its last) and
what the run directory holds afterwards. An attack that hangs is killed after ``HANG_S`` and says so. Attacks are
small (the CPU quickstart model or the simulated backends, a few steps) and independent, so the table builds in a
few minutes.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 60.0  # an attack still running after this long is hung: killed, and reported so
SIMULATED = ["--set", "generation.backend=simulated", "--set", "generation.clock=wall",
             "--set", "generation.prefill_s=0.01", "--set", "trainer.backend=simulated", "--set", "eval_every=null"]
QUIET = ["--quiet", "--no-plot"]

# User code the attacks load: a module in the attack's directory (on PYTHONPATH). Evaluation calls rewards with one
# (greedy) completion per prompt, training with group_size completions: the eval attacks misbehave only there.
USER_CODE = textwrap.dedent('''
    import asyncio, os, time

    def short(completions, **kwargs):
        return [1.0]

    def words(completions, **kwargs):
        return ["yes"] * len(completions)

    def coroutine(completions, **kwargs):
        async def later():
            return [1.0] * len(completions)
        return later()

    def huge(completions, **kwargs):
        return [1e308] * len(completions)

    def raises_in_eval(completions, **kwargs):
        if len(completions) == 1:
            raise RuntimeError("the verifier is down")
        return [float(len(c)) for c in completions]

    def exits_in_eval(completions, **kwargs):
        if len(completions) == 1:
            os._exit(3)
        return [float(len(c)) for c in completions]

    def hangs_in_eval(completions, **kwargs):
        if len(completions) == 1:
            time.sleep(10 ** 6)
        return [float(len(c)) for c in completions]

    from tests.custom_sampler_fixture import NewestFirstSampler

    class RaisingSampler(NewestFirstSampler):
        def _candidates(self, T):
            if T >= 1:
                raise RuntimeError("the custom sampler broke at T=1")
            yield from super()._candidates(T)
''')


@dataclass
class Outcome:
    exit: int | str  # the exit status, or "hung" when killed after HANG_S
    says: str  # the first line a person reads
    result: str  # what the run directory holds, or what the attack observed


@dataclass
class Attack:
    what: str  # the attack, as issue 45 words it
    expect: str  # what should happen (the "what to build")
    run: Callable[[Path], Outcome]


# ----------------------------------------------------------------------------------------------------- helpers
def _env(tmp: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp)]), "HF_HUB_OFFLINE": "1",
            "MPLBACKEND": "Agg"}


def _default_signals() -> None:
    """In the child: SIGHUP and SIGINT as a terminal gives them, whatever the caller inherited (``nohup``, a
    background job): a run keeps an inherited ignore."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tmp: Path, *args: str, preexec_fn=None) -> subprocess.Popen:
    (tmp / "user_code.py").write_text(USER_CODE)

    def child() -> None:
        _default_signals()
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *args], cwd=tmp, env=_env(tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=child)


def _finish(proc: subprocess.Popen, timeout: float = HANG_S) -> tuple[int | str, str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        return "hung", stdout, stderr


def _first(stderr: str) -> str:
    """stderr's first line (with the next, when it is a heading such as "invalid configuration (1 error):")."""
    lines, warning = [], False
    for line in stderr.splitlines():
        if re.match(r"\S+:\d+: \w*Warning: ", line) or (warning and line.startswith(" ")):
            warning = True  # a Python warning and the source line it shows: not what the run says
            continue
        warning = False
        if line.strip() and "it/s]" not in line:
            lines.append(line.strip())
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else ""


def _rows(path: Path) -> int:
    return max(0, len(path.read_text().splitlines()) - 1) if path.exists() else 0


def _files(out: Path, stderr: str = "") -> str:
    """What the run directory holds: summary status, whole rows, the socket, error.log, traceback lines."""
    if not out.exists():
        return "nothing written"
    parts = []
    summary = out / "summary.json"
    if summary.exists():
        data = json.loads(summary.read_text())
        parts.append(f"summary.json {data.get('status')!r} at step {data.get('steps')}")
    else:
        parts.append("no summary.json")
    whole = [name for name in ("metrics.csv", "trace.csv", "completions.jsonl")
             if (out / name).exists() and (out / name).read_bytes().endswith(b"\n")]
    cut = [name for name in ("metrics.csv", "trace.csv", "completions.jsonl")
           if (out / name).exists() and (out / name).stat().st_size and name not in whole]
    if (out / "metrics.csv").exists():
        parts.append(f"{_rows(out / 'metrics.csv')} metrics rows")
    if cut:
        parts.append(f"cut mid-row: {', '.join(cut)}")
    parts.append("control.sock left behind" if (out / "control.sock").exists() else "control.sock removed")
    if (out / "error.log").exists():
        parts.append("error.log written")
    tracebacks = stderr.count("Traceback")
    if tracebacks:
        parts.append(f"{tracebacks} traceback(s) ({len(stderr.splitlines())} stderr lines)")
    return "; ".join(parts)


def _cli(tmp: Path, *args: str, timeout: float = HANG_S, preexec_fn=None) -> Outcome:
    code, _, stderr = _finish(_start(tmp, *args, preexec_fn=preexec_fn), timeout)
    out = next((Path(args[i + 1]) for i, a in enumerate(args) if a in ("--out", "--resume")), None)
    return Outcome(code, _first(stderr), _files(tmp / out if out else tmp, stderr))


def _run(tmp: Path, *args: str, steps: int = 2) -> Outcome:
    return _cli(tmp, "run", "quickstart", "--steps", str(steps), "--out", "run", *QUIET, *args)


def _python(tmp: Path, code: str) -> Outcome:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp, env=_env(tmp), capture_output=True,
                          text=True, timeout=HANG_S)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    printed = proc.stdout.strip().splitlines()
    return Outcome(proc.returncode, lines[-1] if lines else "",
                   printed[-1] if printed else f"raised (exit {proc.returncode})" if proc.returncode else "")


# --------------------------------------------------------------------------------------------- configuration
def _config_file(text: str) -> Callable[[Path], Outcome]:
    def attack(tmp: Path) -> Outcome:
        (tmp / "config.yaml").write_text(text)
        return _cli(tmp, "run", "config.yaml", "--steps", "1", "--out", "run", *QUIET)
    return attack


def _dataset(tmp: Path, data: bytes) -> Outcome:
    (tmp / "data.jsonl").write_bytes(data)
    return _run(tmp, "--set", "task.name=dataset", "--set", "task.options.train=data.jsonl")


# ------------------------------------------------------------------------------------------------------ signals
def _signal(signum: int, after_rows: int = 3) -> Callable[[Path], Outcome]:
    def attack(tmp: Path) -> Outcome:
        proc = _start(tmp, "run", "quickstart", "--steps", "100000", "--out", "run", *QUIET, *SIMULATED)
        deadline = time.monotonic() + HANG_S
        while _rows(tmp / "run" / "metrics.csv") < after_rows and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signum)
        code, _, stderr = _finish(proc)
        return Outcome(code, _first(stderr), _files(tmp / "run", stderr))
    return attack


# ------------------------------------------------------------------------------------------------- on disk
def _disk_full(tmp: Path) -> Outcome:
    """A file-size limit stands in for a full disk (no root or mount needed): past it a write fails with
    ``OSError`` (EFBIG) as it would with ENOSPC."""
    limit = 64 * 1024

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return _cli(tmp, "run", "quickstart", "--steps", "100000", "--out", "run", *QUIET, *SIMULATED,
                preexec_fn=limited)


def _flipped_checkpoint_byte(tmp: Path) -> Outcome:
    first = _run(tmp, "--checkpoint-every", "1", steps=2)
    if first.exit != 0:
        return Outcome(first.exit, first.says, f"the first run failed: {first.result}")
    newest = sorted((tmp / "run" / "checkpoints").glob("step-*"))[-1]
    tensors = newest / "tensors.pt"
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tensors.write_bytes(bytes(data))
    resumed = _cli(tmp, "run", "quickstart", "--steps", "3", "--resume", "run", *QUIET)
    return Outcome(resumed.exit, resumed.says, f"{newest.name} damaged; resumed: {resumed.result}")


def _recorded(tmp: Path) -> Outcome | None:
    first = _run(tmp, *SIMULATED, steps=6)
    return None if first.exit == 0 else Outcome(first.exit, first.says, f"the recorded run failed: {first.result}")


def _cut_file(name: str, keep: Callable[[bytes], int]) -> Callable[[Path], Outcome]:
    def attack(tmp: Path) -> Outcome:
        failed = _recorded(tmp)
        if failed:
            return failed
        path = tmp / "run" / name
        data = path.read_bytes()
        path.write_bytes(data[:keep(data)])
        opened = _python(tmp, """
            import warnings
            from asyncrl import Recording
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rec = Recording("run")
                rec.at(rec.steps[-1])
            said = "; ".join(str(w.message) for w in caught) or "no warning"
            print(f"Recording opens with {len(rec.steps)} steps, at(last) works; {said}")
        """)
        replay = _cli(tmp, "replay", "run", "--sampler", "weight_fifo", "--out", "replayed", "--no-plot")
        opened_text = opened.result or f"Recording: {opened.says}"
        return Outcome(replay.exit, replay.says, f"{opened_text}; replay exit {replay.exit}")
    return attack


def _mid_last_row(data: bytes) -> int:
    """Half way into the last row."""
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    return start + (len(data) - start) // 2


# ----------------------------------------------------------------------------------------------------- attach
def _client_exits_while_paused(tmp: Path) -> Outcome:
    proc = _start(tmp, "run", "quickstart", "--steps", "100000", "--out", "run", *QUIET, *SIMULATED)
    out = tmp / "run"
    deadline = time.monotonic() + HANG_S
    while not ((out / "control.sock").exists() and _rows(out / "metrics.csv") >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            code, _, stderr = _finish(proc, 1)
            return Outcome(code, _first(stderr), "the run did not start")
        time.sleep(0.05)
    client = _python(tmp, """
        from asyncrl import attach
        remote = attach("run")
        remote.pause()
        print(remote.trainer_version)
    """)  # and exits without resuming
    paused_at = int(client.result or 0)
    waited = time.monotonic()
    while _rows(out / "metrics.csv") <= paused_at + 1 and time.monotonic() - waited < 15:
        time.sleep(0.05)
    moved = _rows(out / "metrics.csv") > paused_at + 1
    result = (f"resumed {time.monotonic() - waited:.1f} s after the client exited" if moved
              else "still paused 15 s after the client exited")
    proc.send_signal(signal.SIGINT)
    code, _, stderr = _finish(proc)
    said = next((line for line in stderr.splitlines() if "paused the run" in line), _first(stderr))
    return Outcome(code, said, result)


# ---------------------------------------------------------------------------------------------- exact resume
def _kill_and_resume(tmp: Path) -> Outcome:
    """weight_fifo (W 1), checkpoints every 3 steps, killed with SIGKILL at 7 rows and resumed to 12, against an
    uninterrupted run of 12: every non-timing column of metrics.csv compared."""
    import pandas as pd

    args = ["run", "quickstart", "--steps", "12", *QUIET, "--checkpoint-every", "3", "--set", "eval_every=null",
            "--set", "sampler.name=weight_fifo", "--set", "sampler.max_staleness_versions=1",
            "--set", "torch_threads=1"]
    whole = _cli(tmp, *args, "--out", "whole")
    proc = _start(tmp, *args, "--out", "killed")
    deadline = time.monotonic() + HANG_S
    while _rows(tmp / "killed" / "metrics.csv") < 7 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    _finish(proc)
    resumed = _cli(tmp, *args, "--resume", "killed")
    if whole.exit != 0 or resumed.exit != 0:
        return Outcome(resumed.exit, resumed.says, f"uninterrupted exit {whole.exit}: {whole.result}")
    a, b = pd.read_csv(tmp / "whole" / "metrics.csv"), pd.read_csv(tmp / "killed" / "metrics.csv")
    timing = [c for c in a.columns
              if c.endswith("_s") or any(word in c for word in ("per_s", "time", "idle", "tflops", "mfu"))]
    columns = [c for c in a.columns if c not in timing and c in b.columns]
    differ = [c for c in columns if not a[c].equals(b[c])]
    return Outcome(resumed.exit, resumed.says, f"{len(b)} rows; " + (
        f"differs from the uninterrupted run in {', '.join(differ[:6])}" if differ else
        f"identical to the uninterrupted run in all {len(columns)} non-timing columns"))


# ------------------------------------------------------------------------------------------------------ table
ATTACKS: dict[str, Attack] = {
    "yaml_set_unclosed": Attack(
        "`--set 'reward.funcs=[unclosed'`", "one line naming the --set, line and column; exit 2",
        lambda tmp: _run(tmp, "--set", "reward.funcs=[unclosed")),
    "yaml_tab_in_file": Attack(
        "a tab indenting a key in a config file", "one line naming the file, line and column; exit 2",
        _config_file("seed: 1\nsampler:\n\tname: in_order\n")),
    "config_empty": Attack("an empty config file", "one line naming the file; exit 2", _config_file("")),
    "config_list": Attack("a config file holding a YAML list", "one line naming the file; exit 2",
                          _config_file("- seed: 1\n- groups_per_step: 2\n")),
    "bool_for_int": Attack("`--set groups_per_step=true`", "a configuration error naming the key; exit 2",
                           lambda tmp: _run(tmp, "--set", "groups_per_step=true")),
    "dataset_not_utf8": Attack(
        "a dataset file with a byte that is not UTF-8", "one line naming the file and the line; exit 2",
        lambda tmp: _dataset(tmp, b'{"prompt": "a", "answer": "1"}\n{"prompt": "b\xff", "answer": "2"}\n')),
    "sigint": Attack("Ctrl-C (SIGINT) after 3 steps", "stops at a safe point; summary 'interrupted'; exit 130",
                     _signal(signal.SIGINT)),
    "sigterm": Attack("SIGTERM after 3 steps (timeout, schedulers, container stops)",
                      "as Ctrl-C: summary 'terminated', control.sock removed; exit 143", _signal(signal.SIGTERM)),
    "sighup": Attack("SIGHUP after 3 steps (the terminal closed)", "as SIGTERM; exit 129", _signal(signal.SIGHUP)),
    "reward_wrong_length": Attack(
        "a reward function returning 1 value for 8 completions",
        "stops: one line (its last) and error.log; exit 1",
        lambda tmp: _run(tmp, "--set", "eval_every=null", "--set", "reward.funcs=[user_code:short]")),
    "reward_strings": Attack(
        "a reward function returning strings", "stops: one line and error.log; exit 1",
        lambda tmp: _run(tmp, "--set", "eval_every=null", "--set", "reward.funcs=[user_code:words]")),
    "reward_coroutine": Attack(
        "a (sync) reward function returning a coroutine", "stops: one line and error.log; exit 1",
        lambda tmp: _run(tmp, "--set", "eval_every=null", "--set", "reward.funcs=[user_code:coroutine]")),
    "custom_sampler_raises": Attack(
        "a custom sampler whose select raises at T=1", "stops: one line and error.log; exit 1",
        lambda tmp: _run(tmp, *SIMULATED, "--set", "sampler.name=custom",
                         "--set", "sampler.target=user_code:RaisingSampler", steps=4)),
    "eval_reward_raises": Attack(
        "a reward function that raises in evaluation only (eval_every 1)",
        "a fault row; the prompt left out of the evaluation (eval_failed); the run goes on",
        lambda tmp: _run(tmp, "--set", "eval_every=1", "--set", "reward.funcs=[user_code:raises_in_eval]")),
    "eval_reward_exits": Attack(
        "a reward function that calls os._exit in evaluation",
        "contained in a worker: a fault, the run goes on (summary written, control.sock removed)",
        lambda tmp: _run(tmp, "--set", "eval_every=1", "--set", "reward.funcs=[user_code:exits_in_eval]")),
    "eval_reward_hangs": Attack(
        f"a reward function that sleeps for ever in evaluation (reward.timeout_s 2; killed after {HANG_S:g} s)",
        "a timeout fault after reward.timeout_s; never a hang",
        lambda tmp: _run(tmp, "--set", "eval_every=1", "--set", "reward.timeout_s=2",
                         "--set", "reward.funcs=[user_code:hangs_in_eval]")),
    "reward_1e308": Attack(
        "a reward of 1e308 (finite) for every completion",
        "non-finite loss/gradient never reaches the optimizer: fault rows, then one line naming "
        "faults.max_nonfinite_steps",
        lambda tmp: _run(tmp, "--set", "eval_every=null", "--set", "reward.funcs=[user_code:huge]", steps=5)),
    "checkpoint_flipped_byte": Attack(
        "one byte flipped in the newest checkpoint's tensors.pt, then --resume",
        "the damaged checkpoint named and skipped; resumes from the one before", _flipped_checkpoint_byte),
    "disk_full": Attack(
        "the disk fills mid-run (a 64 KiB file-size limit: writes fail with OSError)",
        "stops at a safe point: one line naming the path and the error; every row whole; exit 1", _disk_full),
    "trace_cut_mid_row": Attack(
        "trace.csv cut mid-row, then Recording and `asyncrl replay`",
        "opens up to its last whole step with a warning naming the file; replay says the same",
        _cut_file("trace.csv", _mid_last_row)),
    "metrics_cut_in_half": Attack(
        "metrics.csv cut in half, then Recording and `asyncrl replay`",
        "opens up to its last whole step with a warning naming the file",
        _cut_file("metrics.csv", lambda data: len(data) // 2)),
    "client_exits_while_paused": Attack(
        "an attached client pauses the run and exits", "the run resumes within seconds and says so",
        _client_exits_while_paused),
    "assign_ctrl_policy": Attack(
        "`ctrl.policy = other` after construction", "AttributeError saying to build a new Controller(...)",
        lambda tmp: _python(tmp, """
            from asyncrl import Controller, load_config
            ctrl = Controller.from_config(load_config("quickstart", generation={"backend": "simulated"},
                                                      trainer={"backend": "simulated"}))
            ctrl.policy = ctrl.policy
            print("assigned silently")
        """)),
    "kill9_and_resume": Attack(
        "weight_fifo run killed with SIGKILL at 7 rows (checkpoints every 3), resumed to 12 steps",
        "identical to an uninterrupted run in every non-timing column", _kill_and_resume),
}


def run_attack(name: str, tmp: Path) -> Outcome:
    """One attack in ``tmp`` (a fresh directory); an error of the harness itself is its outcome, not a crash."""
    try:
        return ATTACKS[name].run(tmp)
    except Exception as exc:  # the record goes on: the row says what broke
        return Outcome("-", f"harness error: {type(exc).__name__}: {exc}", "-")
