"""What a replay reads of a recorded run: its config, its schedule, every committed group's completion lengths and
rewards by prompt and weight version, and its step timings. Typed data only: nothing here reads the wording of a
trace reason or detail (the one text used is a dispatch row's ``detail``, which *is* the prompt, and only to check
that the prompt stream still serves the prompts the run saw).

Where each number comes from:
- **Groups**: the trace's typed columns. ``dispatch`` rows give a group's data position (the k-th dispatch row took
  the k-th prompt of the stream), its ``dispatch_index`` (batch) and stamps; ``commit`` rows the weights it was
  generated with (``gen_start_version``, ``gen_end_version``) and the step in progress (``trainer_version``).
- **Completions**: one row per completion, ``group_id``, ``tokens`` (its length) and ``reward`` (with
  ``completion_index``, ``prompt_id``): the recording's ``completions`` table (a live controller's) or
  ``completions.jsonl`` in the run directory. A run without them (written before completions were logged) still
  replays, on each step's means: ``gen_len_mean`` and ``gen_reward_mean`` of ``metrics.csv`` for every completion
  committed in that step (``source == "step means"``): the schedule of a gated sampler is exact either way, timings
  and skew are then approximate.
- **Timings**: ``metrics.csv`` (``asyncrl/replay/latency.py`` fits them).

Invariants: a ``RecordedGroup`` exists for every committed group of the recording and only for those (an aborted
or skipped group produced no completions); its ``lengths`` and ``rewards`` have one entry per completion, in
``completion_index`` order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from asyncrl.trace import COMMIT, DISPATCH, SELECT

COMPLETIONS_FILE = "completions.jsonl"
COMPLETION_COLUMNS = ("group_id", "tokens", "reward")  # what a replay needs of a completions row


@dataclass(frozen=True)
class RecordedGroup:
    """One committed group of the recording: ``position`` (its data position, the prompt stream's index),
    ``version`` (the weights its generation started with), ``batch`` (its dispatch index; None for a replacement),
    ``step`` (T when it committed), ``lengths`` and ``rewards`` (one per completion). A multi-turn run's also
    ``turns`` (model turns per trajectory) and ``env_tokens`` (observation tokens per trajectory); its ``lengths``
    are then the sampled tokens (what decoding took), observations left out."""

    group_id: int
    position: int
    prompt: str
    version: int
    batch: int | None
    step: int
    lengths: tuple[int, ...]
    rewards: tuple[float, ...]
    turns: tuple[int, ...] | None = None
    env_tokens: tuple[int, ...] | None = None

    def turn_lengths(self) -> list[list[int]]:
        """Each trajectory's sampled tokens split over its turns (the first turns take the remainder): the
        completions log counts a trajectory's tokens, not each turn's."""
        out = []
        for n, k in zip(self.lengths, self.turns or [1] * len(self.lengths)):
            k = max(1, min(k, n))
            out.append([n // k + (j < n % k) for j in range(k)])
        return out

    @property
    def multi_turn(self) -> bool:
        return self.turns is not None


@dataclass
class RecordedRun:
    """A recording as a replay reads it (``read``)."""

    cfg: Any
    trace: pd.DataFrame
    metrics: pd.DataFrame
    groups: list[RecordedGroup]
    source: str  # "completions" (per completion) or "step means" (metrics.csv only)

    @property
    def steps(self) -> int:
        return len(self.metrics)

    @property
    def schedule(self) -> pd.DataFrame:
        """Which groups were trained at which step: the ``select`` rows (``step``, ``group_id``, ``weight_version``,
        ``target_step``, ``lag``), in trace order."""
        return schedule(self.trace)


def schedule(trace: pd.DataFrame) -> pd.DataFrame:
    """The ``select`` rows of a trace as ``step`` (the trainer version it trained at), ``group_id``,
    ``weight_version``, ``target_step`` and ``lag``."""
    rows = trace[trace.event == SELECT]
    return pd.DataFrame({"step": rows.trainer_version.astype(int).to_numpy(),
                         "group_id": rows.group_id.astype(int).to_numpy(),
                         "weight_version": rows.weight_version.astype(int).to_numpy(),
                         "target_step": rows.target_step.to_numpy(), "lag": rows.lag.astype(int).to_numpy()})


def read(recording) -> RecordedRun:
    """What a replay needs of ``recording`` (an ``asyncrl.Recording`` of a run directory or of a live controller:
    its ``cfg``, ``trace``, ``metrics`` and ``source``)."""
    trace, metrics = recording.trace, recording.metrics
    if metrics.empty:
        raise ValueError(f"{recording!r} has no finished step: a replay needs at least one")
    completions = _completions(recording)
    dispatch = trace[trace.event == DISPATCH]
    positions = {int(g): k for k, g in enumerate(dispatch.group_id)}
    prompts = dict(zip(dispatch.group_id.astype(int), dispatch.detail))
    batches = {int(g): (None if pd.isna(b) else int(b)) for g, b in zip(dispatch.group_id, dispatch.dispatch_index)}
    commits = trace[trace.event == COMMIT]
    if completions is not None:
        per_group = {int(g): rows for g, rows in completions.groupby("group_id", sort=False)}
        source = "completions"
    else:
        per_group, source = {}, "step means"
        means = metrics.set_index("step")
    G = recording.cfg.group_size
    groups = []
    for gid, start, w, T in zip(commits.group_id.astype(int), commits.gen_start_version, commits.weight_version,
                                commits.trainer_version.astype(int)):
        version = int(w if pd.isna(start) else start)
        if source == "completions":
            rows = per_group.get(gid)
            if rows is None:  # committed but not logged (``log_completions`` keeps N a step): left to the draws
                continue
            rows = rows.sort_values("completion_index") if "completion_index" in rows else rows
            lengths, rewards = rows.tokens.astype(int).tolist(), rows.reward.astype(float).tolist()
            if "turns" in rows and rows.turns.notna().all():  # multi-turn: sampled tokens, turns, observations
                env = rows.env_tokens.fillna(0).astype(int).tolist() if "env_tokens" in rows else [0] * len(rows)
                lengths = [n - e for n, e in zip(lengths, env)]
                turns = (tuple(rows.turns.astype(int).tolist()), tuple(env))
            else:
                turns = (None, None)
        else:
            mean_len, mean_reward = _step_means(means, T)
            lengths, rewards = [mean_len] * G, [mean_reward] * G
            turns = (None, None)
        groups.append(RecordedGroup(gid, positions[gid], prompts[gid], version, batches[gid], T,
                                    tuple(max(1, n) for n in lengths), tuple(rewards), *turns))
    if not groups:
        raise ValueError(f"{recording!r} committed no group whose completions it holds: nothing to replay")
    return RecordedRun(recording.cfg, trace, metrics, groups, source)


def _completions(recording) -> pd.DataFrame | None:
    """The recording's per-completion rows, or None when it has none."""
    table = getattr(recording, "completions", None)
    if table is None:
        source = getattr(recording, "source", None)
        table = getattr(source, "completions", None)  # a live controller's
        if table is None and isinstance(source, (str, Path)) and (Path(source) / COMPLETIONS_FILE).is_file():
            path = Path(source) / COMPLETIONS_FILE
            table = pd.read_json(path, lines=True) if path.stat().st_size else pd.DataFrame()
    if table is None or len(table) == 0:
        return None
    missing = [c for c in COMPLETION_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"the recording's completions lack the columns {missing}; a replay needs "
                         f"{list(COMPLETION_COLUMNS)}")
    return table


def _step_means(means: pd.DataFrame, step: int) -> tuple[int, float]:
    """The mean completion length and reward of what was committed during ``step`` (the last step's for a group
    committed after it: the trace runs on past the last ``step`` row)."""
    row = means.loc[step] if step in means.index else means.iloc[-1]
    length, reward = float(row.get("gen_len_mean", math.nan)), float(row.get("gen_reward_mean", math.nan))
    if math.isnan(length):  # a step that committed nothing: the trained groups' means
        length, reward = float(row.get("train_len_mean", 1.0)), float(row.get("train_reward_mean", 0.0))
    return max(1, round(length)), (0.0 if math.isnan(reward) else reward)
