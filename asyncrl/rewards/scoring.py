"""How the rollout pump scores: ``GroupScorer`` (its collaborator: submit a finished group, collect scored ones,
retries within ``faults.reward_retries``), the run's functions, a group's inputs and the per-step metrics; and how
an evaluation scores (``score_now`` through ``GroupScorer.evaluation_runner``).

Invariants:
- Every group submitted comes back from ``collect`` exactly once, scored (``problem`` None) or given up
  (``problem`` says why: the pump skips it), unless ``cancel``ed (aborted). Each failed attempt is one ``fault``
  row, worded as the pump always worded them (``retried: scoring again (k of B re-scorings)`` / ``not retried:
  faults.reward_retries=B re-scorings spent``); a ``bug`` (wrong length, non-number, missing column) is a fault
  ``not retried: a bug in the reward; the run stops`` and ``collect`` returns it as a ``RewardTypeError`` to raise
  once the batch is accounted for.
- ``collect(wait=True)`` returns only when every group submitted so far is back: a hand tick waits for its own
  groups, so a stepped run is the same with any number of workers; a running pump does not wait.
- The run's functions, first found wins: the objects a caller passed (``reward_funcs=``), ``reward.funcs`` of the
  config, the task's own ``reward_funcs`` (a dataset task's verifier: countdown's), else the task's own
  ``reward(prompt, text)`` (the built-in toy tasks, bit for bit).
- A group's inputs are TRL's: ``prompts`` the prompt as the data holds it (messages for a conversational prompt,
  else its text), ``completions`` the decoded texts (as messages, ``[{"role": "assistant", "content": text}]``,
  for a conversational prompt), ``completion_ids``, and every column of the prompt's row repeated per completion.
- A committed group carries its functions' values (``GroupRollouts.reward_parts``): the train pump makes
  ``reward/<name>`` of the groups a step trains from them (``asyncrl.metrics.FunctionRewards``), and a checkpoint
  keeps them with the group. ``reward_time_s`` is the seconds the functions took on every group scored since the
  last step, failed attempts included (the work, not the time a group queued for a worker).
- An evaluation's prompts are scored by the same machinery in a runner of their own (the same settings: workers,
  ``timeout_s``), re-scored within ``faults.reward_retries`` with the same fault rows; a prompt that keeps failing
  is left out (``None``), never scored 0, and no function (the task's own ``reward``/``is_correct`` included)
  is called outside the runner.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.completions import CompletionsLog, group_rows
from asyncrl.faults import RewardTypeError, reward_problem
from asyncrl.rewards.functions import RewardBatch, RewardFunctions, TaskReward, function_name
from asyncrl.rewards.runner import RewardRunner, Scored

REWARD_TIME_S = "reward_time_s"
BUG_REASON = "not retried: a bug in the reward; the run stops"


def retry_reason(attempt: int, budget: int) -> str:
    """A failed scoring attempt ``attempt`` (0: the first) that is scored again, within ``budget`` re-scorings."""
    return f"retried: scoring again ({attempt + 1} of {budget} re-scorings)"


def spent_reason(budget: int) -> str:
    return f"not retried: faults.reward_retries={budget} re-scorings spent"


def run_functions(reward: Any, task: Any, reward_funcs: Sequence[Any] | None = None) -> RewardFunctions:
    """The run's ``RewardFunctions`` from its ``reward:`` section, its task and the functions a caller passed."""
    if reward_funcs:
        if reward.funcs:
            raise ValueError(f"reward functions given twice: reward_funcs={[function_name(f) for f in reward_funcs]} "
                             f"and reward.funcs={reward.model_dump(mode='json')['funcs']}; name them in one place")
        return RewardFunctions(reward_funcs, reward.weights)
    if reward.funcs:
        return reward.functions()
    own = getattr(task, "reward_funcs", None)
    if own:
        return RewardFunctions(own)
    return RewardFunctions([TaskReward(task)])


def group_batch(prompt: Any, texts: list[str], completion_ids: list[list[int]]) -> RewardBatch:
    """One group's inputs, as TRL passes them (see the module's invariants)."""
    n = len(texts)
    messages = getattr(prompt, "messages", None)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if messages is not None else list(texts)
    columns = {k: [v] * n for k, v in (getattr(prompt, "columns", None) or {}).items()}
    return RewardBatch([prompt.text if messages is None else messages] * n, completions, completion_ids, columns,
                       source=prompt)


