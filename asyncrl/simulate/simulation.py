"""The discrete-event loop of a what-if study: a ``Controller`` built on the local ``simulated`` backends, driven
through virtual time.

``Simulation.run`` is a single-threaded loop around ``Controller.rollout_tick``/``train_tick`` (nothing sleeps,
nothing runs in a thread): virtual time jumps to the next event, which is a group finishing (the generator's
schedule) or the trainer finishing a chunk (the policy's latency model). ``Controller.run`` on the same backends
still runs the two real pump threads (each poll is a rollout tick of ``rollout_tick_s``): that exercises the run
loop but says nothing about time; studies of time and throughput go through this loop.

Invariants (kept in ``Simulation``):
- A train tick's effects (``T += 1``, the weight sync, aborts) become visible when its chunk has trained, not when
  it started: the loop asks the sampler (``Controller.explain``) what the next train tick would select, reserves the
  trainer for that chunk's time, and runs the real ``train_tick`` at the end of it. So the rollout side sees the
  old ``T`` while the trainer works, as it would in a real run. The tick's choice is the one made at its start, as
  in a real run, where a train tick holds the controller's lock through evict and select: groups that finish while
  the chunk trains are held by the generator (``hold``) and committed when the tick ends, right after it, so they
  cannot change what it selected (the rollout side keeps dispatching meanwhile). Should the chunk trained still
  differ from the one planned, the trainer's time follows the chunk it trained, and
  ``summary()["train_ticks_replanned"]`` counts such ticks.
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

import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd

from asyncrl import metrics as M
from asyncrl.backends.simulated import SimulatedGenerator, SimulatedPolicy
from asyncrl.config import Config
from asyncrl.controller import Controller
from asyncrl.trace import ABORT, TURN

WALL_COLUMNS = ("step_time_s", "sync_time_s", "tokens_per_s", "gen_tokens_per_s")  # the controller's are wall time


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
        # aborts (after a sync, or at a turn boundary inside a rollout tick) and turn events: when delivered, at the
        # end of the tick that recorded them, on this thread, so at the virtual time the tick ran
        ctrl.subscribe(lambda row: self._times[row.event].append(self.clock.now), events=[ABORT, TURN])

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
                gen.hold = tick_at is not None
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
            clock.stepping, gen.timed_updates, gen.hold = True, False, False
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
            from asyncrl.plots.simulation import plot_simulation

            plot_simulation(self).savefig(out / "simulation.png", dpi=110)
        return out


def count_gpus(cfg: Config) -> int:
    """GPUs a simulated config stands for: ``generation.replicas x gpus_per_replica``, plus
    ``trainer.data_parallel`` unless the trainer is ``colocated`` on the replicas' GPUs."""
    gen, trainer = cfg.generation, cfg.trainer
    return gen.replicas * gen.gpus_per_replica + (0 if trainer.colocated else trainer.data_parallel)
