"""The virtual clock: simulated backends under the real controller (asyncrl.simulate, asyncrl simulate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl import Controller, cli, load_config
from asyncrl.simulate import ASYNC, SYNC, Simulation, calibrate, measure_overlap, run, simulate, sweep

SIM = {"generation": {"backend": "simulated"}, "trainer": {"backend": "simulated"}, "eval_every": None}


def stepped(knobs: dict, sampler=SYNC, **overrides) -> Controller:
    cfg = load_config("quickstart", sampler=sampler, **SIM | {"generation": {"backend": "simulated", **knobs}},
                      **overrides)
    return Controller.from_config(cfg)


def test_two_runs_with_one_seed_write_identical_files(tmp_path):
    for name in ("a", "b"):
        simulate("what_if", 40, sampler={"name": "windowed", "max_staleness_versions": 1}, seed=3).write(
            tmp_path / name, plots=False)
    for file in ("metrics.csv", "trace.csv", "summary.json", "config.yaml"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    other = simulate("what_if", 40, sampler={"name": "windowed", "max_staleness_versions": 1}, seed=4)
    assert (tmp_path / "a" / "metrics.csv").read_text() != other.metrics.to_csv(index=False)  # the seed matters


def test_virtual_time_accounting_and_the_two_stage_limit():
    sync, asyn = (simulate("what_if", 150, sampler=s) for s in (SYNC, ASYNC))
    a, s = asyn.summary(), sync.summary()
    for summary in (a, s):
        assert summary["gen_busy_frac"] + summary["gen_idle_frac"] == pytest.approx(1)
        assert summary["train_busy_frac"] + summary["train_idle_frac"] == pytest.approx(1)
        assert 0 < summary["gen_busy_frac"] <= 1 and 0 < summary["train_busy_frac"] <= 1
    # the preset's stages are equal on average
    assert s["gen_busy_s_per_step"] == pytest.approx(s["train_busy_s_per_step"], rel=0.05)
    # synchronous: the two sides take turns, overlapping only during weight syncs (the generator pauses for them)
    syncs = sync.metrics.sync_time_s.sum()
    gen_busy, train_busy = sync.busy()
    assert gen_busy + train_busy - syncs == pytest.approx(s["sim_time_s"], rel=0.01)
    assert s["lag_max"] == 0 and a["lag_max"] == 1
    # asynchronous overlaps the two: close to the limit of 2 at equal stage times, both sides nearly always busy
    ratio = a["sim_steps_per_hour"] / s["sim_steps_per_hour"]
    assert 1.85 <= ratio < 2.0
    assert a["gen_idle_frac"] < 0.1 and a["train_idle_frac"] < 0.1
    # simulated step times in the metrics add up to the simulated time
    assert asyn.metrics.step_time_s.sum() == pytest.approx(a["sim_time_s"])
    assert (asyn.metrics.train_time_s > 0).all()


def test_trace_times_are_ordered_and_steps_wait_for_their_chunk():
    sim = simulate("what_if", 10, sampler=ASYNC)
    trace = sim.trace
    assert trace.sim_time_s.notna().all()
    # events are logged in the order they happen, except selections, which are booked when their chunk started
    later = trace[trace.event != "select"].sim_time_s
    assert later.is_monotonic_increasing
    steps = trace[trace.event == "step"].sim_time_s.to_numpy()
    assert (steps[1:] - steps[:-1] > 1.0).all()  # a step takes seconds of simulated time, not zero


def test_stepping_waits_a_drawn_number_of_rollout_ticks_the_same_every_time():
    def play():
        # one group decodes at a time, 1.5 s each, a rollout tick is 1 s: group k of a batch is done at tick
        # ceil(1.5 (k + 1)), so the trainer waits while groups are pending
        ctrl = stepped({"prefill_s": 1.5, "concurrency": 1, "rollout_tick_s": 1.0}, groups_per_step=4)
        log = []
        for _ in range(16):
            r = ctrl.rollout_tick()
            t = ctrl.train_tick()
            log.append((len(r.committed), ctrl.buffer.num_pending, bool(t.selected), t.note.split(":")[0]))
        return ctrl, log

    ctrl, log = play()
    assert [c for c, *_ in log[:6]] == [0, 1, 1, 0, 1, 1]  # finishes at ticks 2, 3, 5, 6 (1.5 s apart)
    assert log[0][1] == 4 and log[0][3] == "select waits"  # pending groups, and the sampler waiting for them
    assert log[5][2]  # the step trains once the fourth group is in
    assert ctrl.trainer_version >= 2
    _, again = play()
    assert again == log
    assert ctrl.trace.equals(play()[0].trace)


def test_stale_data_slows_the_reward_model_and_shows_in_importance_weights():
    sync = simulate("what_if", 60, sampler=SYNC)
    stale = simulate("what_if", 60, sampler={"name": "weight_fifo", "max_staleness_versions": 3},
                     generation={"concurrency": 32})
    assert stale.summary()["lag_mean"] > 1.5
    assert stale.metrics.progress.iloc[-1] < sync.metrics.progress.iloc[-1]
    assert (sync.metrics.progress_share == 1).all() and (stale.metrics.progress_share < 1).any()
    from asyncrl.backends.simulated import DRIFT, LOG_HALF

    group = next(s.rollouts for s in stale.ctrl.buffer.ready_slots())
    assert group.logprobs[0][0] == pytest.approx(LOG_HALF - DRIFT * group.gen_start_version)


def test_long_tailed_lengths_are_clipped_and_keep_their_mean():
    for lengths in ("lognormal", "pareto"):
        cfg = load_config("what_if", generation={"max_new_tokens": 4096, "lengths": lengths, "length_mean": 20.0,
                                                 "length_sigma": 1.0, "pareto_alpha": 2.5})
        ctrl = Controller.from_config(cfg)
        draws = [ctrl.generator.length() for _ in range(20000)]
        assert min(draws) >= 1 and max(draws) <= 4096
        assert sum(draws) / len(draws) == pytest.approx(20.5, rel=0.1)  # ceil adds about half a token
        cfg = load_config("what_if", generation={"max_new_tokens": 16, "lengths": lengths})
        generator = Controller.from_config(cfg).generator
        assert max(generator.length() for _ in range(5000)) == 16


@pytest.mark.parametrize("section, knobs, words", [
    ("generation", {"concurrency": 0}, ["generation.simulated.concurrency", "greater than or equal to 1",
                                        "input_value=0"]),
    ("generation", {"lengths": "zipf"}, ["lengths", "'uniform', 'lognormal' or 'pareto'", "input_value='zipf'"]),
    ("generation", {"latency_s": 0.1}, ["latency_s=0.1", "allowed", "prefill_s", "decode_s_per_token"]),
    ("generation", {"reward_base": 0.5, "reward_max": 0.4}, ["reward_max 0.4", "reward_base 0.5"]),
    ("generation", {"decode_s_per_token": -1}, ["decode_s_per_token", "input_value=-1"]),
    ("trainer", {"stale_progress": 1.5}, ["trainer.simulated.stale_progress", "less than or equal to 1",
                                          "input_value=1.5"]),
    ("trainer", {"train_s_per_tok": 0.1}, ["train_s_per_tok=0.1", "allowed", "train_s_per_token"]),
])
def test_bad_knobs_fail_when_the_config_loads_naming_the_value_and_what_is_allowed(section, knobs, words):
    overrides = {section: dict(knobs)}
    with pytest.raises(ValueError) as info:
        load_config("what_if", **overrides)  # before any backend is built
    for word in words:
        assert word in str(info.value)
    assert overrides == {section: knobs}  # the caller's overrides are left as they were


def test_knobs_are_typed_fields_of_the_backend_sections():
    cfg = load_config("what_if", generation={"lengths": "pareto"}, trainer={"sync_s": 0.5})
    assert cfg.generation.lengths == "pareto" and cfg.generation.prefill_s == 0.2  # the preset's knob survives
    assert cfg.trainer.sync_s == 0.5
    ctrl = Controller.from_config(cfg)
    assert ctrl.generator.model.lengths == "pareto" and ctrl.policy.model.sync_s == 0.5
    # a knob of the other side, or of a simulated section on another backend, is an unknown key
    with pytest.raises(ValueError, match="sync_s=0.5"):
        load_config("what_if", generation={"sync_s": 0.5})
    with pytest.raises(ValueError, match="prefill_s=0.1"):
        load_config("quickstart", generation={"prefill_s": 0.1})


def test_a_non_simulated_controller_and_zero_steps_are_rejected():
    with pytest.raises(ValueError, match="both backends 'simulated'"):
        Simulation(Controller.from_config(load_config("quickstart", eval_every=None)))
    ctrl = Controller.from_config(load_config("what_if"))
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        run(ctrl, 0)


def test_simulation_continues_a_stepped_controller():
    ctrl = Controller.from_config(load_config("what_if", sampler=ASYNC))
    for _ in range(3):
        ctrl.tick()
    before = len(ctrl.trace)
    sim = run(ctrl, 5)
    assert len(sim.metrics) == 5 and sim.metrics.step.iloc[0] == ctrl.trainer_version - 5
    assert sim.trace.sim_time_s.iloc[:before].isna().all() and sim.trace.sim_time_s.iloc[before:].notna().all()
    ctrl.tick()  # still steppable by hand afterwards


def test_sweep_returns_one_row_per_setting():
    df = sweep(samplers=("in_order", "weight_fifo"), windows=(0, 1), steps=20,
               latencies={"preset": {}, "long tail": {"generation": {"lengths": "pareto"}}})
    assert len(df) == 8
    assert {"latency", "sampler", "window", "sim_steps_per_hour", "lag_mean", "drop_frac"} <= set(df.columns)
    sync = df[(df.sampler == "in_order") & (df.window == 0)]
    assert (sync.lag_max == 0).all()


def test_cli_simulate_writes_its_files(tmp_path, capsys):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), MPLBACKEND="Agg")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "simulate", "what_if", "--steps", "30", "--out", str(out),
         "--set", "sampler.name=weight_fifo", "--set", "generation.lengths=lognormal"],
        capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    for file in ("metrics.csv", "trace.csv", "summary.json", "simulation.png", "config.yaml"):
        assert (out / file).stat().st_size > 0, file
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["sampler"]["name"] == "weight_fifo"
    for key in ("sim_steps_per_hour", "gen_idle_frac", "train_idle_frac", "lag_mean", "lag_counts", "groups_dropped"):
        assert key in summary
    assert json.loads(done.stdout.splitlines()[-1])["steps"] == 30
    # the refusal through the CLI's entry point in this process (what ``python -m asyncrl.cli`` exits with): a second
    # interpreter importing torch cost ~5 s; the successful run above is the one in a subprocess
    code = cli.main(["simulate", "quickstart", "--steps", "3", "--out", str(tmp_path / "bad")])
    assert code == 2 and "both backends 'simulated'" in capsys.readouterr().err


def test_calibration_recovers_the_latency_model_and_predicts_another_sampler(tmp_path):
    simulate("what_if", 60, sampler=SYNC).write(tmp_path / "sync", plots=False)  # a "real" run with known knobs
    cal = calibrate(tmp_path / "sync")
    truth = load_config("what_if").trainer
    assert cal.training.train_s_per_token == pytest.approx(truth.train_s_per_token, rel=1e-6)
    assert cal.training.train_s_per_step == pytest.approx(truth.train_s_per_step, rel=1e-6)
    assert cal.training.sync_s == pytest.approx(truth.sync_s)
    measured = simulate("what_if", 60, sampler=ASYNC).summary()["sim_steps_per_hour"]
    assert cal.predict(ASYNC, 60)["sim_steps_per_hour"] == pytest.approx(measured, rel=0.05)


def test_calibration_from_a_real_synchronous_run():
    cfg = load_config("quickstart", sampler=SYNC, eval_every=None)
    ctrl = Controller.from_config(cfg)
    for _ in range(8):
        ctrl.tick()
    metrics = ctrl.metrics
    assert (metrics.train_time_s > 0).all() and (metrics.train_time_s < metrics.step_time_s).all()
    cal = calibrate(metrics, cfg)
    assert cal.generation.decode_s_per_token > 0 and cal.training.train_s_per_token > 0
    predicted = cal.predict(SYNC, 20)["sim_steps_per_hour"]  # the fit reproduces the run it was fitted on
    assert predicted == pytest.approx(3600 / metrics.step_time_s.iloc[3:].mean(), rel=0.05)
    with pytest.raises(ValueError, match="needs a synchronous run"):
        calibrate(metrics, load_config("quickstart", sampler=ASYNC))
    with pytest.raises(ValueError, match=r"lack \['train_time_s'\]"):
        calibrate(metrics.drop(columns="train_time_s"), cfg)


def overlapped(sampler, slowdown: float, steps: int = 150) -> dict:
    return simulate("what_if", steps, sampler=sampler, trainer={"overlap_slowdown": slowdown}).summary()


def test_overlap_slowdown_slows_both_stages_while_they_run_at_once():
    """At equal stage times, overlap can gain at most 2 / s when each stage runs s times slower beside the other:
    with s = 2 (one shared resource) asynchronous gains nothing. Synchronous never overlaps: unchanged."""
    sync = overlapped(SYNC, 1.0)["sim_steps_per_hour"]
    assert overlapped(SYNC, 2.0)["sim_steps_per_hour"] == sync
    assert overlapped(ASYNC, 1.0)["sim_steps_per_hour"] / sync == pytest.approx(1.93, rel=0.03)
    for slowdown in (1.5, 2.0):
        summary = overlapped(ASYNC, slowdown)
        assert summary["sim_steps_per_hour"] / sync == pytest.approx(2 / slowdown, rel=0.03)
        assert summary["train_busy_frac"] + summary["train_idle_frac"] == pytest.approx(1)
        assert summary["train_ticks_replanned"] == 0  # the stretch is booked to the tick it slowed


def test_calibration_takes_the_overlap_slowdown_from_a_separate_measurement(tmp_path):
    simulate("what_if", 40, sampler=SYNC).write(tmp_path / "sync", plots=False)
    cal = calibrate(tmp_path / "sync", overlap_slowdown=1.5)
    assert cal.training.overlap_slowdown == 1.5
    assert cal.predict(ASYNC, 60)["sim_steps_per_hour"] == pytest.approx(
        overlapped(ASYNC, 1.5, 60)["sim_steps_per_hour"], rel=0.05)
    with pytest.raises(ValueError, match="overlap_slowdown"):
        calibrate(tmp_path / "sync", overlap_slowdown=0.5)
    # the measurement: the real backends' calls alone and at once, outside the controller
    m = measure_overlap(load_config("quickstart", sampler=SYNC, eval_every=None, torch_threads=1), reps=2)
    assert m["gen_s"] > 0 and m["train_s"] > 0 and m["together_s"] > 0
    short, long = sorted((m["gen_s"], m["train_s"]))
    assert m["overlap_slowdown"] == pytest.approx(min(4.0, max(1.0, 1 + (m["together_s"] - long) / short)))


def test_the_wall_clock_makes_the_same_seconds_real_and_is_refused_by_a_simulation():
    ctrl = stepped({"clock": "wall", "prefill_s": 1.0})
    ctrl.rollout_tick()  # dispatches a batch; nothing is done at once
    assert ctrl.buffer.num_pending == ctrl.cfg.groups_per_step
    assert len(ctrl.generator.poll(timeout=None)) == ctrl.cfg.groups_per_step  # waits for them
    with pytest.raises(ValueError, match="generation.clock is 'wall'"):
        Simulation(ctrl)


def test_the_sweeps_window_labels_do_not_overlap():
    """Nearby points of a sweep (what_if.ipynb's long tail: in_order and weight_fifo at W=1, windowed and ready_first
    at W=2) each keep a readable label: one shared where they say the same, none drawn over another."""
    import pandas as pd
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from asyncrl.plots.simulation import plot_sweep

    rows = [("in_order", 0, 0.0, 1035.5, 0.0), ("in_order", 1, 0.975, 1936.6, 0.0), ("in_order", 2, 1.925, 2674.5, 0.0),
            ("weight_fifo", 1, 0.975, 1988.3, 0.0), ("weight_fifo", 2, 1.925, 2755.5, 0.0),
            ("windowed", 1, 0.925, 2843.2, 0.471), ("windowed", 2, 1.869, 3484.0, 0.188),
            ("ready_first", 1, 0.975, 2336.4, 0.0), ("ready_first", 2, 1.925, 3428.8, 0.0)]
    df = pd.DataFrame(rows, columns=["sampler", "window", "lag_mean", "sim_steps_per_hour", "drop_frac"])
    fig = plot_sweep(df, limit=3511.0)
    FigureCanvasAgg(fig).draw()
    (ax,) = fig.axes
    labels = [(t.get_text(), t.get_window_extent(fig.canvas.get_renderer())) for t in ax.texts]
    assert sorted(text for text, _ in labels) == sorted(
        ["W=0", "W=1", "W=2", "W=1, 47% dropped", "W=2, 19% dropped", "W=1", "W=2"])
    for i, (a, box_a) in enumerate(labels):
        for b, box_b in labels[i + 1:]:
            assert not box_a.overlaps(box_b), (a, b)
