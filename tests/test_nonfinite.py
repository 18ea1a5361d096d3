"""Non-finite numbers stop at the door: a reward whose weighted sum overflows is a ``fault`` like NaN (retried, then
the group skipped); a step whose loss or gradient norm is not finite never reaches the optimizer (its update
skipped, weights and optimizer state bit for bit as they were, a ``fault`` row naming its groups), and
``faults.max_nonfinite_steps`` such steps in a row stop the run with one line (asyncrl/faults.py)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import GRPOLoss
from asyncrl.rewards import RewardBatch, RewardFunctions, RewardRunner
from tests.faults import small_config

F = "tests.reward_functions:"


def tensors(state) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors(v)]
    return []


def snapshot(policy) -> list[torch.Tensor]:
    state = policy.state_dict()
    return [t.clone() for t in tensors({"model": state["model"], "optimizer": state["optimizer"]})]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def finite(policy) -> bool:
    return all(torch.isfinite(t).all() for t in policy.state_dict()["model"].values())


def step(ctrl, T: int) -> None:
    while ctrl.trainer_version < T:
        ctrl.tick()


# ------------------------------------------------------------------------------------------------ rewards
@pytest.mark.parametrize("workers", [0, 1])
def test_a_weighted_sum_that_overflows_is_a_problem_like_nan(workers):
    functions = RewardFunctions([F + "huge", F + "length"], [2.0, 1.0])  # 1e308 is finite; 2e308 is not
    runner = RewardRunner(functions, workers, 30.0)
    try:
        runner.submit(0, RewardBatch(["p", "p"], ["a", "bb"], [[1], [1, 2]]))
        (out,) = runner.wait([0])
        assert out.rewards is None and out.bug is None
        assert "the weighted sum of completion 0's rewards [1e+308, 1.0]" in out.problem
        assert "reward.weights [2.0, 1.0] is inf (non-finite)" in out.problem
    finally:
        runner.close()
    alone = RewardRunner(RewardFunctions([F + "huge"]), 0)  # 1e308 alone, weight 1: a finite total
    alone.submit(0, RewardBatch(["p"], ["a"], [[1]]))
    assert alone.wait([0])[0].rewards == [1e308]


def test_a_reward_whose_weighted_sum_overflows_is_a_fault_and_the_run_completes_with_finite_weights():
    from asyncrl import Controller

    ctrl = Controller.from_config(small_config(reward={"funcs": [F + "first_char", F + "huge_on_b"],
                                                       "weights": [1.0, 2.0]}))
    try:
        step(ctrl, 3)
        trace = ctrl.trace
        faults = trace[trace.event == "fault"]
        assert not faults.empty and faults.detail.str.contains("(non-finite)", regex=False).all()
        assert set(faults.reason) == {"retried: scoring again (1 of 2 re-scorings)",
                                      "retried: scoring again (2 of 2 re-scorings)",
                                      "not retried: faults.reward_retries=2 re-scorings spent"}
        skipped = set(trace[trace.event == "skip"].group_id)
        assert skipped == set(faults.group_id)  # every such group skipped, none trained
        assert not skipped & set(trace[trace.event == "select"].group_id)
        assert finite(ctrl.policy) and ctrl.metrics.loss.map(math.isfinite).all()
        assert ctrl.metrics.reward_mean.map(math.isfinite).all()
    finally:
        ctrl.close()


# ------------------------------------------------------------------------------------------------ the update
class Poisoned(GRPOLoss):
    """GRPO's loss, NaN while ``poisoned``."""

    poisoned = False

    def __call__(self, logprobs, batch, entropy=None):
        loss_sum, normaliser, contributions = super().__call__(logprobs, batch, entropy)
        return (loss_sum * math.nan if self.poisoned else loss_sum), normaliser, contributions


