"""Fault containment: the ``faults:`` config section, the errors that stop a run when a budget is spent, and
``FaultContainment``, the collaborator the controller holds that keeps the budgets (consecutive generation
failures, backoff, generator restarts) and decides, for each error, whether it is retried and what the trace says.
The rollout pump (``asyncrl/rollout.py``) acts on its verdicts: it records the fault, retries, re-dispatches or
skips; ``is_dead_actor`` (``asyncrl.backends.base``) tells a dead Ray actor from another error.

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
- Scoring: a reward that raises or returns a non-finite number (or whose weighted sum over ``reward.weights``
  overflows) is re-scored up to ``reward_retries`` times, then the group is skipped; an evaluation's prompt is
  scored the same way, and left out of the evaluation (counted in ``eval_failed``). A reward that returns a
  non-number is a programming error: the run stops with a TypeError naming the value (the group is skipped first,
  so the accounting still holds).
- Generation: a failing ``submit``/``poll``/``abort`` (or version read) counts against ``generation_retries``
  consecutive failures. Requests whose ``submit`` failed are kept and re-submitted; groups the backend lost (it
  reports nothing in flight after a failed ``poll``) are re-dispatched as a new attempt of the same group (same
  prompt, same slot and stamps; staleness still counts from the first dispatch, which only over-states it) up to
  ``max_dispatch_attempts``, then skipped. Only a spent budget stops the run: ``GenerationFailed`` names the
  backend, the budget and the last error; the groups stay live, so stepping again after a fix continues.
- Backoff: after failure ``n`` the run pump waits ``min(backoff_s * 2 ** (n - 1), max_backoff_s)`` before the next
  generation call, in slices no longer than its poll timeout (it stays responsive to a stop). A tick never waits:
  in step mode each rollout tick makes at most one attempt, so stepping is the pacing and stays deterministic.
- Non-finite steps: a policy whose step's loss or gradient norm is not finite skips the optimizer update (weights,
  optimizer state and learning-rate schedule as they were) and reports them as they were; the train pump records a
  ``fault`` naming the step's groups, and ``max_nonfinite_steps`` such steps in a row stop the run
  (``NonFiniteSteps``), the weights those of the last finite step.
- A dead generator actor (Ray) is restarted from the trainer's current weights when ``restart_generator`` is on
  (at most ``max_generator_restarts`` times) and every group it held is re-dispatched. A dead trainer actor stops
  the run (``TrainerFailed``): its optimizer state is gone, the last checkpoint is the way back.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field


class FaultsConfig(BaseModel):
    """Retry budgets and backoff. The defaults ride out a few transient failures without hiding a broken part."""

    model_config = ConfigDict(extra="forbid")

    reward_retries: int = Field(
        2, ge=0, description="re-scorings of one group after its reward raised or returned NaN/inf (or its weighted "
        "sum overflowed); then skipped")
    generation_retries: int = Field(
        8, ge=0, description="consecutive failed generation-backend calls retried; one more stops the run")
    backoff_s: float = Field(0.05, ge=0, description="run-mode wait after the first generation failure (doubles)")
    max_backoff_s: float = Field(2.0, ge=0, description="cap on the run-mode wait between generation retries")
    max_dispatch_attempts: int = Field(
        3, ge=1, description="dispatches of one group (the first included) when the backend loses it; then skipped")
    restart_generator: bool = Field(
        True, description="restart a dead generator actor from the trainer's weights and re-dispatch its groups")
    max_generator_restarts: int = Field(3, ge=0, description="generator actor restarts allowed in one run")
    max_nonfinite_steps: int = Field(
        3, ge=1, description="optimizer steps in a row whose loss or gradient norm is NaN/inf (each one's update "
        "skipped) that stop the run")

    def backoff(self, failures: int) -> float:
        """Seconds the run pump waits after the ``failures``-th consecutive generation failure."""
        return min(self.backoff_s * 2 ** max(0, failures - 1), self.max_backoff_s)


class GenerationFailed(RuntimeError):
    """The generation backend failed more times in a row than ``faults.generation_retries`` allows."""


class TrainerFailed(RuntimeError):
    """The trainer (policy backend) failed; a step cannot be half-trained, so the run stops."""


class RewardTypeError(TypeError):
    """The task's reward returned something that is not a number: a bug in the reward, never retried."""


class NonFiniteSteps(RuntimeError):
    """``faults.max_nonfinite_steps`` optimizer steps in a row had a non-finite loss or gradient norm."""


class StepShortfall(RuntimeError):
    """A stamped step lost groups and no prompt is left to replace them."""


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line, short enough for a trace cell."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def reward_problem(value: object) -> str | None:
    """Why ``value`` is not a usable reward: ``None`` when it is a finite real number; ``"non-finite"`` for
    NaN/inf (a data fault, retried); raises TypeError for anything that is not a number (a programming error)."""
    if not isinstance(value, numbers.Real):
        raise RewardTypeError(
            f"the task's reward returned {value!r} ({type(value).__name__}); a reward must be a real number "
            "(int or float, finite)"
        )
    return None if math.isfinite(value) else f"non-finite reward {value!r}"


class Verdict(NamedTuple):
    """What to do about one error: the fault row's ``reason`` (``retried: ...`` / ``not retried: ...``); the
    exception that stops the run (None: retried); for a dead generator actor, whether to restart it."""

    reason: str
    error: Exception | None = None
    restart: bool = False
    detail: str = ""  # the fault row's ``detail`` where no exception gives it


