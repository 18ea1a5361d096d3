"""A recorded run replayed under a sampler: the real controller, buffer and sampler on the simulated clock
(``asyncrl.simulate.Simulation``), whose generator serves each dispatched prompt the completions the recording holds
for it (``RecordedGenerator``), with latencies fitted from the recording's own step timings (``latency.fit``).

    replayed = asyncrl.Recording("runs/q").replay(sampler={"name": "windowed", "max_staleness_versions": 2})
    replayed.metrics; replayed.trace; replayed.explain(); replayed.at(10).explain(); replayed.schedule

A replay predicts **schedules and data, not learning**: what the sampler admits, trains, keeps and drops, with which
staleness, how fast, and the lengths and rewards of what it trains. The rewards are the recorded policy's (the
weights never change here), so a replay says nothing about how well another sampler would learn.

Invariants:
- The replay's config is the recording's (task, seed, batch and group sizes, chunking, limits, max_new_tokens), with
  the simulated backends in place of the engines and ``sampler`` in place of the run's; evaluation, checkpoints and
  tracking are off. The prompt stream is therefore the run's: the k-th dispatch takes the k-th prompt, and each
  recorded group's prompt is checked against it.
- With the run's own sampler, ``in_order`` or ``weight_fifo`` (whose schedule does not depend on timing,
  docs/samplers.md), the replay trains the same groups at the same steps with the same versions as the recording.
- A replay is deterministic: a function of the recording, the sampler and the steps.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from asyncrl.config import Config
from asyncrl.controller import Controller
from asyncrl.replay.latency import fit as fit_latency
from asyncrl.replay.generator import RecordedGenerator
from asyncrl.replay.recorded import RecordedRun, read, schedule
from asyncrl.samplers import build_sampler, sampler_config
from asyncrl.simulate import Simulation
from asyncrl.trace import DISPATCH


class ReplayedRun:
    """The replayed run, read like a controller: ``trace`` and ``metrics`` (a live run's columns, with simulated
    times, plus ``sim_time_s``), ``explain()`` and ``state()`` where it ended, ``at(step, event=None)`` (a view at
    any step, as a ``Recording`` gives), ``steps``; and what a replay adds: ``schedule`` (every trained group with
    its prompt and the recorded group it was served), ``drawn_fraction`` and ``summary()``."""

    def __init__(self, recorded: RecordedRun, sim: Simulation, follow, sampler: dict, fit: dict):
        self.recorded, self.simulation, self.controller = recorded, sim, sim.ctrl
        self.sampler, self.fit = sampler, fit
        self._follow = follow

    @property
    def trace(self) -> pd.DataFrame:
        return self.simulation.trace

    @property
    def metrics(self) -> pd.DataFrame:
        return self.simulation.metrics

    @property
    def steps(self) -> list[int]:
        return self._follow.steps

    def explain(self, timeout: float | None = None) -> pd.DataFrame:
        return self.controller.explain(timeout)

    def state(self):
        return self.controller.state()

    def at(self, step: int, event: int | None = None):
        """The replayed controller right after step ``step`` (or its ``event``-th trace row): ``state()``,
        ``explain()``, ``trace``, ``metrics``."""
        return self._follow.at(step, event)

    @property
    def drawn_fraction(self) -> float:
        """The share of the replay's groups whose prompt the recording never generated (served a group drawn from
        the recording's own groups at the nearest version)."""
        return self.controller.generator.drawn_fraction

    @property
    def schedule(self) -> pd.DataFrame:
        """Every trained group: ``step``, ``group_id``, ``weight_version``, ``target_step``, ``lag``, ``prompt``,
        ``recorded_group`` (whose completions it was served) and ``drawn``."""
        trace = self.controller.trace
        out = schedule(trace)
        dispatch = trace[trace.event == DISPATCH]
        prompts = dict(zip(dispatch.group_id.astype(int), dispatch.detail))
        served = self.controller.generator.served
        out["prompt"] = [prompts[g] for g in out.group_id]
        out["recorded_group"] = [served[g].recorded_group for g in out.group_id]
        out["drawn"] = [served[g].drawn for g in out.group_id]
        return out

    def summary(self) -> dict[str, Any]:
        """The simulation's summary (``asyncrl.simulate.Simulation.summary``) with the replay's own facts:
        ``drawn_fraction``, ``source`` (where the lengths and rewards came from) and ``latency`` (the fit)."""
        return {**self.simulation.summary(), "drawn_fraction": self.drawn_fraction, "source": self.recorded.source,
                "latency": self.fit}

    def __repr__(self) -> str:
        return (f"ReplayedRun({self.sampler}, {len(self.metrics)} steps, {self.drawn_fraction:.0%} drawn, "
                f"lengths and rewards from {self.recorded.source})")


