"""Datasets as tasks: every format read into the same prompts (TRL's standard and conversational forms), columns
that survive a checkpoint, stable ids, splits, content hashes, one-line errors for bad data; chat templates
(the ids are exactly the template's, no doubled <bos>); countdown's generated rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from asyncrl.chat import check_prompt_lengths, prompt_ids, render, render_task
from asyncrl.countdown import USER_PROMPT, countdown_rows, countdown_task
from asyncrl.datasets import DataError, check_reward_columns, data_changed, dataset_task, read_table, required_columns
from asyncrl.prompts import Prompt, PromptStream
from asyncrl.rewards.builtin import countdown_score
from asyncrl.tasks import build_task
from asyncrl.tokenizer import BOS_ID, build_tokenizer

ROWS = [
    {"prompt": "2+2=", "answer": "4", "level": 1, "tags": ["easy", "sum"]},
    {"prompt": [{"role": "user", "content": "3+5="}], "answer": "8", "level": 2, "tags": []},
    {"prompt": "9-7=", "answer": "2", "level": 1, "tags": ["easy"]},
]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tabular_rows():  # Parquet, CSV and datasets need one type per column: standard prompts only
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a} for a, b in ((1, 2), (3, 4), (5, 0))]


def _task(train, **options):
    return build_task({"name": "dataset", "options": {"train": train, **options}})


# --------------------------------------------------------------------------------------------------- reading
def test_jsonl_and_json_keep_every_column_with_its_prompt(tmp_path):
    expected = None
    for name, write in [
        ("a.jsonl", lambda p: _jsonl(p, ROWS)),
        ("b.json", lambda p: p.write_text(json.dumps(ROWS))),
        ("c.json", lambda p: _jsonl(p, ROWS)),  # JSON Lines in a .json file, as datasets reads it
        ("d.json", lambda p: p.write_text(json.dumps({k: [r[k] for r in ROWS] for k in ROWS[0]}))),  # columns
    ]:
        write(tmp_path / name)
        task = _task(str(tmp_path / name))
        got = [(p.id, p.text, p.answer, p.messages, p.columns) for p in task.train_prompts]
        assert expected is None or got == expected, name
        expected = got
    assert expected == [
        ("train/0", "2+2=", "4", None, {"answer": "4", "level": 1, "tags": ["easy", "sum"]}),
        ("train/1", "", "8", [{"role": "user", "content": "3+5="}], {"answer": "8", "level": 2, "tags": []}),
        ("train/2", "9-7=", "2", None, {"answer": "2", "level": 1, "tags": ["easy"]}),
    ]


def test_parquet_csv_saved_directory_and_python_objects_read_alike(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _tabular_rows()
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "t.parquet"))
    pd.DataFrame(rows).to_csv(tmp_path / "t.csv", index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    sources = [str(tmp_path / "t.parquet"), str(tmp_path / "saved"), ds, pd.DataFrame(rows), rows]
    for source in sources:
        task = _task(source)
        assert [(p.id, p.text, p.columns) for p in task.train_prompts] == [
            (f"train/{i}", r["prompt"], {"answer": r["answer"], "level": r["level"]}) for i, r in enumerate(rows)
        ], source
    csv = _task(str(tmp_path / "t.csv"))  # types inferred as datasets' CSV reader infers them
    assert [p.columns["level"] for p in csv.train_prompts] == [1, 3, 5]


def test_values_are_plain_json_and_a_prompt_survives_a_checkpoint_equal(tmp_path):
    import numpy as np

    frame = pd.DataFrame({"prompt": ["a=", "b="], "vec": [np.array([1, 2]), np.array([3])],
                          "score": [np.float32(0.5), np.float32(1.5)], "when": [None, None]})
    task = _task(frame)
    p = task.train_prompts[0]
    assert p.columns == {"vec": [1, 2], "score": 0.5, "when": None}
    assert all(type(v) in (list, float, type(None)) for v in p.columns.values())
    for prompt in task.train_prompts + _task(ROWS).train_prompts:
        assert Prompt(**json.loads(json.dumps(prompt.to_json()))) == prompt
    toy = build_task("addition").train_prompts[0]
    assert toy.to_json() == {"text": toy.text, "answer": toy.answer, "id": toy.id, "columns": {"answer": toy.answer}}
    assert Prompt(**{"text": "1=", "answer": "1", "id": "train/1"}).columns == {}  # a checkpoint written before


def test_system_prompt_makes_standard_prompts_conversational_and_keeps_a_rows_own(tmp_path):
    rows = [{"prompt": "2+2="}, {"prompt": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "x"}]}]
    task = _task(rows, system_prompt="Be brief.")
    assert task.train_prompts[0].messages == [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "2+2="}]
    assert task.train_prompts[1].messages == rows[1]["prompt"]
    assert task.conversational and task.train_prompts[0].prompt == task.train_prompts[0].messages


def test_splits_eval_file_and_a_seeded_eval_fraction(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(40)]
    path = _jsonl(tmp_path / "t.jsonl", rows)
    held = _jsonl(tmp_path / "e.jsonl", rows[:3])
    task = _task(str(path), eval=str(held))
    assert [p.id for p in task.eval_prompts] == ["eval/0", "eval/1", "eval/2"] and len(task.train_prompts) == 40
    assert task.split("eval") == task.eval_prompts and task.held_out
    frac = _task(str(path), eval_fraction=0.25)
    assert len(frac.eval_prompts) == 10 and len(frac.train_prompts) == 30
    assert not {p.text for p in frac.eval_prompts} & {p.text for p in frac.train_prompts}
    assert [p.id for p in frac.train_prompts] == [f"train/{i}" for i in range(30)]  # the index in its split
    again = _task(str(path), eval_fraction=0.25)
    assert [p.text for p in again.eval_prompts] == [p.text for p in frac.eval_prompts]
    other = _task(str(path), eval_fraction=0.25, split_seed=1)
    assert [p.text for p in other.eval_prompts] != [p.text for p in frac.eval_prompts]
    source_row = int(frac.eval_prompts[4].text[1:])  # q<row>: the file row the split row came from
    assert frac.where("eval/4") == f"dataset {str(path)!r} row {source_row}"
    none = _task(str(path))
    assert none.eval_prompts == [] and not none.held_out
    with pytest.raises(ValueError, match=r"task 'dataset' has no 'eval' split: set task.options.eval"):
        none.split("eval")


def test_the_prompt_stream_serves_a_dataset_by_position():
    task = _task([{"prompt": f"q{i}"} for i in range(1000)])
    stream = PromptStream(task.train_prompts, seed=5)
    first = [stream.get(i).id for i in range(2000)]
    resumed = PromptStream(_task([{"prompt": f"q{i}"} for i in range(1000)]).train_prompts, seed=5)
    assert [resumed.get(i).id for i in range(1500, 2000)] == first[1500:]
    assert sorted(first[:1000]) == sorted(p.id for p in task.train_prompts)


# ----------------------------------------------------------------------------------------- hashes and caching
def test_the_content_hash_follows_the_data_and_a_changed_file_is_named(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", ROWS)
    task = _task(str(path))
    assert task.fingerprint["train"].startswith("sha256:") and data_changed(task.identity, task) is None
    assert task.identity == {"train": {"source": repr(str(path)), "hash": task.fingerprint["train"]}}
    assert _task(ROWS).fingerprint == _task(list(ROWS)).fingerprint  # objects: hashed by their rows
    assert _task(ROWS[:2]).fingerprint != _task(ROWS).fingerprint
    saved = task.identity
    assert re.match(r"the checkpoint was trained on dataset '.*t.jsonl' \(train split\), and this run has no such "
                    r"data \(task 'addition'\): give the same data", data_changed(saved, build_task("addition")))
    _jsonl(path, ROWS[:2] + [{"prompt": "9-7=", "answer": "3"}])
    changed = _task(str(path))
    message = data_changed(saved, changed)
    assert message is not None and "\n" not in message
    assert re.match(rf"dataset {re.escape(repr(str(path)))} \(train split\) changed since the checkpoint", message)


def test_a_file_is_read_once_while_it_is_unchanged(tmp_path, monkeypatch):
    import asyncrl.datasets as D

    path = _jsonl(tmp_path / "t.jsonl", ROWS)
    reads = []
    real = D.read_table
    monkeypatch.setattr(D, "read_table", lambda *a: reads.append(a) or real(*a))
    from asyncrl import load_config

    cfg = load_config("quickstart", task={"name": "dataset", "options": {"train": str(path)}})  # validates: reads
    task = build_task(cfg.task)  # the controller's build: the same task, not read again
    assert len(reads) == 1 and build_task(cfg.task) is task
    _jsonl(path, ROWS[:2])
    assert len(build_task(cfg.task).train_prompts) == 2 and len(reads) == 2


# ---------------------------------------------------------------------------------------------- bad input
def _error(match, **options):
    with pytest.raises(DataError) as info:
        _task(**options) if "train" in options else build_task({"name": "dataset", "options": options})
    message = str(info.value)
    assert "\n" not in message and re.search(match, message), message
    return message


def test_bad_data_is_one_line_naming_the_file_the_row_and_the_column(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    _error(rf"dataset file {re.escape(repr(missing))} \(task.options.train\) does not exist; allowed: a .jsonl",
           train=missing)
    (tmp_path / "t.txt").write_text("x")
    _error(r"t.txt' \(task.options.train\): unknown format '.txt'; allowed: a .jsonl, .json, .parquet or .csv",
           train=str(tmp_path / "t.txt"))
    path = _jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}, {"question": "y", "answer": "1"}])
    _error(r"a.jsonl' row 1 \(line 2\) has no column 'prompt' \(task.options.prompt_key\); its columns are "
           r"\['answer', 'question'\]", train=str(path))
    _jsonl(tmp_path / "q.jsonl", [{"question": "y", "answer": "1"}])
    assert _task(str(tmp_path / "q.jsonl"), prompt_key="question").train_prompts[0].columns == {"answer": "1"}
    _jsonl(path, [{"prompt": "x"}, {"prompt": "  "}])
    _error(r"a.jsonl' row 1 \(line 2\) column 'prompt' is an empty prompt", train=str(path))
    _jsonl(path, [{"prompt": []}])
    _error(r"row 0 \(line 1\) column 'prompt' is an empty list; allowed: a non-empty string", train=str(path))
    _jsonl(path, [{"prompt": [{"role": "user", "content": ["part"]}]}])
    _error(r"column 'prompt' message 0 is .*; allowed: an object with a 'role' string and a 'content' string",
           train=str(path))
    _jsonl(path, [{"prompt": 7}])
    _error(r"column 'prompt' is int '7'; allowed: a non-empty string \(standard\)", train=str(path))
    path.write_text('{"prompt": "x"}\n{"prompt": \n')
    _error(r"a.jsonl' line 2 \(row 1\): not JSON", train=str(path))
    frame = pd.DataFrame({"prompt": ["a"], "when": [pd.Timestamp("2026-01-01")]})
    _error(r"dataset train_dataset \(a DataFrame\) row 0 column 'when' holds a Timestamp .*; allowed: strings, "
           r"numbers", train=frame)
    with pytest.raises(ValueError, match=r"task 'dataset' needs option\(s\) \['train'\]"):
        build_task({"name": "dataset"})
    _error(r"give eval \(a dataset of its own\) or eval_fraction, not both", train=ROWS, eval=ROWS, eval_fraction=0.5)
    _error(r"eval_fraction must be in \(0, 1\), got 1.5", train=ROWS, eval_fraction=1.5)
    _jsonl(path, [])
    _error(r"a.jsonl' \(task.options.train\) has no rows", train=str(path))


def test_a_saved_dataset_dict_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _tabular_rows()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    _error(r"holds a datasets.DatasetDict with splits \['train', 'test'\]: name one split's directory",
           train=str(tmp_path / "dd"))
    assert len(_task(str(tmp_path / "dd" / "train"), eval=str(tmp_path / "dd" / "test")).eval_prompts) == 3


def test_bad_data_is_refused_when_the_config_loads(tmp_path):
    from asyncrl import load_config

    with pytest.raises(ValueError, match=r"dataset file '.*nope.jsonl' \(task.options.train\) does not exist"):
        load_config("quickstart", task={"name": "dataset", "options": {"train": str(tmp_path / "nope.jsonl")}})
    with pytest.raises(ValueError, match=r"bad options \{'path': 'x'\} for task 'dataset': unknown; its options are "
                                         r"\['train', 'eval', 'eval_fraction', 'prompt_key', 'system_prompt'"):
        load_config("quickstart", task={"name": "dataset", "options": {"path": "x"}})


def test_a_reward_functions_columns_are_checked_against_every_row():
    def accuracy_reward(completions, solution, **kwargs):
        return [0.0] * len(completions)

    def either(completions, **kwargs):
        return [0.0] * len(completions)

    either.required_columns = [("solution", "answer")]
    assert required_columns(accuracy_reward) == [("solution",)] and required_columns(either) == [("solution", "answer")]
    task = _task(ROWS)
    check_reward_columns(task, [either])  # 'answer' will do
    with pytest.raises(ValueError, match=r"dataset train_dataset \(a list of dicts\) row 0 has no column 'solution', "
                                         r"which reward function accuracy_reward needs; its columns are \['answer'"):
        check_reward_columns(task, [accuracy_reward])


# ------------------------------------------------------------------------------------------- chat templates
def _llama_like(template: str | None):
    """The byte tokenizer (whose encode adds <bos>, as Llama's does) with another chat template."""
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '</s>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")


def _template_ids(tok, messages, **kw):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("template", [None, LLAMA3_LIKE])
def test_conversational_ids_are_exactly_the_templates_with_one_bos(template):
    tok = build_tokenizer() if template is None else _llama_like(template)
    task = render_task(_task(ROWS, system_prompt="Be brief."), tok)
    for prompt in task.train_prompts:
        ids = prompt_ids(tok, prompt)
        assert ids == _template_ids(tok, prompt.messages)
        assert ids[0] == BOS_ID and ids[1] != BOS_ID
        assert prompt.text == tok.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    standard = render_task(_task([{"prompt": "2+2="}]), tok)
    assert prompt_ids(tok, standard.train_prompts[0]) == tok.encode("2+2=")  # a standard prompt: as ever
    assert build_tokenizer().apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True,
                                                 tokenize=False) == "<bos>user: 3+4=\nassistant: "


