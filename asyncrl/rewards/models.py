"""Reward models: a sequence-classification model with one label as a reward function, as TRL takes one.

An entry of ``reward.funcs`` may be a model directory, ``{model: PATH, batch_size: 32}``, or in Python a
``transformers`` ``PreTrainedModel`` (``AutoModelForSequenceClassification``, ``num_labels=1``) with its tokenizer:
``(model, tokenizer)``, or ``reward_funcs=[model]`` with ``reward_processing_classes=[tokenizer]`` (TRL's
arguments; without a tokenizer, the one in the model's ``name_or_path`` directory). ``RewardModel`` wraps either
as a reward function of TRL's signature, so it is loaded, called, timed, weighted and reported like any other.

How it scores (as TRL's ``GRPOTrainer`` does): the text is prompt + completion, for conversational data the
messages ``prompt + [completion]`` through the reward tokenizer's chat template; it is tokenized as asyncrl
tokenizes a prompt (``asyncrl/chat.py``): a standard text with the tokenizer's special tokens, a templated one
with nothing added again (the template writes its own); right-padded, ``batch_size`` texts per forward, in the
model's dtype with no gradient; the reward is the model's one logit (``logits[:, 0]``).

Where it scores: on the CPU, in the reward workers (or inline), by default. On a GPU run, ``place(device, lock)``
(``asyncrl.backends.place_reward_models`` calls it for the run) puts it on the GPU of the engine in the trainer's
process instead, scoring there, in that process (the runner keeps a placed model out of its workers: N workers would
each load it, on the CPU), each forward inside ``lock()``: the device lock vLLM and the trainer take turns on, so the
three never interleave GPU work on one card. ``lock`` is any callable returning a context manager (``DeviceLock``):
this module sits below the backends and imports none of them.

Invariants:
- Its name, hence its metric ``reward/<name>``, is the model directory's name (a model object: the basename of its
  ``name_or_path``, else its class).
- Built from a directory it holds only the path until its first call: it is sent to a reward worker as the path
  (``__getstate__``), and the worker loads the directory once, on its first call, and keeps it. A model object is
  sent by its state (pickled with its tokenizer) and kept the same way.
- A directory is checked when the config loads, without loading the weights: it exists, holds ``config.json``
  whose model has one label (and a sequence-classification architecture when it names one); anything else is one
  ``ValueError`` line naming the path.
- Nothing heavy is imported here until a model is loaded or called (``transformers``, ``torch``).
- Placed (``in_process``): each forward of ``batch_size`` texts, its inputs' move to the device and its logits'
  move back all run inside one ``lock()``; nothing of it runs outside one. A placed model sent to another process
  (pickled) arrives unplaced: on the CPU, without the lock, which belongs to this process.
"""

from __future__ import annotations

import json
import threading
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Protocol

KEYS = ("model", "batch_size")


class DeviceLock(Protocol):
    """What a placed reward model holds while it uses its device: ``with lock(): ...`` (a run's device lock,
    ``functools.partial(asyncrl.backends.device_lock.exclusive_device, device, name)``, or any such callable)."""

    def __call__(self) -> AbstractContextManager[Any]: ...


def is_model(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers`` model object (duck-typed: nothing imported)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(obj).__mro__) and hasattr(obj, "config")


def is_reward_model(spec: Any) -> bool:
    """Whether a ``reward.funcs`` entry is a reward model: a ``{model: ...}`` mapping, a model object, a
    ``(model, tokenizer)`` pair, or a ``RewardModel``."""
    return (isinstance(spec, RewardModel) or isinstance(spec, dict) or is_model(spec)
            or isinstance(spec, tuple) and len(spec) == 2 and is_model(spec[0]))


