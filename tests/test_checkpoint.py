"""Checkpoints (asyncrl/checkpoint.py): atomic under a crash at every point of a save, loadable without unpickling
code, refused from another version or model shape, restorable under another sampler, kept K at a time, and a run
killed with SIGKILL resumes from the CLI with bit-identical losses (in_order, no lookahead)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from asyncrl import Controller, checkpoint
from tests.faults import check_accounting, small_config

SYNC = {"name": "in_order", "max_lookahead_versions": 0}


def stepped(cfg, steps: int) -> Controller:
    ctrl = Controller.from_config(cfg)
    while ctrl.trainer_version < steps:
        ctrl.tick()
    return ctrl


# ------------------------------------------------------------------------------------------------- atomicity
class Crash(Exception):
    pass


def crash_at(monkeypatch, k: int | None) -> list[str]:
    """Make the k-th file-system operation of a save raise (None: count them). Returns the log of operations."""
    log: list[str] = []
    for name in ("_write", "_rename", "_remove"):
        real = getattr(checkpoint, name)

        def op(*args, _real=real, _name=name):
            log.append(f"{_name} {args[0].name}")
            if k is not None and len(log) == k:
                raise Crash(f"crash at {log[-1]}")
            return _real(*args)

        monkeypatch.setattr(checkpoint, name, op)
    return log


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_a_crash_at_any_point_of_a_save_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, overwrite):
    ctrl = stepped(small_config(), 2)
    directory = tmp_path / "ckpts"
    first = checkpoint.save_periodic(directory, ctrl.cfg, ctrl.state_dict(), keep=3)
    while ctrl.trainer_version < 3:
        ctrl.tick()
    target = first if overwrite else directory / "step-000003"
    if overwrite:
        ctrl.save(tmp_path / "dry-run" / target.name)
    with monkeypatch.context() as m:
        points = crash_at(m, None)
        ctrl.save(tmp_path / "dry-run" / target.name)
    assert len(points) == (7 if overwrite else 5), points  # 4 files, then rename (aside, in, remove the old)
    for k in range(1, len(points) + 1):
        with monkeypatch.context() as m:
            crash_at(m, k)
            try:
                ctrl.save(target)
            except Crash:
                pass
        found = checkpoint.resolve(target if overwrite else directory)
        version = checkpoint.read(found, checkpoint_version()).meta["trainer_version"]
        assert version in (2, 3), (k, points[k - 1], found)
        assert checkpoint.read(first if not overwrite else found, checkpoint_version())  # the previous survives
    ctrl.save(target)  # and a save that completes cleans up after the crashed ones
    assert checkpoint.resolve(target) == target
    assert not [p.name for p in target.parent.iterdir() if p.name.startswith(".")]
    restored = Controller.restore(target)
    assert restored.trainer_version == 3 and restored.trace.equals(ctrl.trace)


def checkpoint_version() -> str:
    import asyncrl

    return asyncrl.__version__


def test_checkpoint_files_load_without_unpickling_code(tmp_path):
    ctrl = stepped(small_config(), 1)
    path = ctrl.save(tmp_path / "c")
    assert sorted(p.name for p in path.iterdir()) == ["config.yaml", "meta.json", "state.json", "tensors.pt"]
    tensors = torch.load(path / "tensors.pt", weights_only=True)
    assert set(tensors) == {"policy", "generator", "torch_rng"}
    meta = json.loads((path / "meta.json").read_text())
    assert meta["trainer_version"] == 1 and meta["asyncrl_version"] == checkpoint_version()
    assert json.loads((path / "state.json").read_text())["metrics"][0]["step"] == 0


def test_restore_refuses_another_version_or_model_shape_and_changes_nothing(tmp_path):
    ctrl = stepped(small_config(), 1)
    path = ctrl.save(tmp_path / "c")
    other = small_config(model={"hidden_size": 64, "intermediate_size": 172})
    with pytest.raises(checkpoint.CheckpointError, match="hidden_size: checkpoint 128, config 64"):
        Controller.restore(path, config=other)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "asyncrl_version": "0.0.1"}))
    with pytest.raises(checkpoint.CheckpointError, match="written by asyncrl '0.0.1'.*this is asyncrl"):
        Controller.restore(path)
    assert json.loads((path / "meta.json").read_text())["asyncrl_version"] == "0.0.1"  # untouched


def test_checkpoint_every_keeps_the_newest(tmp_path):
    cfg = small_config(checkpoint_every=2, checkpoint_dir=str(tmp_path), keep_checkpoints=2)
    stepped(cfg, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000006"]
    assert checkpoint.latest(tmp_path).name == "step-000006"


# --------------------------------------------------------------------------------------- another sampler
def test_restore_under_another_sampler_rejudges_the_groups(tmp_path):
    ctrl = stepped(small_config(sampler={"name": "windowed", "max_staleness_versions": 1}), 3)
    for _ in range(2):
        ctrl.rollout_tick()  # groups buffered ahead of the trainer
    held = {s.group_id for s in ctrl.buffer}
    assert held
    path = ctrl.save(tmp_path / "c")

    fifo = Controller.restore(path, sampler={"name": "weight_fifo", "max_staleness_versions": 1})
    assert fifo.capacity == 4 * 2  # N (W + 1), recomputed for the new sampler
    kept, trace = {s.group_id for s in fifo.buffer}, fifo.trace
    gone = set(trace.group_id[trace.event.isin(["skip", "evict"])].dropna().astype(int))
    assert kept | (gone & held) == held and len(fifo.buffer) <= fifo.capacity
    while fifo.trainer_version < 6:
        fifo.tick()
    check_accounting(fifo)

    in_order = Controller.restore(path, sampler={"name": "in_order", "max_lookahead_versions": 1})
    skips = in_order.trace[in_order.trace.event == "skip"]
    assert set(skips.group_id.astype(int)) == held  # windowed groups carry no target step: in_order cannot train them
    assert skips.reason.str.contains("stamped with a target step").all()
    while in_order.trainer_version < 5:
        in_order.tick()
    check_accounting(in_order)

    dropped = Controller.restore(path, sampler=SYNC, on_sampler_change="drop")
    assert len(dropped.buffer) == 0 and not dropped.inflight
    assert dropped.trace.reason[dropped.trace.event == "skip"].str.contains("dropped").sum() == len(held)


# ----------------------------------------------------------------------------------------------------- CLI
def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--quiet", "--no-plot",
            "--set", "sampler.max_lookahead_versions=0", "--set", "eval_every=null", "--set", "torch_threads=1",
            *args]


@pytest.mark.slow  # two CLI runs in fresh interpreters and a reference run: ~16 s on 2 cores
def test_sigkill_then_resume_gives_the_uninterrupted_losses(tmp_path):
    steps, out = 10, tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.Popen(cli("--steps", "100000", "--out", str(out), "--checkpoint-every", "2"), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while checkpoint.latest(out / "checkpoints") is None:
        assert killed.poll() is None, killed.stderr.read().decode()
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    resumed_from = checkpoint.latest(out / "checkpoints")
    at = json.loads((resumed_from / "meta.json").read_text())["trainer_version"]
    assert 2 <= at < steps, f"killed too late (newest checkpoint at step {at})"

    proc = subprocess.run(cli("--steps", str(steps), "--resume", str(out)), env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    metrics = pd.read_csv(out / "metrics.csv")
    assert metrics.step.tolist() == list(range(steps))  # one uninterrupted history, no step twice
    trace = pd.read_csv(out / "trace.csv")
    assert (trace.event == "step").sum() == steps and trace.seq.tolist() == list(range(len(trace)))

    straight = Controller.from_config(small_config_like_cli())
    straight.run(steps, progress=False)
    assert metrics.loss.tolist() == straight.metrics.loss.tolist()  # bit-identical (CSV floats round-trip)


ASYNC = [{"name": "weight_fifo", "max_staleness_versions": 1}, {"name": "in_order", "max_lookahead_versions": 1}]


def decisions(ctrl: Controller) -> dict:
    """What a run decided and learned: each select/evict/abort (step, group, weight version), the weights each
    committed group was generated with and its reward, the metrics that do not measure time, the final weights."""
    trace = ctrl.trace
    ends = trace[trace.event.isin(["select", "evict", "abort"])]
    commit = trace[trace.event == "commit"].sort_values("group_id")
    return {
        "decided": list(zip(ends.event, ends.trainer_version, ends.group_id, ends.weight_version)),
        "generated": list(zip(commit.group_id, commit.weight_version, commit.detail, commit.reason)),
        "metrics": ctrl.metrics.drop(columns=[c for c in ctrl.metrics if c.endswith(("_s", "tflops", "mfu"))]),
        "weights": ctrl.policy.state_dict()["model"],
    }


@pytest.mark.parametrize("how", ["stepped-1", "stepped-3", "run-2"])
@pytest.mark.parametrize("sampler", ASYNC, ids=["weight_fifo-W1", "in_order-L1"])
def test_a_save_at_any_step_resumes_exactly(tmp_path, sampler, how):
    """A save right after a step holds every rollout the generator already finished (the batch the step's weight
    sync generated with the old weights included), so the resumed run trains what the uninterrupted one does:
    saved after stepping (after the first step, and later) or after ``run`` returned."""
    cfg, steps = small_config(sampler=sampler), 5
    mode, save_at = how.split("-")
    saved = Controller.from_config(cfg)
    if mode == "run":
        saved.run(int(save_at), progress=False)
    while saved.trainer_version < int(save_at):
        saved.tick()
    saved.save(tmp_path / "ckpt")
    resumed = Controller.restore(tmp_path / "ckpt")
    for ctrl in (saved, resumed):
        while ctrl.trainer_version < steps:
            ctrl.tick()
    # Stepped, saving changes nothing either; a run's rows count its own timing-dependent buffer sizes.
    want = decisions(stepped(cfg, steps) if mode == "stepped" else saved)
    for ctrl in (saved, resumed):
        got = decisions(ctrl)
        assert got["decided"] == want["decided"] and got["generated"] == want["generated"]
        pd.testing.assert_frame_equal(got["metrics"], want["metrics"])
        for name, tensor in want["weights"].items():
            assert torch.equal(got["weights"][name], tensor), name
        check_accounting(ctrl)


def small_config_like_cli():
    from asyncrl import load_config

    return load_config("quickstart", sampler=SYNC, eval_every=None, torch_threads=1)


# ------------------------------------------------------------------------------------------ damaged files
def truncate(file, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("name", ["tensors.pt", "state.json", "config.yaml", "meta.json"])
def test_a_damaged_checkpoint_is_one_error_naming_the_file(tmp_path, name):
    ctrl = stepped(small_config(), 1)
    path = ctrl.save(tmp_path / "c")
    (path / name).write_text("{ not: [ closed") if name == "config.yaml" else truncate(path / name)
    with pytest.raises(checkpoint.CheckpointError) as caught:
        Controller.restore(path)
    message = str(caught.value)
    assert "\n" not in message and f"damaged checkpoint file {str(path / name)!r}" in message, message
    assert caught.value.__cause__ is None  # no torch / json traceback chained under it


def test_resume_falls_back_to_the_newest_intact_checkpoint_and_says_so(tmp_path, capsys):
    from asyncrl import cli

    out = tmp_path / "run"
    args = ["run", "quickstart", "--quiet", "--no-plot", "--set", "sampler.max_lookahead_versions=0",
            "--set", "eval_every=null", "--set", "torch_threads=1", "--set", "groups_per_step=2",
            "--set", "group_size=2"]
    assert cli.main([*args, "--steps", "4", "--out", str(out), "--checkpoint-every", "2"]) == 0
    newest = checkpoint.latest(out / "checkpoints")
    assert newest.name == "step-000004"
    truncate(newest / "tensors.pt")
    capsys.readouterr()
    assert cli.main([*args, "--steps", "5", "--resume", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    skipped = [line for line in err if "skipping damaged checkpoint file" in line]
    assert len(skipped) == 1 and str(newest / "tensors.pt") in skipped[0] and "BadZipFile" in skipped[0], err
    assert any(f"resuming from checkpoint {out / 'checkpoints' / 'step-000002'} at step 2 of 5" in line
               for line in err), err
    assert not any("Traceback" in line for line in err), err
    assert pd.read_csv(out / "metrics.csv").step.tolist() == list(range(5))


def flip_one_byte(file) -> None:
    """Change one byte in the middle of ``file`` so that it still parses (a digit of state.json for another digit;
    a byte of tensors.pt's tensor data, which torch reads back without noticing)."""
    data = bytearray(file.read_bytes())
    i = len(data) // 2
    if file.suffix == ".json":
        i = next(j for j in range(i, len(data)) if chr(data[j]).isdigit())
        data[i] = ord("1") if data[i] != ord("1") else ord("2")
    else:
        data[i] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["tensors.pt", "state.json"])