def test_model_chat_template_overrides_and_the_task_is_not_changed(tmp_path):
    tok = build_tokenizer()
    task = _task(ROWS)
    rendered = render_task(task, tok, LLAMA3_LIKE)
    conv = rendered.train_prompts[1]
    assert conv.text == "<bos><user>3+5=</s><assistant>" and prompt_ids(tok, conv) == _template_ids(
        tok, conv.messages, chat_template=LLAMA3_LIKE)
    assert task.train_prompts[1].text == "" and rendered is not task  # the cached task serves other tokenizers
    toy = build_task("addition")
    assert render_task(toy, tok) is toy  # nothing conversational: the same task, bit for bit
    file = tmp_path / "t.jinja"
    file.write_text(LLAMA3_LIKE)
    from asyncrl.chat import template_text

    assert template_text(str(file)) == LLAMA3_LIKE and template_text(LLAMA3_LIKE) == LLAMA3_LIKE
    with pytest.raises(ValueError, match="neither a Jinja template nor an existing file"):
        template_text(str(tmp_path / "missing.jinja"))


def test_a_conversational_dataset_needs_a_template(tmp_path):
    tok = _llama_like(None)
    path = _jsonl(tmp_path / "c.jsonl", ROWS)
    with pytest.raises(ValueError, match=rf"^dataset {re.escape(repr(str(path)))} row 1 is conversational \(a list "
                                         r"of messages\) but the tokenizer .* has no chat template: set "
                                         r"model.chat_template"):
        render_task(_task(str(path)), tok)
    render_task(_task([{"prompt": "2+2="}]), tok)  # standard prompts need none


