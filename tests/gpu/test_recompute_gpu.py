"""``trainer.gradient_checkpointing`` on the Megatron trainer, on a GPU: Megatron-core's full activation recompute
(asyncrl/backends/megatron.py maps the knob to ``recompute_granularity 'full'``, ``recompute_method 'uniform'``,
``recompute_num_layers 1``), unpatched (its CUDA RNG tracker is real here).

For each attention path (``flex``, the CUDA default, whose ``BlockMask`` is handed beside the call:
``megatron_forward._hand_over_block_mask``; and ``unfused``), one bf16 training step of the same batch, with and
without recompute, on fresh policies of one seed: the same loss and gradient norm (up to bf16 kernel noise), and
a lower peak of memory allocated during the step (``torch.cuda.max_memory_allocated`` over what was allocated when
the step began: the activations). ``micro_batch_tokens`` is fixed, so both runs make the same passes.

Numbers (peaks, seconds, losses) go to stdout and, when ``ASYNCRL_GPU_RESULTS`` names a folder, to
``recompute_gpu.json`` there. Run: ``pytest tests/gpu/test_recompute_gpu.py -s`` (~1-2 min on an H100)."""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")

from asyncrl.algorithms import GRPOLoss, LossConfig  # noqa: E402
from asyncrl.backends.megatron import MegatronPolicy  # noqa: E402
from asyncrl.config import MegatronTrainerConfig, ModelConfig  # noqa: E402
from asyncrl.data import TrainBatch  # noqa: E402
from asyncrl.tokenizer import build_tokenizer  # noqa: E402
from tests.gpu.results import Results  # noqa: E402

RESULTS = Results("recompute_gpu")
record = RESULTS.record
# ~90M parameters: one 8,192-position pass keeps ~3.5 GB of activations with flex (more unfused); recompute ~0.6 GB
MODEL = ModelConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4, max_position_embeddings=1024, dtype="bfloat16")
ROWS, WIDTH, PROMPT = 16, 512, 32


def batch(seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (ROWS, WIDTH), generator=g)
    mask = torch.zeros(ROWS, WIDTH)
    mask[:, PROMPT:] = 1
    return TrainBatch(ids, torch.ones(ROWS, WIDTH, dtype=torch.long), mask, torch.zeros(ROWS, WIDTH),
                      torch.randn(ROWS, generator=g), [ROWS])


def _policy(tok, cfg) -> MegatronPolicy:
    return MegatronPolicy(MODEL, cfg, GRPOLoss(LossConfig(entropy_coef=0.01)), 0, tok)


def _close(policy) -> None:
    policy.close()
    gc.collect()
    torch.cuda.empty_cache()


def one_step(tok, attention: str, recompute: bool) -> dict:
    """One measured step of a fresh policy (seed 0), after a warm-up step of another one (flex's compile,
    Megatron's buffers and kernels' first calls are not in the numbers)."""
    cfg = MegatronTrainerConfig(device="cuda", lr=1e-5, attention=attention, micro_batching="packed",
                                micro_batch_tokens=ROWS * WIDTH, gradient_checkpointing=recompute)
    data = batch()
    warm = _policy(tok, cfg)
    try:
        assert (warm.transformer_config.recompute_granularity == "full") == recompute
        lp = warm.logprobs(data)
        data = replace(data, prev_logprobs=lp, gen_logprobs=lp - 0.05 * data.loss_mask)
        warm.begin_train_step()
        warm.train_microbatches(data)
        warm.finish_train_step()
    finally:
        _close(warm)
    policy = _policy(tok, cfg)
    try:
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        policy.begin_train_step()
        out = policy.train_microbatches(data)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - start
        metrics = policy.finish_train_step()
        return {"loss_sum": out["loss_sum"], "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                "forward_backward_s": round(seconds, 4), "activation_peak_gib": round(peak / 2**30, 3),
                "start_gib": round(start / 2**30, 3), "memory_plan": policy.memory_plan}
    finally:
        _close(policy)


@pytest.mark.parametrize("attention", ["flex", "unfused"])
def test_recompute_gives_the_same_step_with_less_activation_memory(attention):
    tok = build_tokenizer()
    plain = one_step(tok, attention, False)
    recomputed = one_step(tok, attention, True)
    record(f"recompute_{attention}", {"plain": plain, "recompute": recomputed,
                                      "peak_ratio": round(recomputed["activation_peak_gib"]
                                                          / plain["activation_peak_gib"], 3),
                                      "time_ratio": round(recomputed["forward_backward_s"]
                                                          / plain["forward_backward_s"], 3)})
    assert recomputed["loss"] == pytest.approx(plain["loss"], rel=1e-3, abs=1e-4)
    assert recomputed["loss_sum"] == pytest.approx(plain["loss_sum"], rel=1e-3, abs=1e-3)
    assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=2e-2) and plain["grad_norm"] > 0
    assert recomputed["activation_peak_gib"] < 0.6 * plain["activation_peak_gib"], (recomputed, plain)
