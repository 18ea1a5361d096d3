"""``trainer.lr_schedule`` (constant / linear / cosine) with ``trainer.warmup_steps``: transformers' multipliers, in
the torch and Megatron engines, and a resumed run takes the uninterrupted run's lr at every step."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.backends.lr_schedule import lr_factor
from asyncrl.config import load_config
from tests.test_model_families import megatron_cpu  # noqa: F401 - the fixture (a world of one, gloo)


@pytest.mark.parametrize("schedule,name", [("constant", "constant_with_warmup"), ("linear", "linear"),
                                           ("cosine", "cosine")])
@pytest.mark.parametrize("warmup,total", [(0, 5), (2, 6), (3, 3)])
def test_the_multipliers_are_transformers_schedulers(schedule, name, warmup, total):
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total + 2):
        assert lr_factor(step, schedule, warmup, total) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12), step
        opt.step()
        ref.step()


def _lrs(frame) -> list[float]:
    return [float(x) for x in frame["lr"]]


def test_the_torch_engine_follows_the_schedule_and_a_resume_continues_it_exactly(tmp_path):
    from asyncrl.controller import Controller

    knobs = {"trainer": {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2, "lr_decay_steps": 6}}
    with Controller.from_config(load_config("quickstart", seed=2, **knobs)) as whole:
        whole.run(6, progress=False)
        lrs, weights = _lrs(whole.metrics), whole.policy.export_weights()
    expected = [0.0, 5e-4] + [1e-3 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    with Controller.from_config(load_config("quickstart", seed=2, **knobs)) as first:
        first.run(3, progress=False)
        first.save(tmp_path / "ckpt")
    with Controller.restore(tmp_path / "ckpt") as resumed:
        resumed.run(3, progress=False)
        assert _lrs(resumed.metrics) == lrs  # the restored history and the three steps after it
        after = resumed.policy.export_weights()
    assert all(torch.equal(after[k], v) for k, v in weights.items())


def test_a_decay_needs_its_horizon_and_asyncrl_run_gives_it_steps(tmp_path):
    import yaml

    from asyncrl import cli
    from asyncrl.controller import Controller

    with pytest.raises(ValueError, match="trainer.lr_decay_steps"):
        Controller.from_config(load_config("quickstart", trainer={"lr_schedule": "linear"}))
    with pytest.raises(ValueError, match="warmup_steps 5 > trainer.lr_decay_steps 4"):
        load_config("quickstart", trainer={"lr_schedule": "linear", "warmup_steps": 5, "lr_decay_steps": 4})
    out = tmp_path / "run"
    assert cli.main(["run", "quickstart", "--steps", "3", "--out", str(out), "--quiet", "--no-plot",
                     "--set", "trainer.lr_schedule=linear", "--set", "trainer.lr=0.001"]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["lr_decay_steps"] == 3
    import pandas as pd

    assert list(pd.read_csv(out / "metrics.csv")["lr"]) == pytest.approx([1e-3, 2e-3 / 3, 1e-3 / 3])


def test_the_megatron_engine_follows_the_schedule_across_a_state_dict(megatron_cpu):  # noqa: F811
    from dataclasses import replace

    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends.megatron import MegatronPolicy
    from asyncrl.config import MegatronTrainerConfig, ModelConfig
    from asyncrl.tokenizer import build_tokenizer
    from tests.test_megatron_backend import make_batch

    trainer = MegatronTrainerConfig(device="cpu", optimizer="torch", lr=1e-3, lr_schedule="linear", warmup_steps=1,
                                    lr_decay_steps=4)

    def policy():
        return MegatronPolicy(ModelConfig(), trainer, GRPOLoss(), 0, build_tokenizer())

    def step(p) -> float:
        batch = make_batch()
        lp = p.logprobs(batch)
        p.begin_train_step()
        p.train_microbatches(replace(batch, prev_logprobs=lp, gen_logprobs=lp))
        return p.finish_train_step()["lr"]

    a = policy()
    assert [step(a) for _ in range(2)] == pytest.approx([0.0, 1e-3])
    state = a.state_dict()
    b = policy()
    b.load_state_dict(state)
    assert [step(b) for _ in range(3)] == pytest.approx([2e-3 / 3, 1e-3 / 3, 0.0])
