"""The replay's latency model, fitted from the recording's own step timings (``metrics.csv``), in the simulated
backends' knobs (``SimulatedGeneration``, ``SimulatedTraining``).

- A recording of a **simulated** run carries its latency model in its config: the replay uses it unchanged.
- Otherwise, as ``asyncrl.simulate.calibrate`` does for a synchronous run, but for any sampler: training is
  ``train_s_per_step + train_s_per_token x`` completion tokens (least squares over the steps; proportional when the
  token counts hardly vary), the sync its mean. Generation: a batch (one admission's groups) lasts
  ``decode_s_per_token x`` its longest recorded completion, so ``decode_s_per_token`` = the seconds a batch took
  / the mean longest completion of the recorded batches. The seconds a batch took: in a lockstep run (``in_order``
  with no lookahead) the step time less training and sync, per step (scoring and the controller's own time
  included); otherwise the generator's time (``gen_completions x gen_len_mean / gen_tokens_per_s`` per step:
  the rollout pump's time in ``poll``, or vLLM's own seconds stepping its engine) over the batches committed. A torch generator decodes each batch in one call, one
  after another (``admission: wave``, ``concurrency: groups_per_step``); a streaming engine starts each group at
  once (``streaming``, no slot limit).

Timings measured while generation and training overlapped already hold what they cost each other, so
``overlap_slowdown`` stays 1 unless given (``measure_overlap`` measures it; a lockstep recording replayed under an
asynchronous sampler on one machine needs it). The first ``skip`` steps are left out as warm-up when the
recording has enough steps.

A **multi-turn** recording (its completions have ``turns``) replays with a ``turns`` model: each group's recorded
turns are served, and the generation seconds are split between decoding and the environment's calls by least
squares (``_fit_turns``), the calls' seconds then drawn from a lognormal (``SIGMA``) with the fitted mean, on the
recording's ``environment.workers`` (replayed under an asynchronous sampler, its trajectories play free turns).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from asyncrl.config import SimulatedGeneration, SimulatedTraining
from asyncrl.replay.recorded import RecordedRun

SKIP = 3  # warm-up steps left out of a fit when at least 2 x SKIP steps are recorded
SIGMA = 0.5  # the spread of a replayed environment call (lognormal): the fit finds a mean only, and its
# features count a batch's calls, so a wide spread would add the expected maximum of noisier sums on top


def fit(run: RecordedRun, overlap_slowdown: float | None = None) -> tuple[dict[str, Any], dict[str, Any], dict]:
    """``(generation knobs, trainer knobs, fit)``: the simulated sections' knobs for the replay, and what the fit
    found (seconds per batch, the rates, which rule it used)."""
    cfg = run.cfg
    if cfg.generation.backend == "simulated" and cfg.trainer.backend == "simulated":
        generation = cfg.generation.model_dump(include=set(SimulatedGeneration.model_fields))
        training = cfg.trainer.model_dump(include=set(SimulatedTraining.model_fields))
        generation.update(clock="ticks", replicas=cfg.generation.replicas)
        training["clock"] = "ticks"
        if overlap_slowdown is not None:
            training["overlap_slowdown"] = overlap_slowdown
        return generation, training, {"rule": "the recording's own simulated latency model"}
    m = run.metrics.iloc[SKIP:] if len(run.metrics) >= 2 * SKIP else run.metrics
    N, G = cfg.groups_per_step, cfg.group_size
    per_step, per_token = _fit_training(m)
    sync_s = _mean(m, "sync_time_s")
    lockstep = cfg.sampler.model_dump() == {"name": "in_order", "max_lookahead_versions": 0}
    if lockstep:
        batch_s = float((m.step_time_s - m.train_time_s - m.sync_time_s).clip(lower=0).mean())
        rule = "lockstep: a batch is the step time less training and sync"
    else:
        rate = m.gen_tokens_per_s if "gen_tokens_per_s" in m else None
        tokens = m.gen_completions * m.gen_len_mean if {"gen_completions", "gen_len_mean"} <= set(m) else None
        ok = (rate > 0) & np.isfinite(rate) & tokens.notna() if rate is not None and tokens is not None else None
        if ok is None or not ok.any():
            raise ValueError("the recording's metrics lack the generation timings a replay fits "
                             "(gen_tokens_per_s, gen_completions, gen_len_mean)")
        poll_s = float((tokens[ok] / rate[ok]).sum())
        batches = float(m.gen_completions[ok].sum()) / (N * G)
        batch_s, rule = poll_s / batches if batches else 0.0, "the generator's seconds (gen_tokens_per_s), per batch"
    longest = _mean_longest(run)
    decode_s, turns, extra = batch_s / longest, None, {}
    if any(g.multi_turn for g in run.groups):
        decode_s, turns, split, call_s = _fit_turns(run, m, lockstep, batch_s / longest)
        rule += f"; multi-turn: {split}"
        extra = {"env_call_s": call_s}
    generation = {"prefill_s": 0.0, "decode_s_per_token": decode_s, "clock": "ticks", "turns": turns,
                  "replicas": cfg.generation.replicas,
                  "weight_update": getattr(cfg.generation, "weight_update", "drain")}
    if cfg.generation.backend == "torch":
        generation.update(admission="wave", concurrency=N)
    else:
        generation.update(admission="streaming", concurrency=None)
    training = {"train_s_per_token": per_token, "train_s_per_step": per_step, "sync_s": sync_s, "clock": "ticks",
                "overlap_slowdown": 1.0 if overlap_slowdown is None else overlap_slowdown}
    return generation, training, {"rule": rule, "batch_s": batch_s, "longest_mean": longest,
                                  "steps_fitted": len(m), **extra}


def _fit_turns(run: RecordedRun, m, lockstep: bool, decode_s: float) -> tuple[float, dict, str, float]:
    """A multi-turn recording: ``(decode_s_per_token, turns knobs, what the fit did, mean seconds a call)``. The simulated
    generator plays a group's turns one after another, each a decode of its longest turn and then the environment
    answering its trajectories in turn, so a batch of groups lasts about ``decode_s_per_token x D + call_s x E``
    (``D``: the most tokens, turn by turn, of its groups; ``E``: the most environment calls of its groups). Least
    squares over the steps (the generation seconds of each, as ``fit`` reads them) gives both; the environment's
    seconds per call are taken as the mean of a lognormal of spread ``SIGMA`` for the median ``env_latency_s``. When
    the two do not separate (too few steps, or a negative coefficient), every second stays the decoder's, as for a
    single-turn run."""
    cfg = run.cfg
    by_step: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for g in run.groups:
        if g.batch is not None and g.multi_turn:
            split = g.turn_lengths()
            d = sum(max((x[j] for x in split if len(x) > j), default=0) for j in range(max(map(len, split))))
            by_step[g.step][g.batch].append((d, sum(g.turns)))
    steps = [int(s) for s in m.step if int(s) in by_step]
    x = np.array([[sum(max(d for d, _ in b) for b in by_step[s].values()),
                   sum(max(e for _, e in b) for b in by_step[s].values())] for s in steps], dtype=float)
    rows = m.set_index("step").loc[steps]
    if lockstep:
        y = (rows.step_time_s - rows.train_time_s - rows.sync_time_s).clip(lower=0).to_numpy(float)
    else:
        y = (rows.gen_completions * rows.gen_len_mean / rows.gen_tokens_per_s).fillna(0).to_numpy(float)
    max_turns = getattr(getattr(cfg, "environment", None), "max_turns", None) or max(max(g.turns or (1,)) for g in run.groups)
    workers = getattr(getattr(cfg, "environment", None), "workers", 0) or 0  # its calls' workers: free turns
    turns = {"max_turns": int(max_turns), "env_latency_s": 0.0, "env_latency_sigma": SIGMA, "workers": int(workers)}
    if len(steps) >= 3:
        (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
        if a > 0 and b > 0:
            turns["env_latency_s"] = float(b) / math.exp(SIGMA ** 2 / 2)  # the median of that mean
            return float(a), turns, (f"decode {a * 1e3:.3g} ms a token, environment {b * 1e3:.3g} ms a call "
                                     f"(mean) over {len(steps)} steps"), float(b)
    return decode_s, turns, "the environment's seconds not separable from decoding: all the decoder's", 0.0


def _fit_training(m) -> tuple[float, float]:
    """``(train_s_per_step, train_s_per_token)`` from the steps' training seconds and completion tokens."""
    tokens, train = m.completion_tokens.to_numpy(float), m.train_time_s.to_numpy(float)
    if not len(tokens) or tokens.mean() <= 0:
        return float(train.mean()) if len(train) else 0.0, 0.0
    per_step, per_token = 0.0, float(train.mean() / tokens.mean())
    if tokens.std() > 0.02 * tokens.mean() and len(tokens) >= 3:
        slope, intercept = np.polyfit(tokens, train, 1)
        if slope >= 0 and intercept >= 0:
            per_step, per_token = float(intercept), float(slope)
    return per_step, per_token


def _mean(m, column: str) -> float:
    value = float(m[column].mean()) if column in m else 0.0
    return 0.0 if math.isnan(value) else value


def _mean_longest(run: RecordedRun) -> float:
    """The mean over the recorded batches of their longest completion (replacements, which belong to no batch,
    left out)."""
    longest: dict[int, int] = defaultdict(int)
    for group in run.groups:
        if group.batch is not None:
            longest[group.batch] = max(longest[group.batch], max(group.lengths))
    return sum(longest.values()) / len(longest) if longest else 1.0
