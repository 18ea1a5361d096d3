"""Fault containment: the ``faults:`` config section, the errors that stop a run when a budget is spent, and
``FaultContainment``, the part of ``Controller`` that records faults, retries and gives groups up.

Invariants it keeps:
- Every error the pumps catch becomes a ``fault`` trace event: the group id when there is one, the error in
  ``detail``, and a ``reason`` that starts with ``retried:`` or ``not retried:``.
- A group the controller gives up on ends with a ``skip`` event and its reason (one of the four ends: trained by
  ``select``, ``evict``, ``abort``, ``skip``); its buffer slot and in-flight permit are released, and a replacement
  group is dispatched from the next prompt with the same stamps (``target_step``; not for a step already done), so
  an admitted batch still delivers ``groups_per_step`` groups. With no prompt left, a stamped step that lost groups
  fails at its train tick with the step and the shortfall named. The replacement is stamped with the current
  weight version, so ``weight_fifo`` (one version at a time, never skipping ahead) can stall on an older version
  that lost a group once newer versions are buffered; the run loop's stall watchdog then names it (a known limit).
- Lost groups are detected by the backend's ``num_inflight()`` dropping to 0 after a poll that failed or returned
  nothing while the controller still has groups out with it; a backend that loses some groups but keeps others is
  noticed only once the others are back (the run loop's stall watchdog covers a backend that never comes back).
- Scoring: a reward that raises or returns a non-finite number is re-scored up to ``reward_retries`` times, then
  the group is skipped. A reward that returns a non-number is a programming error: the run stops with a TypeError
  naming the value (the group is skipped first, so the accounting still holds).
- Generation: a failing ``submit``/``poll``/``abort`` (or version read) counts against ``generation_retries``
  consecutive failures. Requests whose ``submit`` failed are kept and re-submitted; groups the backend lost (it
  reports nothing in flight after a failed ``poll``) are re-dispatched as a new attempt of the same group (same
  prompt, same slot and stamps; staleness still counts from the first dispatch, which only over-states it) up to
  ``max_dispatch_attempts``, then skipped. Only a spent budget stops the run: ``GenerationFailed`` names the
  backend, the budget and the last error; the groups stay live, so stepping again after a fix continues.
- Backoff: after failure ``n`` the run pump waits ``min(backoff_s * 2 ** (n - 1), max_backoff_s)`` before the next
  generation call, in slices no longer than its poll timeout (it stays responsive to a stop). A tick never waits:
  in step mode each rollout tick makes at most one attempt, so stepping is the pacing and stays deterministic.
- A dead generator actor (Ray) is restarted from the trainer's current weights when ``restart_generator`` is on
  (at most ``max_generator_restarts`` times) and every group it held is re-dispatched. A dead trainer actor stops
  the run (``TrainerFailed``): its optimizer state is gone, the last checkpoint is the way back.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.data import GenerationRequest, GroupRollouts

_FAILED = object()  # what _generation_call returns when the call failed and the fault was contained


class FaultsConfig(BaseModel):
    """Retry budgets and backoff. The defaults ride out a few transient failures without hiding a broken part."""

    model_config = ConfigDict(extra="forbid")

    reward_retries: int = Field(
        2, ge=0, description="re-scorings of one group after its reward raised or returned NaN/inf; then skipped")
    generation_retries: int = Field(
        8, ge=0, description="consecutive failed generation-backend calls retried; one more stops the run")
    backoff_s: float = Field(0.05, ge=0, description="run-mode wait after the first generation failure (doubles)")
    max_backoff_s: float = Field(2.0, ge=0, description="cap on the run-mode wait between generation retries")
    max_dispatch_attempts: int = Field(
        3, ge=1, description="dispatches of one group (the first included) when the backend loses it; then skipped")
    restart_generator: bool = Field(
        True, description="restart a dead generator actor from the trainer's weights and re-dispatch its groups")
    max_generator_restarts: int = Field(3, ge=0, description="generator actor restarts allowed in one run")

    def backoff(self, failures: int) -> float:
        """Seconds the run pump waits after the ``failures``-th consecutive generation failure."""
        return min(self.backoff_s * 2 ** max(0, failures - 1), self.max_backoff_s)


class GenerationFailed(RuntimeError):
    """The generation backend failed more times in a row than ``faults.generation_retries`` allows."""


class TrainerFailed(RuntimeError):
    """The trainer (policy backend) failed; a step cannot be half-trained, so the run stops."""


class RewardTypeError(TypeError):
    """The task's reward returned something that is not a number: a bug in the reward, never retried."""


