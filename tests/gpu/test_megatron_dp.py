"""Megatron-core with data_parallel 2 (two Ray rank actors, one GPU each, NCCL) trains like data_parallel 1 (one Ray
actor, one GPU) on the same batch, in bf16 with Megatron's DDP and optimizer (the GPU default), through the same
code path a run uses (``asyncrl/backends/ranks.py``: ``RankGroupPolicy`` over ``MegatronPolicy`` ranks).

The claim (docs/cluster.md): a 2-rank step equals the 1-rank step up to float reassociation. So each step is compared
from the same state: the 1-rank trainer takes ``STEPS`` optimizer steps on one fixed batch of 8 groups x 8
completions, saving its state (weights, fp32 master weights, Adam moments) before each; the 2-rank trainer (4 whole
groups a rank) loads each saved state and takes that one step. Trajectories compared without that reset drift apart
by design (weights that differ by rounding, which Adam turns into lr-sized moves of near-zero gradient entries), so
a bound on them would measure chaos, not the code; the runs of 2026-11-30 held later steps to 5% of step 1's norm
while the norms had shrunk 13x, which allowed 70-80% relative error.

Tolerance model (``TOLERANCES``). From one state, the two steps differ only in the order and blocking of sums: each
rank's forward/backward on its 32 sequences (bf16 matmuls accumulating in fp32) and the gradient all-reduce in fp32
(``grad_reduce_in_fp32``) instead of one 64-sequence pass. A reassociated sum of bf16 products is off by at most a
few units of bf16's roundoff ``u = 2**-8`` relative to the sum of magnitudes, and the per-step scalars (loss, the
gradient norm) are such sums: each is held to ``u`` relative (measured at step 1 of the unsynced runs: 2e-6 for the
norm, 1e-4 for the loss). The token normaliser is an integer count: equal. The logprobs of the batch from the same
state differ only by the forward's blocking: mean absolute difference at most ``u`` times the mean |logprob|. After
the step, the update of the logprobs (after minus before) points the same way in both: cosine at least ``1 - u``
(Adam moves an entry whose gradient is within rounding of zero by lr either way, so a few entries may differ).

Needs only torch, megatron-core, Ray and the project (with pydantic): no vLLM. Skips without 2 CUDA GPUs.
On a machine with two GPUs and the stack of docs/gpu.md, from the repo root:
``PYTHONPATH=${SITE:+$SITE:}$PWD python -m pytest -q -s -o addopts="" tests/gpu/test_megatron_dp.py`` (an absolute PYTHONPATH,
plus any ``--target`` site folder: Ray actors inherit it). Prints ``RESULT`` lines; with ``ASYNCRL_GPU_RESULTS``
set, also writes ``megatron_dp.json`` there.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:  # before importing Megatron: on a CPU machine this file costs nothing
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("ray")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from asyncrl import load_config  # noqa: E402
from asyncrl.algorithms import GRPOLoss  # noqa: E402
from asyncrl.data import TrainBatch  # noqa: E402
from asyncrl.tokenizer import build_tokenizer  # noqa: E402

STEPS = 4
MODEL = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6,
         "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False}
U = 2.0 ** -8  # bf16's unit roundoff
TOLERANCES = {"loss_rel": U, "grad_norm_rel": U, "logprobs_rel": U, "update_cosine_min": 1 - U}


def make_batch(groups: int = 8, group_size: int = 8, prompt: int = 8, completion: int = 24, seed: int = 0,
               vocab: int = 259) -> TrainBatch:
    """Random tokens, ragged completions (right padding), a random advantage per completion."""
    g = torch.Generator().manual_seed(seed)
    B, S = groups * group_size, prompt + completion
    ids = torch.randint(3, vocab, (B, S), generator=g)
    attn = torch.ones(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S)
    for i in range(B):
        n = completion - (i * 7) % 11
        loss_mask[i, prompt:prompt + n] = 1
        attn[i, prompt + n:] = 0
        ids[i, prompt + n:] = 0
    advantages = torch.randn(B, generator=g)
    return TrainBatch(ids, attn, loss_mask, torch.zeros(B, S), advantages, [group_size] * groups)


def trainer(data_parallel: int, device: str = "cuda", dtype: str = "bfloat16"):
    """A ``data_parallel``-rank Megatron trainer in Ray actors (a run's code path) and how long it took to build."""
    from asyncrl.backends.megatron import MegatronPolicy
    from asyncrl.backends.ranks import RankGroupPolicy
    from asyncrl.backends.ray import ensure_ray, remote

    cfg = load_config("quickstart", seed=0, model={**MODEL, "dtype": dtype},
                      trainer={"backend": "megatron", "device": device, "placement": "ray",
                               "data_parallel": data_parallel, "lr": 1e-4, "grad_clip": 1.0})
    ensure_ray()
    args = (cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, build_tokenizer())
    t0 = time.perf_counter()
    policy = RankGroupPolicy.start(MegatronPolicy, args, cfg) if data_parallel > 1 else remote(
        MegatronPolicy, args, cfg.trainer)
    return policy, time.perf_counter() - t0


def step(policy, batch: TrainBatch) -> dict:
    """One optimizer step on ``batch``: its metrics, and the batch's logprobs before and after it."""
    before = policy.logprobs(batch)
    policy.begin_train_step()
    policy.train_microbatches(batch)
    m = policy.finish_train_step()
    return {**{k: m[k] for k in ("loss", "grad_norm", "normaliser")}, "before": before, "after": policy.logprobs(batch)}


def batch_for(policy) -> TrainBatch:
    batch = make_batch()
    start = policy.logprobs(batch)
    # the generator's logprobs a little off the trainer's: importance weights that are not all 1
    return replace(batch, prev_logprobs=start, gen_logprobs=start - 0.05 * batch.loss_mask)


def run_one_rank(steps: int = STEPS, **kw) -> dict:
    """The 1-rank trajectory: ``steps`` steps, the state before each saved (CPU copies)."""
    policy, built_s = trainer(1, **kw)
    try:
        batch = batch_for(policy)
        states, rows = [], []
        for _ in range(steps):
            states.append(policy.state_dict())
            rows.append(step(policy, batch))
    finally:
        policy.close()
    return {"batch": batch, "states": states, "steps": rows, "build_s": built_s}


def replay_two_ranks(one: dict, **kw) -> dict:
    """Each of the 1-rank run's steps again on 2 ranks, from the state the 1-rank run had before it."""
    policy, built_s = trainer(2, **kw)
    try:
        rows = []
        for state in one["states"]:
            policy.load_state_dict(state)
            rows.append(step(policy, one["batch"]))
    finally:
        policy.close()
    return {"steps": rows, "build_s": built_s}


def record(results: dict) -> None:
    for key, value in results.items():
        print(f"RESULT {key} = {json.dumps(value)}", flush=True)
    out = os.environ.get("ASYNCRL_GPU_RESULTS")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "megatron_dp.json"), "w") as f:
            json.dump(results, f, indent=1)


