"""``simulated``: backends with no model, on a virtual clock, for what-if studies of samplers and throughput.

Everything but the model is real: buffer, sampler, pumps, trace and metrics are the controller's. What is
modelled, with typed knobs (``SimulatedGeneration``, the ``generation`` section's, and ``SimulatedTraining``, the
``trainer`` section's, both in asyncrl/config.py so that ``load_config`` checks them):
- **Latency.** A group's ``G`` completions decode together: it takes ``prefill_s + decode_s_per_token x`` its
  longest completion, whose lengths come from a (long-tailed, if asked) distribution clipped to
  ``[1, max_new_tokens]``. At most ``concurrency`` groups decode at once; the rest wait, first in first out.
  Training a chunk takes ``train_s_per_token`` per completion token, a step adds ``train_s_per_step``, and a weight
  sync takes ``sync_s`` (plus the bytes over the link, below), during which the generator stops decoding. While a chunk trains and a group decodes at
  the same time, both go ``overlap_slowdown`` times slower (they share cores, memory bandwidth or an interpreter).
- **Reward.** The policy accumulates *progress*: a step on fresh data adds ``reward_gain``, a step on data ``L``
  versions stale adds ``reward_gain * stale_progress ** L``. Progress travels to the generator with the weights; a
  group generated at version ``v`` succeeds with probability ``min(reward_max, reward_base + progress(v))``.
- **Importance weights.** Token logprobs drift by ``DRIFT`` per version, so stale rollouts carry importance weights
  ``exp(-DRIFT * lag)`` as real ones do; the policy reads each token's lag back from that difference.

**Replicas and weight updates** (timed only on ``asyncrl.simulate``'s clock):
- ``generation.replicas: K`` engines, each with ``concurrency`` slots; a submitted group goes to the replica with
  the fewest groups (ties: the lowest index), as ``ReplicaSet`` deals them. ``admission: streaming`` starts a group
  as soon as a slot is free; ``wave`` starts up to ``concurrency`` queued groups together once the replica is idle
  and returns them all when the slowest ends.
- ``trainer.data_parallel: R`` divides a chunk's per-token time by ``R x scaling_efficiency ** log2(R)``.
- After a step the weights go to each replica as one transfer of ``sync_s + weight_bytes / link_gb_per_s``, one after
  another (``sync_fanout: sequential``) or down a binomial tree (``tree``); the trainer waits for the last. A replica
  then loads for ``load_s`` (``None``: it stops for its whole transfer instead): ``weight_update: inflight`` at once,
  its running groups paused and then spanning two versions; ``drain`` once the groups it runs have finished on the
  old weights, starting none meanwhile. A group submitted after ``load_weights(v)`` starts on its replica only once
  that replica holds ``v``; each group reports the versions its replica held when it started and ended, and each
  token the logprob of the version it was decoded under (decoding steps spread evenly over the group's decoding
  time, pauses included). Stepped by hand or on the wall clock an update is instant.

**Turns** (``generation.turns``): multi-turn groups, asyncrl/backends/simulated_turns.py (``TurnsModel``).

Time is virtual by default (``clock: ticks``, a ``SimClock``): nothing sleeps. Stepped by hand (or under
``Controller.run``) each ``poll`` is one rollout tick and advances the clock by ``rollout_tick_s``, so a group
finishes after a number of rollout ticks drawn from the model, the same every time for a seed. Under
``asyncrl.simulate`` a discrete-event loop owns the clock instead (``clock.stepping = False``) and asks
``next_event_time``/``train_seconds`` how long things take. ``clock: wall`` (in both sections) makes the same
seconds real: ``poll`` waits for them and training sleeps, for exercising ``Controller.run`` in real time.

Invariants (kept here): random draws happen only in ``submit`` (``draw``: lengths and rewards, in request order), so a
seed and the order of submissions fix every outcome, whatever K; a group's finish time depends only on the groups
submitted before it, aborts, pauses and weight updates, never on when it is polled; a replica's versions never
decrease, and a group never starts on weights older than those current at its submission.
"""

from __future__ import annotations

import heapq
import math
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from asyncrl.algorithms import gap_contributions
from asyncrl.backends.base import Capabilities
from asyncrl.config import SimulatedGeneration, SimulatedGenerationConfig, SimulatedTrainerConfig, SimulatedTraining
from asyncrl.data import GenerationRequest, GroupRollouts, TrainBatch
from asyncrl.backends.simulated_timeline import Replica, SimClock, WallClock, busy_seconds
from asyncrl.backends.simulated_turns import DRIFT, LOG_HALF, TurnsModel, draw_env_seconds
from asyncrl.metrics import GAP_METRICS, Accumulator

