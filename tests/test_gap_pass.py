"""The gap pass beside training (``asyncrl/gap_pass.py``): during a run a thread of the train pump's measures the
buffered groups under the weights that sampled them, so the train thread does not; the numbers are the ones the
train pump would compute itself, so a run's metrics equal hand ticks' bit for bit."""

from __future__ import annotations

import threading
import time
from collections import Counter

import torch

from asyncrl import Controller, load_config
from asyncrl.algorithms import make_train_batch, mark_versions
from asyncrl.backends.base import KeptVersions, capabilities

CPU = {"eval_every": None, "torch_threads": 1, "generation": {"max_new_tokens": 4}}
GAP = ["gap_tokens", "mismatch_kl", "is_mismatch_mean", "is_mismatch_max", "is_staleness_mean", "is_staleness_max"]


def count_calls(policy, slow_s: float = 0.0) -> Counter:
    """Count ``policy.logprobs_at`` calls by thread name; with ``slow_s`` each chunk's training takes that much
    longer (so the gap pass has time beside it on a busy machine)."""
    calls: Counter = Counter()
    logprobs_at, train = policy.logprobs_at, policy.train_microbatches

    def counted(batch, version, current):
        calls[threading.current_thread().name] += 1
        return logprobs_at(batch, version, current)

    def slowed(batch):
        time.sleep(slow_s)
        return train(batch)

    policy.logprobs_at = counted
    policy.train_microbatches = slowed
    return calls


def test_a_rows_logprobs_do_not_depend_on_the_rows_beside_it():
    # What lets whichever thread measured a group give the same number: the torch policy's forward is row-wise.
    ctrl = Controller.from_config(load_config("quickstart", **CPU, task={"name": "addition"}))
    for _ in range(3):
        ctrl.tick()
    groups = [slot.rollouts for slot in ctrl.buffer.ready_slots()]
    assert len(groups) >= 2
    batch = make_train_batch(groups, ctrl.cfg.loss, ctrl.tokenizer.pad_token_id)
    whole = ctrl.policy.logprobs(batch)
    alone = make_train_batch(groups[1:2], ctrl.cfg.loss, ctrl.tokenizer.pad_token_id)  # its own width
    G = ctrl.cfg.group_size
    assert torch.equal(ctrl.policy.logprobs(alone), whole[G:2 * G, :alone.input_ids.shape[1]])


def test_logprobs_at_reads_a_copy_with_the_swaps_numbers():
    ctrl = Controller.from_config(load_config("quickstart", **CPU))
    for _ in range(4):
        ctrl.tick()
    policy, T = ctrl.policy, ctrl.trainer_version
    assert capabilities(policy).concurrent_logprobs_at
    batch = make_train_batch([s.rollouts for s in ctrl.buffer.ready_slots()], ctrl.cfg.loss,
                             ctrl.tokenizer.pad_token_id)
    older = min(policy._kept)
    assert older < T
    before = [p.detach().clone() for p in policy.model.parameters()]
    on_copy = policy.logprobs_at(batch, older, T)
    assert torch.equal(on_copy, KeptVersions.logprobs_at(policy, batch, older, T))  # swapped in and back
    assert not torch.equal(on_copy, policy.logprobs(batch))  # other weights than the current ones
    assert all(torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))  # the trained ones untouched


def test_a_run_measures_beside_training_and_its_metrics_equal_hand_ticks():
    # in_order L=1 is gated: a run's schedule is the hand ticks' (the controller's invariant), so every column,
    # the gap's included, must be equal, whichever thread measured each group.
    cfg = load_config("quickstart", **CPU, loss={"gap_completions": None})
    by_hand = Controller.from_config(cfg)
    while by_hand.trainer_version < 8:
        by_hand.tick()
    running = Controller.from_config(cfg)
    calls = count_calls(running.policy, slow_s=0.02)
    running.run(8, progress=False)
    assert calls["asyncrl-gap-pass"] > 0, calls  # the thread measured groups beside training
    a, b = by_hand.metrics[GAP], running.metrics[GAP]
    assert a.equals(b), (a, b)
    assert (a.gap_tokens.iloc[1:] > 0).all()
    for thread in [t for t in threading.enumerate() if t.name == "asyncrl-gap-pass"]:
        thread.join(timeout=5)  # it ends with the run (within gap_pass.WAIT_S of its end)
        assert not thread.is_alive()


def test_close_waits_for_the_measurement_in_progress_before_closing_the_policy():
    """A process exits right after ``close()`` (the CLI): the gap pass's thread must not be inside the policy's
    forward then (a daemon thread in a torch op at exit aborts the process), nor measure with a closed policy."""
    ctrl = Controller.from_config(load_config("quickstart", **CPU, loss={"gap_completions": None}))
    logprobs_at, close = ctrl.policy.logprobs_at, ctrl.policy.close
    events: list[str] = []

    def slow(batch, version, current):  # a measurement the run's end finds in progress
        if threading.current_thread().name == "asyncrl-gap-pass":
            time.sleep(0.5)
            events.append("measured")
        return logprobs_at(batch, version, current)

    ctrl.policy.logprobs_at = slow
    ctrl.policy.close = lambda: (events.append("closed"), close())
    ctrl.run(4, progress=False)
    ctrl.close()
    assert "closed" in events and "measured" in events and events[-1] == "closed", events
    assert not [t for t in threading.enumerate() if t.name == "asyncrl-gap-pass" and t.is_alive()]


def test_hand_ticks_measure_on_their_own_thread():
    ctrl = Controller.from_config(load_config("quickstart", **CPU))
    calls = count_calls(ctrl.policy)
    for _ in range(4):
        ctrl.tick()
    assert set(calls) == {threading.current_thread().name} and sum(calls.values()) == 3  # steps 1-3 were stale


def test_mark_versions_passes_only_the_rows_not_known():
    ctrl = Controller.from_config(load_config("quickstart", **CPU, loss={"gap_completions": None}))
    for _ in range(3):
        ctrl.tick()
    groups = [s.rollouts for s in ctrl.buffer.ready_slots()][:2]
    batch = make_train_batch(groups, ctrl.cfg.loss, ctrl.tokenizer.pad_token_id)
    T = ctrl.trainer_version + 1  # every token stale
    seen = []

    def at(sub, version):
        seen.append(sub.input_ids.shape[0])
        return torch.full(sub.input_ids.shape, -1.5)

    first = groups[0].num_tokens
    known = [-0.25] * first + [None] * groups[1].num_tokens  # the first group measured ahead
    out = mark_versions(batch, groups, T, at, known)
    assert seen == [len(groups[1].completion_ids)]  # only the second group's rows
    held = out.version_logprobs[out.loss_mask > 0]
    assert (held[:first] == -0.25).all() and (held[first:] == -1.5).all()
