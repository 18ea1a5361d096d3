"""The ``grpo`` preset (TRL 1.16's GRPOConfig defaults), the toy-knob warning, one ``device`` for both engines, and
the wall-time limit (``max_time_s``, ``ctrl.run(max_time_s=)``, ``asyncrl run --max-time``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from asyncrl import Controller, load_config

ROOT = Path(__file__).resolve().parents[1]
WORDS = {"name": "dataset", "options": {"train": str(ROOT / "examples/word_problems.jsonl")}}


def test_grpo_preset_has_trl_grpoconfig_defaults():
    cfg = load_config("grpo")
    assert cfg.trainer.backend == "torch" and cfg.generation.backend == "torch"
    assert cfg.trainer.device == "cpu" and cfg.generation.device == "cpu"
    assert cfg.trainer.lr == 1e-6                      # learning_rate
    assert cfg.loss.kl == "none" and cfg.loss.kl_coef == 0.0  # beta 0
    assert cfg.loss.entropy_coef == 0.0
    assert cfg.generation.temperature == 1.0 and cfg.generation.top_p == 1.0 and cfg.generation.top_k == 0
    assert cfg.group_size == 8                         # num_generations
    assert cfg.generation.max_new_tokens == 512        # max_completion_length
    assert cfg.loss.loss_type == "dapo"
    assert cfg.loss.scale_rewards == "group"
    assert cfg.loss.importance_sampling_level == "token"
    assert cfg.loss.mask_truncated_completions is False
    assert cfg.loss.clip_eps_low == 0.2 and cfg.loss.clip_eps_high == 0.2  # epsilon, epsilon_high None
    assert cfg.trainer.lr_schedule == "linear" and cfg.trainer.warmup_steps == 0
    assert cfg.trainer.grad_clip == 1.0                # max_grad_norm
    assert cfg.trainer.betas == (0.9, 0.999) and cfg.trainer.weight_decay == 0.0
    assert cfg.model.max_position_embeddings >= 512    # the built-in model has room for 512 new tokens


def test_grpo_preset_takes_a_model_and_a_task_and_moves_to_the_gpu_with_one_set():
    cfg = load_config("grpo", model={"hf_path": "no/such/dir"}, task=WORDS)
    assert cfg.model.hf_path == "no/such/dir" and cfg.task.name == "dataset"
    gpu = load_config("grpo", device="cuda")
    assert gpu.trainer.device == "cuda" and gpu.generation.device == "cuda"
    own = load_config("grpo", device="cuda", trainer={"device": "cpu"})  # a section's own device wins
    assert own.trainer.device == "cpu" and own.generation.device == "cuda"
    engines = load_config("grpo", device="cuda", generation={"backend": "vllm"}, trainer={"backend": "megatron"})
    assert (engines.generation.backend, engines.generation.device) == ("vllm", "cuda")
    assert (engines.trainer.backend, engines.trainer.device) == ("megatron", "cuda")


def _warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "entropy_coef" in str(w.message)]


def test_a_toy_entropy_bonus_with_a_real_model_or_real_data_warns_in_one_line():
    for overrides, named in (({"model": {"hf_path": "no/such/dir"}}, "model.hf_path"),
                             ({"task": WORDS}, "a dataset task")):
        (msg,) = _warnings(lambda: load_config("quickstart", **overrides))
        assert "loss.entropy_coef 0.03" in msg and named in msg and "\n" not in msg
    assert _warnings(lambda: load_config("quickstart")) == []  # the toy task keeps its toy knob
    assert _warnings(lambda: load_config("grpo", task=WORDS, model={"hf_path": "x"})) == []
    assert _warnings(lambda: load_config("quickstart", task=WORDS, loss={"entropy_coef": 0.0})) == []
    assert _warnings(lambda: load_config("grpo", task=WORDS, loss={"entropy_coef": 0.01})) == []  # a choice
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)]
    (msg,) = _warnings(lambda: Controller.from_config(load_config("quickstart", eval_every=None), train_dataset=rows,
                                                      reward_funcs=[lambda completions, **kw: [0.0] * len(completions)]))
    assert "a dataset task" in msg


def test_run_stops_at_its_wall_time_limit_after_a_step_with_a_checkpoint(tmp_path):
    cfg = load_config("quickstart", eval_every=None, checkpoint_every=1000, checkpoint_dir=str(tmp_path / "ckpt"))
    ctrl = Controller.from_config(cfg)
    frame = ctrl.run(10_000, progress=False, max_time_s=1.0)
    assert frame.attrs["status"] == "time_limit" and ctrl.last_run.status == "time_limit"
    assert 1 <= ctrl.trainer_version < 10_000 and len(frame) == ctrl.trainer_version
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [f"step-{ctrl.trainer_version:06d}"]
    more = ctrl.run(2, progress=False)  # the controller goes on as after any run; no limit without one
    assert more.attrs["status"] == "completed" and len(more) == 2
    with pytest.raises(ValueError, match="max_time_s"):
        ctrl.run(1, max_time_s=0)


def test_max_time_s_in_the_config_limits_a_run():
    ctrl = Controller.from_config(load_config("quickstart", eval_every=None, max_time_s=0.5))
    frame = ctrl.run(10_000, progress=False)
    assert frame.attrs["status"] == "time_limit" and 1 <= len(frame) < 10_000


def test_cli_max_time_ends_with_status_time_limit_exit_0_and_a_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--steps", "100000", "--out",
                           str(out), "--max-time", "2", "--checkpoint-every", "100000", "--quiet", "--no-plot",
                           "--set", "eval_every=null"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "time_limit" and 1 <= summary["steps"] < 100000
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{summary['steps']:06d}"]
    bad = subprocess.run([sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--steps", "1", "--out",
                          str(tmp_path / "x"), "--max-time", "0"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--max-time" in bad.stderr


@pytest.mark.slow
def test_grpo_preset_trains_a_warm_started_chat_model_on_a_dataset_with_bounded_entropy(tmp_path):
    """benchmarks/bench_grpo_preset.py's setting, the preset as it is: 50 CPU steps from a warm-started tiny Qwen3
    with a chat template, a conversational dataset and a reward function: the entropy stays near where it started
    (the quickstart's bonus took a model like it to its maximum, ~5.6 nats, within about 10 steps)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_grpo_preset import rows, run, warm_start

    data = rows()
    warm_start(tmp_path / "qwen3", data, sft_steps=60, seed=0)
    steps, summary = run("grpo", tmp_path / "qwen3", data, steps=50, seed=0, overrides={})
    assert len(steps) == 50 and summary["lr"] == 1e-6 and summary["entropy_coef"] == 0
    assert summary["entropy_max"] < summary["entropy_first"] + 0.5 and summary["entropy_max"] < 2.0
    assert summary["heldout_accuracy_after"] >= summary["heldout_accuracy_before"] - 0.05