class RewardMetrics:
    """The per-step ``reward_time_s`` (see the module's invariants)."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {}

    def scored(self, outcome: Scored) -> None:
        """Any scoring that ended (its time counts, whatever the outcome)."""
        self.totals[REWARD_TIME_S] = self.totals.get(REWARD_TIME_S, 0.0) + outcome.seconds

    def result(self) -> dict[str, float]:
        return {REWARD_TIME_S: self.totals.get(REWARD_TIME_S, 0.0)}

    def take(self) -> dict[str, float]:
        out = self.result()
        self.reset()
        return out


class GroupScorer:
    """The rollout pump's scoring (see the module's invariants). ``decode`` turns completion ids into texts,
    ``fault(gid, error, reason)`` records a fault row; ``notify`` is called (from another thread) when a score
    comes back, so a waiting pump looks again. ``lock``: the run state's (reentrant) lock, which every change of
    this bookkeeping takes (the rollout pump, a save and the train pump's aborts reach it from their threads); no
    reward function runs under it, and nothing waits for the runner holding it."""

    def __init__(self, functions: RewardFunctions, workers: int, timeout_s: float | None, retries: int,
                 decode: Callable[[list[list[int]]], list[str]], fault: Callable[[int, str, str], None],
                 log: CompletionsLog | None = None, notify: Callable[[], None] | None = None, lock: Any = None,
                 placement: str = "process", ray_options: dict | None = None):
        self.functions, self.retries, self.decode, self.fault = functions, retries, decode, fault
        self.lock = lock if lock is not None else threading.RLock()
        self.runner = RewardRunner(functions, workers, timeout_s, on_done=notify if workers else None,
                                   placement=placement, ray_options=ray_options)
        self._settings = (workers, timeout_s, placement, ray_options)  # an evaluation's runner's too
        self._evaluation: RewardRunner | None = None
        self.metrics = RewardMetrics(functions.names)  # a task's own reward: reward/<task name>
        self.log = log if log is not None else CompletionsLog("all", functions.names)
        self._open: dict[int, tuple[Any, Any, int]] = {}  # group id -> (rollouts, prompt, attempt)
        self._parts: dict[int, dict[str, list] | None] = {}  # scored, until committed
        self._ready: list[tuple[Any, str | None]] = []  # scoring ended, until collected
        self._bug: Exception | None = None  # the first bug since the last collect
        self._rows: list[dict] = []  # completions of groups committed, until flushed to the log
        self._order: dict[int, int] = {}  # group id -> when it was submitted (collect returns them in this order)
        self._submitted = itertools.count()

    def submit(self, groups: list[tuple[Any, Any]]) -> None:
        """Start scoring finished groups, ``(rollouts, prompt)`` each, handed over together (a group its backend
        scored is only checked). Inline, each is scored (and re-scored) right here, in turn."""
        batches = []
        for group, prompt in groups:
            gid = group.group_id
            with self.lock:
                self._order[gid] = next(self._submitted)
            if group.rewards is not None:  # the backend scored it (simulated): nothing to re-score
                problem = next(filter(None, map(reward_problem, group.rewards)), None)
                if problem is not None:
                    self.fault(gid, problem, "not retried: the generation backend scored this group")
                with self.lock:
                    self._ready.append((group, problem))
                continue
            group.texts = self.decode(group.completion_ids)
            with self.lock:
                self._open[gid] = (group, prompt, 0)
            batches.append((gid, group_batch(prompt, group.texts, group.completion_ids)))
            if self.runner.workers == 0:  # inline: scored, and re-scored, right here
                self.runner.submit_all(batches)
                batches = []
                while gid in self._open:
                    self._take([gid])
        if batches:
            self.runner.submit_all(batches)

    def collect(self, wait: bool = False, timeout: float = 0.0) -> tuple[list[tuple[Any, str | None]], Exception | None]:
        """The groups whose scoring ended, in the order they were submitted: ``(rollouts, problem)``, rewards set
        when ``problem`` is None; and the first bug, to raise after they are accounted for. ``wait``: until every open group is back; else waiting
        up to ``timeout`` for one (none when one is back already)."""
        while True:
            with self.lock:
                keys, ready = list(self._open), bool(self._ready)
            if not keys:
                break
            if wait:  # in the order they were submitted: a stepped run commits alike with any workers
                self.runner.wait_for(keys)
                self._take(keys)
                continue
            if not self.runner.ready(0.0 if ready else timeout):
                break
            self._take()  # in the order they ended
            timeout = 0.0
        with self.lock:
            out, self._ready = sorted(self._ready, key=lambda done: self._order[done[0].group_id]), []
            for group, _ in out:
                del self._order[group.group_id]
            bug, self._bug = self._bug, None
        return out, bug

    def _take(self, keys: list | None = None) -> None:
        """Take the runner's outcomes (of ``keys``; None: all) and act on them, under the lock: an outcome is
        never out of the runner and not yet in this bookkeeping, which another thread could wait for forever."""
        again = []
        with self.lock:
            for outcome in self.runner.take(keys):
                done, error, retry = self._ended(outcome)
                if done is not None:
                    self._ready.append(done)
                if retry is not None:
                    again.append(retry)
                self._bug = self._bug or error
        for gid, batch in again:  # outside the lock: inline, this runs the functions
            self.runner.submit(gid, batch)

    def _ended(self, outcome: Scored):
        """``(ended, bug, retry)`` for one outcome: the group done (scored or given up), the bug to raise, or the
        ``(gid, batch)`` to score again. Under the lock."""
        gid = outcome.key
        if gid not in self._open:
            return None, None, None  # cancelled
        group, prompt, attempt = self._open[gid]
        self.metrics.scored(outcome)
        if outcome.bug is not None:
            del self._open[gid]
            self.fault(gid, outcome.bug, BUG_REASON)
            return (group, f"the reward is broken: {outcome.bug}"), RewardTypeError(outcome.bug), None
        if outcome.problem is None:
            del self._open[gid]
            group.rewards = outcome.rewards
            self._parts[gid] = outcome.parts
            return (group, None), None, None
        budget = self.retries
        if attempt < budget:
            self.fault(gid, outcome.problem, retry_reason(attempt, budget))
            self._open[gid] = (group, prompt, attempt + 1)
            return None, None, (gid, group_batch(prompt, group.texts, group.completion_ids))
        del self._open[gid]
        self.fault(gid, outcome.problem, spent_reason(budget))
        return (group, f"the reward failed {budget + 1} time(s), last: {outcome.problem}"), None, None

    def committed(self, group_id: int, prompt: Any, weight_version: int, group: Any) -> None:
        """A scored group is in the buffer: it carries its functions' values (``reward_parts``), its completions go
        to the log at the next ``flush`` (the pump commits under the run state's lock, and writes the file outside
        it)."""
        with self.lock:
            parts = self._parts.pop(group_id, None)  # a group its backend scored keeps the parts it came with
            group.reward_parts = parts = parts if parts is not None else group.reward_parts
            if group.texts is not None and self.log.wants(weight_version):
                self._rows += group_rows(group_id, prompt, weight_version, group, parts)

    def flush(self) -> None:
        """Log the completions of the groups committed since the last call (in commit order)."""
        with self.lock:
            rows, self._rows = self._rows, []
        self.log.add(rows)

    def take_metrics(self) -> dict[str, float]:
        with self.lock:
            return self.metrics.take()

    def scoring(self, group_id: int) -> bool:
        """Submitted and not yet committed or given up: in flight, but not in the generator."""
        with self.lock:
            return group_id in self._open or any(g.group_id == group_id for g, _ in self._ready)

    @property
    def open(self) -> int:
        with self.lock:
            return len(self._open) + len(self._ready)

    def cancel(self, group_id: int) -> bool:
        """Forget a group (aborted, or gone while it was scored); True when it was being scored."""
        with self.lock:
            self._parts.pop(group_id, None)
            self._order.pop(group_id, None)
            ready = len(self._ready)
            self._ready = [(g, p) for g, p in self._ready if g.group_id != group_id]
            if self._open.pop(group_id, None) is None:
                return len(self._ready) != ready
        self.runner.cancel(group_id)
        return True

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the reward metrics counted towards the next step (not their time) and the
        completions logged so far."""
        with self.lock:
            metrics = {k: v for k, v in self.metrics.totals.items() if k != REWARD_TIME_S}
            rows = self.log.state_dict()
        return {**({"metrics": metrics} if metrics else {}), **({"completions": rows} if rows["rows"] else {})}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        with self.lock:
            self.metrics.totals = dict(state.get("metrics", {}))
            self.log.load_state_dict(state.get("completions"))

    def evaluation_runner(self) -> RewardRunner:
        """The runner evaluations score with: ``evaluation_functions`` of this scorer's, in workers of its own
        with the same settings (``reward.workers``, ``timeout_s``, placement), so an evaluation never waits behind
        training groups nor takes their outcomes. Built at the first evaluation, closed with this scorer. Reward
        functions of the user's (not a toy task's own reward) get at least one worker even when training scores
        inline (``reward.workers: 0``): an evaluation runs at the start and the end of a CLI run, where a function
        that calls ``os._exit`` or never returns must be a fault, not the end of the controller or a hang."""
        with self.lock:
            if self._evaluation is None:
                workers, timeout_s, placement, ray_options = self._settings
                if not self.functions.is_task:
                    workers = max(workers, 1)
                self._evaluation = RewardRunner(evaluation_functions(self.functions), workers, timeout_s,
                                                placement=placement, ray_options=ray_options)
            return self._evaluation

    def close(self) -> None:
        self.runner.close()
        if self._evaluation is not None:
            self._evaluation.close()
        self.log.close()


# ------------------------------------------------------------------------------------------------- evaluation
class TaskCorrect(TaskReward):
    """A task's own ``is_correct(prompt, completion_text)`` as a function over a group (1.0 correct, else 0.0):
    an evaluation asks it beside the task's reward, in the same runner, so the task's code runs guarded too."""

    def __init__(self, task: Any):
        super().__init__(task)
        self.__name__ = "is_correct"

    def score(self, batch: RewardBatch) -> list:
        return [float(self.task.is_correct(batch.source, text)) for text in batch.completions]


def evaluation_functions(functions: RewardFunctions) -> RewardFunctions:
    """What an evaluation scores with: the run's functions; a task's own reward with its ``is_correct`` beside it
    (weight 0: the total stays the task's reward, bit for bit)."""
    if not functions.is_task:
        return functions
    return RewardFunctions([functions.funcs[0], TaskCorrect(functions.funcs[0].task)], [1.0, 0.0])


# An evaluation's calls that killed their worker or ran past timeout_s, none succeeding, before it leaves out the
# rest: each such call costs a worker's restart or timeout_s, so a function that does it on every prompt would hold
# an evaluation (and the train thread, with eval_every) for minutes. A function that merely raises is retried as usual.
EVAL_GIVE_UP = 3


def fatal(problem: str | None) -> bool:
    """Whether a scoring problem cost a worker or a whole timeout (the runner's and the pool's wording)."""
    return problem is not None and (" died (" in problem or "past reward.timeout_s" in problem)
_EVALUATED = itertools.count()  # runner keys of evaluations' prompts: unique while two evaluations overlap


def score_now(runner: RewardRunner, batches: Sequence[RewardBatch], retries: int,
              fault: Callable[[int, str, str], None]) -> tuple[list[Scored | None], Exception | None]:
    """Score ``batches`` (an evaluation's prompts) through ``runner`` and wait for them: each one's ``Scored``, or
    None where its scoring failed ``retries + 1`` times. Every failed attempt is ``fault(index, error, reason)``,
    worded as the pump's; a bug (wrong length, non-number) is a fault and the ``RewardTypeError`` returned, to
    raise once the rest are scored. Bounded as the runner is (``timeout_s``, a dead worker replaced), and as a whole:
    after ``EVAL_GIVE_UP`` calls that killed their worker or timed out, none succeeding, the rest are left out."""
    keys = [("evaluation", next(_EVALUATED), i) for i in range(len(batches))]
    out: list[Scored | None] = [None] * len(batches)
    bug: Exception | None = None
    todo, attempt, failed_first, gave_up = list(range(len(batches))), 0, 0, False
    while todo:
        runner.submit_all([(keys[i], batches[i]) for i in todo])
        waiting, failed = {keys[i]: i for i in todo}, []
        while waiting:
            runner.ready(1.0)
            for scored in runner.take([k for k in waiting]):
                i = waiting.pop(scored.key)
                if scored.bug is not None:
                    fault(i, scored.bug, BUG_REASON)
                    bug = bug or RewardTypeError(scored.bug)
                elif scored.problem is None:
                    out[i] = scored
                elif attempt < retries:
                    fault(i, scored.problem, retry_reason(attempt, retries))
                    failed.append(i)
                else:
                    fault(i, scored.problem, spent_reason(retries) + "; the prompt is left out of the evaluation")
                if fatal(scored.problem) and not any(o is not None for o in out):
                    failed_first += 1
            if attempt == 0 and failed_first >= EVAL_GIVE_UP and waiting:  # every call so far died or timed out
                why = (f"evaluation given up: the first {failed_first} scorings killed their worker or ran past "
                       "reward.timeout_s and none succeeded")
                for key, i in waiting.items():
                    runner.cancel(key)
                    fault(i, why, "not retried; the prompt is left out of the evaluation")
                for i in failed:  # due a retry: left out with the rest
                    fault(i, why, "not retried; the prompt is left out of the evaluation")
                waiting, failed, gave_up = {}, [], True
        todo, attempt = ([] if gave_up else failed), attempt + 1
    return out, bug
