"""What the policy is trained on: ``task:`` (a built-in task and its options).

The place for the sections that say what the prompts are and how completions are scored (a ``reward:`` section,
dataset options), next to the task they feed.

Invariants:
- A section is checked when the config loads by building what it names, so an unknown task, an unknown option or
  a bad value is an error before anything starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.tasks import build_task


class TaskConfig(BaseModel):
    """``task:`` — a built-in task (asyncrl/tasks.py) and its options, checked when the config loads."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("copy_digit", description="one of asyncrl.tasks.TASKS")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the task factory's keyword arguments (each task's are its factory's)")

    @model_validator(mode="after")
    def _builds(self) -> TaskConfig:
        build_task(self)  # an unknown task, an unknown option or a bad value is a ValueError naming it
        return self
