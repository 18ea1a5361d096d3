"""Export and restore need nothing they do not use: ``asyncrl export`` reads a checkpoint's weights and tokenizer
only (a run whose rewards are ``module:function`` exports with no trust flag and the module gone; no tracking sink
is opened), a restore opens no tracking sink unless asked, and restoring a run built from Python objects says in
one line what to pass (never a fall back to the config's own task)."""

from __future__ import annotations

import os
import sys

import pandas as pd
import pytest
import torch

from asyncrl.checkpoint import CheckpointError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REWARDS = "def short(completions, **kwargs):\n    return [float(len(c) < 2) for c in completions]\n"


def _files(directory) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_export_of_a_run_with_module_rewards_imports_nothing_and_opens_no_sink(tmp_path, monkeypatch, capsys):
    from asyncrl import cli
    from asyncrl.controller import Controller

    code = tmp_path / "code"
    code.mkdir()
    (code / "my_rewards_mod.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(code))
    run, tb = tmp_path / "run", tmp_path / "tb"
    assert cli.main(["run", "quickstart", "--steps", "2", "--checkpoint-every", "2", "--out", str(run), "--quiet",
                     "--no-plot", "--set", "reward.funcs=[my_rewards_mod:short]", "--set", "groups_per_step=2",
                     "--tensorboard", str(tb)]) == 0
    saved = torch.load(run / "checkpoints" / "step-000002" / "tensors.pt", weights_only=True)["policy"]["model"]
    logs = _files(tb)
    assert logs
    (code / "my_rewards_mod.py").unlink()  # the reward code is gone: an export that imported it would fail
    sys.modules.pop("my_rewards_mod", None)
    capsys.readouterr()
    assert cli.main(["export", str(run), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    assert "step 2" in capsys.readouterr().err
    assert "my_rewards_mod" not in sys.modules and _files(tb) == logs  # nothing imported, no new TensorBoard file
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items() if k in state)
    assert torch.equal(state["model.layers.0.mlp.up_proj.weight"], saved["model.layers.0.mlp.up_proj.weight"])

    # A restore (trusted this time, the code back) opens no tracking sink unless asked.
    (code / "my_rewards_mod.py").write_text(REWARDS)
    with Controller.restore(run, trust_code=True) as ctrl:
        assert not ctrl.tracker.active and ctrl.cfg.tracking.tensorboard_dir is None
    assert _files(tb) == logs
    with Controller.restore(run, trust_code=True, tracking=True) as ctrl:
        assert ctrl.tracker.active
    assert len(_files(tb)) == len(logs) + 1


def _rows(n=12):
    return [{"prompt": f"{chr(97 + i % 5)}{chr(98 + i % 3)}=", "answer": chr(97 + i % 5)} for i in range(n)]


def first_letter(completions, answer, **kwargs):
    return [float(c[:1] == a) for c, a in zip(completions, answer)]


def test_restoring_a_run_built_from_objects_says_what_to_pass(tmp_path):
    from asyncrl import Controller
    from tests.faults import small_config

    cfg = small_config(groups_per_step=2)
    rows = pd.DataFrame(_rows())
    with Controller.from_config(cfg, train_dataset=rows, reward_funcs=[first_letter],
                                reward_weights=[2.0]) as ctrl:
        while ctrl.trainer_version < 2:
            ctrl.tick()
        saved = ctrl.save(tmp_path / "ckpt")
        while ctrl.trainer_version < 4:
            ctrl.tick()
        want = ctrl.metrics.loss.tolist()
    for kwargs, missing in (({"trust_code": True}, "train_dataset=, reward_funcs="),
                            ({"trust_code": True, "reward_funcs": [first_letter]}, "train_dataset="),
                            ({"train_dataset": rows}, "reward_funcs=")):  # functions alone: trust or pass them
        with pytest.raises(CheckpointError) as info:
            Controller.restore(saved, **kwargs)
        message = str(info.value)
        assert "\n" not in message and "copy_first" not in message, message
        assert (f"pass {missing} again" if "train" in missing else "or pass reward_funcs=") in message
    with Controller.restore(saved, train_dataset=rows, reward_funcs=[first_letter]) as again:
        assert again.cfg.reward.weights == [2.0] and again.task.name == "dataset"
        while again.trainer_version < 4:
            again.tick()
        assert again.metrics.loss.tolist() == want  # exact: the same data, functions and weights


def test_a_trusted_restore_asks_for_reward_functions_that_do_not_import(tmp_path):
    from asyncrl import Controller
    from tests.faults import small_config

    def local_reward(completions, **kwargs):  # a closure: config.yaml names it, nothing can import it
        return [float(len(c)) for c in completions]

    rows = _rows()
    with Controller.from_config(small_config(groups_per_step=2), train_dataset=rows,
                                reward_funcs=[local_reward]) as ctrl:
        ctrl.tick()
        saved = ctrl.save(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"built from Python objects \(train_dataset, reward_funcs\).*: pass "
                                              r"reward_funcs= again, as Controller.restore\(path, trust_code=True, "
                                              r"reward_funcs=\.\.\.\)$"):
        Controller.restore(saved, trust_code=True, train_dataset=rows)
    with Controller.restore(saved, train_dataset=rows, reward_funcs=[local_reward]) as again:
        assert again.trainer_version == ctrl.trainer_version
