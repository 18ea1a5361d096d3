"""The command line as a user meets it, in a subprocess: help, configuration errors (one line each, exit status 2,
no traceback), experiment tracking flags, and the closing line that says whether the run learned.

Runs use the simulated backends where a model is not the point (seconds, not minutes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import Config, presets

ROOT = Path(__file__).resolve().parents[1]
SIMULATED = ["--set", "generation.backend=simulated", "--set", "trainer.backend=simulated"]


def asyncrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "MPLBACKEND": "Agg", **(env or {})})


def assert_clean_error(proc: subprocess.CompletedProcess) -> str:
    """Exit status 2, nothing on stdout, no traceback or pydantic boilerplate on stderr."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    for noise in ("Traceback", "errors.pydantic.dev", "input_value", "input_type", "[type="):
        assert noise not in proc.stderr, proc.stderr
    return proc.stderr


def test_help_lists_the_presets_and_explains_every_option():
    top = asyncrl("--help")
    assert top.returncode == 0
    assert "presets: " + ", ".join(presets()) in top.stdout  # every preset, whatever has been added since
    run = asyncrl("run", "--help").stdout
    assert re.search(r"--out DIR\s+directory for metrics\.csv", run)
    for option in ("--steps", "--set", "--tensorboard", "--wandb", "--quiet", "--no-plot"):
        assert re.search(rf"{option}[^\n]*\n?\s+\S", run), option
    assert "quickstart" in run.split("positional arguments:")[1].split("options:")[0]


def test_configuration_errors_are_one_line_each_with_key_value_and_what_is_allowed(tmp_path):
    out = tmp_path / "never"
    proc = asyncrl("run", "quickstart", "--steps", "2", "--out", str(out), "--set", "trainer.lr=-1",
                   "--set", "lr=3", "--set", "sampler.name=bogus", "--set", "loss.truncation=clip")
    lines = assert_clean_error(proc).splitlines()
    assert lines[0] == "asyncrl run: invalid configuration (4 errors):"
    assert sorted(lines[1:]) == sorted([
        "  trainer.lr = -1: should be greater than 0",
        "  sampler.name = 'bogus': should be one of 'windowed', 'weight_fifo', 'in_order', 'ready_first', 'custom'",
        "  loss.truncation = 'clip': should be 'none', 'tis', 'icepop' or 'seq-mask-tis'",
        f"  lr = 3: not a configuration key; the keys here are {', '.join(Config.model_fields)} "
        "(did you mean trainer.lr?)",
    ])
    assert not out.exists()  # nothing is written for a configuration that does not validate


def test_unknown_preset_and_malformed_set_are_clean_errors(tmp_path):
    proc = asyncrl("run", "quickstrat", "--steps", "2", "--out", str(tmp_path / "x"))
    assert "unknown preset 'quickstrat'" in assert_clean_error(proc) and "'quickstart'" in proc.stderr
    proc = asyncrl("run", "quickstart", "--steps", "2", "--out", str(tmp_path / "x"), "--set", "seed")
    assert assert_clean_error(proc).strip() == "asyncrl run: --set expects KEY=VALUE, got 'seed'"


def test_a_stale_sampler_without_importance_correction_reports_the_sampler_rule_not_the_truncation(tmp_path):
    proc = asyncrl("run", "quickstart", "--steps", "2", "--out", str(tmp_path / "x"),
                   "--set", "sampler.name=weight_fifo", "--set", "loss.importance_correction=none")
    (line,) = assert_clean_error(proc).splitlines()[1:]
    assert "may train on stale data" in line and "truncation" not in line


def test_a_custom_sampler_off_the_path_hints_at_pythonpath(tmp_path):
    args = ["run", "quickstart", "--steps", "1", "--out", str(tmp_path / "x"), "--quiet", "--no-plot", *SIMULATED,
            "--set", "sampler.name=custom", "--set", "sampler.target=my_sampler:NewestFirst"]
    env = {"PYTHONPATH": str(ROOT)}
    stderr = assert_clean_error(asyncrl(*args, env=env))
    assert "module 'my_sampler' does not import" in stderr and "is its folder on PYTHONPATH?" in stderr
    ok = asyncrl(*args, env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "notebooks")])})
    assert ok.returncode == 0, ok.stderr  # the hint is the fix


