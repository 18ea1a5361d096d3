"""Your own data as a task: a table of rows (a JSONL / JSON / Parquet / CSV file, a directory written by
``datasets.Dataset.save_to_disk``, or in Python a ``datasets.Dataset``, a pandas DataFrame or a list of dicts)
read into ``Prompt``s, the way TRL reads a prompt dataset.

TRL's conventions: the ``prompt`` column (``prompt_key``) is a string (standard) or a list of ``{"role",
"content"}`` messages (conversational); every other column stays with its prompt (``Prompt.columns``) and reaches
the reward functions as a keyword argument. ``system_prompt`` makes a standard prompt conversational (a system and
a user message) and is put before a conversational prompt that has no system message of its own.

Invariants:
- Every row is checked when the task is built, before anything runs: a missing file, an unknown format, a row
  without the prompt column, an empty or malformed prompt, a value that is not JSON. Each is one ``ValueError``
  naming the source, the row (0-based, as in the prompt ids) and the column, and what is allowed.
- Values are plain JSON once read (numpy and Arrow values converted, tuples become lists), so a ``Prompt``'s
  columns survive a checkpoint equal. Prompt ids are ``<split>/<row>``: the row's 0-based index in its split.
- ``fingerprint`` is a content hash per split (sha256 of a file's bytes, of every file of a saved directory, or
  of the rows' canonical JSON for an object), so a checkpoint can tell that its data changed (``data_changed``).
- A file is read once for as long as it is unchanged (same size and modification time): the config checks a
  task by building it, and the controller builds it again (``_TASKS``, the last two tasks built).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import numbers
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.prompts import Prompt

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ALLOWED = ("a .jsonl, .json, .parquet or .csv file, or a directory written by datasets.Dataset.save_to_disk "
           "(in Python also a datasets.Dataset, a pandas DataFrame or a list of dicts)")
JSON_VALUES = "strings, numbers, booleans, null, and lists and objects of them"
ANSWER_KEYS = ("answer", "solution")  # the column a toy-style ``Prompt.answer`` (and the constant-answer bar) reads


class DataError(ValueError):
    """Bad data or dataset options: the message names the source, the row and the column, and what is allowed."""


class Table:
    """A source read into rows: ``name`` (how errors name it: ``'data/train.jsonl'``), ``rows`` (dicts of JSON
    values), ``fingerprint`` (``sha256:<hex>``), ``lines`` (a JSONL file: the 1-based line of each row)."""

    def __init__(self, name: str, rows: list[dict], fingerprint: str, lines: list[int] | None = None):
        self.name, self.rows, self.fingerprint, self.lines = name, rows, fingerprint, lines

    def where(self, row: int) -> str:
        line = f" (line {self.lines[row]})" if self.lines is not None else ""
        return f"dataset {self.name} row {row}{line}"


# --- reading ----------------------------------------------------------------------------------------------------
def read_table(source: Any, role: str = "train") -> Table:
    """Rows of ``source`` (see the module docstring); ``role`` names the option in errors (``train``/``eval``)."""
    if isinstance(source, (str, Path)):
        return _read_path(Path(source), role)
    if isinstance(source, list):
        if not all(isinstance(row, dict) for row in source):
            bad = next(i for i, row in enumerate(source) if not isinstance(row, dict))
            raise DataError(f"{role} dataset (a list) row {bad} is a {type(source[bad]).__name__}, not a dict; "
                             f"allowed: {ALLOWED}")
        name = f"{role}_dataset (a list of dicts)"
        return _from_rows(name, [_plain_row(row, name, i) for i, row in enumerate(source)])
    kind = type(source).__module__.split(".")[0] + "." + type(source).__name__
    if kind == "pandas.DataFrame":
        name = f"{role}_dataset (a DataFrame)"
        return _from_rows(name, [_plain_row(row, name, i) for i, row in enumerate(source.to_dict("records"))])
    if kind == "datasets.Dataset":
        name = f"{role}_dataset (a datasets.Dataset)"
        return _from_rows(name, [_plain_row(row, name, i) for i, row in enumerate(source.to_list())])
    if kind == "datasets.DatasetDict":
        raise DataError(f"{role} dataset is a datasets.DatasetDict with splits {sorted(source)}: pass one split "
                         f"(e.g. dataset[{sorted(source)[0]!r}])")
    raise DataError(f"{role} dataset: cannot read a {kind}; allowed: {ALLOWED}")


def _read_path(path: Path, role: str) -> Table:
    name = repr(str(path))
    if not path.exists():
        raise DataError(f"dataset file {name} (task.options.{role}) does not exist; allowed: {ALLOWED}")
    if path.is_dir():
        return _read_saved(path, name, role)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"dataset file {name} (task.options.{role}): unknown format {path.suffix or '(none)'!r}; "
                         f"allowed: {ALLOWED}")
    data = path.read_bytes()
    fingerprint = "sha256:" + hashlib.sha256(data).hexdigest()
    if fmt in ("jsonl", "json", "csv"):
        _check_utf8(data, name, fmt)
    if fmt == "jsonl":
        rows, lines = _json_lines(data, name)
        return Table(name, rows, fingerprint, lines)
    if fmt == "json":
        return _read_json(data, name, fingerprint)
    if fmt == "parquet":
        pq = _need("pyarrow.parquet", name)

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow's errors for a damaged file share no useful base class
            raise DataError(f"dataset file {name}: not a readable Parquet file ({_short(exc)})") from None
    else:
        import pandas as pd

        try:  # types inferred as datasets' CSV reader does; an empty field stays "" (not NaN)
            rows = pd.read_csv(path, keep_default_na=False).to_dict("records")
        except Exception as exc:
            raise DataError(f"dataset file {name}: not a readable CSV file ({_short(exc)})") from None
    return Table(name, [_plain_row(row, name, i) for i, row in enumerate(rows)], fingerprint)


def _check_utf8(data: bytes, name: str, fmt: str) -> None:
    """A text dataset file is UTF-8; a byte that is not is named by its line and column, where an editor finds it,
    and its row where a line is a row (JSON Lines: the non-blank lines before it; CSV: after the header)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        before = data[:data.rfind(b"\n", 0, exc.start) + 1].splitlines()
        row = {"jsonl": sum(1 for b in before if b.strip()), "csv": line - 2}.get(fmt)
        raise DataError(f"dataset file {name} line {line}{f' (row {row})' if row is not None else ''}: not UTF-8 "
                         f"text (byte {data[exc.start]:#04x} at column {column}, byte offset {exc.start}); save the "
                         "file as UTF-8") from None


