"""One Megatron training step at ``gpu_real_shape``'s shape, without vLLM: where the training engine's time goes.

    python benchmarks/bench_megatron_step.py [VARIANT ...] [--out DIR]

A variant is ``KIND-CHUNK``: ``fused`` (each logprob chunk's float32 work one compiled function: asyncrl/logprobs.py,
the CUDA default), ``eager`` (the eager chunk), ``noswiglu`` (fused chunk, Megatron's SwiGLU unfused:
``bias_activation_fusion`` off), and ``CHUNK`` is ``trainer.logprob_chunk_tokens``. Every variant trains the same
synthetic step: 32 groups x 8 completions of the preset's long-tailed lengths (min(1024, round(64 exp|z|)) a
group) after 24 prompt tokens. Two warm-up steps, then 3 timed ones; useful TFLOP/s = 6 x parameters x completion
tokens / step time. Last, one profiled step of the first variant, its CUDA time by kernel kind. Needs CUDA and
Megatron-core; the numbers are in benchmarks/README.md ("A real model's shape on one H200").
"""

from __future__ import annotations

import argparse
import math
import time

import pandas as pd
import torch
from record import meta, save

from asyncrl import load_config
from asyncrl import logprobs as L
from asyncrl.algorithms import GRPOLoss
from asyncrl.backends.megatron import MegatronPolicy
from asyncrl.data import TrainBatch
from asyncrl.tokenizer import build_tokenizer

KINDS = [("flash attention", ["flash_fwd", "flash_bwd"]),  # before gemm: FlashAttention's names hold "cutlass"
         ("gemm", ["gemm", "cutlass", "sm90", "nvjet", "xmma", "matmul"]), ("flex attention", ["flex", "triton_tem"]),
         ("compiled (logprob chunk, SwiGLU)", ["triton_red", "triton_per", "triton_poi"]),
         ("optimizer", ["adam", "multi_tensor"]), ("norm", ["norm"]),
         ("elementwise", ["elementwise", "vectorized", "unrolled"]), ("reduce", ["reduce"]),
         ("copy", ["copy", "memcpy", "memset", "cat"])]


def synthetic_batch(seed: int = 0, prompt: int = 24) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    lens = [n for _ in range(32) for n in [min(1024, round(64 * math.exp(abs(float(torch.randn(1, generator=g))))))] * 8]
    B, S = len(lens), prompt + max(lens)
    ids = torch.randint(300, 151000, (B, S), generator=g)
    attn, mask = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S)
    for i, n in enumerate(lens):
        attn[i, :prompt + n] = 1
        mask[i, prompt:prompt + n] = 1
        ids[i, prompt + n:] = 0
    return TrainBatch(ids, attn, mask, -torch.rand(B, S, generator=g) * mask, torch.randn(B, generator=g), [8] * 32)


def kind(kernel: str) -> str:
    name = kernel.lower()
    return next((k for k, keys in KINDS if any(x in name for x in keys)), "other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", default=["fused-2048", "eager-2048", "noswiglu-2048"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    before = meta("bench_megatron_step")
    cfg = load_config("gpu_real_shape")
    batch = synthetic_batch()
    tokens = int(batch.loss_mask.sum())
    swiglu_on = MegatronPolicy._transformer_config

    def settings(variant: str):
        """The variant's switches (module-level: the logprob chunk reads them at each pass)."""
        name, chunk = variant.split("-")
        L.FUSED_DEVICES = set() if name == "eager" else {"cuda"}

        def transformer_config(self):
            c = swiglu_on(self)
            c.bias_activation_fusion = name != "noswiglu"
            return c
        MegatronPolicy._transformer_config = transformer_config
        return cfg.trainer.model_copy(update={"logprob_chunk_tokens": int(chunk)})

    def build(variant: str) -> MegatronPolicy:
        return MegatronPolicy(cfg.model, settings(variant), GRPOLoss(cfg.loss), 0,
                              build_tokenizer(cfg.model.vocab_size))

    def step(p: MegatronPolicy) -> None:
        p.begin_train_step()
        p.train_microbatches(batch)
        p.finish_train_step()

    rows, first = [], None
    for variant in args.variants:
        p = build(variant)
        torch.cuda.reset_peak_memory_stats()
        step(p), step(p)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            step(p)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / 3
        rows.append({"variant": variant, "step_s": dt, "useful_train_tflops": 6 * p.num_parameters * tokens / dt / 1e12,
                     "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                     "micro_batch_tokens": p._budget, "parameters": p.num_parameters})
        print(rows[-1], flush=True)
        if first is None:
            first = (variant, p)
        else:
            p.close()
    variant, p = first
    settings(variant)  # the first variant's switches again, for its profile
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(p)
        torch.cuda.synchronize()
    kernels = pd.DataFrame([{"kernel": e.key[:150], "kind": kind(e.key), "ms": e.device_time_total / 1e3,
                             "count": e.count} for e in prof.key_averages()]).sort_values("ms", ascending=False)
    by_kind = kernels.groupby("kind").ms.sum().sort_values(ascending=False)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"\nprofiled step of {variant}: {kernels.ms.sum():.1f} ms of CUDA time by kernel kind")
    print(by_kind.round(1).to_string())
    print(kernels.head(25).to_string(index=False))
    out = save("bench_megatron_step", table, {"completion_tokens": tokens, "positions": int(batch.attention_mask.sum()),
                                                "profiled": variant, "profile_ms_by_kind": by_kind.round(2).to_dict()},
               before=before, out=args.out, files={"kernels.csv": kernels})
    print(f"raw data: {out}")


if __name__ == "__main__":
    main()
