"""Evaluation on a split: ``n`` completions per prompt, greedy or sampled, scored by the run's reward functions;
``mean@n`` (the share of correct completions, averaged over prompts) and ``pass@n`` (the share of prompts with at
least one correct completion), with ``reward_mean`` and ``accuracy`` as before.

Invariants:
- Draws nothing from the run's random streams: greedy completions draw no randomness, sampled ones come from a
  generator of their own seeded by ``seed`` (``Controller.evaluate`` derives it from the run's seed and the weight
  version), so a run with evaluations is the run without them.
- Greedy is deterministic: with ``temperature`` 0 the prompt's one greedy completion stands for all ``n`` (so
  ``mean@n`` equals ``pass@n`` equals ``accuracy``).
- ``accuracy`` is ``mean@n``; with ``n`` 1 and the default greedy decoding it is the accuracy ``eval_every`` always
  reported (a toy task's ``is_correct``), bit for bit.
- A completion is correct when the function ``reward.accuracy`` names gave it 1 (or more), else when its total
  reward is at its maximum: every function that applied gave it 1 (a weighted sum of rewards in [0, 1]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from asyncrl.backends.base import capabilities
from asyncrl.chat import prompt_ids
from asyncrl.prompts import Prompt
from asyncrl.rewards.functions import RewardBatch, RewardFunctions, call

# score(prompt, texts, completion_ids) -> (total reward of each completion, whether each is correct)
__all__ = ["evaluate_prompts", "evaluate_task", "scorer", "split_prompts"]
Score = Callable[[Prompt, list[str], list[list[int]]], tuple[list[float], list[bool]]]


def completions(generator: Any, prompts: Sequence[Prompt], tokenizer: Any, n: int, temperature: float,
                seed: int, max_new_tokens: int) -> list[list[list[int]]]:
    """``n`` completions (token ids) of each (rendered) prompt: greedy when ``temperature`` is 0, else sampled
    through ``generator.generate_sampled(prompt_ids, n, temperature, seed, max_new_tokens)``."""
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    if temperature == 0:
        greedy = generator.generate_greedy(ids, max_new_tokens)
        return [[list(c)] * n for c in greedy]
    if not capabilities(generator).sampled_evaluation:
        raise ValueError(f"evaluate(temperature={temperature}): the generator {type(generator).__name__} samples only "
                         "rollouts; evaluate with temperature=0.0 (greedy), or use the torch or vLLM generator")
    flat = generator.generate_sampled(ids, n, temperature, seed, max_new_tokens)
    return [list(flat[i * n:(i + 1) * n]) for i in range(len(prompts))]


def evaluate_prompts(generator: Any, prompts: Sequence[Prompt], tokenizer: Any, score: Score, n: int = 1,
                     temperature: float = 0.0, seed: int = 0, max_new_tokens: int = 4) -> tuple[dict, list[dict]]:
    """(summary, rows): the summary's ``mean@n``, ``pass@n``, ``reward_mean``, ``accuracy`` and ``n`` (prompts
    evaluated), and one row per completion (``prompt_id``, ``completion_index``, ``completion``, ``reward``,
    ``correct``)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"evaluate(n={n!r}): completions per prompt, an integer >= 1")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"evaluate(temperature={temperature!r}): 0.0 (greedy) or a positive sampling temperature")
    if not prompts:
        nan = float("nan")
        return {f"mean@{n}": nan, f"pass@{n}": nan, "reward_mean": nan, "accuracy": nan, "n": 0.0}, []
    groups = completions(generator, prompts, tokenizer, n, float(temperature), seed, max_new_tokens)
    rows, means, passes, rewards = [], [], [], []
    for prompt, ids in zip(prompts, groups):
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        totals, correct = score(prompt, texts, ids)
        means.append(float(np.mean(correct)))
        passes.append(float(any(correct)))
        rewards.extend(totals)
        rows += [{"prompt_id": prompt.id, "completion_index": i, "completion": t, "reward": r, "correct": bool(c)}
                 for i, (t, r, c) in enumerate(zip(texts, totals, correct))]
    summary = {f"mean@{n}": float(np.mean(means)), f"pass@{n}": float(np.mean(passes)),
               "reward_mean": float(np.mean(rewards)), "accuracy": float(np.mean(means)), "n": float(len(prompts))}
    return summary, rows


def split_prompts(task: Any, split: str, max_prompts: int | None = None) -> list[Prompt]:
    """The prompts of ``split`` ("eval": the task's evaluation prompts, "train": its training prompts), the first
    ``max_prompts`` of them; a split the task does not have is one line saying how to give it one."""
    if split not in ("train", "eval"):
        raise ValueError(f"evaluate(split={split!r}): the splits are 'eval' and 'train'")
    if max_prompts is not None and (not isinstance(max_prompts, int) or isinstance(max_prompts, bool)
                                    or max_prompts < 1):
        raise ValueError(f"evaluate(max_prompts={max_prompts!r}): an integer >= 1, or None (the whole split)")
    prompts = list(task.eval_prompts if split == "eval" else task.train_prompts)
    if not prompts:
        raise ValueError(f"task {task.name!r} has no {split!r} split to evaluate on: set task.options.eval (a "
                         "dataset of its own) or task.options.eval_fraction, or pass eval_dataset=")
    return prompts[:max_prompts]


def scorer(task: Any, functions: RewardFunctions | None = None, accuracy: str | None = None) -> Score:
    """How an evaluation scores a prompt's completions: the task's own ``reward``/``is_correct`` (a toy task: what
    ``eval_every`` always reported), else the run's reward functions, called as TRL calls them (see the module's
    last invariant for what is correct)."""
    if functions is None or functions.is_task:
        return lambda p, texts, ids: ([task.reward(p, t) for t in texts], [task.is_correct(p, t) for t in texts])
    if accuracy is not None and accuracy not in functions.names:
        raise ValueError(f"reward.accuracy {accuracy!r} is not one of the reward functions {functions.names}")

    def score(prompt: Prompt, texts: list[str], ids: list[list[int]]) -> tuple[list[float], list[bool]]:
        n = len(texts)
        conversational = prompt.messages is not None
        batch = RewardBatch([prompt.prompt] * n, [[{"role": "assistant", "content": t}] for t in texts]
                            if conversational else list(texts), [list(i) for i in ids],
                            {k: [v] * n for k, v in prompt.columns.items()}, source=prompt)
        results = [call(f, name, batch) for f, name in zip(functions.funcs, functions.names)]
        totals = functions.combine(results)
        if accuracy is not None:
            values = results[functions.names.index(accuracy)]
            return totals, [v is not None and v >= 1.0 for v in values]
        best = [sum(w for w, r in zip(functions.weights, column) if r is not None) for column in zip(*results)]
        return totals, [any(r is not None for r in column) and t >= b for t, b, column in
                        zip(totals, best, zip(*results))]

    return score


def evaluate_task(generator: Any, task: Any, tokenizer: Any, functions: RewardFunctions | None = None,
                  split: str = "eval", n: int = 1, temperature: float = 0.0, max_prompts: int | None = None,
                  seed: int = 0, max_new_tokens: int = 4, accuracy: str | None = None) -> tuple[dict, list[dict]]:
    """``evaluate_prompts`` on a task's split with the run's reward functions (``Controller.evaluate``)."""
    prompts = split_prompts(task, split, max_prompts)
    return evaluate_prompts(generator, prompts, tokenizer, scorer(task, functions, accuracy), n, temperature, seed,
                            max_new_tokens)
