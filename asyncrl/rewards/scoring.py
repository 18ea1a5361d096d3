"""How the rollout pump scores: ``GroupScorer`` (its collaborator: submit a finished group, collect scored ones,
retries within ``faults.reward_retries``), the run's functions, a group's inputs and the per-step metrics.

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
- ``reward/<name>`` is the mean of a function's values over the completions it applied to, in the groups committed
  since the last step (as ``gen_reward_mean``); ``reward_time_s`` the seconds the functions took on every group
  scored since the last step, failed attempts included (the work, not the time a group queued for a worker).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.completions import CompletionsLog, group_rows
from asyncrl.faults import RewardTypeError, reward_problem
from asyncrl.rewards.functions import RewardBatch, RewardFunctions, TaskReward, function_name
from asyncrl.rewards.runner import RewardRunner, Scored

REWARD_TIME_S = "reward_time_s"


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
    """The per-step ``reward/<name>`` means and ``reward_time_s`` (see the module's invariants)."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {}

    def scored(self, outcome: Scored) -> None:
        """Any scoring that ended (its time counts, whatever the outcome)."""
        self.totals[REWARD_TIME_S] = self.totals.get(REWARD_TIME_S, 0.0) + outcome.seconds

    def committed(self, parts: dict[str, list] | None) -> None:
        """A group committed with these per-function values."""
        for name, values in (parts or {}).items():
            applied = [v for v in values if v is not None]
            self.totals[f"sum/{name}"] = self.totals.get(f"sum/{name}", 0.0) + sum(applied)
            self.totals[f"n/{name}"] = self.totals.get(f"n/{name}", 0.0) + len(applied)

    def result(self) -> dict[str, float]:
        out = {REWARD_TIME_S: self.totals.get(REWARD_TIME_S, 0.0)}
        for name in self.names:
            n = self.totals.get(f"n/{name}", 0.0)
            out[f"reward/{name}"] = self.totals.get(f"sum/{name}", 0.0) / n if n else math.nan
        return out

    def take(self) -> dict[str, float]:
        out = self.result()
        self.reset()
        return out


class GroupScorer:
    """The rollout pump's scoring (see the module's invariants). ``decode`` turns completion ids into texts,
    ``fault(gid, error, reason)`` records a fault row; ``notify`` is called (from another thread) when a score
    comes back, so a waiting pump looks again."""

    def __init__(self, functions: RewardFunctions, workers: int, timeout_s: float | None, retries: int,
                 decode: Callable[[list[list[int]]], list[str]], fault: Callable[[int, str, str], None],
                 log: CompletionsLog | None = None, notify: Callable[[], None] | None = None):
        self.functions, self.retries, self.decode, self.fault = functions, retries, decode, fault
        self.runner = RewardRunner(functions, workers, timeout_s, on_done=notify if workers else None)
        self.metrics = RewardMetrics(functions.names)  # a task's own reward: reward/<task name>
        self.log = log if log is not None else CompletionsLog("all", functions.names)
        self._open: dict[int, tuple[Any, Any, int]] = {}  # group id -> (rollouts, prompt, attempt)
        self._parts: dict[int, dict[str, list] | None] = {}  # scored, until committed
        self._ready: list[tuple[Any, str | None]] = []  # scoring ended, until collected
        self._bug: Exception | None = None  # the first bug since the last collect

    def submit(self, group: Any, prompt: Any) -> None:
        """Start scoring a finished group (unless its backend scored it: then it only is checked)."""
        gid = group.group_id
        if group.rewards is not None:  # the backend scored it (simulated): nothing to re-score
            problem = next(filter(None, map(reward_problem, group.rewards)), None)
            if problem is not None:
                self.fault(gid, problem, "not retried: the generation backend scored this group")
            self._ready.append((group, problem))
            return
        group.texts = self.decode(group.completion_ids)
        self._open[gid] = (group, prompt, 0)
        self.runner.submit(gid, group_batch(prompt, group.texts, group.completion_ids))
        while self.runner.workers == 0 and gid in self._open:  # inline: scored, and re-scored, right here
            self._take(self.runner.wait([gid]))

    def collect(self, wait: bool = False, timeout: float = 0.0) -> tuple[list[tuple[Any, str | None]], Exception | None]:
        """The groups whose scoring ended: ``(rollouts, problem)``, rewards set when ``problem`` is None; and the
        first bug, to raise after they are accounted for. ``wait``: until every open group is back; else waiting
        up to ``timeout`` for one (none when one is back already)."""
        while self._open:
            if wait:
                self._take(self.runner.wait(list(self._open)))
                continue
            outcomes = self.runner.poll(0.0 if self._ready else timeout)
            if not outcomes:
                break
            self._take(outcomes)
            timeout = 0.0
        out, self._ready = self._ready, []
        bug, self._bug = self._bug, None
        return out, bug

    def _take(self, outcomes: list[Scored]) -> None:
        for outcome in outcomes:
            done, error = self._ended(outcome)
            if done is not None:
                self._ready.append(done)
            self._bug = self._bug or error

    def _ended(self, outcome: Scored) -> tuple[tuple[Any, str | None] | None, Exception | None]:
        gid = outcome.key
        if gid not in self._open:
            return None, None  # cancelled
        group, prompt, attempt = self._open[gid]
        self.metrics.scored(outcome)
        if outcome.bug is not None:
            del self._open[gid]
            self.fault(gid, outcome.bug, "not retried: a bug in the reward; the run stops")
            return (group, f"the reward is broken: {outcome.bug}"), RewardTypeError(outcome.bug)
        if outcome.problem is None:
            del self._open[gid]
            group.rewards = outcome.rewards
            self._parts[gid] = outcome.parts
            return (group, None), None
        budget = self.retries
        if attempt < budget:
            self.fault(gid, outcome.problem, f"retried: scoring again ({attempt + 1} of {budget} re-scorings)")
            self._open[gid] = (group, prompt, attempt + 1)
            self.runner.submit(gid, group_batch(prompt, group.texts, group.completion_ids))
            return None, None
        del self._open[gid]
        self.fault(gid, outcome.problem, f"not retried: faults.reward_retries={budget} re-scorings spent")
        return (group, f"the reward failed {budget + 1} time(s), last: {outcome.problem}"), None

    def committed(self, group_id: int, prompt: Any, weight_version: int, group: Any) -> None:
        """A scored group is in the buffer: its metrics count, its completions are logged."""
        parts = self._parts.pop(group_id, None)
        self.metrics.committed(parts)
        if group.texts is not None and self.log.wants(weight_version):
            self.log.add(group_rows(group_id, prompt, weight_version, group, parts))

    def scoring(self, group_id: int) -> bool:
        """Submitted and not yet collected: in flight, but not in the generator."""
        return group_id in self._open or any(g.group_id == group_id for g, _ in self._ready)

    @property
    def open(self) -> int:
        return len(self._open) + len(self._ready)

    def cancel(self, group_id: int) -> bool:
        """Forget a group (aborted, or gone while it was scored); True when it was being scored."""
        self._parts.pop(group_id, None)
        ready = len(self._ready)
        self._ready = [(g, p) for g, p in self._ready if g.group_id != group_id]
        if self._open.pop(group_id, None) is not None:
            self.runner.cancel(group_id)
            return True
        return len(self._ready) != ready

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the reward metrics counted towards the next step (not their time) and the
        completions logged so far."""
        metrics = {k: v for k, v in self.metrics.totals.items() if k != REWARD_TIME_S}
        rows = self.log.state_dict()
        return {**({"metrics": metrics} if metrics else {}), **({"completions": rows} if rows["rows"] else {})}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.metrics.totals = dict(state.get("metrics", {}))
        self.log.load_state_dict(state.get("completions"))

    def close(self) -> None:
        self.runner.close()
        self.log.close()
