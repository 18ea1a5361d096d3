"""TRL's GRPOTrainer (vLLM colocated) and asyncrl on the same model directory and the same fixed-length work, on one
GPU, in one invocation: steps/s, generation and training seconds a step, useful training TFLOP/s, peak memory, and
every step's times (``steps.csv``, ``results.per_step`` in meta.json).

    python benchmarks/bench_trl_gpu.py [--steps 8] [--warmup 3] [--completion 512] [--out DIR]
    python benchmarks/bench_trl_gpu.py --sides trl --model-dir /tmp/qwen --out DIR            # one side a call,
    python benchmarks/bench_trl_gpu.py --sides trl,asyncrl --reuse --model-dir /tmp/qwen --out DIR  # then the other
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
  (``weight_fifo`` W=1) on the same engines. Generation is the generator's busy time on the device lock; training
  the policy's calls of the step (the ``train_time_s`` metric: logprobs, forward/backward, optimizer step).

Warm-up: every side and mode runs ``--warmup`` steps (default 3) before ``--steps`` timed ones (default 8). The first
steps compile FlexAttention and the fused kernels, fit the micro-batch budget and warm vLLM; on one H100 both sides
were still speeding up after one warm-up step (issue 48), which understated asyncrl. Every step's times are kept.

Useful training TFLOP/s, one formula on both sides: ``asyncrl.metrics.train_flops`` (6 x parameters x real tokens
trained: prompt and completion, no padding) summed over the timed steps, over their training seconds summed. For
asyncrl these are its own ``train_flops`` / ``train_time_s`` metrics (so the figure is its ``train_tflops`` over
the timed steps; the weight export to vLLM counts as the sync's, as TRL's weight sync counts as its generation);
for TRL the step's time outside ``_generate_single_turn``. ``mfu`` divides by the card's bf16 dense peak
(``asyncrl.metrics.peak_flops``). Runs before 2026-12-05 divided asyncrl's completion tokens by the trainer's busy
time on the device lock (the weight export included): ``busy_train_tflops`` in rows.csv is that figure.
Peak memory: ``torch.cuda.max_memory_allocated`` of each side's process (vLLM's pool and the trainer together).

``--set KEY=VALUE`` (repeatable) overrides ``gpu_real_shape`` on the asyncrl side (``--set trainer.attention=flex``);
it is part of the work a ``--reuse`` compares. ``--sides`` runs some sides only; with ``--reuse`` a side whose
result is already in ``--out`` (from an earlier call with the same steps, warm-up and completion length) is read
instead of run, so the two sides can run in two calls of a machine with a per-call time limit and still land in one
run directory (``results.sides`` says which command made each). Rows through ``benchmarks/record.py`` (``--out``,
default ``$OUT``, else ``benchmarks/data/bench_trl_gpu/<UTC>``).
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

import model_dirs
import pandas as pd
from model_dirs import SHAPES
from record import DATA, meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from asyncrl.metrics import peak_flops, throughput, train_flops  # noqa: E402

GROUPS, GROUP_SIZE = 32, 8
QWEN, TINY = SHAPES["qwen2_0_5b"][1], SHAPES["tiny_qwen2"][1]


def say(*args) -> None:
    print(*args, flush=True)


def build_model_dir(path: Path, dry: bool, seed: int = 0) -> Path:
    """A randomly initialised Qwen2 directory (config, bf16 safetensors, the padded byte tokenizer, its chat
    template): what both sides load (``benchmarks/model_dirs.py``)."""
    return model_dirs.build_model_dir(path, "tiny_qwen2" if dry else "qwen2_0_5b", seed)


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
    tokens: list[int] = []  # completion tokens a generation (one a step)
    prompt_tokens: list[int] = []  # prompt tokens of those completions (trained too: real positions)
    original = trainer._generate_single_turn

    def timed_generation(*a, **kw):
        sync()
        t0 = time.perf_counter()
        out = original(*a, **kw)
        sync()
        gen.append(time.perf_counter() - t0)
        completions = out[0]
        prompt_ids = a[0] if a else kw.get("prompt_ids", [])
        per_prompt = len(completions) // max(len(prompt_ids), 1)  # 1 if prompts came repeated, else the group size
        tokens.append(sum(len(c) for c in completions))
        prompt_tokens.append(per_prompt * sum(len(p) for p in prompt_ids))
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
    per_step = [{"side": "trl", "mode": "sync", "step": i, "timed": i >= warmup, "step_s": w, "gen_s": g,
                 "train_s": w - g, "sync_s": float("nan"), "completion_tokens": c, "train_tokens": c + p,
                 "train_flops": train_flops(params, c + p)}
                for i, (w, g, c, p) in enumerate(zip(walls, gen, tokens, prompt_tokens))]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"side": "trl", "mode": "sync", **summary(per_step, params, device),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0,
            "per_step_s": walls, "per_step_gen_s": gen, "per_step": per_step}


def summary(per_step: list[dict], params: int, device: str | None) -> dict:
    """A side's figures over its timed steps: steps/s, mean seconds a step, tokens a step, and the useful training
    TFLOP/s of ``asyncrl.metrics.train_flops`` summed over the training seconds summed (module docstring)."""
    timed = pd.DataFrame([r for r in per_step if r["timed"]])
    flops, train = float(timed.train_flops.sum()), float(timed.train_s.sum())
    rate = throughput({"train_flops": flops}, train)
    return {"steps": len(timed), "warmup": len(per_step) - len(timed), "steps_per_s": len(timed) / timed.step_s.sum(),
            "step_s": float(timed.step_s.mean()), "gen_s": float(timed.gen_s.mean()), "train_s": train / len(timed),
            "completion_tokens_per_step": float(timed.completion_tokens.mean()),
            "train_tokens_per_step": float(timed.train_tokens.mean()), "parameters": params,
            "useful_train_tflops": rate["train_tflops"], "mfu": rate["train_tflops"] * 1e12 / peak_flops(device)}


# ---- asyncrl -----------------------------------------------------------------------------------------------------

def run_asyncrl(model_dir: str, steps: int, warmup: int, completion: int, dry: bool,
                modes: tuple[str, ...] = ("sync", "async"), sets: tuple[str, ...] = ()) -> list[dict]:
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
    over = b2.merge_overrides(over, b2.parse_overrides(list(sets)))  # --set: the preset's knobs, recorded
    preset = "quickstart" if dry else "gpu_real_shape"
    cfgs = {m: load_config(preset, sampler=s, **over) for m, s in b2.SAMPLERS.items()}
    for m in set(modes) & set(b2.EXTRA_MODES):  # async_overlap and the others of bench_two_gpus.py, by name
        cfgs[m] = load_config(preset, sampler=b2.SAMPLERS["async"], **b2.merge_overrides(over, b2.EXTRA_MODES[m]))
    cfg = cfgs["sync"]
    task, tok = build_task(cfg.task), load_tokenizer(cfg.model)
    policy = b2.build(cfg.trainer.backend, POLICIES, (cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok),
                      cfg.trainer)
    generator = b2.build(cfg.generation.backend, GENERATORS, (cfg.model, cfg.generation, cfg.seed, tok),
                         cfg.generation)
    rows = []
    device = None
    try:
        for i, mode in enumerate(modes):
            row, curve, policy = b2.one_run(cfgs[mode], mode, 0, generator, policy, task, tok, warmup, steps, i > 0)
            device = device or (str(getattr(policy, "device", "")) if b2._local_cuda(policy) else None)
            per_step = [{"side": "asyncrl", "mode": mode, "step": int(r.step), "timed": int(r.step) >= warmup,
                         "step_s": r.step_time_s, "gen_s": float("nan"), "train_s": r.train_time_s,
                         "sync_s": r.sync_time_s, "completion_tokens": r.completion_tokens,
                         "train_tokens": r.train_tokens, "train_flops": r.train_flops} for r in curve.itertuples()]
            params = b2._parameters(policy)
            mine = summary(per_step, params, _device_name(device))
            rows.append({"side": "asyncrl", "mode": mode, **mine,
                         # the whole run's wall clock (what steps/s is), the generator's busy time on the lock
                         "steps_per_s": row["steps_per_s"], "step_s": 1 / row["steps_per_s"],
                         "gen_s": row["gen_busy_per_step_s"], "train_busy_s": row["train_busy_per_step_s"],
                         # the figure of runs before 2026-12-05 (module docstring), for comparison with them
                         "busy_train_tflops": row["useful_train_tflops"],
                         "train_tflops": row.get("train_tflops_median"),
                         "peak_allocated_gib": row.get("peak_allocated_gib", 0.0),
                         "peak_reserved_gib": row.get("peak_reserved_gib", 0.0),
                         "memory_plan": row.get("memory_plan", "{}"), "per_step": per_step})
            say(f"  asyncrl {mode}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'per_step'})}")
    finally:
        for backend in (generator, policy):
            backend.close()
    return rows


def _device_name(device: str | None) -> str | None:
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device and torch.cuda.is_available() else None


# ---- the invocation ----------------------------------------------------------------------------------------------

def child(args) -> int:
    if args.side == "trl":
        out = run_trl(args.model_dir, args.steps, args.warmup, args.completion, args.cpu_dry_run)
    else:
        out = run_asyncrl(args.model_dir, args.steps, args.warmup, args.completion, args.cpu_dry_run,
                          tuple(args.modes.split(",")), tuple(args.overrides))
    Path(args.result).write_text(json.dumps(out))
    return 0


SIDES = ("trl", "asyncrl")
TARGETS = {"asyncrl_sync_over_trl_steps_per_s": 2.0, "asyncrl_sync_over_trl_useful_train_tflops": 2.2,
           "asyncrl_async_over_trl_steps_per_s": 2.4}  # issue 48's, on one H100


def reusable(side: str, args, out: Path) -> dict | None:
    """``{"ran", "result"}`` of ``side`` in ``out`` if ``--reuse`` and an earlier call ran the same work, else None."""
    result = out / f"{side}.json"
    if not (args.reuse and result.exists()):
        return None
    saved = json.loads(result.read_text())
    if "ran" in saved and saved["ran"].get("work") == work_of(args, side):
        return saved
    say(f"{side}: {result} ran other work ({saved.get('ran', {}).get('work')}, not {work_of(args, side)}): "
        "running it again")
    return None


def work_of(args, side: str) -> dict:
    sets = args.overrides if side == "asyncrl" else []  # --set changes the asyncrl side only
    return {"steps": args.steps, "warmup": args.warmup, "completion": args.completion, "dry_run": args.cpu_dry_run,
            **({"set": list(sets)} if sets else {})}


def run_side(side: str, args, model_dir: Path, out: Path, before: dict) -> tuple[list[dict], dict]:
    """One side's rows and the call that made them (its meta, whether reused): read from ``out`` (``reusable``), or
    run in a child process and saved there as ``{"ran": meta and work, "result": rows}``."""
    saved = reusable(side, args, out)
    if saved is None:
        result = out / f"{side}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--result", str(result),
               "--model-dir", str(model_dir), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--completion", str(args.completion), "--modes", args.modes] + (["--cpu-dry-run"] if args.cpu_dry_run else [])
        cmd += [x for item in (args.overrides if side == "asyncrl" else []) for x in ("--set", item)]
        t0 = time.perf_counter()
        done = subprocess.run(cmd)
        say(f"{side}: exit {done.returncode} in {time.perf_counter() - t0:.0f} s")
        if done.returncode != 0 or not result.exists():
            return [], {}
        saved = {"ran": {**before, "work": work_of(args, side)}, "result": json.loads(result.read_text())}
        result.write_text(json.dumps(saved))
        reused = False
    else:
        say(f"{side}: reused {out / f'{side}.json'} ({saved['ran']['command']}, {saved['ran']['date_utc']})")
        reused = True
    got = saved["result"]
    return (got if isinstance(got, list) else [got]), {**saved["ran"], "reused": reused}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps a side and mode (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps before them (default 3)")
    parser.add_argument("--completion", type=int, default=None, help="tokens every completion (default 512; dry 8)")
    parser.add_argument("--model-dir", default=None, help="the model directory: used if it holds one, else written "
                        "there (default: a temporary one)")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--name", default=None)
    parser.add_argument("--modes", default="sync,async", help="asyncrl's modes, comma-separated: sync, async, and any of bench_two_gpus.py's EXTRA_MODES "
                        "(async_overlap: the trainer's passes beside vLLM's decoding)")
    parser.add_argument("--sides", default=",".join(SIDES), help="the sides to run or reuse (default trl,asyncrl)")
    parser.add_argument("--reuse", action="store_true", help="read a side whose result --out already holds "
                        "(same steps, warm-up and completion) instead of running it")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override gpu_real_shape for the asyncrl side (dotted key, YAML value); repeatable")
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dry = args.cpu_dry_run
    args.completion = args.completion or (8 if dry else 512)
    sides = [s for s in args.sides.split(",") if s]
    if not sides or set(sides) - set(SIDES) or args.steps < 1 or args.warmup < 0:
        parser.error(f"--sides {args.sides!r}: a comma-separated subset of {','.join(SIDES)}; --steps >= 1, "
                     f"--warmup >= 0 (got {args.steps}, {args.warmup})")
    from bench_two_gpus import EXTRA_MODES

    allowed = ("sync", "async", *EXTRA_MODES)
    if not args.modes or set(args.modes.split(",")) - set(allowed):
        parser.error(f"--modes {args.modes!r}: a comma-separated subset of {','.join(allowed)}")
    if args.side:
        return child(args)
    before = meta("bench_trl_gpu")
    out = Path(args.out) if args.out else DATA / "bench_trl_gpu" / (
        args.name or time.strftime("%Y-%m-%dT%H%MZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="qwen-"))
    if any(reusable(side, args, out) is None for side in sides) and not (model_dir / "config.json").exists():
        t0 = time.perf_counter()
        build_model_dir(model_dir, dry)
        say(f"model directory {model_dir} in {time.perf_counter() - t0:.1f} s")
    made = {side: run_side(side, args, model_dir, out, before) for side in sides}
    rows = [r for side_rows, _ in made.values() for r in side_rows]
    if all(ran.get("reused") for _, ran in made.values()):  # nothing ran here: the machine is the last side's
        before = {k: v for k, v in made[sides[-1]][1].items() if k not in ("work", "reused")}
    if not rows:
        say("!!! no side produced a result")
        return 1
    steps = pd.DataFrame([s for r in rows for s in r.pop("per_step", [])])
    frame = pd.DataFrame(rows)
    cols = ["side", "mode", "steps_per_s", "gen_s", "train_s", "train_tokens_per_step", "useful_train_tflops", "mfu",
            "peak_allocated_gib"]
    say("\n" + frame[[c for c in cols if c in frame]].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if len(steps):
        say("\nevery step (timed False: warm-up):\n" + steps.drop(columns=["train_flops"]).to_string(
            index=False, float_format=lambda x: f"{x:.4g}"))
    results = {}
    trl = frame[frame.side == "trl"]
    if len(trl):
        for mode in ("sync", "async"):
            ours = frame[(frame.side == "asyncrl") & (frame["mode"] == mode)]
            if len(ours):
                results[f"asyncrl_{mode}_over_trl_steps_per_s"] = float(ours.steps_per_s.iloc[0] / trl.steps_per_s.iloc[0])
                results[f"asyncrl_{mode}_over_trl_useful_train_tflops"] = float(
                    ours.useful_train_tflops.iloc[0] / trl.useful_train_tflops.iloc[0])
        say(f"against TRL: {json.dumps(results)} (issue 48's targets on one H100: {json.dumps(TARGETS)})")
    per_step = {f"{side}_{mode}": {c: [None if pd.isna(x) else x for x in part[c].tolist()]
                                   for c in ("timed", "step_s", "gen_s", "train_s", "train_tokens")}
                for (side, mode), part in steps.groupby(["side", "mode"], sort=False)} if len(steps) else {}
    trl_rows = [r for r in rows if r["side"] == "trl"]
    save("bench_trl_gpu", frame.drop(columns=[c for c in ("per_step_s", "per_step_gen_s") if c in frame]),
         {"steps": args.steps, "warmup": args.warmup, "modes": args.modes, "completion": args.completion, "groups": GROUPS,
          "group_size": GROUP_SIZE, "model": TINY if dry else QWEN, "ratios": results, "dry_run": dry,
          "trl_per_step": {k: trl_rows[0].get(k) for k in ("per_step_s", "per_step_gen_s")} if trl_rows else {},
          "per_step": per_step, "targets": TARGETS,
          "tflops": "asyncrl.metrics.train_flops (6 x parameters x real tokens trained) over training seconds, summed "
                    "over the timed steps, both sides (module docstring)",
          "sides": {side: {k: ran.get(k) for k in ("command", "date_utc", "commit", "reused")}
                    for side, (_, ran) in made.items() if ran}},
         before=before, out=out, files={"steps.csv": steps} if len(steps) else None)
    say(f"raw data: {out}" + ("  (CPU dry run: numbers mean nothing)" if dry else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
