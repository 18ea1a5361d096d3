"""The simulator at cluster scale: generation replicas, data-parallel ranks, the weight transfer, drain and in-flight
weight updates, waves, the summary's GPU figures, and ``asyncrl simulate --sweep/--gpus``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from asyncrl import Controller, load_config
from asyncrl.simulate import ASYNC, SYNC, count_gpus, grid, simulate

# what_if with fewer slots per engine, so that one replica makes generation the slower stage
SLOW_GEN = {"concurrency": 2, "admission": "streaming", "weight_update": "inflight"}


def rate(steps: int = 30, sampler=ASYNC, **overrides) -> dict:
    return simulate("what_if", steps, sampler=sampler, **overrides).summary()


def spans(sim) -> pd.DataFrame:
    """Each committed group's stamp and the weights its replica held when it started and ended (the trace says)."""
    commits = sim.trace[sim.trace.event == "commit"]
    found = commits.reason.str.extract(r"generated with weights (\d+)\.\.(\d+)").astype(int)
    return pd.DataFrame({"stamp": commits.weight_version.astype(int).to_numpy(),
                         "start": found[0].to_numpy(), "end": found[1].to_numpy()})


def test_more_replicas_raise_throughput_while_generation_binds_and_stop_once_training_does():
    fast_train = {"train_s_per_token": 0.0001}  # ~0.6 s a step against ~11 s of generation on one replica
    gen_bound = [rate(generation={**SLOW_GEN, "replicas": k}, trainer=fast_train) for k in (1, 2, 4)]
    for fewer, more in zip(gen_bound, gen_bound[1:]):
        assert more["sim_steps_per_hour"] / fewer["sim_steps_per_hour"] > 1.7  # about 2x per doubling
        assert more["tokens_per_s"] > 1.7 * fewer["tokens_per_s"]
    assert all(s["gen_idle"] < 0.1 for s in gen_bound)  # every replica kept busy: generation is the bottleneck
    slow_train = {"train_s_per_token": 0.002}  # ~8.5 s a step: above generation's 5.5 s on two replicas
    train_bound = [rate(generation={**SLOW_GEN, "replicas": k}, trainer=slow_train) for k in (2, 4, 8)]
    steps_h = [s["sim_steps_per_hour"] for s in train_bound]
    assert max(steps_h) / min(steps_h) < 1.05  # more replicas buy nothing once training binds
    assert train_bound[0]["train_idle"] < 0.05
    assert train_bound[0]["gen_idle"] < train_bound[1]["gen_idle"] < train_bound[2]["gen_idle"]  # they wait
    # per GPU, the extra replicas only cost
    per_gpu = [s["tokens_per_s_per_gpu"] for s in train_bound]
    assert per_gpu[0] > per_gpu[1] > per_gpu[2]


def test_gpus_counts_what_the_config_uses_and_tokens_per_s_follow_the_trained_tokens():
    cfg = load_config("what_if", generation={"replicas": 3, "gpus_per_replica": 2}, trainer={"data_parallel": 2})
    assert count_gpus(cfg) == 8
    assert count_gpus(load_config("what_if")) == 2
    colocated = load_config("what_if", generation={"replicas": 2}, trainer={"data_parallel": 2, "colocated": True})
    assert count_gpus(colocated) == 2  # the trainer's ranks share the replicas' GPUs
    sim = simulate(cfg, 20, sampler=ASYNC)
    s = sim.summary()
    assert (s["gpus"], s["replicas"], s["data_parallel"]) == (8, 3, 2)
    assert s["tokens_per_s"] == pytest.approx(sim.metrics.tokens.sum() / s["sim_time_s"])
    assert s["tokens_per_s_per_gpu"] == pytest.approx(s["tokens_per_s"] / 8)
    assert s["gen_idle"] == s["gen_idle_frac"] and s["train_idle"] == s["train_idle_frac"]
    assert 0 <= s["gen_idle"] <= 1 and 0 <= s["train_idle"] <= 1
    with pytest.raises(ValueError, match=r"colocated with data_parallel 3.*2 GPU\(s\)"):
        load_config("what_if", generation={"replicas": 2}, trainer={"data_parallel": 3, "colocated": True})
    with pytest.raises(ValueError, match="needs placement 'ray'|Ray actor"):  # real engines still need actors
        load_config("quickstart", generation={"replicas": 2})


