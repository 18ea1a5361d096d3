"""Counterfactual replay (asyncrl.replay, ``Recording.replay``, ``asyncrl replay``): a recorded run's own completions
served to a sampler on the simulated clock."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

import asyncrl
from asyncrl import Controller, cli, load_config
from asyncrl.run_files import RunFiles
from asyncrl.replay.recorded import schedule
from asyncrl.simulate import Simulation
from asyncrl.trace import COMMIT, TRACE_COLUMNS

QUICK = {"eval_every": None, "torch_threads": 1}


def record(out: Path, steps: int, preset: str = "what_if", simulated_clock: bool = False, **overrides) -> Controller:
    """A run directory as ``asyncrl run`` writes it (config.yaml, trace.csv, metrics.csv, trace_index.csv,
    completions.jsonl), from a run stepped by hand or, with ``simulated_clock``, driven by ``asyncrl.simulate``
    (virtual time; its metrics.csv then has the simulated times)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(preset, **overrides)
    ctrl = Controller.from_config(cfg)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    files = RunFiles(out).attach(ctrl)
    sim = Simulation(ctrl) if simulated_clock else None
    if sim is not None:
        sim.run(steps)
    else:
        while ctrl.trainer_version < steps:
            ctrl.tick()
    files.close()
    if sim is not None:
        sim.metrics.to_csv(out / "metrics.csv", index=False)
    return ctrl


def cli_run(out: Path, steps: int, *settings: str) -> Path:
    """``asyncrl run quickstart`` in this process (threaded pumps, as from a shell)."""
    args = ["run", "quickstart", "--steps", str(steps), "--out", str(out), "--quiet", "--no-plot",
            "--set", "eval_every=null", "--set", "torch_threads=1", *[a for s in settings for a in ("--set", s)]]
    assert cli.main(args) == 0
    return out


def trained(frame: pd.DataFrame) -> list[tuple]:
    return list(zip(frame.step, frame.group_id, frame.weight_version))


@pytest.mark.parametrize("sampler", [{"name": "in_order", "max_lookahead_versions": 1},
                                     {"name": "weight_fifo", "max_staleness_versions": 2}])
def test_replaying_a_gated_run_under_its_own_sampler_reproduces_its_schedule(tmp_path, sampler):
    # a real CPU run, its pumps in two threads, written by `asyncrl run`; completions 1-6 tokens long
    run = cli_run(tmp_path / "run", 14, f"sampler={json.dumps(sampler)}", "generation.max_new_tokens=6")
    rec = asyncrl.Recording(run)
    replayed = rec.replay(sampler=sampler)
    assert len(replayed.metrics) == 14
    mine, theirs = replayed.schedule, schedule(rec.trace)
    assert trained(mine) == trained(theirs)  # the same groups trained at the same steps, with the same versions
    dispatched = rec.trace[rec.trace.event == "dispatch"].set_index("group_id").detail
    assert list(mine.prompt) == list(dispatched.loc[theirs.group_id])  # ... on the same prompts
    assert not mine.drawn.any() and list(mine.recorded_group) == list(theirs.group_id)


def test_a_replay_under_another_sampler_gets_that_samplers_schedule_with_the_recorded_lengths(tmp_path):
    # the recorded run: in_order L=1 on the simulated backends (uniform lengths 1..128), 60 steps, so the prompt
    # stream's first epoch (410 prompts) is done and some prompts were generated twice, at two versions
    record(tmp_path / "run", 60)
    rec = asyncrl.Recording(tmp_path / "run")
    replayed = rec.replay(sampler={"name": "windowed", "max_staleness_versions": 0}, steps=10)
    assert replayed.drawn_fraction == 0  # 10 steps of windowed dispatch fewer prompts than were recorded

    # The oracle: the same sampler on the simulated clock, the generator serving each prompt the lengths and
    # rewards the run's files hold for it at the version nearest the one it is generated with.
    completions = pd.read_json(tmp_path / "run" / "completions.jsonl", lines=True)
    commits = rec.trace[rec.trace.event == COMMIT].set_index("group_id").gen_start_version
    recorded: dict[str, list] = {}
    for gid, rows in completions.groupby("group_id"):
        recorded.setdefault(rows.prompt_id.iloc[0], []).append(
            (int(commits[gid]), rows.tokens.tolist(), rows.reward.tolist()))

    from asyncrl.backends.simulated import SimulatedGenerator

    cfg = load_config("what_if", sampler={"name": "windowed", "max_staleness_versions": 0})
    oracle = Controller.from_config(cfg)
    generator: SimulatedGenerator = oracle.generator

    def draw(request, success):
        options = recorded[oracle.buffer[request.group_id].prompt.id]
        _, lengths, rewards = min(options, key=lambda o: (abs(o[0] - generator.version), o[0]))
        return lengths, rewards

    generator.draw = draw
    Simulation(oracle).run(10)
    assert trained(replayed.schedule) == trained(schedule(oracle.trace))
    assert replayed.metrics.train_len_mean.tolist() == oracle.metrics.train_len_mean.tolist()
    # and it is not the recorded schedule: windowed W=0 generates ahead and evicts what went stale
    assert (replayed.trace.event == "evict").any() and replayed.schedule.lag.max() == 0
    assert trained(replayed.schedule) != trained(schedule(rec.trace))[:80]


