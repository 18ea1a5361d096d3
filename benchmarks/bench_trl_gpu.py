"""TRL's GRPOTrainer (vLLM colocated) and asyncrl on the same model directory and the same fixed-length work, on one
GPU, in one invocation: steps/s, generation and training seconds a step, useful training TFLOP/s, peak memory.

    python benchmarks/bench_trl_gpu.py [--steps 3] [--warmup 1] [--completion 512] [--out DIR]
    python benchmarks/bench_trl_gpu.py --cpu-dry-run    # the same code on CPU: a tiny model, TRL without vLLM

The work: 32 prompts x 8 completions a step, every completion ``--completion`` tokens (a randomly initialised model
with a 152k vocabulary all but never samples its eos: a completion stops at the limit), one optimizer step a
generation batch, lr 1e-5, no KL term. The model: a directory this bench writes first (``build_model_dir``), a
randomly initialised Qwen2 of Qwen2.5-0.5B's shape (494M parameters, bf16; q/k/v biases, tied embeddings,
rope_theta 1e6) with the byte tokenizer padded to its 151,936 ids (``asyncrl/tokenizer.py``), so both sides load
the same weights and tokenizer from disk (``model.hf_path`` for asyncrl, ``model=DIR`` for TRL).

Each side runs in a child process of its own (its own vLLM engine; the GPU is given back between them):
- ``trl``: ``GRPOTrainer(use_vllm=True, vllm_mode="colocate")``, 32 completions a micro-batch x 8 accumulation
  steps (one generation of 256 a step), TRL's defaults otherwise (its loss, its importance-sampling correction and
  the extra no-grad forward that needs). A step's seconds from a callback around each optimizer step;
  *generation* is ``_generate_single_turn`` (weight sync into vLLM and ``vLLM.generate``), *training* the rest of
  the step (the extra forward, forward/backward, optimizer).
- ``asyncrl``: the ``gpu_real_shape`` preset with ``model.hf_path`` the directory and every completion
  ``--completion`` tokens, the rest at the preset's defaults (its micro-batch budget fitted to the memory, chunked
  logprobs, FlexAttention), through ``bench_two_gpus.one_run``: synchronous (``in_order`` L=0) and asynchronous
  (``weight_fifo`` W=1) on the same engines. Generation and training are each engine's busy time on the device
  lock.
Useful training TFLOP/s on both sides: 6 x parameters x completion tokens a step / training seconds a step.
Peak memory: ``torch.cuda.max_memory_allocated`` of each side's process (vLLM's pool and the trainer together).
Rows through ``benchmarks/record.py`` (``--out``, default ``$OUT``, else ``benchmarks/data/bench_trl_gpu/<UTC>``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from record import DATA, meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUPS, GROUP_SIZE = 32, 8
QWEN = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
            intermediate_size=4864, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=2048)
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=128)


def say(*args) -> None:
    print(*args, flush=True)


def build_model_dir(path: Path, dry: bool, seed: int = 0) -> Path:
    """A randomly initialised Qwen2 directory (config, bf16 safetensors, the padded byte tokenizer, its chat
    template): what both sides load."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from asyncrl.tokenizer import build_tokenizer

    shape = TINY if dry else QWEN
    tok = build_tokenizer(shape["vocab_size"])
    cfg = Qwen2Config(**shape, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32 if dry else torch.bfloat16)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def prompts(n: int) -> list[str]:
    """The ``copy_first`` task's training prompts (the preset's task), in order, ``n`` of them."""
    from asyncrl import load_config
    from asyncrl.tasks import build_task

    pool = build_task(load_config("gpu_real_shape").task).train_prompts
    return [pool[i % len(pool)].text for i in range(n)]


# ---- TRL ---------------------------------------------------------------------------------------------------------

