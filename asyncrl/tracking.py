"""Experiment tracking: every metrics row of a run, to TensorBoard and/or Weights & Biases.

Nothing is written unless configured (``tracking: {tensorboard_dir: runs/tb}``, ``tracking: {wandb_project: p}``).
A row is logged at its ``step`` (the ``step`` column of ``Controller.metrics``), one scalar per numeric column;
NaN and non-numeric values are left out (an evaluation column is logged only on the steps that evaluated).
The packages are imported only when asked for, and a missing one is a configuration error, not a failure
after hours of training.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class TrackingConfig(BaseModel):
    """Where metrics rows go besides ``Controller.metrics``: a TensorBoard log directory (``pip install
    'asyncrl[tracking]'``) and/or a W&B project (``pip install wandb``; ``wandb_mode: offline`` logs to disk)."""

    model_config = ConfigDict(extra="forbid")

    tensorboard_dir: str | None = Field(None, description="write each step's metrics row to TensorBoard here")
    wandb_project: str | None = Field(None, description="log each step's metrics row to this W&B project")
    wandb_run_name: str | None = Field(None, description="the W&B run's name (None: W&B's)")
    wandb_mode: str | None = Field(
        None, description="wandb.init(mode=...): 'online', 'offline' or 'disabled'; None: W&B's default")

    @field_validator("tensorboard_dir", "wandb_project")
    @classmethod
    def _installed(cls, value: str | None, info: ValidationInfo) -> str | None:
        module, install = {"tensorboard_dir": ("tensorboard", "pip install 'asyncrl[tracking]'"),
                           "wandb_project": ("wandb", "pip install wandb")}[info.field_name]
        if value is not None and not _importable(module):
            raise ValueError(f"needs the {module!r} package, which is not installed ({install}); or leave it unset")
        return value


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: deliberately made unimportable
        return False


class Tracker:
    """Sends metrics rows to the configured trackers. ``log(row)`` once per optimizer step; ``close()`` at the end
    (each row is flushed as it is logged, so an interrupted run keeps what it logged)."""

    def __init__(self, cfg: TrackingConfig, run_config: dict[str, Any] | None = None):
        self._tensorboard = self._wandb = None
        if cfg.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=cfg.tensorboard_dir)
        if cfg.wandb_project is not None:
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, mode=cfg.wandb_mode,
                                     config=run_config)

    @property
    def active(self) -> bool:
        return self._tensorboard is not None or self._wandb is not None

    def log(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        scalars = {k: float(v) for k, v in row.items() if k != "step" and _is_number(v)}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, global_step=step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._tensorboard = self._wandb = None


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