def test_the_replay_reads_like_a_controller(tmp_path):
    record(tmp_path / "run", 12, sampler={"name": "weight_fifo", "max_staleness_versions": 1})
    rec = asyncrl.Recording(tmp_path / "run")
    replayed = rec.replay(sampler={"name": "ready_first"}, steps=8)
    assert list(replayed.trace.columns)[:len(TRACE_COLUMNS)] == TRACE_COLUMNS
    assert replayed.trace.sim_time_s.notna().any()
    controller_columns = [c for c in rec.metrics.columns if c not in ("step_time_s", "tokens_per_s")]
    assert set(controller_columns) <= set(replayed.metrics.columns)
    assert replayed.steps == list(range(8))
    view = replayed.at(4)
    assert view.state().trainer_version == 5 and list(view.explain().columns)[:7] == [
        "group_id", "weight_version", "target_step", "state", "action", "code", "reason"]
    assert view.metrics.step.tolist() == [0, 1, 2, 3, 4]
    assert replayed.explain().group_id.tolist() == [s.group_id for s in replayed.controller.buffer]
    summary = replayed.summary()
    assert summary["steps"] == 8 and summary["source"] == "completions" and summary["drawn_fraction"] == 0


def test_prompts_the_run_never_generated_are_drawn_from_its_groups_and_counted(tmp_path):
    record(tmp_path / "run", 4, sampler={"name": "in_order", "max_lookahead_versions": 0})
    rec = asyncrl.Recording(tmp_path / "run")
    # windowed W=0 generates far ahead of an in_order L=0 run: most of its prompts were never generated
    replayed = rec.replay(sampler={"name": "windowed", "max_staleness_versions": 0}, steps=6)
    served = replayed.controller.generator.served
    drawn = [gid for gid, s in served.items() if s.drawn]
    assert 0 < replayed.drawn_fraction == len(drawn) / len(served) < 1
    recorded_groups = {int(g) for g in rec.trace[rec.trace.event == COMMIT].group_id}
    assert {served[g].recorded_group for g in drawn} <= recorded_groups
    again = rec.replay(sampler={"name": "windowed", "max_staleness_versions": 0}, steps=6)
    assert trained(again.schedule) == trained(replayed.schedule)  # deterministic, draws included
    assert again.controller.generator.served == served


def test_a_lockstep_recording_replays_at_its_own_pace(tmp_path):
    # the fit: in a lockstep run a batch is the step less training and sync, so its own replay keeps its pace
    run = cli_run(tmp_path / "run", 16, 'sampler={"name": "in_order", "max_lookahead_versions": 0}')
    rec = asyncrl.Recording(run)
    replayed = rec.replay(sampler={"name": "in_order", "max_lookahead_versions": 0})
    measured, simulated = (m.iloc[3:].step_time_s.mean() for m in (rec.metrics, replayed.metrics))
    assert simulated == pytest.approx(measured, rel=0.1)
    assert replayed.summary()["source"] == "completions"  # `asyncrl run` writes completions.jsonl
    assert replayed.fit["rule"].startswith("lockstep")


