"""Seeded fault injection around the real backends and task, shared by tests/test_faults.py and
docs/make_reliability.py (which runs every scenario and writes docs/reliability.md).

- ``FlakyGenerator`` wraps a generation backend: ``submit``/``poll`` errors, a poll that loses the groups it was
  generating, stragglers held back for some polls, or a backend that fails on every call while ``broken``.
- ``FlakyTask`` wraps a task: rewards that raise, NaN rewards, or non-numbers.
- ``check_accounting(ctrl)``: every dispatched group has exactly one end (select, evict, abort, skip) or is still
  live (buffered or in flight), permits are held only by live groups, and every fault event is explained.
- ``SCENARIOS`` and ``run_scenario``: what the tests assert and the reliability table reports.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from asyncrl import Controller, load_config
from asyncrl.backends import build_backends
from asyncrl.tasks import build_task

ENDS = ("select", "evict", "abort", "skip")


class InjectedError(RuntimeError):
    """What the harness raises (so a test can tell an injected fault from a real bug)."""


class FlakyGenerator:
    """A generation backend with seeded faults. Rates are per call (``poll``/``submit``) or per group."""

    def __init__(self, inner: Any, seed: int = 0, poll_error: float = 0.0, submit_error: float = 0.0,
                 lose: float = 0.0, straggle: float = 0.0, straggle_polls: int = 3) -> None:
        self.inner, self.rng = inner, random.Random(seed)
        self.poll_error, self.submit_error, self.lose = poll_error, submit_error, lose
        self.straggle, self.straggle_polls = straggle, straggle_polls
        self.broken = False  # every call fails while set
        self.held: list[list] = []  # [polls left, group] for stragglers
        self.injected: Counter = Counter()
        self.lock = threading.Lock()  # the run pumps poll and abort from two threads

    def _maybe_fail(self, kind: str, rate: float) -> None:
        if self.broken or (rate and self.rng.random() < rate):
            self.injected[kind] += 1
            raise InjectedError(f"injected {kind} failure")

    @property
    def version(self) -> int:
        if self.broken:
            raise InjectedError("injected version failure")
        return self.inner.version

    def submit(self, requests) -> None:
        self._maybe_fail("submit", self.submit_error)
        self.inner.submit(requests)

    def poll(self, timeout: float | None = 0.0):
        with self.lock:
            self._maybe_fail("poll", self.poll_error)
        fresh = self.inner.poll(timeout)
        with self.lock:
            return self._after_poll(fresh)

    def _after_poll(self, fresh):
        if fresh and self.lose and self.rng.random() < self.lose:
            self.injected["lost"] += len(fresh)
            raise InjectedError(f"injected poll failure that lost {len(fresh)} group(s)")
        for entry in self.held:
            entry[0] -= 1
        out = [g for n, g in self.held if n <= 0]
        self.held = [e for e in self.held if e[0] > 0]
        for group in fresh:
            if self.straggle and self.rng.random() < self.straggle:
                self.injected["straggler"] += 1
                self.held.append([self.straggle_polls, group])
            else:
                out.append(group)
        return out

    def abort(self, group_ids):
        with self.lock:
            return self._abort(group_ids)

    def _abort(self, group_ids):
        wanted = set(group_ids)
        held = [g.group_id for _, g in self.held if g.group_id in wanted]
        self.held = [e for e in self.held if e[1].group_id not in wanted]
        return list(self.inner.abort(group_ids)) + held

    def num_inflight(self) -> int:
        return self.inner.num_inflight() + len(self.held)

    def __getattr__(self, name: str):  # load_weights, generate_greedy, state_dict, close, ...
        return getattr(self.inner, name)


class FlakyTask:
    """A task whose reward raises, returns NaN or returns a non-number, each at a seeded rate per call."""

    def __init__(self, inner: Any, seed: int = 0, raise_rate: float = 0.0, nan_rate: float = 0.0,
                 non_number: bool = False) -> None:
        self.inner, self.rng = inner, random.Random(seed)
        self.raise_rate, self.nan_rate, self.non_number = raise_rate, nan_rate, non_number
        self.injected: Counter = Counter()

    def reward(self, prompt, text):
        if self.non_number:
            return "yes"
        if self.raise_rate and self.rng.random() < self.raise_rate:
            self.injected["reward raised"] += 1
            raise InjectedError("injected reward failure")
        if self.nan_rate and self.rng.random() < self.nan_rate:
            self.injected["reward NaN"] += 1
            return float("nan")
        return self.inner.reward(prompt, text)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def small_config(**overrides: Any):
    """The quickstart model and task at a size that keeps a scenario to seconds on a busy CPU."""
    base = dict(groups_per_step=4, group_size=4, eval_every=None, torch_threads=1,
                faults={"backoff_s": 0.001, "max_backoff_s": 0.01})
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            value = {**base[key], **value}
        base[key] = value
    return load_config("quickstart", **base)


def flaky_controller(cfg, generator_faults: dict | None = None, task_faults: dict | None = None) -> Controller:
    """A controller on the real backends of ``cfg`` with the generator and the task wrapped."""
    import torch

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    policy, generator, tokenizer = build_backends(cfg)
    task = build_task(cfg.task)
    if task_faults:
        task = FlakyTask(task, seed=cfg.seed, **task_faults)
    if generator_faults:
        generator = FlakyGenerator(generator, seed=cfg.seed, **generator_faults)
    return Controller(cfg, task, policy, generator, tokenizer)


def check_accounting(ctrl: Controller) -> Counter:
    """Exactly one end per dispatched group unless it is live; permits held by live groups only; every fault
    event says whether it is retried. Returns the count of each end."""
    trace = ctrl.trace
    dispatched = trace.loc[trace.event == "dispatch", "group_id"].astype(int).tolist()
    assert len(dispatched) == len(set(dispatched)), "a group id was dispatched twice"
    ends = trace[trace.event.isin(ENDS)]
    count = Counter(ends.group_id.astype(int).tolist())
    for gid in dispatched:
        alive = int(gid in ctrl.buffer or gid in ctrl.inflight)
        assert count[gid] + alive == 1, f"group {gid}: {count[gid]} end events, alive={alive}"
    assert set(count) <= set(dispatched)
    # permits: buffer slots are exactly the live groups, and the in-flight ones are exactly the pending slots
    assert set(ctrl.inflight) == {s.group_id for s in ctrl.buffer.pending_slots()}
    assert len(ctrl.buffer) == sum(1 for gid in dispatched if count[gid] == 0)
    faults = trace[trace.event == "fault"]
    assert faults.reason.str.match(r"^(not )?retried: ").all(), faults.reason.tolist()
    assert (faults.detail.str.len() > 0).all()
    skips = trace[trace.event == "skip"]
    assert (skips.reason.str.len() > 0).all()
    return Counter(ends.event)


def kill_actor(backend: Any) -> None:
    """Kill a backend's Ray actor the way a crash would (no cleanup)."""
    import ray

    ray.kill(backend._actor, no_restart=True)