def test_a_prompt_longer_than_the_context_after_templating_is_named(tmp_path):
    tok = build_tokenizer()
    path = _jsonl(tmp_path / "c.jsonl", [{"prompt": "2+2="}, {"prompt": [{"role": "user", "content": "x" * 40}]}])
    task = render_task(_task(str(path)), tok)
    check_prompt_lengths(task, tok, 64, 4, "model.max_position_embeddings")  # 59 + 4 <= 64
    with pytest.raises(ValueError, match=rf"^dataset {re.escape(repr(str(path)))} row 1 column 'prompt' is 59 tokens "
                                         r"after the chat template .*max_new_tokens 8 it needs 67 positions, more than "
                                         r"the model's context model.max_position_embeddings 64"):
        check_prompt_lengths(task, tok, 64, 8, "model.max_position_embeddings")


def test_render_names_the_row_of_a_plain_prompt_list():
    tok = _llama_like(None)
    with pytest.raises(ValueError, match=r"^prompt 'eval/0' is conversational"):
        render([Prompt("", "", "eval/0", [{"role": "user", "content": "x"}])], tok)


# ------------------------------------------------------------------------------------------------- countdown
def test_countdown_rows_are_solvable_distinct_and_seeded():
    rows = countdown_rows(500, seed=3)
    assert rows == countdown_rows(500, seed=3) and rows != countdown_rows(500, seed=4)
    for row in rows:
        assert 3 <= len(row["nums"]) <= 4 and all(1 <= n <= 99 for n in row["nums"]) and 1 <= row["target"] <= 100
        used = sorted(int(n) for n in re.findall(r"\d+", row["solution"]))
        assert used == sorted(row["nums"]) and eval(row["solution"]) == pytest.approx(row["target"])
        assert countdown_score(f"<answer>{row['solution']}</answer>", row["nums"], row["target"]) == 1.0
    assert len({(tuple(sorted(r["nums"])), r["target"]) for r in rows}) == len(rows)


