"""A reward model on a GPU run scores in the trainer's process under the device lock (issue 47): ``place(device,
lock)`` keeps it out of the reward workers and runs each forward of ``batch_size`` texts inside ``lock()``. On the
CPU the same path runs with a lock that records what it was asked (the GPU test, tests/gpu/test_reward_model_gpu.py,
gives it the real device lock on cuda); its scores are those of the worker path, bit for bit."""

from __future__ import annotations

import os
import pickle
from contextlib import contextmanager

import pytest

from asyncrl.rewards import RewardBatch, RewardFunctions, RewardRunner
from asyncrl.rewards.models import RewardModel
from tests import reward_functions as rf
from tests.test_reward_models import reward_model_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPTS = ["cab=", "x=", "longer prompt=", "q=", "ab=", "zz=", "m="]
COMPLETIONS = ["a", "bcd efg", "hello there", "", "c", "a much longer completion", "b"]


class RecordingLock:
    """A device lock that records each acquire and release (and what ran in between, through ``events``)."""

    def __init__(self):
        self.events: list = []

    @contextmanager
    def __call__(self):
        self.events.append("acquire")
        try:
            yield
        finally:
            self.events.append("release")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "my-rm"
    reward_model_dir(path)
    return str(path)


def _scored(funcs, workers=1):
    runner = RewardRunner(RewardFunctions(funcs), workers=workers, timeout_s=60)
    try:
        runner.submit(0, RewardBatch(PROMPTS, COMPLETIONS, [[1]] * len(PROMPTS)))
        (scored,) = runner.wait([0])
        return scored, runner.worker_pids
    finally:
        runner.close()


def test_a_placed_reward_model_runs_each_batch_of_batch_size_under_the_lock_it_is_given(rm_dir):
    lock = RecordingLock()
    placed = RewardModel(rm_dir, batch_size=3)
    placed.place("cpu", lock)
    assert placed.in_process and not RewardModel(rm_dir).in_process
    model, _ = placed.load()
    model.register_forward_pre_hook(lambda _, args, kwargs: lock.events.append(("forward",
                                                                                 len(kwargs["input_ids"]))),
                                    with_kwargs=True)
    scores = placed(prompts=PROMPTS, completions=COMPLETIONS)
    assert lock.events == ["acquire", ("forward", 3), "release"] * 2 + ["acquire", ("forward", 1), "release"]
    assert scores == RewardModel(rm_dir, batch_size=3)(prompts=PROMPTS, completions=COMPLETIONS)  # bit for bit


def test_a_placed_reward_model_scores_in_this_process_as_the_workers_score(rm_dir):
    """With workers, a placed model stays in this process (a worker would hold no lock of this process and load
    the model once more); the other functions still go to the workers; the scores are the worker path's."""
    lock = RecordingLock()
    placed = RewardModel(rm_dir, batch_size=2)
    placed.place("cpu", lock)
    here, pids = _scored([placed, rf.length])
    assert pids and os.getpid() not in pids  # rf.length went to a worker
    assert lock.events.count("acquire") == 4 and lock.events.count("release") == 4  # 7 texts, 2 a forward
    worker, _ = _scored([RewardModel(rm_dir, batch_size=2), rf.length])
    assert here.problem is None and here.bug is None, here
    assert here.parts == worker.parts and here.rewards == worker.rewards
    assert here.parts["my-rm"] != [0.0] * len(PROMPTS)
    # sent to another process, it arrives unplaced: the CPU, no lock of this process
    copy = pickle.loads(pickle.dumps(placed))
    assert (copy.device, copy.device_lock, copy.in_process) == ("cpu", None, False)


def test_a_gpu_run_places_its_reward_models_on_the_engine_in_its_process(rm_dir):
    from functools import partial

    from asyncrl import load_config
    from asyncrl.backends import place_reward_models, reward_model_device
    from asyncrl.backends.device_lock import exclusive_device

    assert reward_model_device(load_config("quickstart")) is None
    assert reward_model_device(load_config("grpo")) is None
    gpu = load_config("gpu_quickstart")
    assert reward_model_device(gpu) == "cuda"
    assert reward_model_device(load_config("quickstart", device="cuda")) == "cuda"  # the torch engines on the GPU
    functions = RewardFunctions([{"model": rm_dir, "batch_size": 4}, rf.length])
    assert place_reward_models(load_config("quickstart"), functions) == []
    assert not functions.funcs[0].in_process
    assert place_reward_models(gpu, functions) == ["my-rm"]  # nothing touches the GPU until the first call
    model = functions.funcs[0]
    assert model.device == "cuda" and model.in_process
    assert isinstance(model.device_lock, partial) and model.device_lock.func is exclusive_device
    assert model.device_lock.args == ("cuda", "RewardModel")
