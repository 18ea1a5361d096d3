"""A chat model directory for the countdown tool task (the ``gpu_countdown_tools`` preset), built offline: what
``tests/gpu/test_agents_gpu.py`` and ``benchmarks/bench_agents_gpu.py`` run, and what ``model.hf_path`` names.

    from tool_model import build_tool_model_dir
    info = build_tool_model_dir("/tmp/countdown-tools")            # ~23M parameters, 500 SFT steps, ~30 s on a GPU
    python benchmarks/tool_model.py /tmp/countdown-tools [--shape tiny] [--steps N]

The directory, as the other benchmarks build theirs (``bench_trl_gpu.build_model_dir``): a Qwen2-shaped model
(config.json, safetensors) and the byte tokenizer padded to 512 ids (``asyncrl/tokenizer.py``), whose chat
template is ``TOOL_CHAT_TEMPLATE`` (tools and Hermes ``<tool_call>``: ``asyncrl.environments.check_template``
accepts it). A randomly initialised model all but never writes a well-formed tool call, so the weights are
warm-started by a short supervised pass on synthetic countdown transcripts that call the tool, token for token as
``asyncrl/turns.py`` lays a trajectory out (the prompt rendered with the tools and the environment's hint, each
model turn then ``<eos>``, each tool result rendered by the template): half of them call ``calculate`` with the
solution and answer (2 turns), half first try another expression, read its value, call the solution, then answer
(3 turns). Only the model's turns are trained (the loss mask of the RL run). The rows come from
``countdown_rows`` with a seed of their own (``SFT_SEED``), not the task's.

``info`` (also ``tool_model.json`` in the directory): the shape, parameters, steps, seconds, the loss at the start
and the end, and ``probe_tool_call_rate``: the share of sampled first turns (temperature 1) of held-out prompts that
parse as a ``calculate`` call, so a run that makes no tool call can be told from a model that never learnt to.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asyncrl.countdown import USER_PROMPT, countdown_rows  # noqa: E402
from asyncrl.environments.calculator import HINT, Calculator, evaluate  # noqa: E402

SFT_SEED = 12345  # the transcripts' rows: apart from the task's (seed 0)
SHAPES = {
    # ~23M parameters: the SFT pass and an RL step take seconds on an H100
    "small": dict(vocab_size=512, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1408, max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=1e4),
    # CPU tests: the same directory's shape of things, in a second
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=1e4),
}


def tool_tokenizer(vocab_size: int = 512):
    """The byte tokenizer padded to ``vocab_size`` with the tool chat template."""
    from asyncrl.tokenizer import TOOL_CHAT_TEMPLATE, build_tokenizer

    tok = build_tokenizer(vocab_size)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def tools() -> list[dict]:
    from asyncrl.environments import describe_class

    return list(describe_class(Calculator).tools)


def prompt_messages(row: dict) -> list[dict]:
    """A countdown row's prompt as the tool task's trajectory starts (countdown's user message, no system prompt,
    extended by ``Calculator.reset``'s hint as ``asyncrl/turns.py`` extends it)."""
    return [{"role": "user", "content": f"{USER_PROMPT.format(nums=row['nums'], target=row['target'])}\n\n{HINT}"}]


def call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculate", "arguments": {"expression": expression}}) + "</tool_call>"


def turns(row: dict, rng: random.Random) -> list[dict]:
    """The messages after the prompt: tool calls, their results, the answer (module docstring)."""
    out = []
    wrong = " + ".join(str(n) for n in row["nums"])
    if rng.random() < 0.5 and evaluate(wrong) != str(row["target"]):
        out += [{"role": "assistant", "content": call(wrong)}, {"role": "tool", "name": "calculate",
                                                                 "content": evaluate(wrong)}]
    out += [{"role": "assistant", "content": call(row["solution"])},
            {"role": "tool", "name": "calculate", "content": evaluate(row["solution"])},
            {"role": "assistant", "content": f"<answer>{row['solution']}</answer>"}]
    return out


def encode(tok, prompt: list[dict], after: list[dict], schemas: list[dict]) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of a transcript laid out as ``asyncrl/turns.py`` holds a trajectory: the rendered prompt, each
    model turn's tokens then ``<eos>`` (mask 1), each observation the template's rendering minus what is held."""
    def render(messages):
        return tok.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)

    messages = [dict(m) for m in prompt]
    text = render(messages)
    ids = tok.encode(text, add_special_tokens=False)
    mask = [0] * len(ids)
    for m in after:
        messages.append(m)
        if m["role"] == "assistant":
            turn = tok.encode(m["content"], add_special_tokens=False) + [tok.eos_token_id]
            ids, mask, text = ids + turn, mask + [1] * len(turn), text + m["content"] + tok.eos_token
            continue
        rendered = render(messages)
        if not rendered.startswith(text):
            raise ValueError("the tool chat template re-rendered an earlier turn")
        obs = tok.encode(rendered[len(text):], add_special_tokens=False)
        ids, mask, text = ids + obs, mask + [0] * len(obs), rendered
    return ids, mask


def build_tool_model_dir(path: str | Path, shape: str = "small", steps: int = 500, batch: int = 32,
                         lr: float = 1e-3, device: str | None = None, seed: int = 0, rows: int = 1000,
                         probe: int = 32, log_every: int = 50) -> dict:
    """Write the warm-started chat model directory at ``path`` (module docstring); returns its ``info``. Prints the
    loss every ``log_every`` steps (0: silent)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: one of {sorted(SHAPES)}")
    t0 = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = SHAPES[shape]
    tok, schemas = tool_tokenizer(spec["vocab_size"]), tools()
    data = countdown_rows(rows + probe, seed=SFT_SEED, min_numbers=3, max_numbers=4)
    rng = random.Random(seed)
    examples = [encode(tok, prompt_messages(r), turns(r, rng), schemas) for r in data[:rows]]
    torch.manual_seed(seed)
    config = Qwen2Config(**spec, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(config).to(device)
    cuda = str(device).startswith("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))
    losses = []
    model.train()
    for step in range(steps):
        chosen = [examples[rng.randrange(len(examples))] for _ in range(batch)]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, (row_ids, row_mask) in enumerate(chosen):
            n = len(row_ids)
            ids[i, :n], attention[i, :n] = torch.tensor(row_ids), 1
            labels[i, :n] = torch.where(torch.tensor(row_mask) == 1, torch.tensor(row_ids), -100)
        ids, labels, attention = ids.to(device), labels.to(device), attention.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=ids, attention_mask=attention).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            print(f"  tool model: SFT step {step + 1}/{steps}, loss {losses[-1]:.3f}, "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    train_s = time.perf_counter() - t0
    rate = probe_tool_calls(model, tok, schemas, data[rows:], device) if probe else float("nan")
    del optimizer, schedule  # the GPU memory goes back before the engines are built (vLLM checks what is free)
    model = model.to(torch.bfloat16 if cuda else torch.float32)
    model.config.dtype = model.dtype
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    info = {"shape": shape, **spec, "parameters": sum(p.numel() for p in model.parameters()), "steps": steps,
            "batch": batch, "lr": lr, "device": str(device), "sft_rows": rows, "sft_seed": SFT_SEED,
            "loss_first": losses[0] if losses else float("nan"),
            "loss_last": sum(losses[-10:]) / len(losses[-10:]) if losses else float("nan"),
            "sft_s": round(train_s, 2), "probe_prompts": probe, "probe_tool_call_rate": rate,
            "build_s": round(time.perf_counter() - t0, 2)}
    (path / "tool_model.json").write_text(json.dumps(info, indent=1) + "\n")
    del model
    if cuda:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return info


def ensure_tool_model_dir(path: str | Path, **kwargs) -> dict:
    """The directory at ``path`` if an earlier build left it whole (its ``tool_model.json``), else built there now
    (``build_tool_model_dir(path, **kwargs)``); its ``info`` with ``reused`` saying which."""
    done = Path(path) / "tool_model.json"
    if done.exists() and (Path(path) / "config.json").exists():
        return {**json.loads(done.read_text()), "reused": True}
    return {**build_tool_model_dir(path, **kwargs), "reused": False}


def probe_tool_calls(model, tok, schemas: list[dict], rows: list[dict], device) -> float:
    """The share of sampled first turns (temperature 1, at most 96 tokens) of ``rows``' prompts that parse as a
    ``calculate`` call."""
    import torch

    from asyncrl.environments import parse_tool_calls

    prompts = [tok.encode(tok.apply_chat_template(prompt_messages(r), tools=schemas, tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False) for r in rows]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)  # left-padded
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], attention[i, width - len(p):] = torch.tensor(p), 1
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(device).startswith("cuda")):
        out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=96, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    good = [any(isinstance(c, tuple) and c[0] == "calculate" for c in parse_tool_calls(t)) for t in texts]
    return sum(good) / len(good)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    print(json.dumps(build_tool_model_dir(args.path, args.shape, args.steps, device=args.device), indent=1))
