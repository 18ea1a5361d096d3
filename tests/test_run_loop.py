"""The run loop a notebook can trust: interrupt, background runs (pause / resume / stop), breakpoints (``until``),
fail-fast on errors in either pump or backend, the stall watchdog, the step timer, and the CLI under Ctrl-C.

Runs use the simulated backends with latency knobs so that they last long enough to interrupt. Nothing here asserts
a duration: a run that should end is waited for in a thread with a generous join timeout, so a hang fails the test
instead of hanging the suite. Timings are in benchmarks/."""

from __future__ import annotations

import _thread
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pandas as pd
import torch
import pytest
from tests.test_controller import accounting

from asyncrl import Controller, cli, load_config
from asyncrl.faults import GenerationFailed
from asyncrl.run_loop import StallError, runs_in_lockstep

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 120  # a run that should end and has not after this long is hung (generous: the test box is loaded)
SAMPLERS = [
    {"name": "in_order", "max_lookahead_versions": 1},
    {"name": "weight_fifo", "max_staleness_versions": 1},
    {"name": "windowed", "max_staleness_versions": 1},
    {"name": "ready_first", "max_staleness_versions": 1},
]


def simulated(sampler=None, latency_s=0.005, train_s_per_token=2e-5, **overrides) -> Controller:
    """A controller on the simulated backends: generation takes ~latency_s a group, training ~1 ms a step."""
    cfg = load_config(
        "quickstart", eval_every=None,
        generation={"backend": "simulated", "clock": "wall", "prefill_s": latency_s},
        trainer={"backend": "simulated", "clock": "wall", "train_s_per_token": train_s_per_token},
        **({"sampler": sampler} if sampler else {}), **overrides,
    )
    return Controller.from_config(cfg)


