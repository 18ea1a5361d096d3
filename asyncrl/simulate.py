"""What-if studies in seconds: the real controller, buffer and sampler on the simulated backends' virtual clock.

    sim = asyncrl.simulate.simulate("what_if", steps=1000, sampler={"name": "weight_fifo"})
    sim.summary()["sim_steps_per_hour"]; sim.metrics; sim.trace; sim.write("out/")
    asyncrl.simulate.grid("what_if_gen_heavy", 60, gpus=8)   # every split of 8 GPUs, the best marked

``Simulation.run`` is a single-threaded discrete-event loop around ``Controller.rollout_tick``/``train_tick``
(nothing sleeps, nothing runs in a thread): virtual time jumps to the next event, which is a group finishing
(the generator's schedule) or the trainer finishing a chunk (the policy's latency model). ``Controller.run`` on
the same backends still runs the two real pump threads (each poll is a rollout tick of ``rollout_tick_s``): that
exercises the run loop but says nothing about time; studies of time and throughput go through this module.

Invariants (kept in ``Simulation``):
- A train tick's effects (``T += 1``, the weight sync, aborts) become visible when its chunk has trained, not when
  it started: the loop asks the sampler (``Controller.explain``) what the next train tick would select, reserves the
  trainer for that chunk's time, and runs the real ``train_tick`` at the end of it. So the rollout side sees the
  old ``T`` while the trainer works, as it would in a real run. (The chunk actually trained can differ from the one
  planned if rollouts committed meanwhile change a sampler's choice; the trainer's time then follows the chunk it
  trained, and ``summary()["train_ticks_replanned"]`` counts such ticks.)
- After a step the weights go to every replica (``SimulatedPolicy.sync_arrivals``: latency plus bytes over the link,
  one after another or down a tree): the trainer waits for the last transfer; each replica loads them as its
  ``weight_update`` says (``SimulatedGenerator.receive``).
- While a chunk trains and a group decodes, both run ``overlap_slowdown`` times slower (``_contend``): the trainer's
  tick and the generator's groups in flight end later by the same stretch, booked as busy time of both.
- Virtual time never goes back; busy + idle = elapsed for each side (the generator's per replica), by construction
  of the timelines.
- Everything written to files is a function of the config and seed: no wall-clock value goes in them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from asyncrl import metrics as M
from asyncrl.backends.simulated import (
    SimulatedGeneration, SimulatedGenerator, SimulatedPolicy, SimulatedTraining, draw_length,
)
from asyncrl.config import Config, load_config
from asyncrl.controller import Controller
from asyncrl.samplers import SAMPLERS

WALL_COLUMNS = ("step_time_s", "sync_time_s", "tokens_per_s", "gen_tokens_per_s")  # the controller's are wall time
SYNC = {"name": "in_order", "max_lookahead_versions": 0}
ASYNC = {"name": "weight_fifo", "max_staleness_versions": 1}


class Simulation:
    """Drives a ``Controller`` built on local ``simulated`` backends through virtual time."""

    def __init__(self, ctrl: Controller) -> None:
        if not (isinstance(ctrl.generator, SimulatedGenerator) and isinstance(ctrl.policy, SimulatedPolicy)):
            raise ValueError(
                "a simulation needs both backends 'simulated' and in-process (placement 'local'); got generator "
                f"{type(ctrl.generator).__name__} and policy {type(ctrl.policy).__name__} (the 'what_if' preset is one)"
            )
        wall = [name for name, b in (("generation", ctrl.generator), ("trainer", ctrl.policy)) if b.model.clock == "wall"]
        if wall:
            raise ValueError(f"a simulation drives a virtual clock itself; {', '.join(wall)}.clock is 'wall' "
                             "(allowed here: 'ticks')")
        self.ctrl, self.gen, self.policy = ctrl, ctrl.generator, ctrl.policy
        self.clock = self.gen.clock
        self.start = self.clock.now
        self.trainer_free = self.start  # the trainer works (or waits for a sync) until then
        self.train_busy = 0.0
        self.step_groups = ctrl.state().step_groups_trained
        self.first_step = ctrl.trainer_version
        self.steps: list[dict] = []  # per finished step: when it ended (sync done), its train and sync seconds
        self._step_train = 0.0
        self._gen_tokens = 0  # completion tokens committed since the last step ended
        self._stretch = 0.0  # this train tick's extra seconds from decoding beside it (overlap_slowdown)
        self._times: dict[str, list[float]] = defaultdict(list)  # per trace event kind, times in trace order
        self._seen = ctrl.trace.event.value_counts().to_dict()  # events before the simulation: no time
        self._drawn = list(self.gen.drawn)
        self.replanned = 0  # train ticks whose chunk differed in length from the one planned
        self.wall_s = 0.0

    # ------------------------------------------------------------------------------------------------- loop
    def run(self, steps: int) -> pd.DataFrame:
        """``steps`` more optimizer steps in virtual time. Returns the metrics of the steps it ran (simulated
        time columns). Stops early when the prompt stream runs out; a deadlock is an error naming the verdicts."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        ctrl, gen, clock = self.ctrl, self.gen, self.clock
        target, rows = ctrl.trainer_version + steps, len(self.steps)
        wall, tick_at, tick_start = time.perf_counter(), None, None
        clock.stepping, gen.timed_updates = False, True
        try:
            while ctrl.trainer_version < target:
                now = clock.now
                if tick_at is not None and now >= tick_at:
                    self._train(tick_start, now)
                    tick_at = None
                self._rollout(now)
                if tick_at is None and now >= self.trainer_free:
                    tick_at, tick_start = self._plan(now), now
                events = [t for t in (gen.next_event_time(), tick_at) if t is not None]
                if tick_at is None and self.trainer_free > now:
                    events.append(self.trainer_free)
                if not events:
                    if ctrl.exhausted and not ctrl.inflight:
                        break
                    raise RuntimeError(
                        f"simulation stalled at T={ctrl.trainer_version}, t={now:.3f}s: nothing in flight, "
                        f"{ctrl.last_report}; verdicts:\n{ctrl.explain().to_string(max_rows=20)}"
                    )
                later = max(now, min(events))
                if tick_at is not None:
                    later, tick_at = self._contend(now, later, tick_at)
                clock.now = later
        finally:
            clock.stepping, gen.timed_updates = True, False
            self.wall_s += time.perf_counter() - wall
        return self.metrics.iloc[rows:]

    def _contend(self, now: float, until: float, tick_at: float) -> tuple[float, float]:
        """The trainer trains until ``tick_at``; the next event is at ``until``, at full speed. Where a group
        decodes meanwhile, both sides go ``overlap_slowdown`` times slower: the interval they share stretches,
        and every later finish of both moves by the stretch (the generator's as a ``pause`` of that length, which
        is what a slower decode amounts to). Returns the new time to jump to and the tick's new end."""
        slowdown = self.policy.model.overlap_slowdown
        if slowdown == 1 or until <= now:
            return until, tick_at
        flights = self.gen._flights.values()
        if not any(f.start <= now < f.finish for f in flights):
            # nothing decodes now: a group that starts before ``until`` (after a sync) is where overlap begins
            return min([until] + [f.start for f in flights if now < f.start < until]), tick_at
        stretch = (slowdown - 1) * (until - now)  # decoding lasts until the next finish >= until: all shared
        self.gen.pause(stretch)
        self._stretch += stretch
        return until + stretch, tick_at + stretch

    def _rollout(self, now: float) -> None:
        """Rollout ticks at ``now`` until one neither dispatches nor commits."""
        while True:
            report = self.ctrl.rollout_tick()
            if report.dispatched:
                self._times["admit"].append(now)
            self._times["dispatch"].extend([now] * len(report.dispatched))
            self._times["commit"].extend([now] * len(report.committed))
            self._gen_tokens += sum(self.ctrl.buffer[g].rollouts.num_tokens for g in report.committed)
            if not (report.dispatched or report.committed):
                return

    def _plan(self, now: float) -> float | None:
        """When the next train tick ends, from the chunk the sampler would select now; None when it would wait.
        A tick that would only evict runs at once (eviction takes no time)."""
        ctrl = self.ctrl
        chosen, evicts = [], False
        for verdict in self._verdicts():
            chosen += [verdict.group_id] if verdict.action == "select" else []
            evicts = evicts or verdict.action == "evict"
        if not chosen:
            if evicts:
                self._record_train(ctrl.train_tick(), now, now)
                return self._plan(now)
            return None
        tokens = sum(ctrl.buffer[g].rollouts.num_tokens for g in chosen)
        finishes = self.step_groups + len(chosen) >= ctrl.cfg.groups_per_step
        return now + self.policy.train_seconds(tokens, finishes)

    def _verdicts(self) -> list:
        """``Controller.explain`` without the DataFrame (this runs before every train tick): the sampler's
        verdicts with this step's chunk bounds."""
        ctrl = self.ctrl
        remaining = ctrl.cfg.groups_per_step - self.step_groups
        lo, hi = ctrl.cfg.chunk_bounds
        return ctrl.sampler.explain(ctrl.trainer_version, min(lo, remaining), min(hi, remaining))

    def _train(self, start: float, now: float) -> None:
        """The planned tick's end: run it. If the sampler took another chunk than planned (rollouts committed
        meanwhile changed its choice), the trainer's time follows the chunk it trained: a longer one keeps it busy
        for the difference after ``T`` moved."""
        report = self.ctrl.train_tick()
        self._record_train(report, start, now)
        took = self.policy.train_seconds(self.policy.last_tokens, report.step_finished) if report.selected else 0.0
        took, self._stretch = took + self._stretch, 0.0  # slowed by decoding beside it (_contend)
        self.replanned += not math.isclose(took, now - start)
        self.train_busy += took
        self._step_train += took
        self.trainer_free = max(now, start + took)
        self.step_groups += len(report.selected)
        if report.step_finished:
            arrivals = self.policy.sync_arrivals(self.gen.replicas)
            self.gen.receive([self.trainer_free + a for a in arrivals], self.policy.transfer_seconds())
            sync = arrivals[-1]
            self.trainer_free += sync
            self.train_busy += sync
            self.steps.append({"sim_time_s": self.trainer_free, "train_time_s": self._step_train, "sync_time_s": sync,
                               "gen_tokens": self._gen_tokens})
            self.step_groups, self._step_train, self._gen_tokens = 0, 0.0, 0

    def _record_train(self, report, start: float, end: float) -> None:
        times = self._times
        times["evict"].extend([start] * len(report.evicted))
        times["select"].extend([start] * len(report.selected))
        times["abort"].extend([end] * len(report.aborted))
        if report.selected:
            times["train"].append(end)
        if report.step_finished:
            times["sync"].append(end)
            times["step"].append(end)

    # ----------------------------------------------------------------------------------------------- reading
    @property
    def end(self) -> float:
        return max(self.clock.now, self.trainer_free)

    @property
    def metrics(self) -> pd.DataFrame:
        """The controller's metrics for the simulated steps, with virtual times in place of wall-clock ones:
        ``step_time_s``, ``train_time_s``, ``sync_time_s``, ``tokens_per_s``, ``gen_tokens_per_s`` (completion
        tokens committed during the step per simulated second) and ``sim_time_s`` (step end)."""
        m = self.ctrl.metrics
        m = m[m.step >= self.first_step].head(len(self.steps)).reset_index(drop=True).copy()
        sim = pd.DataFrame(self.steps[:len(m)])
        if m.empty:
            return m
        ends = sim.sim_time_s.to_numpy()
        m[M.STEP_TIME_S.name] = ends - pd.Series(ends).shift(1, fill_value=self.start).to_numpy()
        m[M.TRAIN_TIME_S.name] = sim.train_time_s.to_numpy()
        m[M.SYNC_TIME_S.name] = sim.sync_time_s.to_numpy()
        m[M.TOKENS_PER_S.name] = m.tokens / m[M.STEP_TIME_S.name] if "tokens" in m else math.nan
        m[M.GEN_TOKENS_PER_S.name] = sim.gen_tokens.to_numpy() / m[M.STEP_TIME_S.name]
        m["sim_time_s"] = ends
        return m

    @property
    def trace(self) -> pd.DataFrame:
        """The controller's trace with ``sim_time_s``: when each event happened in virtual time (NaN for events
        before the simulation started, or of a kind the loop does not time)."""
        trace = self.ctrl.trace.copy()
        order = trace.groupby("event").cumcount() - trace.event.map(self._seen).fillna(0).astype(int)
        when = []
        for event, k in zip(trace.event, order):
            times = self._times.get(event, ())
            when.append(times[k] if 0 <= k < len(times) else math.nan)
        trace["sim_time_s"] = when
        return trace

    def busy(self) -> tuple[float, float]:
        """Seconds the generator's replicas (a group decoding, or loading weights; summed over replicas) and the
        trainer (training or waiting for a sync) were busy since the simulation started."""
        return sum(self.gen.busy_s(self.start, self.end)), min(self.train_busy, self.end - self.start)

    def summary(self) -> dict[str, Any]:
        """Throughput in simulated time, each side's busy/idle fraction, the lag distribution, groups dropped.

        ``gpus``: what the config uses (``count_gpus``); ``tokens_per_s``: completion tokens trained per simulated
        second, and per GPU; ``gen_idle`` / ``train_idle``: the share of the time a generation replica (mean over
        replicas) / the trainer was idle (the same numbers as ``gen_idle_frac`` / ``train_idle_frac``);
        ``gen_busy_s_per_step`` sums the replicas' busy seconds."""
        m, trace = self.metrics, self.ctrl.trace
        trace = trace.iloc[sum(self._seen.values()):]
        steps, elapsed = len(m), self.end - self.start
        gen_busy, train_busy = self.busy()
        lags = trace.lag[trace.event == "select"].astype(int)
        counts = trace.event.value_counts()
        dispatched, evicted, aborted = (int(counts.get(k, 0)) for k in ("dispatch", "evict", "abort"))
        tail = m.tail(max(1, steps // 10))
        frac = (lambda x: x / elapsed) if elapsed > 0 else (lambda x: math.nan)
        groups, seconds = (now - before for now, before in zip(self.gen.drawn, self._drawn))
        group_s = seconds / groups if groups else math.nan
        replicas, slots = self.gen.replicas, self.gen.model.concurrency
        # Overlap cannot beat the slower stage alone: the trainer's seconds per step, or the generator's when its
        # slots are kept full (N groups x their mean seconds / all slots; with no slot limit, generation never binds).
        gen_capacity_s = self.ctrl.cfg.groups_per_step * group_s / (slots * replicas) if slots else 0.0
        train_s = train_busy / steps if steps else math.nan
        bound = max(gen_capacity_s, train_s)
        gpus = count_gpus(self.ctrl.cfg)
        tokens_per_s = float(m.tokens.sum()) / elapsed if steps and elapsed > 0 and "tokens" in m else math.nan
        return {
            "sampler": self.ctrl.cfg.sampler.model_dump(),
            "seed": self.ctrl.cfg.seed,
            "steps": steps,
            "gpus": gpus,
            "replicas": replicas,
            "data_parallel": self.policy.model.data_parallel,
            "sim_time_s": elapsed,
            "sim_steps_per_hour": 3600 * steps / elapsed if elapsed > 0 else math.nan,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s / gpus,
            "gen_idle": frac(elapsed - gen_busy / replicas),
            "train_idle": frac(elapsed - train_busy),
            "gen_busy_frac": frac(gen_busy / replicas),
            "gen_idle_frac": frac(elapsed - gen_busy / replicas),
            "train_busy_frac": frac(train_busy),
            "train_idle_frac": frac(elapsed - train_busy),
            "gen_busy_s_per_step": gen_busy / steps if steps else math.nan,
            "train_busy_s_per_step": train_s,
            "group_s_mean": group_s,
            "two_stage_limit_steps_per_hour": 3600 / bound if bound > 0 else math.nan,
            "tokens_per_step": float(m.tokens.mean()) if steps and "tokens" in m else math.nan,
            "lag_mean": float(lags.mean()) if len(lags) else math.nan,
            "lag_max": int(lags.max()) if len(lags) else 0,
            "lag_p90": float(lags.quantile(0.9)) if len(lags) else math.nan,
            "lag_counts": {str(k): int(v) for k, v in sorted(lags.value_counts().items())},
            "groups_dispatched": dispatched,
            "groups_trained": len(lags),
            "groups_evicted": evicted,
            "groups_aborted": aborted,
            "groups_dropped": evicted + aborted,
            "train_ticks_replanned": self.replanned,
            "drop_frac": (evicted + aborted) / dispatched if dispatched else 0.0,
            "reward_last": float(tail.reward_mean.mean()) if steps else math.nan,
        }

    def write(self, out: str | Path, plots: bool = True) -> Path:
        """``metrics.csv``, ``trace.csv``, ``summary.json``, ``config.yaml`` and ``simulation.png`` in ``out``."""
        import yaml

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(self.ctrl.cfg.model_dump(mode="json"), sort_keys=False))
        self.metrics.to_csv(out / "metrics.csv", index=False)
        self.trace.to_csv(out / "trace.csv", index=False)
        (out / "summary.json").write_text(json.dumps(self.summary(), indent=2) + "\n")
        if plots:
            from asyncrl.simulate_plots import plot_simulation

            plot_simulation(self).savefig(out / "simulation.png", dpi=110)
        return out


# ----------------------------------------------------------------------------------------------- entry points
def count_gpus(cfg: Config) -> int:
    """GPUs a simulated config stands for: ``generation.replicas x gpus_per_replica``, plus
    ``trainer.data_parallel`` unless the trainer is ``colocated`` on the replicas' GPUs."""
    gen, trainer = cfg.generation, cfg.trainer
    return gen.replicas * gen.gpus_per_replica + (0 if trainer.colocated else trainer.data_parallel)


def run(ctrl: Controller, steps: int) -> Simulation:
    """Run ``ctrl`` (simulated backends) ``steps`` steps on the virtual clock; the ``Simulation`` has the results."""
    sim = Simulation(ctrl)
    sim.run(steps)
    return sim


def simulate(preset: str | Path | Config = "what_if", steps: int = 200, **overrides: Any) -> Simulation:
    """Build a controller from a preset (or a ``Config``) with overrides and run it ``steps`` simulated steps."""
    cfg = preset if isinstance(preset, Config) else load_config(preset, **overrides)
    return run(Controller.from_config(cfg), steps)


def sweep(samplers: Iterable[str] = ("in_order", "weight_fifo", "windowed", "ready_first"),
          windows: Iterable[int] = (0, 1, 2), latencies: Mapping[str, Mapping] | None = None,
          preset: str = "what_if", steps: int = 200, seeds: Iterable[int] = (0,), **overrides: Any) -> pd.DataFrame:
    """One simulation per sampler x window x latency setting x seed: a DataFrame with one row each (the
    summary's numbers). ``latencies`` maps a label to config overrides, e.g.
    ``{"long tail": {"generation": {"lengths": "pareto", "pareto_alpha": 1.5}}}``."""
    from asyncrl.config import merge_overrides

    latencies = dict(latencies or {"preset": {}})
    rows = []
    for label, latency in latencies.items():
        for name in samplers:
            for window in windows:
                for seed in seeds:
                    sampler = {"name": name, SAMPLERS[name].window_knob: window}
                    cfg = load_config(preset, **merge_overrides(merge_overrides(dict(overrides), dict(latency)),
                                                       {"sampler": sampler, "seed": seed}))
                    sim = simulate(cfg, steps)
                    s = sim.summary()
                    rows.append({"latency": label, "sampler": name, "window": window, "seed": seed,
                                 **{k: v for k, v in s.items() if k not in ("sampler", "seed", "lag_counts")}})
    return pd.DataFrame(rows)


def grid(preset: str | Path = "what_if", steps: int = 200, axes: Mapping[str, Iterable[Any]] | None = None,
         gpus: int | None = None, **overrides: Any) -> pd.DataFrame:
    """One simulation per point of the grid ``axes`` (a dotted config key -> its values, e.g.
    ``{"generation.replicas": [1, 2, 4]}``; several keys: every combination), on ``preset`` with ``overrides``.
    ``gpus``: only the points whose config uses exactly that many GPUs (``count_gpus``); with neither
    ``generation.replicas`` nor ``trainer.data_parallel`` among the axes, every split of ``gpus`` between the two
    (replicas 1 .. gpus - 1, ranks the rest) is added. One row per point: its values, then the summary's numbers;
    ``best`` marks the point with the most ``tokens_per_s_per_gpu`` (at a fixed GPU count: the most tokens/s)."""
    import itertools

    from asyncrl.config import merge_overrides

    axes = {key: list(values) for key, values in (axes or {}).items()}
    splits = gpus is not None and not {"generation.replicas", "trainer.data_parallel"} & set(axes)
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1 + splits):
        raise ValueError(f"gpus must be an int >= {1 + splits} (one GPU for each side at least), got {gpus!r}")
    if splits:
        axes = {"generation.replicas": list(range(1, gpus)), "trainer.data_parallel": list(range(1, gpus)), **axes}
    for key, values in axes.items():
        if not values:
            raise ValueError(f"the sweep over {key} has no values")
    points = []  # every point's config first: a bad value fails before anything runs
    for point in itertools.product(*axes.values()):
        nested: dict = {}
        for key, value in zip(axes, point):
            *parents, leaf = key.split(".")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        cfg = load_config(preset, **merge_overrides(dict(overrides), nested))
        if gpus is None or count_gpus(cfg) == gpus:
            points.append((point, cfg))
    if not points:
        raise ValueError(f"no point of the sweep {axes} uses {gpus} GPUs")
    rows = []
    for point, cfg in points:
        s = simulate(cfg, steps).summary()
        rows.append({**dict(zip(axes, point)), **{k: v for k, v in s.items() if k not in ("sampler", "lag_counts")}})
    df = pd.DataFrame(rows)
    df["best"] = df.index == df.tokens_per_s_per_gpu.idxmax()
    return df