def heal(ctrl: Controller) -> None:
    """Switch every injected fault off."""
    if isinstance(ctrl.generator, FlakyGenerator):
        ctrl.generator.broken = False
        ctrl.generator.poll_error = ctrl.generator.submit_error = ctrl.generator.lose = 0.0
    if isinstance(ctrl.task, FlakyTask):
        ctrl.task.raise_rate = ctrl.task.nan_rate = 0.0
        ctrl.task.non_number = False


def drain(ctrl: Controller, max_ticks: int = 200) -> None:
    """Stop dispatching and collect every group still in flight (so all permits but the buffered are back)."""
    ctrl.exhausted = True
    for _ in range(max_ticks):
        if not ctrl.inflight:
            return
        ctrl.rollout_tick()
    raise AssertionError(f"{len(ctrl.inflight)} group(s) still in flight after {max_ticks} ticks")


@dataclass
class Scenario:
    what: str  # the fault, in words
    expect: str  # what should happen, in words
    overrides: dict = field(default_factory=dict)
    generator: dict = field(default_factory=dict)
    task: dict = field(default_factory=dict)
    steps: int = 6
    error: str | None = None  # the error type the run must stop with, if any
    kill: str | None = None  # "generator" or "trainer": kill that Ray actor once step 2 is done (stepped)


