"""``device_sharing: overlap`` on one GPU: Megatron's passes beside vLLM's decoding (asyncrl/backends/device_lock.py).

- An asynchronous run of the generation-heavy shape with overlap trains its steps at lag <= 1 on two pump threads,
  and the trainer's passes really ran beside vLLM's engine steps: a "MegatronPolicy beside" span overlaps a
  "VLLMGenerator" span in time. After the run the device takes turns again.
- The same batch's logprobs computed beside a decoding vLLM equal the trainer's own turn's (the stream changes when
  the kernels run, not what they compute).
Skipped without CUDA, vLLM and Megatron-core. Numbers go to ``device_sharing.json`` under ``ASYNCRL_GPU_RESULTS``.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from asyncrl import Controller, load_config  # noqa: E402
from asyncrl.algorithms import LossConfig, make_train_batch  # noqa: E402
from asyncrl.backends.device_lock import (  # noqa: E402
    device_lock_spans, device_lock_stats, device_sharing, share_device)
from asyncrl.data import GenerationRequest  # noqa: E402
from tests.gpu.results import Results  # noqa: E402

RESULTS = Results("device_sharing")
record = RESULTS.record


def overlapping(a: list, b: list) -> float:
    """Seconds during which some span of ``a`` and some span of ``b`` both ran (spans sorted by start)."""
    total = 0.0
    for start, end in a:
        for s, e in b:
            if s >= end:
                break
            total += max(0.0, min(end, e) - max(start, s))
    return total


def test_an_overlapping_run_trains_with_the_passes_beside_decoding():
    cfg = load_config("gpu_gen_heavy", eval_every=None, device_sharing="overlap")
    with Controller.from_config(cfg) as ctrl:
        assert not ctrl.lockstep  # a thread per pump: the train pump's passes do not wait for the rollout pump's
        device_lock_stats(reset=True)
        ctrl.run(6, progress=False)
        m = ctrl.metrics
        assert len(m) == 6 and int(m.lag_max.max()) <= 1
        spans = device_lock_spans()
        beside = sorted((s, e) for n, s, e in spans if n == "MegatronPolicy beside")
        vllm = sorted((s, e) for n, s, e in spans if n == "VLLMGenerator")
        both = overlapping(beside, vllm)
        record("overlap", {"steps_per_s": float(len(m) / m.step_time_s.sum()), "stats": device_lock_stats(),
                           "beside_s": sum(e - s for s, e in beside), "beside_while_decoding_s": both})
        assert beside and both > 0, "the trainer's passes never ran while vLLM held the device"
        assert device_sharing(cfg.trainer.device) == "turns"  # hand ticks after the run take turns again

        # The same batch, the trainer's turn against beside a decoding vLLM: the same logprobs.
        policy, generator, tok = ctrl.policy, ctrl.generator, ctrl.tokenizer
        prompts = [tok.encode(f"copy {chr(97 + i)}:") for i in range(8)]
        generator.submit([GenerationRequest(9000 + i, p, 4) for i, p in enumerate(prompts)])
        groups = []
        while len(groups) < 8:  # (groups the run left in flight come back too: not these)
            groups += [g for g in generator.poll(1.0) if g.group_id >= 9000]
        for g in groups:
            g.rewards = [float(i % 2) for i in range(len(g.completion_ids))]
        batch = make_train_batch(groups, LossConfig(), pad_id=tok.pad_token_id)
        turn = policy.logprobs(batch)
        share_device(cfg.trainer.device, "overlap")
        stop, sampled = threading.Event(), []

        def decode() -> None:  # vLLM stepping on its high-priority stream while the passes run beside it
            n = 0
            while not stop.is_set():
                generator.submit([GenerationRequest(10_000 + n * 8 + i, p, 16) for i, p in enumerate(prompts)])
                got = 0
                while got < 8 and not stop.is_set():
                    out = generator.poll(0.5)
                    got += len(out)
                    sampled.extend(out)
                n += 1

        thread = threading.Thread(target=decode, daemon=True)
        thread.start()
        try:
            beside_lp = [policy.logprobs(batch) for _ in range(3)]
        finally:
            stop.set()
            thread.join(60)
            share_device(cfg.trainer.device, "turns")
        err = max(float((b - turn).abs().max()) for b in beside_lp)
        record("logprobs_beside_vs_turn_max_abs", err)
        assert err <= 1e-5, err
        # what vLLM sampled meanwhile is what it says it sampled: the trainer's logprobs of those tokens agree with
        # vLLM's own as closely as two engines do (~0.002 a token in test_megatron_vllm.py), not as garbage would
        sampled = [g for g in sampled if g.group_id >= 10_000]
        assert sampled, "vLLM finished no group while the passes ran"
        for g in sampled:
            g.rewards = [float(i % 2) for i in range(len(g.completion_ids))]
        batch = make_train_batch(sampled, LossConfig(), pad_id=tok.pad_token_id)
        mask = batch.loss_mask > 0
        gap = float((policy.logprobs(batch) - batch.gen_logprobs).abs()[mask].mean())
        record("vllm_vs_megatron_mean_abs_while_beside", gap)
        assert gap < 0.02, gap
