"""Megatron-core training and vLLM generation colocated in one process on one GPU (run on the H200).

- Megatron's bf16 GPTModel against an exact fp32 transformers forward of the same weights.
- The Megatron optimizer path (DDP + ``get_megatron_optimizer``, the GPU default; there is no fallback to the torch
  optimizer: a policy that cannot build it fails here): a step learns; whole-step normalisation.
- Logprob agreement: vLLM's sampled-token logprobs and Megatron's, for the same weights, each against an exact fp32
  reference (transformers, fp32, TF32 off), before and after a weight update pushed from Megatron to vLLM.
  Criterion: each mean |error| at most twice the other's.

Numbers go to stdout and, when ``ASYNCRL_GPU_RESULTS`` names a folder, to ``megatron_vllm.json`` there.
Run: ``pytest -m gpu tests/gpu/test_megatron_vllm.py -s`` (or every file in one process: tests/gpu/conftest.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from asyncrl.algorithms import GRPOLoss, LossConfig, make_train_batch, token_logprobs  # noqa: E402
from tests.gpu.results import Results  # noqa: E402
from asyncrl.backends.hf import init_hf_model  # noqa: E402
from asyncrl.backends.megatron import MegatronPolicy  # noqa: E402
from asyncrl.backends.vllm import VLLMGenerator  # noqa: E402
from asyncrl.config import MegatronTrainerConfig, ModelConfig, VLLMGenerationConfig  # noqa: E402
from asyncrl.data import GenerationRequest  # noqa: E402
from asyncrl.tokenizer import build_tokenizer  # noqa: E402

MAX_NEW_TOKENS = 16
RESULTS = Results("megatron_vllm")
record = RESULTS.record
MODEL = ModelConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, dtype="bfloat16")


def trainer(**kw):
    return MegatronTrainerConfig(device="cuda", **kw)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def policy(tok):
    t0 = time.perf_counter()
    p = MegatronPolicy(MODEL, trainer(lr=1e-3), GRPOLoss(), 0, tok)  # no fallback: Megatron's optimizer or a failure
    record("megatron_init_s", round(time.perf_counter() - t0, 2))
    record("optimizer", p.optimizer_kind)
    assert p.dtype == torch.bfloat16 and p.optimizer_kind == "megatron"
    yield p
    p.close()


@pytest.fixture(scope="module")
def generator(policy, tok):
    # The KV pool from a token budget (a wave of 512 sequences of up to 128 tokens, 134 MB), not a share of the card:
    # the next file's engines need the memory back (tests/gpu/conftest.py)
    gen_cfg = VLLMGenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, kv_cache_tokens=65536)
    gen = VLLMGenerator(MODEL, gen_cfg, 0, tok)
    record("vllm_init_s", round(gen.init_seconds, 1))
    yield gen
    gen.close()


def fp32_reference(weights, hf_config):
    """transformers, fp32, TF32 off: the exact reference forward."""
    model = init_hf_model(hf_config, 0)
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.cuda().eval()


@torch.no_grad()
def reference_logprobs(model, batch):
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ids = batch.input_ids.cuda()
        return (token_logprobs(model(input_ids=ids).logits.float(), ids) * batch.loss_mask.cuda()).cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def random_batch(B=16, S=48, seed=0, prompt=8):
    from asyncrl.data import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, S), generator=g)
    mask = torch.zeros(B, S)
    mask[:, prompt:] = 1
    return TrainBatch(ids, torch.ones(B, S, dtype=torch.long), mask, torch.zeros(B, S), torch.randn(B, generator=g),
                      [B])


def mean_err(a, b, mask):
    return float((a - b).abs()[mask > 0].mean())


def test_megatron_fp32_matches_transformers(tok):
    policy = MegatronPolicy(MODEL.model_copy(update={"dtype": "float32"}), trainer(), GRPOLoss(), 1, tok)
    batch = random_batch()
    ref = reference_logprobs(fp32_reference(policy.export_weights(), policy.hf_config), batch)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ours = policy.logprobs(batch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    err = mean_err(ours, ref, batch.loss_mask)
    record("megatron_fp32_vs_ref_mean_abs", err)
    assert err < 1e-4
    policy.close()


def test_megatron_bf16_step_learns_and_normalises_over_the_whole_step(tok):
    batch = random_batch(seed=3)
    a = MegatronPolicy(MODEL, trainer(lr=1e-4, grad_clip=None), GRPOLoss(), 2, tok)
    b = MegatronPolicy(MODEL, trainer(lr=1e-4, grad_clip=None, micro_batch_size=4), GRPOLoss(), 2, tok)
    assert a.optimizer_kind == b.optimizer_kind == "megatron"  # the GPU default: what this test is about
    lp = a.logprobs(batch)
    batch = replace(batch, prev_logprobs=lp.clone(), gen_logprobs=lp.clone() - 0.05 * batch.loss_mask)
    a.begin_train_step()
    a.train_microbatches(batch)
    ma = a.finish_train_step()
    b.begin_train_step()
    b.train_microbatches(batch.slice(0, 5))
    b.train_microbatches(batch.slice(5, 16))
    mb = b.finish_train_step()
    record("normalisation_1_vs_2_chunks", {"loss": [ma["loss"], mb["loss"]], "grad_norm": [ma["grad_norm"], mb["grad_norm"]]})
    assert ma["tokens"] == mb["tokens"] == batch.num_tokens
    assert ma["loss"] == pytest.approx(mb["loss"], abs=2e-3)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=2e-2)
    losses = [ma["loss"]]
    t0 = time.perf_counter()
    for _ in range(3):
        a.begin_train_step()
        a.train_microbatches(batch)
        losses.append(a.finish_train_step()["loss"])
    torch.cuda.synchronize()
    record("megatron_bf16_losses", losses)
    record("megatron_step_ms_16x48", round((time.perf_counter() - t0) / 3 * 1e3, 2))
    assert losses[-1] < losses[0]
    # the torch-optimizer path runs on the GPU too
    c = MegatronPolicy(MODEL, trainer(lr=1e-4, optimizer="torch"), GRPOLoss(), 2, tok)
    c.begin_train_step()
    c.train_microbatches(batch)
    assert c.finish_train_step()["loss"] == pytest.approx(ma["loss"], abs=2e-3)
    for p in (a, b, c):
        p.close()


def poll_all(generator, n: int, timeout_s: float = 300.0) -> list:
    """Poll until ``n`` groups came back (a generator may return finished groups over several polls)."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} groups came back in {timeout_s} s"
        got += generator.poll()
    return got