def test_wandb_without_the_package_is_a_configuration_error(tmp_path):
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    proc = asyncrl("run", "quickstart", "--steps", "1", "--out", str(tmp_path / "x"), "--wandb", "asyncrl-test")
    assert assert_clean_error(proc).splitlines()[1] == (
        "  tracking.wandb_project = 'asyncrl-test': needs the 'wandb' package, which is not installed "
        "(pip install wandb); or leave it unset"
    )


def test_tensorboard_flag_logs_every_metrics_row(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tb = tmp_path / "q", tmp_path / "tb"
    proc = asyncrl("run", "quickstart", "--steps", "3", "--out", str(out), "--quiet", "--no-plot", *SIMULATED,
                   "--tensorboard", str(tb))
    assert proc.returncode == 0, proc.stderr
    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = events.Scalars("reward_mean")
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    import pandas as pd

    rows = pd.read_csv(out / "metrics.csv")
    assert [e.step for e in scalars] == rows.step.tolist() == [0, 1, 2]
    assert [e.value for e in scalars] == pytest.approx(rows.reward_mean.tolist())


def test_the_closing_line_compares_the_untrained_model_the_trained_one_and_the_constant_answer(tmp_path):
    proc = asyncrl("run", "quickstart", "--steps", "4", "--out", str(tmp_path / "q"), "--quiet", *SIMULATED,
                   "--set", "eval_every=2")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"held-out greedy accuracy: \d\.\d\d untrained -> \d\.\d\d after 4 steps; "
                        r"the best constant answer scores 0\.20", last), last
    assert (tmp_path / "q" / "reward.png").stat().st_size > 1000


@pytest.mark.parametrize("cls, lacks", [("NoKnobs", "`Knobs`"), ("NoCandidates", "`_candidates(T)`"),
                                        ("NotASubclass", "does not subclass SamplerBase")])
def test_a_custom_sampler_mistake_is_one_line_before_anything_is_written(tmp_path, cls, lacks):
    out = tmp_path / "never"
    proc = asyncrl("run", "quickstart", "--steps", "2", "--out", str(out), *SIMULATED, "--set", "sampler.name=custom",
                   "--set", f"sampler.target=tests.custom_sampler_fixture:{cls}", env={"PYTHONPATH": str(ROOT)})
    (line,) = assert_clean_error(proc).splitlines()[1:]
    assert cls in line and lacks in line
    assert not out.exists()


def test_an_out_directory_that_cannot_be_written_is_refused_before_anything_is_built(tmp_path):
    # /proc takes no new entry, not even from root (whom permission bits let through)
    proc = asyncrl("run", "quickstart", "--steps", "2", "--out", "/proc/asyncrl-test-out")
    assert assert_clean_error(proc).strip() == (
        "asyncrl run: --out '/proc/asyncrl-test-out': cannot create files in '/proc' (No such file or directory)"
    )
    left = [p.name for p in tmp_path.iterdir()]
    proc = asyncrl("simulate", "what_if", "--steps", "2", "--out", "/proc/asyncrl-test-out")
    assert "cannot create files in '/proc'" in assert_clean_error(proc)
    assert [p.name for p in tmp_path.iterdir()] == left


def test_help_does_not_import_torch():
    """`asyncrl --help` lists the presets from the package's files: no torch (seconds) for a usage text."""
    code = ("import sys\nfrom asyncrl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'pandas', 'pydantic'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "presets: " + ", ".join(presets()) in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_a_resumed_run_says_where_it_resumes_and_its_bar_counts_from_there(tmp_path):
    out = tmp_path / "run"
    first = asyncrl("run", "quickstart", "--steps", "2", "--checkpoint-every", "2", "--out", str(out), "--quiet",
                    "--no-plot", *SIMULATED)
    assert first.returncode == 0, first.stderr
    resumed = asyncrl("run", "quickstart", "--steps", "4", "--resume", str(out), "--no-plot", *SIMULATED)
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stderr.splitlines()
    assert lines[0] == f"asyncrl run: resuming from checkpoint {out / 'checkpoints' / 'step-000002'} at step 2 of 4"
    bar = resumed.stderr.split("\r")
    assert re.search(r"\| 2/4 \[", bar[0]) and re.search(r"\| 4/4 \[", resumed.stderr)
    assert "0/2" not in resumed.stderr
