"""Running both pumps: ``Controller.start`` returns a ``RunHandle``; ``Controller.run`` is ``start(...).wait()``.

A run is three threads. The rollout pump and the train pump loop over the controller's own ``rollout_tick`` and
``train_tick`` (a run does exactly what stepping does, only concurrently, so generation overlaps training); a
supervisor starts them, watches for stalls and closes the run. The person's thread only asks (``pause``,
``resume``, ``stop``) and waits. Lockstep: when the sampler cannot admit ahead of training
(``Controller.lockstep``: ``in_order`` with no lookahead), there is nothing for two threads to overlap, so one
pump thread runs a rollout tick then a train tick, as stepping does, and nothing is handed across cores (a backend
that generates in a thread or actor of its own still generates while the driver trains). So does an asynchronous
sampler's run when both engines share one GPU (``runs_in_lockstep``; ``pump_threads`` chooses by hand).

Invariants:
- Safe points. A pump looks at pause and stop only between two ticks, where it holds no lock and no tick is half
  done. So a stopped, paused or interrupted run leaves the controller as stepping would: every dispatched group is
  trained, evicted, aborted, buffered or still in flight (a later tick collects it), and stepping works.
- Fail fast. The first exception to escape a tick, a callback or the breakpoint predicate, or the watchdog's
  ``StallError``, is the run's ``error``: both pumps stop at their next safe point and ``wait()`` re-raises that same
  exception object (its traceback shows where in the pump it happened).
- One run at a time per controller, and no tick by hand while its pumps go; parked (paused) pumps allow it.
- Stop and pause take effect within one tick plus ``POLL_S``: an idle pump never waits longer than that.
- Wall-time limit (``max_time_s``, default ``cfg.max_time_s``): judged after each finished step, so the run ends
  on a step boundary ("time_limit"), never inside one; then, as a completed run, it collects what finished and, with
  ``checkpoint_every``, saves a checkpoint of that step unless the step's own periodic save just wrote it.
- Public API only: the handle drives the controller through its ticks, ``subscribe`` (the ``until`` breakpoint,
  ``on_step``, the progress bar), ``changed`` / ``num_events`` (wake-ups), ``clock``, ``drain`` and ``explain``.
- No lost wake-ups. A pump waits on the controller's condition only if the trace has not grown since its tick
  began: whatever the other pump did meanwhile (a step moving ``T``, a select freeing room, a commit) wrote a
  trace row, and its ``notify_all`` may have come while this pump was still inside its tick. (Without this check a
  rollout pump that finished an idle tick just after a step slept a whole ``POLL_S`` with the gate open: on two
  GPUs that was a 47 ms stall every few steps.)
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch

from asyncrl.backends.device_lock import share_device
from asyncrl.config.placement import shared_cuda_index
from asyncrl.pump_threads import _libgomp_pause, release_idle_openmp_workers, torch_threads_per_pump  # noqa: F401
from asyncrl.reports import TickReport
from asyncrl.trace import SKIP, TRACE_EVENTS, StepEvent, TraceRow

POLL_S = 0.05  # longest wait of an idle pump before it looks again (bounds how late a stop or pause lands)
STOP_GRACE_S = 5.0  # after an error, how long the supervisor waits for a pump still inside a backend call
ENDS = ("completed", "exhausted", "breakpoint", "time_limit", "stopped", "interrupted", "failed")


class StallError(RuntimeError):
    """No commit and no step for ``stall_timeout_s``; the message says what each pump waits for and gives the
    sampler's verdicts."""


