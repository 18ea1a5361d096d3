"""One formula for useful training FLOP/s: the engines' ``train_flops`` and the controller's ``train_tflops`` are
``asyncrl.metrics.train_flops`` over ``train_time_s``, the same function benchmarks/bench_trl_gpu.py applies to
TRL's trainer, so the two sides' TFLOP/s compare like for like."""

from __future__ import annotations

import pytest

from asyncrl import Controller, load_config
from asyncrl.metrics import throughput, train_flops


def test_a_steps_train_tflops_is_train_flops_of_its_real_tokens_over_its_train_time():
    with Controller.from_config(load_config("quickstart", eval_every=None, groups_per_step=4)) as ctrl:
        ctrl.run(2, progress=False)
        m = ctrl.metrics
        params = ctrl.policy.num_parameters
    assert (m.train_tokens > m.completion_tokens).all()  # prompt and completion positions, no padding
    for row in m.itertuples():
        assert row.train_flops == pytest.approx(train_flops(params, row.train_tokens))
        assert row.train_tflops == pytest.approx(row.train_flops / row.train_time_s / 1e12)
        assert row.train_tflops == pytest.approx(throughput({"train_flops": row.train_flops},
                                                            row.train_time_s)["train_tflops"])


def test_train_flops_is_six_per_parameter_per_token():
    assert train_flops(494_032_768, 130_708) == 6 * 494_032_768 * 130_708