# ------------------------------------------------------------------------------------------------ calibration
@dataclass
class Calibration:
    """A latency model fitted to a real synchronous run, and how to simulate that workload under another sampler.

    ``measured``: the real run's per-step means (seconds: ``gen_s``, ``train_s``, ``sync_s``, ``step_s``; ``tokens``
    per step; ``steps`` used)."""

    config: Config
    generation: SimulatedGeneration
    training: SimulatedTraining
    measured: dict[str, float]

    def config_for(self, sampler: Mapping, **overrides: Any) -> Config:
        """The real run's config on the simulated backends with the fitted knobs and ``sampler``."""
        from asyncrl.config import merge_overrides

        sim = {
            "generation": {"backend": "simulated", "placement": "local", "weight_sync": "driver",
                           **self.generation.model_dump()},
            "trainer": {"backend": "simulated", "placement": "local", **self.training.model_dump()},
            "eval_every": None, "sampler": dict(sampler),
        }
        return Config.model_validate(merge_overrides(merge_overrides(self.config.model_dump(mode="json"), sim), overrides))

    def predict(self, sampler: Mapping, steps: int = 300, **overrides: Any) -> dict[str, Any]:
        """The summary of a simulation of ``steps`` steps under ``sampler``."""
        return simulate(self.config_for(sampler, **overrides), steps).summary()


