"""The completions log: what the model wrote, row by row, whole after an interrupt or kill -9, cut back on resume,
and read by group."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pandas as pd
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
    proc.stdout.close()
    rows = read_rows(path)  # every whole line parses; a torn last line is left out
    groups = [r["group_id"] for r in rows]
    assert len(rows) >= 8 and all(len(r["completion"]) == 5000 for r in rows)
    last = groups[-1]  # a group's rows are one write, which the kill may cut short: only the last group's
    assert groups[:groups.index(last)] == [g for g in range(last) for _ in range(8)] and groups.count(last) <= 8


# ------------------------------------------------------------------------------------------------ in a run
def stepped(steps=2, **overrides):
    from asyncrl import Controller
    from tests.faults import small_config

    ctrl = Controller.from_config(small_config(**overrides))
    while ctrl.trainer_version < steps:
        ctrl.tick()
    return ctrl


def test_every_committed_group_is_logged_with_what_the_buffer_holds():
    ctrl = stepped(reward={"funcs": ["exact_match"]})
    try:
        rows, trace = ctrl.completions, ctrl.trace
        committed = trace[trace.event == "commit"]
        G = ctrl.cfg.group_size
        assert list(rows.columns) == [*COLUMNS, "reward/exact_match"]
        assert rows.group_id.tolist() == [g for g in committed.group_id for _ in range(G)]
        assert rows.completion_index.tolist() == list(range(G)) * len(committed)
        assert rows.weight_version.tolist() == [w for w in committed.weight_version for _ in range(G)]
        dispatched = trace[trace.event == "dispatch"].set_index("group_id").detail
        assert (rows.prompt == dispatched[rows.group_id].to_numpy()).all()  # the rendered text the model was given
        assert rows.prompt_id.str.startswith("train/").all() and (rows.prompt_tokens > 0).all()
        for slot in ctrl.buffer:  # still buffered: the log says what the buffer holds
            if slot.ready:
                mine = rows[rows.group_id == slot.group_id]
                assert mine.reward.tolist() == slot.rollouts.rewards
                assert mine.completion.tolist() == slot.rollouts.texts
                assert mine.tokens.tolist() == [len(c) for c in slot.rollouts.completion_ids]
                assert mine.finish_reason.tolist() == slot.rollouts.finish_reasons
        verdicts = ctrl.explain()
        ready = verdicts.state == "ready"
        assert (verdicts.completions[ready] == G).all() and (verdicts.completions[~ready] == 0).all()
    finally:
        ctrl.close()


def test_log_completions_none_or_every_n_weight_versions():
    ctrl = stepped(steps=3, log_completions="none")
    assert ctrl.completions.empty and list(ctrl.completions.columns)[:len(COLUMNS)] == list(COLUMNS)
    ctrl.close()
    ctrl = stepped(steps=3, log_completions=2)
    versions = set(ctrl.completions.weight_version)
    assert versions and all(v % 2 == 0 for v in versions)
    ctrl.close()
    with pytest.raises(ValueError, match="log_completions 'some'"):
        stepped(log_completions="some")


def test_a_run_directory_and_its_recording_hold_the_completions(tmp_path):
    from asyncrl import Recording
    from asyncrl.run_files import RunFiles

    ctrl = stepped(steps=0)
    files = RunFiles(tmp_path).attach(ctrl)
    while ctrl.trainer_version < 2:
        ctrl.tick()
    (tmp_path / "config.yaml").write_text(__import__("yaml").safe_dump(ctrl.cfg.model_dump(mode="json")))
    files.close()
    try:
        live = ctrl.completions
        assert live.equals(CompletionsFile(tmp_path / "completions.jsonl").frame(["copy_first"]))
        rec = Recording(tmp_path)
        view = rec.at(rec.steps[-1])
        gid = int(view.explain().query("state == 'ready'").group_id.iloc[0])
        pd.testing.assert_frame_equal(view.completions(gid), live[live.group_id == gid].reset_index(drop=True))
        assert view.explain().completions.equals(ctrl.explain().completions)
        assert Recording(ctrl).at(1).completions(gid).equals(view.completions(gid))
    finally:
        ctrl.close()


CLI = ["run", "quickstart", "--quiet", "--no-plot", "--set", "eval_every=null", "--set", "torch_threads=1",
       "--set", "groups_per_step=2", "--set", "group_size=2"]


def consistent(out) -> pd.DataFrame:
    """The run directory's completions are one row per completion of each group its trace committed, once."""
    rows = pd.DataFrame(read_rows(out / "completions.jsonl"))
    trace = pd.read_csv(out / "trace.csv")
    committed = trace[trace.event == "commit"].group_id.tolist()
    assert not rows.duplicated(["group_id", "completion_index"]).any()
    assert sorted(set(rows.group_id)) == sorted(committed) and (rows.groupby("group_id").size() == 2).all()
    return rows


def test_a_resumed_run_logs_each_group_once(tmp_path):
    from asyncrl import checkpoint, cli

    out = tmp_path / "run"
    assert cli.main([*CLI, "--steps", "5", "--out", str(out), "--checkpoint-every", "2"]) == 0
    first = consistent(out)
    (out / "checkpoints" / "step-000004").rename(tmp_path / "step-000004")  # so the resume is from step 2
    assert checkpoint.latest(out / "checkpoints").name == "step-000002"
    assert cli.main([*CLI, "--steps", "6", "--resume", str(out)]) == 0
    again = consistent(out)  # the rows logged after step 2's checkpoint were cut, then logged again
    rows_at_2 = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    kept = rows_at_2["in_step"]["gen"]["rewards"]["completions"]["rows"]
    assert 0 < kept < len(first) and again.iloc[:kept].equals(first.iloc[:kept])


@pytest.mark.slow  # a CLI run in a fresh interpreter, killed, and its resume: ~7-15 s on 2 cores
def test_kill_9_of_a_run_then_resume_leaves_every_row_whole_and_each_group_once(tmp_path):
    import os

    from asyncrl import checkpoint, cli

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *CLI, "--steps", "100000", "--out", str(out),
                               "--checkpoint-every", "3"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while checkpoint.latest(out / "checkpoints") is None or len(read_rows(out / "completions.jsonl")) < 40:
        assert killed.poll() is None, killed.stderr.read().decode()
        assert time.monotonic() < deadline, "no checkpoint within 5 minutes"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    lines = (out / "completions.jsonl").read_bytes().split(b"\n")
    assert all(json.loads(line) for line in lines[:-1])  # every finished row whole (a last one may be cut short)
    steps = json.loads((checkpoint.latest(out / "checkpoints") / "meta.json").read_text())["trainer_version"] + 2
    assert cli.main([*CLI, "--steps", str(steps), "--resume", str(out)]) == 0
    consistent(out)


def test_the_dashboard_shows_a_chosen_groups_completions():
    pytest.importorskip("ipywidgets")
    import html

    import widgets

    ctrl = stepped(steps=0, reward={"funcs": ["exact_match"]})
    try:
        dash = widgets.Dashboard(ctrl, steps=1)
        assert "no buffered group with completions" in dash.completions.table.value
        dash.controls.buttons["rollout"].click()
        view = dash.completions
        ready = ctrl.explain().query("state == 'ready'").group_id.tolist()
        assert list(view.group.options) == ready and view.group.value == ready[-1]
        view.group.value = ready[0]
        rows = ctrl.completions[ctrl.completions.group_id == ready[0]]
        for text in rows.completion:
            assert html.escape(text, quote=False) in view.table.value
        assert "reward/exact_match" in view.table.value and f"group {ready[0]}" in view.table.value
    finally:
        ctrl.close()
