"""Megatron training-step variants on one GPU at the 0.5B shape: what pays toward issue 48's 35% MFU.

    python benchmarks/bench_mfu_gpu.py [VARIANT ...] [--shape trl|real] [--budget-s 230] [--reserve-gib 10] [--out DIR]

The step is asyncrl's own: a ``MegatronPolicy`` built from ``gpu_real_shape``'s model and trainer sections (a
Qwen2.5-0.5B-shaped Llama, 494M parameters with the 151,936-id vocabulary, bf16; FlexAttention, chunked fused
logprobs, the fused SwiGLU, Megatron's DDP and optimizer), timed as ``begin_train_step`` + ``train_microbatches`` +
``finish_train_step`` (forward, backward, optimizer; no weight export) on one synthetic batch:
- ``--shape trl`` (default): bench_trl_gpu.py's work, 32 groups x 8 completions of 512 tokens after each prompt's
  chat-templated tokens (the ``copy_first`` prompts it trains on);
- ``--shape real``: ``gpu_real_shape``'s long-tailed completions (bench_megatron_step.py's batch, up to 1,024).

A VARIANT is ``default`` (the trainer as a run builds it) or settings joined by ``+``, each ``KEY=VALUE``:
``micro_batch_tokens=N`` (forced: the pass budget is set to N after the build, bypassing the memory estimate, so a
value the estimate refuses is measured, and one that does not fit fails with CUDA's out-of-memory error in the
table), ``compile=layers|modules`` and any other ``trainer`` knob (validated as the config would), or
``tc.FIELD=VALUE``, a megatron-core ``TransformerConfig`` field set on top of the trainer's own (fusion flags:
``bias_dropout_fusion`` compiles with megatron's ``jit_fuser``; ``gradient_accumulation_fusion``,
``apply_rope_fusion``, ``masked_softmax_fusion`` and ``persist_layer_norm`` need Apex or Transformer Engine, absent
here, and fail at the build, which the table then says).

Each variant: built (the 494M initial weights made once and reused), ``--warmup`` steps (default 2: compilation
and the auto budget's fit happen there), ``--steps`` timed ones (default 4, synchronised around each), then one
profiled step (torch.profiler, CPU and CUDA): its kernel time by category (layer GEMMs, attention, norms, compiled
elementwise, other elementwise/copies, output-layer GEMMs, logprob/softmax, loss, optimizer), and ``gpu_busy``, the
kernels' time over the unprofiled step's wall time (near 1: the GPU is never idle, so CUDA graphs could win little).
TFLOP/s is the project's ``train_flops`` (6 x parameters x real tokens) over the step's seconds, ``mfu`` that over
the card's dense bf16 peak (``asyncrl.metrics.peak_flops``). Peak memory includes ``--reserve-gib`` (default 10
GiB), allocated first as a stand-in for the colocated vLLM engine of the bench presets (``kv_cache_tokens`` 540,000
of this model: 6.6 GB of KV pool, its weights, activations and CUDA graphs).

Bounded in time: the run has ``--budget-s`` (default 230 s) and each variant a deadline within it (an alarm that
interrupts a compilation too); a variant that fails, runs out of memory or out of time is one row with its error,
its memory given back, dynamo's caches reset, and the sweep goes on; one that cannot start in the time left is
``skipped``. Order the variants by priority. Needs CUDA and Megatron-core. Writes ``rows.csv`` (a row a variant),
``categories.csv`` (a row per variant and category), ``kernels.csv`` (each variant's top kernels) and ``meta.json``
through ``benchmarks/record.py`` into ``--out`` (default ``$OUT``, else ``benchmarks/data/bench_mfu_gpu/<UTC>``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import torch
from record import meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_megatron_step import kind  # noqa: E402

from asyncrl import load_config  # noqa: E402
from asyncrl.data import TrainBatch  # noqa: E402
from asyncrl.metrics import throughput  # noqa: E402
from torch.autograd.profiler_util import Kernel  # noqa: E402

# In priority order (the time guard skips the last ones first): the preset (varlen attention, compiled layers), the
# same with FlexAttention (2026-12-05's best), with eager layers, larger passes than the memory estimate allows on an
# H100 (~29k positions with 10 GiB reserved), fewer output-layer chunks, flex eager (2026-12-05's default), the one
# megatron fusion flag that needs neither Apex nor TE, the modules compiled apart.
VARIANTS = ["default", "attention=flex", "compile=none", "micro_batch_tokens=49152", "logprob_chunk_tokens=8192",
            "attention=flex+compile=none", "tc.bias_dropout_fusion=true", "compile=modules"]
TARGET_MFU = 0.35  # issue 48, on one H100
CAP_S = {"first": 150.0, "compile": 150.0, "plain": 75.0}  # a variant's deadline at most (first: flex compiles)
NEED_S = {"first": 60.0, "compile": 60.0, "plain": 25.0}  # the least time left for a variant to start
TAIL_S = 8.0  # kept for writing the run directory
DRY = {"model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128, "dtype": "float32"},
       "trainer": {"device": "cpu", "attention": "auto", "compile": "none"}}  # --cpu-dry-run: the same code on a
# tiny model (numbers mean nothing; the preset's varlen kernel and compiled layers are CUDA's)


class VariantTimeout(BaseException):
    """A variant's deadline (a BaseException, so no library's ``except Exception`` swallows it mid-compile)."""


@contextmanager
def deadline(seconds: float):
    def ring(signum, frame):
        raise VariantTimeout(f"out of time after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, ring)
    # repeating: an alarm that lands in a finaliser is swallowed there ("Exception ignored"), the next one is not
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01), 2.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def say(*args) -> None:
    print(*args, flush=True)


# ---- the batch ---------------------------------------------------------------------------------------------------

def trl_batch(vocab: int, completion: int = 512, groups: int = 32, seed: int = 0) -> TrainBatch:
    """bench_trl_gpu.py's step: its 32 ``copy_first`` prompts, chat-templated, x 8 completions of ``completion``."""
    from bench_trl_gpu import GROUP_SIZE, prompts

    from asyncrl.tokenizer import build_tokenizer

    tok = build_tokenizer(vocab)
    lens = []
    for text in prompts(groups):
        try:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        except Exception:  # a tokenizer without a chat template: the raw prompt
            ids = tok(text).input_ids
        lens += [len(ids)] * GROUP_SIZE
    return batch_of(lens, [completion] * len(lens), GROUP_SIZE, vocab, seed)