def test_countdown_is_a_conversational_task_with_nums_and_target_columns():
    task = build_task({"name": "countdown", "options": {"train_size": 50, "eval_size": 10, "seed": 1}})
    assert task.name == "countdown" and len(task.train_prompts) == 50 and len(task.eval_prompts) == 10
    prompt = task.train_prompts[0]
    assert set(prompt.columns) == {"nums", "target"} and prompt.id == "train/0"
    assert prompt.messages[0]["role"] == "system"
    assert prompt.messages[1] == {"role": "user", "content": USER_PROMPT.format(**prompt.columns)}
    assert "<think> </think>" in prompt.messages[1]["content"] and "<answer>" in prompt.messages[1]["content"]
    train = {(tuple(sorted(p.columns["nums"])), p.columns["target"]) for p in task.train_prompts}
    assert not train & {(tuple(sorted(p.columns["nums"])), p.columns["target"]) for p in task.eval_prompts}
    assert task.constant_answer_accuracy == pytest.approx(0.1)
    nums, target = prompt.columns["nums"], prompt.columns["target"]
    solution = next(r["solution"] for r in countdown_rows(60, seed=1) if r["nums"] == nums)
    assert eval(solution) == pytest.approx(target)
    for completion in (f"<think>...</think> <answer>{solution}</answer>",
                       [{"role": "assistant", "content": f"<answer>{solution}</answer>"}]):
        assert task.reward(prompt, completion) == 1.0 and task.is_correct(prompt, completion)
    assert task.reward(prompt, f"<answer>{nums[0]}</answer>") == 0.0 and task.reward(prompt, solution) == 0.0
    assert countdown_task(train_size=50, eval_size=10, seed=1).fingerprint == task.fingerprint
    with pytest.raises(ValueError, match=r"bad options .* for task 'countdown': max_numbers must be an integer in"):
        build_task({"name": "countdown", "options": {"max_numbers": 9}})