def compare(one: dict, two: dict) -> dict:
    """Per step, from the same state: the numbers the test checks (printed and recorded either way)."""
    mask = one["batch"].loss_mask > 0
    out: dict = {key: [[a[key], b[key]] for a, b in zip(one["steps"], two["steps"])]
                 for key in ("loss", "grad_norm", "normaliser")}
    for key in ("logprobs_before_mean_abs", "logprobs_before_rel", "update_cosine", "update_mean_abs"):
        out[key] = []
    for a, b in zip(one["steps"], two["steps"]):
        gap = float((a["before"] - b["before"])[mask].abs().mean())
        out["logprobs_before_mean_abs"].append(gap)
        out["logprobs_before_rel"].append(gap / float(a["before"][mask].abs().mean()))
        d1, d2 = (a["after"] - a["before"])[mask], (b["after"] - b["before"])[mask]
        out["update_cosine"].append(float(torch.nn.functional.cosine_similarity(d1, d2, dim=0)))
        out["update_mean_abs"].append(float(d1.abs().mean()))
    out["build_s"] = [round(one["build_s"], 1), round(two["build_s"], 1)]
    return out


def check(r: dict) -> None:
    t = TOLERANCES
    for i in range(len(r["loss"])):
        (l1, l2), (g1, g2), (n1, n2) = r["loss"][i], r["grad_norm"][i], r["normaliser"][i]
        assert n1 == n2, f"step {i + 1}: token normaliser {n1} vs {n2} (both ranks' tokens count once)"
        assert abs(l1 - l2) <= t["loss_rel"] * max(abs(l1), 0.1), f"step {i + 1}: loss {l1} vs {l2}"
        assert abs(g1 - g2) <= t["grad_norm_rel"] * g1, f"step {i + 1}: gradient norm {g1} vs {g2}"
        assert r["logprobs_before_rel"][i] <= t["logprobs_rel"], f"step {i + 1}: forward differs, {r}"
        # the step moved the logprobs well beyond what the two forwards differ by (else the cosine says nothing)
        assert r["update_mean_abs"][i] > 10 * r["logprobs_before_mean_abs"][i], f"step {i + 1} moved nothing: {r}"
        assert r["update_cosine"][i] >= t["update_cosine_min"], f"step {i + 1}: update cosine, {r}"


def test_megatron_data_parallel_2_matches_data_parallel_1():
    import ray

    import megatron.core

    results = {"machine": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "ray": ray.__version__,
               "torch": torch.__version__, "megatron_core": megatron.core.__version__, "tolerances": TOLERANCES}
    one = run_one_rank()
    record({**results, "loss_dp1": [r["loss"] for r in one["steps"]],  # on record even if the 2-rank run fails
            "grad_norm_dp1": [r["grad_norm"] for r in one["steps"]]})
    two = replay_two_ranks(one)
    results.update(compare(one, two))
    record(results)
    check(results)