def sample(generator, tok, first_id, groups=16, G=8):
    texts = [f"{i}+{i % 7}=" if i % 2 else f"copy {chr(97 + i % 26)}:" for i in range(groups)]
    generator.submit([GenerationRequest(first_id + i, tok.encode(t), G) for i, t in enumerate(texts)])
    out = sorted(poll_all(generator, groups), key=lambda g: g.group_id)
    for g in out:
        g.rewards = [float(len(c) % 3) for c in g.completion_ids]  # anything: gives non-zero advantages
    return out


def agreement(policy, generator, tok, first_id, tag):
    groups = sample(generator, tok, first_id)
    batch = make_train_batch(groups, LossConfig(), pad_id=tok.pad_token_id)
    t0 = time.perf_counter()
    meg = policy.logprobs(batch)
    t_lp = time.perf_counter() - t0
    ref = reference_logprobs(fp32_reference(policy.export_weights(), policy.hf_config), batch)
    vl, mask = batch.gen_logprobs, batch.loss_mask
    res = {
        "tokens": int(mask.sum()),
        "version": groups[0].gen_start_version,
        "vllm_vs_ref_mean": mean_err(vl, ref, mask),
        "megatron_vs_ref_mean": mean_err(meg, ref, mask),
        "vllm_vs_megatron_mean": mean_err(vl, meg, mask),
        "vllm_vs_ref_max": float((vl - ref).abs()[mask > 0].max()),
        "megatron_vs_ref_max": float((meg - ref).abs()[mask > 0].max()),
        "ref_mean_logprob": float(ref[mask > 0].mean()),
        "megatron_logprobs_s": round(t_lp, 4),
    }
    e_v, e_m = res["vllm_vs_ref_mean"], res["megatron_vs_ref_mean"]
    res["ratio"] = max(e_v, e_m) / max(min(e_v, e_m), 1e-12)
    res["pass"] = e_v <= 2 * e_m and e_m <= 2 * e_v
    record(f"agreement_{tag}", res)
    return res, groups, batch


def test_logprob_agreement_before_and_after_a_weight_update(policy, generator, tok):
    before, groups, batch = agreement(policy, generator, tok, 1000, "before_update")
    assert before["version"] == 0
    # train a few steps on what was sampled, push the weights, sample again
    for _ in range(3):
        batch = replace(batch, prev_logprobs=policy.logprobs(batch))
        policy.begin_train_step()
        policy.train_microbatches(batch)
        policy.finish_train_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    weights = policy.export_weights()
    torch.cuda.synchronize()
    t_export = time.perf_counter() - t0
    generator.load_weights(weights, 3)
    record("sync_small_model", {"export_s": round(t_export, 4), "load_s": round(generator.last_sync_seconds, 4)})
    assert generator.version == 3
    after, groups2, _ = agreement(policy, generator, tok, 1000, "after_update")  # same group ids: same seeds
    assert after["version"] == 3
    changed = any(a.completion_ids != b.completion_ids for a, b in zip(groups, groups2))
    assert changed and abs(after["ref_mean_logprob"] - before["ref_mean_logprob"]) > 1e-3
    assert before["pass"] and after["pass"], (before, after)
    assert before["vllm_vs_ref_mean"] < 2e-2 and after["vllm_vs_ref_mean"] < 2e-2


def test_a_wave_returns_every_completion_and_seeded_groups_do_not_depend_on_their_wave(generator, tok):
    """64 groups x 8 in one wave come back whole (8 completions each, within max_new_tokens), with per-group seeds a
    group resubmitted in another wave samples the same tokens, and without them the sampling is not fixed. Tokens/s
    of each wave are recorded, not asserted (speed is measured by benchmarks/bench_gpu.py)."""
    prompts = [tok.encode(f"prompt {i} ") for i in range(64)]
    out, waves = {}, {}
    for seeded in (True, False):
        generator.per_group_seed = seeded
        for rep in range(2):  # the same group ids twice: with per-group seeds the second wave repeats the first
            generator.submit([GenerationRequest(5000 + i, p, 8) for i, p in enumerate(prompts)])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            groups = sorted(poll_all(generator, 64), key=lambda g: g.group_id)
            dt = time.perf_counter() - t0
            assert [g.group_id for g in groups] == [5000 + i for i in range(64)]
            assert all(len(g.completion_ids) == 8 and all(1 <= len(c) <= MAX_NEW_TOKENS for c in g.completion_ids)
                       for g in groups)
            waves[seeded, rep] = [g.completion_ids for g in groups]
        tokens = sum(g.num_tokens for g in groups)
        out["seeded" if seeded else "unseeded"] = {"tokens": tokens, "s": round(dt, 3), "tok_per_s": round(tokens / dt)}
    generator.per_group_seed = True
    record("throughput_64x8x16", out)
    assert waves[True, 0] == waves[True, 1]
    assert waves[False, 0] != waves[False, 1]