def test_token_counts_are_the_lengths_of_the_prompt_ids_with_or_without_the_rust_tokenizer():
    from asyncrl.chat import token_counts

    tok = build_tokenizer()
    prompts = render_task(_task(ROWS * 700, system_prompt=None), tok).train_prompts  # over two chunks
    for special in (True, False):
        texts = [p.text for p in prompts if (p.messages is None) == special]
        expected = [len(prompt_ids(tok, p)) for p in prompts if (p.messages is None) == special]
        assert token_counts(tok, texts, special) == expected

        class Wrapped:  # a tokenizer without a Rust backend: the Python call
            def __call__(self, *args, **kwargs):
                return tok(*args, **kwargs)

        assert token_counts(Wrapped(), texts, special) == expected


# ------------------------------------------------------------------------------- a dataset under a controller
class Graded:
    """Makes a dataset task score itself (the completion starts with the row's answer), so these tests need no
    reward functions: the controller's handling of the data is what they look at."""

    @staticmethod
    def of(task):
        from asyncrl.datasets import DatasetTask

        class GradedTask(DatasetTask):
            def reward(self, prompt, completion):
                return float(str(completion).strip().startswith(prompt.columns["answer"]))

        return GradedTask(task.train_prompts, task.eval_prompts, task.sources, task.fingerprint, task._origin)


