"""Evaluations score through the reward runner, as training does (asyncrl/evaluation.py,
asyncrl/rewards/scoring.py's ``score_now``): a reward that raises, kills its worker with ``os._exit`` or sleeps past
``reward.timeout_s`` on the held-out prompts only is a ``fault`` row, retried within ``faults.reward_retries``, and
the prompt is left out and counted in ``eval_failed``; the run goes on, and the CLI ends normally."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import small_config

F = "tests.reward_functions:"
FRACTION = "0.006"  # copy_first's 512 strings: 3 held out ('ahh=', 'bff=', 'hca=')
HELD_OUT = 3
LEFT_OUT = "not retried: faults.reward_retries=1 re-scorings spent; the prompt is left out of the evaluation"
WHY = {"raises_on_eval": "reward function 'raises_on_eval' raised RuntimeError: the held-out verifier is down",
       "exits_on_eval": "died (exit code 3) while scoring with 'exits_on_eval'",
       "sleeps_on_eval": "'sleeps_on_eval' ran past reward.timeout_s=0.5 s"}


def config(func: str, workers: int, **overrides):
    return small_config(reward={"funcs": [F + "first_char", F + func], "workers": workers, "timeout_s": 0.5},
                        faults={"reward_retries": 1}, task={"name": "copy_first", "options": {"eval_fraction": 0.006}},
                        **overrides)


def eval_faults(ctrl):
    trace = ctrl.trace
    return trace[(trace.event == "fault") & trace.detail.str.startswith("evaluation of prompt 'eval/")]


@pytest.mark.parametrize("func,workers", [("raises_on_eval", 0), ("raises_on_eval", 1), ("exits_on_eval", 1),
                                          ("sleeps_on_eval", 2)])
def test_an_evaluation_whose_reward_fails_completes_counts_the_prompts_and_the_run_goes_on(func, workers,
                                                                                          monkeypatch):
    from asyncrl import Controller

    monkeypatch.setenv("ASYNCRL_EVAL_FRACTION", FRACTION)
    periodic = func == "raises_on_eval"  # a sleeper's calls cost a timeout, a dead worker a new one: fewer of them
    ctrl = Controller.from_config(config(func, workers, eval_every=1 if periodic else None))
    try:
        while ctrl.trainer_version < 1:
            ctrl.tick()
        ev = ctrl.evaluate()  # greedy
        assert ev["eval_failed"] == HELD_OUT and ev["n"] == 0 and ev["accuracy"] != ev["accuracy"]  # NaN: none left
        sampled = ctrl.evaluate(n=2, temperature=1.0, max_prompts=2)  # pass@n
        assert sampled["eval_failed"] == 2 and sampled["n"] == 0
        evaluations = ctrl.evaluations
        assert evaluations.eval_failed.tolist() == [HELD_OUT] * (len(evaluations) - 1) + [2]
        if periodic:  # the untrained model's, step 0's (eval_every): in the evaluations and the metrics row
            assert len(evaluations) == 4 and ctrl.metrics.eval_failed.tolist() == [HELD_OUT]
        faults = eval_faults(ctrl)
        assert faults.detail.str.contains(WHY[func], regex=False).all(), faults.detail.tolist()
        per_evaluation = 2 * HELD_OUT  # one retry each, then left out
        assert len(faults) == per_evaluation * (len(evaluations) - 1) + 2 * 2
        assert (faults.reason == "retried: scoring again (1 of 1 re-scorings)").sum() == len(faults) // 2
        assert (faults.reason == LEFT_OUT).sum() == len(faults) // 2
        while ctrl.trainer_version < 2:  # the run goes on: training prompts score as before
            ctrl.tick()
        assert not (ctrl.trace.event == "skip").any()
        assert ctrl.metrics.reward_mean.notna().all()
    finally:
        ctrl.close()


def test_an_evaluation_retries_and_keeps_a_prompt_that_scores_on_its_second_try(tmp_path, monkeypatch):
    """``fails_once`` raises the first time it sees a group: the held-out prompts count after their retry."""
    from asyncrl import Controller

    monkeypatch.setenv("ASYNCRL_REWARD_MARKERS", str(tmp_path))
    ctrl = Controller.from_config(small_config(reward={"funcs": [F + "fails_once"]}, faults={"reward_retries": 1},
                                               task={"name": "copy_first", "options": {"eval_fraction": 0.006}}))
    try:
        ev = ctrl.evaluate()
        assert ev["eval_failed"] == 0 and ev["n"] == HELD_OUT
        faults = eval_faults(ctrl)
        assert len(faults) == HELD_OUT and (faults.reason == "retried: scoring again (1 of 1 re-scorings)").all()
    finally:
        ctrl.close()


def test_a_tasks_own_reward_that_raises_on_evaluation_is_a_fault_not_a_traceback():
    """The toy tasks' own ``reward``/``is_correct`` go through the runner too."""
    from asyncrl import Controller
    from asyncrl.backends import build_backends
    from asyncrl.tasks import build_task

    class Flaky:  # copy_first, whose reward fails on its held-out prompts
        def __init__(self, task):
            self.task = task

        def __getattr__(self, name):
            return getattr(self.task, name)

        def reward(self, prompt, text):
            if prompt.id.startswith("eval/"):
                raise OSError("the grader's disk is gone")
            return self.task.reward(prompt, text)

    cfg = small_config(task={"name": "copy_first", "options": {"eval_fraction": 0.006}}, faults={"reward_retries": 0})
    policy, generator, tokenizer = build_backends(cfg)
    ctrl = Controller(cfg, Flaky(build_task(cfg.task)), policy, generator, tokenizer)
    try:
        ev = ctrl.evaluate()
        assert ev["eval_failed"] == HELD_OUT and ev["n"] == 0
        faults = eval_faults(ctrl)
        assert len(faults) == HELD_OUT and faults.detail.str.contains("OSError: the grader's disk is gone").all()
        assert (faults.reason == "not retried: faults.reward_retries=0 re-scorings spent; the prompt is left out of "
                                 "the evaluation").all()
    finally:
        ctrl.close()


