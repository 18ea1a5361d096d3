"""The train pump, top to bottom: evict, select, train a chunk, and when the step's groups are all trained, the
optimizer step and the end of the step (``T += 1`` with the weight sync, aborts, the metrics row). ``Controller``
builds one from the parts it uses and calls ``tick`` from its ``train_tick``; it asks the rollout pump
(``asyncrl/rollout.py``) for what touches generation: ``sync_generator``, ``abort``, ``check_shortfall``, ``fault``.

Invariants:
- The pump never encodes a policy: evict, select and abort are the sampler's decisions, with the reasons its
  verdicts give (``select_reasoned``, ``evict_reasoned``, ``abort_reason``), written to the trace.
- One RL step is exactly one optimizer step: ``begin_train_step`` with the step's first chunk, ``train_microbatches``
  per chunk, ``finish_train_step`` once its ``groups_per_step`` groups are trained. The step's accumulator (``step``)
  and the policy are this pump's alone, so training and the optimizer step run outside the lock.
- ``T`` and the generator's weights move together, under the lock (``_finish_step``): the rollout pump never sees
  ``T + 1`` while the generator holds weights ``T``. Before the sync, the batches a gated sampler admits at the old
  ``T`` are admitted (``RolloutPump.admit_due``), so with a gated sampler the schedule does not depend on timing.
- A training error is a ``fault`` row with ``FaultContainment.trainer_error``'s verdict, then raised.
- A step whose loss or gradient norm the policy reports non-finite had its update skipped by the policy
  (``finish_train_step``'s contract): it still ends (``T += 1``, its metrics row), with a ``fault`` row naming its
  groups; ``faults.max_nonfinite_steps`` such steps in a row raise ``NonFiniteSteps`` once that step is recorded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl import metrics as M
from asyncrl.algorithms import make_train_batch, mark_versions, mask_truncated
from asyncrl.backends.base import capabilities, is_dead_actor
from asyncrl.buffer import ReplayBuffer, Slot
from asyncrl.faults import FaultContainment, GenerationFailed, NonFiniteSteps, StepShortfall, describe
from asyncrl.gap_pass import GapPass
from asyncrl.metrics import FunctionRewards, StepAccumulator
from asyncrl.reports import TickReport
from asyncrl.state import RunState
from asyncrl.trace import ABORT, EVICT, SELECT, STEP, SYNC, TRAIN

if TYPE_CHECKING:
    from asyncrl.backends.base import GenerationBackend, PolicyBackend
    from asyncrl.config import Config
    from asyncrl.rollout import RolloutPump
    from asyncrl.samplers import SamplerBase
    from asyncrl.tasks import Task


def sync_bytes(sync: Any) -> dict[str, float]:
    """``{sync_bytes: the last sync's payload}`` where the weight sync counts it (``last_bytes``), else ``{}``."""
    nbytes = getattr(sync, "last_bytes", None)
    return {} if nbytes is None else {M.SYNC_BYTES.name: float(nbytes)}


class TrainPump:
    """The train half of a controller, built from the parts it uses: ``state`` is the controller's run state,
    ``rollout`` the rollout pump it hands generation to, ``clock`` the step timer's (active time only),
    ``save_checkpoint()`` what ``checkpoint_every`` calls at the end of a step, under the lock."""

    def __init__(self, cfg: Config, state: RunState, buffer: ReplayBuffer, sampler: SamplerBase,
                 policy: PolicyBackend, generator: GenerationBackend, task: Task, tokenizer: Any,
                 rollout: RolloutPump, faults: FaultContainment, clock: Callable[[], float],
                 save_checkpoint: Callable[[], Any], reward_functions: Any = None):
        self.cfg, self.state, self.buffer, self.sampler = cfg, state, buffer, sampler
        self.policy, self.generator, self.task, self.tokenizer = policy, generator, task, tokenizer
        self.rollout, self.faults, self.clock, self.save_checkpoint = rollout, faults, clock, save_checkpoint
        self.step = StepAccumulator(clock)  # the step in progress (STEP_METRICS); reset when it finishes
        self.function_rewards = FunctionRewards(rollout.scorer.functions.names)  # reward/<name>: the step's groups
        self.kept: set[int] = set()  # the weight versions the policy holds (keeps_versions), the current included
        # Buffered groups' logprobs under the weights that sampled them, measured ahead (a checkpoint's, the gap
        # pass's): group id -> one value or None per completion token.
        self.known: dict[int, list] = {}
        self.reward_functions = reward_functions  # what evaluations score with (None: the task's own reward)
        # What the backends declare is fixed by their classes: read once, not per tick (``capabilities`` checks
        # the declaration each call).
        self.policy_can, self.generator_can = capabilities(policy), capabilities(generator)
        # an on-policy sampler trains no stale token: nothing to keep, nothing to measure
        self.keeping = not sampler.is_on_policy and cfg.loss.gap_metrics and self.policy_can.keeps_versions
        beside = self.policy_can.concurrent_logprobs_at and not self.policy_can.actor  # in this process
        self.chosen = 0  # groups of the chunk being trained (selected, not yet counted in ``step``)
        needed = lambda: cfg.groups_per_step - self.step.groups - self.chosen  # noqa: E731  (more the step needs)
        self.gap = GapPass(state, buffer, self.measure, lambda: self.kept, needed) if self.keeping and beside else None

    # ------------------------------------------------------------------------------------------------ a tick
    def tick(self) -> TickReport:
        """Evict; select a chunk; train on it; when the step's groups are all trained, finish the step."""
        N, state = self.cfg.groups_per_step, self.state
        with state.lock:
            T = state.trainer_version
            if T == 0 and self.cfg.eval_every and not state.evaluations:
                self.evaluate()  # the untrained model: where the held-out curve starts
            report = TickReport("train", T)
            if self.keeping and T not in self.kept:  # the first tick, or the first after a restore
                self._keep_versions(T)
            for slot, reason in self.sampler.evict_reasoned(T):  # each with the words its verdict gives
                report.evicted.append(slot.group_id)
                self.step.add({"groups_evicted": 1, **M.skew("drop", [slot.rollouts])})
                state.record(EVICT, slot.group_id, slot.weight_version, slot.target_step, T - slot.weight_version,
                             "", reason)
            remaining = N - self.step.groups
            lo, hi = self.cfg.chunk_bounds
            chosen = self.sampler.select_reasoned(T, min(lo, remaining), min(hi, remaining))
            if chosen is None:
                self.rollout.check_shortfall(T, self.step.groups)
                report.note = (
                    f"select waits: {self.buffer.num_ready} ready, {self.buffer.num_pending} pending, "
                    f"needs {min(lo, remaining)}"
                )
                return report
            chunk = [slot for slot, _ in chosen]
            self.chosen = len(chunk)
            if self.gap is not None:  # what the gap pass measured of them (it waits for one it is measuring)
                self.known.update(self.gap.claim(slot.group_id for slot in chunk))
            for slot, reason in chosen:
                report.selected.append(slot.group_id)
                state.record(SELECT, slot.group_id, slot.weight_version, slot.target_step, T - slot.weight_version,
                             "", reason)
        try:
            self._train_chunk(chunk, T)
            finished = self.step.groups == N
            # The optimizer step runs outside the lock (only this pump touches the policy; the rollout pump needs it
            # to dispatch and commit); T and the generator's weights move at the sync, under it. Not if a restart can
            # reload the trainer's weights as T under the lock (a restart in the rollout pump): never mid-update or
            # ahead of T.
            restartable = self.cfg.faults.restart_generator and self.generator_can.actor
            update = self._optimizer_step() if finished and not restartable else None
            stop = None
            with state.changed:
                if finished:
                    stop = self._finish_step(report, update if update is not None else self._optimizer_step())
                    every = self.cfg.checkpoint_every
                    if every and state.trainer_version % every == 0:
                        self.save_checkpoint()
                state.changed.notify_all()
            if stop is not None:  # the step is done and recorded; its update was skipped
                raise stop
        except (GenerationFailed, StepShortfall, NonFiniteSteps):
            raise
        except Exception as exc:
            verdict = self.faults.trainer_error(exc, T, is_dead_actor(exc, self.policy))
            self.rollout.fault(None, describe(exc), verdict.reason)
            if verdict.error is not None:
                raise verdict.error from exc
            raise
        report.skipped.extend(self.rollout.take_skipped())
        report.trainer_version = state.trainer_version
        return report

    def _train_chunk(self, chunk: list[Slot], T: int) -> None:
        train_start = time.perf_counter()
        groups = [slot.rollouts for slot in chunk]
        batch = make_train_batch(groups, self.cfg.loss, self.tokenizer.pad_token_id)
        known = [x for g in groups for x in self.known.pop(g.group_id, [None] * g.num_tokens)] \
            if any(g.group_id in self.known for g in groups) else None
        batch = mark_versions(batch, groups, T, self._logprobs_at, known, self.cfg.loss.gap_completions)  # the importance weight's parts, apart
        batch = mask_truncated(batch, groups, self.cfg.loss)  # loss.mask_truncated_completions
        if not self.policy_can.prev_logprobs_from_forward:  # such a policy takes them from its forward
            batch = replace(batch, prev_logprobs=self.policy.logprobs(batch))
        if not self.step.started:
            self.policy.begin_train_step()
            self.step.started = True
        self.policy.train_microbatches(batch)
        rewards = [r for g in groups for r in g.rewards]
        lags = [T - slot.weight_version for slot in chunk]
        chunk_index = int(self.step.total("chunks"))
        self.step.add({
            "reward_mean": sum(rewards), "completions": len(rewards), "lag_mean": sum(lags), "lag_max": max(lags),
            "groups": len(chunk), "chunks": 1, "completion_tokens": sum(g.num_tokens for g in groups),
            "train_time_s": time.perf_counter() - train_start, **M.skew("train", groups),
            **M.token_staleness(groups, T),
        })
        self.function_rewards.add_groups(groups)
        self.chosen = 0
        self.state.record(TRAIN, detail=f"{len(chunk)} groups, {batch.num_tokens} tokens",
                          reason=f"chunk {chunk_index} of step {T}")

    def _logprobs_at(self, batch, version: int, current: int | None = None):
        """The trainer's logprobs under weights ``version`` if it kept them (``keeps_versions``), else None."""
        current = self.state.trainer_version if current is None else current
        return self.policy.logprobs_at(batch, version, current) if version in self.kept else None

    def _keep_versions(self, current: int) -> None:
        """The policy's weights being version ``current`` (at the first tick, and right after each optimizer step):
        it keeps them, and those of every version a buffered group may have been sampled with (the oldest buffered
        ``weight_version`` on, and ``current - 1``, which batches admitted at the step's end are generated with),
        and drops older ones (what that costs: docs/replay.md). Kept from the step that made them, the current
        weights can be read while they are trained (the gap pass)."""
        with self.state.lock:
            oldest = min([max(current - 1, 0)] + [slot.weight_version for slot in self.buffer.slots()])
        self.kept = set(self.policy.keep_versions(list(range(oldest, current + 1)), current))

    def _optimizer_step(self) -> dict[str, float]:
        """``policy.finish_train_step()`` (normalise, clip, one optimizer step): the policy's step metrics."""
        train_start = time.perf_counter()
        out = self.policy.finish_train_step()
        if self.keeping:
            self._keep_versions(self.state.trainer_version + 1)
        self.step.add({"train_time_s": time.perf_counter() - train_start})  # what a simulation calibrates on
        return out

    def measure(self, groups: list, current: int | None = None) -> dict[int, list]:
        """``groups``' logprobs under the weights that sampled their tokens, as far as the policy kept them and
        ``loss.gap_completions`` asks (``mark_versions``): group id -> one value or None per completion token, None
        also at a token sampled by version ``current`` or later (default: every kept version is measured)."""
        current = max(self.kept, default=-1) + 1 if current is None else current
        batch = make_train_batch(groups, self.cfg.loss, self.tokenizer.pad_token_id)
        known = [x for g in groups for x in self.known.get(g.group_id, [None] * g.num_tokens)]
        batch = mark_versions(batch, groups, current, lambda b, v: self._logprobs_at(b, v, current), known,
                              self.cfg.loss.gap_completions)
        held = batch.version_logprobs.masked_fill(batch.stale_mask == 0, math.nan)[batch.loss_mask > 0].tolist()
        out, start = {}, 0
        for g in groups:
            out[g.group_id] = [None if math.isnan(x) else x for x in held[start:start + g.num_tokens]]
            start += g.num_tokens
        return out

    def _turn_note(self, gid: int) -> str:
        """A multi-turn group's abort says the turn it reached (``asyncrl/turns.py``); "" for any other."""
        note = getattr(self.generator, "abort_note", None)
        return note(gid) if note is not None else ""

    def _finish_step(self, report: TickReport, out: dict[str, float]) -> NonFiniteSteps | None:
        """Under the lock, after the optimizer step (``out``): ``T += 1`` with the sync, aborts, the metrics row.
        A step whose loss or gradient norm is not finite (its policy skipped the update) is a ``fault`` row naming
        its groups; returned, the error that stops the run once ``faults.max_nonfinite_steps`` were in a row."""
        state, rollout = self.state, self.rollout
        T = state.trainer_version + 1
        verdict = self.faults.step_numbers(T - 1, out.get("loss", 0.0), out.get("grad_norm", 0.0), self._trained)
        if verdict is not None:
            rollout.fault(None, verdict.detail, verdict.reason)
        sync_start = time.perf_counter()
        rollout.sync_generator(T, report)  # first admits the batches due at the old T (admit_due)
        sync_s = time.perf_counter() - sync_start
        state.trainer_version = T
        state.record(SYNC, None, T, reason=f"generator now holds weights {T}")  # no timings: traces replay
        doomed = [slot.group_id for slot in self.buffer.pending_slots()
                  if self.sampler.should_abort_inflight(slot.weight_version, T)]
        for slot in rollout.abort(doomed):
            w = slot.weight_version
            report.aborted.append(slot.group_id)
            self.step.add({"groups_aborted": 1})
            state.record(ABORT, slot.group_id, w, slot.target_step, T - w, "",
                         self.sampler.abort_reason(slot, T) + self._turn_note(slot.group_id))
        elapsed = self.clock() - self.step.start  # active time only: not a person's pause between hand ticks
        row = {  # the vocabulary: asyncrl.metrics (STEP_METRICS, STEP_FACTS)
            M.STEP.name: T - 1,
            M.TRAINER_VERSION.name: T,
            **self.step.result(), **rollout.take_skew(),  # M.GEN_METRICS: committed this step
            **self.function_rewards.result(),  # reward/<name>: trained this step, as reward_mean
            M.STEP_TIME_S.name: elapsed,
            M.TOKENS_PER_S.name: self.step.total("completion_tokens") / elapsed if elapsed > 0 else math.nan,
            M.SYNC_TIME_S.name: sync_s,
            **sync_bytes(rollout.sync_weights),
            M.BUFFERED.name: len(self.buffer),
            M.INFLIGHT.name: self.buffer.num_pending,
        }
        row.update({k: v for k, v in out.items() if k not in row})  # the policy's: its Loss's and ENGINE_METRICS
        row.update(M.throughput(out, self.step.total(M.TRAIN_TIME_S.name)))  # train_tflops, mfu
        gen_tokens, gen_s = rollout.take_generation_counts()
        row[M.GEN_TOKENS_PER_S.name] = gen_tokens / gen_s if gen_s > 0 else math.nan
        if self.generator_can.step_metrics:  # e.g. a replica set's tokens and busy time per replica
            row.update(self.generator.step_metrics())
        if self.cfg.eval_every and T % self.cfg.eval_every == 0:
            ev = self.evaluate()
            row[M.EVAL_REWARD.name] = ev[M.HELD_OUT_REWARD.name]
            row[M.EVAL_ACCURACY.name] = ev[M.HELD_OUT_ACCURACY.name]
            row[M.EVAL_FAILED.name] = ev[M.EVAL_FAILED.name]
        state.finish_step(row, f"loss={row['loss']:.4f} reward={row[M.REWARD_MEAN.name]:.3f}",
                          f"optimizer step {T - 1} done" if verdict is None else
                          f"step {T - 1} done, its update skipped (non-finite loss or gradient norm)")
        report.step_finished = True
        self.step.reset()
        self.function_rewards.reset()
        return None if verdict is None else verdict.error

    def _trained(self) -> list[int]:
        """The groups the step in progress trained: its ``select`` rows since the last ``step`` row."""
        groups = []
        for row in reversed(self.state.trace):
            if row.event == STEP:
                break
            if row.event == SELECT:
                groups.append(row.group_id)
        return sorted(groups)

    # ------------------------------------------------------------------------------------- evaluation, state
    def evaluate(self, split: str = "eval", n: int = 1, temperature: float = 0.0,
                 max_prompts: int | None = None) -> dict[str, float]:
        """``Controller.evaluate`` (``asyncrl/evaluation.py``); the row it adds to ``evaluations`` keeps the weight
        version it judged. A sampled evaluation's random stream is its own, seeded by the run's seed, the version
        and how many evaluations came before."""
        from asyncrl.evaluation import evaluate_task

        version = self.generator.version
        seed = int(np.random.SeedSequence([self.cfg.seed, version, len(self.state.evaluations)]).generate_state(1)[0])
        ev, _ = evaluate_task(self.generator, self.task, self.tokenizer, self.reward_functions, split, n, temperature,
                              max_prompts, seed, self.cfg.generation.max_new_tokens, self.cfg.reward.accuracy,
                              self.rollout.scorer.evaluation_runner(), self.cfg.faults.reward_retries,
                              self.rollout.fault)  # scored as training scores: workers, timeout_s, fault rows
        with self.state.lock:
            self.state.evaluations.append({M.EVALUATED_VERSION.name: version,
                                           **{c.name: ev[c.name] for c in (M.HELD_OUT_REWARD, M.HELD_OUT_ACCURACY)},
                                           M.EVAL_SPLIT.name: split, M.EVAL_N.name: n,
                                           M.EVAL_TEMPERATURE.name: float(temperature), M.EVAL_PROMPTS.name: ev["n"],
                                           M.EVAL_FAILED.name: ev[M.EVAL_FAILED.name],
                                           f"mean@{n}": ev[f"mean@{n}"], f"pass@{n}": ev[f"pass@{n}"]})
        return ev

    def count_aborted(self) -> None:
        """A group aborted in flight between weight syncs (a multi-turn group stopped at a turn boundary,
        ``asyncrl/turn_hooks.py``): counted in the step's ``groups_aborted`` as a sync's aborts are. Under the
        run state's lock."""
        self.step.add({"groups_aborted": 1})

    def measure_beside(self, running: Callable[[], bool]) -> None:
        """A run's: the gap pass's thread, while ``running()``, if this policy's ``logprobs_at`` allows one."""
        if self.gap is not None:
            self.gap.start(running)

    def end_beside(self, timeout: float = 30.0) -> None:
        """Wait for the gap pass's thread to end (its run has ended): before the policy closes (``GapPass.join``)."""
        if self.gap is not None:
            self.gap.join(timeout)

    def step_state(self) -> dict:
        """What this pump counted towards the next step (evictions before a select that waited): a checkpoint keeps
        it, so the resumed step's metrics row counts them too."""
        return dict(self.step.totals)

    def version_state(self) -> dict[str, list]:
        """For a checkpoint (the policy's kept weights are not in it): each ready buffered group's logprobs under the
        older weights that sampled its tokens (None at its other tokens), so a resumed run measures the gap as an
        uninterrupted one would (group id -> one value per completion token)."""
        T = self.state.trainer_version
        stale = [slot.rollouts for slot in self.buffer.ready_slots()
                 if any(v < T for c in slot.rollouts.versions() for v in c)]
        return {str(g): values for g, values in self.measure(stale, T).items()} if stale else {}

    def resume(self, in_step: dict | None) -> None:
        self.known = {int(g): lp for g, lp in ((in_step or {}).get("versions") or {}).items()}
        if self.keeping:  # copies of the weights before the restore: dropped; the next tick keeps the current ones
            self.kept = set(self.policy.keep_versions([], self.state.trainer_version))
        self.step.totals = dict((in_step or {}).get("train", {}))  # a checkpoint older than ``in_step``: nothing
