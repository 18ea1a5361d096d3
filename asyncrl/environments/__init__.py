"""Environments: multi-turn rollouts in the two shapes users already write (docs/environments.md).

- A **text environment** (Gymnasium-shaped) is a class with a ``step`` method: ``reset(self, **row) -> str | None``
  and ``step(self, action: str) -> tuple[str | None, float, bool]`` (observation, reward, done). (A ``step``
  annotated to return ``str`` is a tool of a tool environment, as TRL allows.)
- A **tool environment** is any other class, TRL's ``environment_factory`` convention: ``reset(self, **row) -> str |
  None`` (a string extends the prompt), every other public method a tool (its schema from its type hints and
  docstring, ``transformers.utils.get_json_schema``, as TRL builds it), optional ``get_reward(self) -> float``.

This module holds what is decided before anything runs: the ``environment:`` config section, a class's kind and
tool schemas, the tool-call format of a chat template (and the one-line refusals), and tool-call parsing. The
instances live in ``asyncrl.environments.host``; the turns are driven by ``asyncrl/turns.py``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from asyncrl.strict import StrictModel

NOT_TOOLS = ("reset", "get_reward", "close")  # public methods of a tool environment that are no tools


class EnvironmentConfig(StrictModel):
    """The ``environment:`` section: multi-turn rollouts with one environment instance per trajectory."""

    factory: str | None = Field(None, description="the environment class, 'package.module:Class' (None: single-turn "
                                "completions; in Python Controller.from_config(cfg, environment_factory=Class))")
    max_turns: int = Field(4, ge=1, description="model turns per trajectory: the trajectory ends after this many")
    workers: int = Field(1, ge=0, description="processes the environment instances live in (0: in the pump's "
                         "process, unguarded: no timeout, a crash is the run's)")
    timeout_s: float = Field(30.0, gt=0, description="a call to an environment (reset, step, a tool, get_reward) "
                             "running longer is a fault: its worker is stopped and replaced")
    max_env_tokens: int = Field(256, ge=1, description="content tokens of one observation at most (a text "
                                "environment's reply, or a turn's tool results together, in order): longer content "
                                "is cut, ending in '…' when that fits, before the chat template renders it (the "
                                "template's wrapping, e.g. the role header and the next generation prompt, is not "
                                "counted); raw text (no chat template): the observation's tokens are cut")


def load_factory(spec: str) -> type:
    """The class named ``package.module:Class``; one line naming the spec when it cannot be loaded."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"environment.factory {spec!r}: write it 'package.module:Class'")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment.factory {spec!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not inspect.isclass(obj):
        raise ValueError(f"environment.factory {spec!r} is {type(obj).__name__}, not a class")
    return obj


def factory_spec(cls: type) -> str:
    """How a config names ``cls``."""
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclass(frozen=True)
class EnvironmentKind:
    """What a class is: ``kind`` ``"text"`` or ``"tool"``, its tools' JSON schemas (a tool environment), and
    whether it has ``get_reward``."""

    cls: type
    kind: str
    tools: tuple[dict, ...] = ()
    has_reward: bool = False
    names: tuple[str, ...] = field(default=())


def is_text_environment(cls: type) -> bool:
    """A class with a ``step`` method is a text environment, unless that ``step`` is a tool: annotated to return
    ``str`` (a TRL environment may name a tool ``step``, as TRL's echo example does)."""
    step = getattr(cls, "step", None)
    if not callable(step):
        return False
    returns = inspect.signature(step).return_annotation
    return returns not in (str, "str")


def tool_names(cls: type) -> list[str]:
    """A tool environment's tools: its public methods other than ``reset``/``get_reward`` (TRL's rule)."""
    text = is_text_environment(cls)
    return [name for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS and (name != "step" or not text)]