def _controller(task, **overrides):
    from asyncrl import Controller, load_config
    from asyncrl.backends import build_backends

    cfg = load_config("quickstart", **{"groups_per_step": 2, "group_size": 4, "eval_every": None,
                                       "torch_threads": 1, "generation": {"max_new_tokens": 2}, **overrides})
    policy, generator, tokenizer = build_backends(cfg)
    return Controller(cfg, Graded.of(task), policy, generator, tokenizer)


def _stepped(ctrl, steps):
    while ctrl.trainer_version < steps:
        ctrl.tick()
    return ctrl


WORDS = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b), "pair": [a, b]}
         for a in range(4) for b in range(4)]


def test_a_conversational_dataset_trains_with_the_templates_ids_and_the_trace_shows_the_rendering(tmp_path):
    path = _jsonl(tmp_path / "words.jsonl", WORDS)
    ctrl = _stepped(_controller(_task(str(path), eval_fraction=0.25)), 2)
    tok = ctrl.tokenizer
    dispatched = ctrl.trace[ctrl.trace.event == "dispatch"]
    assert dispatched.detail.str.startswith("<bos>user: ").all() and dispatched.detail.str.endswith("assistant: ").all()
    prompt = ctrl.stream.get(0)
    assert ctrl.encode(prompt) == _template_ids(tok, prompt.messages)  # one <bos>, the template's
    assert prompt.text == dispatched.detail.iloc[0] and prompt.id.startswith("train/")
    assert len(ctrl.metrics) == 2 and ctrl.task.conversational