class ActiveClock:
    """Seconds in which the controller was working: inside a tick, or while a run's pumps were going (not paused).
    The step timer reads it, so a person's think-time between hand ticks does not dilute ``tokens_per_s``.
    Re-entrant: a run's ticks nest inside the run's own span."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth, self._since, self._total = 0, 0.0, 0.0

    def __enter__(self) -> ActiveClock:
        with self._lock:
            if self._depth == 0:
                self._since = time.perf_counter()
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._total += time.perf_counter() - self._since

    def now(self) -> float:
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._depth else 0.0)


def breakpoint_matcher(until: str | Callable | None, events: tuple[str, ...]) -> Callable | None:
    """``until`` as a predicate on a trace row; a bad value is an error naming what is allowed."""
    if until is None:
        return None
    if isinstance(until, str):
        if until not in events:
            raise ValueError(f"until={until!r} is not a trace event; events: {', '.join(events)} "
                             "(or pass a callable taking a trace row)")
        return lambda row: row.event == until
    if callable(until):
        return until
    raise TypeError(f"until must be a trace event name ({', '.join(events)}) or a callable taking a trace row, "
                    f"got {until!r}")


class RunHandle:
    """A run of both pumps in the background (``Controller.start``).

    ``pause()`` parks both pumps at a safe point and returns once they are parked (tick by hand meanwhile);
    ``resume()`` goes on; ``stop()`` ends the run at a safe point; ``wait()`` blocks until the run ended, re-raises
    its error, and returns the metrics of the steps finished since it started (``.attrs["status"]`` and
    ``.attrs["breakpoint"]`` say how it ended; ``.attrs["until_fired"]`` whether ``until`` matched, None without
    one: a run that ended without its breakpoint also warns). ``running`` is true until the run ended (also while
    paused); ``status`` is ``running``, ``paused`` or how it ended (``ENDS``); ``error`` the exception that ended it;
    ``breakpoint`` the trace row that matched ``until``.
    """

    def __init__(self, ctrl: Any, steps: int, until=None, progress: bool = True,
                 on_step: Callable[[dict, list[TraceRow]], Any] | None = None, max_time_s: float | None = None,
                 checkpoint: Callable[[], Any] | None = None):
        # ``ctrl``: an ``asyncrl.Controller`` (not imported: the controller imports this module); ``checkpoint``:
        # its periodic save (``checkpoint_every``), for a run that ends at its wall-time limit
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        self.max_time_s = ctrl.cfg.max_time_s if max_time_s is None else max_time_s
        if self.max_time_s is not None and not (type(self.max_time_s) in (int, float) and self.max_time_s > 0):
            raise ValueError(f"max_time_s must be a number of seconds > 0 (or None: no limit), got {max_time_s!r}")
        self._started_at, self._checkpoint = time.monotonic(), checkpoint  # the limit's clock (reset at launch)
        self._match = breakpoint_matcher(until, TRACE_EVENTS)
        self.ctrl, self.steps, self.until, self.on_step = ctrl, steps, until, on_step
        self.target = ctrl.trainer_version + steps  # the run ends when T reaches it (hand ticks while paused count)
        self.status = "running"
        self.error: BaseException | None = None
        self.breakpoint = None
        self.stuck: list[str] = []  # pumps still inside a backend call when the run gave up on them
        # _cv guards the fields below; it is the handle's own lock, never held while ticking, never the controller's.
        self._cv = threading.Condition()
        self._end: str | None = None  # set once: why the pumps stop
        self._pause = False
        self._parked: set[str] = set()
        self._exited: set[str] = set()
        self._clocked = False
        self._unreported: list[TraceRow] = []  # trace rows not yet handed to ``on_step``
        self._steps: list[dict] = []  # metrics rows of steps this run's pumps finished, not yet reported
        self._subscription = None
        self._first_row = len(ctrl.metrics)
        self._progress_at = time.monotonic()  # last commit/select/evict/abort/step: the stall watchdog's clock
        # groups given up since the watchdog's clock last moved, and the last one's reason: a part that fails every
        # time (an environment's reset, a reward) stalls the run, and its stall message should name that failure
        self._skipped: tuple[int, str] = (0, "")
        pumps = ({"lockstep": self._lockstep_pump} if ctrl.lockstep else
                 {"rollout": self._rollout_pump, "train": self._train_pump})
        self._torch_threads = torch_threads_per_pump(ctrl.cfg, len(pumps))  # read on the person's thread
        self._caller_threads = torch.get_num_threads()
        self._pumps = tuple(pumps)
        self._doing = {name: ("starting", time.monotonic()) for name in self._pumps}
        self._finished = threading.Event()
        self._bar = _progress_bar(ctrl.trainer_version, self.target) if progress else None
        self._threads = {name: threading.Thread(target=self._guarded, args=(name, pumps[name]), daemon=True,
                                                name=f"asyncrl-{name}-pump") for name in self._pumps}
        self._supervisor = threading.Thread(target=self._supervise, daemon=True, name="asyncrl-run")

    def _launch(self) -> None:
        self._started_at = time.monotonic()
        release_idle_openmp_workers()
        self._share("overlap")
        self._subscription = self.ctrl.subscribe(self._on_event)
        with self._cv:
            self.ctrl.clock.__enter__()
            self._clocked = True
        self._supervisor.start()

    def _share(self, mode: str) -> None:
        """``device_sharing: overlap`` holds only while the pumps run (backends/device_lock.py)."""
        cfg = self.ctrl.cfg
        if cfg.device_sharing == "overlap":
            share_device(f"cuda:{shared_cuda_index(cfg.generation, cfg.trainer)}", mode)

    def _on_event(self, event: TraceRow | StepEvent) -> None:
        """Every event of the controller, at the end of the tick that recorded it. Only events of this run's pumps
        are matched against ``until`` and count as its steps (not a hand tick's while paused, nor what the final
        drain collects)."""
        row = event.row if isinstance(event, StepEvent) else event
        ours = threading.current_thread() in self._threads.values()
        with self._cv:
            self._unreported.append(row)
            if row.event == SKIP:
                self._skipped = (self._skipped[0] + 1, row.reason)
            if ours and isinstance(event, StepEvent):
                self._steps.append(dict(event.metrics))
            if ours and self._match is not None and self.breakpoint is None and self._match(row):
                self.breakpoint = row
                self._request_end("breakpoint")

    # ------------------------------------------------------------------------------------------- the pumps
    def _rollout_pump(self) -> None:
        ctrl = self.ctrl
        while self._safe_point("rollout"):
            self._doing_now("rollout", "inside rollout_tick (dispatch, generator.poll, scoring, commit)")
            seen = ctrl.num_events
            report = ctrl.rollout_tick(wait_s=POLL_S)
            self._after_tick(report)
            if report.dispatched or report.committed:
                continue
            with ctrl.changed:
                if ctrl.num_events != seen:  # something moved during the tick (a step, room): its notify is
                    continue  # already spent, so waiting now would sleep a whole POLL_S with the gate open
                if ctrl.exhausted and not ctrl.inflight:
                    return  # nothing left to generate; the train pump drains what is buffered
                self._doing_now("rollout", f"waiting: {report.note or f'{len(ctrl.inflight)} groups in flight'}")
                ctrl.changed.wait(POLL_S)

    def _train_pump(self) -> None:
        ctrl = self.ctrl
        while self._safe_point("train"):
            if ctrl.trainer_version >= self.target:
                return self._request_end("completed")
            self._doing_now("train", "inside train_tick (evict, select, logprobs, train, optimizer step, sync)")
            seen = ctrl.num_events
            report = ctrl.train_tick()
            self._after_tick(report)
            if report.selected or report.evicted:
                continue
            with ctrl.changed:
                if ctrl.num_events != seen:  # the rollout pump committed during the tick: look again first
                    continue
                if ctrl.exhausted and not ctrl.inflight:
                    return self._request_end("exhausted")  # nothing more will arrive and select has nothing
                self._doing_now("train", f"waiting: {report.note}")
                ctrl.changed.wait(POLL_S)

    def _lockstep_pump(self) -> None:
        """Both ticks on this one thread, a rollout tick then a train tick, as ``Controller.tick`` does. With no
        progress in either, the next rollout tick's poll waits for the backend (or a short wait when nothing is in
        flight, so a failing backend's backoff paces it)."""
        ctrl, name = self.ctrl, "lockstep"
        while self._safe_point(name):
            if ctrl.trainer_version >= self.target:
                return self._request_end("completed")
            seen = ctrl.num_events
            self._doing_now(name, "inside rollout_tick (dispatch, generator.poll, scoring, commit)")
            rollout = ctrl.rollout_tick(wait_s=POLL_S)
            self._after_tick(rollout)
            if not self._safe_point(name):
                return
            self._doing_now(name, "inside train_tick (evict, select, logprobs, train, optimizer step, sync)")
            train = ctrl.train_tick()
            self._after_tick(train)
            if rollout.dispatched or rollout.committed or train.selected or train.evicted:
                continue
            if ctrl.exhausted and not ctrl.inflight:
                return self._request_end("exhausted")  # nothing more will arrive and select has nothing
            with ctrl.changed:
                if ctrl.num_events == seen and not ctrl.inflight:  # in flight: the next poll is the wait
                    self._doing_now(name, f"waiting: {train.note}")
                    ctrl.changed.wait(POLL_S)

    def _guarded(self, name: str, pump: Callable[[], None]) -> None:
        try:
            if self._torch_threads is not None:
                torch.set_num_threads(self._torch_threads)  # this thread's pool (and threads started after it)
            pump()
        except BaseException as exc:  # the run's error, re-raised by wait() in the caller's thread
            self._request_end("failed", exc)
        finally:
            with self._cv:
                self._exited.add(name)
                self._cv.notify_all()

    def _safe_point(self, name: str) -> bool:
        """Between two ticks: park here while paused; False once the run should end."""
        with self._cv:
            if self._pause and self._end is None:
                self._parked.add(name)
                self._doing_now(name, "parked (paused)")
                self._cv.notify_all()
                while self._pause and self._end is None:
                    self._cv.wait()
                self._parked.discard(name)
            return self._end is None

    def _doing_now(self, name: str, what: str) -> None:
        if self._doing[name][0] != what:
            self._doing[name] = (what, time.monotonic())

    def _after_tick(self, report: TickReport) -> None:
        if (report.committed or report.selected or report.evicted or report.aborted or report.step_finished
                or report.filtered):  # a uniform group came back: filter_uniform_groups judges that streak itself
            self._progress_at = time.monotonic()
            self._skipped = (0, "")
        if report.step_finished:
            if (self.max_time_s is not None and time.monotonic() - self._started_at >= self.max_time_s
                    and self.ctrl.trainer_version < self.target):  # (the last step: the run completed)
                self._request_end("time_limit")  # a step just ended: the safe point the limit waits for
            with self._cv:
                steps, self._steps = self._steps, []
            for row in steps:
                if self._bar is not None:
                    self._bar.set_postfix(reward=f"{row['reward_mean']:.3f}", lag=f"{row['lag_mean']:.2f}",
                                          refresh=False)
                    self._bar.update(1)
                if self.on_step is not None:
                    with self._cv:
                        events, self._unreported = self._unreported, []
                    self.on_step(row, events)

    def _request_end(self, why: str, error: BaseException | None = None) -> None:
        with self._cv:
            if error is not None and self.error is None:
                self.error, why = error, "failed"
            if self._end is None or why == "failed":
                self._end = why
            self._cv.notify_all()

    # ------------------------------------------------------------------------------------------ supervisor
    def _supervise(self) -> None:
        """Start the pumps, watch for stalls, wait for both pumps (or give up on one stuck in a backend call after
        ``STOP_GRACE_S``), then close the run."""
        for thread in self._threads.values():
            thread.start()
        stall_s = self.ctrl.cfg.stall_timeout_s
        ending_since = None
        while any(t.is_alive() for t in self._threads.values()):
            time.sleep(POLL_S)
            with self._cv:
                stalled = (self._end is None and not self._pause
                           and time.monotonic() - self._progress_at > stall_s)
                ending = self._end is not None
            if stalled:
                self._request_end("failed", StallError(self._stall_message(stall_s)))
            if ending and ending_since is None:
                ending_since = time.monotonic()
            if ending_since is not None and time.monotonic() - ending_since > STOP_GRACE_S:
                break
        self._close()

    def _stall_message(self, stall_s: float) -> str:
        ctrl, now = self.ctrl, time.monotonic()
        lines = [f"stalled at T={ctrl.trainer_version}: no commit and no step for {stall_s:g} s (stall_timeout_s); "
                 f"{len(ctrl.inflight)} groups in flight, {len(ctrl.buffer)} buffered (capacity {ctrl.capacity})"
                 + (f"; {self._skipped[0]} groups skipped since the last commit; the last: {self._skipped[1]}"
                    if self._skipped[0] else "")]
        for name in self._pumps:
            what, since = self._doing[name]
            lines.append(f"  {name} pump: {what} (for {now - since:.1f} s)")
        try:
            verdicts = ctrl.explain(timeout=1.0).to_string(max_rows=20)
        except TimeoutError:
            verdicts = "(unavailable: a pump holds the controller's lock)"
        return "\n".join(lines + ["verdicts (explain()):", verdicts])

    def _close(self) -> None:
        self.stuck = [f"{name} pump: {self._doing[name][0]}" for name, t in self._threads.items() if t.is_alive()]
        if self.error is None and self._end in ("completed", "exhausted", "time_limit"):
            try:  # collect what finished after the pumps stopped, as the old run did
                self.ctrl.drain()
                cfg, T = self.ctrl.cfg, self.ctrl.trainer_version  # a time limit keeps its step (unless just saved)
                if self._end == "time_limit" and self._checkpoint and cfg.checkpoint_every and T % cfg.checkpoint_every:
                    self._checkpoint()
            except BaseException as exc:
                self.error, self._end = exc, "failed"
        if self._bar is not None:
            self._bar.close()
        self._share("turns")  # hand ticks after the run take turns again
        if self._torch_threads is not None:  # back to the caller's count for threads started later (and MKL's)
            torch.set_num_threads(self._caller_threads)
        if self._subscription is not None:
            self._subscription.cancel()
        with self._cv:
            if self._clocked:
                self.ctrl.clock.__exit__(None, None, None)
                self._clocked = False
            self.status = self._end or "stopped"
            self._finished.set()
            self._cv.notify_all()

    # ---------------------------------------------------------------------------------------- the person's side
    @property
    def running(self) -> bool:
        """True until the run ended (also while it is paused)."""
        return not self._finished.is_set()

    @property
    def paused(self) -> bool:
        return self.status == "paused"

    def pause(self) -> None:
        """Park both pumps at their next safe point; returns once both are parked (or the run ended)."""
        if self._inside():
            raise RuntimeError("pause() from inside the run (a callback or until predicate) would wait for itself")
        with self._cv:
            if self._finished.is_set() or self._pause:
                return
            self._pause = True
            self._cv.notify_all()
        self._until(lambda: self._parked | self._exited >= set(self._pumps))
        with self._cv:
            if not self._finished.is_set() and self._pause:
                self.status = "paused"
                if self._clocked:
                    self.ctrl.clock.__exit__(None, None, None)
                    self._clocked = False

    def resume(self) -> None:
        """Go on after ``pause()``; trace rows written by hand ticks meanwhile are not matched against ``until``."""
        with self._cv:
            if not self._pause:
                return
            self._pause = False
            if not self._finished.is_set():
                release_idle_openmp_workers()  # hand ticks while paused may have started a pool here again
                self.status = "running"
                self._progress_at = time.monotonic()
                if not self._clocked:
                    self.ctrl.clock.__enter__()
                    self._clocked = True
            self._cv.notify_all()

    def stop(self, wait: bool = True) -> None:
        """End the run at the pumps' next safe point; with ``wait``, return once it has ended."""
        self._request_end("stopped")
        if wait and not self._inside():  # from a callback in a pump: it ends once the callback returns
            self._until(self._finished.is_set)

    def wait(self) -> pd.DataFrame:
        """Block until the run ended; re-raise its error; return the metrics of the steps finished since it started.
        An interrupt (Ctrl-C, a notebook's Interrupt) while waiting stops the run at a safe point, then is re-raised."""
        try:
            self._until(self._finished.is_set)
        except KeyboardInterrupt:
            self._request_end("interrupted")
            self._until(self._finished.is_set)
            raise
        if self.error is not None:
            raise self.error
        frame = self.ctrl.metrics.iloc[self._first_row:].copy()
        frame.attrs = {"status": self.status, "breakpoint": self.breakpoint,
                       "until_fired": None if self.until is None else self.breakpoint is not None}
        if frame.attrs["until_fired"] is False and self.status in ("completed", "exhausted"):
            warnings.warn(f"until={self.until!r} never matched: the run {self.status} after {len(frame)} step(s) "
                          "without stopping there (.attrs['until_fired'] is False)", UserWarning, stacklevel=3)
        return frame

    def _until(self, predicate: Callable[[], bool]) -> None:
        # short waits, so an interrupt reaches the waiting thread (a signal does not wake a blocked wait)
        with self._cv:
            while not predicate() and not self._finished.is_set():
                self._cv.wait(POLL_S)

    def _inside(self) -> bool:
        return threading.current_thread() in (self._supervisor, *self._threads.values())

    def check_hand_tick(self) -> None:
        """Raise when a tick by hand would race this run's pumps (a pump's own ticks pass)."""
        if self._inside():
            return
        with self._cv:
            if self._finished.is_set():
                if any(t.is_alive() for t in self._threads.values()):
                    raise RuntimeError(f"the last run gave up on its {' and '.join(self.stuck)}; the controller "
                                       "cannot tick until that backend call returns")
                return
            if self._pause and self._parked | self._exited >= set(self._pumps):
                return  # paused: both pumps parked (or done)
        raise RuntimeError(f"a run is going ({self!r}): pause it (handle.pause()) or stop it before ticking by hand")

    @property
    def alive(self) -> bool:
        """Some thread of this run is still going (a new run or a hand tick would race it)."""
        return not self._finished.is_set() or any(t.is_alive() for t in self._threads.values())

    def __repr__(self) -> str:
        where = f", breakpoint at trace row {self.breakpoint.seq}" if self.breakpoint is not None else ""
        error = f", error {type(self.error).__name__}: {self.error}" if self.error is not None else ""
        return (f"RunHandle({self.status}, T={self.ctrl.trainer_version} of {self.target}, "
                f"until={self.until!r}{where}{error})")


def runs_in_lockstep(cfg: Any, admits_ahead: bool) -> bool:
    """One pump thread (a rollout tick then a train tick, as stepping does) or two: ``cfg.pump_threads`` 1 or 2
    decides; ``auto`` is one when the sampler cannot admit ahead (nothing to overlap) or when generation and
    training share one CUDA device in this process. There their GPU work takes turns under the device lock anyway
    (``backends/device_lock.py``); a second thread only competes for the interpreter with the one stepping the
    engine. The schedule stays asynchronous: the next batch is dispatched before the current one trains, and
    trained a version stale. Measured on one H200: no slower than two threads (benchmarks/README.md, "One pump
    thread on one GPU")."""
    if cfg.pump_threads != "auto":
        return cfg.pump_threads == 1
    shared = shared_cuda_index(cfg.generation, cfg.trainer) is not None and cfg.device_sharing == "turns"
    return not admits_ahead or shared


def _progress_bar(start: int, target: int):
    """Counts the trainer version toward the run's target: a resumed or continued run starts where ``T`` is."""
    from tqdm.auto import tqdm

    return tqdm(total=target, initial=start, desc="steps", unit="step")
