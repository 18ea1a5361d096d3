"""The training-inference gap, apart, on the GPU engines (run on the H200): vLLM generates, Megatron-core trains,
colocated in one process. The mismatch between the two engines at the same weights is small and positive
(``mismatch_kl`` > 0: two engines, bf16), its importance-weight part near 1; Megatron keeps the weights of the
version a stale group was sampled with (``KeptVersions``), so every stale token is measured; ``logprobs_at`` under
the current version is ``logprobs`` and leaves the parameters as they were.

Numbers go to stdout (``RESULT`` lines). Run: ``pytest -o addopts="" -s tests/gpu/test_gap.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from asyncrl import Controller, load_config  # noqa: E402
from asyncrl.algorithms import make_train_batch  # noqa: E402


def test_vllm_and_megatron_mismatch_is_small_and_positive_and_stale_tokens_are_measured():
    # gap_completions None: every completion's stale tokens (the default reads one completion a group). The KV pool
    # from a token budget (two steps of 512 sequences of up to 64 tokens, 134 MB), not the preset's share of the
    # card: tests/gpu/conftest.py says why
    cfg = load_config("gpu_quickstart", eval_every=None, sampler={"name": "in_order", "max_lookahead_versions": 1},
                      generation={"max_new_tokens": 8, "kv_cache_tokens": 65536}, loss={"gap_completions": None})
    ctrl = Controller.from_config(cfg)
    try:
        for _ in range(6):
            ctrl.tick()
        m = ctrl.metrics.iloc[1:]  # lag 1 from step 1 on: every token stale, its version's weights kept
        print("RESULT gap", m[["mismatch_kl", "is_mismatch_mean", "is_mismatch_max", "is_staleness_mean",
                                "is_staleness_max", "gap_tokens", "completion_tokens"]].to_dict("list"), flush=True)
        assert (m.gap_tokens == m.completion_tokens).all()
        assert (m.mismatch_kl > 0).all() and (m.mismatch_kl < 0.05).all()
        assert ((m.is_mismatch_mean - 1).abs() < 0.05).all()
        policy = ctrl.policy
        params = sum(p.numel() * p.element_size() for p in policy.model.parameters())
        assert policy.kept_bytes() in (params, 2 * params)  # one or two versions held, each the whole model
        # logprobs_at the current version is logprobs; a kept version's pass leaves the parameters untouched
        while not ctrl.buffer.ready_slots():
            ctrl.rollout_tick()
        group = ctrl.buffer.ready_slots()[0].rollouts
        batch = make_train_batch([group], cfg.loss, ctrl.tokenizer.pad_token_id)
        before = [p.detach().clone() for p in policy.model.parameters()]
        T = ctrl.trainer_version
        assert torch.equal(policy.logprobs_at(batch, T, T), policy.logprobs(batch))
        older = policy.logprobs_at(batch, max(v for v in policy._kept if v < T), T)  # the current ones are kept too
        assert not torch.equal(older, policy.logprobs(batch))  # other weights, other numbers
        assert all(torch.equal(a, p) for a, p in zip(before, policy.model.parameters()))
    finally:
        ctrl.close()