def run_trl(model_dir: str, steps: int, warmup: int, completion: int, dry: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    total = warmup + steps
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_dict({"prompt": prompts(GROUPS * total)})

    def copy_first(prompts, completions, **kwargs):  # the copy_first task's reward: the first letter again
        return [float(c[:1] == p[:1]) for p, c in zip(prompts, completions)]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=GROUP_SIZE * 4,
        gradient_accumulation_steps=GROUPS * GROUP_SIZE // (GROUP_SIZE * 4), num_generations=GROUP_SIZE,
        max_completion_length=completion, learning_rate=1e-5, beta=0.0, temperature=1.0, max_steps=total,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, shuffle_dataset=False, disable_tqdm=True,
        bf16=not dry, use_cpu=dry, use_vllm=not dry, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        model_init_kwargs={"dtype": "float32" if dry else "bfloat16"}, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model_dir, reward_funcs=copy_first, args=args, train_dataset=data,
                          processing_class=tok)
    gen: list[float] = []
    tokens: list[int] = []
    original = trainer._generate_single_turn

    def timed_generation(*a, **kw):
        sync()
        t0 = time.perf_counter()
        out = original(*a, **kw)
        sync()
        gen.append(time.perf_counter() - t0)
        tokens.append(sum(len(c) for c in out[0]))
        return out

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    trainer._generate_single_turn = timed_generation
    walls: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            sync()
            walls.append(time.perf_counter() - self.t0)

    trainer.add_callback(StepClock())
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    params = sum(p.numel() for p in trainer.model.parameters())
    w, g, t = walls[warmup:], gen[warmup:], tokens[warmup:]
    step_s = sum(w) / len(w)
    gen_s = sum(g) / len(g)
    tok_step = sum(t) / len(t)
    return {"side": "trl", "mode": "sync", "steps": len(w), "steps_per_s": 1 / step_s, "step_s": step_s,
            "gen_s": gen_s, "train_s": step_s - gen_s, "completion_tokens_per_step": tok_step,
            "parameters": params, "useful_train_tflops": 6 * params * tok_step / (step_s - gen_s) / 1e12,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0,
            "per_step_s": walls, "per_step_gen_s": gen}


# ---- asyncrl -----------------------------------------------------------------------------------------------------

def run_asyncrl(model_dir: str, steps: int, warmup: int, completion: int, dry: bool,
                modes: tuple[str, ...] = ("sync", "async")) -> list[dict]:
    import bench_two_gpus as b2

    from asyncrl import load_config
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends import GENERATORS, POLICIES
    from asyncrl.backends.hf import load_tokenizer
    from asyncrl.tasks import build_task

    over = {"eval_every": None, "groups_per_step": GROUPS, "group_size": GROUP_SIZE, "model": {"hf_path": model_dir},
            "generation": {"max_new_tokens": completion, "min_new_tokens_tail": None}}
    if dry:  # the torch engines on the CPU, the tiny directory
        over = b2.merge_overrides(over, {"model": {"dtype": "float32"}, "generation": {"device": "cpu"},
                                         "trainer": {"device": "cpu"}})
    preset = "quickstart" if dry else "gpu_real_shape"
    cfgs = {m: load_config(preset, sampler=s, **over) for m, s in b2.SAMPLERS.items()}
    cfg = cfgs["sync"]
    task, tok = build_task(cfg.task), load_tokenizer(cfg.model)
    policy = b2.build(cfg.trainer.backend, POLICIES, (cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok),
                      cfg.trainer)
    generator = b2.build(cfg.generation.backend, GENERATORS, (cfg.model, cfg.generation, cfg.seed, tok),
                         cfg.generation)
    rows = []
    try:
        for i, mode in enumerate(modes):
            row, _, policy = b2.one_run(cfgs[mode], mode, 0, generator, policy, task, tok, warmup, steps, i > 0)
            rows.append({"side": "asyncrl", "mode": mode, "steps": row["steps"], "steps_per_s": row["steps_per_s"],
                         "step_s": 1 / row["steps_per_s"], "gen_s": row["gen_busy_per_step_s"],
                         "train_s": row["train_busy_per_step_s"],
                         "completion_tokens_per_step": row["completion_tokens_per_step"],
                         "parameters": b2._parameters(policy), "useful_train_tflops": row["useful_train_tflops"],
                         "train_tflops": row.get("train_tflops_median"), "mfu": row.get("mfu_median"),
                         "peak_allocated_gib": row.get("peak_allocated_gib", 0.0),
                         "peak_reserved_gib": row.get("peak_reserved_gib", 0.0),
                         "memory_plan": row.get("memory_plan", "{}")})
            say(f"  asyncrl {mode}: {json.dumps(rows[-1])}")
    finally:
        for backend in (generator, policy):
            backend.close()
    return rows


