"""A latency model fitted to a real synchronous run (``calibrate``), the overlap probe that measures how much the two
stages slow each other on one machine (``measure_overlap``), and the prediction of the same workload under another
sampler (``Calibration.predict``).

Invariants: a fit reads only the run's ``metrics.csv`` and ``config.yaml`` (no trace); the fitted knobs are the
simulated backends' own (``SimulatedGeneration``, ``SimulatedTraining``), so a calibrated config is an ordinary config.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from asyncrl.backends.simulated import SimulatedGeneration, SimulatedTraining, draw_length
from asyncrl.config import Config, load_config
from asyncrl.controller import Controller
from asyncrl.simulate.studies import SYNC, simulate


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
