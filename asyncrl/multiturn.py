"""Wiring multi-turn rollouts into a controller: the ``environment:`` section (or ``environment_factory=``) turns
the run's generator into a ``TurnGenerator`` (``asyncrl/turns.py``) bound to the rollout pump
(``asyncrl/turn_hooks.py``). Checked before anything starts: the class's kind and tool schemas, and the model's
chat template (a tool-call format for a tool environment; the prefix property for any), each a one-line
``ValueError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

from asyncrl.environments import check_template, describe_class, factory_spec, load_factory
from asyncrl.metrics import FunctionRewards
from asyncrl.turn_hooks import TurnHooks
from asyncrl.turns import TurnGenerator


def environment_class(cfg: Any, environment_factory: type | None) -> type | None:
    """The run's environment class: ``environment_factory`` (Python) or ``environment.factory`` (the config)."""
    if environment_factory is not None:
        return environment_factory
    return load_factory(cfg.environment.factory) if cfg.environment.factory else None


def with_environment(cfg: Any, generator: Any, tokenizer: Any, environment_factory: type | None,
                     slot_of: Callable[[int], Any], task: Any = None,
                     reward_funcs: list | None = None) -> tuple[Any, Any]:
    """``(generator, cfg)``: the run's generator wrapped in a ``TurnGenerator`` when it has an environment (and the
    config naming the class given as an object), else both unchanged. ``slot_of(gid)``: a group's buffer slot (its
    prompt); ``task``: its prompts are what an evaluation may ask the environment to play; ``reward_funcs`` (objects)
    or ``reward.funcs``: reward functions added to the environment's reward (a task's own reward is not: the
    environment's replaces it)."""
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
    functions = None
    if reward_funcs or cfg.reward.funcs:
        from asyncrl.rewards import RewardFunctions

        functions = RewardFunctions(reward_funcs, cfg.reward.weights) if reward_funcs else cfg.reward.functions()
    turns = TurnGenerator(generator, kind, env.max_turns, env.workers, env.timeout_s, env.max_env_tokens, tokenizer,
                          lambda gid: slot_of(gid).prompt, template,
                          lambda: [*getattr(task, "eval_prompts", []), *getattr(task, "train_prompts", [])], functions,
                          cfg.model.max_position_embeddings - cfg.generation.max_new_tokens)
    return turns, cfg


def attach(pump: Any, generator: Any, train: Any = None) -> None:
    """Bind a ``TurnGenerator`` (or a generator that plays turns itself: the simulated one with a ``turns``
    model) to the pump that polls it and the train pump that counts its aborts (nothing for any other generator).
    A ``TurnGenerator``'s groups carry their reward's parts: the train pump's ``reward/<name>`` are those
    (``reward/environment`` and each reward function's)."""
    if isinstance(generator, TurnGenerator) or getattr(generator, "plays_turns", False) is True:
        TurnHooks(pump, generator, train)
    if isinstance(generator, TurnGenerator):  # an asynchronous sampler's run lets trajectories go on freely
        generator.free_turns = pump.sampler.admits_ahead and generator.host.n > 0
    elif getattr(generator, "plays_turns", False) is True:  # the simulated generator models it (``turns.workers``)
        generator.free_turns = pump.sampler.admits_ahead
    if isinstance(generator, TurnGenerator) and train is not None:
        train.function_rewards = FunctionRewards(generator.reward_names)


TRAJECTORY_COLUMNS = ["group_id", "trajectory", "state", "turn", "turn_versions", "weight_version", "tool_calls",
                      "env_tokens", "reward"]


class TurnsView:
    """The controller's reads of multi-turn trajectories (a base of ``Controller``; it reads its ``buffer``)."""

    def trajectories(self) -> pd.DataFrame:
        """One row per trajectory of every multi-turn group in flight or buffered: ``group_id``, ``trajectory``,
        ``state`` (``in flight``: its next turn is on its way; ``done``: it ended, its group is still in flight;
        ``buffered``: committed), ``turn`` (model turns so far), ``turn_versions`` (the weight version of each),
        the slot's ``weight_version``, and for buffered ones ``tool_calls``, ``env_tokens`` and ``reward``. Empty
        (with these columns) for a single-turn run."""
        rows = []
        with self._lock:
            for slot in list(self.buffer.pending_slots()) + list(self.buffer.ready_slots()):
                if slot.ready and slot.rollouts is not None and slot.rollouts.turns:
                    for i, (t, r) in enumerate(zip(slot.rollouts.turns, slot.rollouts.rewards or [])):
                        rows.append({"group_id": slot.group_id, "trajectory": i, "state": "buffered",
                                     "turn": t["turns"], "turn_versions": list(t["turn_versions"]),
                                     "weight_version": slot.weight_version, "tool_calls": t["tool_calls"],
                                     "env_tokens": t["env_tokens"], "reward": r})
                elif not slot.ready and slot.turns:
                    for i, (versions, done) in sorted(slot.turns.items()):
                        rows.append({"group_id": slot.group_id, "trajectory": i,
                                     "state": "done" if done else "in flight", "turn": len(versions),
                                     "turn_versions": list(versions), "weight_version": slot.weight_version})
        # counts as nullable integers: an in-flight trajectory's <NA> must not turn the buffered ones' 6 into 6.0
        frame = pd.DataFrame(rows, columns=TRAJECTORY_COLUMNS).astype(
            {"turn": "Int64", "weight_version": "Int64", "tool_calls": "Int64", "env_tokens": "Int64"})
        return frame.sort_values(["group_id", "trajectory"], kind="stable").reset_index(drop=True)