def wait_for(predicate, what: str, timeout_s: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def in_thread(fn, *args, **kwargs):
    """Call ``fn`` in a thread; return ``(result, exception)``; fail (not hang) when it does not return."""
    out = {}

    def body():
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"{fn.__name__} hung: still going after {HANG_S} s"
    return out.get("result"), out.get("error")


def assert_quiet(ctrl: Controller) -> None:
    """Nothing trains or generates in the background: no thread of the run is alive and T stays put."""
    assert not ctrl.last_run.alive and not ctrl.last_run.running
    T, trace = ctrl.trainer_version, len(ctrl.trace)
    time.sleep(1.0)
    assert ctrl.trainer_version == T and len(ctrl.trace) == trace


def assert_steppable(ctrl: Controller) -> None:
    T = ctrl.trainer_version
    for _ in range(50):
        ctrl.tick()
        if ctrl.trainer_version > T:
            break
    assert ctrl.trainer_version > T, "stepping by hand no longer finishes a step"
    accounting(ctrl)


# -------------------------------------------------------------------------------------------------- interrupt
@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler for the test. ``_thread.interrupt_main()`` raises KeyboardInterrupt only while
    SIGINT has a Python handler; a suite started where SIGINT is ignored (``nohup``, ``trap '' INT``, some CI
    runners) inherits SIG_IGN, the interrupt never arrives, and the run below would go on forever."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_interrupt_during_run_stops_both_pumps_and_leaves_the_controller_steppable(sigint_raises):
    ctrl = simulated({"name": "windowed", "max_staleness_versions": 1}, latency_s=0.02)

    def interrupt_once_running():
        wait_for(lambda: ctrl.trainer_version >= 2, "two steps")
        _thread.interrupt_main()  # what a notebook's Interrupt and Ctrl-C deliver: KeyboardInterrupt in the caller

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        ctrl.run(100_000, progress=False)
    assert ctrl.last_run.status == "interrupted" and ctrl.last_run.error is None
    assert_quiet(ctrl)
    ends = accounting(ctrl)  # every dispatched group trained, evicted, aborted, buffered or still in flight
    assert ends["select"] >= 16
    inflight, deadline = set(ctrl.inflight), time.monotonic() + HANG_S
    while inflight & set(ctrl.inflight):  # a later tick collects what was in flight
        assert time.monotonic() < deadline, f"groups {inflight & set(ctrl.inflight)} never came back"
        ctrl.rollout_tick()
        time.sleep(0.02)
    assert_steppable(ctrl)
    T = ctrl.trainer_version
    ctrl.run(2, progress=False)
    assert ctrl.trainer_version == T + 2


def test_the_interrupt_test_passes_in_a_suite_started_with_sigint_ignored():
    """As under ``nohup`` or ``trap '' INT``: the test process inherits SIGINT ignored. The interrupt test installs
    the handler it relies on, so it passes instead of running for ever (before: a 25-minute hang, until killed)."""
    test = "tests/test_run_loop.py::test_interrupt_during_run_stops_both_pumps_and_leaves_the_controller_steppable"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout", "120", test],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 passed" in proc.stdout


# ------------------------------------------------------------------------------------------------- fail fast
class Boom(RuntimeError):
    pass


# The default retry budget, with its backoff shrunk from 0.05 s doubling to 2 s (about 7 s in all) to 1 ms.
FAST_RETRIES = {"backoff_s": 0.001, "max_backoff_s": 0.001}


def fail_after(obj, name: str, calls: int) -> None:
    """Make ``obj.name`` raise ``Boom`` from its ``calls``-th call on."""
    method, count = getattr(obj, name), [0]

    def failing(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise Boom(f"{name} failed on call {count[0]}")
        return method(*args, **kwargs)

    setattr(obj, name, failing)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: s["name"])
@pytest.mark.parametrize("backend,method", [("generator", "poll"), ("policy", "train_microbatches")])
def test_an_error_in_either_backend_is_re_raised_never_a_hang(sampler, backend, method):
    # FAST_RETRIES: the default backoff would wait ~7 s through the 8 retries; the pacing is
    # test_a_run_spaces_generation_retries_by_the_backoff's, here only that the error comes back once they are spent
    ctrl = simulated(sampler, latency_s=0.02, faults=FAST_RETRIES)
    fail_after(getattr(ctrl, backend), method, 12)
    _, error = in_thread(ctrl.run, 100_000, progress=False)
    # A generation failure is retried until faults.generation_retries is spent (asyncrl/faults.py), then
    # GenerationFailed carries the backend's own error as its cause; a training failure is raised as it is.
    original = error.__cause__ if isinstance(error, GenerationFailed) and backend == "generator" else error
    assert isinstance(original, Boom), f"expected the backend's own error, got {error!r}"
    where = "".join(traceback.format_tb(original.__traceback__) + traceback.format_tb(error.__traceback__))
    assert "failing" in where and ("rollout_tick" if backend == "generator" else "train_tick") in where
    assert ctrl.last_run.status == "failed" and ctrl.last_run.error is error
    assert_quiet(ctrl)


def test_an_error_is_kept_in_the_handle_of_a_background_run():
    ctrl = simulated(latency_s=0.01, faults=FAST_RETRIES)
    fail_after(ctrl.generator, "poll", 5)
    handle = ctrl.start(100_000, progress=False)
    wait_for(lambda: not handle.running, "the failed run to end")
    assert isinstance(handle.error.__cause__, Boom) and handle.status == "failed" and not handle.alive
    with pytest.raises(GenerationFailed, match="poll failed"):  # after the retries (asyncrl/faults.py)
        handle.wait()


def test_stall_watchdog_names_what_each_pump_waits_for():
    ctrl = simulated({"name": "weight_fifo", "max_staleness_versions": 1}, latency_s=0.005, stall_timeout_s=1.0)
    ctrl.run(2, progress=False)
    ctrl.generator.poll = lambda timeout=0.0: time.sleep(timeout or 0) or []  # groups in flight never come back
    _, error = in_thread(ctrl.run, 100, progress=False)
    assert isinstance(error, StallError), repr(error)
    text = str(error)
    assert "no commit and no step for 1 s" in text and "in flight" in text
    assert "rollout pump:" in text and "train pump: waiting: select waits" in text
    assert "verdicts" in text
    assert_quiet(ctrl)


# ----------------------------------------------------------------------------------------- background runs
def test_pause_resume_stop_a_background_run():
    ctrl = simulated({"name": "weight_fifo", "max_staleness_versions": 1}, latency_s=0.01)
    handle = ctrl.start(100_000, progress=False)
    assert handle.running
    with pytest.raises(RuntimeError, match="already going"):
        ctrl.start(5, progress=False)
    with pytest.raises(RuntimeError, match="already going"):
        ctrl.run(5, progress=False)
    with pytest.raises(RuntimeError, match="pause it"):
        ctrl.tick()
    wait_for(lambda: ctrl.trainer_version >= 2, "two steps")

    handle.pause()
    assert handle.paused and handle.running
    T, trace = ctrl.trainer_version, len(ctrl.trace)
    time.sleep(0.5)
    assert ctrl.trainer_version == T and len(ctrl.trace) == trace  # parked
    for _ in range(50):  # the person steps by hand while the run is paused
        ctrl.tick()
        if ctrl.trainer_version > T:
            break
    assert ctrl.trainer_version == T + 1

    handle.resume()
    assert not handle.paused
    wait_for(lambda: ctrl.trainer_version >= T + 3, "the resumed run to train")
    handle.stop()
    assert not handle.running and handle.status == "stopped" and handle.error is None
    frame = handle.wait()
    assert frame.attrs["status"] == "stopped" and len(frame) == ctrl.trainer_version
    assert_quiet(ctrl)
    accounting(ctrl)
    assert_steppable(ctrl)
    ctrl.run(2, progress=False)  # and a new run goes


def test_step_timer_counts_active_time_only():
    ctrl = simulated(latency_s=0.0)
    while ctrl.trainer_version < 1:
        ctrl.tick()
    ctrl.rollout_tick()
    time.sleep(0.5)  # a person reading the buffer between two hand ticks
    while ctrl.trainer_version < 2:
        ctrl.tick()
    assert ctrl.metrics.step_time_s.iloc[1] < 0.5


# ---------------------------------------------------------------------------------------------- breakpoints
def test_until_an_event_name_stops_right_after_it_and_stays_steppable():
    # rollouts outpace training, so windowed dispatches ahead and evicts what falls out of its window
    ctrl = simulated({"name": "windowed", "max_staleness_versions": 1}, latency_s=0.001, train_s_per_token=2e-4)
    with pytest.raises(ValueError, match="'evicted' is not a trace event; events: admit, .*evict"):
        ctrl.run(5, until="evicted", progress=False)
    assert len(ctrl.trace) == 0
    frame = ctrl.run(1000, until="evict", progress=False)
    row = frame.attrs["breakpoint"]
    assert frame.attrs["status"] == "breakpoint" and ctrl.last_run.status == "breakpoint"
    assert row.event == "evict" and row["event"] == "evict"
    trace = ctrl.trace
    first = trace[trace.event == "evict"].iloc[0]
    assert first.seq == row.seq and ctrl.trainer_version < 1000
    # stopped at the end of the tick that evicted: that tick trained its chunk, the train pump did not tick again
    assert (trace[trace.seq > row.seq].event == "train").sum() <= 1
    assert_quiet(ctrl)
    assert len(ctrl.explain()) == len(ctrl.buffer)  # the person reads the verdicts at that moment
    assert_steppable(ctrl)


def test_until_a_predicate_on_a_trace_row():
    ctrl = simulated({"name": "in_order", "max_lookahead_versions": 1})
    frame = ctrl.run(1000, until=lambda row: row.event == "commit" and row.group_id >= 20, progress=False)
    row = frame.attrs["breakpoint"]
    assert row.event == "commit" and row.group_id >= 20
    commits = ctrl.trace[ctrl.trace.event == "commit"]
    assert commits[commits.group_id >= 20].iloc[0].seq == row.seq
    assert_quiet(ctrl)
    assert_steppable(ctrl)
    with pytest.raises(TypeError, match="until must be"):
        ctrl.run(3, until=3, progress=False)


def test_a_breakpoint_that_never_fired_is_said_in_the_result_and_a_warning():
    # in_order with lookahead never evicts: until="evict" cannot match, and all the steps run
    ctrl = simulated({"name": "in_order", "max_lookahead_versions": 1})
    with pytest.warns(UserWarning, match=r"until='evict' never matched: the run completed after 3 step\(s\)"):
        frame = ctrl.run(3, until="evict", progress=False)
    assert frame.attrs["status"] == "completed" and len(frame) == 3
    assert frame.attrs["breakpoint"] is None and frame.attrs["until_fired"] is False
    fired = simulated({"name": "in_order", "max_lookahead_versions": 1}).run(10, until="commit", progress=False)
    assert fired.attrs["until_fired"] is True and fired.attrs["status"] == "breakpoint"
    assert ctrl.run(1, progress=False).attrs["until_fired"] is None  # no until, nothing to say


def test_the_readmes_breakpoint_example_stops_at_an_eviction():
    """README's ``run(50, until="evict")`` under the controller it builds for it stops at an eviction."""
    lines = (ROOT / "README.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '.run(50, until="evict")' in line)
    name = lines[at].split(".run(")[0].strip()
    built = next(line for line in lines[:at] if line.startswith(f"{name} = "))
    ctrl = eval(built.split(" = ", 1)[1], {"Controller": Controller, "load_config": load_config})
    frame = ctrl.run(50, until="evict", progress=False)
    assert frame.attrs["status"] == "breakpoint" and frame.attrs["breakpoint"].event == "evict"
    assert ctrl.trainer_version < 50


def test_a_failing_predicate_fails_the_run():
    ctrl = simulated()
    _, error = in_thread(ctrl.run, 100, until=lambda row: row.no_such_column, progress=False)
    assert isinstance(error, AttributeError)
    assert_quiet(ctrl)


# ------------------------------------------------------------------------------------------------------ CLI
def test_cli_ctrl_c_stops_cleanly_with_every_finished_step_written(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--steps", "100000", "--out", str(out), "--quiet",
         "--set", "generation.backend=simulated", "--set", "generation.clock=wall",
         "--set", "generation.prefill_s=0.01",
         "--set", "trainer.backend=simulated", "--set", "eval_every=null"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: (out / "metrics.csv").exists() and len((out / "metrics.csv").read_text().splitlines()) > 3
                 or proc.poll() is not None, "three finished steps in metrics.csv")
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] >= 3
    metrics, trace = pd.read_csv(out / "metrics.csv"), pd.read_csv(out / "trace.csv")
    assert metrics.step.tolist() == list(range(summary["steps"]))
    assert (trace.event == "step").sum() == summary["steps"] and trace.seq.tolist() == list(range(len(trace)))
    assert "Traceback" not in stderr and "terminate called" not in stderr


def test_cli_checks_everything_before_writing_anything(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = [
        (["no_such_preset", "--out", str(tmp_path / "a")], "unknown preset"),
        (["quickstart", "--out", str(tmp_path / "b"), "--set", "sampler.name=nope"], "sampler"),
        (["quickstart", "--out", str(blocker / "c")], "not a directory"),
        (["quickstart", "--out", str(blocker)], "not a directory"),
    ]
    # In this process, through the CLI's own entry point (cli.main returns what ``python -m asyncrl.cli`` exits
    # with): four fresh interpreters importing torch took ~15 s; tests/test_cli.py runs such errors in a subprocess.
    for argv, message in cases:
        code = cli.main(["run", *argv, "--steps", "2", "--quiet"])
        stderr = capsys.readouterr().err
        assert code == 2 and message in stderr, (argv, stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_pump_never_sleeps_through_a_step_that_came_during_its_tick():
    """No lost wake-up: the rollout pump's tick finds the gate shut, and before the tick returns the train pump
    finishes a step (``T`` moves, the gate opens, its ``notify_all`` is spent). The pump must look again instead of
    waiting a whole ``POLL_S`` with the gate open. The interleaving is forced (such a tick returns only once ``T``
    moved), so the check needs no timing: the pump must not enter a wait after such a tick."""
    ctrl = simulated({"name": "weight_fifo", "max_staleness_versions": 1}, latency_s=0.001, train_s_per_token=2e-4)
    tick, wait = ctrl.rollout_tick, ctrl.changed.wait
    straddled, slept = threading.Event(), []
    forced: list[int] = []

    def straddling_tick(*args, **kwargs):
        straddled.clear()
        T = ctrl.trainer_version
        report = tick(*args, **kwargs)
        if report.note.startswith("gate closed") and not ctrl.inflight and len(forced) < 5:
            wait_for(lambda: ctrl.trainer_version > T, "the train pump's step")  # it has all it needs for it
            forced.append(T)
            straddled.set()
        return report

    def watched_wait(timeout=None):
        if straddled.is_set() and threading.current_thread().name == "asyncrl-rollout-pump":
            straddled.clear()
            slept.append(ctrl.trainer_version)
        return wait(timeout)

    ctrl.rollout_tick, ctrl.changed.wait = straddling_tick, watched_wait
    _, error = in_thread(ctrl.run, 10, progress=False)
    assert error is None and ctrl.trainer_version == 10
    assert forced, "the interleaving was never forced: the check would pass vacuously"
    assert not slept, f"the rollout pump waited after a step had opened its gate (at T={slept})"
    accounting(ctrl)


def test_a_run_spaces_generation_retries_by_the_backoff():
    """A generation backend that keeps failing is retried after ``faults.backoff(n)`` seconds each time, also while
    nothing is in flight (the gate shut during a long step), until ``generation_retries`` are spent: a run must
    not burn its retry budget in a few milliseconds (the pumps look again at once after a tick that wrote a trace
    row; the backoff is what paces them)."""
    ctrl = simulated({"name": "weight_fifo", "max_staleness_versions": 1}, latency_s=0.002,
                     faults={"generation_retries": 4, "backoff_s": 0.05, "max_backoff_s": 0.2})
    ctrl.run(2, progress=False)
    finish, poll, attempts = ctrl.policy.finish_train_step, ctrl.generator.poll, []
    ctrl.policy.finish_train_step = lambda: time.sleep(2.0) or finish()  # a long step: the gate stays shut

    def failing(timeout=0.0):
        if ctrl.inflight:
            return poll(timeout)
        attempts.append(time.monotonic())
        raise RuntimeError("the generation server went away")

    ctrl.generator.poll = failing
    _, error = in_thread(ctrl.run, 100, progress=False)
    assert isinstance(error, GenerationFailed), repr(error)
    assert len(attempts) == 5  # the first failure and 4 retries
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert all(gap >= 0.95 * ctrl.cfg.faults.backoff(n) for n, gap in enumerate(gaps, start=1)), gaps
    accounting(ctrl)


@pytest.mark.parametrize("sampler, lockstep", [
    ({"name": "in_order", "max_lookahead_versions": 0}, True),
    ({"name": "weight_fifo", "max_staleness_versions": 0}, True),
    ({"name": "in_order", "max_lookahead_versions": 1}, False),
    ({"name": "windowed", "max_staleness_versions": 0}, False),  # ungated: always admits, so it can run ahead
])
def test_a_sampler_that_cannot_admit_ahead_runs_both_ticks_on_one_thread(sampler, lockstep):
    """Lockstep: nothing can overlap when admission waits for training, so one pump thread does both ticks (a step
    is not handed across cores); otherwise two pumps. Pause, hand ticks while paused, and resume work either way."""
    ctrl = simulated(sampler, latency_s=0.001, train_s_per_token=2e-5)
    assert ctrl.lockstep is lockstep
    seen: set[str] = set()
    ctrl.subscribe(lambda _row: seen.add(threading.current_thread().name))
    handle = ctrl.start(6, progress=False)
    wait_for(lambda: ctrl.trainer_version >= 2, "two steps")
    handle.pause()
    T = ctrl.trainer_version
    ctrl.tick()  # by hand, while paused
    assert ctrl.trainer_version >= T
    handle.resume()
    handle.wait()
    assert handle.status == "completed"
    pumps = {name for name in seen if name.endswith("-pump")}
    assert pumps == ({"asyncrl-lockstep-pump"} if lockstep else {"asyncrl-rollout-pump", "asyncrl-train-pump"})
    accounting(ctrl)


@pytest.mark.parametrize("pump_threads, lockstep", [(1, True), (2, False), ("auto", False)])
def test_pump_threads_chooses_one_thread_or_two_for_an_asynchronous_sampler(pump_threads, lockstep):
    """``pump_threads`` 1 runs weight_fifo W=1's ticks on one thread, still a version ahead (lag 1); 2 and auto (off
    a shared GPU) give each pump its own. Every group is accounted for either way."""
    ctrl = simulated({"name": "weight_fifo", "max_staleness_versions": 1}, latency_s=0.001, pump_threads=pump_threads)
    assert ctrl.lockstep is lockstep
    seen: set[str] = set()
    ctrl.subscribe(lambda _row: seen.add(threading.current_thread().name))
    metrics = ctrl.run(6, progress=False)
    assert {name for name in seen if name.endswith("-pump")} == (
        {"asyncrl-lockstep-pump"} if lockstep else {"asyncrl-rollout-pump", "asyncrl-train-pump"})
    assert len(metrics) == 6 and metrics.lag_max.max() == 1  # asynchronous on one thread too: trained a version stale
    accounting(ctrl)


@pytest.mark.parametrize("trainer, generation, lockstep", [
    ({"device": "cuda"}, {"device": "cuda:0"}, True),  # one GPU, both engines in this process: the device lock
    ({"device": "cuda:1"}, {"device": "cuda:0"}, False),  # a GPU each: generation overlaps training
    ({"device": "cpu"}, {"device": "cpu"}, False),
    ({"device": "cuda"}, {"device": "cuda", "placement": "ray"}, False),  # another process: no lock between them
])
def test_auto_runs_an_asynchronous_sampler_on_one_thread_when_both_engines_share_one_gpu(trainer, generation,
                                                                                          lockstep):
    cfg = load_config("quickstart", sampler={"name": "weight_fifo", "max_staleness_versions": 1}, trainer=trainer,
                      generation=generation)
    assert runs_in_lockstep(cfg, admits_ahead=True) is lockstep
    assert runs_in_lockstep(cfg.model_copy(update={"pump_threads": 2}), admits_ahead=True) is False
    assert runs_in_lockstep(cfg, admits_ahead=False) is True  # nothing to overlap


def test_overlap_runs_a_pump_a_thread_on_the_shared_gpu_and_needs_vllm_and_megatron_sharing_one():
    cfg = load_config("gpu_real_shape", device_sharing="overlap")  # the trainer's passes beside vLLM's decoding
    assert runs_in_lockstep(cfg, admits_ahead=True) is False
    assert runs_in_lockstep(cfg.model_copy(update={"device_sharing": "turns"}), admits_ahead=True) is True
    assert runs_in_lockstep(cfg, admits_ahead=False) is True  # a synchronous sampler: nothing to overlap
    with pytest.raises(ValueError, match=re.escape(
            "device_sharing 'overlap' runs Megatron's passes beside vLLM on the CUDA device both use in this process; "
            "got generation 'vllm' on 'cuda:0' (local) and trainer 'megatron' on 'cuda:1' (local): use "
            "device_sharing 'turns'")):
        load_config("gpu_real_shape", device_sharing="overlap", trainer={"device": "cuda:1"},
                    generation={"device": "cuda:0"})
    with pytest.raises(ValueError, match="got generation 'torch' on 'cpu'"):
        load_config("quickstart", device_sharing="overlap")
    with pytest.raises(ValueError, match=r"device_sharing[\s\S]*'turns' or 'overlap'"):
        load_config("gpu_real_shape", device_sharing="always")


def test_pump_threads_refuses_other_values_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"pump_threads[\s\S]*'auto', 1 or 2"):
        load_config("quickstart", pump_threads=3)


def test_a_run_lets_the_callers_idle_openmp_workers_go_so_the_pumps_pool_keeps_spinning():
    """With libgomp, a pool too many (the caller's, idle, beside the pump's) puts the pump's workers to sleep after
    every op: release_idle_openmp_workers frees the calling thread's workers only, and torch builds them again."""
    script = """
import os, torch
from asyncrl.run_loop import _libgomp_pause, release_idle_openmp_workers
if _libgomp_pause() is None:
    print("NO_LIBGOMP"); raise SystemExit
torch.set_num_threads(2)
x = torch.randn(4_000_000)
def threads():
    return len(os.listdir("/proc/self/task"))
(x * 2).sum()  # a parallel region on this thread: its pool now holds a worker
before = threads()
released = release_idle_openmp_workers()
after = threads()
(x * 2).sum()
print(released, before - after, threads() - after)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if "NO_LIBGOMP" in out.stdout:
        pytest.skip("torch does not use GNU libgomp here")
    released, gone, rebuilt = out.stdout.split()
    assert (released, gone, rebuilt) == ("True", "1", "1"), out.stdout


@pytest.mark.parametrize("sampler, torch_threads, expected", [
    ({"name": "weight_fifo", "max_staleness_versions": 1}, None, 2),  # two pumps computing on this CPU: half each
    ({"name": "weight_fifo", "max_staleness_versions": 1}, 4, 4),  # the person's own choice is kept
    ({"name": "in_order", "max_lookahead_versions": 0}, None, 4),  # lockstep: one pump, every thread
])
def test_two_pumps_on_one_cpu_share_its_torch_threads_and_the_caller_keeps_its_own(sampler, torch_threads, expected):
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        ctrl = Controller.from_config(load_config("quickstart", eval_every=None, sampler=sampler,
                                                  torch_threads=torch_threads, generation={"max_new_tokens": 4}))
        seen = set()
        ctrl.start(2, progress=False, on_step=lambda row, events: seen.add(torch.get_num_threads())).wait()
        assert seen == {expected}, f"the pump trained with {seen} torch threads"
        assert torch.get_num_threads() == 4, "the caller's thread count changed"
        ctrl.close()
    finally:
        torch.set_num_threads(previous)
