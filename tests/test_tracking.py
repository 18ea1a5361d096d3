"""Experiment tracking (asyncrl/tracking.py): every metrics row to TensorBoard, read back from the event file;
W&B only when installed and asked for; nothing written unless configured."""

from __future__ import annotations

import sys
import types

import pytest
from pydantic import ValidationError

from asyncrl import Controller, load_config

SIMULATED = {"generation": {"backend": "simulated"}, "trainer": {"backend": "simulated"}}


def stepped(ctrl: Controller, steps: int) -> None:
    while ctrl.trainer_version < steps:
        ctrl.rollout_tick()
        ctrl.train_tick()


def test_controller_logs_every_metrics_row_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ctrl = Controller.from_config(load_config("quickstart", **SIMULATED, eval_every=2,
                                              tracking={"tensorboard_dir": str(tmp_path / "tb")}))
    stepped(ctrl, 4)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()  # each row is flushed as it is logged: readable while the controller is still open
    metrics = ctrl.metrics
    for key in ("reward_mean", "loss", "lag_mean", "tokens_per_s"):
        scalars = events.Scalars(key)
        assert [e.step for e in scalars] == metrics.step.tolist() == [0, 1, 2, 3]
        assert [e.value for e in scalars] == pytest.approx(metrics[key].tolist(), rel=1e-6), key
    evals = metrics.dropna(subset=["eval_accuracy"])
    assert [e.step for e in events.Scalars("eval_accuracy")] == evals.step.tolist() == [1, 3]  # only where it ran
    ctrl.close()


def test_nothing_is_tracked_unless_configured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # SummaryWriter's default directory would be ./runs
    ctrl = Controller.from_config(load_config("quickstart", **SIMULATED))
    assert not ctrl.tracker.active
    stepped(ctrl, 2)
    ctrl.close()
    assert list(tmp_path.iterdir()) == []


def test_asking_for_wandb_without_the_package_is_a_configuration_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed, whether it is or not
    with pytest.raises(ValidationError, match=r"needs the 'wandb' package, which is not installed \(pip install wandb\)"):
        load_config("quickstart", tracking={"wandb_project": "asyncrl"})


def test_wandb_gets_every_row_at_its_step_and_the_run_config(monkeypatch):
    calls = []
    run = types.SimpleNamespace(log=lambda data, step: calls.append(("log", step, data)),
                                finish=lambda: calls.append(("finish",)))
    fake = types.ModuleType("wandb")
    fake.__spec__ = types.SimpleNamespace(name="wandb")  # find_spec answers from sys.modules
    fake.init = lambda **kw: calls.append(("init", kw)) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config("quickstart", **SIMULATED, tracking={"wandb_project": "asyncrl", "wandb_mode": "offline"})
    ctrl = Controller.from_config(cfg)
    stepped(ctrl, 2)
    ctrl.close()
    (init,), logs = [c for c in calls if c[0] == "init"], [c for c in calls if c[0] == "log"]
    assert init[1]["project"] == "asyncrl" and init[1]["mode"] == "offline"
    assert init[1]["config"]["sampler"]["name"] == "in_order"
    assert [step for _, step, _ in logs] == [0, 1]
    assert logs[1][2]["reward_mean"] == pytest.approx(ctrl.metrics.reward_mean.iloc[1])
    assert calls[-1] == ("finish",)


def test_a_resumed_run_keeps_logging_to_the_first_runs_tensorboard_directory(tmp_path):
    """``asyncrl run ... --tensorboard TB`` then ``--resume`` without the flag: the resumed steps go to TB too."""
    pytest.importorskip("tensorboard")
    import os
    import subprocess
    from pathlib import Path

    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parents[1]
    out, tb = tmp_path / "run", tmp_path / "tb"
    simulated = ["--set", "generation.backend=simulated", "--set", "trainer.backend=simulated"]

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--out", str(out), "--quiet",
                               "--no-plot", *simulated, *args], capture_output=True, text=True, timeout=300,
                              cwd=root, env={**os.environ, "MPLBACKEND": "Agg"})
        assert proc.returncode == 0, proc.stderr

    cli("--steps", "2", "--checkpoint-every", "2", "--tensorboard", str(tb))
    cli("--steps", "4", "--resume", str(out))
    assert yaml.safe_load((out / "config.yaml").read_text())["tracking"]["tensorboard_dir"] == str(tb)
    events = EventAccumulator(str(tb))
    events.Reload()
    assert sorted({e.step for e in events.Scalars("reward_mean")}) == [0, 1, 2, 3]