# ("exits_on_eval", 0, ...): training scores inline, and an evaluation still gets a worker of its own for user code
@pytest.mark.parametrize("func,workers,every", [("raises_on_eval", 0, 1), ("exits_on_eval", 1, None),
                                                ("exits_on_eval", 0, None)])
def test_the_cli_ends_normally_when_evaluation_rewards_fail(func, workers, every, tmp_path):
    """The untrained model's evaluation, each step's (eval_every) and the final one; a dead worker: the final."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "ASYNCRL_EVAL_FRACTION": FRACTION, "HF_HUB_OFFLINE": "1",
           "MPLBACKEND": "Agg"}
    out = tmp_path / "run"
    sets = {"groups_per_step": 4, "group_size": 4, "eval_every": "null" if every is None else every, "torch_threads": 1,
            "task.options.eval_fraction": 0.006, "faults.reward_retries": 0, "reward.workers": workers,
            "reward.funcs": f"[{F}first_char, {F}{func}]"}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "run", "quickstart", "--out", str(out), "--steps", "1",
                           "--quiet", "--no-plot", *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 1
    assert summary["final_eval_eval_failed"] == HELD_OUT
    assert not (out / "control.sock").exists()


def test_an_evaluation_whose_every_call_kills_its_worker_gives_up_after_a_few_and_leaves_the_rest_out(monkeypatch):
    """Each call that kills its worker costs a new one: over ~100 held-out prompts that would hold the evaluation
    (and the train thread, with eval_every) for minutes. After scoring.EVAL_GIVE_UP such calls with none succeeding,
    the rest are left out at once, each with a fault row saying why, all counted in eval_failed."""
    from asyncrl import Controller
    from asyncrl.rewards.scoring import EVAL_GIVE_UP

    monkeypatch.setenv("ASYNCRL_EVAL_FRACTION", "0.2")
    ctrl = Controller.from_config(small_config(
        reward={"funcs": [F + "first_char", F + "exits_on_eval"], "workers": 0, "timeout_s": 0.5},
        faults={"reward_retries": 1}, task={"name": "copy_first", "options": {"eval_fraction": 0.2}}))
    try:
        held_out = len(ctrl.task.eval_prompts)
        ev = ctrl.evaluate()
        assert held_out > 3 * EVAL_GIVE_UP and ev["eval_failed"] == held_out and ev["n"] == 0
        faults = eval_faults(ctrl)
        died = faults.detail.str.contains("died (exit code 3)", regex=False)
        assert EVAL_GIVE_UP <= died.sum() < held_out  # not one dead worker a prompt
        given_up = faults[faults.detail.str.contains("evaluation given up", regex=False)]
        assert len(given_up) + died.sum() >= held_out and len(faults) <= 2 * held_out
        assert ctrl.evaluate(n=1)["eval_failed"] == held_out  # the next evaluation starts afresh, and ends the same
    finally:
        ctrl.close()