def test_a_dataset_run_restores_bit_for_bit_with_its_columns_and_refuses_changed_data(tmp_path):
    from asyncrl import Controller, load_config
    from asyncrl.checkpoint import CheckpointError

    path = _jsonl(tmp_path / "words.jsonl", WORDS)
    task = _task(str(path), eval_fraction=0.25)
    a = _stepped(_controller(task, sampler={"name": "in_order", "max_lookahead_versions": 1}), 2)
    a.rollout_tick()  # a batch ahead: groups in the buffer, with their prompts' columns
    saved = a.save(tmp_path / "ckpt")
    state = json.loads((saved / "state.json").read_text())
    rows = [s["prompt"] for s in state["buffer"]["slots"]]
    assert rows and all(set(r["columns"]) == {"answer", "pair"} and r["messages"] for r in rows)
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["data"] == task.identity

    from asyncrl.checkpoint import load

    _, loaded = load(saved)  # the controller's own restore path, with the graded task
    b = _controller(task, sampler={"name": "in_order", "max_lookahead_versions": 1})
    b.load_state_dict(loaded)
    assert [s.prompt for s in b.buffer.slots()] == [s.prompt for s in a.buffer.slots()]  # columns included
    for ctrl in (a, b):
        _stepped(ctrl, 4)
    assert a.metrics.loss.tolist() == b.metrics.loss.tolist()
    assert a.trace.drop(columns="seq").equals(b.trace.drop(columns="seq"))

    _jsonl(path, WORDS[:-1])  # the file changed since
    def exact(completions, answer, **kwargs):
        return [float(c[0]["content"].strip().startswith(a)) for c, a in zip(completions, answer)]

    with pytest.raises(CheckpointError, match=r"the checkpoint was trained on dataset '.*words.jsonl' \(train "
                                              r"split\), and this run has no such data \(task 'copy_first'\)"):
        Controller.restore(saved, reward_funcs=[exact])  # its config.yaml names the quickstart's task
    cfg = load_config(saved / "config.yaml", task={"name": "dataset", "options": {"train": str(path),
                                                                                   "eval_fraction": 0.25}})
    with pytest.raises(CheckpointError, match=r"dataset '.*words.jsonl' \(train split\) changed since the "
                                              r"checkpoint: its content hash was sha256:[0-9a-f]{12}, it is sha256:"):
        Controller.restore(saved, config=cfg, reward_funcs=[exact])


def test_a_prompt_too_long_after_templating_is_refused_when_the_controller_is_built(tmp_path):
    long = [{"prompt": [{"role": "user", "content": "x" * 50}], "answer": "1"}]
    path = _jsonl(tmp_path / "long.jsonl", WORDS[:3] + long)
    with pytest.raises(ValueError, match=rf"^dataset {re.escape(repr(str(path)))} row 3 column 'prompt' is 69 tokens "
                                         r"after the chat template .* more than the model's context "
                                         r"model.max_position_embeddings 64"):
        _controller(_task(str(path)))


def test_countdown_runs_end_to_end_on_cpu():
    from asyncrl import Controller, load_config

    cfg = load_config("quickstart", groups_per_step=2, group_size=2, eval_every=1, torch_threads=1,
                      task={"name": "countdown", "options": {"train_size": 8, "eval_size": 4}},
                      model={"max_position_embeddings": 512}, generation={"max_new_tokens": 4})
    with Controller.from_config(cfg) as ctrl:
        ctrl.run(2, progress=False)
        detail = ctrl.trace[ctrl.trace.event == "dispatch"].detail.iloc[0]
        assert detail.startswith("<bos>system: You are a helpful assistant.") and "<answer>" in detail
        assert detail.endswith("</answer>.\nassistant: ")
        assert set(ctrl.metrics.reward_mean) <= {0.0, 0.25, 0.5, 0.75, 1.0} and len(ctrl.evaluations) == 3
        ev = ctrl.evaluate(n=2, temperature=1.0)
        assert ev["n"] == 4 and 0.0 <= ev["mean@2"] <= ev["pass@2"] <= 1.0