class StepShortfall(RuntimeError):
    """A stamped step lost groups and no prompt is left to replace them."""


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line, short enough for a trace cell."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@runtime_checkable
class ActorBackend(Protocol):
    """Optional for a backend: it is a proxy of one Ray actor (``asyncrl.backends.ray.RemoteBackend``). Only such a
    backend can die as an actor and be restarted; in-process, child-process, replica-set and rank-group backends
    are not one actor and do not have these members."""

    @property
    def actor_id(self) -> str:
        """The actor's id (hex), as ``ray.exceptions.RayActorError.actor_id`` names a dead one."""
        ...

    def restart(self) -> None:
        """Replace the dead actor with a fresh one built the same way (it starts from its constructor's state)."""
        ...


def is_dead_actor(exc: BaseException, backend: object) -> bool:
    """Is ``exc`` Ray saying that ``backend``'s actor died? (False without Ray or for a backend that is not one
    actor.)"""
    errors = sys.modules.get("ray.exceptions")
    if errors is None or not isinstance(backend, ActorBackend) or not isinstance(exc, errors.RayActorError):
        return False
    return exc.actor_id in (None, backend.actor_id)


def reward_problem(value: object) -> str | None:
    """Why ``value`` is not a usable reward: ``None`` when it is a finite real number; ``"non-finite"`` for
    NaN/inf (a data fault, retried); raises TypeError for anything that is not a number (a programming error)."""
    if not isinstance(value, numbers.Real):
        raise RewardTypeError(
            f"the task's reward returned {value!r} ({type(value).__name__}); a reward must be a real number "
            "(int or float, finite)"
        )
    return None if math.isfinite(value) else f"non-finite reward {value!r}"


