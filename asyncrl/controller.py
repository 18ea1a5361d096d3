"""The single controller: a rollout pump and a train pump around one replay buffer, following one sampler.

Read this file top to bottom: ``rollout_tick`` (the rollout pump, ``asyncrl/rollout.py``: admit, dispatch, poll,
score, retry, skip, commit), ``train_tick`` (evict, select, logprobs, advantages, train, and at the end of a step:
optimizer step, ``T += 1``, weight sync, abort), then ``start``/``run``, which drive the same two ticks from two
threads so generation overlaps training (the loop, its pause/stop/breakpoints and its failure handling are in
``asyncrl.run_loop``). The run state (``T``, in flight, trace, metrics, ...) is one ``RunState``
(``asyncrl/state.py``) that this controller owns and hands to its pumps; observers ``subscribe`` to its events.

Invariants:
- The pumps never encode a policy: every admit/select/evict/abort decision is the sampler's.
- Every admitted group is, exactly once, trained (``select``), evicted, aborted or skipped (given up after a fault,
  ``RolloutPump.skip`` is the only way), and the trace says which and why. Every error caught is a ``fault`` event
  (``asyncrl/faults.py`` describes the budgets, retries and replacements).
- Permits: ``len(buffer) <= capacity`` (a batch is dispatched only when all its groups fit) and in-flight groups
  never exceed ``max_inflight_groups``.
- ``T`` and the generator's version move together under the lock: the rollout pump never sees ``T + 1`` while
  the generator still holds weights ``T``. That is what makes ``in_order`` with no lookahead synchronous GRPO.
  (A generator that stages weights — vLLM behind the collective sync — reports the staged version as soon as the
  receive completed, before the sync returns, and swaps them in between two engine steps (``weight_update``: drain
  or inflight). Groups carry the versions they were really generated with.)
- With a gated sampler the schedule does not depend on timing, stepped or threaded: ``_finish_step`` admits the
  batches due at the old ``T`` before the sync, and a generator generates what was submitted before a weight load.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from asyncrl.algorithms import Loss, make_train_batch
from asyncrl.backends.base import ActorBackend, PrevLogprobsFromForward, StepMetrics, is_dead_actor
from asyncrl.buffer import ReplayBuffer, Slot
from asyncrl.config import Config, check_sampler_fits
from asyncrl.data import GenerationRequest
from asyncrl.faults import FaultContainment, GenerationFailed, StepShortfall, describe
from asyncrl import metrics as M
from asyncrl.metrics import StepAccumulator
from asyncrl.reports import ControllerState, TickReport
from asyncrl.rollout import FAILED, RolloutPump
from asyncrl.run_loop import ActiveClock, RunHandle
from asyncrl.samplers import (
    AdmitsAhead, StalenessWindow, TargetStamping, build_sampler, explain_frame, reasoned,
)
from asyncrl.state import RunState, Subscription
from asyncrl.trace import (  # noqa: F401  (all importable from here too)
    ABORT, EVICT, SELECT, STEP, SYNC, TRACE_COLUMNS, TRACE_DTYPES, TRACE_EVENTS, TRAIN, StepEvent, TraceRow,
)
from asyncrl.tracking import Tracker


def _tick(method):
    """A tick by hand is refused while a run's pumps go (pause the run first), its time is active time for the
    step timer, and its events go to the subscribers when it ends."""

    @functools.wraps(method)
    def tick(self, *args, **kwargs):
        if self._run is not None:
            self._run.check_hand_tick()
        try:
            with self.clock:
                return method(self, *args, **kwargs)
        finally:
            self._state.deliver()  # subscribers hear of the tick's events after it, outside the lock

    return tick


class Controller:
    def __init__(self, cfg: Config, task, policy, generator, tokenizer, sampler=None, buffer=None):
        from asyncrl.tasks import PromptStream

        self.cfg = cfg
        self.task = task
        self.policy = policy
        self.generator = generator
        self.tokenizer = tokenizer
        self.buffer = buffer if buffer is not None else ReplayBuffer()
        self.sampler = sampler if sampler is not None else build_sampler(cfg.sampler, self.buffer)
        check_sampler_fits(self.sampler, cfg)
        if not task.train_prompts:
            raise ValueError(f"task {task.name!r} has no training prompts; a run needs at least one")
        self.capacity = cfg.buffer_capacity(self.sampler.required_buffer_capacity(cfg.groups_per_step))
        self.stream = PromptStream(task.train_prompts, seed=cfg.seed, max_epochs=cfg.max_epochs)
        self._state = RunState()  # T, in flight, trace, metrics, ...: written only by this controller's pumps
        self._lock = self._state.lock
        self.faults = FaultContainment(cfg.faults, _backend_name(cfg.generation), _backend_name(cfg.trainer))
        self._rollout = RolloutPump(self, self._state, self.faults)
        self.last_report: TickReport | None = None
        self.tracker = Tracker(cfg.tracking, cfg.model_dump(mode="json"))  # does nothing unless configured
        if self.tracker.active:  # a sink like any other observer: each step's metrics row
            self.subscribe(lambda event: self.tracker.log(event.metrics), events=STEP)
        self._frames: dict[str, tuple[int, pd.DataFrame]] = {}
        self._prompt_ids: dict[str, list[int]] = {}
        self._run: RunHandle | None = None  # the latest run (start/run); at most one goes at a time
        self.clock = ActiveClock()  # time inside ticks or while a run goes: what the step timer counts
        self._step = StepAccumulator(self.clock.now)  # the step in progress (STEP_METRICS); reset when it finishes
        from asyncrl.backends.weight_sync import build_weight_sync

        self.sync_weights = build_weight_sync(cfg, policy, generator)  # generation.weight_sync: driver | collective
        self.sync_weights(0)
        self._check_prompt_lengths()

    def _check_prompt_lengths(self) -> None:
        """Every prompt plus ``max_new_tokens`` fits the model's context (``model.max_position_embeddings``); the
        longest offender is named. (A model from ``hf_path`` brings its own context and is not checked here.)"""
        if self.cfg.model.hf_path is not None:
            return
        context, new = self.cfg.model.max_position_embeddings, self.cfg.generation.max_new_tokens
        prompts = list(self.task.train_prompts) + list(self.task.eval_prompts)
        longest = max(prompts, key=lambda p: len(self.encode(p.text)))
        n = len(self.encode(longest.text))
        if n + new > context:
            raise ValueError(
                f"prompt {longest.text[:60]!r} is {n} tokens; with generation.max_new_tokens {new} it needs {n + new} "
                f"positions, more than the model's context model.max_position_embeddings {context}: shorten the "
                "task's prompts, lower max_new_tokens or raise max_position_embeddings"
            )

    def encode(self, text: str) -> list[int]:
        """Prompt token ids, cached per controller: prompts repeat every epoch, and encoding is slow next to a lookup."""
        ids = self._prompt_ids.get(text)
        if ids is None:
            ids = self._prompt_ids[text] = self.tokenizer.encode(text)  # the tokenizer adds <bos>
        return ids

    @classmethod
    def from_config(cls, cfg: Config, loss: Loss | None = None) -> Controller:
        """Task, backends and sampler from ``cfg``; the policy trains with ``loss`` (default ``GRPOLoss(cfg.loss)``:
        a loss of your own is one class satisfying ``asyncrl.algorithms.Loss``)."""
        from asyncrl.backends import build_backends
        from asyncrl.tasks import build_task

        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(cfg.seed)
        task = build_task(cfg.task)
        policy, generator, tokenizer = build_backends(cfg, loss)
        return cls(cfg, task, policy, generator, tokenizer)

    # ------------------------------------------------------------------------------------------ rollout pump
    @_tick
    def rollout_tick(self, wait_s: float = 0.0) -> TickReport:
        """Ask ``admit``; dispatch at most one batch; collect what finished; score; commit (``asyncrl/rollout.py``).
        ``wait_s``: how long ``poll`` may wait for a group in flight to finish (a run's pump waits a little rather
        than spin)."""
        report = self._rollout.tick(wait_s)
        self.last_report = report
        return report

    # -------------------------------------------------------------------------------------------- train pump
    @_tick
    def train_tick(self) -> TickReport:
        """Evict; select a chunk; train on it; when the step's groups are all trained, finish the step."""
        N, state = self.cfg.groups_per_step, self._state
        with self._lock:
            T = state.trainer_version
            if T == 0 and self.cfg.eval_every and not state.evaluations:
                self.evaluate()  # the untrained model: where the held-out curve starts
            report = TickReport("train", T)
            decide = reasoned(self.sampler)  # each decision with the words its verdict gives, for the trace
            for slot, reason in decide.evict_reasoned(T):
                report.evicted.append(slot.group_id)
                self._step.add({"groups_evicted": 1, **M.skew("drop", [slot.rollouts])})
                state.record(EVICT, slot.group_id, slot.weight_version, slot.target_step, T - slot.weight_version,
                             "", reason)
            remaining = N - self._step.groups
            lo, hi = self.cfg.chunk_bounds
            chosen = decide.select_reasoned(T, min(lo, remaining), min(hi, remaining))
            if chosen is None:
                self._rollout.check_shortfall(T, self._step.groups)
                report.note = (
                    f"select waits: {self.buffer.num_ready} ready, {self.buffer.num_pending} pending, "
                    f"needs {min(lo, remaining)}"
                )
                self.last_report = report
                return report
            chunk = [slot for slot, _ in chosen]
            for slot, reason in chosen:
                report.selected.append(slot.group_id)
                state.record(SELECT, slot.group_id, slot.weight_version, slot.target_step, T - slot.weight_version,
                             "", reason)
        try:
            self._train_chunk(chunk, T)
            finished = self._step.groups == N  # the step's accumulator and the policy are this pump's alone
            # The optimizer step runs outside the lock (only this pump touches the policy; the rollout pump needs it
            # to dispatch and commit); T and the generator's weights move at the sync, under it. Not if a restart can
            # reload the trainer's weights as T under the lock (a restart in the rollout pump): never mid-update or
            # ahead of T.
            restartable = self.cfg.faults.restart_generator and isinstance(self.generator, ActorBackend)
            update = self._optimizer_step() if finished and not restartable else None
            with state.changed:
                if finished:
                    self._finish_step(report, update if update is not None else self._optimizer_step())
                    every = self.cfg.checkpoint_every
                    if every and state.trainer_version % every == 0:
                        from asyncrl.checkpoint import save_periodic

                        save_periodic(self, self.cfg.checkpoint_dir, self.cfg.keep_checkpoints)
                state.changed.notify_all()
        except (GenerationFailed, StepShortfall):
            raise
        except Exception as exc:
            verdict = self.faults.trainer_error(exc, T, is_dead_actor(exc, self.policy))
            self._rollout.fault(None, describe(exc), verdict.reason)
            if verdict.error is not None:
                raise verdict.error from exc
            raise
        report.skipped.extend(self._rollout.take_skipped())
        report.trainer_version = state.trainer_version
        self.last_report = report
        return report

    def _train_chunk(self, chunk: list[Slot], T: int) -> None:
        train_start = time.perf_counter()
        groups = [slot.rollouts for slot in chunk]
        batch = make_train_batch(groups, self.cfg.loss, self.tokenizer.pad_token_id)
        if not isinstance(self.policy, PrevLogprobsFromForward):  # such a policy takes them from its forward
            batch = replace(batch, prev_logprobs=self.policy.logprobs(batch))
        if not self._step.started:
            self.policy.begin_train_step()
            self._step.started = True
        self.policy.train_microbatches(batch)
        rewards = [r for g in groups for r in g.rewards]
        lags = [T - slot.weight_version for slot in chunk]
        chunk_index = int(self._step.total("chunks"))
        self._step.add({
            "reward_mean": sum(rewards), "completions": len(rewards), "lag_mean": sum(lags), "lag_max": max(lags),
            "groups": len(chunk), "chunks": 1, "completion_tokens": sum(g.num_tokens for g in groups),
            "train_time_s": time.perf_counter() - train_start, **M.skew("train", groups),
        })
        self._state.record(TRAIN, detail=f"{len(chunk)} groups, {batch.num_tokens} tokens",
                           reason=f"chunk {chunk_index} of step {T}")

    def _optimizer_step(self) -> dict[str, float]:
        """``policy.finish_train_step()`` (normalise, clip, one optimizer step): the policy's step metrics."""
        train_start = time.perf_counter()
        out = self.policy.finish_train_step()
        self._step.add({"train_time_s": time.perf_counter() - train_start})  # what a simulation calibrates on
        return out

    def _finish_step(self, report: TickReport, out: dict[str, float]) -> None:
        """Under the lock, after the optimizer step (``out``): ``T += 1`` with the sync, aborts, the metrics row."""
        state = self._state
        T = state.trainer_version + 1
        sync_start = time.perf_counter()
        self._rollout.sync_generator(T, report)  # first admits the batches due at the old T (admit_due)
        sync_s = time.perf_counter() - sync_start
        state.trainer_version = T
        state.record(SYNC, None, T, reason=f"generator now holds weights {T}")  # no timings: traces replay
        doomed = [g for g, w in state.inflight.items() if self.sampler.should_abort_inflight(w, T)]
        cancelled = self._rollout.generation_call("abort", self.generator.abort, doomed) if doomed else []
        cancelled = [] if cancelled is FAILED else list(cancelled)
        if state.unsent and doomed:  # never sent: cancelled here
            cancelled += [r.group_id for r in state.unsent if r.group_id in set(doomed)]
            state.unsent[:] = [r for r in state.unsent if r.group_id not in set(doomed)]
        for gid in cancelled:
            w = state.inflight.pop(gid)
            state.attempts.pop(gid, None)
            slot = self.buffer.remove([gid])[0]
            report.aborted.append(gid)
            self._step.add({"groups_aborted": 1})
            state.record(ABORT, gid, w, slot.target_step, T - w, "", reasoned(self.sampler).abort_reason(slot, T))
        elapsed = self.clock.now() - self._step.start  # active time only: not a person's pause between hand ticks
        row = {  # the vocabulary: asyncrl.metrics (STEP_METRICS, STEP_FACTS)
            M.STEP.name: T - 1,
            M.TRAINER_VERSION.name: T,
            **self._step.result(), **self._rollout.take_skew(),  # M.GEN_METRICS: committed this step
            M.STEP_TIME_S.name: elapsed,
            M.TOKENS_PER_S.name: self._step.total("completion_tokens") / elapsed if elapsed > 0 else math.nan,
            M.SYNC_TIME_S.name: sync_s,
            M.BUFFERED.name: len(self.buffer),
            M.INFLIGHT.name: len(state.inflight),
        }
        row.update({k: v for k, v in out.items() if k not in row})  # the policy's: its Loss's and ENGINE_METRICS
        row.update(M.throughput(out, self._step.total(M.TRAIN_TIME_S.name)))  # train_tflops, mfu
        gen_tokens, gen_s = self._rollout.take_generation_counts()
        row[M.GEN_TOKENS_PER_S.name] = gen_tokens / gen_s if gen_s > 0 else math.nan
        if isinstance(self.generator, StepMetrics):  # e.g. a replica set's tokens and busy time per replica
            row.update(self.generator.step_metrics())
        if self.cfg.eval_every and T % self.cfg.eval_every == 0:
            ev = self.evaluate()
            row[M.EVAL_REWARD.name] = ev[M.HELD_OUT_REWARD.name]
            row[M.EVAL_ACCURACY.name] = ev[M.HELD_OUT_ACCURACY.name]
        state.finish_step(row, f"loss={row['loss']:.4f} reward={row[M.REWARD_MEAN.name]:.3f}",
                          f"optimizer step {T - 1} done")
        report.step_finished = True
        self._step.reset()

    def tick(self) -> TickReport:
        """One rollout tick, then one train tick."""
        report = self.rollout_tick().merge(self.train_tick())
        self.last_report = report
        return report

    # ------------------------------------------------------------------------------------------------ running
    def start(self, steps: int, until=None, progress: bool = True, on_step=None) -> RunHandle:
        """Run both pumps in the background until ``T`` has grown by ``steps`` (or the data ran out, or ``until``
        matched); returns a ``RunHandle`` at once (``pause``, ``resume``, ``stop``, ``wait``, ``running``,
        ``error``). ``until``: a trace event name (``TRACE_EVENTS``) or a callable on a trace row: the run stops
        right after the tick that emitted the first match among this run's events. ``on_step(row, events)`` is
        called in the train pump after each step with its metrics row and the trace rows (``TraceRow``) since the
        last call. With a sampler that cannot admit ahead (``lockstep``) one thread runs both ticks in turn."""
        if self._run is not None and self._run.alive:
            raise RuntimeError(f"a run is already going ({self._run!r}): wait for it, or stop it, before starting "
                               "another")
        handle = RunHandle(self, steps, until, progress, on_step)  # validates steps and until: nothing changes
        self._run = handle
        handle._launch()
        return handle

    def run(self, steps: int, until=None, progress: bool = True) -> pd.DataFrame:
        """``start(steps, until).wait()``: blocks; an interrupt (Ctrl-C, a notebook's Interrupt) stops both pumps
        at a safe point and is re-raised, and an error in either pump is re-raised as the original exception; the
        controller stays steppable. Returns the metrics of the steps it ran; ``.attrs["status"]`` says how it ended
        (completed, exhausted, breakpoint, ...), ``.attrs["breakpoint"]`` the trace row ``until`` matched and
        ``.attrs["until_fired"]`` whether it matched (None without ``until``); a run that ended without its
        breakpoint also warns (``UserWarning``)."""
        return self.start(steps, until, progress).wait()

    async def arun(self, steps: int, until=None, progress: bool = True) -> pd.DataFrame:
        """``run`` without blocking the event loop (a notebook stays responsive); cancelling it stops the run."""
        handle = self.start(steps, until, progress)
        try:
            await asyncio.to_thread(handle._finished.wait)
        except asyncio.CancelledError:
            handle.stop()
            raise
        return handle.wait()

    def drain(self) -> None:
        """Collect what finished after a run's pumps stopped, so nothing is left half-accounted."""
        try:
            self._rollout.drain()
        finally:
            self._state.deliver()

    # ---------------------------------------------------------------------------------------------- observing
    def subscribe(self, callback, events=None, history: bool = False) -> Subscription:
        """Call ``callback(event)`` for each trace event from now on (``events``: names from ``TRACE_EVENTS``;
        default all). ``event`` is a ``TraceRow`` (the trace's columns: ``seq``, ``event``, ``trainer_version``,
        ``group_id``, ``weight_version``, ``target_step``, ``lag``, ``detail``, ``reason``), except for ``step``: a
        ``StepEvent`` with the step's ``row`` and its ``metrics`` row. Events come in trace order, each once, at the
        end of the tick that recorded them, outside the controller's lock, in the thread that ran the tick (a run's
        pump). ``history=True`` first replays every event so far. Returns a ``Subscription`` (``cancel()``)."""
        return self._state.subscribe(callback, events, history)

    @property
    def num_events(self) -> int:
        """Rows in the trace so far (cheap: no frame is built)."""
        return len(self._state.trace)

    @property
    def changed(self) -> threading.Condition:
        """Notified when a pump made progress the other may wait for (a commit, a select, a step). Holding it holds
        the controller's lock: a driver checks ``num_events`` and waits under it, so no wake-up is lost."""
        return self._state.changed

    @property
    def lockstep(self) -> bool:
        """The sampler cannot admit ahead of training (``AdmitsAhead``: ``in_order`` with no lookahead): a run then
        drives both ticks on one thread (``asyncrl/run_loop.py``), with the same results as two."""
        return isinstance(self.sampler, AdmitsAhead) and not self.sampler.admits_ahead

    @property
    def trainer_version(self) -> int:
        """``T``: optimizer steps done; the generator holds weights ``T``."""
        return self._state.trainer_version

    @property
    def data_position(self) -> int:
        """Prompts taken from the prompt stream so far."""
        return self._state.data_position

    @property
    def exhausted(self) -> bool:
        """The prompt stream has no batch left (set it to False to let a stepped test dispatch again)."""
        return self._state.exhausted

    @exhausted.setter
    def exhausted(self, value: bool) -> None:
        with self._lock:
            self._state.exhausted = bool(value)

    @property
    def inflight(self) -> dict[int, int]:
        """Groups dispatched and not yet back: group id -> weight version at dispatch (read it, do not edit it)."""
        return self._state.inflight

    def _frame(self, name: str, rows: list, columns=None, dtypes=None) -> pd.DataFrame:
        cached = self._frames.get(name)
        if cached is None or cached[0] != len(rows):
            frame = pd.DataFrame(list(rows), columns=columns)
            cached = (len(rows), frame if dtypes is None else frame.astype(dtypes))
            self._frames[name] = cached
        return cached[1]

    @property
    def trace(self) -> pd.DataFrame:
        """Every admit/refuse/dispatch/commit/evict/select/train/sync/abort/step event, in order, with its reason.
        Ids, versions, steps and lags are nullable integers (``Int64``): an event without one has ``<NA>``."""
        with self._lock:
            return self._frame("trace", self._state.trace, TRACE_COLUMNS, TRACE_DTYPES)

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per optimizer step."""
        with self._lock:
            return self._frame("metrics", self._state.metrics)

    @property
    def last_run(self) -> RunHandle | None:
        """The handle of the latest ``start``/``run`` (its ``status``, ``error``, ``breakpoint``), or None."""
        return self._run

    @property
    def generation_version(self) -> int:
        return self.generator.version

    def explain(self, timeout: float | None = None) -> pd.DataFrame:
        """The sampler's verdict for every buffered group as the next train tick would see it (with this step's
        chunk bounds), as a table; with generation replicas, also which replica generated each group. Changes
        nothing. ``timeout``: give up (``TimeoutError``) when a pump holds the lock longer than that."""
        from asyncrl import read_view

        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"explain: a pump held the controller's lock for over {timeout:g} s")
        try:
            return read_view.verdicts(self.cfg, self.sampler, self.buffer, self.trainer_version, self._step.groups)
        finally:
            self._lock.release()

    def state(self) -> ControllerState:
        """A consistent snapshot for widgets (versions, the buffer by version, the window, the last report).
        The verdicts are not in it: they cost a pass over the buffer, so ``explain()`` computes them when asked."""
        from asyncrl import read_view

        with self._lock:
            return read_view.snapshot(
                cfg=self.cfg, sampler=self.sampler, buffer=self.buffer, trainer_version=self.trainer_version,
                generation_version=self.generator.version, capacity=self.capacity, inflight=len(self.inflight),
                step_groups_trained=self._step.groups, data_position=self.data_position, exhausted=self.exhausted,
                last_report=self.last_report,
            )

    @property
    def evaluations(self) -> pd.DataFrame:
        """Every held-out evaluation so far (by ``evaluate()``: ``eval_every``, the untrained model's before step
        0 when ``eval_every`` is set, and any call of yours), with the weight version it judged."""
        with self._lock:
            return self._frame("evaluations", self._state.evaluations, [c.name for c in M.EVALUATION_COLUMNS])

    def evaluate(self) -> dict[str, float]:
        """Greedy completions on the held-out prompts: ``reward_mean``, ``accuracy`` (also in ``evaluations``)."""
        from asyncrl.tasks import evaluate

        version = self.generator.version
        ev = evaluate(self.generator, self.task, self.tokenizer, self.cfg.generation.max_new_tokens)
        with self._lock:
            self._state.evaluations.append({M.EVALUATED_VERSION.name: version,
                                **{c.name: ev[c.name] for c in (M.HELD_OUT_REWARD, M.HELD_OUT_ACCURACY)}})
        return ev

    # ------------------------------------------------------------------------------------------- checkpoints
    def save(self, path: str | Path) -> Path:
        """Write a checkpoint directory at ``path`` atomically. ``asyncrl/checkpoint.py`` documents the format and
        what a resume restores; groups in flight are saved as pending and submitted again on restore."""
        from asyncrl.checkpoint import save

        with self._lock:  # nothing moves while the files are written
            return save(self, path)

    def state_dict(self) -> dict:
        """Everything a resume needs, between two steps (``asyncrl/checkpoint.py`` says where each key is stored):
        the run state, ``in_step``, ``buffer``, ``sampler``, ``dispatch_index``, ``policy``, ``generator``,
        ``torch_rng``. First it commits what the generator finished (``RolloutPump.collect_finished``)."""
        with self._lock:
            if self._step.started:
                raise RuntimeError(f"cannot save in the middle of step {self.trainer_version}: {self._step.groups} "
                                   f"of {self.cfg.groups_per_step} groups trained; save between steps")
            self._rollout.collect_finished()
            return {**self._state.state_dict(), "buffer": self.buffer.state_dict(),
                    "in_step": self._rollout.step_state(self._step),
                    "sampler": self.cfg.sampler.model_dump(mode="json"), "dispatch_index": self.sampler.dispatch_index,
                    "policy": self.policy.state_dict(), "generator": self.generator.state_dict(),
                    "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict, on_sampler_change: str = "rejudge") -> None:
        """Continue from ``state`` (``state_dict()``'s keys; ``buffer`` slots holding ``Prompt`` and
        ``GroupRollouts``): weights, optimizer, generator, RNG, buffer, history; the buffer's pending groups are
        submitted again. When ``state["sampler"]`` is not this controller's sampler, ``on_sampler_change`` says what
        happens to the restored groups (``restore`` documents it)."""
        if on_sampler_change not in ("rejudge", "drop"):
            raise ValueError(f"on_sampler_change must be 'rejudge' or 'drop', got {on_sampler_change!r}")
        with self._lock:
            self.policy.load_state_dict(state["policy"])
            self.buffer.load_state_dict(state["buffer"])  # in place: the sampler judges this buffer
            self._state.load_state_dict(state)
            self._frames.clear()
            T = self.trainer_version
            self.sync_weights(T)
            if state["generator"] is not None:
                self.generator.load_state_dict(state["generator"])
            torch.set_rng_state(state["torch_rng"])
            self._rollout.load_step_state(state.get("in_step"), self._step)
            for slot in self.buffer.pending_slots():  # in flight at save time: generated again
                self._state.inflight[slot.group_id] = slot.weight_version
                self._state.unsent.append(GenerationRequest(slot.group_id, self.encode(slot.prompt.text),
                                                            self.cfg.group_size))
            self.sampler.set_dispatch_index(T)
            if state["sampler"] == self.cfg.sampler.model_dump(mode="json"):
                self.sampler.dispatch_index = state["dispatch_index"]  # exact, including batches admitted ahead of T
            else:
                self._rejudge(state["sampler"], on_sampler_change)
            self._rollout.flush_unsent()

    def _rejudge(self, old: dict, how: str) -> None:
        """Restored under another sampler: skip what it cannot keep, fix its dispatch index, let it evict."""
        T, N, new = self.trainer_version, self.cfg.groups_per_step, self.cfg.sampler.name
        change = f"restored under sampler {new} (was {old.get('name')})"
        stamps = isinstance(self.sampler, TargetStamping) and self.sampler.stamps_target
        for slot in self.buffer.slots():
            if how == "drop":
                self._rollout.skip(slot.group_id, f"{change}; dropped (on_sampler_change='drop')", replace=False)
            elif stamps and slot.target_step is None:
                self._rollout.skip(slot.group_id, f"{change}, which trains only groups stamped with a target step",
                                   replace=False)
        for slot in reversed(self.buffer.slots()[self.capacity:]):
            self._rollout.skip(slot.group_id, f"{change}; over its capacity {self.capacity}", replace=False)
        kept = self.buffer.slots()
        if stamps:
            self.sampler.dispatch_index = max([T - 1] + [s.target_step for s in kept])
        else:
            self.sampler.dispatch_index = T - 1 + -(-len(kept) // N)  # the batches it holds count as admitted
        for slot, reason in reasoned(self.sampler).evict_reasoned(T):
            self._state.record(EVICT, slot.group_id, slot.weight_version, slot.target_step, T - slot.weight_version,
                               "on restore", f"{reason} ({change})")
        self._rollout.take_skipped()

    @classmethod
    def restore(cls, path: str | Path, sampler: Any = None, config: Config | None = None,
                on_sampler_change: str = "rejudge", trust_code: bool = False) -> Controller:
        """A controller that continues from the checkpoint at ``path`` (a checkpoint directory, or a directory of
        them: the newest intact one), built from ``config`` (default: the checkpoint's own), whose model must
        have the checkpoint's shape. ``sampler`` (a sampler config or mapping) replaces the config's sampler.
        ``trust_code``: what a restore without a config may import, and where it connects (asyncrl/checkpoint.py).
        When the sampler differs from the checkpoint's, the capacity is the new sampler's and the restored
        groups are, with ``on_sampler_change="rejudge"``, judged by the new sampler's rules: groups it can never
        train (no ``target_step`` under a stamping sampler such as ``in_order``) and groups beyond its capacity
        (newest first) are skipped, the rest stay and its ``evict`` runs at once; its dispatch index counts the
        batches it kept. With ``"drop"`` every restored group is skipped and the new sampler starts at the
        checkpoint's step with an empty buffer. Either way the trace records each skip and eviction."""
        from asyncrl.checkpoint import restore

        return restore(cls, path, sampler, config, on_sampler_change, trust_code)

    def close(self) -> None:
        """Release the backends (and their Ray actors). The controller's history stays readable."""
        for backend in (self.generator, self.policy):
            backend.close()
        self.tracker.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Controller(T={self.trainer_version}, sampler={self.sampler!r}, buffer={self.buffer!r}, "
                f"inflight={len(self.inflight)})")


def _backend_name(part) -> str:
    return f"{part.backend}, placement {part.placement}"

