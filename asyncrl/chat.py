"""Prompts as the model sees them: conversational prompts rendered by the tokenizer's chat template, and the
token ids of any prompt.

Invariants:
- A conversational prompt's ids are exactly ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``
  (with ``model.chat_template`` when set): the rendered text encoded without special tokens, because the template
  writes its own ``<bos>``. A standard prompt's ids are ``tokenizer.encode(text)``, ``<bos>`` prepended, as ever.
- ``render_task`` returns the task itself when no prompt is conversational (a toy task runs bit for bit as
  before); otherwise a copy whose prompts carry their rendered text (what the trace, recordings and the
  completions log show). The task it was given is not changed: a cached dataset task serves other tokenizers too.
- A conversational dataset with a tokenizer that has no template, and a prompt longer than the model's context
  after templating, are one ``ValueError`` each, naming the data (file and row) and the tokenizer or the limit.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.prompts import Prompt


def template_text(chat_template: str | None) -> str | None:
    """``model.chat_template``: a Jinja template, or the path of a file holding one (``.jinja``)."""
    if chat_template is None:
        return None
    if "{" not in chat_template and Path(chat_template).is_file():
        return Path(chat_template).read_text()
    if "{" not in chat_template:
        raise ValueError(f"model.chat_template {chat_template!r} is neither a Jinja template nor an existing file")
    return chat_template


def has_template(tokenizer: Any, chat_template: str | None = None) -> bool:
    return chat_template is not None or bool(getattr(tokenizer, "chat_template", None))


def _describe(tokenizer: Any) -> str:
    path = getattr(tokenizer, "name_or_path", "") or ""
    return f"the tokenizer of {path!r}" if path else f"the tokenizer ({type(tokenizer).__name__})"


def render(prompts: Sequence[Prompt], tokenizer: Any, chat_template: str | None = None,
           where: Any = None) -> list[Prompt]:
    """``prompts`` with every conversational one's ``text`` set to its rendering (standard ones unchanged).
    ``where(prompt_id)`` names a prompt's row in errors."""
    todo = [i for i, p in enumerate(prompts) if p.messages is not None]
    if not todo:
        return list(prompts)
    if not has_template(tokenizer, chat_template):
        first = prompts[todo[0]]
        named = where(first.id) if where is not None else f"prompt {first.id!r}"
        raise ValueError(f"{named} is conversational (a list of messages) but {_describe(tokenizer)} has no chat "
                         "template: set model.chat_template (a Jinja template or a file holding one)")
    texts = tokenizer.apply_chat_template([prompts[i].messages for i in todo], chat_template=chat_template,
                                          add_generation_prompt=True, tokenize=False)
    out = list(prompts)
    for i, text in zip(todo, texts):
        out[i] = replace(prompts[i], text=text)
    return out


def prompt_ids(tokenizer: Any, prompt: Prompt | str) -> list[int]:
    """The token ids of a (rendered) prompt: see the module's first invariant. A plain string is standard."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return tokenizer.encode(prompt.text, add_special_tokens=prompt.messages is None)


def render_task(task: Any, tokenizer: Any, chat_template: str | None = None) -> Any:
    """The task as a controller with this tokenizer runs it (see the module's second invariant)."""
    prompts = list(task.train_prompts) + list(task.eval_prompts)
    if not any(p.messages is not None for p in prompts):
        return task
    where = getattr(task, "where", None)
    out = copy.copy(task)
    out.train_prompts = render(task.train_prompts, tokenizer, chat_template, where)
    out.eval_prompts = render(task.eval_prompts, tokenizer, chat_template, where)
    return out


def check_prompt_lengths(task: Any, tokenizer: Any, context: int, max_new_tokens: int, limit: str) -> None:
    """Every (rendered) prompt plus ``max_new_tokens`` fits ``context`` positions (``limit`` names where the
    context comes from); the longest offender is named, with its row."""
    prompts = list(task.train_prompts) + list(task.eval_prompts)
    if not prompts:
        return
    lengths = [0] * len(prompts)
    for special in (True, False):  # standard prompts get <bos>; a rendered template has its own
        which = [i for i, p in enumerate(prompts) if (p.messages is None) == special]
        for i, n in zip(which, token_counts(tokenizer, [prompts[i].text for i in which], special)):
            lengths[i] = n
    n, longest = max((n, i) for i, n in enumerate(lengths))
    prompt = prompts[longest]
    if n + max_new_tokens <= context:
        return
    where = getattr(task, "where", None)
    named = where(prompt.id) if where is not None else f"task {task.name!r} prompt {prompt.id!r}"
    key = getattr(task, "prompt_key", None)
    column = f" column {key!r}" if key else ""
    templ = " after the chat template" if prompt.messages is not None else ""
    raise ValueError(
        f"{named}{column} is {n} tokens{templ} ({prompt.text[:50]!r}...); with generation.max_new_tokens "
        f"{max_new_tokens} it needs {n + max_new_tokens} positions, more than the model's context {limit} "
        f"{context}: shorten the prompt, lower max_new_tokens or use a model with a longer context")


def token_counts(tokenizer: Any, texts: list[str], add_special_tokens: bool, chunk: int = 1024) -> list[int]:
    """``len(tokenizer.encode(text, add_special_tokens=...))`` for each text, in chunks through the Rust
    tokenizer when there is one: 100,000 prompts through the Python wrapper at once take seconds and hundreds of
    MB that the process keeps (benchmarks/bench_dataset.py)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    out: list[int] = []
    for start in range(0, len(texts), chunk):
        part = texts[start:start + chunk]
        if backend is not None:
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            out.extend(len(e) for e in encode(part, add_special_tokens=add_special_tokens))
        else:
            ids = tokenizer(part, add_special_tokens=add_special_tokens, return_attention_mask=False)["input_ids"]
            out.extend(len(i) for i in ids)
    return out


def model_context(model_cfg: Any) -> tuple[int | None, str]:
    """(positions the model takes, where that number comes from): ``model.max_position_embeddings``, or the
    ``max_position_embeddings`` of the ``model.hf_path`` directory's config (None when it states none)."""
    if model_cfg.hf_path is None:
        return model_cfg.max_position_embeddings, "model.max_position_embeddings"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_cfg.hf_path)
    context = getattr(getattr(config, "text_config", config), "max_position_embeddings", None)
    return context, f"max_position_embeddings of model.hf_path {model_cfg.hf_path!r}"


def prepare_task(task: Any, tokenizer: Any, model_cfg: Any, max_new_tokens: int) -> Any:
    """The task as a controller runs it: rendered by the chat template (``model.chat_template`` when set), every
    prompt checked to fit the model's context with ``max_new_tokens`` to spare."""
    task = render_task(task, tokenizer, template_text(getattr(model_cfg, "chat_template", None)))
    context, limit = model_context(model_cfg)
    if context is not None:
        check_prompt_lengths(task, tokenizer, context, max_new_tokens, limit)
    return task
