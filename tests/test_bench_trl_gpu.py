"""benchmarks/bench_trl_gpu.py's bookkeeping, without a GPU: each side's figures over its timed steps only, one
TFLOP/s formula on both sides, and two calls' sides merged into one run directory whose meta.json keeps the keys
the README's tables read (``machine.gpus``, ``results.steps``, ``results.ratios``) and every step's times."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = pytest.importorskip("bench_trl_gpu")

from asyncrl.metrics import train_flops  # noqa: E402


def steps(side, mode, secs, train, tokens, warmup=1, params=100):
    return [{"side": side, "mode": mode, "step": i, "timed": i >= warmup, "step_s": s, "gen_s": s - t, "train_s": t,
             "sync_s": 0.0, "completion_tokens": n - 5, "train_tokens": n, "train_flops": train_flops(params, n)}
            for i, (s, t, n) in enumerate(zip(secs, train, tokens))]


def test_a_sides_figures_are_over_its_timed_steps_and_tflops_is_train_flops_over_train_seconds():
    per = steps("trl", "sync", [9.0, 2.0, 4.0], [5.0, 1.0, 3.0], [1000, 200, 600])  # step 0: warm-up
    got = bench.summary(per, 100, None)
    assert got["steps"] == 2 and got["warmup"] == 1
    assert got["steps_per_s"] == pytest.approx(2 / 6.0) and got["train_s"] == pytest.approx(2.0)
    assert got["useful_train_tflops"] == pytest.approx(6 * 100 * 800 / 4.0 / 1e12)
    assert got["train_tokens_per_step"] == 400 and got["completion_tokens_per_step"] == 395


def saved(side, mode_rows, work, gpus):
    ran = {"bench": "bench_trl_gpu", "command": f"benchmarks/bench_trl_gpu.py --sides {side}",
           "date_utc": "2026-12-05T18:00:00+00:00", "commit": "abc1234", "dirty": False,
           "machine": {"gpus": gpus, "cores": 16}, "versions": {}, "work": work}
    return {"ran": ran, "result": mode_rows if side == "asyncrl" else mode_rows[0]}


def row(side, mode, steps_per_s, tflops, per_step):
    return {"side": side, "mode": mode, "steps": 2, "warmup": 1, "steps_per_s": steps_per_s, "gen_s": 1.0,
            "train_s": 1.0, "useful_train_tflops": tflops, "peak_allocated_gib": 1.0, "per_step": per_step,
            "per_step_s": [s["step_s"] for s in per_step]}


def test_two_calls_sides_merge_into_one_run_directory_without_running_anything(tmp_path, monkeypatch):
    work = {"steps": 2, "warmup": 1, "completion": 8, "dry_run": True}
    gpus = ["NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04"]
    trl = row("trl", "sync", 0.1, 100.0, steps("trl", "sync", [9, 10, 10], [3, 3, 3], [900, 900, 900]))
    ours = [row("asyncrl", "sync", 0.2, 220.0, steps("asyncrl", "sync", [6, 5, 5], [1, 1, 1], [900] * 3)),
            row("asyncrl", "async", 0.25, 210.0, steps("asyncrl", "async", [5, 4, 4], [1, 1, 1], [900] * 3))]
    (tmp_path / "trl.json").write_text(json.dumps(saved("trl", [trl], work, gpus)))
    (tmp_path / "asyncrl.json").write_text(json.dumps(saved("asyncrl", ours, work, gpus)))
    real_run = bench.subprocess.run

    def run(cmd, *a, **k):  # record.py asks git and lscpu; a side's child would be a bench_trl_gpu.py --side
        assert "--side" not in cmd, "a reused side must not run"
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["bench_trl_gpu.py", "--cpu-dry-run", "--steps", "2", "--warmup", "1",
                                      "--sides", "trl,asyncrl", "--reuse", "--model-dir", str(tmp_path / "none"),
                                      "--out", str(tmp_path)])
    assert bench.main() == 0
    assert not (tmp_path / "none").exists()  # nothing to run: no model directory built
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["machine"]["gpus"] == gpus and meta["commit"] == "abc1234"  # the GPU machine's, not this one's
    r = meta["results"]
    assert r["steps"] == 2 and r["warmup"] == 1
    assert r["ratios"] == pytest.approx({"asyncrl_sync_over_trl_steps_per_s": 2.0,
                                         "asyncrl_sync_over_trl_useful_train_tflops": 2.2,
                                         "asyncrl_async_over_trl_steps_per_s": 2.5,
                                         "asyncrl_async_over_trl_useful_train_tflops": 2.1})
    assert r["per_step"]["trl_sync"]["step_s"] == [9, 10, 10] and r["per_step"]["asyncrl_async"]["timed"] == [
        False, True, True]
    assert {s: v["reused"] for s, v in r["sides"].items()} == {"trl": True, "asyncrl": True}
    assert r["trl_per_step"]["per_step_s"] == [9, 10, 10]
    assert (tmp_path / "steps.csv").read_text().count("\n") == 1 + 9  # header + every step of the three runs


def test_a_saved_side_of_other_work_is_not_reused(tmp_path, monkeypatch, capsys):
    old = {"steps": 3, "warmup": 1, "completion": 8, "dry_run": True}
    (tmp_path / "trl.json").write_text(json.dumps(saved("trl", [row("trl", "sync", 0.1, 1.0, [])], old, [])))
    args = bench.argparse.Namespace(reuse=True, steps=8, warmup=3, completion=8, cpu_dry_run=True)
    assert bench.reusable("trl", args, tmp_path) is None
    assert "ran other work" in capsys.readouterr().out


def test_bad_sides_are_one_line_naming_what_is_allowed(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_trl_gpu.py", "--sides", "trl,verl"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--sides 'trl,verl': a comma-separated subset of trl,asyncrl" in capsys.readouterr().err