def _json_lines(data: bytes, name: str) -> tuple[list[dict], list[int]]:
    rows, lines = [], []
    for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"dataset file {name} line {number} (row {len(rows)})"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: a JSON {type(row).__name__}, not an object of columns")
        rows.append(row)
        lines.append(number)
    return rows, lines


def _read_json(data: bytes, name: str, fingerprint: str) -> Table:
    try:
        whole = json.loads(data)
    except json.JSONDecodeError as exc:
        if exc.msg != "Extra data":
            raise DataError(f"dataset file {name}: not JSON ({exc.msg} at line {exc.lineno})") from None
        rows, lines = _json_lines(data, name)  # JSON Lines in a .json file, as datasets reads it
        return Table(name, rows, fingerprint, lines)
    if isinstance(whole, dict) and whole and all(isinstance(v, list) for v in whole.values()):
        lengths = {len(v) for v in whole.values()}
        if len(lengths) != 1:
            raise DataError(f"dataset file {name}: an object of columns of different lengths {sorted(lengths)}")
        whole = [dict(zip(whole, values)) for values in zip(*whole.values())]
    if not isinstance(whole, list):
        raise DataError(f"dataset file {name}: a JSON {type(whole).__name__}; allowed: a list of row objects, "
                         "an object of equal-length column lists, or JSON Lines")
    for i, row in enumerate(whole):
        if not isinstance(row, dict):
            raise DataError(f"dataset file {name} row {i}: a JSON {type(row).__name__}, not an object of columns")
    return Table(name, whole, fingerprint)


def _read_saved(path: Path, name: str, role: str) -> Table:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"dataset directory {name} holds a datasets.DatasetDict with splits {splits}: name one "
                         f"split's directory (e.g. {str(path / (splits[0] if splits else 'train'))!r})")
    if not (path / "state.json").is_file():
        raise DataError(f"dataset directory {name} (task.options.{role}) was not written by "
                         f"datasets.Dataset.save_to_disk (no state.json); allowed: {ALLOWED}")
    load_from_disk = _need("datasets", name).load_from_disk
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0" + file.read_bytes())
    rows = load_from_disk(str(path)).to_list()
    return Table(name, [_plain_row(row, name, i) for i, row in enumerate(rows)], "sha256:" + digest.hexdigest())


