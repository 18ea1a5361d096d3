"""Tasks: prompts, a verifiable reward, held-out evaluation prompts, and the bar learning is judged against.

A task's ``constant_answer_accuracy`` is the best accuracy any prompt-independent answer scores on its
evaluation prompts (computed from the prompts with the task's own ``is_correct``). A tiny model first learns the
answer *format*, then often collapses onto one answer: only accuracy well above this bar shows it learned a
prompt-dependent answer.

Built-in toy tasks (``build_task(TaskConfig(name=..., options={...}))``):

| name | prompt → answer | evaluation prompts | constant answer |
| --- | --- | --- | --- |
| ``copy_digit`` | ``"7="`` → ``"7"`` | the same 10 prompts (nothing to hold out) | 0.10 |
| ``copy_first`` | ``"cab="`` → ``"c"`` | held out: 3-character strings never trained on | ≈ 1/len(alphabet) |
| ``copy_last`` | ``"cab="`` → ``"b"`` | held out, as above | ≈ 1/len(alphabet) |
| ``successor`` | ``"c>"`` → ``"d"`` | the same 25 prompts (a..y) | 0.04 |
| ``addition`` | ``"3+4="`` → ``"7"`` (digits 0..``max_digit``) | the same prompts | 0.20 |

Tasks from data (their prompts carry their rows' columns, ``Prompt.columns``; the run's reward functions score
them):

| name | prompts | evaluation prompts |
| --- | --- | --- |
| ``dataset`` | your file or object's ``prompt`` column (``asyncrl/datasets.py``) | ``eval``, ``eval_fraction`` or none |
| ``countdown`` | TinyZero's countdown, generated from a seed (``asyncrl/countdown.py``) | held-out rows |

Scoring: the completion text (decoded without special tokens; anything from a literal ``<eos>`` on is cut) is
stripped of leading whitespace and its first ``len(answer)`` characters are compared with the answer. Reward 1 for
correct, else 0 — or ``partial_credit`` (option, default 0) when the answer has the right form (e.g. a digit for
``addition``).

``PromptStream`` (``asyncrl/prompts.py``) serves training prompts by data position (a seeded shuffle per epoch) so a
run can be resumed from its position alone.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Sequence
from functools import cached_property, partial
from typing import Any, Protocol, runtime_checkable

import numpy as np

from asyncrl.chat import prompt_ids, render
from asyncrl.countdown import countdown_task
from asyncrl.datasets import DataError, DatasetTask, check_reward_columns, dataset_task
from asyncrl.metrics import HELD_OUT_ACCURACY, HELD_OUT_REWARD
from asyncrl.prompts import Prompt, PromptStream

__all__ = ["Prompt", "PromptStream", "Task", "ToyTask", "TASKS", "TOY_TASKS", "build_task", "check_rewards",
           "evaluate", "task_with_data"]


@runtime_checkable
class Task(Protocol):
    name: str
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]

    @property
    def constant_answer_accuracy(self) -> float: ...

    def reward(self, prompt: Prompt, completion_text: str) -> float: ...

    def is_correct(self, prompt: Prompt, completion_text: str) -> bool: ...


def completion_answer(completion_text: str, n_chars: int) -> str:
    """The part of a completion that is graded: cut at a literal ``<eos>``, strip leading whitespace, keep the
    first ``n_chars`` characters."""
    return completion_text.split("<eos>", 1)[0].lstrip()[:n_chars]


class ToyTask:
    """A task over a fixed prompt list with exact single-answer grading (see the module docstring)."""

    def __init__(self, name: str, train_prompts: Sequence[Prompt], eval_prompts: Sequence[Prompt],
                 partial_credit: float = 0.0, well_formed: Callable[[str], bool] | None = None,
                 held_out: bool = False):
        if not train_prompts or not eval_prompts:
            raise ValueError(f"task {name!r} needs training and evaluation prompts")
        if not 0.0 <= partial_credit < 1.0:
            raise ValueError(f"partial_credit must be in [0, 1), got {partial_credit}")
        self.name = name
        self.train_prompts = list(train_prompts)
        self.eval_prompts = list(eval_prompts)
        self.partial_credit = float(partial_credit)
        self.held_out = held_out  # True when no evaluation prompt is a training prompt
        self._well_formed = well_formed

    def is_correct(self, prompt: Prompt, completion_text: str) -> bool:
        return completion_answer(completion_text, len(prompt.answer)) == prompt.answer

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        if self.is_correct(prompt, completion_text):
            return 1.0
        if self.partial_credit and self._well_formed is not None:
            if self._well_formed(completion_answer(completion_text, len(prompt.answer))):
                return self.partial_credit
        return 0.0

    @cached_property
    def constant_answer_accuracy(self) -> float:
        """Best accuracy on ``eval_prompts`` of one answer given to every prompt. Only a string that is some
        prompt's answer can score, so the candidates are the evaluation answers."""
        candidates = sorted({p.answer for p in self.eval_prompts})
        n = len(self.eval_prompts)
        return max(sum(self.is_correct(p, c) for p in self.eval_prompts) / n for c in candidates)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, train={len(self.train_prompts)}, "
                f"eval={len(self.eval_prompts)}, held_out={self.held_out})")