def calibrate(run: str | Path | pd.DataFrame, config: Config | None = None, skip: int = 3,
              overlap_slowdown: float = 1.0) -> Calibration:
    """Fit the simulated backends' latency model to a real **synchronous** run (``in_order`` with
    ``max_lookahead_versions`` 0): its directory (``metrics.csv`` + ``config.yaml``, as ``asyncrl run`` writes
    them), or its metrics DataFrame and config. The first ``skip`` steps (warm-up) are left out.

    In a synchronous run the two sides take turns, so per step: generation = ``step_time_s - train_time_s -
    sync_time_s`` (scoring and the controller's own time included). Training is fitted as ``train_s_per_step +
    train_s_per_token x tokens`` (least squares; proportional when the token counts hardly vary), the sync as its
    mean, the completion lengths as a lognormal with the measured mean, and the decode time per token so that a
    batch (all its groups decoding at once, as the torch and vLLM generators do) takes the measured time.

    A synchronous run never runs the two stages at once, so it cannot tell how much they slow each other when
    they do: ``overlap_slowdown`` (the ``SimulatedTraining`` knob) comes from a separate measurement of the same
    machine and workload, ``measure_overlap(config)``, which times a generation and a training call alone and at
    once in two threads, outside the controller. It is never fitted to an asynchronous run (that is what the
    calibration predicts). The default 1 assumes full overlap (separate devices)."""
    if isinstance(run, (str, Path)):
        config = config or load_config(Path(run) / "config.yaml")
        run = pd.read_csv(Path(run) / "metrics.csv")
    if config is None:
        raise ValueError("calibrate(metrics_dataframe) needs the run's config too: calibrate(metrics, config)")
    sampler = config.sampler.model_dump()
    if sampler != SYNC:
        raise ValueError(f"calibration needs a synchronous run ({SYNC}), where generation and training take turns "
                         f"and generation time = step time - train time - sync time; got sampler {sampler}")
    missing = [c for c in ("step_time_s", "train_time_s", "sync_time_s", "tokens") if c not in run.columns]
    if missing:
        raise ValueError(f"the run's metrics lack {missing}; needed: step_time_s, train_time_s, sync_time_s, tokens")
    m = run.iloc[skip:]
    if len(m) < 3:
        raise ValueError(f"calibration needs at least 3 steps after the {skip} skipped, got {len(m)}")
    gen = m.step_time_s - m.train_time_s - m.sync_time_s
    N, G, cap = config.groups_per_step, config.group_size, config.generation.max_new_tokens
    lengths = _fit_lengths(float(m.tokens.mean()) / (N * G), cap)
    longest = _mean_longest(lengths, cap, N * G)
    # A weight load pauses the groups in flight (the model this fit was checked with) unless the run said otherwise.
    generation = SimulatedGeneration(decode_s_per_token=max(0.0, float(gen.mean())) / longest,
                                     weight_update=getattr(config.generation, "weight_update", "inflight"),
                                     **lengths.model_dump(include={"lengths", "length_mean", "length_sigma"}))
    tokens, train = m.tokens.to_numpy(float), m.train_time_s.to_numpy(float)
    per_step, per_token = 0.0, train.mean() / tokens.mean()
    if tokens.std() > 0.02 * tokens.mean():
        slope, intercept = np.polyfit(tokens, train, 1)
        if slope >= 0 and intercept >= 0:
            per_step, per_token = float(intercept), float(slope)
    training = SimulatedTraining(train_s_per_token=per_token, train_s_per_step=per_step,
                                 sync_s=float(m.sync_time_s.mean()), overlap_slowdown=overlap_slowdown)
    measured = {"steps": len(m), "step_s": float(m.step_time_s.mean()), "gen_s": float(gen.mean()),
                "train_s": float(train.mean()), "sync_s": float(m.sync_time_s.mean()), "tokens": float(tokens.mean())}
    return Calibration(config, generation, training, measured)