# ---- the invocation ----------------------------------------------------------------------------------------------

def child(args) -> int:
    if args.side == "trl":
        out = run_trl(args.model_dir, args.steps, args.warmup, args.completion, args.cpu_dry_run)
    else:
        out = run_asyncrl(args.model_dir, args.steps, args.warmup, args.completion, args.cpu_dry_run,
                          tuple(args.modes.split(",")))
    Path(args.result).write_text(json.dumps(out))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps a side (default 3; dry run 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--completion", type=int, default=None, help="tokens every completion (default 512; dry 8)")
    parser.add_argument("--model-dir", default=None, help="the model directory: used if it holds one, else written "
                        "there (default: a temporary one)")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--name", default=None)
    parser.add_argument("--modes", default="sync,async", help="asyncrl's modes, comma-separated (sync, async)")
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--side", choices=("trl", "asyncrl"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dry = args.cpu_dry_run
    args.steps = args.steps or (2 if dry else 3)
    args.completion = args.completion or (8 if dry else 512)
    if args.side:
        return child(args)
    before = meta("bench_trl_gpu")
    out = Path(args.out) if args.out else DATA / "bench_trl_gpu" / (
        args.name or time.strftime("%Y-%m-%dT%H%MZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="qwen-"))
    if not (model_dir / "config.json").exists():
        build_model_dir(model_dir, dry)
    say(f"model directory {model_dir} in {time.perf_counter() - t0:.1f} s")
    rows = []
    for side in ("trl", "asyncrl"):
        result = out / f"{side}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--result", str(result),
               "--model-dir", str(model_dir), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--completion", str(args.completion), "--modes", args.modes] + (["--cpu-dry-run"] if dry else [])
        t0 = time.perf_counter()
        done = subprocess.run(cmd)
        say(f"{side}: exit {done.returncode} in {time.perf_counter() - t0:.0f} s")
        if done.returncode == 0 and result.exists():
            got = json.loads(result.read_text())
            rows += got if isinstance(got, list) else [got]
    if not rows:
        say("!!! neither side produced a result")
        return 1
    frame = pd.DataFrame(rows)
    cols = ["side", "mode", "steps_per_s", "gen_s", "train_s", "completion_tokens_per_step", "useful_train_tflops",
            "peak_allocated_gib"]
    say("\n" + frame[[c for c in cols if c in frame]].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    results = {}
    trl = frame[frame.side == "trl"]
    if len(trl):
        for mode in ("sync", "async"):
            ours = frame[(frame.side == "asyncrl") & (frame["mode"] == mode)]
            if len(ours):
                results[f"asyncrl_{mode}_over_trl_steps_per_s"] = float(ours.steps_per_s.iloc[0] / trl.steps_per_s.iloc[0])
                results[f"asyncrl_{mode}_over_trl_useful_train_tflops"] = float(
                    ours.useful_train_tflops.iloc[0] / trl.useful_train_tflops.iloc[0])
        say(f"against TRL: {json.dumps(results)} (targets: whole step >= 1.5x, useful training TFLOP/s >= 1.3x)")
    save("bench_trl_gpu", frame.drop(columns=[c for c in ("per_step_s", "per_step_gen_s") if c in frame]),
         {"steps": args.steps, "warmup": args.warmup, "modes": args.modes, "completion": args.completion, "groups": GROUPS,
          "group_size": GROUP_SIZE, "model": TINY if dry else QWEN, "ratios": results, "dry_run": dry,
          "trl_per_step": {k: rows[0].get(k) for k in ("per_step_s", "per_step_gen_s")} if len(trl) else {}},
         before=before, out=out)
    say(f"raw data: {out}" + ("  (CPU dry run: numbers mean nothing)" if dry else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