def test_data_parallel_divides_the_token_time_by_the_scaling_model():
    policy = Controller.from_config(load_config(
        "what_if", trainer={"data_parallel": 4, "scaling_efficiency": 0.9})).policy
    m = policy.model
    assert policy.train_seconds(1000, True) == pytest.approx(
        m.train_s_per_token * 1000 / (4 * 0.9 ** 2) + m.train_s_per_step)
    one, four = (rate(sampler=SYNC, trainer={"data_parallel": r, "scaling_efficiency": 0.9}) for r in (1, 4))
    token_s = one["train_busy_s_per_step"] - m.train_s_per_step - m.sync_s
    assert four["train_busy_s_per_step"] == pytest.approx(m.train_s_per_step + m.sync_s + token_s / 3.24, rel=0.02)
    with pytest.raises(ValueError, match="scaling_efficiency"):
        load_config("what_if", trainer={"scaling_efficiency": 1.5})


@pytest.mark.parametrize("fanout, transfers", [("sequential", 7), ("tree", 3)])
def test_a_weight_sync_is_latency_plus_bytes_over_the_link_per_replica(fanout, transfers):
    trainer = {"sync_s": 0.01, "weight_bytes": 4.8e8, "link_gb_per_s": 48.0, "sync_fanout": fanout}
    cfg = load_config("what_if", generation={"replicas": 7}, trainer=trainer)
    policy = Controller.from_config(cfg).policy
    hop = 0.01 + 4.8e8 / 48e9
    expected = [hop * (i + 1) for i in range(7)] if fanout == "sequential" else [hop * n for n in (1, 2, 2, 3, 3, 3, 3)]
    assert policy.sync_arrivals(7) == pytest.approx(expected)
    sim = simulate(cfg, 10, sampler=SYNC)
    assert sim.metrics.sync_time_s.to_numpy() == pytest.approx([transfers * hop] * 10)  # the trainer waits for all


def test_drain_keeps_one_version_per_group_and_inflight_lets_groups_span_two():
    long_groups = {"replicas": 2, "concurrency": 8, "lengths": "pareto", "pareto_alpha": 1.5, "length_mean": 40.0,
                   "load_s": 0.02}
    runs = {mode: simulate("what_if", 40, sampler=ASYNC, generation={**long_groups, "weight_update": mode})
            for mode in ("drain", "inflight")}
    drained, inflight = spans(runs["drain"]), spans(runs["inflight"])
    assert (drained.start == drained.end).all()
    assert (inflight.end > inflight.start).any()  # weights loaded under running groups
    for groups in (drained, inflight):
        assert (groups.stamp <= groups.start).all()  # never generated with weights older than its stamp
    # draining waits for the longest running group with its other slots empty: fewer steps an hour than loading in
    # flight (a replica decoding one tail counts as busy, so this shows in throughput, not in gen_idle)
    drain_h, inflight_h = (runs[m].summary()["sim_steps_per_hour"] for m in ("drain", "inflight"))
    assert drain_h < 0.95 * inflight_h
    # sampler staleness is judged by the stamp (the oldest version): windows hold in both modes
    assert all(run.summary()["lag_max"] <= 1 for run in runs.values())


def test_waves_return_together_and_streaming_returns_each_group_when_it_ends():
    def commit_times(admission: str) -> pd.Series:
        sim = simulate("what_if", 6, sampler=SYNC, generation={"admission": admission, "concurrency": None})
        trace = sim.trace
        commits = trace[trace.event == "commit"]
        return commits.groupby("weight_version").sim_time_s.nunique()

    assert (commit_times("wave") == 1).all()  # one LLM.generate-like wave a batch: all its groups at once
    assert (commit_times("streaming") > 1).all()  # each group when its longest completion ends


