"""Tasks: prompts and answers, held-out evaluation sets, grading, the constant-answer bar, the prompt stream."""

from __future__ import annotations

from collections import Counter

import pytest

from asyncrl.config import TaskConfig
from asyncrl.tasks import TASKS, TOY_TASKS, Prompt, PromptStream, Task, build_task, evaluate


def test_the_registry_holds_the_toy_tasks_and_the_data_tasks():
    assert set(TASKS) == set(TOY_TASKS) | {"dataset", "countdown", "guess_letter"}  # guess_letter: an environment task


@pytest.mark.parametrize("name", sorted(TOY_TASKS))
def test_every_task_builds_and_satisfies_the_protocol(name):
    task = build_task(TaskConfig(name=name))
    assert isinstance(task, Task) and task.name == name
    assert task.train_prompts and task.eval_prompts
    for p in task.train_prompts + task.eval_prompts:
        assert isinstance(p, Prompt) and p.text and p.answer
        assert task.is_correct(p, p.answer) and task.reward(p, p.answer) == 1.0
    assert len({p.id for p in task.train_prompts + task.eval_prompts}) == len(task.train_prompts + task.eval_prompts)
    assert 0 < task.constant_answer_accuracy < 0.5


@pytest.mark.parametrize("name,pick", [("copy_first", lambda s: s[0]), ("copy_last", lambda s: s[-1])])
def test_copy_tasks_hold_out_their_evaluation_strings(name, pick):
    task = build_task({"name": name})
    train = {p.text for p in task.train_prompts}
    held = {p.text for p in task.eval_prompts}
    assert not train & held and len(train) + len(held) == 8**3 and task.held_out
    assert len(held) == round(0.2 * 512)
    for p in task.train_prompts + task.eval_prompts:
        assert p.text.endswith("=") and p.answer == pick(p.text[:-1])
    # every answer letter is still seen in training; the split depends on split_seed only
    assert {p.answer for p in task.eval_prompts} <= {p.answer for p in task.train_prompts}
    again = build_task({"name": name})
    assert [p.text for p in again.eval_prompts] == [p.text for p in task.eval_prompts]
    other = build_task({"name": name, "options": {"split_seed": 1}})
    assert {p.text for p in other.eval_prompts} != held


def test_constant_answer_accuracy_is_computed_from_the_eval_prompts():
    assert build_task("copy_digit").constant_answer_accuracy == pytest.approx(0.1)
    assert build_task("successor").constant_answer_accuracy == pytest.approx(1 / 25)
    assert build_task("addition").constant_answer_accuracy == pytest.approx(5 / 25)  # "4": 0+4, 1+3, ...
    task = build_task("copy_first")
    most = Counter(p.answer for p in task.eval_prompts).most_common(1)[0][1]
    assert task.constant_answer_accuracy == pytest.approx(most / len(task.eval_prompts))
    small = build_task({"name": "copy_last", "options": {"alphabet": "ab", "length": 2, "eval_fraction": 0.5}})
    assert small.constant_answer_accuracy in (0.5, 1.0)


def test_grading_reads_the_first_characters_after_whitespace():
    task = build_task("addition")
    p = next(p for p in task.eval_prompts if p.text == "3+4=")
    assert p.answer == "7"
    for text in ["7", " 7", "7<eos>", "\n7x", "78"]:
        assert task.is_correct(p, text) and task.reward(p, text) == 1.0
    for text in ["", " ", "x7", "<eos>7", "6"]:
        assert not task.is_correct(p, text) and task.reward(p, text) == 0.0


def test_partial_credit_for_a_well_formed_wrong_answer():
    task = build_task({"name": "addition", "options": {"partial_credit": 0.1}})
    p = next(p for p in task.eval_prompts if p.text == "3+4=")
    assert task.reward(p, "7") == 1.0 and task.reward(p, "5") == 0.1 and task.reward(p, "x") == 0.0
    copy = build_task({"name": "copy_first", "options": {"partial_credit": 0.2}})
    q = copy.eval_prompts[0]
    wrong = next(c for c in "abcdefgh" if c != q.answer)
    assert copy.reward(q, wrong) == 0.2 and copy.reward(q, "z") == 0.0


def test_successor_and_copy_digit_prompts():
    succ = build_task("successor")
    assert [(p.text, p.answer) for p in succ.train_prompts[:2]] == [("a>", "b"), ("b>", "c")]
    assert len(succ.train_prompts) == 25
    digit = build_task("copy_digit")
    assert [(p.text, p.answer) for p in digit.train_prompts[:2]] == [("0=", "0"), ("1=", "1")]


def test_build_task_errors_name_what_exists():
    with pytest.raises(ValueError, match="copy_first"):
        build_task("nope")
    with pytest.raises(ValueError, match="bad options"):
        build_task({"name": "addition", "options": {"max_digits": 3}})
    with pytest.raises(ValueError):
        build_task({"name": "copy_first", "options": {"eval_fraction": 1.5}})
    with pytest.raises(ValueError):
        build_task({"name": "addition", "options": {"partial_credit": 1.0}})


