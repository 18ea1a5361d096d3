"""What ``trainer.gradient_checkpointing`` saves and costs a torch-engine train step on CPU.

    python benchmarks/bench_gradient_checkpointing.py [--repeats 3] [--layers 6] [--hidden 256] [--tokens 384]

Each cell runs in a fresh process (so its peak is its own): a Llama-style model from config, one chunk of
``--groups`` groups x 8 completions of ``--tokens`` tokens, one train step (forward, backward, AdamW), with and
without gradient checkpointing. Reported per cell: the bytes the forward keeps for backward (saved tensors, counted
by ``torch.autograd.graph.saved_tensors_hooks``: with checkpointing, only each layer's input), the process's peak
RSS growth over the step (``resource.getrusage`` after the model is built: activations, gradients and AdamW's
state; the last two are the same either way), the step's time, and its loss and gradient norm (equal up to float
noise). Raw rows go through ``benchmarks/record.py`` (``benchmarks/data/bench_gradient_checkpointing/<UTC time>/``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def cell(args) -> dict:
    """One train step in this process; what it measured."""
    import torch

    from asyncrl.algorithms import GRPOLoss, LossConfig, make_train_batch
    from asyncrl.backends.torch import TorchPolicy
    from asyncrl.config import ModelConfig, TorchTrainerConfig
    from asyncrl.data import GroupRollouts

    torch.set_num_threads(args.threads)
    model = ModelConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.tokens + 16)
    loss = GRPOLoss(LossConfig())
    policy = TorchPolicy(model, TorchTrainerConfig(lr=1e-5, gradient_checkpointing=args.checkpointing), loss, seed=0)
    g = torch.Generator().manual_seed(0)
    groups = [GroupRollouts(i, [257, 97 + i, 61], [torch.randint(0, 256, (args.tokens,), generator=g).tolist()
                                                   for _ in range(8)],
                            [[-2.0] * args.tokens] * 8, 0, 0, rewards=torch.rand(8, generator=g).tolist())
              for i in range(args.groups)]
    batch = make_train_batch(groups, loss.cfg, pad_id=256)
    saved = []
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    policy.begin_train_step()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        policy.train_microbatches(batch)
    metrics = policy.finish_train_step()
    step_s = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"gradient_checkpointing": args.checkpointing, "saved_for_backward_mib": sum(saved) / 2**20,
            "peak_rss_growth_mib": (peak_kib - base_kib) / 1024, "step_s": step_s, "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"], "parameters": policy.num_parameters,
            "tokens": args.groups * 8 * args.tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=384, help="completion tokens of each sequence")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default=None)
    parser.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(args)))
        return

    import pandas as pd
    from record import meta, save

    before = meta("bench_gradient_checkpointing")
    rows = []
    for repeat in range(args.repeats):
        for on in (False, True):  # alternating, so the box's load hits both alike
            cmd = [sys.executable, __file__, "--cell", "--layers", str(args.layers), "--hidden", str(args.hidden),
                   "--tokens", str(args.tokens), "--groups", str(args.groups), "--threads", str(args.threads)]
            out = subprocess.run(cmd + (["--checkpointing"] if on else []), capture_output=True, text=True,
                                 check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            rows.append({"repeat": repeat, **json.loads(out.stdout.strip().splitlines()[-1])})
    frame = pd.DataFrame(rows)
    table = frame.groupby("gradient_checkpointing").agg(
        saved_for_backward_mib=("saved_for_backward_mib", "median"),
        peak_rss_growth_mib=("peak_rss_growth_mib", "median"), step_s=("step_s", "median"),
        loss=("loss", "first"), grad_norm=("grad_norm", "first"))
    off, on = table.loc[False], table.loc[True]
    results = {"saved_for_backward_ratio": on.saved_for_backward_mib / off.saved_for_backward_mib,
               "peak_rss_growth_ratio": on.peak_rss_growth_mib / off.peak_rss_growth_mib,
               "step_time_ratio": on.step_s / off.step_s,
               "loss_abs_diff": abs(on.loss - off.loss), "grad_norm_rel_diff": abs(on.grad_norm / off.grad_norm - 1),
               "shape": {k: getattr(args, k) for k in ("layers", "hidden", "tokens", "groups", "threads")},
               "parameters": int(frame.parameters.iloc[0])}
    print(table.to_string(float_format=lambda x: f"{x:.4g}"))
    print(json.dumps(results, indent=1))
    print(save("bench_gradient_checkpointing", frame, results, before=before, out=args.out, name=args.name))


if __name__ == "__main__":
    main()
