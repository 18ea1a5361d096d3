"""The rollout pump, top to bottom: admit, dispatch, poll (with retries), score, skip or commit. ``Controller``
builds one from the parts it uses and calls ``tick`` from its ``rollout_tick``; the train pump
(``asyncrl/train.py``) calls ``abort``, ``sync_generator``, ``check_shortfall`` and ``fault``, and a restore under
another sampler calls ``skip``.

Invariants (with ``asyncrl/faults.py``, which keeps the budgets and words each fault):
- The pump never encodes a policy: the sampler admits; the pump dispatches one batch at a time, only when all of
  it fits the buffer's capacity and the in-flight limit, and only when nothing waits to be re-submitted.
- Every admitted group is, exactly once, trained, evicted, aborted or skipped, and ``skip`` is the only way a
  group is given up: its slot and in-flight permit come back, and a group from the next prompt with the same
  stamps replaces it (``dispatch``: one place takes prompts from the stream and reserves slots).
- Every error caught is a ``fault`` row; a failing generation call is retried by the next tick (stepping) or after
  the backoff (a run: ``poll`` waits it out in slices of its timeout), until the budget is spent.
- The groups in flight are the buffer's pending slots (reserved, not yet committed or removed); the pump owns what
  only it needs of them: the requests not yet accepted by ``submit`` (``unsent``) and the dispatch counts of groups
  sent more than once (``attempts``). ``release`` is the one place a group leaves flight (committed, skipped or
  aborted), ``abort`` the one place the generator is asked to cancel groups.
- Everything that reads or writes the run state does so under ``state.lock``; scoring runs outside it, through
  ``GroupScorer`` (``asyncrl/rewards/scoring.py``): inline with ``reward.workers: 0``, else in workers (processes,
  or Ray actors) while this pump goes on generating. A group being scored stays in flight (never "lost" by the generator); a tick
  by hand (``wait_s == 0``), a save and a drain wait for the scores of every group submitted, so a stepped run
  commits the same groups at the same ticks with any number of workers; a running pump commits them when they
  come back.
- A save first brings back every group in flight (``settle``), those a tick's poll took (``_polling``) included,
  so a checkpoint never holds a group whose weights and random draws were spent (asyncrl/controller.py says why).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from asyncrl.backends.base import capabilities, is_dead_actor
from asyncrl.buffer import ReplayBuffer, Slot
from asyncrl.completions import CompletionsLog
from asyncrl.data import GenerationRequest, GroupRollouts
from asyncrl.faults import FaultContainment, StepShortfall, describe
from asyncrl.metrics import GEN_METRICS, Accumulator, skew
from asyncrl.reports import TickReport
from asyncrl.rewards.scoring import GroupScorer, run_functions
from asyncrl.state import RunState
from asyncrl.trace import ADMIT, COMMIT, DISPATCH, FAULT, REFUSE, SKIP
from asyncrl.uniform_groups import UniformFilter, UniformGroupsError  # noqa: F401  (importable from here too)

if TYPE_CHECKING:
    from asyncrl.backends.base import GenerationBackend
    from asyncrl.config import Config
    from asyncrl.rewards import RewardFunctions
    from asyncrl.samplers import SamplerBase
    from asyncrl.tasks import PromptStream, Task

FAILED = object()  # what ``generation_call`` returns when the call failed and the fault was contained


class RolloutPump:
    """The rollout half of a controller, built from the parts it uses: ``state`` is the controller's run state
    (this pump and the train pump write it), ``encode`` a prompt's token ids, ``sync_weights(version)`` the weight
    sync into ``generator``; ``rewards`` the run's reward functions (default: ``cfg.reward``'s, else the task's)."""

    def __init__(self, cfg: Config, state: RunState, buffer: ReplayBuffer, sampler: SamplerBase,
                 stream: PromptStream, generator: GenerationBackend, task: Task, tokenizer: Any,
                 encode: Callable[[Any], list[int]], sync_weights: Callable[[int], None], faults: FaultContainment,
                 rewards: RewardFunctions | None = None):
        self.cfg, self.state, self.buffer, self.sampler, self.stream = cfg, state, buffer, sampler, stream
        self.generator, self.task, self.tokenizer, self.encode = generator, task, tokenizer, encode
        self.sync_weights, self.faults = sync_weights, faults
        self.unsent: list[GenerationRequest] = []  # dispatched, not yet accepted by ``submit``
        self.attempts: dict[int, int] = {}  # dispatches of live groups sent more than once
        self._batch: dict[int, int] = {}  # group in flight -> the batch (dispatch index) it was admitted in
        self._refused: str | None = None  # the last refusal traced, until the gate opens again
        self._skipped: list[int] = []  # since the last report
        self._shortfall: dict[int, list[int]] = {}  # stamped steps that lost groups nothing replaced
        self._generated = [0, 0.0]  # completion tokens polls returned, seconds spent in poll: since the last step
        self._skew = Accumulator(GEN_METRICS)  # the groups committed since the last step (skew metrics)
        self.uniform = UniformFilter(cfg.filter_uniform_groups, cfg.stall_timeout_s)
        self._eager: TickReport | None = None  # the running tick's, while it generates (``_scored`` commits)
        self._polling = self._settling = False  # a tick's poll may hold groups not yet committed; a save settles
        self._error: Exception | None = None  # raised in a commit ``_scored`` made, for that tick to raise
        rewards = rewards if rewards is not None else run_functions(cfg.reward, task)  # the controller's: checked
        on_ray = cfg.reward.workers > 0 and "ray" in (cfg.trainer.placement, cfg.generation.placement)
        if on_ray:  # a run on Ray scores in Ray actors, in the session its engines use
            from asyncrl.backends.ray import ensure_ray

            ensure_ray(cfg.ray.num_cpus, cfg.ray.address)
        self.scorer = GroupScorer(
            rewards, cfg.reward.workers, cfg.reward.timeout_s, cfg.faults.reward_retries,
            lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True), self.fault,
            CompletionsLog(cfg.log_completions, rewards.names), self._scored, state.lock,
            "ray" if on_ray else "process", cfg.reward.ray_options)

    # ------------------------------------------------------------------------------------------------ a tick
    def tick(self, wait_s: float = 0.0) -> TickReport:
        """Ask ``admit``; dispatch at most one batch; collect what finished; score; commit. ``wait_s``: how long
        ``poll`` may wait for a group in flight to finish (a run's pump waits a little rather than spin)."""
        with self.state.lock:
            if self._settling:  # a save brings back what is in flight: it polls, this tick admits and polls nothing
                return TickReport("rollout", self.state.trainer_version)
            report = self._admit()
            self._polling = True
        try:
            if wait_s > 0 and self.scorer.open:  # a running pump commits the scores back already before it generates
                self._collect([], report, wait=False)  # (a train pump may wait for them; generating takes a while)
            with self.state.lock:  # and while it generates, ``_scored`` commits them as they come (into this report)
                self._eager = report if wait_s > 0 and self.scorer.runner.workers else None
            try:
                finished = self._poll(wait_s)
            finally:
                with self.state.lock:
                    self._eager, error, self._error = None, self._error, None
            if error is not None:
                raise error
            self._collect(finished, report, wait=wait_s == 0, timeout=0.0 if finished else wait_s)
        finally:
            with self.state.changed:  # what the poll took is committed or with the scorer: a waiting save goes on
                self._polling = False
                self.state.changed.notify_all()
        return report

    def _scored(self) -> None:
        """A worker's score came back (another thread): while a run's tick generates, commit it now (into that
        tick's report; an error is the tick's to raise); else wake a pump waiting on ``changed``. Waits 50 ms at
        most."""
        if self.state.changed.acquire(timeout=0.05):
            try:
                if self._eager is not None:
                    try:
                        self._collect([], self._eager, wait=False)
                    except Exception as exc:  # a reward bug, filter_uniform_groups: raised by the tick
                        self._error = self._error or exc
                self.state.changed.notify_all()
            finally:
                self.state.changed.release()

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
        if self.sampler.gated:
            while not self._no_room() and self._admit_batch(report, trace_refusal=False):
                pass

    def _no_room(self) -> str | None:
        """Why no batch may be dispatched now (the buffer, the in-flight limit, the stream), or None."""
        s, buffer, N = self.state, self.buffer, self.cfg.groups_per_step
        limit = self.cfg.max_inflight_groups
        if s.exhausted:
            return "no dispatch: the prompt stream is exhausted"
        if len(buffer) + N > buffer.capacity:
            return (f"no dispatch: buffer holds {len(buffer)}, a batch of {N} needs room (capacity "
                    f"{buffer.capacity})")
        if limit is not None and buffer.num_pending + N > limit:
            return f"no dispatch: {buffer.num_pending} in flight, limit {limit}"
        if self.unsent:
            return f"no dispatch: {len(self.unsent)} group(s) wait to be re-submitted to the generation backend"
        if self.stream.exhausted(s.data_position + N - 1):
            s.exhausted = True
            return "no dispatch: fewer prompts left than a batch; the stream is exhausted"
        return None

    def _admit_batch(self, report: TickReport, trace_refusal: bool) -> bool:
        """Ask the sampler; on an admission dispatch one batch and submit it. False when the gate is shut."""
        s, sampler, T = self.state, self.sampler, self.state.trainer_version
        gate = sampler.explain_admission(T)  # asked first: admit changes what it would say
        admission = sampler.admit(T)
        if admission is None:
            if trace_refusal:
                report.note = f"gate closed: {gate}"
                if gate != self._refused:  # once per distinct refusal: a running pump asks a shut gate every poll
                    self._refused = gate
                    s.record(REFUSE, detail=f"batch {sampler.dispatch_index + 1}", reason=gate)
            return False
        report.admitted = admission
        self._refused = None
        version = self.generation_call("version", lambda: self.generator.version)
        if version is FAILED:  # the fault is recorded; under the lock the generator holds weights T
            version = T
        s.record(ADMIT, None, version, admission.target_step, None, f"batch {admission.dispatch_index}", gate,
                 dispatch_index=admission.dispatch_index)
        for _ in range(self.cfg.groups_per_step):
            report.dispatched.append(self._dispatch(version, admission.target_step, "", admission.dispatch_index))
        self.flush_unsent()  # one submit per batch: the generator decodes each batch on its own
        return True

    def _dispatch(self, version: int, target_step: int | None, why: str, batch: int | None) -> int | None:
        """The next prompt as a new group (slot reserved: in flight; queued for ``submit``); None when the stream
        has no prompt left. ``batch``: the dispatch index of the batch it belongs to."""
        s = self.state
        if self.stream.exhausted(s.data_position):
            return None
        prompt = self.stream.get(s.data_position)
        s.data_position += 1
        gid = self.buffer.reserve(version, target_step, prompt=prompt)
        if batch is not None:
            self._batch[gid] = batch
        self.unsent.append(GenerationRequest(gid, self.encode(prompt), self.cfg.group_size))
        s.record(DISPATCH, gid, version, target_step, None, prompt.text, why, dispatch_index=batch)
        return gid

    def flush_unsent(self) -> None:
        """Submit what waits to be submitted (new, re-dispatched or replacement groups); kept on failure."""
        if self.unsent and self.generation_call("submit", self.generator.submit, list(self.unsent)) is not FAILED:
            self.unsent.clear()

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
            if self.unsent:
                return []
        # The backend waits for a group only if one is in flight; the backoff above applies either way, so a run
        # spaces its retries even while nothing is in flight (a failing tick writes a trace row, so the pump looks
        # again at once instead of waiting on the controller: the backoff is what paces it).
        start = time.perf_counter()
        generating = self.buffer.num_pending > self.scorer.open  # the rest are being scored
        finished = self.generation_call("poll", self.generator.poll, timeout if generating else 0.0)
        with s.lock:
            self._generated[1] += time.perf_counter() - start
            if finished is not FAILED:
                self._generated[0] += sum(g.num_tokens for g in finished)
        if finished is FAILED or not finished:
            # Lost groups: after a poll that failed or returned nothing (so no result awaits collection), a
            # backend with nothing in flight will never return the groups we sent it.
            with s.lock:
                unsent = {r.group_id for r in self.unsent}
                sent = [g for g in self.inflight_ids() if g not in unsent and not self.scorer.scoring(g)]
                if sent and self.generation_call("num_inflight", self.generator.num_inflight) == 0:
                    self._redispatch(sent, "lost by the generation backend (it has nothing in flight)")
            return []
        return finished

    def _collect(self, finished: list[GroupRollouts], report: TickReport, wait: bool = True,
                 timeout: float = 0.0) -> None:
        """Submit the finished groups for scoring and commit (or skip) the groups whose scoring ended: with
        ``wait``, every group submitted so far; else those back now (waiting up to ``timeout`` for one)."""
        s, buffer = self.state, self.buffer
        with s.lock:  # an aborted group may still come back finished: it was already accounted for
            finished = [g for g in finished if self.in_flight(g.group_id)]
            prompts = [buffer[g.group_id].prompt for g in finished]
        self.scorer.submit(list(zip(finished, prompts)))  # outside the lock (inline: scored right here)
        scored, bad = self.scorer.collect(wait=wait, timeout=timeout)
        with s.changed:
            for group, problem in scored:
                if not self.in_flight(group.group_id):
                    self.scorer.cancel(group.group_id)
                    continue  # aborted while it was being scored
                if problem is not None:
                    self.skip(group.group_id, problem)
                    continue
                if (uniform := self.uniform.reason(group)) is not None:
                    self._skew.add({"groups_uniform": 1})
                    self.skip(group.group_id, uniform)
                    self.scorer.cancel(group.group_id)  # skipped, not committed: not in the completions log
                    report.filtered.append(group.group_id)
                    continue
                slot = self.release(group.group_id, group)
                self.scorer.committed(slot.group_id, slot.prompt, slot.weight_version, group)
                report.committed.append(group.group_id)
                self._skew.add(skew("gen", [group]))
                s.record(COMMIT, slot.group_id, slot.weight_version, slot.target_step, None,
                         f"reward_mean={sum(group.rewards) / len(group.rewards):.3f}",
                         f"generated with weights {group.gen_start_version}..{group.gen_end_version}"
                         + ("" if group.replica is None else f" on replica {group.replica}"),
                         gen_start_version=group.gen_start_version, gen_end_version=group.gen_end_version,
                         replica=group.replica)
            report.skipped.extend(self.take_skipped())
            if scored:
                s.changed.notify_all()
        self.scorer.flush()  # the completions log's file written outside the lock
        if bad is not None:
            raise bad
        self.uniform.check()

    def collect_finished(self) -> TickReport:
        """Commit what the generator has already finished (the batches a step's weight sync generated with the old
        weights included), and nothing else: no admission, no dispatch, no re-submission, no lost-group check."""
        report = TickReport("rollout", self.state.trainer_version)
        finished = self.generation_call("poll", self.generator.poll, 0.0)
        if finished is not FAILED and finished:
            with self.state.lock:
                self._generated[0] += sum(g.num_tokens for g in finished)
        self._collect(finished if finished is not FAILED else [], report)  # and the scores still out
        return report

    def settle(self) -> None:
        """A save's, under the lock: every group in flight back (``stall_timeout_s`` at most), a tick's first."""
        with self.state.changed:
            self._settling = True
            try:
                while self._polling:  # the wait releases the lock: the tick commits, then admits and polls no more
                    self.state.changed.wait(0.05)
                self.collect_finished()
                deadline = time.monotonic() + self.cfg.stall_timeout_s
                while self.buffer.num_pending and time.monotonic() < deadline:
                    self._collect(self._poll(0.05), TickReport("rollout", self.state.trainer_version))
            finally:
                self._settling = False

    def drain(self) -> TickReport:
        """Collect what finished after a run's pumps stopped, so nothing is left half-accounted."""
        report = TickReport("rollout", self.state.trainer_version)
        self._collect(self._poll(0.0), report)
        return report

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
        s, generator = self.state, self.generator
        if not is_dead_actor(exc, generator):
            verdict = self.faults.generation_error(what, exc, self.buffer.num_pending)
            self.fault(None, describe(exc), verdict.reason)
            if verdict.error is not None:
                raise verdict.error from exc
            return
        version = s.trainer_version if version is None else version
        lost = self.inflight_ids()
        restartable = capabilities(generator).actor and self.cfg.generation.weight_sync == "driver"
        verdict = self.faults.generator_died(what, exc, restartable, version, len(lost))
        self.fault(None, describe(exc), verdict.reason)
        if verdict.error is not None:
            raise verdict.error from exc
        generator.restart()
        self.sync_weights(version)
        self.unsent.clear()
        self._redispatch(lost, "lost with the dead generator actor")

    def sync_generator(self, version: int, report: TickReport | None = None) -> None:
        """Load weights ``version`` into the generator; a dead generator actor is restarted with them. At the end
        of a step (``report``: its train tick's) ``admit_due`` runs first, at the old ``T``."""
        if report is not None:
            self.admit_due(report)
        try:
            self.sync_weights(version)
        except Exception as exc:
            if not is_dead_actor(exc, self.generator):
                raise
            self._generation_fault("weight sync", exc, version)  # the restart loads ``version``

    def _redispatch(self, group_ids: list[int], why: str) -> None:
        """Send lost groups again (same slot, prompt and stamps) while ``faults.max_dispatch_attempts`` last;
        skip the others."""
        limit = self.cfg.faults.max_dispatch_attempts
        queued = {r.group_id for r in self.unsent}
        for gid in group_ids:
            attempt = self.attempts.get(gid, 1) + 1
            if attempt > limit:
                self.skip(gid, f"{why}; dispatched {limit} times (faults.max_dispatch_attempts)")
                continue
            self.attempts[gid] = attempt
            self.fault(gid, why, f"retried: re-dispatched, attempt {attempt} of {limit}")
            if gid not in queued:
                self._send(gid)

    def skip(self, gid: int, reason: str, replace: bool = True) -> None:
        """The one way a group is given up: its slot and in-flight permit come back, a ``skip`` event says why,
        and a group from the next prompt with the same stamps replaces it (so its batch still delivers
        ``groups_per_step`` groups). With no prompt left, a stamped step records the shortfall (``check_shortfall``
        reports it when the step cannot complete)."""
        s = self.state
        with s.lock:
            batch = self._batch.get(gid)
            slot = self.release(gid)
            self._skipped.append(gid)
            if slot.target_step is not None and slot.target_step < s.trainer_version:
                replace = False  # its step is done: a replacement could only be evicted
            if not replace:
                s.record(SKIP, gid, slot.weight_version, slot.target_step, None, "not replaced", reason)
                return
            if self.stream.exhausted(s.data_position):
                if slot.target_step is not None:
                    self._shortfall.setdefault(slot.target_step, []).append(gid)
                s.record(SKIP, gid, slot.weight_version, slot.target_step, None, "not replaced: no prompt left",
                         reason)
                return
            new = self.buffer.next_group_id  # the id ``_dispatch`` reserves
            s.record(SKIP, gid, slot.weight_version, slot.target_step, None, f"replaced by group {new}", reason)
            # stamped with the current weight version: the generator's too, under the lock; in the lost group's batch
            self._dispatch(s.trainer_version, slot.target_step, f"replaces group {gid}", batch)

    def abort(self, group_ids: Iterable[int]) -> list[Slot]:
        """Cancel groups in flight (the train pump's, after a step, for those the sampler dooms): the generator
        aborts those it was sent, the ones it was not are cancelled here. Returns the slots of the groups cancelled,
        each released; a group the generator could not cancel (the call failed) stays in flight."""
        doomed = list(group_ids)
        if not doomed:
            return []
        with self.state.lock:
            cancelled = self.generation_call("abort", self.generator.abort, doomed)
            cancelled = [] if cancelled is FAILED else list(cancelled)
            if self.unsent:  # never sent: cancelled here
                cancelled += [r.group_id for r in self.unsent if r.group_id in set(doomed)]
                self.unsent[:] = [r for r in self.unsent if r.group_id not in set(doomed)]
            cancelled += [gid for gid in doomed if self.scorer.cancel(gid)]  # generated, being scored
            return [self.release(gid) for gid in cancelled]

    def release(self, gid: int, rollouts: GroupRollouts | None = None) -> Slot:
        """The one place a group leaves flight: its dispatch count and any request of it still waiting for
        ``submit`` go, and with ``rollouts`` its slot is committed (ready, with the weights its tokens used),
        without them the slot is removed (a skip, an abort), giving its permit back. Returns the slot."""
        self.attempts.pop(gid, None)
        self._batch.pop(gid, None)
        if self.unsent:  # an attempt thought lost that came back after all need not be sent again
            self.unsent[:] = [r for r in self.unsent if r.group_id != gid]
        if rollouts is None:
            return self.buffer.remove([gid])[0]
        return self.buffer.commit(gid, rollouts, end_weight_version=rollouts.gen_end_version,
                                  start_weight_version=rollouts.gen_start_version)

    def in_flight(self, gid: int) -> bool:
        return gid in self.buffer and not self.buffer[gid].ready

    def inflight_ids(self) -> list[int]:
        """The groups in flight (the buffer's pending slots), in dispatch order."""
        return [slot.group_id for slot in self.buffer.pending_slots()]

    def _send(self, gid: int) -> None:
        self.unsent.append(GenerationRequest(gid, self.encode(self.buffer[gid].prompt), self.cfg.group_size))

    def resume(self, in_step: dict | None, trace: Iterable) -> None:
        """After a restore (the buffer and the trace loaded): what this pump counted towards the next step
        (``step_state``), and every pending slot, in flight at save time, queued to be generated again in the
        batch its dispatch row names. ``flush_unsent`` submits them."""
        self.unsent.clear()
        self.attempts.clear()
        gen = dict((in_step or {}).get("gen", {}))  # a checkpoint older than ``in_step``: nothing
        self.scorer.load_state_dict(gen.pop("rewards", None))
        self._skew.totals = gen
        pending = self.inflight_ids()
        live = set(pending)
        self._batch = {row.group_id: row.dispatch_index for row in trace
                       if row.event == DISPATCH and row.group_id in live and row.dispatch_index is not None}
        for gid in pending:
            self._send(gid)

    def take_generation_counts(self) -> tuple[int, float]:
        """(completion tokens, poll seconds) since the previous call: the step's ``gen_tokens_per_s``. Under the
        state lock (the train pump calls it while finishing a step)."""
        tokens, seconds = self._generated
        self._generated = [0, 0.0]
        return tokens, seconds
    def take_skew(self) -> dict[str, float]:
        """``GEN_METRICS`` of the groups committed since the last call (the step ending counts them), ``reward_time_s``."""
        out = {**self._skew.result(), **self.scorer.take_metrics()}
        self._skew.reset()
        return out

    def step_state(self) -> dict:
        """The committed groups' ``GEN_METRICS`` towards the next step, and under ``rewards`` the reward metrics
        and the completions logged. A checkpoint keeps it (``resume``), so the resumed step's metrics row counts
        them too (not the generation rate: timings are not restored)."""
        rewards = self.scorer.state_dict()  # left out while it counts nothing: older checkpoints stay byte for byte
        return {**self._skew.totals, **({"rewards": rewards} if any(rewards.values()) else {})}

    def close(self) -> None:
        """Stop the reward workers and close the completions log."""
        self.scorer.close()

    def take_skipped(self) -> list[int]:
        out, self._skipped = self._skipped, []
        return out

    def fault(self, gid: int | None, error: str, reason: str) -> None:
        """Record a ``fault`` row (with the group's stamps while it is buffered)."""
        with self.state.lock:
            buffer = self.buffer
            slot = buffer[gid] if gid is not None and gid in buffer else None
            version, target = (slot.weight_version, slot.target_step) if slot is not None else (None, None)
            self.state.record(FAULT, gid, version, target, None, error, reason)

    def check_shortfall(self, T: int, trained: int) -> None:
        """A stamped step that lost groups no prompt could replace fails here, naming the step and the shortfall,
        instead of waiting forever (``trained``: groups of step ``T`` already trained)."""
        lost, N = self._shortfall.get(T), self.cfg.groups_per_step
        have = trained + self.buffer.count(target_step=T)
        if lost and have < N:
            raise StepShortfall(
                f"step {T} cannot complete: it lost group(s) {lost} (see their skip events) and the prompt stream "
                f"is exhausted, so no later prompt can replace them; it has {have} of {N} groups (short by "
                f"{N - have})"
            )
