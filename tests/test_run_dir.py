"""A run directory that cannot be written (asyncrl/run_dir.py): a full disk (ENOSPC, even part-way through a write)
or a directory turned read-only (EROFS) stops ``asyncrl run`` with one line naming the file and the error, exit 1;
every row of ``trace.csv``, ``metrics.csv`` and ``completions.jsonl`` is whole, the recording opens without damage,
and ``summary.json`` is written where it still can be. Tests run as root, where permission bits stop no write, so
the operating system's refusals are simulated at ``os.write`` for one file."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import warnings
from pathlib import Path

import pandas as pd
import pytest

from asyncrl import Recording, cli

ARGS = ["run", "quickstart", "--quiet", "--no-plot", "--set", "eval_every=null", "--set", "torch_threads=1",
        "--set", "groups_per_step=2", "--set", "group_size=2"]


def refuse(monkeypatch, target: Path, code: int, after_bytes: int) -> dict:
    """Make writes to ``target`` fail with ``code`` once ``after_bytes`` bytes have gone into it: the write that
    crosses the limit writes what fits (a partial write, as a filling disk does), then raises."""
    real, seen = os.write, {"bytes": 0, "refused": 0}

    def write(fd, data):
        try:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return real(fd, data)
        if path != target:
            return real(fd, data)
        room = after_bytes - seen["bytes"]
        if room >= len(data):
            seen["bytes"] += len(data)
            return real(fd, data)
        if room > 0:
            seen["bytes"] += real(fd, bytes(data[:room]))
            return room  # a short write: the caller must write the rest, and that write fails
        seen["refused"] += 1
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "write", write)
    return seen


def ends_whole(path: Path) -> bool:
    data = path.read_bytes()
    return data == b"" or data.endswith(b"\n")


@pytest.mark.parametrize("name, code, fraction", [
    ("trace.csv", errno.ENOSPC, 0.5),
    ("metrics.csv", errno.ENOSPC, 0.5),
    ("completions.jsonl", errno.ENOSPC, 0.5),
    ("trace_index.csv", errno.EROFS, 0.5),
    ("metrics.csv", errno.EROFS, 0.0),
], ids=["trace-full", "metrics-full", "completions-full", "index-readonly", "metrics-readonly"])
def test_a_file_that_cannot_be_written_stops_the_run_in_one_line_with_whole_rows(tmp_path, capsys, monkeypatch,
                                                                                    name, code, fraction):
    whole = tmp_path / "whole"
    assert cli.main([*ARGS, "--steps", "6", "--out", str(whole)]) == 0
    out = tmp_path / "run"
    seen = refuse(monkeypatch, out / name, code, int((whole / name).stat().st_size * fraction))
    capsys.readouterr()
    assert cli.main([*ARGS, "--steps", "6", "--out", str(out)]) == 1
    monkeypatch.undo()
    assert seen["refused"] >= 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("asyncrl run: cannot write") and str(out / name) in err[0], err
    assert os.strerror(code) in err[0] and errno.errorcode[code] in err[0], err
    for file in ("trace.csv", "metrics.csv", "trace_index.csv", "completions.jsonl"):
        assert ends_whole(out / file), file
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and str(out / name) in summary["error"]
    steps = summary["steps"]
    assert steps < 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no file ends mid-row: the recording opens without a damage warning
        rec = Recording(out)
    assert rec.steps == list(range(len(rec.steps))) and len(rec.metrics) == len(rec.steps) <= steps
    if rec.steps:
        rec.at(rec.steps[-1])
    metrics = pd.read_csv(out / "metrics.csv") if (out / "metrics.csv").stat().st_size else None
    if metrics is not None:  # the rows written are the uninterrupted run's rows
        want = pd.read_csv(whole / "metrics.csv").iloc[:len(metrics)]
        pd.testing.assert_frame_equal(metrics[["step", "loss", "reward_mean"]], want[["step", "loss", "reward_mean"]])


def test_a_checkpoint_that_cannot_be_written_stops_the_run_in_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real = os.fsync

    def fsync(fd):  # where a full disk shows itself to a file system that allocates late
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("/tensors.pt") and ".step-000004.tmp-" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert cli.main([*ARGS, "--steps", "6", "--out", str(out), "--checkpoint-every", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensors.pt" in err[0] and "No space left on device (ENOSPC)" in err[0], err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]  # no half-written checkpoint
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"


def test_the_summary_is_written_where_it_still_can_be(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == "summary.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    assert cli.main([*ARGS, "--steps", "2", "--out", str(out)]) == 1  # the run's files are whole, its summary lost
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out / "summary.json") in err[0] and "ENOSPC" in err[0], err
    assert pd.read_csv(out / "metrics.csv").step.tolist() == [0, 1]


@pytest.fixture
def small_disk(tmp_path):
    """A 200 KiB file system (tmpfs), where the operating system allows mounting one (root on Linux); else skip."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)  # -l: files a failed run left open


def test_a_disk_that_fills_mid_run_stops_it_in_one_line_with_whole_rows(small_disk, capsys):
    out = small_disk / "run"  # a 20-step run writes ~390 KiB: the disk fills part-way
    assert cli.main([*ARGS[:-4], "--steps", "20", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"asyncrl run: cannot write '{out}/"), err
    assert "No space left on device (ENOSPC)" in err[0], err
    for file in ("trace.csv", "metrics.csv", "trace_index.csv", "completions.jsonl"):
        assert ends_whole(out / file), file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec = Recording(out)
    assert 0 < len(rec.steps) < 20 and len(rec.metrics) == len(rec.steps)
    rec.at(rec.steps[-1])


def test_an_oserror_from_a_writer_is_the_same_one_line(tmp_path, capsys, monkeypatch):
    from asyncrl.run_files import CsvLog

    out, real, calls = tmp_path / "run", CsvLog.write, {"n": 0}

    def write(self, rows):
        if self.path.name == "metrics.csv":
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return real(self, rows)

    monkeypatch.setattr(CsvLog, "write", write)
    assert cli.main([*ARGS, "--steps", "6", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"asyncrl run: cannot write {str(out / 'metrics.csv')!r}: Permission denied (EACCES); the run "
                   "stopped, every file ends with a whole row"], err
    assert pd.read_csv(out / "metrics.csv").step.tolist() == [0, 1]
    assert pd.read_csv(out / "trace_index.csv").step.tolist() == [0, 1]
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"
