"""Does the ``grpo`` preset train a real (warm-started) chat model stably on a dataset? Entropy over 50 CPU steps.

    python benchmarks/bench_grpo_preset.py [--steps 50] [--seed 0]

A tiny Qwen3 directory (byte tokenizer with its chat template, written here, no downloads) is warm-started by
supervised fine-tuning to answer conversational prompts ("cab" -> "the answer is c", the first letter) with a
completion of ~16 tokens, stopped early so that held-out accuracy is partial. Then GRPO from that directory
(``model.hf_path``) on the same rows as a dataset (``train_dataset=``, 20% held out), completions of up to 24 tokens,
a reward function defined here (1 for the right letter after "answer is"), three configurations:
- ``grpo``: the preset as it is (TRL 1.16's defaults: lr 1e-6, no entropy bonus);
- ``grpo_lr1e-4``: the preset at a rate at which the weights visibly move in 50 steps;
- ``grpo_lr1e-4_entropy0.03``: the same with the quickstart preset's entropy bonus (the issue-47 failure).
Per step: the policy's entropy (mean over completion tokens), the reward and completion length; after the run
held-out greedy accuracy. Raw rows through ``benchmarks/record.py`` (``benchmarks/data/bench_grpo_preset/``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

LETTERS = "abcdefgh"
ANSWER = re.compile(r"answer is (\w)")


def rows() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": "".join(s)}], "answer": s[0]}
            for s in itertools.product(LETTERS, repeat=3)]


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """TRL's signature; conversational completions are lists of messages."""
    out = []
    for completion, expected in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        found = ANSWER.search(text)
        out.append(1.0 if found is not None and found.group(1) == expected else 0.0)
    return out


def warm_start(path: Path, data: list[dict], sft_steps: int, seed: int) -> None:
    """A tiny Qwen3 directory taught by plain supervised steps to answer ``the answer is X`` then eos."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncrl.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128, vocab_size=len(tok),
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    examples = []
    for row in data:
        prompt = tok(tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False).input_ids
        target = tok(f"the answer is {row['answer']}", add_special_tokens=False).input_ids + [tok.eos_token_id]
        examples.append((prompt, target))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(sft_steps):
        batch = [examples[i] for i in torch.randint(0, len(examples), (32,), generator=g).tolist()]
        width = max(len(p) + len(t) for p, t in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for r, (p, t) in enumerate(batch):
            ids[r, :len(p) + len(t)] = torch.tensor(p + t)
            labels[r, len(p):len(p) + len(t)] = torch.tensor(t)
        loss = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))


def run(name: str, model_dir: Path, data: list[dict], steps: int, seed: int, overrides: dict) -> tuple[list, dict]:
    import pandas as pd  # noqa: F401

    from asyncrl import Controller, load_config
    from asyncrl.config import merge_overrides

    train = [r for i, r in enumerate(data) if i % 5]
    held_out = [r for i, r in enumerate(data) if i % 5 == 0]
    cfg = load_config("grpo", **merge_overrides({"seed": seed, "model": {"hf_path": str(model_dir)}, "eval_every": None,
                                                 "generation": {"max_new_tokens": 24},
                                                 "trainer": {"lr_decay_steps": steps}}, overrides))
    ctrl = Controller.from_config(cfg, train_dataset=train, eval_dataset=held_out, reward_funcs=[answer_reward])
    before = ctrl.evaluate()["accuracy"]
    start = time.perf_counter()
    ctrl.run(steps, progress=False)
    wall = time.perf_counter() - start
    after = ctrl.evaluate()["accuracy"]
    m = ctrl.metrics
    out = [{"config": name, "step": int(i), "entropy": float(r.entropy), "reward_mean": float(r.reward_mean),
            "completion_tokens_mean": float(r.completion_tokens) / float(r.completions), "lr": float(r.lr)}
           for i, r in m.iterrows()]
    ctrl.close()
    return out, {"config": name, "lr": cfg.trainer.lr, "entropy_coef": cfg.loss.entropy_coef,
                 "entropy_first": out[0]["entropy"], "entropy_max": max(r["entropy"] for r in out),
                 "entropy_last": out[-1]["entropy"], "reward_first": out[0]["reward_mean"],
                 "reward_last5": sum(r["reward_mean"] for r in out[-5:]) / 5,
                 "heldout_accuracy_before": before, "heldout_accuracy_after": after, "wall_s": wall}


CONFIGS = {
    "grpo": {},
    "grpo_lr1e-4": {"trainer": {"lr": 1e-4}},
    "grpo_lr1e-4_entropy0.03": {"trainer": {"lr": 1e-4}, "loss": {"entropy_coef": 0.03}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default=None)
    args = parser.parse_args()

    import pandas as pd
    import torch
    from record import meta, save

    torch.set_num_threads(1)
    before = meta("bench_grpo_preset")
    data = rows()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3-warm"
        warm_start(model_dir, data, args.sft_steps, args.seed)
        steps, summary = [], []
        for name in args.configs.split(","):
            per_step, result = run(name, model_dir, data, args.steps, args.seed, CONFIGS[name])
            steps += per_step
            summary.append(result)
            print(json.dumps(result))
    table = pd.DataFrame(summary)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    results = {"summary": summary, "steps": args.steps, "sft_steps": args.sft_steps, "seed": args.seed,
               "max_entropy_possible": float(torch.log(torch.tensor(259.0)))}
    print(save("bench_grpo_preset", pd.DataFrame(steps), results, before=before, out=args.out, name=args.name))


if __name__ == "__main__":
    main()
