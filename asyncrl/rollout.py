"""The rollout pump, top to bottom: admit, dispatch, poll (with retries), score, skip or commit. ``Controller``
holds one and calls ``tick`` from its ``rollout_tick``; the train pump (in ``asyncrl/controller.py``) calls
``generation_call`` (aborts), ``sync_generator``, ``skip`` (restore under another sampler) and ``fault``.

Invariants (with ``asyncrl/faults.py``, which keeps the budgets and words each fault):
- The pump never encodes a policy: the sampler admits; the pump dispatches one batch at a time, only when all of
  it fits the buffer's capacity and the in-flight limit, and only when nothing waits to be re-submitted.
- Every admitted group is, exactly once, trained, evicted, aborted or skipped, and ``skip`` is the only way a
  group is given up: its slot and in-flight permit come back, and a group from the next prompt with the same
  stamps replaces it (``dispatch``: one place takes prompts from the stream and reserves slots).
- Every error caught is a ``fault`` row; a failing generation call is retried by the next tick (stepping) or after
  the backoff (a run: ``poll`` waits it out in slices of its timeout), until the budget is spent.
- Everything that reads or writes the run state does so under ``state.lock``; scoring (pure Python) runs outside.
"""

from __future__ import annotations

import time
from typing import Any

from asyncrl.backends.base import ActorBackend, is_dead_actor
from asyncrl.data import GenerationRequest, GroupRollouts
from asyncrl.faults import FaultContainment, RewardTypeError, StepShortfall, describe, reward_problem
from asyncrl.metrics import GEN_METRICS, Accumulator, skew
from asyncrl.reports import TickReport
from asyncrl.samplers import GatedAdmission
from asyncrl.state import RunState
from asyncrl.trace import ADMIT, COMMIT, DISPATCH, FAULT, REFUSE, SKIP

FAILED = object()  # what ``generation_call`` returns when the call failed and the fault was contained


