"""asyncrl beside TRL's ``GRPOTrainer`` on the same model, task, batch and token count, alternating in one run.

    python benchmarks/bench_trl.py [--steps 60] [--repeats 2] [--venv DIR]

TRL is not a dependency of asyncrl. When ``import trl`` fails, this script makes a virtual environment in
``--venv`` (default: ``asyncrl-bench-trl`` in the system temp dir) that sees the current environment's packages
(a ``.pth`` file), installs ``trl==1.16.*`` there with pip (it adds only what is missing: datasets, accelerate,
...), and re-runs itself with that interpreter. Nothing is installed into the current environment.

The work (both sides): the ``quickstart`` preset's model (0.4M-parameter Llama from config, fp32, same seed and
init), its task (copy the first of three letters) and tokenizer, 8 prompts x 8 completions per step, 4 new tokens,
temperature 1, lr 3e-4, one optimizer step per batch, no KL term, one torch thread (``torch_threads: 1``), CPU.
TRL: ``GRPOConfig(per_device_train_batch_size=64, num_generations=8, max_completion_length=4, beta=0,
num_iterations=1)``, transformers' ``generate`` with a KV cache; the loss is TRL's default for 1.16. A TRL step is
timed between its trainer callbacks' step ends (generation, scoring, logprobs, forward/backward, optimizer).
asyncrl: the modes of ``bench_async.py``. Prints ms/step per repeat and the best of each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import venv
import warnings
from pathlib import Path

TRL_SPEC = "trl==1.16.*"
WARMUP = 3


def ensure_trl(venv_dir: Path) -> None:
    """Re-exec under a venv that has TRL, unless ``trl`` imports here."""
    try:
        import trl  # noqa: F401
        return
    except ImportError:
        pass
    if os.environ.get("ASYNCRL_BENCH_TRL_VENV"):
        sys.exit(f"trl still does not import under {sys.executable}; install it there: pip install '{TRL_SPEC}'")
    python = venv_dir / "bin" / "python"
    if not python.exists():
        print(f"trl is not installed here: making {venv_dir} (sees this environment's packages) and installing "
              f"{TRL_SPEC} into it", flush=True)
        venv.EnvBuilder(with_pip=True).create(venv_dir)
        site = subprocess.check_output([python, "-c", "import site; print(site.getsitepackages()[0])"], text=True)
        outer = [p for p in sys.path if p.endswith("site-packages")]  # addsitedir also runs their .pth files
        (Path(site.strip()) / "_outer_env.pth").write_text(f"import site; [site.addsitedir(p) for p in {outer!r}]\n")
    subprocess.check_call([python, "-m", "pip", "install", "-q", TRL_SPEC])
    env = {**os.environ, "ASYNCRL_BENCH_TRL_VENV": str(venv_dir)}
    os.execve(str(python), [str(python), *sys.argv], env)


def trl_run(steps: int, seed: int = 0) -> dict:
    import pyarrow
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl import load_config
    from asyncrl.backends.torch import build_model
    from asyncrl.tasks import build_task
    from asyncrl.tokenizer import build_tokenizer

    cfg = load_config("quickstart", seed=seed)
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    task = build_task(cfg.task)
    model = build_model(cfg.model, len(tokenizer), seed)
    model.config.use_cache = True  # generation with a KV cache, as asyncrl's generator
    # "<bos>" in the text is the special token: prompts are the same ids asyncrl's generator gets.
    by_text = {tokenizer.bos_token + p.text: p for p in task.train_prompts}
    # A fixed fingerprint: datasets' own (a dill hash of the arrow table) fails on Python 3.12 with pyarrow 26.
    dataset = Dataset(pyarrow.table({"prompt": list(by_text)}), fingerprint="asyncrl-bench-trl")

    def reward(prompts, completions, **_):
        return [task.reward(by_text[p], c) for p, c in zip(prompts, completions)]

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=64, num_generations=8,
        max_completion_length=4, temperature=1.0, learning_rate=cfg.trainer.lr, beta=0.0, num_iterations=1,
        max_steps=WARMUP + steps, logging_steps=10**6, save_strategy="no", report_to="none", use_cpu=True,
        bf16=False, fp16=False, seed=seed, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # its end-of-training dict of logs would bury the table
    trainer.train()
    elapsed = ends[-1] - ends[WARMUP - 1]
    return {"mode": "TRL GRPOTrainer", "steps": steps, "ms_per_step": 1e3 * elapsed / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "asyncrl-bench-trl")
    parser.add_argument("--modes", default="stepped sync,sync run,async run,async run (gen process)",
                        help="asyncrl modes (see bench_async.py)")
    parser.add_argument("--out", default=None, help="run directory (default benchmarks/data/bench_trl/<UTC time>)")
    parser.add_argument("--name", default=None, help="name of the run directory under benchmarks/data/bench_trl")
    args = parser.parse_args()
    ensure_trl(args.venv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames, on every TRL run
    sys.path.insert(0, str(Path(__file__).parent))
    import pandas as pd
    import torch
    import trl
    from bench_async import MODES, timed_run
    from record import meta, save

    before = meta("bench_trl")

    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {list(MODES)}")
    work = {"generation": {"max_new_tokens": 4}, "torch_threads": 1}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"steps={args.steps} after {WARMUP} warm-up, repeats={args.repeats}, 8x8 completions, 4 new tokens, "
          f"1 torch thread; trl={trl.__version__} torch={torch.__version__} cpus={len(os.sched_getaffinity(0))} "
          f"load={load:.2f}",
          flush=True)
    order = ["TRL GRPOTrainer", *modes]
    rows = []
    for r in range(args.repeats):
        for mode in order if r % 2 == 0 else order[::-1]:
            row = trl_run(args.steps) if mode == "TRL GRPOTrainer" else timed_run("quickstart", mode, args.steps, work)
            rows.append({"repeat": r, **row})
            print(f"  repeat {r}: {mode}: {row['ms_per_step']:.1f} ms/step", flush=True)
    table = pd.DataFrame(rows)
    by_mode = table.groupby("mode", sort=False).ms_per_step
    trl_best = by_mode.min()["TRL GRPOTrainer"]
    summary = pd.DataFrame({
        "ms/step (best)": by_mode.min(),
        "ms/step (all)": by_mode.apply(lambda s: " ".join(f"{v:.1f}" for v in s)),
        "time vs TRL": by_mode.min() / trl_best,
    })
    print(summary.round(2).to_string())
    where = save("bench_trl", table.drop(columns="stages", errors="ignore"),
                 {"trl": trl.__version__, "steps": args.steps, "repeats": args.repeats, "warmup": WARMUP,
                  "best_ms": by_mode.min().to_dict(), "time_vs_trl": (by_mode.min() / trl_best).to_dict()},
                 before=before, out=args.out, name=args.name)
    print(f"raw data: {where}")


if __name__ == "__main__":
    main()