def _numbered(split: str, items: Sequence[tuple[str, str]]) -> list[Prompt]:
    return [Prompt(text, answer, f"{split}/{i}", columns={"answer": answer}) for i, (text, answer) in enumerate(items)]


def copy_digit_task(partial_credit: float = 0.0) -> ToyTask:
    items = [(f"{d}=", str(d)) for d in range(10)]
    return ToyTask("copy_digit", _numbered("train", items), _numbered("eval", items), partial_credit,
                   well_formed=str.isdigit)


def copy_char_task(which: str, alphabet: str = "abcdefgh", length: int = 3, eval_fraction: float = 0.2,
                   split_seed: int = 0, partial_credit: float = 0.0) -> ToyTask:
    """``copy_first`` / ``copy_last``: all ``len(alphabet) ** length`` strings, a seeded ``eval_fraction`` of them
    held out for evaluation (the split depends on ``split_seed``, not on the run's seed)."""
    if which not in ("first", "last"):
        raise ValueError(f"which must be 'first' or 'last', got {which!r}")
    if len(set(alphabet)) != len(alphabet) or not alphabet or "=" in alphabet:
        raise ValueError(f"alphabet must be distinct characters without '=', got {alphabet!r}")
    if length < 2:
        raise ValueError(f"length must be >= 2, got {length}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    K = len(alphabet)
    strings = []
    for index in range(K**length):
        chars = []
        for _ in range(length):
            index, r = divmod(index, K)
            chars.append(alphabet[r])
        strings.append("".join(reversed(chars)))
    order = np.random.default_rng(split_seed).permutation(len(strings))
    n_eval = max(1, round(eval_fraction * len(strings)))
    eval_set = {strings[i] for i in order[:n_eval]}
    pick = (lambda s: s[0]) if which == "first" else (lambda s: s[-1])
    train = [(f"{s}=", pick(s)) for s in strings if s not in eval_set]
    held = [(f"{s}=", pick(s)) for s in strings if s in eval_set]
    allowed = set(alphabet)
    return ToyTask(f"copy_{which}", _numbered("train", train), _numbered("eval", held), partial_credit,
                   well_formed=lambda a: a in allowed, held_out=True)


def successor_task(partial_credit: float = 0.0) -> ToyTask:
    letters = string.ascii_lowercase
    items = [(f"{a}>", b) for a, b in zip(letters, letters[1:])]
    return ToyTask("successor", _numbered("train", items), _numbered("eval", items), partial_credit,
                   well_formed=lambda a: a in set(letters))


def addition_task(max_digit: int = 4, partial_credit: float = 0.0) -> ToyTask:
    if not 0 < max_digit <= 9:
        raise ValueError(f"max_digit must be in 1..9, got {max_digit}")
    items = [(f"{a}+{b}=", str(a + b)) for a in range(max_digit + 1) for b in range(max_digit + 1)]
    return ToyTask("addition", _numbered("train", items), _numbered("eval", items), partial_credit,
                   well_formed=lambda a: a.isdigit())


def guess_letter_task(alphabet: str = "abcdefgh", max_turns: int = 3, train_size: int = 512):
    """The multi-turn ``guess_letter`` task (``asyncrl/environments/guess_letter.py``; its environment is the
    ``guess_letter`` preset's ``environment.factory``)."""
    from asyncrl.environments.guess_letter import GuessLetterTask

    return GuessLetterTask(alphabet, max_turns, train_size)


TASKS: dict[str, Callable[..., Task]] = {  # name -> factory; its keyword arguments are the task's options
    "copy_digit": copy_digit_task,
    "copy_first": partial(copy_char_task, "first"),
    "copy_last": partial(copy_char_task, "last"),
    "successor": successor_task,
    "addition": addition_task,
    "dataset": dataset_task,
    "countdown": countdown_task,
    "guess_letter": guess_letter_task,
}
TOY_TASKS = ("copy_digit", "copy_first", "copy_last", "successor", "addition")  # prompt lists built in code


def _name_options(config: Any) -> tuple[str, dict]:
    if isinstance(config, str):
        return config, {}
    if isinstance(config, dict):
        return config.get("name", "copy_digit"), dict(config.get("options") or {})
    return config.name, dict(config.options)


def build_task(config: Any) -> Task:
    """A task from a ``TaskConfig`` (or a mapping ``{"name": ..., "options": {...}}``, or a name). Unknown names
    and options are errors that list what exists."""
    name, options = _name_options(config)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; tasks: {sorted(TASKS)}")
    parameters = inspect.signature(TASKS[name]).parameters
    allowed = list(parameters)
    unknown = {k: v for k, v in options.items() if k not in allowed}
    if unknown:
        raise ValueError(f"bad options {unknown} for task {name!r}: unknown; its options are {allowed}")
    missing = [k for k, p in parameters.items() if p.default is inspect.Parameter.empty and k not in options]
    if missing:
        raise ValueError(f"task {name!r} needs option(s) {missing} (for example task.options.{missing[0]}=PATH); "
                         f"its options are {allowed}")
    try:
        return TASKS[name](**options)
    except DataError:  # it names the file, the row and the column already
        raise
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad options {options} for task {name!r}: {err}") from None


def task_with_data(config: Any, train: Any = None, eval: Any = None) -> Task:
    """``build_task(config)``, or with ``train`` / ``eval`` (objects or paths) a ``dataset`` task over them, keeping
    the config's dataset options (``prompt_key``, ``system_prompt``, ...) when its task is a ``dataset`` task."""
    if train is None and eval is None:
        return build_task(config)
    name, options = _name_options(config)
    options = dict(options) if name == "dataset" else {}
    options.update({k: v for k, v in (("train", train), ("eval", eval)) if v is not None})
    return build_task({"name": "dataset", "options": options})


def check_rewards(task: Task, reward: Any, reward_funcs: Sequence[Any] = (), backend_scores: bool = False) -> Any:
    """The run's reward functions (``asyncrl.rewards.RewardFunctions``), first found wins: ``reward_funcs`` (objects),
    ``reward.funcs`` (the config's ``reward:`` section), the task's own ``reward_funcs`` (countdown's verifier), the
    task's own ``reward`` (the toy tasks). A dataset task with none is one line (unless ``backend_scores``: the
    simulated generator scores its groups itself); so is a row without a column a function needs."""
    from asyncrl.rewards import RewardFunctions, TaskReward

    if reward_funcs and reward.funcs:
        raise ValueError(f"reward functions given twice: reward_funcs= and reward.funcs="
                         f"{reward.model_dump(mode='json')['funcs']}; name them in one place")
    if reward_funcs:
        functions = RewardFunctions(list(reward_funcs), reward.weights)
    elif reward.funcs:
        functions = reward.functions()
    elif getattr(task, "reward_funcs", None):
        functions = RewardFunctions(list(task.reward_funcs), reward.weights)
    elif isinstance(task, DatasetTask) and type(task).reward is DatasetTask.reward and not backend_scores:
        raise ValueError(f"task {task.name!r} ({task.sources.get('train')}) has no reward of its own: name reward "
                         "functions (reward.funcs: a built-in such as math_answer, or 'package.module:function'; in "
                         "Python Controller.from_config(cfg, reward_funcs=[...]))")
    else:
        reward.check_unused()  # weights or an accuracy function with no function to name
        functions = RewardFunctions.of_task(task)
    if reward.accuracy is not None and reward.accuracy not in functions.names:  # functions given as objects too
        raise ValueError(f"reward.accuracy {reward.accuracy!r} is not one of the reward functions {functions.names}")
    check_reward_columns(task, [f for f in functions.funcs if not isinstance(f, TaskReward)])
    return functions


def evaluate(backend: Any, task: Task, tokenizer: Any, max_new_tokens: int = 4,
             prompts: Sequence[Prompt] | None = None) -> dict[str, float]:
    """Greedy completions of the task's evaluation prompts (or ``prompts``) through ``backend.generate_greedy(
    prompt_ids, max_new_tokens)`` (``TorchGenerator`` or ``TorchPolicy``), scored by the task's own reward; returns
    ``reward_mean``, ``accuracy`` and ``n``. Draws no randomness, so it never changes a seeded run.
    (``Controller.evaluate`` does more: a split, ``n`` samples, the run's reward functions: asyncrl/evaluation.py.)"""
    prompts = list(task.eval_prompts if prompts is None else prompts)
    prompts = render(prompts, tokenizer, where=getattr(task, "where", None))  # as the chat template renders them
    if not prompts:
        return {HELD_OUT_REWARD.name: float("nan"), HELD_OUT_ACCURACY.name: float("nan"), "n": 0.0}
    completions = backend.generate_greedy([prompt_ids(tokenizer, p) for p in prompts], max_new_tokens)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = [task.reward(p, t) for p, t in zip(prompts, texts)]
    correct = [task.is_correct(p, t) for p, t in zip(prompts, texts)]
    return {HELD_OUT_REWARD.name: float(np.mean(rewards)), HELD_OUT_ACCURACY.name: float(np.mean(correct)),
            "n": float(len(prompts))}
