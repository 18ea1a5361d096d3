"""The learning rate of each optimizer step: ``trainer.lr_schedule`` (``constant`` / ``linear`` / ``cosine``) after
``trainer.warmup_steps`` of linear warmup, the torch and Megatron engines alike.

Invariants:
- A pure function of the config and the number of optimizer steps already taken (``step``, 0 for the first): the
  engines keep that count in their checkpoint state, so a resumed run takes the uninterrupted run's lr at every
  step (there is no other scheduler state to lose).
- The multipliers are transformers' ``get_scheduler`` ones (``constant_with_warmup``, ``linear``, ``cosine``, with
  ``num_training_steps = lr_decay_steps``), so a TRL run's schedule carries over step for step; as there, the
  first warmup step has lr 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def check_schedule(trainer_cfg: Any) -> None:
    """A ``ValueError`` naming the knob when the schedule cannot be computed (a decay without its horizon)."""
    if trainer_cfg.lr_schedule != "constant" and trainer_cfg.lr_decay_steps is None:
        raise ValueError(f"trainer.lr_schedule {trainer_cfg.lr_schedule!r} decays to 0 over trainer.lr_decay_steps "
                         "optimizer steps: set it (`asyncrl run` sets it to --steps)")


def lr_factor(step: int, schedule: str, warmup_steps: int, decay_steps: int | None) -> float:
    """The multiplier of the base lr for the optimizer step after ``step`` steps taken."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if schedule == "constant":
        return 1.0
    assert decay_steps is not None, "check_schedule first"
    if schedule == "linear":
        return max(0.0, (decay_steps - step) / max(1, decay_steps - warmup_steps))
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_lr(param_groups: Iterable[dict], trainer_cfg: Any, step: int) -> float:
    """Set every parameter group's lr for the optimizer step after ``step`` steps taken; returns it."""
    lr = trainer_cfg.lr * lr_factor(step, trainer_cfg.lr_schedule, trainer_cfg.warmup_steps,
                                    trainer_cfg.lr_decay_steps)
    for group in param_groups:
        group["lr"] = lr
    return lr