def _need(module: str, name: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"dataset {name} needs the {module.split('.')[0]} package: pip install 'asyncrl[data]'") from None


def _from_rows(name: str, rows: list[dict]) -> Table:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    return Table(name, rows, "sha256:" + digest.hexdigest())


def _plain_row(row: dict, name: str, i: int) -> dict:
    out = {}
    for key, value in row.items():
        if not isinstance(key, str):
            raise DataError(f"dataset {name} row {i}: column name {key!r} is not a string")
        out[key] = _plain(value, lambda: f"dataset {name} row {i} column {key!r}")
    return out


def _plain(value: Any, where: Callable[[], str]) -> Any:
    """``value`` as plain JSON (numpy scalars and arrays, tuples, Arrow's lists and structs converted)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise DataError(f"{where()}: an object with non-string keys; allowed: {JSON_VALUES}")
        return {k: _plain(v, where) for k, v in value.items()}
    if isinstance(value, numbers.Number):
        return float(value)
    raise DataError(f"{where()} holds a {type(value).__name__} ({str(value)[:40]!r}); allowed: {JSON_VALUES} "
                     "(convert or drop the column)")


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160] or type(exc).__name__


# --- rows into prompts ------------------------------------------------------------------------------------------
def _messages(value: Any, where: str, key: str) -> list[dict] | None:
    """A conversational prompt's messages, checked (None for a standard prompt)."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where} column {key!r} is an empty prompt; allowed: a non-empty string or a "
                             "non-empty list of {'role', 'content'} messages")
        return None
    if not isinstance(value, list) or not value:
        shown = "an empty list" if value == [] else f"{type(value).__name__} {str(value)[:40]!r}"
        raise DataError(f"{where} column {key!r} is {shown}; allowed: a non-empty string (standard) or a non-empty "
                         "list of {'role', 'content'} messages (conversational)")
    for j, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"]
                and isinstance(message.get("content"), str)):
            raise DataError(f"{where} column {key!r} message {j} is {str(message)[:60]!r}; allowed: an object with a "
                             "'role' string and a 'content' string")
    if not any(m["content"].strip() for m in value):
        raise DataError(f"{where} column {key!r} is an empty prompt: every message's content is empty")
    return value


def _answer(row: dict) -> str:
    for key in ANSWER_KEYS:
        value = row.get(key)
        if isinstance(value, str) or (isinstance(value, numbers.Number) and not isinstance(value, bool)):
            return str(value)
    return ""


def table_prompts(table: Table, split: str, prompt_key: str = "prompt", system_prompt: str | None = None,
                  rows: Iterable[int] | None = None) -> list[Prompt]:
    """One ``Prompt`` per row (``rows``: which of the table's rows, in order; default all), ids ``<split>/<i>``."""
    out = []
    for i, r in enumerate(range(len(table.rows)) if rows is None else rows):
        row = table.rows[r]
        where = table.where(r)
        if prompt_key not in row:
            raise DataError(f"{where} has no column {prompt_key!r} (task.options.prompt_key); its columns are "
                             f"{sorted(row)}")
        messages = _messages(row[prompt_key], where, prompt_key)
        if system_prompt is not None:
            if messages is None:
                messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": row[prompt_key]}]
            elif not any(m["role"] == "system" for m in messages):
                messages = [{"role": "system", "content": system_prompt}, *messages]
        text = row[prompt_key] if messages is None else ""
        columns = {k: v for k, v in row.items() if k != prompt_key}
        out.append(Prompt(text, _answer(row), f"{split}/{i}", messages, columns))
    return out


