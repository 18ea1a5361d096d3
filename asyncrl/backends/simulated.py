"""``simulated``: backends with no model, for what-if studies of samplers and throughput.

The generator draws completion lengths and per-group latencies from a latency model and rewards from a reward
model that improves with the weight version it generated with (so staleness has a visible cost); the policy
"trains" by sleeping a time proportional to the tokens it is given. Everything else — buffer, sampler, pumps,
trace, metrics — is the real controller.

Options (``generation.options`` / ``trainer.options``):
- generator: ``latency_s`` (mean seconds per group, 0 = finished at once), ``latency_jitter`` (lognormal sigma),
  ``reward_base`` (success probability at version 0), ``reward_gain`` (added per version), ``reward_max``.
- policy: ``train_s_per_token`` (seconds of simulated training per completion token).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from asyncrl.backends.base import GenerationRequest, GroupRollouts, TrainBatch

LOG_HALF = math.log(0.5)


class SimulatedGenerator:
    def __init__(self, model_cfg, gen_cfg, seed: int, tokenizer) -> None:
        opts = dict(gen_cfg.options)
        self.latency_s = float(opts.pop("latency_s", 0.0))
        self.jitter = float(opts.pop("latency_jitter", 0.5))
        self.reward_base = float(opts.pop("reward_base", 0.1))
        self.reward_gain = float(opts.pop("reward_gain", 0.01))
        self.reward_max = float(opts.pop("reward_max", 0.95))
        if opts:
            raise ValueError(f"unknown simulated generation options {sorted(opts)}; allowed: latency_s, "
                             "latency_jitter, reward_base, reward_gain, reward_max")
        self.max_new_tokens = gen_cfg.max_new_tokens
        self.eos_id = tokenizer.eos_token_id
        self.rng = random.Random(seed)
        self._version = 0
        self._queue: list[tuple[float, GenerationRequest, int]] = []  # (ready_at, request, start version)
        self._cond = threading.Condition()

    @property
    def version(self) -> int:
        return self._version

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        now = time.perf_counter()
        with self._cond:
            for req in requests:
                delay = self.latency_s * self.rng.lognormvariate(0.0, self.jitter) if self.latency_s else 0.0
                self._queue.append((now + delay, req, self._version))
            self._cond.notify_all()

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._cond:
            while True:
                now = time.perf_counter()
                done = [item for item in self._queue if item[0] <= now]
                if done or not self._queue or (deadline is not None and now >= deadline):
                    break
                wake = min(item[0] for item in self._queue)
                self._cond.wait(max(0.0, min(wake, deadline or wake) - now))
            self._queue = [item for item in self._queue if item[0] > now]
            return [self._rollouts(req, start) for _, req, start in done]

    def _rollouts(self, req: GenerationRequest, start_version: int) -> GroupRollouts:
        p = min(self.reward_max, self.reward_base + self.reward_gain * start_version)
        completions, logprobs, rewards = [], [], []
        for _ in range(req.n):  # content is irrelevant here, only lengths and rewards are modelled
            length = self.rng.randint(1, self.max_new_tokens)
            completions.append([ord("x")] * (length - 1) + [self.eos_id])
            logprobs.append([LOG_HALF] * length)
            rewards.append(1.0 if self.rng.random() < p else 0.0)
        return GroupRollouts(req.group_id, list(req.prompt_ids), completions, logprobs, start_version, self._version,
                             ["stop"] * req.n, rewards=rewards)

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        wanted = set(group_ids)
        with self._cond:
            hit = [req.group_id for _, req, _ in self._queue if req.group_id in wanted]
            self._queue = [item for item in self._queue if item[1].group_id not in wanted]
        return hit

    def num_inflight(self) -> int:
        return len(self._queue)

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        with self._cond:
            self._version = version

    def generate_greedy(self, prompts: Sequence[list[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        p = min(self.reward_max, self.reward_base + self.reward_gain * self._version)
        return [[self.eos_id] if self.rng.random() < p else [0, self.eos_id] for _ in prompts]

    def close(self) -> None:
        with self._cond:
            self._queue.clear()


class SimulatedPolicy:
    def __init__(self, model_cfg, trainer_cfg, loss_cfg, seed: int, tokenizer) -> None:
        opts = dict(trainer_cfg.options)
        self.train_s_per_token = float(opts.pop("train_s_per_token", 0.0))
        if opts:
            raise ValueError(f"unknown simulated trainer options {sorted(opts)}; allowed: train_s_per_token")
        self.steps = 0
        self._tokens = 0.0

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return batch.gen_logprobs.clone()

    def begin_train_step(self) -> None:
        self._tokens = 0.0

    def train_microbatches(self, batch: TrainBatch) -> dict[str, float]:
        tokens = float(batch.loss_mask.sum())
        if self.train_s_per_token:
            time.sleep(self.train_s_per_token * tokens)
        self._tokens += tokens
        return {"tokens": tokens}

    def finish_train_step(self) -> dict[str, float]:
        self.steps += 1
        return {"loss": 0.0, "tokens": self._tokens}

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {"steps": torch.tensor(self.steps)}

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