def batch_of(prompt: list[int], completion: list[int], group_size: int, vocab: int, seed: int = 0) -> TrainBatch:
    """A right-padded batch of random tokens: sequence i is ``prompt[i]`` prompt tokens then ``completion[i]``
    trained ones, with random behaviour logprobs and advantages (nonzero: every token has a gradient)."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(prompt), max(p + c for p, c in zip(prompt, completion))
    ids = torch.randint(3, vocab, (B, S), generator=g)
    attn, mask = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S)
    for i, (p, c) in enumerate(zip(prompt, completion)):
        attn[i, :p + c] = 1
        mask[i, p:p + c] = 1
        ids[i, p + c:] = 0
    return TrainBatch(ids, attn, mask, -torch.rand(B, S, generator=g) * mask, torch.randn(B, generator=g),
                      [group_size] * (B // group_size))


def real_batch() -> TrainBatch:
    from bench_megatron_step import synthetic_batch

    return synthetic_batch()


# ---- a variant ---------------------------------------------------------------------------------------------------

def parse(variant: str) -> tuple[dict, dict, int | None]:
    """``(trainer knobs, TransformerConfig fields, forced micro_batch_tokens)`` of a variant (module docstring)."""
    knobs, fields, budget = {}, {}, None
    for part in [] if variant == "default" else variant.split("+"):
        key, sep, raw = part.partition("=")
        if not sep or not key:
            raise ValueError(f"variant part {part!r}: KEY=VALUE (a trainer knob or tc.FIELD), or 'default'")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        if key == "micro_batch_tokens":
            budget = int(value)
        elif key.startswith("tc."):
            fields[key[3:]] = value
        else:
            knobs[key] = value
    return knobs, fields, budget


class Bench:
    """Builds and times variants of asyncrl's Megatron trainer, sharing the initial weights and one process."""

    def __init__(self, shape: str, dry: bool = False):
        # every module a build imports, imported here, outside any variant's deadline: an alarm in the middle of
        # an import would leave it half made for every variant after
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.transformer.transformer_config  # noqa: F401
        import torch._dynamo  # noqa: F401
        import torch.profiler  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401

        import asyncrl.backends.megatron as M

        self.M, self.cfg = M, load_config("gpu_real_shape", **(DRY if dry else {}))
        from asyncrl.backends.megatron_parallel import init_parallel, resolve_device

        init_parallel(1, 1, resolve_device(self.cfg.trainer.device), 0)  # the process group, before any deadline
        vocab = self.cfg.model.vocab_size
        self.batch = (trl_batch(vocab, 16, 4) if dry else trl_batch(vocab)) if shape == "trl" else real_batch()
        self._weights: dict = {}
        init = M.init_hf_state_dict

        def init_once(hf_config, seed):  # the 494M initial weights are made on the CPU once, not once a variant
            if seed not in self._weights:
                self._weights[seed] = init(hf_config, seed)
            return self._weights[seed]

        M.init_hf_state_dict = init_once
        self._annotate()

    def _annotate(self) -> None:
        """Profiler ranges for the regions a kernel is charged to (``region``): the output layer's chunked logprobs
        (its backward shows as ``_ChunkedLogprobsBackward``), the loss, the optimizer step."""
        from torch.profiler import record_function

        M = self.M
        logprobs = M.chunked_logprobs

        def annotated_logprobs(*a, **kw):
            with record_function("asyncrl.logprobs"):
                return logprobs(*a, **kw)

        M.chunked_logprobs = annotated_logprobs

    def build(self, knobs: dict, fields: dict, budget: int | None):
        import megatron.core.transformer.transformer_config as tc_module

        from asyncrl.algorithms import GRPOLoss
        from asyncrl.config import MegatronTrainerConfig
        from asyncrl.tokenizer import build_tokenizer

        real = tc_module.TransformerConfig

        def with_fields(**kw):  # the trainer's own config with the variant's fields, checked by megatron-core once
            unknown = sorted(set(fields) - set(real.__dataclass_fields__))
            if unknown:
                raise ValueError(f"TransformerConfig has no field(s) {unknown}")
            return real(**{**kw, **fields})

        tc_module.TransformerConfig = with_fields  # read by MegatronPolicy._transformer_config at its call
        try:
            trainer = MegatronTrainerConfig.model_validate({**self.cfg.trainer.model_dump(), **knobs})
            policy = self.M.MegatronPolicy(self.cfg.model, trainer, GRPOLoss(self.cfg.loss), 0,
                                           build_tokenizer(self.cfg.model.vocab_size))
        finally:
            tc_module.TransformerConfig = real
        if budget is not None:
            policy._budget, policy.memory_plan = budget, {"micro_batch_tokens": budget, "forced": True}
        loss = policy.loss
        from torch.profiler import record_function

        class AnnotatedLoss:  # the loss's own object, its call under a profiler range
            def __getattr__(self, name):
                return getattr(loss, name)

            def __call__(self, *a, **kw):
                with record_function("asyncrl.loss"):
                    return loss(*a, **kw)

        policy.loss = AnnotatedLoss()
        return policy

    def step(self, policy) -> dict:
        from torch.profiler import record_function

        policy.begin_train_step()
        policy.train_microbatches(self.batch)
        with record_function("asyncrl.optimizer"):
            return policy.finish_train_step()