class RewardModel:
    """A sequence-classification model with one label, called as a reward function (module docstring)."""

    required_columns = ()  # it reads the prompts and the completions only

    def __init__(self, path: str | None = None, batch_size: int = 32, model: Any = None, tokenizer: Any = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward model batch_size {batch_size!r}: texts per forward, an integer >= 1")
        self.path, self.batch_size = path, batch_size
        self._model, self._tokenizer = model, tokenizer
        self._lock = threading.Lock()
        self.device, self.device_lock = "cpu", None  # where it scores (``place``); None: no lock, the CPU
        if model is not None:
            check_labels(model.config, repr(type(model).__name__))
            source = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
            self.__name__ = Path(source.rstrip("/")).name or type(model).__name__
        else:
            check_dir(path)
            self.__name__ = Path(str(path).rstrip("/")).name

    @classmethod
    def from_spec(cls, spec: Any) -> RewardModel:
        """A ``RewardModel`` from a ``reward.funcs`` entry (``is_reward_model``)."""
        if isinstance(spec, RewardModel):
            return spec
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - set(KEYS))
            if unknown or "model" not in spec:
                raise ValueError(f"reward model {spec!r}: give {{model: PATH, batch_size: N}} (batch_size optional)"
                                 + (f"; unknown key(s) {unknown}" if unknown else "; 'model' is missing"))
            if not isinstance(spec["model"], str):
                raise ValueError(f"reward model {spec!r}: 'model' is the path of a model directory, got "
                                 f"{type(spec['model']).__name__}")
            return cls(spec["model"], spec.get("batch_size", 32))
        if isinstance(spec, tuple):
            return cls(model=spec[0], tokenizer=spec[1])
        return cls(model=spec)

    def spec(self) -> dict:
        """How a config names it: ``{model: PATH, batch_size: N}`` (a model object: its ``name_or_path``)."""
        path = self.path if self.path is not None else str(getattr(self._model, "name_or_path", "") or self.__name__)
        return {"model": path, "batch_size": self.batch_size}

    def place(self, device: str, lock: DeviceLock) -> None:
        """Score on ``device``, in this process, each forward inside ``lock()`` (module docstring). The model moves
        there at its next load (its first call)."""
        self.device, self.device_lock = str(device), lock

    @property
    def in_process(self) -> bool:
        """Placed: it scores in this process (the runner keeps it out of its workers)."""
        return self.device_lock is not None

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "_lock": None, "device": "cpu", "device_lock": None}  # placement stays here
        if self.path is not None:  # a directory travels as its path; the receiver loads it once
            state["_model"] = state["_tokenizer"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def load(self) -> tuple[Any, Any]:
        """``(model, tokenizer)``, loaded on the first call (a directory) and kept; on its device (the CPU unless
        placed), eval."""
        with self._lock:
            if self._model is None:
                from transformers import AutoModelForSequenceClassification

                self._model = AutoModelForSequenceClassification.from_pretrained(self.path, local_files_only=True)
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                source = self.path or getattr(self._model, "name_or_path", None)
                try:
                    self._tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
                except Exception as exc:  # noqa: BLE001 - whatever is wrong, the user needs to know what to pass
                    raise ValueError(f"reward model {self.__name__!r} has no tokenizer ({source!r} holds none): "
                                     "pass (model, tokenizer) or reward_processing_classes=[tokenizer]") from exc
            model, tok = self._model, self._tokenizer
            if tok.pad_token is None:  # a batch is padded; the model finds each text's last token by the pad id
                tok.pad_token = tok.eos_token
            if getattr(model.config, "pad_token_id", None) is None:
                model.config.pad_token_id = tok.pad_token_id
            if str(next(model.parameters()).device) != self._device_name(model) or model.training:
                with self.device_lock() if self.device_lock is not None else nullcontext():  # a copy to the GPU
                    model.to(self.device)
                model.eval()
            return model, tok

    def _device_name(self, model: Any) -> str:
        """``self.device`` as torch names a parameter's device ("cuda" is "cuda:0" there)."""
        import torch

        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return str(device)

    def texts(self, prompts: list, completions: list) -> list[tuple[str, bool]]:
        """``(text, conversational)`` of each row: prompt + completion, through the chat template for a
        conversational row (TRL's rule)."""
        from asyncrl.rewards.builtin import completion_text

        _, tok = self.load()
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):  # conversational: the messages, then the completion's
                messages = prompt + (completion if isinstance(completion, list) else
                                     [{"role": "assistant", "content": str(completion)}])
                out.append((tok.apply_chat_template(messages, tokenize=False), True))
            else:
                out.append((str(prompt) + completion_text(completion), False))
        return out

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        import torch

        model, tok = self.load()
        rows = self.texts(prompts, completions)
        scores: list[float] = []
        with torch.no_grad():
            start = 0
            while start < len(rows):  # batches of one kind: a template writes its own special tokens
                end = start + 1
                while end < min(len(rows), start + self.batch_size) and rows[end][1] == rows[start][1]:
                    end += 1
                inputs = tok([text for text, _ in rows[start:end]], return_tensors="pt", padding=True,
                             padding_side="right", add_special_tokens=not rows[start][1])
                with self.device_lock() if self.device_lock is not None else nullcontext():
                    inputs = {k: v.to(self.device) for k, v in inputs.items()}
                    scores += model(**inputs).logits[:, 0].float().tolist()
                start = end
        return scores

    def __repr__(self) -> str:
        return f"RewardModel({self.spec()!r})"


