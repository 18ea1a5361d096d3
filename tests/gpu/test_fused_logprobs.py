"""The fused chunk of ``chunked_logprobs`` on CUDA (asyncrl/logprobs.py: each chunk's float32 work one compiled
function over the logits in bf16) against the eager path, at the real shape's output layer (hidden 896, a
151,936-id vocabulary, bf16): the same logprobs, entropy and gradients within bf16's rounding, in less time and
less memory. Run on the H200; skipped without CUDA (the CPU test of the same formulas is in test_algorithms.py).

Numbers go to stdout and, when ``ASYNCRL_GPU_RESULTS`` names a folder, to ``fused_logprobs.json`` there."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from asyncrl import logprobs as L  # noqa: E402
from tests.gpu.results import Results  # noqa: E402

N, H, V = 10_000, 896, 151_936  # five chunks of 2,048 positions, the last one shorter
RESULTS = Results("fused_logprobs", positions=N, hidden=H, vocab=V)
record = RESULTS.record


def one_pass(fused: bool, hidden0, weight0, targets, a, b, chunk=2048):
    L.FUSED_DEVICES = {"cuda"} if fused else set()
    hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    lp, ent = L.chunked_logprobs(hidden, weight, targets, chunk, entropy=True)
    ((lp * a).sum() + (ent * b).sum()).backward()
    return lp.detach(), ent.detach(), hidden.grad.float(), weight.grad.float()


def timed(fused: bool, *args, reps=5):
    one_pass(fused, *args)  # compiles the fused functions (and the shorter last chunk's shape) first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    for _ in range(reps):
        one_pass(fused, *args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps, (torch.cuda.max_memory_allocated() - base) / 2**30


def test_fused_chunk_equals_eager_and_is_faster():
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(N, H, generator=g, device="cuda") * 2).bfloat16()
    weight = (torch.randn(V, H, generator=g, device="cuda") * 0.05).bfloat16()
    targets = torch.randint(0, V, (N,), generator=g, device="cuda")
    a, b = torch.randn(N, generator=g, device="cuda"), torch.randn(N, generator=g, device="cuda")
    try:
        fused, eager = one_pass(True, hidden, weight, targets, a, b), one_pass(False, hidden, weight, targets, a, b)
        # the reference: float64 of the same bf16 inputs through the eager path
        ref = one_pass(False, hidden.double(), weight.double(), targets, a.double(), b.double())
        errors = {}
        for name, x, y, r in zip(("logprobs", "entropy", "d hidden", "d weight"), fused, eager, ref):
            r = r.float()
            errors[name] = {"fused": float((x.float() - r).norm() / r.norm()),
                            "eager": float((y.float() - r).norm() / r.norm())}
        record("relative_error_vs_float64", errors)
        for name, e in errors.items():  # two roundings of one function: the fused one no worse than twice eager's
            assert e["fused"] <= 2 * e["eager"] + 2.0 ** -8, name
        t_f, m_f = timed(True, hidden, weight, targets, a, b)
        t_e, m_e = timed(False, hidden, weight, targets, a, b)
        record("forward_backward_ms", {"fused": round(t_f * 1e3, 2), "eager": round(t_e * 1e3, 2),
                                       "eager_over_fused": round(t_e / t_f, 2)})
        record("peak_gib_above_inputs", {"fused": round(m_f, 2), "eager": round(m_e, 2)})
        assert t_f < t_e and m_f <= m_e
    finally:
        L.FUSED_DEVICES = {"cuda"}
