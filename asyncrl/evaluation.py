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

from asyncrl.chat import prompt_ids
from asyncrl.prompts import Prompt

# score(prompt, texts, completion_ids) -> (total reward of each completion, whether each is correct)
Score = Callable[[Prompt, list[str], list[list[int]]], tuple[list[float], list[bool]]]


def completions(generator: Any, prompts: Sequence[Prompt], tokenizer: Any, n: int, temperature: float,
                seed: int, max_new_tokens: int) -> list[list[list[int]]]:
    """``n`` completions (token ids) of each (rendered) prompt: greedy when ``temperature`` is 0, else sampled
    through ``generator.generate_sampled(prompt_ids, n, temperature, seed, max_new_tokens)``."""
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    if temperature == 0:
        greedy = generator.generate_greedy(ids, max_new_tokens)
        return [[list(c)] * n for c in greedy]
    sample = getattr(generator, "generate_sampled", None)
    if sample is None:
        raise ValueError(f"evaluate(temperature={temperature}): the generator {type(generator).__name__} samples only "
                         "rollouts; evaluate with temperature=0.0 (greedy), or use the torch generator")
    flat = sample(ids, n, temperature, seed, max_new_tokens)
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