def place_models(funcs: list, device: str, lock: DeviceLock) -> list[str]:
    """``place`` every reward model among ``funcs`` (a run's ``RewardFunctions.funcs``); their names."""
    placed = []
    for func in funcs:
        if isinstance(func, RewardModel):
            func.place(device, lock)
            placed.append(func.__name__)
    return placed


def check_labels(config: Any, where: str) -> None:
    """A reward model has one label; a ``ValueError`` naming ``where`` otherwise."""
    labels = getattr(config, "num_labels", None)
    if labels != 1:
        raise ValueError(f"reward model {where} has {labels} labels; a reward model is a sequence-classification "
                         "model with one (num_labels=1), whose logit is the reward")


def check_dir(path: Any) -> None:
    """``path`` is a reward model directory (module invariants), read from its ``config.json`` only."""
    where = f"reward model {path!r}"
    if not isinstance(path, str) or not Path(path).is_dir():
        raise ValueError(f"{where} is not a directory (a Hugging Face model directory: config.json, weights, "
                         "tokenizer)")
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where} has no readable config.json ({type(exc).__name__})") from None
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)  # transformers' default is 2 labels
    if labels != 1:
        raise ValueError(f"{where} has {labels} labels; a reward model is a sequence-classification model with one "
                         "(num_labels=1), whose logit is the reward")
    arch = [a for a in config.get("architectures") or [] if not a.endswith("ForSequenceClassification")]
    if arch:
        raise ValueError(f"{where} is a {arch[0]}; a reward model is a ...ForSequenceClassification model "
                         "(AutoModelForSequenceClassification with num_labels=1)")


def with_tokenizers(funcs: list, tokenizers: list | None) -> list:
    """``reward_funcs`` with each model paired with its tokenizer from ``reward_processing_classes`` (TRL's
    arguments: aligned lists, None where an entry is a function or a model whose directory holds its tokenizer)."""
    if tokenizers is None:
        return funcs
    if len(tokenizers) != len(funcs):
        raise ValueError(f"reward_processing_classes has {len(tokenizers)} entries for {len(funcs)} reward_funcs: "
                         "one per function (None where it is not a model)")
    out = []
    for func, tok in zip(funcs, tokenizers):
        if tok is not None and not is_model(func):
            raise ValueError(f"reward_processing_classes gives a tokenizer for {func!r}, which is not a reward model")
        out.append((func, tok) if tok is not None else func)
    return out