def test_the_cli_refuses_bad_data_in_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    from asyncrl.cli import main

    out = tmp_path / "run"
    no_prompt = _jsonl(tmp_path / "q.jsonl", [{"question": "2+2="}])
    no_answer = _jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2="}])
    long = _jsonl(tmp_path / "l.jsonl", [{"prompt": "x" * 80, "answer": "1"}])
    cases = [
        ([f"task.options.train={tmp_path / 'nope.jsonl'}"], r"dataset file '.*nope.jsonl' \(task.options.train\) does "
                                                             r"not exist"),
        ([f"task.options.train={no_prompt}"], r"dataset '.*q.jsonl' row 0 \(line 1\) has no column 'prompt'"),
        ([f"task.options.train={no_answer}", 'reward.funcs=["exact_match"]'],
         r"dataset '.*p.jsonl' row 0 has no column 'solution' or 'answer', which reward function exact_match needs"),
        ([f"task.options.train={long}", 'reward.funcs=["exact_match"]'],
         r"dataset '.*l.jsonl' row 0 column 'prompt' is 81 tokens .* more than the model's context"),
        ([f"task.options.train={_jsonl(tmp_path / 'a.jsonl', ROWS)}", 'reward.funcs=["exact_match"]'],
         r"eval_every 25: task 'dataset' has no evaluation split; give it one \(task.options.eval or eval_fraction"),
    ]
    for sets, match in cases:
        argv = ["run", "quickstart", "--steps", "1", "--out", str(out), "--set", "task.name=dataset"]
        assert main(argv + [a for s in sets for a in ("--set", s)]) == 2
        err = capsys.readouterr().err
        assert re.search(match, err), err
        # one line naming it (a configuration error is under the CLI's "invalid configuration" header), no traceback
        assert len([line for line in err.splitlines() if re.search(match, line)]) == 1
        assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err and not out.exists()


def test_from_config_takes_data_objects_and_model_chat_template():
    from asyncrl import Controller, load_config

    def exact(completions, answer, **kwargs):
        return [float(c[0]["content"].strip().startswith(a)) for c, a in zip(completions, answer)]

    template = "{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] }}{% endfor %}{{ '>' }}"
    with pytest.raises(ValueError, match=r"task 'dataset' needs option\(s\) \['train'\]"):
        load_config("quickstart", task={"name": "dataset", "options": {"system_prompt": "Add."}}).task
    cfg = load_config("quickstart", eval_every=None, model={"chat_template": template})
    with Controller.from_config(cfg, train_dataset=pd.DataFrame(WORDS[:12]), eval_dataset=WORDS[12:],
                                reward_funcs=[exact]) as ctrl:
        assert ctrl.task.sources == {"train": "train_dataset (a DataFrame)", "eval": "eval_dataset (a list of dicts)"}
        assert [p.id for p in ctrl.task.eval_prompts] == ["eval/0", "eval/1", "eval/2", "eval/3"]
        prompt = ctrl.stream.get(0)
        assert prompt.text == f"<bos>[user] {prompt.messages[0]['content']}>"  # model.chat_template, not the byte one
        assert ctrl.encode(prompt) == _template_ids(ctrl.tokenizer, prompt.messages, chat_template=template)
        assert ctrl.state_dict()["data"] == ctrl.task.identity


def test_a_trl_dataset_and_trl_reward_functions_train_unchanged_from_a_yaml_file(tmp_path, capsys):
    """TRL's own conventions end to end: a conversational Parquet dataset with a solution column, and TRL's
    accuracy_reward and think_format_reward named in a YAML file, through the CLI."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import pandas as pd
    import yaml

    from asyncrl.cli import main

    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "solution": str(a + b)}
            for a in range(5) for b in range(5)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "sums.parquet"))
    config = {"groups_per_step": 2, "group_size": 4, "eval_every": 1, "torch_threads": 1,
              "sampler": {"name": "in_order", "max_lookahead_versions": 1}, "generation": {"max_new_tokens": 4},
              "loss": {"importance_correction": "token", "truncation": "tis"},
              "task": {"name": "dataset", "options": {"train": str(tmp_path / "sums.parquet"), "eval_fraction": 0.2}},
              "reward": {"funcs": ["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward"]}}
    (tmp_path / "trl_task.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    assert main(["run", str(tmp_path / "trl_task.yaml"), "--steps", "2", "--out", str(out)]) == 0
    metrics = pd.read_csv(out / "metrics.csv")
    assert len(metrics) == 2 and {"reward/accuracy_reward", "reward/think_format_reward"} <= set(metrics.columns)
    completions = pd.read_json(out / "completions.jsonl", lines=True)
    assert completions.prompt.str.startswith("<bos>user: ").all() and completions.prompt_id.str.match(r"train/\d+$").all()
    assert "held-out greedy accuracy" in capsys.readouterr().out
