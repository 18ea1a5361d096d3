"""Reward functions: the built-ins on standard and conversational completions, TRL's own functions unchanged,
weights and None, async functions, and the runner's outcomes inline and in worker processes (timeouts,
exceptions, NaN, a killed worker, a function from ``__main__``, bugs that stop the run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from contextlib import contextmanager

import pandas as pd
import pytest

from asyncrl.rewards import (MissingColumn, RewardBatch, RewardBug, RewardConfig, RewardFunctions, RewardRunner,
                             countdown, exact_match, format_tags, imported_functions, load_function, math_answer)
from asyncrl.rewards.functions import call
from asyncrl.tasks import build_task
from tests import reward_functions as rf

F = "tests.reward_functions:"


def chat(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


def batch(completions, prompts=None, ids=None, **columns):
    n = len(completions)
    return RewardBatch(prompts or ["p"] * n, list(completions), ids or [[1] * (i + 1) for i in range(n)],
                       {k: list(v) for k, v in columns.items()})


@contextmanager
def runner(funcs, workers=0, timeout_s=None, weights=None, task=None):
    functions = RewardFunctions.of_task(task) if task is not None else RewardFunctions(funcs, weights)
    r = RewardRunner(functions, workers, timeout_s)
    try:
        yield r
    finally:
        r.close()


def score(r, b, key=0):
    r.submit(key, b)
    (out,) = r.wait([key])
    return out


# ------------------------------------------------------------------------------------------------ built-ins
@pytest.mark.parametrize("form", [list, chat])
def test_math_answer_checks_with_math_verify_against_solution_or_answer(form):
    texts = [r"so the answer is \boxed{\frac{1}{3}}", r"\boxed{0.5}", "It is 72.", "no idea"]
    assert math_answer(completions=form(texts), solution=[r"\frac{1}{3}", "1/2", "72", "72"]) == [1.0, 1.0, 1.0, 0.0]
    assert math_answer(completions=form(texts[2:]), answer=["72", "72"]) == [1.0, 0.0]
    # a gold answer that does not parse: the function does not apply (TRL's accuracy_reward does the same)
    assert math_answer(completions=form(["x"]), solution=["not math at all"]) == [None]


@pytest.mark.parametrize("form", [list, chat])
def test_exact_match_format_tags_and_countdown_on_both_forms(form):
    assert exact_match(completions=form([" 7 ", "<think>hm</think><answer>7</answer>", "8"]), answer=["7"] * 3) == [
        1.0, 1.0, 0.0]
    good = "<think>try 3+5</think>\n<answer>(3+5)*2</answer>"
    assert format_tags(completions=form([good, "<answer>1</answer>", good + " extra"])) == [1.0, 0.0, 0.0]
    completions = form([good, "<answer>3*5+2</answer>", "<answer>(3+5)*2</answer>", "<answer>3+5+2</answer>",
                        "<answer>(3+5)*2*2</answer>", "<answer>2**3+5</answer>", "(3+5)*2",
                        "<answer>(3+5)/(2-2)</answer>", "<answer>(3+5)*2 = 16</answer>", "<answer>16/(5-3)</answer>"])
    nums = [[3, 5, 2]] * len(completions)
    target = [16, 17, 17, 16, 16, 13, 16, 16, 16, 8]
    #          ok  ok  wrong target, wrong value, 2 used twice, power, no tags, /0, "=" (TinyZero refuses), 16 not a num
    assert countdown(completions=completions, nums=nums, target=target) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                                                                             0.0, 0.0]


def test_a_builtin_without_its_column_names_the_function_and_the_column():
    with pytest.raises(MissingColumn, match=r"'math_answer' needs a 'solution' or 'answer' column.*\['level'\]"):
        math_answer(completions=["1"], level=[3])
    with pytest.raises(MissingColumn, match="'countdown' needs a 'target' column"):
        countdown(completions=["1"], nums=[[1]])
    functions = RewardFunctions(["countdown", F + "uses_column", "format_tags"])
    functions.check_columns(["nums", "target", "answer"])
    with pytest.raises(ValueError, match="'uses_column' needs a 'answer' column, and the data has none"):
        functions.check_columns(["nums", "target"])
    def declared(completions, **kwargs):
        return [0.0] * len(completions)

    declared.required_columns = [("gold", "reference")]
    with pytest.raises(ValueError, match="'declared' needs a 'gold' or 'reference' column"):
        RewardFunctions([declared]).check_columns(["answer"])
    RewardFunctions([declared]).check_columns(["reference"])
    with runner(["math_answer"]) as r:  # found while scoring: a bug, not retried
        assert "needs a 'solution' or 'answer' column" in score(r, batch(["1"], level=[1])).bug


def test_trl_reward_functions_run_unchanged():
    from trl.rewards import accuracy_reward, think_format_reward

    completions = chat([r"<think>1/3 of it</think> \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", "<think>x"])
    b = batch(completions, solution=[r"\frac{1}{3}"] * 3)
    expected = {"accuracy_reward": [1.0, 0.0, 0.0], "think_format_reward": [1.0, 0.0, 0.0]}
    for workers in (0, 1):
        with runner([accuracy_reward, think_format_reward], workers=workers, timeout_s=30) as r:
            out = score(r, b)
        assert out.problem is None and out.bug is None
        assert out.parts == expected and out.rewards == [2.0, 0.0, 0.0]
    assert RewardConfig(funcs=["trl.rewards:accuracy_reward"]).functions().names == ["accuracy_reward"]


def test_weights_and_none_sum_over_the_functions_that_apply():
    b = batch(["ab", "abc", "abcd"], ids=[[1, 2], [1, 2, 3], [1]])
    with runner([F + "length", F + "only_even", F + "never"], weights=[0.5, 2.0, 3.0]) as r:
        out = score(r, b)
    assert out.parts == {"length": [2.0, 3.0, 4.0], "only_even": [1.0, None, None], "never": [None] * 3}
    assert out.rewards == [0.5 * 2 + 2.0, 0.5 * 3, 0.5 * 4]
    with runner([F + "never"]) as r:  # applies to nothing: 0, as TRL's nansum gives
        assert score(r, b).rewards == [0.0, 0.0, 0.0]


def test_async_functions_inline_in_workers_and_under_a_running_event_loop():
    import asyncio

    b = batch(["a", "bb"])
    for workers in (0, 1):
        with runner([F + "async_length"], workers=workers, timeout_s=30) as r:
            assert score(r, b).rewards == [1.0, 2.0]

    async def in_a_notebook():  # ipykernel runs cells inside an event loop: asyncio.run would refuse
        return call(rf.async_length, "async_length", b)

    assert asyncio.run(in_a_notebook()) == [1.0, 2.0]


def test_a_function_without_kwargs_gets_only_what_it_names():
    with runner([F + "named_params"]) as r:
        assert score(r, batch(["7", "8"], answer=["7", "7"], extra=[1, 2])).rewards == [1.0, 0.0]


# ------------------------------------------------------------------------------------------------ the runner
def test_workers_0_1_2_give_the_same_numbers():
    groups = [batch([f"<think>{i}</think><answer>{i * j}</answer>" for j in range(4)], answer=[str(i)] * 4,
                    solution=[str(i)] * 4) for i in range(6)]
    funcs = ["exact_match", "format_tags", "math_answer", F + "length"]
    results = []
    for workers in (0, 1, 2):
        with runner(funcs, workers=workers, timeout_s=30, weights=[1, 0.25, 2, 0.01]) as r:
            for key, b in enumerate(groups):
                r.submit(key, b)
            results.append([(s.rewards, s.parts) for s in r.wait(list(range(len(groups))))])
    assert results[0] == results[1] == results[2]
    assert results[0][1][1]["exact_match"] == [0.0, 1.0, 0.0, 0.0]


def test_groups_score_at_once_in_workers():
    import os

    with runner([F + "pid_after_a_while"], workers=2, timeout_s=30) as r:
        assert r.started()
        for key in range(2):  # the first keeps its worker busy: the second goes to the other one
            r.submit(key, batch(["a"]))
        pids = {s.rewards[0] for s in r.wait([0, 1])}
        assert pids == set(map(float, r.worker_pids)) and len(pids) == 2 and os.getpid() not in pids


def test_a_timeout_stops_the_call_and_replaces_the_worker(tmp_path):
    with runner([F + "slow_once"], workers=1, timeout_s=0.5) as r:
        assert r.started()
        first = r.worker_pids
        b = batch(["a"], marker=[str(tmp_path / "hung")])
        out = score(r, b)
        assert "'slow_once' ran past reward.timeout_s=0.5 s" in out.problem and "replaced" in out.problem
        assert out.rewards is None and out.bug is None
        retry = score(r, b, key=1)
        assert retry.problem is None and retry.rewards[0] not in first and r.worker_pids != first
    with runner([F + "wait_10ms"], workers=0, timeout_s=0.001) as r:  # inline: judged when it returns
        assert "past reward.timeout_s=0.001" in score(r, batch(["a"])).problem


def test_exceptions_nan_and_a_killed_worker_are_problems_and_the_worker_is_replaced(tmp_path):
    for workers in (0, 1):
        with runner([F + "raises"], workers=workers, timeout_s=30) as r:
            assert score(r, batch(["a"])).problem == ("reward function 'raises' raised ValueError: the verifier is "
                                                      "down")
        with runner([F + "nan"], workers=workers, timeout_s=30) as r:
            assert "returned nan for completion 0 (non-finite)" in score(r, batch(["a"])).problem
    with runner([F + "dies_once", F + "length"], workers=1, timeout_s=30) as r:
        marker = [str(tmp_path / "died")]
        out = score(r, batch(["a"], marker=marker))
        assert "died (killed by SIGKILL) while scoring with 'dies_once'; it was replaced" in out.problem
        again = score(r, batch(["abc"], marker=marker), key=1)  # the replacement scores the retry
        assert again.problem is None and again.rewards == [4.0]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_wrong_length_or_a_non_number_is_a_bug_naming_the_function(workers):
    cases = {"short": "'short' returned 1 rewards for 2 completions",
             "words": "'words' returned 'yes' (str) for completion 0; a reward must be a real number or None",
             "scalar": "'scalar' returned 1.0 (float); it must return a list of 2 rewards"}
    with runner([F + name for name in cases], workers=workers, timeout_s=30) as r:
        out = score(r, batch(["a", "b"]))
    assert out.rewards is None and out.problem is None
    for text in cases.values():
        assert text in out.bug
    assert "\n" not in out.bug


def test_a_notebook_function_is_sent_with_cloudpickle(tmp_path):
    """A function defined in ``__main__`` with no file (a notebook cell, ``python -c``) runs in the workers; one
    that cannot be pickled runs in-process with a one-line warning."""
    script = textwrap.dedent("""
        import os, threading, warnings
        from asyncrl.rewards import RewardBatch, RewardFunctions, RewardRunner
        LOCK = threading.Lock()
        def in_cell(completions, **kw):
            return [float(os.getpid()) + len(c) for c in completions]
        def holds_a_lock(completions, lock=LOCK, **kw):
            return [1.0] * len(completions)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = RewardRunner(RewardFunctions([in_cell, holds_a_lock]), workers=1, timeout_s=30)
        r.submit(0, RewardBatch(["p"], ["ab"], [[1, 2]]))
        (out,) = r.wait([0])
        r.close()
        print(out.parts["in_cell"][0] - 2 != os.getpid(), out.parts["holds_a_lock"], [str(w.message) for w in caught])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True [1.0] [\"reward function 'holds_a_lock' cannot be sent to a worker "
                                  "process (TypeError: cannot pickle '_thread.lock' object); it runs in this process")