def test_a_simulated_recording_replays_with_its_own_latency_model(tmp_path):
    fifo = {"name": "weight_fifo", "max_staleness_versions": 1}
    record(tmp_path / "run", 20, simulated_clock=True, sampler=fifo, generation={"lengths": "lognormal"})
    rec = asyncrl.Recording(tmp_path / "run")
    replayed = rec.replay(sampler=fifo)
    gen = replayed.controller.cfg.generation
    assert (gen.prefill_s, gen.decode_s_per_token, gen.concurrency) == (0.2, 0.02, 8)
    # the same latency model, lengths and rewards: the same steps, ending at the same simulated times
    assert trained(replayed.schedule) == trained(schedule(rec.trace))
    assert replayed.metrics.sim_time_s.tolist() == pytest.approx(rec.metrics.sim_time_s.tolist())
    assert replayed.metrics.train_len_mean.tolist() == rec.metrics.train_len_mean.tolist()
    # windowed W=0 drops groups in flight: their lengths were never recorded, so they are drawn, and the replay of
    # a timing-dependent sampler is a prediction, not a copy
    windowed = {"name": "windowed", "max_staleness_versions": 0}
    record(tmp_path / "windowed", 20, simulated_clock=True, sampler=windowed, generation={"lengths": "lognormal"})
    again = asyncrl.Recording(tmp_path / "windowed").replay(sampler=windowed)
    assert (again.trace.event == "abort").any() and 0 < again.drawn_fraction < 0.5


def test_a_live_controller_replays_too(tmp_path):
    ctrl = Controller.from_config(load_config("what_if", sampler={"name": "in_order", "max_lookahead_versions": 1}))
    rec = asyncrl.Recording(ctrl)
    for _ in range(12):
        ctrl.tick()
    replayed = rec.replay(sampler={"name": "in_order", "max_lookahead_versions": 1})
    assert trained(replayed.schedule) == trained(schedule(rec.trace))


def test_cli_replay_writes_the_table_the_figure_and_the_schedule(tmp_path, capsys):
    record(tmp_path / "run", 10, sampler={"name": "weight_fifo", "max_staleness_versions": 1})
    out = tmp_path / "out"
    code = cli.main(["replay", str(tmp_path / "run"), "--sampler", "in_order", "--sampler",
                     "{name: windowed, max_staleness_versions: 0}", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    table = pd.read_csv(out / "replay.csv", index_col="quantity")
    assert list(table.columns) == ["recorded (weight_fifo W=1)", "in_order L=1", "windowed W=0"]
    assert int(table.loc["groups_trained", "in_order L=1"]) == 80
    sched = pd.read_csv(out / "schedule.csv")
    assert set(sched.sampler) == set(table.columns) and (sched.groupby("sampler").size() == 80).all()
    assert (out / "replay.png").stat().st_size > 10_000
    assert (out / "windowed_W0" / "metrics.csv").is_file() and (out / "drops.csv").is_file()
    assert "windowed W=0" in capsys.readouterr().out
    for bad, words in (("{name: windowed, max_staleness_versions: -1}", "greater than or equal to 0"),
                       ("nope", "'nope'"), ("[1, 2]", "a sampler name or a YAML mapping")):
        assert cli.main(["replay", str(tmp_path / "run"), "--sampler", bad, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("asyncrl replay:") and words in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kept", ["5 bytes", "all but 1 byte"])
def test_cli_replay_of_a_trace_cut_mid_row_says_so_and_replays_only_whole_steps(tmp_path, capsys, kept):
    run = tmp_path / "run"
    record(run, 10, sampler={"name": "weight_fifo", "max_staleness_versions": 1})
    intact = pd.read_csv(run / "trace.csv", keep_default_na=False)
    data = (run / "trace.csv").read_bytes()
    end = data.rfind(b"\n", 0, len(data) * 6 // 10) + 1
    cut = end + 5 if kept == "5 bytes" else data.index(b"\n", end)  # the last row cut mid-line
    (run / "trace.csv").write_bytes(data[:cut])
    kept = pd.read_csv(run / "trace.csv", keep_default_na=False).iloc[:-1]
    whole = int((kept.event == "step").sum())  # the steps whose rows are all whole
    assert 0 < whole < 10
    last_step_seq = kept[kept.event == "step"].seq.iloc[-1]
    want = int(((intact.event == "select") & (intact.seq < last_step_seq)).sum())  # groups trained in those steps
    code = cli.main(["replay", str(run), "--sampler", "in_order", "--out", str(tmp_path / "out"), "--no-plot"])
    err = capsys.readouterr().err
    assert code == 0, err
    said = [line for line in err.splitlines() if "trace.csv ends mid-row" in line]
    assert len(said) == 1 and said[0].startswith("asyncrl replay: ") and f"steps 0..{whole - 1}" in said[0], err
    table = pd.read_csv(tmp_path / "out" / "replay.csv", index_col="quantity")
    assert int(table.loc["groups_trained", "recorded (weight_fifo W=1)"]) == want
