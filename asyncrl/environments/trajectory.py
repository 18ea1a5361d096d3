"""A multi-turn group as ``asyncrl/turns.py`` holds it while its trajectories play, and as the run's reward
functions get it when they end (TRL's keywords, the conversation after the prompt as each completion)."""

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
    trajectories: list[Trajectory] = field(default_factory=list)
    started: bool = False
    turn: int = 0  # model turns generated so far (of the longest trajectory)
    waiting: dict[int, list[int]] = field(default_factory=dict)  # inner request id -> trajectory indices
    chat: bool = False  # rendered by the chat template (else raw text)


def reward_batch(prompt: Any, g: Group, tokenizer: Any) -> RewardBatch:
    """The group as the run's reward functions get it (TRL's keywords): the prompts, each trajectory's conversation
    after the prompt (its messages, or its text for a raw one), its tokens and the row's columns."""
    first = len(prompt.messages) if prompt.messages is not None else 1  # the prompt's messages come first
    conversations = [t.messages[first:] if g.chat else tokenizer.decode(t.ids, skip_special_tokens=True)
                     for t in g.trajectories]
    columns = {k: [v] * g.n for k, v in (prompt.columns or {}).items()}
    prompts = [prompt.messages if prompt.messages is not None else prompt.text] * g.n
    return RewardBatch(prompts, conversations, [list(t.ids) for t in g.trajectories], columns, source=prompt)
