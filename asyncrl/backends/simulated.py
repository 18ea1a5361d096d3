"""``simulated``: backends with no model, on a virtual clock, for what-if studies of samplers and throughput.

Everything but the model is real: buffer, sampler, pumps, trace and metrics are the controller's. What is
modelled, with typed knobs (``SimulatedGeneration``, the ``generation`` section's, and ``SimulatedTraining``, the
``trainer`` section's, both in asyncrl/config.py so that ``load_config`` checks them):
- **Latency.** A group's ``G`` completions decode together: it takes ``prefill_s + decode_s_per_token x`` its
  longest completion, whose lengths come from a (long-tailed, if asked) distribution clipped to
  ``[1, max_new_tokens]``. At most ``concurrency`` groups decode at once; the rest wait, first in first out.
  Training a chunk takes ``train_s_per_token`` per completion token, a step adds ``train_s_per_step``, and a weight
  sync takes ``sync_s``, during which the generator stops decoding. While a chunk trains and a group decodes at
  the same time, both go ``overlap_slowdown`` times slower (they share cores, memory bandwidth or an interpreter).
- **Reward.** The policy accumulates *progress*: a step on fresh data adds ``reward_gain``, a step on data ``L``
  versions stale adds ``reward_gain * stale_progress ** L``. Progress travels to the generator with the weights; a
  group generated at version ``v`` succeeds with probability ``min(reward_max, reward_base + progress(v))``.
- **Importance weights.** Token logprobs drift by ``DRIFT`` per version, so stale rollouts carry importance weights
  ``exp(-DRIFT * lag)`` as real ones do; the policy reads each token's lag back from that difference.

Time is virtual by default (``clock: ticks``, a ``SimClock``): nothing sleeps. Stepped by hand (or under
``Controller.run``) each ``poll`` is one rollout tick and advances the clock by ``rollout_tick_s``, so a group
finishes after a number of rollout ticks drawn from the model, the same every time for a seed. Under
``asyncrl.simulate`` a discrete-event loop owns the clock instead (``clock.stepping = False``) and asks
``next_event_time``/``train_seconds`` how long things take. ``clock: wall`` (in both sections) makes the same
seconds real: ``poll`` waits for them and training sleeps, for exercising ``Controller.run`` in real time.

Invariants (kept here): random draws happen only in ``submit`` (lengths and rewards, in request order), so a
seed and the order of submissions fix every outcome; a group's finish time depends only on the groups submitted
before it, aborts and pauses, never on when it is polled.
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

from asyncrl.config import SimulatedGeneration, SimulatedGenerationConfig, SimulatedTrainerConfig, SimulatedTraining
from asyncrl.data import GenerationRequest, GroupRollouts, TrainBatch

__all__ = ["SimulatedGeneration", "SimulatedTraining", "SimulatedGenerator", "SimulatedPolicy", "draw_length"]

LOG_HALF = math.log(0.5)
DRIFT = 0.01  # token logprobs at version v are LOG_HALF - DRIFT * v: stale tokens carry IS weights exp(-DRIFT * lag)


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


class SimClock:
    """Virtual seconds shared by a simulation's parts. ``stepping``: each generator poll advances ``now``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stepping = True


class WallClock:
    """Real seconds since the generator was built (``clock: wall``)."""

    stepping = False

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    @property
    def now(self) -> float:
        return time.perf_counter() - self._origin


@dataclass
class _Flight:
    request: GenerationRequest
    version: int
    seconds: float  # decoding time, drawn at submit
    lengths: list[int]
    rewards: list[float]
    start: float | None = None
    finish: float | None = None


