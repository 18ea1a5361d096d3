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
- Scoring is the training's (``asyncrl.rewards.scoring.score_now``): through a ``RewardRunner`` (the run's
  workers and ``reward.timeout_s``; alone, an inline one), re-scored within ``faults.reward_retries``, each failure
  a ``fault`` row. A prompt whose scoring keeps failing is left out of every mean and counted in ``eval_failed``;
  ``n`` counts the prompts scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from asyncrl.backends.base import capabilities
from asyncrl.chat import prompt_ids
from asyncrl.metrics import EVAL_FAILED
from asyncrl.prompts import Prompt
from asyncrl.rewards.functions import RewardFunctions
from asyncrl.rewards.runner import RewardRunner
from asyncrl.rewards.scoring import evaluation_functions, group_batch, score_now

# score(prompts, texts, completion_ids) -> for each prompt, (total reward of each completion, whether each is
# correct), or None: its scoring failed past the retries (left out of the evaluation, counted in eval_failed)
__all__ = ["evaluate_prompts", "evaluate_task", "scorer", "split_prompts"]
Score = Callable[[Sequence[Prompt], list[list[str]], list[list[list[int]]]],
                 list[tuple[list[float], list[bool]] | None]]
Fault = Callable[[int | None, str, str], None]  # fault(group_id, error, reason): a ``fault`` trace row


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
    """(summary, rows): the summary's ``mean@n``, ``pass@n``, ``reward_mean``, ``accuracy``, ``n`` (prompts
    evaluated) and ``eval_failed`` (prompts left out: their scoring kept failing), and one row per completion of
    the prompts evaluated (``prompt_id``, ``completion_index``, ``completion``, ``reward``, ``correct``)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"evaluate(n={n!r}): completions per prompt, an integer >= 1")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"evaluate(temperature={temperature!r}): 0.0 (greedy) or a positive sampling temperature")
    groups = completions(generator, prompts, tokenizer, n, float(temperature), seed, max_new_tokens) if prompts else []
    texts = [tokenizer.batch_decode(ids, skip_special_tokens=True) for ids in groups]
    scores = score(prompts, texts, groups) if prompts else []
    rows, means, passes, rewards = [], [], [], []
    for prompt, outputs, scored in zip(prompts, texts, scores):
        if scored is None:  # left out: its scoring failed past the retries (the fault rows say why)
            continue
        totals, correct = scored
        means.append(float(np.mean(correct)))
        passes.append(float(any(correct)))
        rewards.extend(totals)
        rows += [{"prompt_id": prompt.id, "completion_index": i, "completion": t, "reward": r, "correct": bool(c)}
                 for i, (t, r, c) in enumerate(zip(outputs, totals, correct))]
    mean = lambda values: float(np.mean(values)) if values else float("nan")  # noqa: E731  (none scored: NaN)
    summary = {f"mean@{n}": mean(means), f"pass@{n}": mean(passes), "reward_mean": mean(rewards),
               "accuracy": mean(means), "n": float(len(means)), EVAL_FAILED.name: float(len(scores) - len(means))}
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


def scorer(task: Any, functions: RewardFunctions | None = None, accuracy: str | None = None,
           runner: RewardRunner | None = None, retries: int = 0, fault: Fault | None = None) -> Score:
    """How an evaluation scores its prompts' completions: the task's own ``reward``/``is_correct`` (a toy task:
    what ``eval_every`` always reported), else the run's reward functions, called as TRL calls them (see the
    module's invariants for what is correct). ``runner`` scores them (``GroupScorer.evaluation_runner``: the run's
    workers; None: an inline one of ``evaluation_functions``), each prompt re-scored up to ``retries`` times, each
    failure ``fault(None, error, reason)``; a prompt that keeps failing is None."""
    functions = functions if functions is not None else RewardFunctions.of_task(task)
    if accuracy is not None and accuracy not in functions.names:
        raise ValueError(f"reward.accuracy {accuracy!r} is not one of the reward functions {functions.names}")
    own = evaluation_functions(functions) if runner is None else runner.functions

    def correct(parts: dict[str, list], totals: list[float]) -> list[bool]:
        if functions.is_task:  # the task's own is_correct, asked beside its reward
            return [v >= 1.0 for v in parts["is_correct"]]
        if accuracy is not None:
            return [v is not None and v >= 1.0 for v in parts[accuracy]]
        results = [parts[name] for name in functions.names]
        best = [sum(w for w, r in zip(functions.weights, column) if r is not None) for column in zip(*results)]
        return [any(r is not None for r in column) and t >= b for t, b, column in zip(totals, best, zip(*results))]

    def score(prompts: Sequence[Prompt], texts: list[list[str]], ids: list[list[list[int]]]):
        batches = [group_batch(p, list(t), [list(i) for i in c]) for p, t, c in zip(prompts, texts, ids)]

        def failed(i: int, error: str, reason: str) -> None:
            if fault is not None:
                fault(None, f"evaluation of prompt {prompts[i].id!r}: {error}", reason)

        scored, bug = score_now(runner or RewardRunner(own, 0, None), batches, retries, failed)
        if bug is not None:  # a programming error, as in training: the fault is recorded, the caller stops
            raise bug
        return [None if s is None else (s.rewards, correct(s.parts, s.rewards)) for s in scored]

    return score


def evaluate_task(generator: Any, task: Any, tokenizer: Any, functions: RewardFunctions | None = None,
                  split: str = "eval", n: int = 1, temperature: float = 0.0, max_prompts: int | None = None,
                  seed: int = 0, max_new_tokens: int = 4, accuracy: str | None = None,
                  runner: RewardRunner | None = None, retries: int = 0,
                  fault: Fault | None = None) -> tuple[dict, list[dict]]:
    """``evaluate_prompts`` on a task's split with the run's reward functions (``Controller.evaluate``: the run's
    ``runner``, ``retries`` and ``fault`` rows; see ``scorer``)."""
    prompts = split_prompts(task, split, max_prompts)
    return evaluate_prompts(generator, prompts, tokenizer, scorer(task, functions, accuracy, runner, retries, fault),
                            n, temperature, seed, max_new_tokens)