# --- the task ---------------------------------------------------------------------------------------------------
class DatasetTask:
    """Prompts from a table: ``train_prompts``, ``eval_prompts`` (from ``eval``, a seeded ``eval_fraction`` of the
    training rows, or none), ``fingerprint`` and ``sources`` per split, ``where(prompt_id)`` naming a prompt's row.
    A dataset has no reward of its own: the run's reward functions score it (``reward.funcs``)."""

    name = "dataset"

    def __init__(self, train_prompts: list[Prompt], eval_prompts: list[Prompt], sources: dict[str, str],
                 fingerprint: dict[str, str], origin: dict[str, list[int] | None] | None = None,
                 name: str = "dataset", prompt_key: str = "prompt"):
        self.name, self.prompt_key = name, prompt_key
        self.train_prompts, self.eval_prompts = train_prompts, eval_prompts
        self.sources, self.fingerprint = sources, fingerprint
        self._origin = origin or {}  # split -> the source row of each split row (an eval_fraction split)
        self.held_out = bool(eval_prompts)  # no evaluation prompt is a training row

    @property
    def identity(self) -> dict:
        """What a checkpoint keeps to know its data again: each split's source and content hash."""
        return {split: {"source": self.sources[split], "hash": digest} for split, digest in self.fingerprint.items()}

    @property
    def conversational(self) -> bool:
        return any(p.messages is not None for p in self.train_prompts + self.eval_prompts)

    def split(self, name: str) -> list[Prompt]:
        """The prompts of split ``name`` ("train" or "eval")."""
        if name not in ("train", "eval"):
            raise DataError(f"unknown split {name!r}; splits: 'train', 'eval'")
        prompts = self.train_prompts if name == "train" else self.eval_prompts
        if not prompts:
            raise DataError(f"task {self.name!r} has no {name!r} split: set task.options.eval (a file) or "
                             "task.options.eval_fraction")
        return prompts

    def where(self, prompt_id: str) -> str:
        """``dataset 'train.jsonl' row 17`` for ``train/17`` (the source row, which an eval_fraction split maps)."""
        split, _, row = prompt_id.partition("/")
        origin = self._origin.get(split)
        r = int(row)
        return f"dataset {self.sources.get(split, split)} row {origin[r] if origin else r}"

    @cached_property
    def constant_answer_accuracy(self) -> float:
        """With an answer column: the share of evaluation rows whose answer is the most common one (what one
        answer given to every prompt scores under exact match); NaN without answers or an evaluation split."""
        answers = [p.answer for p in self.eval_prompts]
        if not answers or not all(answers):
            return float("nan")
        _, counts = np.unique(answers, return_counts=True)
        return float(counts.max() / len(answers))

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        raise ValueError(f"task {self.name!r} has no reward of its own: name reward functions (reward.funcs in a "
                         "config, or Controller.from_config(cfg, reward_funcs=[...]))")

    def is_correct(self, prompt: Prompt, completion_text: str) -> bool:
        return self.reward(prompt, completion_text) >= 1.0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, train={len(self.train_prompts)} from "
                f"{self.sources.get('train')}, eval={len(self.eval_prompts)})")


_TASKS: OrderedDict[str, DatasetTask] = OrderedDict()  # the last tasks built from files, by options and file states


def _file_state(path: Path) -> list:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.exists()]


