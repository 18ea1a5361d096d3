"""benchmarks/bench_lora_gpu.py end to end on CPU (``--cpu-dry-run``: tiny Qwen2 / Qwen3 directories, the torch
engines): the same code as on a GPU writes one run directory whose meta.json names the preset in its command and
keeps the results the README reads (steps/s of both modes, async/sync, each sync kind's ms and bytes against the
full-weights sync, peak memory), with every timed sync and step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_lora_bench_dry_run_writes_one_run_directory(tmp_path):
    pytest.importorskip("peft")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "benchmarks/bench_lora_gpu.py", "--preset", "gpu_lora_8b", "--cpu-dry-run",
                           "--syncs", "2", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((out / "meta.json").read_text())
    assert "--preset gpu_lora_8b" in meta["command"] and "gpus" in meta["machine"]
    r = meta["results"]
    assert r["complete"] and r["preset"] == "gpu_lora_8b" and (r["steps"], r["warmup"]) == (2, 1)
    assert set(r["steps_per_s"]) == {"sync", "async"} and r["async_over_sync"] > 0
    assert set(r["sync_ms"]) == {"full_weights", "merged"} and r["sync_bytes"]["full_weights"] > 0
    assert r["sync_bytes_over_full_weights"] > 0 and r["sync_ms_over_full_weights"] > 0
    syncs = pd.read_csv(out / "syncs.csv")
    assert len(syncs) == 4 and (syncs.sync_bytes > 0).all()
    steps = pd.read_csv(out / "steps.csv")
    assert sorted(steps["mode"].unique()) == ["async", "sync"] and len(steps) == 4 and (steps.sync_bytes > 0).all()
    assert len(pd.read_csv(out / "rows.csv")) == 2
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, "benchmarks/bench_lora_gpu.py", "--cpu-dry-run", "--steps", "3"], cwd=ROOT,
                       env=env, check=True, capture_output=True, timeout=120)