def test_replicas_take_groups_least_loaded_and_the_same_seed_gives_the_same_run(tmp_path):
    knobs = {"generation": {"replicas": 3, "weight_update": "drain", "load_s": 0.01}, "seed": 5}
    a, b = (simulate("what_if", 15, sampler=ASYNC, **knobs) for _ in range(2))
    a.write(tmp_path / "a", plots=False), b.write(tmp_path / "b", plots=False)
    for file in ("metrics.csv", "trace.csv", "summary.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    commits = a.trace[a.trace.event == "commit"]
    replicas = commits.reason.str.extract(r"on replica (\d)")[0].astype(int)
    assert sorted(replicas.unique()) == [0, 1, 2]
    assert replicas.value_counts().max() - replicas.value_counts().min() <= len(commits) * 0.2
    assert "replica" in a.ctrl.explain().columns
    one = simulate("what_if", 3, sampler=ASYNC)  # one engine: no replica named
    assert not one.trace[one.trace.event == "commit"].reason.str.contains("replica").any()


def test_grid_sweeps_a_key_and_splits_a_gpu_count():
    df = grid("what_if", 10, {"generation.replicas": [1, 2], "sampler.name": ["in_order", "weight_fifo"]})
    assert len(df) == 4 and df.best.sum() == 1
    assert df.loc[df.best, "tokens_per_s_per_gpu"].item() == df.tokens_per_s_per_gpu.max()
    split = grid("what_if", 10, gpus=4)
    assert list(zip(split["generation.replicas"], split["trainer.data_parallel"])) == [(1, 3), (2, 2), (3, 1)]
    assert (split.gpus == 4).all() and split.best.sum() == 1
    with pytest.raises(ValueError, match="no point of the sweep"):
        grid("what_if", 10, {"generation.replicas": [1, 2]}, gpus=9)
    with pytest.raises(ValueError, match="replicas"):
        grid("what_if", 10, {"generation.replicas": [0]})  # checked before anything runs


def test_cli_sweep_writes_sweep_csv_and_plot_with_the_best_split(tmp_path, capsys):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), MPLBACKEND="Agg")
    out = tmp_path / "split"
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "simulate", "what_if", "--steps", "8", "--out",
                           str(out), "--gpus", "3", "--sweep", "generation.concurrency=2,8"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(out / "sweep.csv")
    assert len(table) == 4 and (table.gpus == 3).all() and table.best.sum() == 1
    assert {"generation.replicas", "trainer.data_parallel", "generation.concurrency", "tokens_per_s",
            "tokens_per_s_per_gpu", "gen_idle", "train_idle"} <= set(table.columns)
    assert (out / "sweep.png").stat().st_size > 0
    best = json.loads(done.stdout.splitlines()[-1])
    assert best["tokens_per_s_per_gpu"] == pytest.approx(table.tokens_per_s_per_gpu.max())
    # bad input: exit 2 with the value and what is allowed, nothing written
    from asyncrl.cli import main

    args = ["simulate", "what_if", "--steps", "8", "--out", str(tmp_path / "bad")]
    assert main(args + ["--sweep", "generation.replicas=1,zero"]) == 2
    assert "replicas" in (err := capsys.readouterr().err) and "zero" in err
    assert main(args + ["--sweep", "generation.replicas"]) == 2
    assert re.search(r"--sweep expects KEY=V1,V2", capsys.readouterr().err)
    assert main(args + ["--gpus", "1"]) == 2 and "gpus must be an int >= 2" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_calibration_on_the_two_h200_runs_predicts_their_async_runs_within_15_percent():
    """benchmarks/calibrate_gpus.py on the committed two-H200 data of the balanced preset: fitted to the sync runs
    alone, the simulator predicts the async runs' steps/s and async / sync (benchmarks/README.md records the table)."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(root))
    try:
        from calibrate_gpus import Fit, compare
    finally:
        sys.path.remove(str(root))
    # where the data is kept: its first directory, or the record.py run directory it was converted to
    data = next(d for d in (root / "data" / "two_gpus_balanced_lr5e-4",
                            root / "data" / "bench_two_gpus" / "2026-11-30-balanced-g6-lr5e-4") if d.exists())
    fit = Fit(data, host_share=0.5, admission="wave")
    assert fit.layout == "two GPUs" and fit.d > 0  # a sync step holds driver work on neither GPU
    rows = {r["what"]: r for r in compare(fit, fit, 1.0, 60, "sync runs only")}
    assert abs(rows["sync"]["error"]) < 0.05  # what it was fitted on
    assert abs(rows["async"]["error"]) <= 0.15 and abs(rows["async/sync"]["error"]) <= 0.15
    # the other layout of the same workload: one GPU, both stages' GPU work taking turns, gains less from async
    one_gpu = fit.predict("one GPU", 1.0, 60)
    assert one_gpu["async/sync"] < rows["async/sync"]["predicted"]


def test_calibration_across_layouts_fits_the_overlap_on_one_and_carries_it_to_the_other(tmp_path):
    """The cross-layout path of calibrate_gpus.py on a one-GPU output shaped as bench_two_gpus.py writes it (the
    stage times of benchmarks/README.md's colocated gpu_gen_heavy row, typed in): the layout is read off the preset,
    kappa is fitted to its own async runs, and the same workload on two GPUs is predicted to gain more."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(root))
    try:
        from calibrate_gpus import Fit, compare
    finally:
        sys.path.remove(str(root))
    one = tmp_path / "one_gpu"
    one.mkdir()
    common = {"gen_busy_per_step_s": 2.27, "train_busy_per_step_s": 0.47, "push_wait_s_median": 0.018,
              "completion_tokens_per_step": 10300.0, "sync_load_s_median": 0.009}
    pd.DataFrame([{"run": "sync#0", "mode": "sync", "steps_per_s": 0.361, **common},
                  {"run": "async#0", "mode": "async", "steps_per_s": 0.389, **common}]).to_csv(one / "runs.csv")
    (one / "results.json").write_text(json.dumps({"preset": "gpu_gen_heavy", "overrides": {}}))
    fit = Fit(one, host_share=0.5, admission="wave")
    assert fit.layout == "one GPU" and fit.cfg.groups_per_step == 32
    kappa = fit.fit_kappa(30)
    assert 0 <= kappa <= 1
    own = {r["what"]: r for r in compare(fit, fit, kappa, 30, "fitted")}
    # 30 steps of long-tailed lengths: the sync rate it was fitted on comes back up to the draws' noise
    assert abs(own["sync"]["error"]) < 0.1 and abs(own["async"]["error"]) <= 0.15
    assert fit.predict("two GPUs", kappa, 30)["async/sync"] > own["async/sync"]["predicted"]
    assert fit.slowdown("one GPU", kappa) > fit.slowdown("two GPUs", kappa)


def test_an_inflight_load_gives_the_tokens_after_it_the_new_weights_logprob():
    from asyncrl.backends.simulated import DRIFT, LOG_HALF
    from asyncrl.data import GenerationRequest

    ctrl = Controller.from_config(load_config(
        "what_if", generation={"weight_update": "inflight", "lengths": "uniform", "prefill_s": 0.0,
                               "decode_s_per_token": 0.01, "load_s": 0.5}))
    gen = ctrl.generator
    gen.timed_updates, gen.clock.stepping = True, False
    gen.submit([GenerationRequest(1000, [1, 2], 2)])
    flight = gen._flights[1000]
    longest, start = max(flight.lengths), flight.start
    gen.clock.now = start + 0.01 * longest / 2  # half way through its decoding
    gen.load_weights({"progress": gen.progress}, 1)
    gen.receive([gen.clock.now], 0.0)  # arrives now, loads 0.5 s: the group pauses
    assert flight.finish == pytest.approx(start + 0.01 * longest + 0.5)
    gen.clock.now = flight.finish
    (group,) = gen.poll()
    assert (group.gen_start_version, group.gen_end_version) == (0, 1)
    steps = max(group.logprobs, key=len)
    assert steps[0] == pytest.approx(LOG_HALF) and steps[-1] == pytest.approx(LOG_HALF - DRIFT)
    assert steps == sorted(steps, reverse=True)  # old weights first, then the new ones