def describe_class(cls: type) -> EnvironmentKind:
    """The kind of ``cls`` and, for a tool environment, its tools' schemas; one line when a tool has no schema."""
    if not inspect.isclass(cls):
        got = (f"the string {cls!r} (that form is the config's environment.factory)" if isinstance(cls, str) else
               f"an instance of {type(cls).__qualname__} (pass the class: one instance is made per trajectory)")
        raise ValueError(f"environment_factory must be a class, got {got}")
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"environment {cls.__qualname__} has no reset(self, **row) method")
    if is_text_environment(cls):
        return EnvironmentKind(cls, "text")
    from transformers.utils import get_json_schema

    names = tool_names(cls)
    if not names:
        raise ValueError(f"environment {cls.__qualname__} has neither a step method (a text environment) nor a public "
                         "method to call as a tool (a tool environment)")
    schemas = []
    for name in names:
        try:
            schemas.append(get_json_schema(getattr(cls, name)))
        except Exception as exc:  # transformers says which argument lacks a type hint or a description
            raise ValueError(f"tool {cls.__qualname__}.{name} has no schema: {exc}") from None
    for schema in schemas:  # the method's ``self`` is no argument of the tool
        schema["function"]["parameters"].get("properties", {}).pop("self", None)
        required = schema["function"]["parameters"].get("required")
        if required and "self" in required:
            required.remove("self")
    return EnvironmentKind(cls, "tool", tuple(schemas), callable(getattr(cls, "get_reward", None)), tuple(names))


# --- tool calls in the model's text ------------------------------------------------------------------------------

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
FORMATS = {"hermes": "<tool_call>"}  # Qwen 2.5/3, Hermes: a JSON object between the tags


def tool_call_format(template: str | None) -> str | None:
    """The tool-call format a chat template renders (``"hermes"``), or None when it renders none."""
    if template and "tool_call" in template and "tools" in template:
        return "hermes"
    return None


def parse_tool_calls(text: str) -> list[tuple[str, dict] | str]:
    """The tool calls in a model turn, in order: ``(name, arguments)``, or a string saying why one is malformed
    (its result tells the model so, as a tool message): not JSON, no ``name``, or ``arguments`` not a JSON object
    (missing or null: no arguments). Whether the name is one of the environment's tools is the host's to check
    (``asyncrl.environments.host.refuse_tool_call``), where the call would run."""
    calls: list[tuple[str, dict] | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(f"error: the tool call is not JSON ({exc.msg})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append("error: a tool call needs a \"name\" and \"arguments\"")
            continue
        args = call.get("arguments")
        if isinstance(args, str):  # arguments encoded as a JSON string (OpenAI's wire format)
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if args is not None and not isinstance(args, dict):
            calls.append(f"error: the arguments of tool call {call['name']!r} must be a JSON object, got "
                         f"{type(args).__name__}")
            continue
        calls.append((call["name"], args or {}))
    return calls


PROBE = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "<think>a</think>b"}]


def check_template(tokenizer: Any, chat_template: str | None, kind: EnvironmentKind, model: str) -> str | None:
    """At configuration: the tool-call format of the model's chat template (a tool environment needs one) and the
    prefix property turns rely on (rendering a longer conversation starts with the rendering of a shorter one);
    one line naming the model when either fails. Returns the format (None: a text environment's)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    fmt = tool_call_format(template)
    if kind.kind == "tool" and fmt is None:
        raise ValueError(f"model {model!r}: its chat template has no tool-call format, so a tool environment "
                         f"({kind.cls.__qualname__}) cannot run on it; use a chat model whose template renders tools "
                         "(Qwen/Hermes <tool_call>) or set model.chat_template to one that does (the built-in byte "
                         "tokenizer's: asyncrl.tokenizer.TOOL_CHAT_TEMPLATE, or a file holding it)")
    if not template:
        return fmt
    reply = {"role": "tool", "content": "r"} if kind.kind == "tool" else {"role": "user", "content": "r"}
    tools = list(kind.tools) or None
    short = tokenizer.apply_chat_template(PROBE, tools=tools, chat_template=chat_template, tokenize=False)
    longer = tokenizer.apply_chat_template([*PROBE, reply], tools=tools, chat_template=chat_template, tokenize=False,
                                           add_generation_prompt=True)
    if not longer.startswith(short.rstrip()):
        raise ValueError(f"model {model!r}: its chat template re-renders earlier turns when the conversation grows "
                         "(e.g. it strips a past <think>), so a trajectory's tokens would drift from what the model "
                         "generated; use a template that renders past turns as they were (model.chat_template)")
    return fmt


__all__ = ["EnvironmentConfig", "EnvironmentKind", "check_template", "describe_class", "factory_spec",
           "load_factory", "parse_tool_calls", "tool_call_format", "tool_names"]