def replay(recording, sampler: Any, steps: int | None = None, overlap_slowdown: float | None = None,
           recorded: RecordedRun | None = None) -> ReplayedRun:
    """``recording`` (an ``asyncrl.Recording``) replayed under ``sampler`` (a sampler config or mapping, e.g.
    ``{"name": "windowed", "max_staleness_versions": 2}``) for ``steps`` steps (None: as many as it recorded).
    ``overlap_slowdown``: how much generation and training slow each other while both run (``latency`` says when it
    matters). ``recorded``: the recording already read (``recorded.read``), to replay one recording several times."""
    run = read(recording) if recorded is None else recorded
    steps = run.steps if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1 or None (as many as recorded: {run.steps}), got {steps!r}")
    knobs = sampler_config(sampler).model_dump(mode="json")
    generation, training, fit = fit_latency(run, overlap_slowdown)
    ctrl = _controller(_config(run.cfg, knobs, generation, training))
    stream = ctrl.stream
    keyed = []
    for group in run.groups:
        prompt = stream.get(group.position)
        if prompt.text != group.prompt:
            raise ValueError(
                f"the recording's group {group.group_id} was dispatched with prompt {group.prompt!r}, but the task's "
                f"prompt stream serves {prompt.text!r} at its data position {group.position}: a replay needs the "
                "run's task, data and seed unchanged")
        keyed.append((_key(prompt), group))
    ctrl.generator.serve(keyed, lambda gid: _key(ctrl.buffer[gid].prompt))
    follow = type(recording)(ctrl)  # the recording's own class follows the replay: views at any step
    sim = Simulation(ctrl)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the simulated batches are small tensors: one thread is several times faster
    try:
        sim.run(steps)
    finally:
        torch.set_num_threads(threads)
    return ReplayedRun(run, sim, follow, knobs, fit)


def _key(prompt) -> str:
    return prompt.id or prompt.text


def _config(recorded: Config, sampler: dict, generation: dict, training: dict) -> Config:
    """The recording's config on the simulated backends (``generation``, ``training``: their knobs) under
    ``sampler``, with evaluation, checkpoints and tracking off."""
    # no environment: the recorded trajectories' turns are served by the generator's ``turns`` model instead
    data = recorded.model_dump(mode="json", exclude={"sampler", "generation", "trainer", "tracking", "environment"})
    data.update(
        generation={"backend": "simulated", "placement": "local", "weight_sync": "driver",
                    "max_new_tokens": recorded.generation.max_new_tokens, **generation},
        trainer={"backend": "simulated", "placement": "local", **training},
        sampler=sampler, eval_every=None, checkpoint_every=None, checkpoint_dir=None, torch_threads=None,
    )
    stale = sampler["name"] != "custom" and not build_sampler(sampler, None).is_on_policy
    if stale and data["loss"].get("importance_correction") == "none":
        # a replay trains nothing: the correction only keeps the config valid for a sampler that may train stale
        data["loss"] = {**data["loss"], "importance_correction": "token"}
    return Config.model_validate(data)


def _controller(cfg: Config) -> Controller:
    """A controller on the simulated policy and a ``RecordedGenerator``."""
    from asyncrl.backends.hf import load_tokenizer
    from asyncrl.backends.simulated import SimulatedPolicy
    from asyncrl.tasks import build_task

    tokenizer = load_tokenizer(cfg.model)
    policy = SimulatedPolicy(cfg.model, cfg.trainer, None, cfg.seed, tokenizer)
    generator = RecordedGenerator(cfg.model, cfg.generation, cfg.seed, tokenizer)
    return Controller(cfg, build_task(cfg.task), policy, generator, tokenizer)


def steps_per_s(metrics: pd.DataFrame, cfg: Config | None = None) -> tuple[float, str]:
    """Steps per second of a run's metrics and the time they are counted in: ``simulated`` where the metrics have
    ``sim_time_s`` (a replay, ``asyncrl simulate``), else ``wall`` (the steps' active seconds, ``step_time_s``),
    except for a run on the simulated backends without virtual times (``asyncrl run what_if``), whose wall
    seconds measure no model: NaN, ``none``."""
    if metrics.empty:
        return math.nan, "none"
    if "sim_time_s" in metrics:
        seconds, base = float(metrics.sim_time_s.iloc[-1]), "simulated"
    elif cfg is not None and cfg.generation.backend == "simulated":
        return math.nan, "none"
    else:
        seconds, base = float(metrics.step_time_s.sum()), "wall"
    return (len(metrics) / seconds if seconds > 0 else math.nan), base
