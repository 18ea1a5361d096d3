"""What a randomly initialised model reaches on countdown, on CPU (asyncrl/countdown.py, its verifier
asyncrl.rewards.countdown): the quickstart model with a context long enough for TinyZero's prompt, trained a few
dozen steps, evaluated on the 200 held-out rows before and after (greedy, and pass@8 from eight samples a prompt).

    python benchmarks/bench_countdown.py                  # 30 steps, seed 0
    python benchmarks/bench_countdown.py --steps 60 --seeds 0 1 --name longer
    python benchmarks/bench_countdown.py --preset gpu_quickstart --set model.max_position_embeddings=1024  # a GPU

``--preset`` picks another preset (a GPU one: Megatron trains, vLLM generates and evaluates, its sampled pass@8
included); ``--set KEY=VALUE`` overrides it as the CLI's ``--set`` does.

This is the end-to-end check that countdown runs (the chat template, the verifier, the held-out split) and the
honest baseline for it: a 0.4M-parameter byte-level model that has never seen arithmetic. Raw rows (one per step,
and the evaluations) go to ``benchmarks/data/bench_countdown/<name>/`` (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record import meta, save  # noqa: E402


def config(seed: int, max_new_tokens: int, preset: str = "quickstart", overrides: dict | None = None):
    from asyncrl import load_config
    from asyncrl.config import merge_overrides

    # TinyZero's system and user messages through the byte tokenizer's template: ~460 tokens
    base = dict(seed=seed, task={"name": "countdown"}, eval_every=None, model={"max_position_embeddings": 512},
                generation={"max_new_tokens": max_new_tokens})
    if preset == "quickstart":
        base["torch_threads"] = None
    return load_config(preset, **merge_overrides(base, overrides or {}))


def one_seed(seed: int, steps: int, max_new_tokens: int, preset: str = "quickstart",
             overrides: dict | None = None) -> tuple[list[dict], dict]:
    from asyncrl import Controller

    ctrl = Controller.from_config(config(seed, max_new_tokens, preset, overrides))
    before = ctrl.evaluate()
    before8 = ctrl.evaluate(n=8, temperature=1.0, max_prompts=50)
    start = time.perf_counter()
    ctrl.run(steps, progress=False)
    wall = time.perf_counter() - start
    after = ctrl.evaluate()
    after8 = ctrl.evaluate(n=8, temperature=1.0, max_prompts=50)
    m = ctrl.metrics
    rows = [{"seed": seed, "step": int(r.step), "reward_mean": float(r.reward_mean), "loss": float(r.loss),
             "completion_tokens": float(r.completion_tokens)} for r in m.itertuples()]
    summary = {"seed": seed, "steps": steps, "wall_s": wall, "s_per_step": wall / steps,
               "eval_accuracy_before": before["accuracy"], "eval_accuracy_after": after["accuracy"],
               "pass@8_before": before8["pass@8"], "pass@8_after": after8["pass@8"],
               "train_reward_mean": float(m.reward_mean.mean()), "train_reward_max": float(m.reward_mean.max()),
               "prompt_tokens": len(ctrl.encode(ctrl.stream.get(0)))}
    ctrl.close()
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--preset", default="quickstart", help="the preset countdown runs on (a GPU one too)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the preset (dotted key, YAML value), as asyncrl run --set")
    parser.add_argument("--name", default=None, help="run directory name under benchmarks/data/bench_countdown")
    parser.add_argument("--out", default=None, help="write rows.csv/meta.json here instead")
    args = parser.parse_args()
    from asyncrl.cli import parse_overrides

    overrides = parse_overrides(args.overrides)
    before = meta("bench_countdown")
    rows, summaries = [], []
    for seed in args.seeds:
        r, s = one_seed(seed, args.steps, args.max_new_tokens, args.preset, overrides)
        rows += r
        summaries.append(s)
        print(f"seed {seed}: {args.steps} steps in {s['wall_s']:.0f} s; held-out greedy accuracy "
              f"{s['eval_accuracy_before']:.3f} -> {s['eval_accuracy_after']:.3f}, pass@8 {s['pass@8_before']:.2f} -> "
              f"{s['pass@8_after']:.2f}; training reward mean {s['train_reward_mean']:.4f} (max "
              f"{s['train_reward_max']:.4f} a step)", flush=True)
    results = {"steps": args.steps, "max_new_tokens": args.max_new_tokens, "preset": args.preset,
               "overrides": overrides, "seeds": summaries}
    print(f"saved to {save('bench_countdown', rows, results, before=before, out=args.out, name=args.name)}")


if __name__ == "__main__":
    main()