def test_workers_see_the_callers_sys_path(tmp_path, monkeypatch):
    (tmp_path / "my_verifier.py").write_text("def score(completions, **kw):\n    return [3.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # on sys.path only, not in PYTHONPATH
    with runner(["my_verifier:score"], workers=1, timeout_s=30) as r:
        assert score(r, batch(["a"])).rewards == [3.0]


def test_cancel_and_close_leave_nothing_waiting():
    with runner([F + "slow"], workers=1, timeout_s=60) as r:
        r.submit(0, batch(["a"]))
        r.submit(1, batch(["a"]))
        r.cancel(0)
        assert r.pending == 1 and r.poll() == []
    # closed with a call running: the call ends (as a bug naming the close), nothing is left to wait on
    assert "closed" in r.wait([1])[0].bug and r.pending == 0


def test_a_toy_tasks_reward_is_wrapped_bit_for_bit():
    task = build_task({"name": "copy_digit", "options": {"partial_credit": 0.25}})
    prompt = task.train_prompts[3]
    texts = ["3", " 3x", "4", "x", "3<eos>9", ""]
    for workers in (0, 1):
        with runner([], workers=workers, timeout_s=30, task=task) as r:
            out = score(r, RewardBatch([prompt.text] * 6, texts, [[1]] * 6, {}, source=prompt))
        assert out.rewards == [task.reward(prompt, t) for t in texts] == [1.0, 1.0, 0.25, 0.0, 1.0, 0.0]
        assert all(type(v) is float for v in out.rewards)


# ------------------------------------------------------------------------------------------------ loading
def test_loading_names_what_is_wrong_in_one_line():
    cases = {
        "nosuch": "unknown reward function 'nosuch': the built-ins are ['countdown', 'exact_match', 'format_tags', "
                  "'math_answer']",
        "no_such_module_xyz:f": "module 'no_such_module_xyz' does not import (ModuleNotFoundError",
        F + "missing": "module 'tests.reward_functions' has no function 'missing' (found nothing)",
        "os:sep": "has no function 'sep' (found a str)",
        F + "old_signature": "has the signature old_signature(prompt, completion_text): it takes no completions= keyword",
        "a:b:c": "must look like 'package.module:function'",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError) as err:
            load_function(spec)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert load_function("countdown") is countdown and load_function(rf.length) is rf.length


def test_reward_config_checks_when_it_loads_and_writes_names_back():
    cfg = RewardConfig(funcs=["math_answer", F + "length", rf.only_even], weights=[1, 0.5, 2], workers=2,
                       timeout_s=5, accuracy="math_answer")
    assert cfg.functions().names == ["math_answer", "length", "only_even"]
    assert cfg.model_dump(mode="json")["funcs"] == ["math_answer", F + "length", F + "only_even"]
    assert RewardConfig.model_validate(cfg.model_dump(mode="json")).functions().funcs[2] is rf.only_even
    bad = {"funcs": ["math_answer", "format_tags"], "weights": [1.0]}
    with pytest.raises(ValueError, match=r"reward.weights has 1 values for 2 functions \['math_answer', 'format_tags'"):
        RewardConfig(**bad)
    with pytest.raises(ValueError, match="reward functions named twice: \\['length'\\]"):
        RewardConfig(funcs=[F + "length", rf.length])
    with pytest.raises(ValueError, match="reward.accuracy 'acc' is not one of the reward functions"):
        RewardConfig(funcs=["countdown"], accuracy="acc")
    with pytest.raises(ValueError, match="workers"):
        RewardConfig(workers=-1)
    assert imported_functions({"reward": {"funcs": ["countdown", F + "length"]}}) == [F + "length"]
    assert RewardConfig().functions(build_task("copy_digit")).is_task


def test_a_reward_bug_raised_by_call_is_a_type_error():
    with pytest.raises(RewardBug, match="'short' returned 1 rewards for 2 completions") as err:
        call(rf.short, "short", batch(["a", "b"]))
    assert isinstance(err.value, TypeError)


# ------------------------------------------------------------------------------------------------ in a run
def small(**reward):
    from tests.faults import small_config

    return small_config(reward=reward)


def stepped(cfg, steps=2, **kwargs):
    from asyncrl import Controller

    ctrl = Controller.from_config(cfg, **kwargs)
    while ctrl.trainer_version < steps:
        ctrl.tick()
    return ctrl


def test_a_run_is_scored_by_its_functions_with_their_weights_and_metrics():
    ctrl = stepped(small(funcs=["exact_match", F + "length"], weights=[1.0, 0.5]))
    try:
        rows = ctrl.completions
        assert not rows.empty and {"reward/exact_match", "reward/length"} <= set(rows.columns)
        assert rows.reward.tolist() == (rows["reward/exact_match"] + 0.5 * rows["reward/length"]).tolist()
        answers = rows.prompt.str[0]  # copy_first: "cab=" -> "c" (the toy prompts carry an "answer" column)
        assert rows["reward/exact_match"].tolist() == (rows.completion.str.strip() == answers).astype(float).tolist()
        metrics = ctrl.metrics
        assert {"reward/exact_match", "reward/length", "reward_time_s"} <= set(metrics.columns)
        assert (metrics["reward/length"] >= 0).all() and (metrics.reward_time_s >= 0).all()
    finally:
        ctrl.close()


def test_stepped_runs_are_the_same_with_any_number_of_workers():
    runs = []
    for workers in (0, 2):
        ctrl = stepped(small(funcs=[F + "first_char", "format_tags"], workers=workers, timeout_s=30), steps=3)
        try:
            timing = [c for c in ctrl.metrics if c.endswith(("_s", "tflops", "mfu"))]
            runs.append((ctrl.trace.drop(columns="seq"), ctrl.metrics.drop(columns=timing), ctrl.completions))
        finally:
            ctrl.close()
    for a, b in zip(*runs):
        pd.testing.assert_frame_equal(a, b)


def test_rewards_run_off_the_pumps_thread_and_a_threaded_run_loses_nothing():
    import os

    from asyncrl import Controller

    ctrl = Controller.from_config(small(funcs=[F + "pid", F + "first_char"], workers=2, timeout_s=30))
    try:
        ctrl.run(4, progress=False)
        pids = set(ctrl.completions["reward/pid"])
        assert pids and os.getpid() not in pids  # scored in the worker processes
        trace = ctrl.trace
        dispatched = set(trace[trace.event == "dispatch"].group_id)
        ended = trace[trace.event.isin(["select", "evict", "abort", "skip"])].group_id
        assert ended.is_unique and set(ended) | {slot.group_id for slot in ctrl.buffer} == dispatched
        assert ctrl.trainer_version == 4 and not (trace.event == "fault").any()
    finally:
        ctrl.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failed_call_is_a_fault_and_is_scored_again(workers, tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_REWARD_MARKERS", str(tmp_path))
    funcs = [F + "fails_once"] + ([F + "killed_once", F + "hangs_once"] if workers else [])
    ctrl = stepped(small(funcs=funcs, workers=workers, timeout_s=1.0), steps=1)
    try:
        faults = ctrl.trace[ctrl.trace.event == "fault"]
        assert not faults.empty and (faults.reason == "retried: scoring again (1 of 2 re-scorings)").all()
        assert faults.detail.str.contains("reward function 'fails_once' raised RuntimeError: the verifier hiccuped",
                                          regex=False).all()
        if workers:
            assert faults.detail.str.contains("died (killed by SIGKILL) while scoring with 'killed_once'", regex=False).all()
            assert faults.detail.str.contains("'hangs_once' ran past reward.timeout_s=1 s", regex=False).all()
        assert not (ctrl.trace.event == "skip").any()  # every group scored on its second try
        committed = ctrl.trace[ctrl.trace.event == "commit"].group_id
        assert set(faults.group_id) <= set(committed)
    finally:
        ctrl.close()


def test_a_reward_bug_stops_the_run_with_one_line_and_is_not_retried():
    from asyncrl import Controller
    from asyncrl.faults import RewardTypeError

    ctrl = Controller.from_config(small(funcs=[F + "short"]))
    try:
        with pytest.raises(RewardTypeError, match="reward function 'short' returned 1 rewards for 4 completions"):
            ctrl.run(1, progress=False)
        faults = ctrl.trace[ctrl.trace.event == "fault"]
        assert set(faults.reason) == {"not retried: a bug in the reward; the run stops"}
        assert len(ctrl.trace[ctrl.trace.event == "skip"]) == len(faults)  # accounted: skipped, not lost
    finally:
        ctrl.close()


def test_a_column_the_data_lacks_is_found_before_the_run():
    from asyncrl import Controller

    with pytest.raises(ValueError, match="no column 'nums', which reward function countdown needs"):
        Controller.from_config(small(funcs=["countdown"]))


def test_function_objects_are_named_in_the_config_and_a_restore_imports_only_what_it_is_told(tmp_path):
    from asyncrl import Controller
    from asyncrl.checkpoint import CheckpointError

    ctrl = stepped(small(), steps=1, reward_funcs=[rf.first_char])
    try:
        assert ctrl.cfg.reward.model_dump(mode="json")["funcs"] == [F + "first_char"]
        assert "reward/first_char" in ctrl.metrics
        path = ctrl.save(tmp_path / "ckpt")
    finally:
        ctrl.close()
    with pytest.raises(CheckpointError, match=r"names reward functions \['tests.reward_functions:first_char'\].*"
                                              "trust_code=True.*reward_funcs="):
        Controller.restore(path)
    for kwargs in ({"trust_code": True}, {"reward_funcs": [rf.first_char]}):
        restored = Controller.restore(path, **kwargs)
        assert restored.trainer_version == 1 and restored.cfg.reward.funcs
        restored.close()
    with pytest.raises(ValueError, match="reward functions given twice"):
        Controller.from_config(small(funcs=["exact_match"]), reward_funcs=[rf.first_char])


def test_stepped_runs_with_retries_are_the_same_with_any_number_of_workers(tmp_path, monkeypatch):
    runs = []
    for workers in (0, 2):
        monkeypatch.setenv("ASYNCRL_REWARD_MARKERS", str(tmp_path / str(workers)))
        (tmp_path / str(workers)).mkdir()
        ctrl = stepped(small(funcs=[F + "fails_once"], workers=workers, timeout_s=30), steps=2)
        try:
            runs.append((ctrl.trace.drop(columns="seq"), ctrl.completions))
        finally:
            ctrl.close()
    assert (runs[0][0].event == "fault").sum() > 0
    for a, b in zip(*runs):
        pd.testing.assert_frame_equal(a, b)
