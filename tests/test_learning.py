"""Learning, not format: on the ``quickstart`` preset a tiny random model must reach held-out greedy accuracy of at
least twice the task's best constant answer (and at least 0.6) within a few CPU minutes, on 2 of 3 seeds. Run the
way a user runs it: ``Controller.run`` with both pumps overlapping, under the preset's own sampler (``in_order``
L=1) and under ``weight_fifo`` W=1, so generation runs a weight version ahead of training and the token-level
importance weight corrects it. (Synchronous GRPO is the same computation as ``examples/plain_grpo.py``, bit for bit:
tests/test_controller.py.)"""

from __future__ import annotations

import time

import pytest

from asyncrl import Controller, load_config
from asyncrl.tasks import build_task

STEPS = 300  # the preset reaches >= 0.8 by step ~250 on 13 of 13 measured seeds (see quickstart.yaml)
SEEDS = (0, 1, 2)


def _learns(seed: int, sampler: dict | None) -> tuple[bool, float, float, float]:
    overrides = {"seed": seed, "eval_every": None}
    if sampler is not None:
        overrides["sampler"] = sampler
    start = time.perf_counter()
    with Controller.from_config(load_config("quickstart", **overrides)) as ctrl:
        ctrl.run(STEPS, progress=False)
        accuracy = ctrl.evaluate()["accuracy"]
        bar = max(0.6, 2 * ctrl.task.constant_answer_accuracy)
        assert ctrl.metrics.lag_max.max() <= 1
    return accuracy >= bar, accuracy, bar, time.perf_counter() - start


def test_quickstart_task_is_judged_on_held_out_prompts():
    task = build_task(load_config("quickstart").task)
    assert not {p.text for p in task.train_prompts} & {p.text for p in task.eval_prompts}
    assert task.constant_answer_accuracy < 0.3


@pytest.mark.slow
@pytest.mark.parametrize("sampler", [None, {"name": "weight_fifo", "max_staleness_versions": 1}],
                         ids=["preset in_order L=1", "weight_fifo W=1"])
def test_quickstart_learns_a_prompt_dependent_answer(sampler):
    results = {}
    for seed in SEEDS:  # stop once the verdict on "2 of 3" is decided: the usual 2 passing seeds save a third run
        results[seed] = _learns(seed, sampler)
        passed = sum(ok for ok, *_ in results.values())
        if passed >= 2 or passed + len(SEEDS) - len(results) < 2:
            break
    report = {s: f"acc {a:.2f} (bar {b:.2f}) in {t:.0f}s" for s, (_, a, b, t) in results.items()}
    print(f"{sampler}: {report}")
    assert sum(ok for ok, *_ in results.values()) >= 2, report