class SimulatedGenerator:
    def __init__(self, model_cfg, gen_cfg: SimulatedGenerationConfig, seed: int, tokenizer) -> None:
        self.model = gen_cfg  # its knobs were checked when the config loaded
        self.max_new_tokens = gen_cfg.max_new_tokens
        self.eos_id = tokenizer.eos_token_id
        self.rng = random.Random(seed)
        self.clock = SimClock() if self.model.clock == "ticks" else WallClock()
        self.progress = 0.0  # what the weights have learned (see the module docstring), set by load_weights
        self._version = 0
        self._flights: dict[int, _Flight] = {}  # in submission order: the order the engine starts them
        self._paused_until = 0.0
        self.busy: list[tuple[float, float]] = []  # (start, end) of every decoded group and every weight load
        self.drawn = [0, 0.0]  # groups submitted, and their drawn decoding seconds in total
        self._lock = threading.Condition()  # Controller.run calls in from two pumps; a wall-clock poll waits on it

    @property
    def version(self) -> int:
        return self._version

    def length(self) -> int:
        return draw_length(self.model, self.max_new_tokens, self.rng)

    def success(self) -> float:
        return min(self.model.reward_max, self.model.reward_base + self.progress)

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        with self._lock:
            p = self.success()
            for req in requests:
                lengths = [self.length() for _ in range(req.n)]
                rewards = [1.0 if self.rng.random() < p else 0.0 for _ in range(req.n)]
                seconds = self.model.prefill_s + self.model.decode_s_per_token * max(lengths)
                self.drawn[0] += 1
                self.drawn[1] += seconds
                self._flights[req.group_id] = _Flight(req, self._version, seconds, lengths, rewards)
            self._schedule()
            self._lock.notify_all()

    def _schedule(self) -> None:
        """Start and finish times of every group not started yet: first in first out onto ``concurrency`` slots,
        none before ``now`` or before a weight load ends. Started groups keep theirs."""
        now = self.clock.now
        started = [f for f in self._flights.values() if f.start is not None and f.start <= now]
        waiting = [f for f in self._flights.values() if f.start is None or f.start > now]
        slots = self.model.concurrency
        free = [f.finish for f in started] + [now] * max(0, (slots or len(waiting)) - len(started))
        heapq.heapify(free)
        for f in waiting:
            f.start = max(heapq.heappop(free), now, self._paused_until)
            f.finish = f.start + f.seconds
            heapq.heappush(free, f.finish)

    def next_event_time(self) -> float | None:
        """When the next group finishes (virtual seconds), or None with nothing in flight."""
        with self._lock:
            return min((f.finish for f in self._flights.values()), default=None)

    def pause(self, seconds: float) -> None:
        """A weight load: groups decoding now finish ``seconds`` later; none starts before it ends."""
        with self._lock:
            now = self.clock.now
            self._paused_until = max(self._paused_until, now) + seconds
            self.busy.append((now, now + seconds))
            for f in self._flights.values():
                if f.start <= now < f.finish:
                    f.finish += seconds
            self._schedule()

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        """Groups finished by ``clock.now``, in finishing order. With virtual time it never waits (when stepping,
        this poll is one rollout tick and moves the clock by ``rollout_tick_s``); on the wall clock it waits up to
        ``timeout`` (None: until one finishes) for the next group."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._lock:
            if self.clock.stepping and self._flights:
                self.clock.now += self.model.rollout_tick_s
            while True:
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
            for f in done:
                del self._flights[f.request.group_id]
                self.busy.append((f.start, f.finish))
            if done:
                self._schedule()
            return [self._rollouts(f) for f in done]

    def _rollouts(self, f: _Flight) -> GroupRollouts:
        req, logprob = f.request, LOG_HALF - DRIFT * f.version
        completions = [[ord("x")] * (n - 1) + [self.eos_id] for n in f.lengths]  # content is not modelled
        logprobs = [[logprob] * n for n in f.lengths]
        reasons = ["length" if n == self.max_new_tokens else "stop" for n in f.lengths]
        return GroupRollouts(req.group_id, list(req.prompt_ids), completions, logprobs, f.version, self._version,
                             reasons, rewards=list(f.rewards))

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        with self._lock:
            now = self.clock.now
            hit = [g for g in group_ids if g in self._flights and self._flights[g].finish > now]
            for g in hit:
                f = self._flights.pop(g)
                if f.start < now:
                    self.busy.append((f.start, now))
            if hit:
                self._schedule()
            return hit

    def num_inflight(self) -> int:
        return len(self._flights)

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self._version = version
            self.progress = float(weights["progress"])

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
            self.rng.setstate(state["rng"])
            if "now" in state and isinstance(self.clock, SimClock):
                self.clock.now = float(state["now"])

    def close(self) -> None:
        with self._lock:
            self._flights.clear()


class SimulatedPolicy:
    def __init__(self, model_cfg, trainer_cfg: SimulatedTrainerConfig, loss_cfg, seed: int, tokenizer) -> None:
        self.model = trainer_cfg  # its knobs were checked when the config loaded
        self.steps = 0
        self.progress = 0.0
        self.version = 0  # = steps
        self._tokens = self.last_tokens = 0.0
        self._kept = 0.0  # this step's progress weights: tokens x stale_progress ** lag

    def train_seconds(self, tokens: float, finishes_step: bool) -> float:
        """Virtual seconds to train a chunk of ``tokens`` completion tokens (and the optimizer step, if it ends
        one). The weight sync after a step is ``model.sync_s`` on top."""
        m = self.model
        return m.train_s_per_token * tokens + (m.train_s_per_step if finishes_step else 0.0)

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

    def begin_train_step(self) -> None:
        self._tokens = self._kept = 0.0

    def train_microbatches(self, batch: TrainBatch) -> dict[str, float]:
        per_row = batch.loss_mask.sum(1).tolist()
        keep = self.model.stale_progress
        self.last_tokens = sum(per_row)  # what asyncrl.simulate books the chunk's time by
        self._tokens += self.last_tokens
        self._sleep(self.train_seconds(self.last_tokens, finishes_step=False))
        self._kept += sum(n * keep ** lag for n, lag in zip(per_row, self._lags(batch)))
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
        return {"loss": 0.0, "tokens": self._tokens, "progress": self.progress, "progress_share": share}

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