REGIONS = (("ChunkedLogprobs", "logprobs"), ("asyncrl.logprobs", "logprobs"), ("asyncrl.optimizer", "optimizer"),
           ("asyncrl.loss", "loss"))


def region(event) -> str:
    """The region a CPU op's kernels are charged to: its own or an ancestor's profiler range (``REGIONS``), else
    the model's layers (embedding, decoder, final norm; forward and backward)."""
    while event is not None:
        for needle, name in REGIONS:
            if needle in event.name:
                return name
        event = event.cpu_parent
    return "layers"


def category(where: str, what: str) -> str:
    """One breakdown line for a kernel: where it ran (``region``) and what it is (``bench_megatron_step.kind``)."""
    if where == "optimizer":
        return "optimizer (grad scale, norm, Adam)"
    if where == "loss":
        return "loss"
    if where == "logprobs":
        return "output-layer GEMMs" if what == "gemm" else "logprob/softmax"
    return {"gemm": "layer GEMMs", "flex attention": "attention (flex)", "flash attention": "attention (varlen)",
            "norm": "norms",
            "compiled (logprob chunk, SwiGLU)": "compiled elementwise (SwiGLU, compiled layers)"
            }.get(what, "elementwise/copies/other")


def profile(bench: Bench, policy) -> pd.DataFrame:
    """Every kernel of one profiled step: name, kind, region, category, microseconds."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        bench.step(policy)
        sync()
    rows = []
    for event in prof.events():
        # on CUDA the kernels each op launched; in a CPU dry run the leaf ops' own time stands in for them
        launched = event.kernels if cuda else [] if event.cpu_children else [
            Kernel(event.name, None, event.self_cpu_time_total)]
        if not launched:
            continue
        where = region(event)
        for k in launched:
            what = kind(k.name)
            rows.append({"kernel": k.name[:160], "kind": what, "region": where, "category": category(where, what),
                         "us": float(k.duration)})
    if cuda:  # GPU work no CPU op claimed (none expected): counted, so gpu_busy is not understated
        from torch.autograd import DeviceType

        device = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
        missing = device - sum(r["us"] for r in rows)
        if missing > 0.005 * device:
            rows.append({"kernel": "(GPU work without a CPU op)", "kind": "other", "region": "unattributed",
                         "category": "unattributed", "us": float(missing)})
    return pd.DataFrame(rows, columns=["kernel", "kind", "region", "category", "us"])


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release() -> None:
    gc.collect()
    sync()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def memory(policy) -> dict:
    """What stays allocated between steps (weights, gradients, master weights, Adam's moments, the reserve), what a
    step adds at its peak (a pass's activations and the output layer's chunk), and what the trainer's estimate
    (``megatron_forward.activation_bytes``, an upper bound) plans for a pass of the budget: the budget's headroom."""
    from asyncrl.backends.megatron_forward import activation_bytes, output_layer_bytes

    gib = 2**30
    static = torch.cuda.memory_allocated() / gib
    per = activation_bytes(policy.spec, policy.dtype, policy.attention, policy.spec.max_position_embeddings)
    planned = (per * (policy._budget or 0) + output_layer_bytes(policy.spec, policy.dtype,
                                                                policy.trainer_cfg.logprob_chunk_tokens)) / gib
    return {"static_gib": static, "step_extra_gib": torch.cuda.max_memory_allocated() / gib - static,
            "estimated_extra_gib": planned}


def run_variant(bench: Bench, variant: str, warmup: int, steps: int, limit: float, do_profile: bool):
    """``(row, kernels or None)``: one variant built, warmed up, timed and profiled within ``limit`` seconds."""
    row = {"variant": variant, "status": "ok", "error": ""}
    kernels, policy = None, None
    t0 = time.perf_counter()
    try:
        with deadline(limit):
            knobs, fields, budget = parse(variant)
            policy = bench.build(knobs, fields, budget)
            row["build_s"] = time.perf_counter() - t0
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t1 = time.perf_counter()
            for _ in range(warmup):
                bench.step(policy)
            sync()
            row["warmup_s"] = time.perf_counter() - t1
            times, flops = [], 0.0
            for _ in range(steps):
                t = time.perf_counter()
                metrics = bench.step(policy)
                sync()
                times.append(time.perf_counter() - t)
                flops += metrics.get("train_flops", 0.0)
            rate = throughput({"train_flops": flops, "peak_flops": policy.peak_flops}, sum(times))
            row.update(memory(policy) if cuda else {})
            row.update({"step_s": sum(times) / len(times), "step_s_min": min(times), "step_s_max": max(times),
                        "train_tflops": rate["train_tflops"], "mfu": rate["mfu"],
                        "train_tokens": flops / steps / 6.0 / policy.full_parameters,
                        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan,
                        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else math.nan,
                        "micro_batch_tokens": policy._budget, "compiled_modules": len(policy.compiled),
                        "parameters": policy.full_parameters, "memory_plan": json.dumps(policy.memory_plan)})
            if do_profile:
                try:
                    kernels = profile(bench, policy)
                    busy = kernels.us.sum() / 1e6
                    row.update({"kernel_s": busy, "gpu_busy": busy / row["step_s"]})
                except Exception as e:  # noqa: BLE001  the timing stands without its profile
                    row["profile_error"] = f"{type(e).__name__}: {e}"[:240]
    except (Exception, VariantTimeout) as e:  # one variant's failure is its row, never the sweep's end
        error = " ".join(f"{type(e).__name__}: {e}".split())[:300]  # one line
        if isinstance(e, VariantTimeout) and "step_s" in row:  # timed already: only its profile ran out of time
            row["profile_error"] = error
        else:
            row["status"] = "timeout" if isinstance(e, VariantTimeout) else "failed"
            row["error"] = error
        say(f"  {variant}: {error}")
        traceback.clear_frames(e.__traceback__)
        del e
    finally:
        if policy is not None:
            try:
                policy.close()
            except Exception:  # noqa: BLE001  a broken policy: its memory goes with it below
                pass
        del policy
        # Every variant's compiled code goes with it: dynamo's caches can keep the modules they compiled alive (and
        # with them the weights and Adam's state). On the H100 of 2026-12-05, resetting only after failures other
        # than OOM, 76 GiB stayed allocated after compile=layers and the micro_batch_tokens=65536 OOM, and every
        # later variant ran out of memory; ``left_allocated_gib`` now says what each variant leaves. The cost: the
        # next variant compiles FlexAttention again (in its warm-up, not its timed steps).
        torch._dynamo.reset()
        release()
        row["left_allocated_gib"] = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else math.nan
    row["wall_s"] = time.perf_counter() - t0
    return row, kernels


def estimate(variants: list[str]) -> float:
    """Seconds the sweep should take on an H100: the first variant compiles FlexAttention and the fused logprobs
    (~65 s with its 494M weights made), a compiled one its layers (~90 s), any other ~20 s (build, 6 steps of
    ~1.7 s, one profiled step)."""
    return sum({"first": 65.0, "compile": 90.0, "plain": 20.0}[kind_of_variant(v, i == 0)]
               for i, v in enumerate(variants))


def kind_of_variant(variant: str, first: bool) -> str:
    """'first', 'compile' (its layers compile: the variant's own setting, else the preset's) or 'plain'."""
    if first:
        return "first"
    try:
        how = parse(variant)[0].get("compile") or load_config("gpu_real_shape").trainer.compile
    except ValueError:  # a malformed variant: its row says so when it runs
        return "plain"
    return "plain" if how == "none" else "compile"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", default=VARIANTS)
    ap.add_argument("--shape", choices=("trl", "real"), default="trl")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=230.0, help="the whole sweep's seconds (default 230)")
    ap.add_argument("--reserve-gib", type=float, default=10.0, help="GiB held for the colocated vLLM (default 10)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same code on a tiny model on the CPU")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if args.warmup < 1 or args.steps < 1:
        ap.error(f"--warmup and --steps must be >= 1 (got {args.warmup}, {args.steps})")
    dry = args.cpu_dry_run
    if not (dry or torch.cuda.is_available()):
        say("bench_mfu_gpu needs CUDA (or --cpu-dry-run)")
        return 2
    start = time.perf_counter()
    before = meta("bench_mfu_gpu")
    reserve_gib = 0.0 if dry else args.reserve_gib
    reserve = None if dry else torch.empty(int(reserve_gib * 2**30), dtype=torch.uint8, device="cuda")  # vLLM's
    bench = Bench(args.shape, dry)
    positions, tokens = int(bench.batch.attention_mask.sum()), int(bench.batch.loss_mask.sum())
    say(f"{'CPU dry run' if dry else torch.cuda.get_device_name()}: shape {args.shape}, {bench.batch.num_sequences} sequences, {positions} "
        f"positions ({tokens} completion tokens), {reserve_gib:g} GiB reserved; {len(args.variants)} variants "
        f"in at most {args.budget_s:.0f} s (estimated ~{estimate(args.variants):.0f} s)")
    rows, kernels = [], []
    for i, variant in enumerate(args.variants):
        left = args.budget_s - (time.perf_counter() - start) - TAIL_S
        k = kind_of_variant(variant, i == 0)
        if left < NEED_S[k]:
            rows.append({"variant": variant, "status": "skipped", "error": f"{left:.0f} s left, {NEED_S[k]:.0f} needed"})
            say(f"  {variant}: skipped ({left:.0f} s left)")
            continue
        row, kern = run_variant(bench, variant, args.warmup, args.steps, min(CAP_S[k], left), not args.no_profile)
        rows.append(row)
        if kern is not None and len(kern):
            kernels.append(kern.assign(variant=variant))
        say(f"  {variant}: {row['status']} {row.get('step_s', float('nan')):.3f} s/step, "
            f"mfu {row.get('mfu', float('nan')):.3f}, peak {row.get('peak_allocated_gib', float('nan')):.1f} GiB, "
            f"{row['wall_s']:.0f} s")
    del reserve
    table = pd.DataFrame(rows)
    ok = table[table.status == "ok"] if "status" in table else table.iloc[:0]
    base = ok[ok.variant == "default"]
    if len(base):
        table["speedup"] = base.step_s.iloc[0] / table.get("step_s", math.nan)
    best = ok.loc[ok.step_s.idxmin()] if len(ok) else None  # the same batch in every variant: the fastest
    every = pd.concat(kernels) if kernels else pd.DataFrame(columns=["variant", "kernel", "kind", "region",
                                                                      "category", "us"])
    cats = (every.groupby(["variant", "category"]).us.sum() / 1e3).rename("ms").reset_index()
    cats["share"] = cats.ms / cats.groupby("variant").ms.transform("sum")
    top = (every.groupby(["variant", "kernel", "kind", "region"]).us.agg(["sum", "count"]).reset_index()
           .sort_values(["variant", "sum"], ascending=[True, False]).groupby("variant").head(40))
    shown = ["default"] + ([best.variant] if best is not None and best.variant != "default" else [])
    by_cat = {v: cats[cats.variant == v].set_index("category").ms.round(1).to_dict() for v in shown}
    results = {"shape": args.shape, "sequences": bench.batch.num_sequences, "positions": positions,
               "completion_tokens": tokens, "warmup": args.warmup, "steps": args.steps,
               "reserve_gib": reserve_gib, "target_mfu": TARGET_MFU, "dry_run": dry,
               "best": None if best is None else {"variant": best.variant, "mfu": float(best.mfu),
                                                  "step_s": float(best.step_s)},
               "default": None if not len(base) else {"mfu": float(base.mfu.iloc[0]),
                                                     "step_s": float(base.step_s.iloc[0])},
               "profile_ms_by_category": by_cat, "wall_s": time.perf_counter() - start}
    out = save("bench_mfu_gpu", table, results, before=before, out=args.out, name=args.name,
               files={"categories.csv": cats, "kernels.csv": top})
    cols = [c for c in ("variant", "status", "step_s", "train_tflops", "mfu", "speedup", "peak_allocated_gib",
                        "step_extra_gib", "left_allocated_gib", "micro_batch_tokens", "gpu_busy", "warmup_s", "error") if c in table]
    say("\n" + table[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}", max_colwidth=90))
    if len(cats):
        wide = cats[cats.variant.isin(shown)].pivot(index="category", columns="variant", values="ms")
        say("\nprofiled step, ms of kernel time by category:\n" + wide.round(1).fillna(0).to_string())
    say(f"\ntarget mfu {TARGET_MFU}; best: {results['best']}; raw data: {out} "
        f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