__all__ = ["SimulatedGeneration", "SimulatedTraining", "SimulatedGenerator", "SimulatedPolicy", "draw_env_seconds",
           "draw_length"]



def draw_length(model: SimulatedGeneration, max_new_tokens: int, rng: random.Random) -> int:
    """One completion length from ``model.lengths``, clipped to ``[1, max_new_tokens]``."""
    if model.lengths == "uniform":
        return rng.randint(1, max_new_tokens)
    mean = model.length_mean or max_new_tokens / 4
    if model.lengths == "lognormal":
        x = rng.lognormvariate(math.log(mean) - model.length_sigma ** 2 / 2, model.length_sigma)
    else:  # pareto with this mean: scale x_m = mean (alpha - 1) / alpha
        x = mean * (model.pareto_alpha - 1) / model.pareto_alpha * rng.paretovariate(model.pareto_alpha)
    return min(max_new_tokens, max(1, math.ceil(x)))


@dataclass
class _Flight:
    request: GenerationRequest
    version: int  # the generator's version at submit: the group is generated with these weights or newer
    seconds: float  # decoding time, drawn at submit
    lengths: list[int]
    rewards: list[float]
    replica: int = 0
    start: float = math.inf  # planned by _schedule; fixed once the clock passed it; inf: not planned yet
    finish: float = math.inf
    # Multi-turn (``turns``): per trajectory, each turn's length; per turn, the offset (drawn seconds from the start)
    # at which its decoding starts and at which its environment answered; turns reported to the pump so far.
    turn_lengths: list[list[int]] | None = None
    turn_starts: list[float] | None = None
    turn_ends: list[float] | None = None
    reported: int = 0
    free: bool = False  # free turns (``TurnsModel._plan_free`` says what the next three hold)
    env: list[list[float]] | None = None
    times: list[list[tuple[float, float, float, float]]] | None = None
    reported_turns: list[int] | None = None

    def at(self, offset: float) -> float:
        """When ``offset`` drawn seconds into the group happen, its pauses spread over its span."""
        return self.start + (offset / self.seconds * (self.finish - self.start) if self.seconds else 0.0)