class FaultContainment:
    """The controller's fault handling (a mixin of ``Controller``; it works on the controller's buffer,
    ``inflight``, prompt stream and trace, under its lock). The pumps' tick functions call into it; it is the one
    place where a fault is recorded (``_fault``), a group is given up (``_skip``) or sent again (``_redispatch``).

    State it keeps on the controller: ``_unsent`` (requests dispatched but not yet accepted by ``submit``; their
    groups are in ``inflight``), ``_attempts`` (dispatches of live groups), ``_generation_failures`` and
    ``_retry_at`` (consecutive failures, and when the run pump may call the backend again), ``_restarts``,
    ``_skipped`` (since the last report) and ``_shortfall`` (stamped steps that lost groups nothing replaced)."""

    def _init_faults(self) -> None:
        self._unsent: list[GenerationRequest] = []
        self._attempts: dict[int, int] = {}
        self._generation_failures = 0
        self._retry_at = 0.0
        self._restarts = 0
        self._skipped: list[int] = []
        self._shortfall: dict[int, list[int]] = {}

    def _flush_unsent(self) -> None:
        """Submit what waits to be submitted (new, re-dispatched or replacement groups); kept on failure."""
        if self._unsent and self._generation_call("submit", self.generator.submit, list(self._unsent)) is not _FAILED:
            self._unsent.clear()

    def _poll(self, timeout: float) -> list[GroupRollouts]:
        """The generation half of a rollout tick: re-submit what waits, then poll; every failure is contained by
        ``_generation_call``. The run pump (``timeout > 0``) sits out the backoff in slices of at most ``timeout``;
        a tick (``timeout == 0``) never waits, it tries once: stepping is the pacing, and stays deterministic."""
        wait = self._retry_at - time.monotonic()
        if timeout > 0 and wait > 0:
            time.sleep(min(wait, timeout))
            if wait > timeout:
                return []
        with self._lock:
            self._flush_unsent()
            if self._unsent:
                return []
        # The backend waits for a group only if one is in flight; the backoff above applies either way, so a run
        # spaces its retries even while nothing is in flight (a failing tick writes a trace row, so the pump looks
        # again at once instead of waiting on the controller: the backoff is what paces it).
        finished = self._generation_call("poll", self.generator.poll, timeout if self.inflight else 0.0)
        if finished is _FAILED or not finished:
            # Lost groups: after a poll that failed or returned nothing (so no result awaits collection), a
            # backend with nothing in flight will never return the groups we sent it.
            with self._lock:
                sent = [g for g in self.inflight if g not in {r.group_id for r in self._unsent}]
                if sent and self._generation_call("num_inflight", self.generator.num_inflight) == 0:
                    self._redispatch(sent, "lost by the generation backend (it has nothing in flight)")
            return []
        return finished

    def _generation_call(self, what: str, fn, *args):
        """Call the generation backend; a failure becomes a ``fault`` event and ``_FAILED`` is returned, until
        ``faults.generation_retries`` consecutive failures (``GenerationFailed``). A dead actor is restarted."""
        try:
            out = fn(*args)
        except Exception as exc:
            with self._lock:
                self._generation_fault(what, exc)
            return _FAILED
        if what == "poll":  # only a working poll shows the backend is healthy again
            self._generation_failures, self._retry_at = 0, 0.0
        return out

    def _generation_fault(self, what: str, exc: Exception, version: int | None = None) -> None:
        f = self.cfg.faults
        if is_dead_actor(exc, self.generator):
            self._restart_generator(what, exc, self.trainer_version if version is None else version)
            return
        self._generation_failures += 1
        n = self._generation_failures
        if n > f.generation_retries:
            self._generation_failures = 0  # stepping again after a fix starts a fresh budget
            self._fault(None, describe(exc), f"not retried: {what} failed {n} times in a row, over "
                                             f"faults.generation_retries={f.generation_retries}")
            raise GenerationFailed(
                f"the generation backend ({self._backend_name('generation')}) failed {n} times in a row, over the "
                f"budget faults.generation_retries={f.generation_retries}; last error, in {what}: {describe(exc)}. "
                f"{len(self.inflight)} group(s) stay in flight: stepping again retries them"
            ) from exc
        delay = f.backoff(n)
        self._retry_at = time.monotonic() + delay
        self._fault(None, describe(exc), f"retried: {what} failure {n} of {f.generation_retries} allowed in a row; "
                                         f"next try after {delay:g} s (run) or at the next tick (stepping)")

    def _restart_generator(self, what: str, exc: Exception, version: int) -> None:
        """A dead generator actor: a fresh one with the trainer's weights ``version``; its groups re-dispatched."""
        f, lost = self.cfg.faults, list(self.inflight)
        possible = isinstance(self.generator, ActorBackend) and self.cfg.generation.weight_sync == "driver"
        if not (f.restart_generator and possible and self._restarts < f.max_generator_restarts):
            why = ("faults.restart_generator is off" if not f.restart_generator else
                   "only a Ray generator with weight_sync 'driver' can be restarted" if not possible else
                   f"faults.max_generator_restarts={f.max_generator_restarts} restarts spent")
            self._fault(None, describe(exc), f"not retried: the generator actor died during {what}; {why}")
            raise GenerationFailed(
                f"the generation actor ({self._backend_name('generation')}) died during {what}: {describe(exc)}; "
                f"not restarted: {why}"
            ) from exc
        self._restarts += 1
        self._fault(None, describe(exc), (
            f"retried: the generator actor died during {what}; restarted ({self._restarts} of "
            f"{f.max_generator_restarts}) with the trainer's weights {version}, {len(lost)} group(s) re-dispatched"))
        self.generator.restart()
        self.sync_weights(version)
        self._unsent.clear()
        self._redispatch(lost, "lost with the dead generator actor")

    def _redispatch(self, group_ids: list[int], why: str) -> None:
        """Send lost groups again (same slot, prompt and stamps) while ``faults.max_dispatch_attempts`` last;
        skip the others."""
        limit = self.cfg.faults.max_dispatch_attempts
        queued = {r.group_id for r in self._unsent}
        for gid in group_ids:
            attempt = self._attempts.get(gid, 1) + 1
            if attempt > limit:
                self._skip(gid, f"{why}; dispatched {limit} times (faults.max_dispatch_attempts)")
                continue
            self._attempts[gid] = attempt
            self._fault(gid, why, f"retried: re-dispatched, attempt {attempt} of {limit}")
            if gid not in queued:
                self._unsent.append(GenerationRequest(gid, self._encode(self.buffer[gid].prompt.text),
                                                      self.cfg.group_size))

    def _skip(self, gid: int, reason: str, replace: bool = True) -> None:
        """The one way a group is given up: its slot and in-flight permit come back, a ``skip`` event says why,
        and a group from the next prompt with the same stamps replaces it (so its batch still delivers
        ``groups_per_step`` groups). With no prompt left, a stamped step records the shortfall (``train_tick``
        reports it when the step cannot complete)."""
        self.inflight.pop(gid, None)
        self._attempts.pop(gid, None)
        self._unsent = [r for r in self._unsent if r.group_id != gid]
        slot = self.buffer.remove([gid])[0]
        self._skipped.append(gid)
        if slot.target_step is not None and slot.target_step < self.trainer_version:
            replace = False  # its step is done: a replacement could only be evicted
        if not replace:
            self._event("skip", gid, slot.weight_version, slot.target_step, None, "not replaced", reason)
            return
        if self.stream.exhausted(self.data_position):
            if slot.target_step is not None:
                self._shortfall.setdefault(slot.target_step, []).append(gid)
            self._event("skip", gid, slot.weight_version, slot.target_step, None, "not replaced: no prompt left",
                        reason)
            return
        prompt = self.stream.get(self.data_position)
        self.data_position += 1
        version = self.trainer_version  # the generator's version too, under the lock
        new = self.buffer.reserve(version, slot.target_step, prompt=prompt)
        self.inflight[new] = version
        self._unsent.append(GenerationRequest(new, self._encode(prompt.text), self.cfg.group_size))
        self._event("skip", gid, slot.weight_version, slot.target_step, None, f"replaced by group {new}", reason)
        self._event("dispatch", new, version, slot.target_step, None, prompt.text, f"replaces group {gid}")

    def _take_skipped(self) -> list[int]:
        out, self._skipped = self._skipped, []
        return out

    def _fault(self, gid: int | None, error: str, reason: str) -> None:
        with self._lock:
            slot = self.buffer[gid] if gid is not None and gid in self.buffer else None
            version, target = (slot.weight_version, slot.target_step) if slot is not None else (None, None)
            self._event("fault", gid, version, target, None, error, reason)

    def _backend_name(self, section: str) -> str:
        part = self.cfg.generation if section == "generation" else self.cfg.trainer
        return f"{part.backend}, placement {part.placement}"

    def _score(self, group: GroupRollouts, prompt) -> str | None:
        """Score one group (unless its backend did). ``None`` when every reward is a finite number; otherwise
        each failure is a ``fault`` event, the group is re-scored up to ``faults.reward_retries`` times, and
        the returned string says why it is given up."""
        budget, gid = self.cfg.faults.reward_retries, group.group_id
        if group.rewards is not None:  # the backend scored it (simulated): nothing to re-score
            problem = next(filter(None, map(reward_problem, group.rewards)), None)
            if problem is not None:
                self._fault(gid, problem, "not retried: the generation backend scored this group")
            return problem
        group.texts = self.tokenizer.batch_decode(group.completion_ids, skip_special_tokens=True)
        for attempt in range(budget + 1):
            try:
                rewards = [self.task.reward(prompt, text) for text in group.texts]
                problem = next(filter(None, map(reward_problem, rewards)), None)
            except RewardTypeError:
                raise
            except Exception as exc:
                problem = describe(exc)
            if problem is None:
                group.rewards = rewards
                return None
            self._fault(gid, problem, f"retried: scoring again ({attempt + 1} of {budget} re-scorings)"
                        if attempt < budget else f"not retried: faults.reward_retries={budget} re-scorings spent")
        return f"the reward failed {budget + 1} time(s), last: {problem}"

    def _check_shortfall(self, T: int) -> None:
        """A stamped step that lost groups no prompt could replace fails here, naming the step and the shortfall,
        instead of waiting forever."""
        lost = self._shortfall.get(T)
        have = self._step.groups + self.buffer.count(target_step=T)
        if lost and have < self.cfg.groups_per_step:
            raise StepShortfall(
                f"step {T} cannot complete: it lost group(s) {lost} (see their skip events) and the prompt stream "
                f"is exhausted, so no later prompt can replace them; it has {have} of {self.cfg.groups_per_step} "
                f"groups (short by {self.cfg.groups_per_step - have})"
            )

    def _trainer_fault(self, exc: Exception, T: int) -> None:
        """A training failure is recorded and stops the run: a step cannot be half-trained. A dead trainer actor
        becomes ``TrainerFailed``, which points at the last checkpoint."""
        dead = is_dead_actor(exc, self.policy)
        self._fault(None, describe(exc), "not retried: " + ("the trainer actor died" if dead else
                                                             f"step {T} failed in the trainer"))
        if dead:
            raise TrainerFailed(
                f"the trainer actor ({self._backend_name('trainer')}) died during step {T}: {describe(exc)}. Its "
                "weights and optimizer state are gone: restore the last checkpoint (Controller.restore(path), or "
                "asyncrl run CONFIG --steps N --resume DIR)"
            ) from exc

    def _sync_generator(self, version: int) -> None:
        try:
            self.sync_weights(version)
        except Exception as exc:
            if not is_dead_actor(exc, self.generator):
                raise
            self._generation_fault("weight sync", exc, version)  # the restart loads ``version``