SCENARIOS: dict[str, Scenario] = {
    "reward_raises": Scenario(
        "reward raises on 10% of calls", "re-scored; a group that fails 3 times is skipped and replaced",
        task={"raise_rate": 0.1}),
    "reward_nan": Scenario(
        "reward returns NaN on 5% of calls, no re-scoring (reward_retries 0)",
        "each NaN group skipped and replaced from the next prompt; every step complete",
        overrides={"faults": {"reward_retries": 0}}, task={"nan_rate": 0.05}),
    "poll_errors": Scenario(
        "generator poll raises on 40% of calls", "retried with backoff; nothing lost", generator={"poll_error": 0.4}),
    "submit_errors": Scenario(
        "generator submit raises on 40% of calls", "requests kept and re-submitted", generator={"submit_error": 0.4}),
    "lost_groups": Scenario(
        "a poll fails after generating, losing its groups (30% of polls)",
        "lost groups re-dispatched (new attempt, same prompt and slot)", generator={"lose": 0.3}),
    "lost_no_retry": Scenario(
        "as above, with max_dispatch_attempts 1", "lost groups skipped and replaced (same target step)",
        overrides={"faults": {"max_dispatch_attempts": 1}}, generator={"lose": 0.3}),
    "stragglers": Scenario(
        "30% of groups come back 3 polls late", "run goes on; stragglers trained or evicted when they arrive",
        overrides={"sampler": {"name": "windowed", "max_staleness_versions": 2}}, generator={"straggle": 0.3}),
    "budget_spent": Scenario(
        "generator fails on every call", "GenerationFailed naming the backend, the budget and the last error",
        overrides={"faults": {"generation_retries": 3}}, generator={"poll_error": 1.0}, error="GenerationFailed"),
    "data_runs_out": Scenario(
        "in_order step loses groups (NaN rewards) when no prompt is left",
        "StepShortfall naming the step and the shortfall",
        overrides={"max_epochs": 1, "task": {"name": "copy_digit"},
                   "faults": {"reward_retries": 0}},
        task={"nan_rate": 0.3}, steps=10, error="StepShortfall"),
    "generator_actor_killed": Scenario(
        "the generator's Ray actor is killed after step 2",
        "restarted with the trainer's weights; its groups re-dispatched; the run completes",
        overrides={"generation": {"placement": "ray"}}, kill="generator"),
    "trainer_actor_killed": Scenario(
        "the trainer's Ray actor is killed after step 2",
        "TrainerFailed: the run stops and points at the last checkpoint",
        overrides={"trainer": {"placement": "ray"}}, kill="trainer", error="TrainerFailed"),
    "reward_not_a_number": Scenario(
        "reward returns a string", "TypeError naming the value; the group is skipped first",
        task={"non_number": True}, error="RewardTypeError"),
}


def run_scenario(name: str, mode: str = "stepped", seed: int = 0) -> dict[str, Any]:
    """Run one scenario (``stepped``: ``tick()`` until the steps are done; ``run``: ``Controller.run``) and
    check the accounting. Returns what happened (for the tests and the table)."""
    sc = SCENARIOS[name]
    cfg = small_config(seed=seed, **sc.overrides)
    ctrl = flaky_controller(cfg, sc.generator, sc.task)
    error, killed = None, False
    try:
        if mode == "run":
            ctrl.run(sc.steps, progress=False)
        else:
            for _ in range(50 * sc.steps):
                if ctrl.trainer_version >= sc.steps:
                    break
                if sc.kill and ctrl.trainer_version == 2 and not killed:
                    kill_actor(getattr(ctrl, "generator" if sc.kill == "generator" else "policy"))
                    killed = True
                ctrl.tick()
    except Exception as exc:  # the scenario says which error is expected
        error = exc
    heal(ctrl)
    if sc.kill != "trainer":
        drain(ctrl)
    ends = check_accounting(ctrl)
    trace = ctrl.trace
    injected = Counter()
    for part in (ctrl.generator, ctrl.task):
        if isinstance(part, (FlakyGenerator, FlakyTask)):
            injected.update(part.injected)
    return {
        "ctrl": ctrl,
        "steps": ctrl.trainer_version,
        "injected": dict(injected),
        "faults": int((trace.event == "fault").sum()),
        "retried": int(trace.reason[trace.event == "fault"].str.startswith("retried").sum()),
        "ends": dict(ends),
        "error": error,
        "live": len(ctrl.buffer),
        "inflight": len(ctrl.inflight),
    }


def close(result: dict) -> None:
    """Free a scenario's backends (its Ray actors)."""
    ctrl = result["ctrl"]
    for backend in (ctrl.generator, ctrl.policy):
        try:
            backend.close()
        except Exception:  # a killed actor cannot close
            pass