class SimulatedGenerator(TurnsModel):
    def __init__(self, model_cfg, gen_cfg: SimulatedGenerationConfig, seed: int, tokenizer) -> None:
        self.model = gen_cfg  # its knobs were checked when the config loaded
        self.max_new_tokens = gen_cfg.max_new_tokens
        self.eos_id = tokenizer.eos_token_id
        self.rng = random.Random(seed)
        self.clock = SimClock() if self.model.clock == "ticks" else WallClock()
        self.progress = 0.0  # what the weights have learned (see the module docstring), set by load_weights
        self._version = 0
        # In a Ray actor of its own each replica is one engine (asyncrl/backends/replicas.py); in-process this
        # object models all of them.
        self.replicas = gen_cfg.replicas if gen_cfg.placement != "ray" else 1
        self._replicas = [Replica([(-math.inf, 0)]) for _ in range(self.replicas)]
        self.timed_updates = False  # asyncrl.simulate times each replica's update itself (``receive``)
        self.hold = False  # asyncrl.simulate: while a train tick's chunk trains, finished groups wait to be polled
        self._flights: dict[int, _Flight] = {}  # in submission order: the order the engines start them
        self.busy: list[tuple[float, float, int]] = []  # (start, end, replica) of decoded groups and weight loads
        self.drawn = [0, 0.0]  # groups submitted, and their drawn decoding seconds in total
        self._stops, self._worker_busy = self.free_turn_state()
        self._lock = threading.Condition()  # Controller.run calls in from two pumps; a wall-clock poll waits on it

    @property
    def version(self) -> int:
        return self._version

    def length(self) -> int:
        return draw_length(self.model, self.max_new_tokens, self.rng)

    def success(self) -> float:
        return min(self.model.reward_max, self.model.reward_base + self.progress)

    def draw(self, request: GenerationRequest, success: float) -> tuple[list[int], list[float]]:
        """The lengths and rewards of one group's ``request.n`` completions, from the length and reward models (each
        a success with probability ``success``). A replay's generator serves recorded ones instead
        (``asyncrl.replay``); latency, versions and logprobs follow from them the same way."""
        lengths = [self.length() for _ in range(request.n)]
        return lengths, [1.0 if self.rng.random() < success else 0.0 for _ in range(request.n)]

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        with self._lock:
            self._advance()
            p = self.success()
            load = [0] * self.replicas
            for f in self._flights.values():
                load[f.replica] += 1
            for req in requests:
                replica = min(range(self.replicas), key=lambda r: (load[r], r))  # least loaded, as ReplicaSet
                load[replica] += 1
                if self.model.turns is None:
                    lengths, rewards = self.draw(req, p)
                    seconds = self.model.prefill_s + self.model.decode_s_per_token * max(lengths)
                    f = _Flight(req, self._version, seconds, lengths, rewards, replica)
                else:
                    turn_lengths, env, rewards = self.draw_turns(req, p)
                    f = _Flight(req, self._version, 0.0, [sum(x) for x in turn_lengths], rewards, replica,
                                turn_lengths=turn_lengths)
                    (self._plan_free if self._plays_free() else self._plan_turns)(f, env)
                self.drawn[0] += 1
                self.drawn[1] += f.seconds
                self._flights[req.group_id] = f
            self._schedule()
            self._lock.notify_all()

    def _schedule(self) -> None:
        """Start and finish times of every group not started yet, per replica, in submission order: none before
        ``now``, before the replica's weight load ends, or before it holds the weights the group was submitted
        under; a draining replica starts nothing. Started groups keep theirs."""
        now, slots = self.clock.now, self.model.concurrency
        mine: list[list[_Flight]] = [[] for _ in self._replicas]
        for f in self._flights.values():
            if not f.free:  # free-turn groups hold no slot: ``_project_free`` plans them
                mine[f.replica].append(f)
        for rep, flights in zip(self._replicas, mine):
            started = [f for f in flights if f.start <= now < f.finish]  # a finished group holds no slot
            waiting = [f for f in flights if f.start > now]
            base = math.inf if rep.draining else max(now, rep.free_at)
            if self.model.admission == "streaming":
                free = [f.finish for f in started] + [base] * ((slots - len(started)) if slots else len(waiting))
                heapq.heapify(free)
                for f in waiting:
                    f.start = max(heapq.heappop(free), base, rep.ready(f.version))
                    f.finish = f.start + f.seconds
                    heapq.heappush(free, f.finish)
                continue
            t = max([base] + [f.finish for f in started])  # a wave starts once the running one has ended
            i = 0
            while i < len(waiting):
                t = max(t, rep.ready(waiting[i].version))
                n = slots or len(waiting)
                wave = [f for f in waiting[i:i + n] if rep.ready(f.version) <= t]  # versions never decrease
                end = t + max(f.seconds for f in wave) if wave else math.inf
                for f in wave or waiting[i:]:
                    f.start, f.finish = (t, end) if wave else (math.inf, math.inf)
                i += len(wave) or len(waiting)
                t = end
        self._project_free()

    def next_event_time(self) -> float | None:
        """When the next group finishes or a timed weight update begins (virtual seconds); None if neither. While
        finished groups are held, only later finishes count (the held ones come out when the hold ends)."""
        with self._lock:
            past = self.clock.now if self.hold else -math.inf
            times = [f.finish for f in self._flights.values() if past < f.finish < math.inf]
            times += [f.at(f.turn_ends[f.reported]) for f in self._flights.values()
                      if f.turn_ends is not None and f.reported < len(f.turn_ends) - 1 and f.start < math.inf
                      and past < f.at(f.turn_ends[f.reported])]
            times += [t for t in (self._next_turn_end(past),) if t < math.inf]
            times += [u[0] for rep in self._replicas for u in rep.pending]
            return min(times, default=None)

    def pause(self, seconds: float, replicas: Sequence[int] | None = None) -> None:
        """Decoding stops for ``seconds`` from now on ``replicas`` (default: every replica decoding a group now):
        their running groups finish that much later and none starts before it ends. ``asyncrl.simulate`` books
        contention this way (a slower decode)."""
        with self._lock:
            now = self.clock.now
            if replicas is None:
                replicas = sorted({f.replica for f in self._flights.values() if f.start <= now < f.finish})
            for r in replicas:
                self._stop(r, now, seconds)
            self._schedule()

    def _stop(self, r: int, at: float, seconds: float) -> None:
        rep = self._replicas[r]
        rep.free_at = max(rep.free_at, at) + seconds
        self.busy.append((at, at + seconds, r))
        self._stops[r].append((at, at + seconds))  # free-turn decodes skip it (``_project_free``)
        for f in self._flights.values():
            if f.replica == r and f.start <= at < f.finish and not f.free:
                f.finish += seconds

    def receive(self, arrivals: Sequence[float], transfer_s: float) -> None:
        """The weights last loaded (``load_weights``) reach replica ``i`` at ``arrivals[i]`` (virtual seconds,
        its transfer's end). It then loads them for ``load_s`` seconds as ``weight_update`` says; with ``load_s``
        None it stops for its whole transfer instead (from ``arrivals[i] - transfer_s``)."""
        load_s = self.model.load_s
        with self._lock:
            for rep, arrival in zip(self._replicas, arrivals):
                begin, load = (arrival - transfer_s, transfer_s) if load_s is None else (arrival, load_s)
                rep.pending.append((begin, load, self._version))
            self._advance()
            self._schedule()

    def _advance(self) -> None:
        """Apply the timed updates that began by now, each at its own time (the loop wakes at each begin)."""
        now, applied = self.clock.now, False
        for r, rep in enumerate(self._replicas):
            while rep.pending and rep.pending[0][0] <= now:
                applied = True
                begin, load, version = rep.pending.pop(0)
                version = max(version, rep.versions[-1][1])  # an instant update (stepped by hand) came first
                if self.model.weight_update == "inflight":  # between two engine steps: running groups wait
                    self._stop(r, begin, load)
                    rep.versions.append((rep.free_at, version))
                else:  # drain: finish what runs on the old weights first (one load for a newer update too)
                    rep.draining = (load, version)
                    self._drained(r, begin)
        if applied:
            self._schedule()

    def _drained(self, r: int, t: float) -> None:
        """A draining replica whose groups all ended by ``t`` loads its weights from ``t`` on. A group that started
        by now counts even if it started after ``t`` (a drain that began a float's width before a group's planned
        start): loading under it would make it span versions, which ``drain`` never does."""
        rep, now = self._replicas[r], max(t, self.clock.now)
        if rep.draining is None or any(f.replica == r and f.start <= now and t < f.finish and not f.free
                                       for f in self._flights.values()):  # a free turn takes the next weights
            return
        (load, version), rep.draining = rep.draining, None
        self._stop(r, t, load)
        rep.versions.append((rep.free_at, version))

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        """Groups finished by ``clock.now``, in finishing order. With virtual time it never waits (when stepping,
        this poll is one rollout tick and moves the clock by ``rollout_tick_s``); on the wall clock it waits up to
        ``timeout`` (None: until one finishes) for the next group."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._lock:
            if self.clock.stepping and self._flights:
                self.clock.now += self.model.rollout_tick_s
            while True:
                self._advance()
                now = self.clock.now
                done = sorted((f for f in self._flights.values() if f.finish <= now),
                              key=lambda f: (f.finish, f.request.group_id))
                if done or not self._flights or not isinstance(self.clock, WallClock):
                    break
                wait = min(f.finish for f in self._flights.values()) - now
                if deadline is not None:
                    wait = min(wait, deadline - time.perf_counter())
                if wait <= 0:
                    break
                self._lock.wait(wait)
            turns = self._turns_by(now)
        if turns:  # the pump's callbacks take the run's lock: called with this one released (as TurnGenerator)
            stopped = self._report_turns(turns)
            with self._lock:
                self._freeze([self._flights[g] for g in stopped if g in self._flights], now)
                for g in stopped:
                    f = self._flights.pop(g, None)
                    if f is not None and f.start < now:
                        self.busy.append((f.start, now, f.replica))
                if stopped:
                    self._schedule()
        with self._lock:
            done = sorted((f for f in self._flights.values() if f.finish <= now),
                          key=lambda f: (f.finish, f.request.group_id))
            for r in {f.replica for f in done}:  # their replicas are free now, held or not: a drain loads
                self._drained(r, max(f.finish for f in done if f.replica == r))
            if self.hold:  # asyncrl.simulate: they stay in flight until the train tick's end
                self._schedule()
                return []
            for f in done:
                del self._flights[f.request.group_id]
                self.busy.append((f.start, f.finish, f.replica))
            if done:
                self._schedule()
            return [self._rollouts(f) for f in done]

    def _rollouts(self, f: _Flight) -> GroupRollouts:
        if f.turn_lengths is not None:
            return self._turn_rollouts(f)
        req = f.request
        if self.timed_updates:  # the weights its replica held when it started and when it ended
            rep = self._replicas[f.replica]
            start, end = rep.version_at(f.start), rep.version_at(f.finish)
        else:  # updates are instant: the version it was submitted under, and the current one
            start, end = f.version, self._version
        longest, versions = max(f.lengths), None
        per_step = [LOG_HALF - DRIFT * start] * longest
        if start != end:  # weights loaded under it (inflight): each token keeps the logprob of the weights it was
            # sampled with; decoding step j falls at a share (j + 1) / longest of the decoding time (pauses spread)
            rep, decoding = self._replicas[f.replica], f.finish - f.start - self.model.prefill_s
            begin = f.start + self.model.prefill_s
            versions = rep.versions_at([begin + (j + 1) / longest * decoding for j in range(longest)])
            per_step = [LOG_HALF - DRIFT * v for v in versions]
        completions = [[ord("x")] * (n - 1) + [self.eos_id] for n in f.lengths]  # content is not modelled
        logprobs = [per_step[:n] for n in f.lengths]
        reasons = ["length" if n == self.max_new_tokens else "stop" for n in f.lengths]
        return GroupRollouts(req.group_id, list(req.prompt_ids), completions, logprobs, start, end,
                             reasons, rewards=list(f.rewards), replica=f.replica if self.replicas > 1 else None,
                             texts=["x" * (n - 1) for n in f.lengths],  # what the ids say, for the completions log
                             token_versions=None if versions is None else [versions[:n] for n in f.lengths])

    def busy_s(self, start: float, end: float) -> list[float]:
        """Seconds each replica was busy (a group decoding, or loading weights) between ``start`` and ``end``."""
        with self._lock:
            spans = self.busy + [(f.start, f.finish, f.replica) for f in self._flights.values()]
            return busy_seconds(spans, self.replicas, start, end)

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        with self._lock:
            now = self.clock.now
            hit = [g for g in group_ids if g in self._flights and self._flights[g].finish > now]
            self._freeze([self._flights[g] for g in hit], now)  # the workers still run their calls
            for g in hit:
                f = self._flights.pop(g)
                if f.start < now:
                    self.busy.append((f.start, now, f.replica))
            for r in sorted({r for r, rep in enumerate(self._replicas) if rep.draining}):
                self._drained(r, now)
            if hit:
                self._schedule()
            return hit

    def num_inflight(self) -> int:
        return len(self._flights)

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """The new weights. Groups submitted from now on are generated with them. On ``asyncrl.simulate``'s clock
        each replica gets them when its transfer ends (``receive``); otherwise every replica has them at once."""
        with self._lock:
            self._version = version
            self.progress = float(weights["progress"])
            if not self.timed_updates:
                for rep in self._replicas:  # never before a timed load still under way: versions stay in time order
                    rep.versions.append((max(self.clock.now, rep.versions[-1][0]), version))

    def generate_greedy(self, prompts: Sequence[list[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        p = self.success()  # its own stream: evaluation must not shift the rollouts' draws
        rng = random.Random(self._version)
        return [[self.eos_id] if rng.random() < p else [0, self.eos_id] for _ in prompts]

    def state_dict(self) -> dict:
        """Version, learned progress, the draw RNG and (clock ticks) the virtual time: restored, the next rollouts
        are those of an uninterrupted run. Groups in flight are not included (the controller re-submits them)."""
        with self._lock:
            state = {"version": self._version, "progress": self.progress, "rng": self.rng.getstate()}
            if isinstance(self.clock, SimClock):
                state["now"] = self.clock.now
            return state

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._version, self.progress = int(state["version"]), float(state["progress"])
            self._replicas = [Replica([(-math.inf, self._version)]) for _ in range(self.replicas)]
            self._stops, self._worker_busy = self.free_turn_state()
            self.rng.setstate(state["rng"])
            if "now" in state and isinstance(self.clock, SimClock):
                self.clock.now = float(state["now"])

    def close(self) -> None:
        with self._lock:
            self._flights.clear()


class SimulatedPolicy:
    # Every version's logprobs are LOG_HALF - DRIFT * version: it "keeps" them all, so what-if runs and replays
    # report the importance weight's two parts (no mismatch: one engine; the staleness part exp(-DRIFT * lag)).
    capabilities = Capabilities(keeps_versions=True)

    def __init__(self, model_cfg, trainer_cfg: SimulatedTrainerConfig, loss_cfg, seed: int, tokenizer) -> None:
        self.model = trainer_cfg  # its knobs were checked when the config loaded
        self.steps = 0
        self.progress = 0.0
        self.version = 0  # = steps
        self._tokens = self.last_tokens = 0.0
        self._kept = 0.0  # this step's progress weights: tokens x stale_progress ** lag
        self._gap = Accumulator(GAP_METRICS)  # this step's importance-weight parts (it calls no Loss)

    def train_seconds(self, tokens: float, finishes_step: bool) -> float:
        """Virtual seconds to train a chunk of ``tokens`` completion tokens (and the optimizer step, if it ends
        one) on ``data_parallel`` ranks. The weight sync after a step comes on top (``sync_arrivals``)."""
        m = self.model
        speedup = m.data_parallel * m.scaling_efficiency ** math.log2(m.data_parallel)
        return m.train_s_per_token * tokens / speedup + (m.train_s_per_step if finishes_step else 0.0)

    def transfer_seconds(self) -> float:
        """One weight transfer: the fixed latency plus the bytes over the link."""
        m = self.model
        return m.sync_s + m.weight_bytes / (m.link_gb_per_s * 1e9)

    def sync_arrivals(self, replicas: int) -> list[float]:
        """Seconds after a step's end at which each replica has the new weights (``sync_fanout``); the trainer
        waits for the last."""
        hop = self.transfer_seconds()
        if self.model.sync_fanout == "sequential":
            return [(i + 1) * hop for i in range(replicas)]
        return [(i + 1).bit_length() * hop for i in range(replicas)]  # floor(log2(i + 1)) + 1 rounds

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """This version's logprobs: ``LOG_HALF - DRIFT * version`` on completion tokens, so a token generated
        ``L`` versions ago gets ``prev - gen = -DRIFT * L`` (an importance weight below 1, as stale data has)."""
        return torch.where(batch.loss_mask.bool(), LOG_HALF - DRIFT * self.version, batch.gen_logprobs)

    def _lags(self, batch: TrainBatch) -> list[int]:
        """Each completion's lag, read off its generator logprob ``LOG_HALF - DRIFT * v`` (one per row: a
        completion's tokens share one version). Plain Python: a few dozen numbers per chunk."""
        mask = batch.loss_mask
        means = ((batch.gen_logprobs * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
        return [max(0, self.version - round((LOG_HALF - lp) / DRIFT)) for lp in means]

    def keep_versions(self, versions: Sequence[int], current: int) -> list[int]:
        return sorted(versions)

    def logprobs_at(self, batch: TrainBatch, version: int, current: int) -> torch.Tensor:
        return torch.where(batch.loss_mask.bool(), LOG_HALF - DRIFT * version, batch.gen_logprobs)

    def begin_train_step(self) -> None:
        self._tokens = self._kept = 0.0
        self._gap.reset()

    def train_microbatches(self, batch: TrainBatch) -> dict[str, float]:
        per_row = batch.loss_mask.sum(1).tolist()
        keep = self.model.stale_progress
        self.last_tokens = sum(per_row)  # what asyncrl.simulate books the chunk's time by
        self._tokens += self.last_tokens
        self._sleep(self.train_seconds(self.last_tokens, finishes_step=False))
        self._kept += sum(n * keep ** lag for n, lag in zip(per_row, self._lags(batch)))
        if batch.prev_logprobs is not None:
            self._gap.add(gap_contributions(batch.prev_logprobs, batch))
        return {"tokens": float(sum(per_row))}

    def _sleep(self, seconds: float) -> None:
        if self.model.clock == "wall" and seconds > 0:
            time.sleep(seconds)

    def finish_train_step(self) -> dict[str, float]:
        self._sleep(self.model.train_s_per_step)
        share = self._kept / self._tokens if self._tokens else 1.0
        self.progress += self.model.reward_gain * share
        self.steps += 1
        self.version = self.steps
        return {"loss": 0.0, "tokens": self._tokens, "progress": self.progress, "progress_share": share,
                **self._gap.result()}

    def export_weights(self) -> dict[str, torch.Tensor]:
        self._sleep(self.model.sync_s)
        return {"steps": torch.tensor(self.steps), "progress": torch.tensor(self.progress, dtype=torch.float64)}

    def state_dict(self) -> dict:
        return {"steps": self.steps, "progress": self.progress}

    def load_state_dict(self, state: dict) -> None:
        self.steps = self.version = state["steps"]
        self.progress = state.get("progress", 0.0)

    def close(self) -> None:
        """Nothing to release."""
