"""A multi-turn group as ``asyncrl/turns.py`` holds it while its trajectories play, and as the run's reward
functions get it when they end (TRL's keywords, the conversation after the prompt as each completion); and how an
observation's content is cut to ``environment.max_env_tokens`` (``cut_contents``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.rewards.functions import RewardBatch


@dataclass
class Trajectory:
    ids: list[int] = field(default_factory=list)  # after the prompt: model turns and observations
    mask: list[int] = field(default_factory=list)  # 1 at sampled tokens
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # of the sampled tokens
    turn_versions: list[int] = field(default_factory=list)
    # after the prompt, one entry per model turn and per observation, in order: {"role": "assistant" (a model turn)
    # | "user" (a text environment's reply) | "tool" (a turn's tool results), "text": its tokens decoded,
    # "version": the model turn's weight version (None for an observation)}; the texts joined are the completion
    turn_texts: list[dict] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation (a chat template renders it)
    text: str = ""  # the prompt's and every token's text held so far (the prefix check)
    reward: float = 0.0
    tool_calls: int = 0
    env_tokens: int = 0
    done: bool = False
    finish: str = ""


@dataclass
class Group:
    gid: int
    n: int
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""  # the rendered prompt ``prompt_ids`` encode (the completions log's ``prompt``)
    trajectories: list[Trajectory] = field(default_factory=list)
    started: bool = False
    turn: int = 0  # model turns generated so far (of the longest trajectory)
    waiting: dict[int, list[int]] = field(default_factory=dict)  # inner request id -> trajectory indices
    chat: bool = False  # rendered by the chat template (else raw text)


CUT_MARKER = "…"  # ends an observation's content that was cut (when it fits in the budget)


def cut_contents(tokenizer: Any, texts: list[str], limit: int) -> list[str]:
    """A turn's observation contents (a text environment's reply, or the turn's tool results, in order) cut to
    ``limit`` content tokens together (the template's wrapping is not counted): each text keeps what the earlier
    ones left, cut in tokens, decoded back and ended by ``CUT_MARKER`` when the budget left holds the marker and a
    token more. Cutting the content, not the rendering, keeps the template's text after the message (the next
    turn's header) whole, so the tokens held stay a prefix of the next rendering. Each returned text encodes to at
    most its share (re-encoded, a decoded cut can differ: it is shortened until it fits)."""
    out, left = [], limit
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= left:
            out.append(text)
            left -= len(ids)
            continue
        marker = CUT_MARKER if len(tokenizer.encode(CUT_MARKER, add_special_tokens=False)) < left else ""
        keep = left - len(tokenizer.encode(marker, add_special_tokens=False)) if marker else left
        cut = ""
        while keep > 0:
            cut = tokenizer.decode(ids[:keep], skip_special_tokens=False).rstrip("\ufffd") + marker
            if len(tokenizer.encode(cut, add_special_tokens=False)) <= left:
                break
            keep, cut = keep - 1, ""
        out.append(cut)
        left -= len(tokenizer.encode(cut, add_special_tokens=False))
    return out


def reward_batch(prompt: Any, g: Group, tokenizer: Any) -> RewardBatch:
    """The group as the run's reward functions get it (TRL's keywords): the prompts, each trajectory's conversation
    after the prompt (its messages, or its text for a raw one), its tokens and the row's columns."""
    first = len(prompt.messages) if prompt.messages is not None else 1  # the prompt's messages come first
    conversations = [t.messages[first:] if g.chat else tokenizer.decode(t.ids, skip_special_tokens=True)
                     for t in g.trajectories]
    columns = {k: [v] * g.n for k, v in (prompt.columns or {}).items()}
    prompts = [prompt.messages if prompt.messages is not None else prompt.text] * g.n
    return RewardBatch(prompts, conversations, [list(t.ids) for t in g.trajectories], columns, source=prompt)