class RolloutPump:
    """The rollout half of a controller. ``ctrl`` is read for its parts (``cfg``, ``buffer``, ``sampler``,
    ``stream``, ``generator``, ``task``, ``tokenizer``, ``sync_weights``, ``encode``); ``state`` is the
    controller's run state, which this pump and the train pump write."""

    def __init__(self, ctrl: Any, state: RunState, faults: FaultContainment):
        self.ctrl, self.state, self.faults = ctrl, state, faults
        self.cfg = ctrl.cfg
        self._refused: str | None = None  # the last refusal traced, until the gate opens again
        self._skipped: list[int] = []  # since the last report
        self._shortfall: dict[int, list[int]] = {}  # stamped steps that lost groups nothing replaced
        self._generated = [0, 0.0]  # completion tokens polls returned, seconds spent in poll: since the last step
        self._skew = Accumulator(GEN_METRICS)  # the groups committed since the last step (skew metrics)

    # ------------------------------------------------------------------------------------------------ a tick
    def tick(self, wait_s: float = 0.0) -> TickReport:
        """Ask ``admit``; dispatch at most one batch; collect what finished; score; commit. ``wait_s``: how long
        ``poll`` may wait for a group in flight to finish (a run's pump waits a little rather than spin)."""
        with self.state.lock:
            report = self._admit()
        self._collect(self._poll(wait_s), report)
        return report

    def _admit(self) -> TickReport:
        report = TickReport("rollout", self.state.trainer_version)
        report.note = self._no_room() or ""
        if not report.note:
            self._admit_batch(report, trace_refusal=True)
        report.skipped.extend(self.take_skipped())
        return report

    def admit_due(self, report: TickReport) -> None:
        """In the section that moves ``T`` (under the lock, before the weight sync): admit every batch a gated
        sampler lets through at the old ``T``. The gate never admits batch ``k`` before ``T = k - W``; this makes
        sure it is admitted by then, so its weight version is ``max(0, k - W)`` however late the rollout pump is
        (docs/samplers.md, "Timing-independent schedules"). An ungated sampler (``windowed``) admits on rollout
        ticks only: its gate is always open."""
        if isinstance(self.ctrl.sampler, GatedAdmission) and self.ctrl.sampler.gated:
            while not self._no_room() and self._admit_batch(report, trace_refusal=False):
                pass

    def _no_room(self) -> str | None:
        """Why no batch may be dispatched now (the buffer, the in-flight limit, the stream), or None."""
        ctrl, s, N = self.ctrl, self.state, self.cfg.groups_per_step
        limit = self.cfg.max_inflight_groups
        if s.exhausted:
            return "no dispatch: the prompt stream is exhausted"
        if len(ctrl.buffer) + N > ctrl.capacity:
            return (f"no dispatch: buffer holds {len(ctrl.buffer)}, a batch of {N} needs room (capacity "
                    f"{ctrl.capacity})")
        if limit is not None and len(s.inflight) + N > limit:
            return f"no dispatch: {len(s.inflight)} in flight, limit {limit}"
        if s.unsent:
            return f"no dispatch: {len(s.unsent)} group(s) wait to be re-submitted to the generation backend"
        if ctrl.stream.exhausted(s.data_position + N - 1):
            s.exhausted = True
            return "no dispatch: fewer prompts left than a batch; the stream is exhausted"
        return None

    def _admit_batch(self, report: TickReport, trace_refusal: bool) -> bool:
        """Ask the sampler; on an admission dispatch one batch and submit it. False when the gate is shut."""
        ctrl, s, T = self.ctrl, self.state, self.state.trainer_version
        gate = ctrl.sampler.explain_admission(T)  # asked first: admit changes what it would say
        admission = ctrl.sampler.admit(T)
        if admission is None:
            if trace_refusal:
                report.note = f"gate closed: {gate}"
                if gate != self._refused:  # once per distinct refusal: a running pump asks a shut gate every poll
                    self._refused = gate
                    s.record(REFUSE, detail=f"batch {ctrl.sampler.dispatch_index + 1}", reason=gate)
            return False
        report.admitted = admission
        self._refused = None
        version = self.generation_call("version", lambda: ctrl.generator.version)
        if version is FAILED:  # the fault is recorded; under the lock the generator holds weights T
            version = T
        s.record(ADMIT, None, version, admission.target_step, None, f"batch {admission.dispatch_index}", gate,
                 dispatch_index=admission.dispatch_index)
        for _ in range(self.cfg.groups_per_step):
            report.dispatched.append(self._dispatch(version, admission.target_step, "", admission.dispatch_index))
        self.flush_unsent()  # one submit per batch: the generator decodes each batch on its own
        return True

    def _dispatch(self, version: int, target_step: int | None, why: str, batch: int | None) -> int | None:
        """The next prompt as a new group (slot reserved, in flight, queued for ``submit``); None when the stream
        has no prompt left."""
        ctrl, s = self.ctrl, self.state
        if ctrl.stream.exhausted(s.data_position):
            return None
        prompt = ctrl.stream.get(s.data_position)
        s.data_position += 1
        gid = ctrl.buffer.reserve(version, target_step, prompt=prompt)
        s.inflight[gid] = version
        s.unsent.append(GenerationRequest(gid, ctrl.encode(prompt.text), self.cfg.group_size))
        s.record(DISPATCH, gid, version, target_step, None, prompt.text, why, dispatch_index=batch)
        return gid

    def flush_unsent(self) -> None:
        """Submit what waits to be submitted (new, re-dispatched or replacement groups); kept on failure."""
        s = self.state
        if s.unsent and self.generation_call("submit", self.ctrl.generator.submit, list(s.unsent)) is not FAILED:
            s.unsent.clear()

    def _poll(self, timeout: float) -> list[GroupRollouts]:
        """The generation half of a tick: re-submit what waits, then poll; every failure is contained by
        ``generation_call``. The run pump (``timeout > 0``) sits out the backoff in slices of at most ``timeout``;
        a tick (``timeout == 0``) never waits, it tries once: stepping is the pacing, and stays deterministic."""
        s = self.state
        wait = self.faults.wait_s()
        if timeout > 0 and wait > 0:
            time.sleep(min(wait, timeout))
            if wait > timeout:
                return []
        with s.lock:
            self.flush_unsent()
            if s.unsent:
                return []
        # The backend waits for a group only if one is in flight; the backoff above applies either way, so a run
        # spaces its retries even while nothing is in flight (a failing tick writes a trace row, so the pump looks
        # again at once instead of waiting on the controller: the backoff is what paces it).
        start = time.perf_counter()
        finished = self.generation_call("poll", self.ctrl.generator.poll, timeout if s.inflight else 0.0)
        with s.lock:
            self._generated[1] += time.perf_counter() - start
            if finished is not FAILED:
                self._generated[0] += sum(g.num_tokens for g in finished)
        if finished is FAILED or not finished:
            # Lost groups: after a poll that failed or returned nothing (so no result awaits collection), a
            # backend with nothing in flight will never return the groups we sent it.
            with s.lock:
                sent = [g for g in s.inflight if g not in {r.group_id for r in s.unsent}]
                if sent and self.generation_call("num_inflight", self.ctrl.generator.num_inflight) == 0:
                    self._redispatch(sent, "lost by the generation backend (it has nothing in flight)")
            return []
        return finished

    def _collect(self, finished: list[GroupRollouts], report: TickReport) -> None:
        s, buffer = self.state, self.ctrl.buffer
        with s.lock:  # an aborted group may still come back finished: it was already accounted for
            finished = [g for g in finished if g.group_id in s.inflight]
            prompts = [buffer[g.group_id].prompt for g in finished]
        problems, bad = [], None
        for group, prompt in zip(finished, prompts):  # scoring is pure Python; done outside the lock
            try:
                problems.append(self._score(group, prompt))
            except RewardTypeError as exc:  # a bug in the reward, not a fault to retry: stop, accounted
                self.fault(group.group_id, str(exc), "not retried: a bug in the reward; the run stops")
                problems.append(f"the reward is broken: {exc}")
                bad = bad or exc
        with s.changed:
            for group, problem in zip(finished, problems):
                if group.group_id not in s.inflight:
                    continue  # aborted while it was being scored
                if problem is not None:
                    self.skip(group.group_id, problem)
                    continue
                s.inflight.pop(group.group_id)
                s.attempts.pop(group.group_id, None)
                if s.unsent:  # an attempt thought lost came back after all: no need to send it again
                    s.unsent[:] = [r for r in s.unsent if r.group_id != group.group_id]
                slot = buffer.commit(group.group_id, group, end_weight_version=group.gen_end_version,
                                     start_weight_version=group.gen_start_version)
                report.committed.append(group.group_id)
                self._skew.add(skew("gen", [group]))
                s.record(COMMIT, slot.group_id, slot.weight_version, slot.target_step, None,
                         f"reward_mean={sum(group.rewards) / len(group.rewards):.3f}",
                         f"generated with weights {group.gen_start_version}..{group.gen_end_version}"
                         + ("" if group.replica is None else f" on replica {group.replica}"),
                         gen_start_version=group.gen_start_version, gen_end_version=group.gen_end_version,
                         replica=group.replica)
            report.skipped.extend(self.take_skipped())
            if finished:
                s.changed.notify_all()
        if bad is not None:
            raise bad

    def collect_finished(self) -> TickReport:
        """Commit what the generator has already finished, and nothing else: no admission, no dispatch, no
        re-submission, no lost-group check (another thread's poll may hold a group this one does not see). A save
        calls it first: a step's weight sync generates the batches submitted before it with the old weights
        (``sync_generator``), and a checkpoint that held them as pending would have them generated again, with
        the new weights and the generator's random numbers after them."""
        report = TickReport("rollout", self.state.trainer_version)
        finished = self.generation_call("poll", self.ctrl.generator.poll, 0.0)
        if finished is not FAILED and finished:
            with self.state.lock:
                self._generated[0] += sum(g.num_tokens for g in finished)
            self._collect(finished, report)
        return report

    def drain(self) -> TickReport:
        """Collect what finished after a run's pumps stopped, so nothing is left half-accounted."""
        report = TickReport("rollout", self.state.trainer_version)
        self._collect(self._poll(0.0), report)
        return report

    # ---------------------------------------------------------------------------------------------- scoring
    def _score(self, group: GroupRollouts, prompt) -> str | None:
        """Score one group (unless its backend did). ``None`` when every reward is a finite number; otherwise
        each failure is a ``fault`` event, the group is re-scored up to ``faults.reward_retries`` times, and
        the returned string says why it is given up."""
        budget, gid = self.cfg.faults.reward_retries, group.group_id
        if group.rewards is not None:  # the backend scored it (simulated): nothing to re-score
            problem = next(filter(None, map(reward_problem, group.rewards)), None)
            if problem is not None:
                self.fault(gid, problem, "not retried: the generation backend scored this group")
            return problem
        group.texts = self.ctrl.tokenizer.batch_decode(group.completion_ids, skip_special_tokens=True)
        for attempt in range(budget + 1):
            try:
                rewards = [self.ctrl.task.reward(prompt, text) for text in group.texts]
                problem = next(filter(None, map(reward_problem, rewards)), None)
            except RewardTypeError:
                raise
            except Exception as exc:
                problem = describe(exc)
            if problem is None:
                group.rewards = rewards
                return None
            self.fault(gid, problem, f"retried: scoring again ({attempt + 1} of {budget} re-scorings)"
                       if attempt < budget else f"not retried: faults.reward_retries={budget} re-scorings spent")
        return f"the reward failed {budget + 1} time(s), last: {problem}"

    # ------------------------------------------------------------------------------------- retries and skips
    def generation_call(self, what: str, fn, *args):
        """Call the generation backend; a failure becomes a ``fault`` event and ``FAILED`` is returned, until
        ``faults.generation_retries`` consecutive failures (``GenerationFailed``). A dead actor is restarted."""
        try:
            out = fn(*args)
        except Exception as exc:
            with self.state.lock:
                self._generation_fault(what, exc)
            return FAILED
        if what == "poll":  # only a working poll shows the backend is healthy again
            self.faults.recovered()
        return out

    def _generation_fault(self, what: str, exc: Exception, version: int | None = None) -> None:
        s, generator = self.state, self.ctrl.generator
        if not is_dead_actor(exc, generator):
            verdict = self.faults.generation_error(what, exc, len(s.inflight))
            self.fault(None, describe(exc), verdict.reason)
            if verdict.error is not None:
                raise verdict.error from exc
            return
        version = s.trainer_version if version is None else version
        lost = list(s.inflight)
        restartable = isinstance(generator, ActorBackend) and self.cfg.generation.weight_sync == "driver"
        verdict = self.faults.generator_died(what, exc, restartable, version, len(lost))
        self.fault(None, describe(exc), verdict.reason)
        if verdict.error is not None:
            raise verdict.error from exc
        generator.restart()
        self.ctrl.sync_weights(version)
        s.unsent.clear()
        self._redispatch(lost, "lost with the dead generator actor")

    def sync_generator(self, version: int, report: TickReport | None = None) -> None:
        """Load weights ``version`` into the generator; a dead generator actor is restarted with them. At the end
        of a step (``report``: its train tick's) ``admit_due`` runs first, at the old ``T``."""
        if report is not None:
            self.admit_due(report)
        try:
            self.ctrl.sync_weights(version)
        except Exception as exc:
            if not is_dead_actor(exc, self.ctrl.generator):
                raise
            self._generation_fault("weight sync", exc, version)  # the restart loads ``version``

    def _redispatch(self, group_ids: list[int], why: str) -> None:
        """Send lost groups again (same slot, prompt and stamps) while ``faults.max_dispatch_attempts`` last;
        skip the others."""
        s, limit = self.state, self.cfg.faults.max_dispatch_attempts
        queued = {r.group_id for r in s.unsent}
        for gid in group_ids:
            attempt = s.attempts.get(gid, 1) + 1
            if attempt > limit:
                self.skip(gid, f"{why}; dispatched {limit} times (faults.max_dispatch_attempts)")
                continue
            s.attempts[gid] = attempt
            self.fault(gid, why, f"retried: re-dispatched, attempt {attempt} of {limit}")
            if gid not in queued:
                s.unsent.append(GenerationRequest(gid, self.ctrl.encode(self.ctrl.buffer[gid].prompt.text),
                                                  self.cfg.group_size))

    def skip(self, gid: int, reason: str, replace: bool = True) -> None:
        """The one way a group is given up: its slot and in-flight permit come back, a ``skip`` event says why,
        and a group from the next prompt with the same stamps replaces it (so its batch still delivers
        ``groups_per_step`` groups). With no prompt left, a stamped step records the shortfall (``check_shortfall``
        reports it when the step cannot complete)."""
        s = self.state
        with s.lock:
            s.inflight.pop(gid, None)
            s.attempts.pop(gid, None)
            s.unsent[:] = [r for r in s.unsent if r.group_id != gid]
            slot = self.ctrl.buffer.remove([gid])[0]
            self._skipped.append(gid)
            if slot.target_step is not None and slot.target_step < s.trainer_version:
                replace = False  # its step is done: a replacement could only be evicted
            if not replace:
                s.record(SKIP, gid, slot.weight_version, slot.target_step, None, "not replaced", reason)
                return
            if self.ctrl.stream.exhausted(s.data_position):
                if slot.target_step is not None:
                    self._shortfall.setdefault(slot.target_step, []).append(gid)
                s.record(SKIP, gid, slot.weight_version, slot.target_step, None, "not replaced: no prompt left",
                         reason)
                return
            new = self.ctrl.buffer.next_group_id  # the id ``_dispatch`` reserves
            s.record(SKIP, gid, slot.weight_version, slot.target_step, None, f"replaced by group {new}", reason)
            # stamped with the current weight version: the generator's too, under the lock
            self._dispatch(s.trainer_version, slot.target_step, f"replaces group {gid}", None)

    def take_generation_counts(self) -> tuple[int, float]:
        """(completion tokens, poll seconds) since the previous call: the step's ``gen_tokens_per_s``. Under the
        state lock (the train pump calls it while finishing a step)."""
        tokens, seconds = self._generated
        self._generated = [0, 0.0]
        return tokens, seconds
    def take_skew(self) -> dict[str, float]:
        """``GEN_METRICS`` of the groups committed since the last call (the step that finishes now counts them)."""
        out = self._skew.result()
        self._skew.reset()
        return out

    def step_state(self, train: Accumulator) -> dict:
        """What the pumps counted towards the next step: ``train`` (the controller's step accumulator: evictions
        before a select that waited) and ``gen`` (the committed groups' ``GEN_METRICS``). A checkpoint keeps it, so
        the resumed step's metrics row counts them too (not the generation rate: timings are not restored)."""
        return {"train": dict(train.totals), "gen": dict(self._skew.totals)}

    def load_step_state(self, state: dict | None, train: Accumulator) -> None:
        state = state or {}  # a checkpoint older than ``in_step``: nothing counted
        train.totals = dict(state.get("train", {}))
        self._skew.totals = dict(state.get("gen", {}))

    def take_skipped(self) -> list[int]:
        out, self._skipped = self._skipped, []
        return out

    def fault(self, gid: int | None, error: str, reason: str) -> None:
        """Record a ``fault`` row (with the group's stamps while it is buffered)."""
        with self.state.lock:
            buffer = self.ctrl.buffer
            slot = buffer[gid] if gid is not None and gid in buffer else None
            version, target = (slot.weight_version, slot.target_step) if slot is not None else (None, None)
            self.state.record(FAULT, gid, version, target, None, error, reason)

    def check_shortfall(self, T: int, trained: int) -> None:
        """A stamped step that lost groups no prompt could replace fails here, naming the step and the shortfall,
        instead of waiting forever (``trained``: groups of step ``T`` already trained)."""
        lost, N = self._shortfall.get(T), self.cfg.groups_per_step
        have = trained + self.ctrl.buffer.count(target_step=T)
        if lost and have < N:
            raise StepShortfall(
                f"step {T} cannot complete: it lost group(s) {lost} (see their skip events) and the prompt stream "
                f"is exhausted, so no later prompt can replace them; it has {have} of {N} groups (short by "
                f"{N - have})"
            )