def measure_overlap(config: Config, reps: int = 10, warmup: int = 3) -> dict[str, float]:
    """How much a generation call and a training call slow each other down when they run at once, on this
    machine, for ``config``'s workload (real backends, in-process): each timed alone (``gen_s``, ``train_s``, per
    call), then both at once in two threads, ``reps`` calls each (``together_s`` per pair); after a warm-up, three
    rounds of the three, each figure the fastest of its rounds. The controller is not
    involved: the calls are the backends' own (``submit`` + ``poll`` of a batch; ``begin_train_step``,
    ``train_microbatches``, ``finish_train_step`` on it, with the old-policy logprobs pass if the policy needs one).

    ``overlap_slowdown`` is the rate model's factor: while both run, each goes ``s`` times slower, so the shorter
    call (``a``) ends after ``s * a`` and the longer (``b``) has ``b - a`` left to do alone: ``together = s * a + b -
    a``, ``s = 1 + (together - b) / a``, clipped to ``[1, 4]``. 1 is full overlap, 2 no gain over one after the
    other."""
    import threading

    from asyncrl.algorithms import make_train_batch
    from asyncrl.backends.base import capabilities
    from asyncrl.data import GenerationRequest

    ctrl = Controller.from_config(config)
    try:
        for _ in range(warmup):
            ctrl.tick()
        gen, policy, N, G = ctrl.generator, ctrl.policy, config.groups_per_step, config.group_size
        prompts = [ctrl.encode(ctrl.stream.get(i)) for i in range(N)]

        def generate():
            gen.submit([GenerationRequest(i, prompts[i], G) for i in range(N)])
            return gen.poll(None)

        groups = generate()
        for g in groups:
            g.rewards = [float(i % 2) for i in range(len(g.completion_ids))]
        batch = make_train_batch(groups, config.loss, ctrl.tokenizer.pad_token_id)

        def train():  # what TrainPump._train_chunk and the step's end ask of the policy
            chunk = batch
            if not capabilities(policy).prev_logprobs_from_forward:
                chunk = dataclasses.replace(batch, prev_logprobs=policy.logprobs(batch))
            policy.begin_train_step()
            policy.train_microbatches(chunk)
            policy.finish_train_step()

        def both() -> None:  # reps pairs: generation in a second thread, training in this one
            other = threading.Thread(target=lambda: [generate() for _ in range(reps)], name="measure-overlap")
            other.start()
            for _ in range(reps):
                train()
            other.join()

        def per_call(fn, calls: int) -> float:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - start) / reps

        generate(), train(), both()  # warm: first calls (and a first thread) run slower
        # Three rounds, each figure the fastest of its three: a noisy machine only ever adds time.
        rounds = [(per_call(generate, reps), per_call(train, reps), per_call(both, 1)) for _ in range(3)]
        gen_s, train_s, together = (min(r[i] for r in rounds) for i in range(3))
    finally:
        ctrl.close()
    short, long = sorted((gen_s, train_s))
    slowdown = min(4.0, max(1.0, 1 + (together - long) / short)) if short > 0 else 1.0
    return {"gen_s": gen_s, "train_s": train_s, "together_s": together, "overlap_slowdown": slowdown}


def _fit_lengths(mean: float, cap: int, sigma: float = 0.5) -> SimulatedGeneration:
    """A lognormal length model whose clipped mean is ``mean`` (bisection on a fixed sample)."""
    def clipped_mean(mu: float) -> float:
        model, rng = SimulatedGeneration(lengths="lognormal", length_mean=mu, length_sigma=sigma), random.Random(0)
        return sum(draw_length(model, cap, rng) for _ in range(2000)) / 2000

    lo, hi = 0.01, 100.0 * cap
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    return SimulatedGeneration(lengths="lognormal", length_mean=math.sqrt(lo * hi), length_sigma=sigma)


def _mean_longest(model: SimulatedGeneration, cap: int, n: int, batches: int = 200) -> float:
    rng = random.Random(0)
    return sum(max(draw_length(model, cap, rng) for _ in range(n)) for _ in range(batches)) / batches
