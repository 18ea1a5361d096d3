"""The single controller: a rollout pump and a train pump around one replay buffer, following one sampler.

Read this file top to bottom: ``rollout_tick`` (admit, dispatch, collect, score, commit), ``train_tick`` (evict,
select, logprobs, advantages, train, and at the end of a step: optimizer step, ``T += 1``, weight sync, abort),
then ``start``/``run``, which drive the same two ticks from two threads so generation overlaps training (the loop,
its pause/stop/breakpoints and its failure handling are in ``asyncrl.run_loop``).

Invariants:
- The pumps never encode a policy: every admit/select/evict/abort decision is the sampler's.
- Every admitted group is, exactly once, trained (``select``), evicted, aborted or skipped (given up after a fault,
  ``_skip`` is the only way), and the trace says which and why. Every error caught is a ``fault`` event
  (``asyncrl/faults.py`` describes the budgets, retries and replacements).
- Permits: ``len(buffer) <= capacity`` (a batch is dispatched only when all its groups fit) and in-flight groups
  never exceed ``max_inflight_groups``.
- ``T`` and the generator's version move together under the lock: the rollout pump never sees ``T + 1`` while
  the generator still holds weights ``T``. That is what makes ``in_order`` with no lookahead synchronous GRPO.
  (A generator that stages weights — vLLM behind the collective sync — reports the staged version as soon as the
  receive completed, before the sync returns, and swaps the weights in before its next wave; a wave already running
  finishes on the old ones. Groups carry the version they were really generated with.)
- Stepping is deterministic for a seed: the torch generator consumes its own seeded RNG once per generate call,
  and step mode generates each dispatched batch inside the tick that dispatched it.
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
from asyncrl.backends.base import PrevLogprobsFromForward, StepMetrics
from asyncrl.buffer import ReplayBuffer, Slot
from asyncrl.config import Config, check_sampler_fits
from asyncrl.data import GenerationRequest, GroupRollouts
from asyncrl.faults import _FAILED, ActorBackend, FaultContainment, GenerationFailed, RewardTypeError, StepShortfall
from asyncrl import metrics as M
from asyncrl.metrics import StepAccumulator
from asyncrl.reports import ControllerState, TickReport
from asyncrl.run_loop import ActiveClock, RunHandle
from asyncrl.samplers import StalenessWindow, build_sampler, explain_frame
from asyncrl.trace import TRACE_COLUMNS, TRACE_DTYPES, TRACE_EVENTS  # noqa: F401  (all importable from here too)
from asyncrl.tracking import Tracker


def _tick(method):
    """A tick by hand is refused while a run's pumps go (pause the run first), and its time is active time for the
    step timer."""

    @functools.wraps(method)
    def tick(self, *args, **kwargs):
        if self._run is not None:
            self._run.check_hand_tick()
        with self._clock:
            return method(self, *args, **kwargs)

    return tick


class Controller(FaultContainment):
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
        self.trainer_version = 0
        self.data_position = 0
        self.exhausted = False
        self.inflight: dict[int, int] = {}  # group id -> weight version at dispatch
        self._init_faults()  # FaultContainment's state (asyncrl/faults.py)
        self.last_report: TickReport | None = None
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._trace: list[tuple] = []
        self._refused: str | None = None  # the last refusal traced, until the gate opens again
        self._metrics: list[dict] = []
        self._evals: list[dict] = []
        self.tracker = Tracker(cfg.tracking, cfg.model_dump(mode="json"))  # does nothing unless configured
        self._frames: dict[str, tuple[int, pd.DataFrame]] = {}
        self._prompt_ids: dict[str, list[int]] = {}
        self._run: RunHandle | None = None  # the latest run (start/run); at most one goes at a time
        self._clock = ActiveClock()  # time inside ticks or while a run goes: what the step timer counts
        self._step = StepAccumulator(self._clock.now)  # the step in progress (STEP_METRICS); reset when it finishes
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
        longest = max(prompts, key=lambda p: len(self._encode(p.text)))
        n = len(self._encode(longest.text))
        if n + new > context:
            raise ValueError(
                f"prompt {longest.text[:60]!r} is {n} tokens; with generation.max_new_tokens {new} it needs {n + new} "
                f"positions, more than the model's context model.max_position_embeddings {context}: shorten the "
                "task's prompts, lower max_new_tokens or raise max_position_embeddings"
            )

    def _encode(self, text: str) -> list[int]:
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
        """Ask ``admit``; dispatch at most one batch; collect what finished; score; commit. ``wait_s``: how long
        ``poll`` may wait for a group in flight to finish (a run's pump waits a little rather than spin)."""
        with self._lock:
            report = self._dispatch()
        self._collect(self._poll(wait_s), report)
        self.last_report = report
        return report

    def _dispatch(self) -> TickReport:
        N, T = self.cfg.groups_per_step, self.trainer_version
        report = TickReport("rollout", T)
        limit = self.cfg.max_inflight_groups
        if self.exhausted:
            report.note = "no dispatch: the prompt stream is exhausted"
        elif len(self.buffer) + N > self.capacity:
            report.note = f"no dispatch: buffer holds {len(self.buffer)}, a batch of {N} needs room (capacity {self.capacity})"
        elif limit is not None and len(self.inflight) + N > limit:
            report.note = f"no dispatch: {len(self.inflight)} in flight, limit {limit}"
        elif self._unsent:
            report.note = f"no dispatch: {len(self._unsent)} group(s) wait to be re-submitted to the generation backend"
        elif self.stream.exhausted(self.data_position + N - 1):
            self.exhausted = True
            report.note = "no dispatch: fewer prompts left than a batch; the stream is exhausted"
        else:
            gate = self.sampler.explain_admission(T)  # asked first: admit changes what it would say
            admission = self.sampler.admit(T)
            report.admitted = admission
            if admission is None:
                report.note = f"gate closed: {gate}"
                if gate != self._refused:  # once per distinct refusal: a running pump asks a shut gate every poll
                    self._refused = gate
                    self._event("refuse", None, None, None, None, f"batch {self.sampler.dispatch_index + 1}", gate)
                return report
            self._refused = None
            version = self._generation_call("version", lambda: self.generator.version)
            if version is _FAILED:  # the fault is recorded; under the lock the generator holds weights T
                version = T
            self._event("admit", None, version, admission.target_step, None, f"batch {admission.dispatch_index}", gate)
            requests = []
            for _ in range(N):
                prompt = self.stream.get(self.data_position)
                self.data_position += 1
                gid = self.buffer.reserve(version, admission.target_step, prompt=prompt)
                requests.append(GenerationRequest(gid, self._encode(prompt.text), self.cfg.group_size))
                self.inflight[gid] = version
                report.dispatched.append(gid)
                self._event("dispatch", gid, version, admission.target_step, None, prompt.text, "")
            self._unsent.extend(requests)
            self._flush_unsent()
        report.skipped.extend(self._take_skipped())
        return report

    def _collect(self, finished: list[GroupRollouts], report: TickReport) -> None:
        with self._lock:  # an aborted group may still come back finished: it was already accounted for
            finished = [g for g in finished if g.group_id in self.inflight]
            prompts = [self.buffer[g.group_id].prompt for g in finished]
        problems, bad = [], None
        for group, prompt in zip(finished, prompts):  # scoring is pure Python; done outside the lock
            try:
                problems.append(self._score(group, prompt))
            except RewardTypeError as exc:  # a bug in the reward, not a fault to retry: stop, accounted
                self._fault(group.group_id, str(exc), "not retried: a bug in the reward; the run stops")
                problems.append(f"the reward is broken: {exc}")
                bad = bad or exc
        with self._changed:
            for group, problem in zip(finished, problems):
                if group.group_id not in self.inflight:
                    continue  # aborted while it was being scored
                if problem is not None:
                    self._skip(group.group_id, problem)
                    continue
                self.inflight.pop(group.group_id)
                self._attempts.pop(group.group_id, None)
                if self._unsent:  # an attempt thought lost came back after all: no need to send it again
                    self._unsent = [r for r in self._unsent if r.group_id != group.group_id]
                slot = self.buffer.commit(group.group_id, group, end_weight_version=group.gen_end_version)
                report.committed.append(group.group_id)
                self._event("commit", slot.group_id, slot.weight_version, slot.target_step, None,
                            f"reward_mean={sum(group.rewards) / len(group.rewards):.3f}",
                            f"generated with weights {group.gen_start_version}..{group.gen_end_version}"
                            + ("" if group.replica is None else f" on replica {group.replica}"))
            report.skipped.extend(self._take_skipped())
            if finished:
                self._changed.notify_all()
        if bad is not None:
            raise bad

    # -------------------------------------------------------------------------------------------- train pump
    @_tick
    def train_tick(self) -> TickReport:
        """Evict; select a chunk; train on it; when the step's groups are all trained, finish the step."""
        N = self.cfg.groups_per_step
        with self._lock:
            T = self.trainer_version
            if T == 0 and self.cfg.eval_every and not self._evals:
                self.evaluate()  # the untrained model: where the held-out curve starts
            report = TickReport("train", T)
            for slot in self.sampler.evict(T):
                report.evicted.append(slot.group_id)
                self._step.add({"groups_evicted": 1})
                self._event("evict", slot.group_id, slot.weight_version, slot.target_step, T - slot.weight_version,
                            "", f"{self.sampler.__class__.__name__}.evict({T}) dropped it")
            remaining = N - self._step.groups
            lo, hi = self.cfg.chunk_bounds
            chunk = self.sampler.select(T, min(lo, remaining), min(hi, remaining))
            if chunk is None:
                self._check_shortfall(T)
                report.note = (
                    f"select waits: {self.buffer.num_ready} ready, {self.buffer.num_pending} pending, "
                    f"needs {min(lo, remaining)}"
                )
                self.last_report = report
                return report
            for slot in chunk:
                report.selected.append(slot.group_id)
                self._event("select", slot.group_id, slot.weight_version, slot.target_step, T - slot.weight_version,
                            "", f"{self.sampler.__class__.__name__}.select({T}) chose it")
        try:
            self._train_chunk(chunk, T)
            finished = self._step.groups == N  # the step's accumulator and the policy are this pump's alone
            # The optimizer step runs outside the lock (only this pump touches the policy; the rollout pump needs it
            # to dispatch and commit); T and the generator's weights move at the sync, under it. Not if a restart can
            # reload the trainer's weights as T under the lock (_restart_generator): never mid-update or ahead of T.
            restartable = self.cfg.faults.restart_generator and isinstance(self.generator, ActorBackend)
            update = self._optimizer_step() if finished and not restartable else None
            with self._changed:
                if finished:
                    self._finish_step(report, update if update is not None else self._optimizer_step())
                    every = self.cfg.checkpoint_every
                    if every and self.trainer_version % every == 0:
                        from asyncrl.checkpoint import save_periodic

                        save_periodic(self, self.cfg.checkpoint_dir, self.cfg.keep_checkpoints)
                self._changed.notify_all()
        except (GenerationFailed, StepShortfall):
            raise
        except Exception as exc:
            self._trainer_fault(exc, T)
            raise
        report.skipped.extend(self._take_skipped())
        report.trainer_version = self.trainer_version
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
            "train_time_s": time.perf_counter() - train_start,
        })
        self._event("train", None, None, None, None, f"{len(chunk)} groups, {batch.num_tokens} tokens",
                    f"chunk {chunk_index} of step {T}")

    def _optimizer_step(self) -> dict[str, float]:
        """``policy.finish_train_step()`` (normalise, clip, one optimizer step): the policy's step metrics."""
        train_start = time.perf_counter()
        out = self.policy.finish_train_step()
        self._step.add({"train_time_s": time.perf_counter() - train_start})  # what a simulation calibrates on
        return out

    def _finish_step(self, report: TickReport, out: dict[str, float]) -> None:
        """Under the lock, after the optimizer step (``out``): ``T += 1`` with the sync, aborts, the metrics row."""
        T = self.trainer_version + 1
        sync_start = time.perf_counter()
        self._sync_generator(T)
        sync_s = time.perf_counter() - sync_start
        self.trainer_version = T
        self._event("sync", None, T, None, None, "", f"generator now holds weights {T}")  # no timings: traces replay
        doomed = [g for g, w in self.inflight.items() if self.sampler.should_abort_inflight(w, T)]
        cancelled = self._generation_call("abort", self.generator.abort, doomed) if doomed else []
        cancelled = [] if cancelled is _FAILED else list(cancelled)
        if self._unsent and doomed:  # never sent: cancelled here
            cancelled += [r.group_id for r in self._unsent if r.group_id in set(doomed)]
            self._unsent = [r for r in self._unsent if r.group_id not in set(doomed)]
        for gid in cancelled:
            w = self.inflight.pop(gid)
            self._attempts.pop(gid, None)
            slot = self.buffer.remove([gid])[0]
            report.aborted.append(gid)
            self._step.add({"groups_aborted": 1})
            self._event("abort", gid, w, slot.target_step, T - w, "",
                        f"should_abort_inflight({w}, {T}): it could only be evicted once finished")
        elapsed = self._clock.now() - self._step.start  # active time only: not a person's pause between hand ticks
        row = {  # the vocabulary: asyncrl.metrics (STEP_METRICS, STEP_FACTS)
            M.STEP.name: T - 1,
            M.TRAINER_VERSION.name: T,
            **self._step.result(),
            M.STEP_TIME_S.name: elapsed,
            M.TOKENS_PER_S.name: self._step.total("completion_tokens") / elapsed if elapsed > 0 else math.nan,
            M.SYNC_TIME_S.name: sync_s,
            M.BUFFERED.name: len(self.buffer),
            M.INFLIGHT.name: len(self.inflight),
        }
        row.update({k: v for k, v in out.items() if k not in row})  # the policy's: its Loss's and ENGINE_METRICS
        if isinstance(self.generator, StepMetrics):  # e.g. a replica set's tokens and busy time per replica
            row.update(self.generator.step_metrics())
        if self.cfg.eval_every and T % self.cfg.eval_every == 0:
            ev = self.evaluate()
            row[M.EVAL_REWARD.name] = ev[M.HELD_OUT_REWARD.name]
            row[M.EVAL_ACCURACY.name] = ev[M.HELD_OUT_ACCURACY.name]
        self._metrics.append(row)
        self.tracker.log(row)
        self._event("step", None, None, None, None, f"loss={row['loss']:.4f} reward={row[M.REWARD_MEAN.name]:.3f}",
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
        called in the train pump after each step with its metrics row and the trace rows since the last call."""
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
        (completed, exhausted, breakpoint, ...) and ``.attrs["breakpoint"]`` the trace row ``until`` matched."""
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

    def _drain(self) -> None:
        """Collect what finished after the pumps stopped, so nothing is left half-accounted."""
        report = TickReport("rollout", self.trainer_version)
        self._collect(self._poll(0.0), report)

    # ------------------------------------------------------------------------------------------------ reading
    def _event(self, event, group_id, weight_version, target_step, lag, detail, reason) -> None:
        self._trace.append((len(self._trace), event, self.trainer_version, group_id, weight_version, target_step,
                            lag, detail, reason))

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
            return self._frame("trace", self._trace, TRACE_COLUMNS, TRACE_DTYPES)

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per optimizer step."""
        with self._lock:
            return self._frame("metrics", self._metrics)

    @property
    def last_run(self) -> RunHandle | None:
        """The handle of the latest ``start``/``run`` (its ``status``, ``error``, ``breakpoint``), or None."""
        return self._run

    @property
    def generation_version(self) -> int:
        return self.generator.version

    def explain(self) -> pd.DataFrame:
        """The sampler's verdict for every buffered group as the next train tick would see it (with this step's
        chunk bounds), as a table; with generation replicas, also which replica generated each group. Changes
        nothing."""
        with self._lock:
            remaining = self.cfg.groups_per_step - self._step.groups
            lo, hi = self.cfg.chunk_bounds
            frame = explain_frame(self.sampler.explain(self.trainer_version, min(lo, remaining), min(hi, remaining)))
            if self.cfg.generation.replicas > 1:  # which replica generated each group (empty while it is pending)
                rollouts = [self.buffer[gid].rollouts for gid in frame.group_id]
                frame["replica"] = pd.array([None if r is None else r.replica for r in rollouts], dtype="Int64")
            return frame

    def state(self) -> ControllerState:
        """A consistent snapshot for widgets (versions, the buffer by version, the window, the last report).
        The verdicts are not in it: they cost a pass over the buffer, so ``explain()`` computes them when asked."""
        with self._lock:
            T = self.trainer_version
            windowed = isinstance(self.sampler, StalenessWindow)
            return ControllerState(
                trainer_version=T,
                generation_version=self.generator.version,
                sampler=self.sampler.name,
                sampler_repr=repr(self.sampler),
                window=self.sampler.window if windowed else None,
                lower_bound=self.sampler.lower_bound(T) if windowed else None,
                buffer=self.buffer.summary(),
                capacity=self.capacity,
                inflight=len(self.inflight),
                step_groups_trained=self._step.groups,
                groups_per_step=self.cfg.groups_per_step,
                data_position=self.data_position,
                exhausted=self.exhausted,
                last_report=self.last_report,
            )

    @property
    def evaluations(self) -> pd.DataFrame:
        """Every held-out evaluation so far (by ``evaluate()``: ``eval_every``, the untrained model's before step
        0 when ``eval_every`` is set, and any call of yours), with the weight version it judged."""
        with self._lock:
            return self._frame("evaluations", self._evals, [c.name for c in M.EVALUATION_COLUMNS])

    def evaluate(self) -> dict[str, float]:
        """Greedy completions on the task's held-out prompts: ``reward_mean`` and ``accuracy`` (also recorded in
        ``evaluations``)."""
        from asyncrl.tasks import evaluate

        version = self.generator.version
        ev = evaluate(self.generator, self.task, self.tokenizer, self.cfg.generation.max_new_tokens)
        with self._lock:
            self._evals.append({M.EVALUATED_VERSION.name: version,
                                **{c.name: ev[c.name] for c in (M.HELD_OUT_REWARD, M.HELD_OUT_ACCURACY)}})
        return ev

    # ------------------------------------------------------------------------------------------- checkpoints
    def save(self, path: str | Path) -> Path:
        """Write a checkpoint directory at ``path`` atomically. ``asyncrl/checkpoint.py`` documents the format and
        what a resume restores; groups in flight are saved as pending and submitted again on restore."""
        from asyncrl.checkpoint import save

        return save(self, path)

    @classmethod
    def restore(cls, path: str | Path, sampler: Any = None, config: Config | None = None,
                on_sampler_change: str = "rejudge") -> Controller:
        """A controller that continues from the checkpoint at ``path`` (a checkpoint directory, or a directory of
        them: the newest complete one), built from ``config`` (default: the checkpoint's own), whose model must
        have the checkpoint's shape. ``sampler`` (a sampler config or mapping) replaces the config's sampler.

        When the sampler differs from the checkpoint's, the capacity is the new sampler's and the restored
        groups are, with ``on_sampler_change="rejudge"``, judged by the new sampler's rules: groups it can never
        train (no ``target_step`` under a stamping sampler such as ``in_order``) and groups beyond its capacity
        (newest first) are skipped, the rest stay and its ``evict`` runs at once; its dispatch index counts the
        batches it kept. With ``"drop"`` every restored group is skipped and the new sampler starts at the
        checkpoint's step with an empty buffer. Either way the trace records each skip and eviction."""
        from asyncrl.checkpoint import restore

        return restore(cls, path, sampler, config, on_sampler_change)

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

