"""What padding costs a train step, and what length-sorted or packed micro-batches (asyncrl/micro_batches.py) save.

    python benchmarks/bench_padding.py [--repeats 3] [--groups 16] [--engines torch,megatron] [--out DIR]

Two tables:
1. Plans on the GPU preset's shape (no model, no timing): ``gpu_gen_heavy``'s 32 groups x 8 completions, each
   group's length drawn as that preset's generator draws it (``group_max_tokens``: min(256, 16 exp(|z|)), a
   randomly initialised model rarely stops earlier), over ``--plan-steps`` steps: positions computed per real token
   and passes per step, for one padded batch (the old path), sorted micro-batches and packed rows, each at the
   preset's budget.
2. Train steps timed on this CPU, a long-tailed CPU shape (``--groups`` groups x 8 completions, lengths drawn the
   same way with min 4, max 96; a 4-layer x 256 Llama from config): forward, backward and AdamW of one chunk, the
   engines alternating between the plans in each repeat so the box's load hits all alike. Reported: median step
   ms, positions per real token, passes, and the speed-up over the padded plan of the same engine.

Raw rows go through ``benchmarks/record.py`` (``benchmarks/data/bench_padding/<UTC time>/``), with the load
average before the run: timings on a shared box are noisy, compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import meta, save  # noqa: E402

from asyncrl import micro_batches  # noqa: E402
from asyncrl.algorithms import GRPOLoss, LossConfig, make_train_batch  # noqa: E402
from asyncrl.backends.sampling import group_max_tokens  # noqa: E402
from asyncrl.config import MegatronTrainerConfig, ModelConfig, TorchTrainerConfig, load_config  # noqa: E402
from asyncrl.data import GroupRollouts  # noqa: E402

CPU_MODEL = ModelConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=128)
PROMPT = [1, 99, 98, 97, 61]  # bos + "cab=": the shape of the tasks' prompts


def long_tailed_groups(step: int, groups: int, G: int, lengths, seed: int = 0) -> list[GroupRollouts]:
    """Synthetic scored groups whose completion lengths are drawn as the generator's long tail draws them."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    out = []
    for i in range(groups):
        gid = step * groups + i
        n = group_max_tokens(lengths, seed, gid)
        comps = [torch.randint(3, 259, (n,), generator=g).tolist() for _ in range(G)]
        lps = [(-torch.rand(n, generator=g) * 3).tolist() for _ in range(G)]
        out.append(GroupRollouts(gid, PROMPT, comps, lps, 0, 0, rewards=torch.rand(G, generator=g).tolist()))
    return out


def plan_table(plan_steps: int) -> pd.DataFrame:
    cfg = load_config("gpu_gen_heavy")
    budget = cfg.trainer.micro_batch_tokens or 16384
    rows = []
    for step in range(plan_steps):
        batch = make_train_batch(long_tailed_groups(step, cfg.groups_per_step, cfg.group_size, cfg.generation),
                                 LossConfig(), 0)
        for mode, knobs in (("padded (one batch)", ("rows", None, None)), ("sorted", ("sorted", None, budget)),
                            ("packed", ("packed", None, budget))):
            plans = micro_batches.plan(batch, *knobs)
            real = sum(mb.real_tokens for mb in plans)
            rows.append({"table": "plan", "step": step, "plan": mode, "budget": knobs[2], "real_tokens": real,
                         "positions": sum(mb.positions for mb in plans), "passes": len(plans),
                         "positions_per_token": sum(mb.positions for mb in plans) / real})
    return pd.DataFrame(rows)


def _megatron_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    torch.cuda.current_device = lambda: "cpu"  # what Megatron-core needs on a CPU (FACTS.md)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def policy(engine: str, mode: str, budget: int | None):
    knobs = {"micro_batching": mode, "micro_batch_tokens": budget if mode != "rows" else None}
    if engine == "torch":
        from asyncrl.backends.torch import TorchPolicy

        return TorchPolicy(CPU_MODEL, TorchTrainerConfig(lr=1e-5, **knobs), GRPOLoss(), 0)
    from asyncrl.backends.megatron import MegatronPolicy
    from asyncrl.tokenizer import build_tokenizer

    return MegatronPolicy(CPU_MODEL, MegatronTrainerConfig(device="cpu", lr=1e-5, optimizer="torch", **knobs),
                          GRPOLoss(), 0, build_tokenizer())


def time_table(engines: list[str], groups: int, repeats: int, budget: int) -> pd.DataFrame:
    lengths = SimpleNamespace(min_new_tokens_tail=4, max_new_tokens=96, length_sigma=1.0)
    modes = {"torch": ["rows", "sorted"], "megatron": ["rows", "sorted", "packed"]}
    if "megatron" in engines:
        _megatron_world()
    built = {(e, m): policy(e, m, budget) for e in engines for m in modes[e]}
    rows = []
    for rep in range(repeats):
        batch = make_train_batch(long_tailed_groups(rep, groups, 8, lengths, seed=1), LossConfig(), 0)
        for (engine, mode), pol in built.items():
            for _ in range(2 if rep == 0 else 1):  # the first call of each warms its kernels and allocator
                t0 = time.perf_counter()
                pol.begin_train_step()
                pol.train_microbatches(batch)
                m = pol.finish_train_step()
                step_s = time.perf_counter() - t0
            rows.append({"table": "time", "engine": engine, "plan": mode, "budget": budget if mode != "rows" else None,
                         "repeat": rep, "step_s": step_s, "real_tokens": m["train_tokens"],
                         "positions": m["train_padded_tokens"], "sequences": m["sequences"],
                         "positions_per_token": m["train_padded_tokens"] / m["train_tokens"],
                         "passes": len(micro_batches.plan(batch, mode, None, budget if mode != "rows" else None))})
    return pd.DataFrame(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--plan-steps", type=int, default=50)
    parser.add_argument("--budget", type=int, default=4096, help="micro_batch_tokens of the timed sorted/packed plans")
    parser.add_argument("--engines", default="torch,megatron")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    before = meta("bench_padding")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    plans = plan_table(args.plan_steps)
    summary = plans.groupby("plan")[["positions_per_token", "passes", "real_tokens"]].median()
    print(f"1. plans on gpu_gen_heavy's shape, median of {args.plan_steps} steps:")
    print(summary.to_string(float_format=lambda x: f"{x:.3g}"))

    engines = [e for e in args.engines.split(",") if e]
    timed = time_table(engines, args.groups, args.repeats, args.budget)
    med = timed.groupby(["engine", "plan"]).agg(step_ms=("step_s", lambda s: 1e3 * statistics.median(s)),
                                                positions_per_token=("positions_per_token", "median"),
                                                passes=("passes", "median"), real_tokens=("real_tokens", "median"))
    for engine in engines:
        med.loc[engine, "speedup_vs_padded"] = (med.loc[(engine, "rows"), "step_ms"]
                                                / med.loc[engine, "step_ms"]).to_numpy()
    print(f"\n2. train steps on this CPU ({args.groups} groups x 8, long-tailed; {args.threads} thread(s); "
          f"load before the run {before['machine']['load_1min']}):")
    print(med.to_string(float_format=lambda x: f"{x:.3g}"))
    results = {"plans": summary.reset_index().to_dict(orient="records"),
               "timed": med.reset_index().to_dict(orient="records")}
    out = save("bench_padding", pd.concat([plans, timed], ignore_index=True), results, before=before, out=args.out)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