# ------------------------------------------------------------------------------------------ prompt stream
def _prompts(n):
    return [Prompt(str(i), str(i), f"p{i}") for i in range(n)]


def test_stream_is_a_seeded_shuffle_per_epoch():
    prompts = _prompts(10)
    a, b = PromptStream(prompts, seed=3), PromptStream(prompts, seed=3)
    first = [a.get(i).text for i in range(30)]
    assert first == [b.get(i).text for i in range(30)]
    for epoch in range(3):
        assert sorted(first[10 * epoch: 10 * epoch + 10]) == sorted(p.text for p in prompts)
    assert first[:10] != first[10:20]
    assert first != [PromptStream(prompts, seed=4).get(i).text for i in range(30)]
    # random access equals sequential access (resume needs only the position)
    assert [PromptStream(prompts, seed=3).get(i).text for i in (25, 3, 17)] == [first[25], first[3], first[17]]
    assert PromptStream(prompts, seed=3, shuffle=False).take(12, 3) == [prompts[2], prompts[3], prompts[4]]


def test_stream_runs_out_after_max_epochs():
    s = PromptStream(_prompts(4), seed=0, max_epochs=2)
    assert s.total == 8 and not s.exhausted(7) and s.exhausted(8) and s.remaining(6) == 2
    assert len(s.take(6, 5)) == 2 and s.take(8, 3) == []
    with pytest.raises(IndexError, match="ran out"):
        s.get(8)
    endless = PromptStream(_prompts(4), seed=0)
    assert endless.total is None and not endless.exhausted(10**9) and endless.remaining(5) is None
    with pytest.raises(ValueError):
        PromptStream([], seed=0)


class _Oracle:
    """A backend answering every prompt correctly (or always "a")."""

    def __init__(self, tok, answers):
        self.tok, self.answers = tok, answers

    def generate_greedy(self, prompt_ids, max_new_tokens):
        texts = [self.answers(self.tok.decode(ids, skip_special_tokens=True)) for ids in prompt_ids]
        return [list(t.encode())[:max_new_tokens] + [self.tok.eos_token_id] for t in texts]


def test_evaluate_scores_greedy_completions():
    from asyncrl.tokenizer import build_tokenizer

    tok = build_tokenizer()
    task = build_task("copy_first")
    right = evaluate(_Oracle(tok, lambda text: text[0]), task, tok)
    assert right["accuracy"] == 1.0 and right["reward_mean"] == 1.0 and right["n"] == len(task.eval_prompts)
    const = evaluate(_Oracle(tok, lambda text: "a"), task, tok)
    assert const["accuracy"] <= task.constant_answer_accuracy


def test_task_options_are_checked_when_the_config_loads():
    from asyncrl import load_config

    with pytest.raises(ValueError, match=r"bad options \{'max_digits': 3\} for task 'addition': unknown; its "
                                         r"options are \['max_digit', 'partial_credit'\]"):
        load_config("quickstart", task={"name": "addition", "options": {"max_digits": 3}})
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        load_config("quickstart", task={"name": "copy_first", "options": {"eval_fraction": 1.5}})
    with pytest.raises(ValueError, match=r"unknown task 'adition'; tasks: \["):
        load_config("quickstart", task={"name": "adition"})
    assert load_config("quickstart", task={"name": "copy_last", "options": {"length": 2}}).task.options == {"length": 2}


# --------------------------------------------------------------------------------- Controller.evaluate(split, n)
def _ctrl(**overrides):
    from asyncrl import Controller, load_config

    cfg = load_config("quickstart", **{"groups_per_step": 2, "group_size": 4, "eval_every": None, "torch_threads": 1,
                                       **overrides})
    return Controller.from_config(cfg)


def test_the_default_evaluation_is_the_greedy_accuracy_eval_every_always_reported():
    ctrl = _ctrl()
    ctrl.tick()
    ev = ctrl.evaluate()
    old = evaluate(ctrl.generator, ctrl.task, ctrl.tokenizer, ctrl.cfg.generation.max_new_tokens)
    assert {k: ev[k] for k in old} == old and ev["n"] == len(ctrl.task.eval_prompts)
    assert ev["mean@1"] == ev["pass@1"] == ev["accuracy"]
    row = ctrl.evaluations.iloc[-1]
    assert (row.weight_version, row.split, row.n, row.temperature, row.prompts) == (
        ctrl.generator.version, "eval", 1, 0.0, len(ctrl.task.eval_prompts))
    greedy4 = ctrl.evaluate(n=4)  # greedy: one completion stands for all four
    assert greedy4["mean@4"] == greedy4["pass@4"] == greedy4["accuracy"] == ev["accuracy"]