class FaultContainment:
    """The budgets of one controller: consecutive generation failures and when the run pump may call the backend
    again (``wait_s``), and generator restarts. It decides; the rollout pump acts and records. ``generation``
    and ``trainer`` name the backends in error messages."""

    def __init__(self, cfg: FaultsConfig, generation: str, trainer: str):
        self.cfg, self.generation, self.trainer = cfg, generation, trainer
        self.failures = 0  # consecutive failed generation calls
        self.retry_at = 0.0  # monotonic time before which the run pump does not call the backend again
        self.restarts = 0
        self.nonfinite: list[int] = []  # the steps in a row whose update was skipped (loss or grad norm NaN/inf)

    def wait_s(self) -> float:
        """Seconds of backoff left before the next generation call (<= 0: none)."""
        return self.retry_at - time.monotonic()

    def recovered(self) -> None:
        """A working poll: the backend is healthy again."""
        self.failures, self.retry_at = 0, 0.0

    def generation_error(self, what: str, exc: Exception, inflight: int) -> Verdict:
        """A generation call ``what`` failed (not a dead actor): retried with backoff, or, over
        ``generation_retries`` in a row, ``GenerationFailed``."""
        f = self.cfg
        self.failures += 1
        n = self.failures
        if n > f.generation_retries:
            self.failures = 0  # stepping again after a fix starts a fresh budget
            return Verdict(
                f"not retried: {what} failed {n} times in a row, over faults.generation_retries={f.generation_retries}",
                GenerationFailed(
                    f"the generation backend ({self.generation}) failed {n} times in a row, over the budget "
                    f"faults.generation_retries={f.generation_retries}; last error, in {what}: {describe(exc)}. "
                    f"{inflight} group(s) stay in flight: stepping again retries them"))
        delay = f.backoff(n)
        self.retry_at = time.monotonic() + delay
        return Verdict(f"retried: {what} failure {n} of {f.generation_retries} allowed in a row; next try after "
                       f"{delay:g} s (run) or at the next tick (stepping)")

    def generator_died(self, what: str, exc: Exception, restartable: bool, version: int, lost: int) -> Verdict:
        """The generator actor died during ``what``: restart it (with the trainer's weights ``version``, ``lost``
        groups to re-dispatch) while ``restart_generator`` and the restart budget allow and the backend can be."""
        f = self.cfg
        if not (f.restart_generator and restartable and self.restarts < f.max_generator_restarts):
            why = ("faults.restart_generator is off" if not f.restart_generator else
                   "only a Ray generator with weight_sync 'driver' can be restarted" if not restartable else
                   f"faults.max_generator_restarts={f.max_generator_restarts} restarts spent")
            return Verdict(f"not retried: the generator actor died during {what}; {why}", GenerationFailed(
                f"the generation actor ({self.generation}) died during {what}: {describe(exc)}; not restarted: {why}"))
        self.restarts += 1
        return Verdict(f"retried: the generator actor died during {what}; restarted ({self.restarts} of "
                       f"{f.max_generator_restarts}) with the trainer's weights {version}, {lost} group(s) "
                       "re-dispatched", restart=True)

    def step_numbers(self, T: int, loss: float, grad_norm: float,
                     groups: Callable[[], Sequence[int]]) -> Verdict | None:
        """Step ``T``'s loss and gradient norm as its policy reported them: None when both are finite (the run of
        non-finite steps ends); else the fault's verdict (the policy skipped the update; ``groups()`` the step's
        groups, asked only then), with ``NonFiniteSteps`` once ``max_nonfinite_steps`` steps in a row were."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.nonfinite = []
            return None
        self.nonfinite.append(T)
        budget, steps = self.cfg.max_nonfinite_steps, self.nonfinite
        detail = f"step {T}: loss {loss!r}, grad_norm {grad_norm!r} (groups {', '.join(map(str, groups()))})"
        if len(steps) < budget:
            return Verdict(f"not retried: the step's update is skipped, the weights kept ({len(steps)} of "
                           f"faults.max_nonfinite_steps={budget} such steps in a row stop the run)", detail=detail)
        self.nonfinite = []  # stepping again after a fix starts a fresh count
        return Verdict(f"not retried: the step's update is skipped, the weights kept; {len(steps)} such steps in a row "
                       f"reach faults.max_nonfinite_steps={budget}; the run stops", NonFiniteSteps(
                           f"{len(steps)} optimizer steps in a row ({', '.join(map(str, steps))}) had a non-finite "
                           f"loss or gradient norm (the last: loss {loss!r}, grad_norm {grad_norm!r}), reaching "
                           f"faults.max_nonfinite_steps={budget}; their updates were skipped, so the weights are "
                           f"those before step {steps[0]}"), detail=detail)

    def trainer_error(self, exc: Exception, T: int, dead: bool) -> Verdict:
        """A training failure stops the run (a step cannot be half-trained); a dead trainer actor becomes
        ``TrainerFailed``, which points at the last checkpoint."""
        if not dead:
            return Verdict(f"not retried: step {T} failed in the trainer")
        return Verdict("not retried: the trainer actor died", TrainerFailed(
            f"the trainer actor ({self.trainer}) died during step {T}: {describe(exc)}. Its weights and optimizer "
            "state are gone: restore the last checkpoint (Controller.restore(path), or asyncrl run CONFIG --steps N "
            "--resume DIR)"))
