"""benchmarks/bench_mfu_gpu.py without a GPU: its ``--cpu-dry-run`` runs the same sweep on a tiny model, so the
variants' parsing, each variant failing alone (a bad knob, a TransformerConfig field that does not exist, a fusion
flag that needs Apex), the forced micro-batch budget, the profile's regions and the run directory are checked
before the one GPU call that measures them (issue 48). Numbers mean nothing here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'asyncrl[megatron]')")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = pytest.importorskip("bench_mfu_gpu")


def test_a_variant_is_trainer_knobs_transformer_config_fields_and_a_forced_budget():
    assert bench.parse("default") == ({}, {}, None)
    assert bench.parse("compile=layers+micro_batch_tokens=65536+tc.bias_dropout_fusion=true") == (
        {"compile": "layers"}, {"bias_dropout_fusion": True}, 65536)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bench.parse("layers")


def test_kernels_are_charged_to_their_region_and_category():
    class Event:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent

    backward = Event("autograd::engine::evaluate_function: _ChunkedLogprobsBackward")
    assert bench.region(Event("aten::mm", Event("aten::linear", backward))) == "logprobs"
    assert bench.region(Event("aten::_foreach_mul_", Event("asyncrl.optimizer"))) == "optimizer"
    assert bench.region(Event("aten::mm", Event("autograd::engine::evaluate_function: MmBackward0"))) == "layers"
    assert bench.category("logprobs", "gemm") == "output-layer GEMMs"
    assert bench.category("layers", bench.kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT")) == "layer GEMMs"
    assert bench.category("layers", bench.kind("triton_tem_fused_flex_attention_0")) == "attention (flex)"
    flash = ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel"
             "<Flash_bwd_kernel_traits<64, cutlass::bfloat16_t>>")
    assert bench.category("layers", bench.kind(flash)) == "attention (varlen)"  # not a GEMM, though "cutlass"


def test_the_cpu_dry_run_writes_a_row_a_variant_each_failing_alone(tmp_path):
    variants = ["default", "compile=bogus", "tc.no_such_field=1", "tc.gradient_accumulation_fusion=true",
                "micro_batch_tokens=64"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_mfu_gpu.py"), "--cpu-dry-run",
                           "--out", str(tmp_path), *variants], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert rows.variant.tolist() == variants
    status = dict(zip(rows.variant, rows.status))
    assert status == {"default": "ok", "compile=bogus": "failed", "tc.no_such_field=1": "failed",
                      "tc.gradient_accumulation_fusion=true": "failed", "micro_batch_tokens=64": "ok"}
    errors = dict(zip(rows.variant, rows.error.fillna("")))
    assert "compile" in errors["compile=bogus"] and "no_such_field" in errors["tc.no_such_field=1"]
    assert "fused_weight_gradient_mlp_cuda" in errors["tc.gradient_accumulation_fusion=true"]
    assert all("\n" not in e for e in errors.values())
    ok = rows[rows.status == "ok"]
    assert (ok.step_s > 0).all() and (ok.train_tflops > 0).all() and (ok.train_tokens > 0).all()
    assert int(rows.set_index("variant").micro_batch_tokens["micro_batch_tokens=64"]) == 64  # forced
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["bench"] == "bench_mfu_gpu" and meta["results"]["dry_run"] is True
    assert meta["results"]["sequences"] == 32 and meta["results"]["target_mfu"] == 0.35
    cats = pd.read_csv(tmp_path / "categories.csv")
    assert set(cats.variant) == {"default", "micro_batch_tokens=64"}
    assert {"optimizer (grad scale, norm, Adam)", "logprob/softmax"} <= set(cats.category)
    assert (tmp_path / "kernels.csv").exists()


def test_a_variant_out_of_time_is_its_row_and_the_next_one_runs():
    """The deadline interrupts a variant mid-step (on a GPU: mid-compilation); its policy is released and the
    next variant builds and runs in the same process."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import bench_mfu_gpu as b; bench = b.Bench('trl', True);"
            "late, _ = b.run_variant(bench, 'default', 2, 4, 0.5, False);"
            "after, _ = b.run_variant(bench, 'default', 1, 1, 120, False);"
            "print('ROWS', late['status'], late['error'], '|', after['status'], after['step_s'] > 0)")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next((x for x in done.stdout.splitlines() if x.startswith("ROWS")), done.stdout[-2000:])
    assert line == "ROWS timeout VariantTimeout: out of time after 0 s | ok True"
