"""Reward functions the reward tests name as ``tests.reward_functions:NAME`` (importable in a worker process)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path


def length(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def only_even(completions, completion_ids, **kwargs):
    """Applies to completions with an even number of tokens (None elsewhere)."""
    return [1.0 if len(ids) % 2 == 0 else None for ids in completion_ids]


def even_token_share(completions, completion_ids, **kwargs):
    """The share of a completion's tokens with an even id: a reward that differs between a random model's samples,
    so a group's advantages are not all zero and a step moves the weights (tests/gpu/test_lora_gpu.py)."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def never(completions, **kwargs):
    return [None] * len(completions)


def uses_column(completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def named_params(prompts, completions, answer):  # no **kwargs: gets only what it names
    return [float(p == "p" and c == a) for p, c, a in zip(prompts, completions, answer)]


async def async_length(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def pid(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def pid_after_a_while(completions, **kwargs):
    time.sleep(0.3)
    return [float(os.getpid())] * len(completions)


def slow(completions, **kwargs):
    time.sleep(30)
    return [0.0] * len(completions)


def slow_once(completions, marker, **kwargs):
    """Hangs the first time (``marker``: a path column), then gives its process id."""
    path = Path(marker[0])
    if not path.exists():
        path.write_text("hung")
        time.sleep(30)
    return [float(os.getpid())] * len(completions)


def raises(completions, **kwargs):
    raise ValueError("the verifier is down")


def nan(completions, **kwargs):
    return [float("nan")] * len(completions)


def short(completions, **kwargs):
    return [1.0]


def words(completions, **kwargs):
    return ["yes"] * len(completions)


def scalar(completions, **kwargs):
    return 1.0


def dies_once(completions, marker, **kwargs):
    """SIGKILLs its own worker the first time (``marker``: a path column), then scores 1."""
    path = Path(marker[0])
    if not path.exists():
        path.write_text("died")
        os.kill(os.getpid(), signal.SIGKILL)
    return [1.0] * len(completions)


def wait_10ms(completions, **kwargs):
    time.sleep(0.01)
    return [1.0] * len(completions)


def old_signature(prompt, completion_text):
    return 1.0


def first_char(prompts, completions, **kwargs):
    """The quickstart task (copy_first) as a TRL reward: the completion starts with the prompt's first letter."""
    return [1.0 if c.strip()[:1] == p[:1] else 0.0 for p, c in zip(prompts, completions)]


def _once(prompts, completion_ids, what: str) -> bool:
    """True the first time this group (its prompt and completions) is seen, in any process: a marker file in
    ``$ASYNCRL_REWARD_MARKERS``."""
    import hashlib

    key = hashlib.sha1(f"{what}|{prompts[0]}|{completion_ids}".encode()).hexdigest()
    path = Path(os.environ["ASYNCRL_REWARD_MARKERS"]) / key
    if path.exists():
        return False
    path.write_text(what)
    return True


def fails_once(prompts, completions, completion_ids, **kwargs):
    if _once(prompts, completion_ids, "fails"):
        raise RuntimeError("the verifier hiccuped")
    return first_char(prompts, completions)


def hangs_once(prompts, completions, completion_ids, **kwargs):
    if _once(prompts, completion_ids, "hangs"):
        time.sleep(30)
    return first_char(prompts, completions)


def killed_once(prompts, completions, completion_ids, **kwargs):
    if _once(prompts, completion_ids, "killed"):
        os.kill(os.getpid(), signal.SIGKILL)
    return first_char(prompts, completions)


def first_char_slowly(prompts, completions, **kwargs):
    """``first_char`` taking 10 ms a group: scored in the rollout pump's thread (``reward.workers: 0``), a batch
    takes longer than a train step, so a step mostly ends while the pump holds a batch it generated and has not
    committed yet (tests/test_resume_kill.py saves with batches in flight that way)."""
    time.sleep(0.01)
    return first_char(prompts, completions)


# --- faults only an evaluation sees (tests/test_evaluation_faults.py): the held-out prompts of copy_first with
# task.options.eval_fraction $ASYNCRL_EVAL_FRACTION (the training prompts never match)
_EVAL: set | None = None


def _evaluating(prompts) -> bool:
    global _EVAL
    if _EVAL is None:
        from asyncrl.tasks import build_task

        options = {"eval_fraction": float(os.environ.get("ASYNCRL_EVAL_FRACTION", "0.2"))}
        _EVAL = {p.text for p in build_task({"name": "copy_first", "options": options}).eval_prompts}
    return prompts[0] in _EVAL


def raises_on_eval(prompts, completions, **kwargs):
    if _evaluating(prompts):
        raise RuntimeError("the held-out verifier is down")
    return first_char(prompts, completions)


def exits_on_eval(prompts, completions, **kwargs):
    if _evaluating(prompts):
        os._exit(3)
    return first_char(prompts, completions)


def sleeps_on_eval(prompts, completions, **kwargs):
    if _evaluating(prompts):
        time.sleep(30)
    return first_char(prompts, completions)


def huge_on_b(prompts, completions, **kwargs):
    """1e308 (finite) for the prompts that start with "b", else 0: times a weight of 2 the total overflows."""
    return [1e308 if p.startswith("b") else 0.0 for p in prompts]


def huge(completions, **kwargs):
    return [1e308] * len(completions)