def test_a_non_finite_loss_skips_the_update_bit_for_bit_and_three_in_a_row_stop_the_run():
    from asyncrl import Controller
    from asyncrl.faults import NonFiniteSteps

    cfg = small_config()
    loss = Poisoned(cfg.loss)
    ctrl = Controller.from_config(cfg, loss=loss)
    try:
        step(ctrl, 1)
        before = snapshot(ctrl.policy)
        loss.poisoned = True
        for T in (2, 3):
            step(ctrl, T)
            assert same(snapshot(ctrl.policy), before)  # weights and AdamW state untouched
        trace = ctrl.trace
        faults = trace[trace.event == "fault"]
        assert len(faults) == 2 and faults.group_id.isna().all()
        for (_, fault), T in zip(faults.iterrows(), (1, 2)):
            groups = sorted(trace[(trace.event == "select") & (trace.trainer_version == T)].group_id)
            assert fault.detail == f"step {T}: loss nan, grad_norm nan (groups {', '.join(map(str, groups))})"
        assert faults.reason.tolist() == [
            f"not retried: the step's update is skipped, the weights kept ({k} of faults.max_nonfinite_steps=3 such "
            "steps in a row stop the run)" for k in (1, 2)]
        assert ctrl.metrics.loss.isna().tolist() == [False, True, True]
        with pytest.raises(NonFiniteSteps, match=r"^3 optimizer steps in a row \(1, 2, 3\) had a non-finite loss or "
                           r"gradient norm .*faults\.max_nonfinite_steps=3.*the weights are those before step 1$") as e:
            step(ctrl, 4)
        assert "\n" not in str(e.value) and ctrl.trainer_version == 4  # the third step is recorded, then the stop
        assert same(snapshot(ctrl.policy), before)
        last = ctrl.trace[ctrl.trace.event == "fault"].iloc[-1]
        assert "reach faults.max_nonfinite_steps=3; the run stops" in last.reason
        loss.poisoned = False  # stepping again after a fix trains, with a fresh count
        step(ctrl, 5)
        assert not same(snapshot(ctrl.policy), before) and finite(ctrl.policy)
    finally:
        ctrl.close()


def test_a_run_whose_rewards_overflow_the_advantages_stops_after_max_nonfinite_steps_with_its_weights():
    """1e308 for every completion (weight 1: a finite total) overflows GRPO's float32 advantages: NaN losses,
    never applied; ``faults.max_nonfinite_steps`` of them end a running run with the error."""
    from asyncrl import Controller
    from asyncrl.faults import NonFiniteSteps

    ctrl = Controller.from_config(small_config(reward={"funcs": [F + "huge"]}, faults={"max_nonfinite_steps": 2}))
    try:
        before = snapshot(ctrl.policy)
        with pytest.raises(NonFiniteSteps, match=r"faults\.max_nonfinite_steps=2"):
            ctrl.run(6, progress=False)
        assert ctrl.trainer_version == 2 and same(snapshot(ctrl.policy), before)
    finally:
        ctrl.close()


def test_the_torch_policy_skips_a_step_with_an_infinite_gradient():
    """A monkeypatched gradient: inf in one weight's gradient after the backward, the loss finite."""
    from asyncrl.backends import build_backends
    from asyncrl.data import GroupRollouts
    from asyncrl.algorithms import make_train_batch

    cfg = small_config()
    policy, _, _ = build_backends(cfg)
    group = GroupRollouts(0, [65, 66, 61], [[67], [68]], [[-1.0], [-2.0]], 0, 0, rewards=[1.0, 0.0])
    batch = make_train_batch([group], cfg.loss, 0)
    before = snapshot(policy)
    policy.begin_train_step()
    policy.train_microbatches(batch)
    next(p for p in policy.model.parameters() if p.grad is not None).grad[0].fill_(math.inf)
    out = policy.finish_train_step()
    assert out["grad_norm"] == math.inf and math.isfinite(out["loss"])
    assert same(snapshot(policy), before) and policy.steps_done == 0
    policy.begin_train_step()  # the next step is a real one
    policy.train_microbatches(batch)
    out = policy.finish_train_step()
    assert math.isfinite(out["grad_norm"]) and not same(snapshot(policy), before) and policy.steps_done == 1