def test_a_checkpoint_with_one_flipped_byte_is_refused_naming_the_file(tmp_path, name):
    ctrl = stepped(small_config(), 1)
    path = ctrl.save(tmp_path / "c")
    flip_one_byte(path / name)
    with pytest.raises(checkpoint.CheckpointError) as caught:
        Controller.restore(path)
    message = str(caught.value)
    assert "\n" not in message and f"damaged checkpoint file {str(path / name)!r}" in message, message
    assert "sha256" in message and caught.value.__cause__ is None
    assert set(json.loads((path / "meta.json").read_text())["digests"]) == {"tensors.pt", "state.json"}


def test_a_checkpoint_without_digests_still_loads(tmp_path):
    ctrl = stepped(small_config(), 2)
    path = ctrl.save(tmp_path / "step-000002")
    meta = json.loads((path / "meta.json").read_text())
    del meta["digests"]
    (path / "meta.json").write_text(json.dumps(meta))
    assert checkpoint.damage(path) is None and checkpoint.resolve(tmp_path) == path
    restored = Controller.restore(path)
    assert restored.trainer_version == 2
    for key, tensor in ctrl.policy.state_dict()["model"].items():
        assert torch.equal(restored.policy.state_dict()["model"][key], tensor), key


@pytest.mark.parametrize("name", ["tensors.pt", "state.json"])
def test_resume_skips_a_checkpoint_with_a_flipped_byte_for_the_previous_good_one(tmp_path, capsys, name):
    from asyncrl import cli

    out = tmp_path / "run"
    args = ["run", "quickstart", "--quiet", "--no-plot", "--set", "sampler.max_lookahead_versions=0",
            "--set", "eval_every=null", "--set", "torch_threads=1", "--set", "groups_per_step=2",
            "--set", "group_size=2"]
    assert cli.main([*args, "--steps", "4", "--out", str(out), "--checkpoint-every", "2"]) == 0
    first, newest = checkpoint._complete(out / "checkpoints")
    flip_one_byte(newest / name)
    capsys.readouterr()
    assert cli.main([*args, "--steps", "5", "--resume", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    skipped = [line for line in err if "skipping damaged checkpoint file" in line]
    assert len(skipped) == 1 and str(newest / name) in skipped[0] and "sha256" in skipped[0], err
    assert any(f"resuming from checkpoint {first} at step 2 of 5" in line for line in err), err
    assert not any("Traceback" in line for line in err), err
    assert pd.read_csv(out / "metrics.csv").step.tolist() == list(range(5))
    flip_one_byte(first / name)  # no intact checkpoint left: one line, exit 2, nothing run
    flip_one_byte(checkpoint.latest(out / "checkpoints") / name)
    assert cli.main([*args, "--steps", "6", "--resume", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "skipping" not in line]
    assert len(err) == 1 and "no intact checkpoint" in err[0] and str(first / name) in err[0], err


# ------------------------------------------------------------------------------ what a restore may run
EVIL = '''
import pathlib
pathlib.Path(__file__).with_name("ran").write_text("the module's top-level code ran")
from tests.custom_sampler_fixture import NewestFirstSampler as Sampler
'''


def test_restore_without_a_config_refuses_a_custom_sampler_unless_trusted(tmp_path, monkeypatch):
    ctrl = stepped(small_config(), 1)
    path = ctrl.save(tmp_path / "c")
    (tmp_path / "evil_sampler.py").write_text(EVIL)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = (path / "config.yaml").read_text().replace(
        "sampler:\n  name: in_order\n  max_lookahead_versions: 1\n",
        "sampler:\n  name: custom\n  target: evil_sampler:Sampler\n")
    assert "evil_sampler" in config
    (path / "config.yaml").write_text(config)
    refused = "names a custom sampler, 'evil_sampler:Sampler'.*trust_code=True"
    with pytest.raises(checkpoint.CheckpointError, match=refused):
        Controller.restore(path)
    assert not (tmp_path / "ran").exists() and "evil_sampler" not in sys.modules
    kept = Controller.restore(path, config=small_config())  # the caller's config decides what runs
    assert kept.trainer_version == 1 and not (tmp_path / "ran").exists()
    trusted = Controller.restore(path, trust_code=True)
    assert trusted.cfg.sampler.name == "custom" and (tmp_path / "ran").exists()
    sys.modules.pop("evil_sampler", None)


def test_restore_connects_where_the_caller_says_not_where_the_checkpoint_did(tmp_path, monkeypatch):
    import asyncrl.backends.ray

    ctrl = stepped(small_config(), 1)
    path = ctrl.save(tmp_path / "c")
    config = (path / "config.yaml").read_text()
    assert "placement: local" in config and "address: null" in config
    (path / "config.yaml").write_text(
        config.replace("placement: local", "placement: ray", 1).replace("address: null", "address: 10.9.8.7:6379"))

    class Connecting(Exception):
        pass

    def ensure_ray(num_cpus=None, address=None):
        raise Connecting(address)

    monkeypatch.setattr(asyncrl.backends.ray, "ensure_ray", ensure_ray)
    with pytest.raises(Connecting) as caught:
        Controller.restore(path)
    assert caught.value.args == (None,)  # RAY_ADDRESS or a local Ray, never the checkpoint's cluster
    with pytest.raises(Connecting) as caught:
        Controller.restore(path, config=small_config(generation={"placement": "ray"}, ray={"address": "auto"}))
    assert caught.value.args == ("auto",)