def dataset_task(train: Any, eval: Any = None, eval_fraction: float | None = None, prompt_key: str = "prompt",
                 system_prompt: str | None = None, split_seed: int = 0) -> DatasetTask:
    """The ``dataset`` task: ``train`` (a path or an object, see the module docstring), ``eval`` (the same, an
    evaluation split of its own) or ``eval_fraction`` (a share of the training rows held out, chosen by
    ``split_seed``), ``prompt_key`` (the prompt column), ``system_prompt`` (a system message for every prompt)."""
    if not isinstance(prompt_key, str) or not prompt_key:
        raise DataError(f"prompt_key must be a column name, got {prompt_key!r}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise DataError(f"system_prompt must be a string, got {system_prompt!r}")
    if eval is not None and eval_fraction is not None:
        raise DataError(f"give eval (a dataset of its own) or eval_fraction, not both (got eval={eval!r}, "
                         f"eval_fraction={eval_fraction})")
    if eval_fraction is not None and not (isinstance(eval_fraction, numbers.Real) and 0 < eval_fraction < 1):
        raise DataError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    paths = [s for s in (train, eval) if isinstance(s, (str, Path))]
    key = None
    if len(paths) == sum(s is not None for s in (train, eval)):  # all from files: cacheable while they are unchanged
        states = [_file_state(Path(s)) for s in paths]
        key = json.dumps([str(train), str(eval), eval_fraction, prompt_key, system_prompt, split_seed, states])
        if key in _TASKS:
            _TASKS.move_to_end(key)
            return _TASKS[key]
    task = _build(train, eval, eval_fraction, prompt_key, system_prompt, split_seed)
    if key is not None:
        _TASKS[key] = task
        while len(_TASKS) > 2:
            _TASKS.popitem(last=False)
    return task


def _build(train, eval, eval_fraction, prompt_key, system_prompt, split_seed) -> DatasetTask:
    table = read_table(train, "train")
    if not table.rows:
        raise DataError(f"dataset {table.name} (task.options.train) has no rows; a run needs at least one")
    sources, fingerprint, origin = {"train": table.name}, {"train": table.fingerprint}, {}
    train_rows = None
    if eval_fraction is not None:
        n = len(table.rows)
        n_eval = max(1, round(eval_fraction * n))
        if n_eval >= n:
            raise DataError(f"eval_fraction {eval_fraction} of dataset {table.name}'s {n} rows leaves none to train on")
        held = np.sort(np.random.default_rng(split_seed).permutation(n)[:n_eval])
        keep = np.ones(n, dtype=bool)
        keep[held] = False
        train_rows, eval_rows = np.flatnonzero(keep).tolist(), held.tolist()
        origin = {"train": train_rows, "eval": eval_rows}
        sources["eval"], fingerprint["eval"] = table.name, table.fingerprint
        eval_prompts = table_prompts(table, "eval", prompt_key, system_prompt, eval_rows)
    elif eval is not None:
        eval_table = read_table(eval, "eval")
        sources["eval"], fingerprint["eval"] = eval_table.name, eval_table.fingerprint
        eval_prompts = table_prompts(eval_table, "eval", prompt_key, system_prompt)
    else:
        eval_prompts = []
    train_prompts = table_prompts(table, "train", prompt_key, system_prompt, train_rows)
    return DatasetTask(train_prompts, eval_prompts, sources, fingerprint, origin, prompt_key=prompt_key)


# --- checks a run makes against its data ------------------------------------------------------------------------
def data_changed(saved: dict | None, task: Any) -> str | None:
    """One line when ``task``'s data is not the data a checkpoint trained on (``saved``: the task's ``identity``
    then), else None."""
    if not saved:
        return None
    now = getattr(task, "identity", None) or {}
    for split, was in saved.items():
        if split not in now:
            return (f"the checkpoint was trained on dataset {was['source']} ({split} split), and this run has no such "
                    f"data (task {task.name!r}): give the same data (task.options.{split}, or {split}_dataset=)")
        if now[split]["hash"] != was["hash"]:
            return (f"dataset {now[split]['source']} ({split} split) changed since the checkpoint: its content hash "
                    f"was {was['hash'][:19]}, it is {now[split]['hash'][:19]}; restore with the data the run trained on")
    return None


TRL_ARGUMENTS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                 "environments"}  # environments: what an environment run passes (TRL's keyword), not a column


def required_columns(func: Callable) -> list[tuple[str, ...]]:
    """The columns a reward function needs, each as the names any one of which will do: its
    ``required_columns`` attribute when it has one (``[("solution", "answer")]``), else the parameters without a
    default that TRL would not pass itself."""
    declared = getattr(func, "required_columns", None)
    if declared is not None:
        return [tuple([c]) if isinstance(c, str) else tuple(c) for c in declared]
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return []
    return [(p.name,) for p in parameters if p.default is inspect.Parameter.empty and p.name not in TRL_ARGUMENTS
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_reward_columns(task: Any, funcs: Iterable[Callable]) -> None:
    """Every row of ``task`` has the columns each reward function needs; else one line naming the row, the column
    and the function."""
    where = getattr(task, "where", lambda pid: f"task {task.name!r} prompt {pid!r}")
    prompt_key = getattr(task, "prompt_key", "prompt")  # the row's prompt column is one of its columns too
    needs = [(getattr(f, "__name__", repr(f)), need) for f in funcs for need in required_columns(f)]
    if not needs:
        return
    for prompt in list(task.train_prompts) + list(task.eval_prompts):
        for name, need in needs:
            if not any(column in prompt.columns for column in need):
                wanted = " or ".join(repr(c) for c in need)
                raise DataError(f"{where(prompt.id)} has no column {wanted}, which reward function {name} needs; "
                                 f"its columns are {sorted({prompt_key, *prompt.columns})}")
