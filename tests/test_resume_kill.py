"""Exact resume whatever the kill point: ``asyncrl run quickstart`` killed with SIGKILL at several points (when
``metrics.csv`` reaches chosen row counts) and resumed with ``--resume`` each time writes what an uninterrupted run
writes, in every column that does not measure time: ``metrics.csv``, ``trace.csv`` and ``completions.jsonl``, for
the two samplers whose schedules do not depend on timing (``in_order``, ``weight_fifo``), with the gap metrics on
(the quickstart's default).

The reward takes 10 ms a group in the rollout pump's thread (``tests.reward_functions:first_char_slowly``), so most
steps end while that pump holds a batch it generated and has not committed: the saves catch batches in flight (the
test asserts some did), which a save must bring back before the state is taken (asyncrl/rollout.py, ``settle``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

STEPS, EVERY = 40, 5
KILLS = (8, 19, 31)  # metrics.csv rows at which a run is killed; each resume goes on from the newest checkpoint
SAMPLERS = {
    "in_order": [],  # the quickstart's: in_order with max_lookahead_versions 1
    "weight_fifo": ["--set", "sampler.name=weight_fifo", "--set", "sampler.max_staleness_versions=1"],
}
# What the rollout pump had done by the time a step ended (committed, buffered, in flight) is its pace, not the
# run's history: two uninterrupted threaded runs may differ there. Everything else must be equal.
PACE = ("gen_completions", "gen_len_mean", "gen_reward_mean", "groups_uniform", "buffered", "inflight")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--steps", str(STEPS), "--quiet", "--no-plot",
            "--set", 'reward.funcs=["tests.reward_functions:first_char_slowly"]', *args]


def rows(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return max(0, f.read().count(b"\n") - 1)
    except FileNotFoundError:
        return 0


def run_killed(out: Path, args: list[str], env: dict) -> None:
    """Start the run, kill it with SIGKILL when metrics.csv has each of ``KILLS`` rows (resuming in between), then
    resume it to the end."""
    first = True
    for kill_at in KILLS:
        (out / "metrics.csv").unlink(missing_ok=True)  # a resumed run writes it again from its checkpoint
        where = ["--out", str(out), "--checkpoint-every", str(EVERY)] if first else ["--resume", str(out)]
        proc = subprocess.Popen(cli(*where, *args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while rows(out / "metrics.csv") < kill_at:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, f"metrics.csv did not reach {kill_at} rows in 5 minutes"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed at {kill_at} rows"
        first = False
    done = subprocess.run(cli("--resume", str(out), *args), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("resuming from checkpoint") == 1


def timing(column: str) -> bool:
    return column.endswith(("_s", "tflops", "mfu")) or column in PACE


def history(out: Path) -> dict:
    """What a run wrote, less what measures time or the pumps' pace: the metrics; each trace event's rows in order
    up to the last step (without ``seq``, which interleaves the two pumps' rows by timing; after the last step the
    rollout pump went on until the run stopped); a commit only for the groups trained or evicted, without its
    trainer version (when a group came back during a step is pace; ``refuse`` rows, written when the rollout pump
    happens to ask a shut gate, likewise); the completions of those groups, in the order they were logged."""
    metrics = pd.read_csv(out / "metrics.csv")
    trace = pd.read_csv(out / "trace.csv", keep_default_na=False, dtype=str)
    trace = trace.iloc[:trace.index[trace.event == "step"][-1] + 1].drop(columns="seq")
    ended = set(trace.group_id[trace.event.isin(["select", "evict"])])
    trace = trace[(trace.event != "commit") | trace.group_id.isin(ended)]
    events = {event: rows_.drop(columns="trainer_version" if event == "commit" else []).reset_index(drop=True)
              for event, rows_ in trace.groupby("event", sort=True) if event != "refuse"}
    completions = [row for line in (out / "completions.jsonl").read_text().splitlines()
                   if str((row := json.loads(line))["group_id"]) in ended]
    return {"metrics": metrics.drop(columns=[c for c in metrics if timing(c)]), "events": events,
            "completions": completions, "inflight": metrics.inflight}


@pytest.mark.slow  # two samplers, each an uninterrupted run and a run killed three times: ~95 s on a busy 2-core box
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_a_run_killed_at_many_points_resumes_to_the_uninterrupted_history(tmp_path, sampler):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = SAMPLERS[sampler]
    straight = subprocess.run(cli("--out", str(tmp_path / "straight"), "--checkpoint-every", str(EVERY), *args),
                              env=env, capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr
    run_killed(tmp_path / "killed", args, env)
    want, got = history(tmp_path / "straight"), history(tmp_path / "killed")

    # Not vacuous: some saves caught groups in flight (the row of the step a checkpoint followed counts them).
    saved_at = want["inflight"].iloc[EVERY - 1::EVERY]
    assert (saved_at > 0).any(), f"no checkpoint had groups in flight: {saved_at.tolist()}"
    assert len(got["metrics"]) == STEPS
    assert got["metrics"].is_staleness_mean.notna().any()  # the gap metrics are on (the quickstart's default)
    assert got["metrics"]["reward/first_char_slowly"].notna().all()
    pd.testing.assert_frame_equal(got["metrics"], want["metrics"])
    assert sorted(got["events"]) == sorted(want["events"])
    for event, frame in want["events"].items():
        pd.testing.assert_frame_equal(got["events"][event], frame, obj=f"trace.csv {event} rows")
    assert got["completions"] == want["completions"]


@pytest.mark.parametrize("sampler", [{"name": "weight_fifo", "max_staleness_versions": 1},
                                     {"name": "in_order", "max_lookahead_versions": 1}], ids=["weight_fifo", "in_order"])
def test_a_save_with_a_streaming_generator_holds_no_group_in_flight(tmp_path, sampler):
    """A generator whose groups take many polls (the simulated one, ``weight_update: drain``, 0.1 s a tick): a save
    after a step brings the groups still generating back, each committed with the weights that generated it (its
    slot's version), and the restored run goes on as the saved one does."""
    from asyncrl import Controller, load_config

    cfg = load_config("what_if", sampler=sampler, groups_per_step=4, group_size=4,
                      generation={"weight_update": "drain", "rollout_tick_s": 0.1})
    saved = Controller.from_config(cfg)
    while saved.trainer_version < 3:
        saved.tick()
    assert saved.inflight, "nothing in flight at the save: the test would prove nothing"
    path = saved.save(tmp_path / "ckpt")
    state = json.loads((path / "state.json").read_text())
    assert [slot["group_id"] for slot in state["buffer"]["slots"] if not slot["ready"]] == []
    resumed = Controller.restore(path)
    for ctrl in (saved, resumed):
        while ctrl.trainer_version < 6:
            ctrl.tick()
        commits = ctrl.trace[ctrl.trace.event == "commit"]
        assert (commits.gen_start_version == commits.weight_version).all()  # drain: one version, the slot's
    keep = [c for c in saved.metrics if not timing(c)]
    pd.testing.assert_frame_equal(resumed.metrics[keep], saved.metrics[keep])
    assert resumed.trace.drop(columns="seq").equals(saved.trace.drop(columns="seq"))
