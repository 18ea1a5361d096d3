"""Wiring multi-turn rollouts into a controller: the ``environment:`` section (or ``environment_factory=``) turns
the run's generator into a ``TurnGenerator`` (``asyncrl/turns.py``) bound to the rollout pump
(``asyncrl/turn_hooks.py``). Checked before anything starts: the class's kind and tool schemas, and the model's
chat template (a tool-call format for a tool environment; the prefix property for any), each a one-line
``ValueError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.environments import check_template, describe_class, factory_spec, load_factory
from asyncrl.turn_hooks import TurnHooks
from asyncrl.turns import TurnGenerator


def environment_class(cfg: Any, environment_factory: type | None) -> type | None:
    """The run's environment class: ``environment_factory`` (Python) or ``environment.factory`` (the config)."""
    if environment_factory is not None:
        return environment_factory
    return load_factory(cfg.environment.factory) if cfg.environment.factory else None


def with_environment(cfg: Any, generator: Any, tokenizer: Any, environment_factory: type | None,
                     prompt_of: Callable[[int], Any], task: Any = None) -> tuple[Any, Any]:
    """``(generator, cfg)``: the run's generator wrapped in a ``TurnGenerator`` when it has an environment (and the
    config naming the class given as an object), else both unchanged. ``task``: its prompts are what an evaluation
    may ask the environment to play."""
    cls = environment_class(cfg, environment_factory)
    if cls is None:
        return generator, cfg
    kind = describe_class(cls)
    from asyncrl.chat import template_text

    template = template_text(cfg.model.chat_template)
    check_template(tokenizer, template, kind, cfg.model.hf_path or "the built-in byte-tokenizer model")
    env = cfg.environment
    if environment_factory is not None:
        cfg = cfg.model_copy(update={"environment": env.model_copy(update={"factory": factory_spec(cls)})})
    turns = TurnGenerator(generator, kind, env.max_turns, env.workers, env.timeout_s, env.max_env_tokens, tokenizer,
                          prompt_of, template,
                          lambda: [*getattr(task, "eval_prompts", []), *getattr(task, "train_prompts", [])])
    return turns, cfg


def attach(pump: Any, generator: Any) -> None:
    """Bind a ``TurnGenerator`` to the pump that polls it (nothing for any other generator)."""
    if isinstance(generator, TurnGenerator):
        TurnHooks(pump, generator)
