"""The completions log: what the model wrote, row by row, whole after an interrupt or kill -9, cut back on resume,
and read by group."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from asyncrl.completions import COLUMNS, CompletionsFile, CompletionsLog, check_every, group_rows, read_rows
from asyncrl.data import GroupRollouts
from asyncrl.tasks import Prompt


def rollouts(gid, n=3, version=0):
    return GroupRollouts(gid, [5, 6], [[1] * (i + 1) for i in range(n)], [[0.0] * (i + 1) for i in range(n)],
                         version, version, ["stop"] * n, [float(i) for i in range(n)], [f"text {gid}.{i}" for i in range(n)])


def rows_of(gid, version=0):
    return group_rows(gid, Prompt(f"prompt {gid}=", "1", f"train/{gid}"), version, rollouts(gid, version=version),
                      {"exact_match": [1.0, 0.0, None]})


def test_a_groups_rows_carry_every_column():
    first = rows_of(7)[0]
    assert list(first)[:len(COLUMNS)] == list(COLUMNS)
    assert first == {"group_id": 7, "prompt_id": "train/7", "weight_version": 0, "completion_index": 0,
                     "prompt": "prompt 7=", "prompt_tokens": 2, "tokens": 1, "completion": "text 7.0",
                     "finish_reason": "stop", "reward": 0.0, "reward/exact_match": 1.0}
    log = CompletionsLog("all", ["exact_match"])
    log.add(rows_of(7))
    frame = log.frame()
    assert list(frame.columns) == [*COLUMNS, "reward/exact_match"] and len(frame) == 3
    assert frame["reward/exact_match"].isna().tolist() == [False, False, True]


def test_log_completions_all_none_or_every_n_weight_versions():
    assert [CompletionsLog(every).wants(v) for every in ("all", "none", 3) for v in (0, 1, 3)] == [
        True, True, True, False, False, False, True, False, True]
    for bad in (0, -1, "some", 1.5, True):
        with pytest.raises(ValueError, match="log_completions .*'all', 'none', or N"):
            check_every(bad)


def test_a_file_appends_cuts_a_torn_line_and_resumes_at_the_saved_row_count(tmp_path):
    path = tmp_path / "run" / "completions.jsonl"
    log = CompletionsLog("all", ["exact_match"])
    log.add(rows_of(0))  # before a file: held in memory, written first when one is opened
    log.open(path)
    log.add(rows_of(1))
    saved = log.state_dict()
    log.add(rows_of(2))
    log.close()
    assert [r["group_id"] for r in read_rows(path)] == [0] * 3 + [1] * 3 + [2] * 3 and saved == {"rows": 6}
    with open(path, "ab") as f:
        f.write(b'{"group_id": 3, "prom')  # a write cut short
    assert len(read_rows(path)) == 9
    resumed = CompletionsLog("all", ["exact_match"])
    resumed.load_state_dict(saved)
    resumed.open(path)  # group 2 is generated again after the resume: its old rows go
    assert resumed.counts == {0: 3, 1: 3} and resumed.count(2) == 0
    resumed.add(rows_of(2))
    resumed.close()
    assert [r["group_id"] for r in read_rows(path)] == [0] * 3 + [1] * 3 + [2] * 3 and resumed.rows == 9
    assert resumed.count(2) == 3
    assert path.read_bytes().endswith(b"\n") and resumed.frame().shape == (9, len(COLUMNS) + 1)
    by_group = CompletionsFile(path)
    assert by_group.group(1).completion.tolist() == ["text 1.0", "text 1.1", "text 1.2"]
    assert by_group.group(99).empty and by_group.count(2) == 3
    assert CompletionsLog().open(path).rows == 0 and read_rows(path) == []  # a fresh run in the same directory



def test_kill_9_leaves_every_finished_row_whole(tmp_path):
    path = tmp_path / "completions.jsonl"
    writer = textwrap.dedent(f"""
        import itertools
        from asyncrl.completions import CompletionsLog
        log = CompletionsLog().open({str(path)!r})
        print("open", flush=True)
        for g in itertools.count():
            log.add([{{"group_id": g, "completion_index": i, "completion": "x" * 5000}} for i in range(8)])
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "open\n"
    deadline = time.monotonic() + 30
    while path.stat().st_size < 2_000_000 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rows = read_rows(path)  # every whole line parses; a torn last line would be left out
    groups = [r["group_id"] for r in rows]
    assert len(rows) >= 8 and all(len(r["completion"]) == 5000 for r in rows)
    assert groups == [g for g in range(groups[-1] + 1) for _ in range(8)]  # a group's rows are one write