def test_sampled_evaluation_gives_mean_and_pass_at_n_and_leaves_the_run_unchanged():
    a, b = _ctrl(), _ctrl()
    for ctrl in (a, b):
        ctrl.tick()
    ev = a.evaluate(split="train", n=4, temperature=1.0, max_prompts=20)
    assert ev["n"] == 20 and 0 <= ev["mean@4"] <= ev["pass@4"] <= 1 and ev["accuracy"] == ev["mean@4"]
    again = _ctrl()
    again.tick()
    assert again.evaluate(split="train", n=4, temperature=1.0, max_prompts=20) == ev  # seeded by run and version
    for ctrl in (a, b):  # the evaluation drew nothing from the rollouts' random stream
        while ctrl.trainer_version < 3:
            ctrl.tick()
    assert a.trace.drop(columns="seq").equals(b.trace.drop(columns="seq"))
    assert a.metrics.loss.tolist() == b.metrics.loss.tolist()
    assert list(a.evaluations.columns[-2:]) == ["mean@4", "pass@4"] and a.evaluations.iloc[-1].split == "train"


def test_evaluation_arguments_are_checked_in_one_line():
    ctrl = _ctrl()
    for kwargs, match in [({"split": "test"}, r"evaluate\(split='test'\): the splits are 'eval' and 'train'"),
                          ({"n": 0}, r"evaluate\(n=0\): completions per prompt, an integer >= 1"),
                          ({"temperature": -1.0}, r"evaluate\(temperature=-1.0\): 0.0 \(greedy\) or a positive"),
                          ({"max_prompts": 0}, r"evaluate\(max_prompts=0\): an integer >= 1, or None")]:
        with pytest.raises(ValueError, match=match):
            ctrl.evaluate(**kwargs)
    assert len(ctrl.evaluations) == 0


def test_evaluation_scores_with_the_runs_reward_functions():
    from asyncrl.datasets import dataset_task
    from asyncrl.evaluation import evaluate_task
    from asyncrl.rewards import RewardFunctions

    class Fixed:  # a generator whose greedy completions are given: "4" for every prompt
        def generate_greedy(self, prompt_ids, max_new_tokens):
            return [list(b"4") for _ in prompt_ids]

    def right(completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    def short(completions, **kwargs):
        return [1.0 if len(c) <= 1 else 0.0 for c in completions]

    def only_sums(completions, op, **kwargs):  # does not apply to other rows (None)
        return [float(c.strip() == "4") if o == "add" else None for c, o in zip(completions, op)]

    from asyncrl.tokenizer import build_tokenizer

    rows = [{"prompt": "2+2=", "answer": "4", "op": "add"}, {"prompt": "3+3=", "answer": "6", "op": "add"},
            {"prompt": "2*2=", "answer": "4", "op": "mul"}, {"prompt": "8/2=", "answer": "4", "op": "div"}]
    task = dataset_task(train=rows, eval=rows)
    tok = build_tokenizer()
    ev, rows_out = evaluate_task(Fixed(), task, tok, RewardFunctions([right, short], [1.0, 0.5]))
    assert ev["reward_mean"] == pytest.approx((1.5 + 0.5 + 1.5 + 1.5) / 4) and ev["accuracy"] == 0.75  # total at max
    assert [r["correct"] for r in rows_out] == [True, False, True, True]
    ev, _ = evaluate_task(Fixed(), task, tok, RewardFunctions([right, short], [1.0, 0.5]), accuracy="short")
    assert ev["accuracy"] == 1.0  # the function reward.accuracy names
    ev, rows_out = evaluate_task(Fixed(), task, tok, RewardFunctions([only_sums]))
    assert [r["correct"] for r in rows_out] == [True, True, False, False]  # None (does not apply): not correct

    from asyncrl.backends.base import Capabilities

    class Sampled(Fixed):  # n samples a prompt: "4", then "x" — one right in n for the rows whose answer is 4
        capabilities = Capabilities(sampled_evaluation=True)

        def generate_sampled(self, prompt_ids, n, temperature, seed, max_new_tokens):
            self.asked = (n, temperature, seed, max_new_tokens)
            return [list(b"4") if i % n == 0 else list(b"x") for i in range(len(prompt_ids) * n)]

    with pytest.raises(ValueError, match=r"evaluate\(temperature=0.7\): the generator Fixed samples only rollouts"):
        evaluate_task(Fixed(), task, tok, RewardFunctions([right]), n=4, temperature=0.7)
    gen = Sampled()
    ev, _ = evaluate_task(gen, task, tok, RewardFunctions([right]), n=4, temperature=0.7, seed=5, max_new_tokens=3)
    assert gen.asked == (4, 0.7, 5, 3)
    assert ev["pass@4"] == 0.75 and ev["mean@4"] == pytest.approx(0.75 / 4) and ev["accuracy"] == ev["mean@4"]
