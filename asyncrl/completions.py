"""The completions log: what the model wrote, one row per completion of every committed group.

A run directory holds it as ``completions.jsonl`` (append-only, one JSON object a line); a controller gives it as
``ctrl.completions`` (a DataFrame) and a recording as ``view.completions(group_id)``. A row: ``group_id``,
``prompt_id``, ``weight_version`` (the group's stamp: the weights it was generated with), ``completion_index``,
``prompt`` (the rendered text the model was given: a conversational prompt as its chat template rendered it; on an
environment run, the rendering with the tools and ``reset``'s text, the ``GroupRollouts``' ``prompt_text``; its
tokens are the ``prompt_tokens``), ``prompt_tokens`` and ``tokens`` (token counts; on a multi-turn run ``tokens``
counts everything after the prompt, the ``env_tokens`` of observations included), ``completion`` (decoded without
special tokens, as the reward functions read it), ``finish_reason``, ``reward`` (the total) and ``reward/<name>``
for each reward function (null where it did not apply).

Invariants:
- Rows are written when their group is committed (scored and in the buffer), a group's rows in one ``write`` of
  whole lines, flushed at once: an interrupt or ``kill -9`` leaves every finished row whole, and a write a full or
  read-only disk refuses part-way is cut back (``asyncrl/run_dir.py``, ``RunDirError``; nothing is written after
  it). A reader ignores a
  last line without its newline (a write cut short), and opening a file to append cuts such a line off first.
- ``log_completions``: ``all`` (default), ``none``, or ``N``: the groups generated with weights ``0, N, 2N, ...``
  (a fact of the group, not of timing: two runs of one seed log the same rows).
- A resumed run keeps the rows its checkpoint had logged (``rows``, saved with the checkpoint) and appends from
  there: rows logged after the save are cut, as those groups are generated again. (A fresh run's file starts
  empty.)
- Without a file the rows stay in memory (a notebook's run); with one, in the file only (a long run's log does
  not grow the process), read back on demand.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.run_dir import RunDirError, append, open_for_append

FILE = "completions.jsonl"
COLUMNS = ("group_id", "prompt_id", "weight_version", "completion_index", "prompt", "prompt_tokens", "tokens",
           "completion", "finish_reason", "reward")


def check_every(value: Any) -> str | int:
    """``log_completions`` as given: ``"all"``, ``"none"`` or a positive step interval, else a one-line error."""
    if value in ("all", "none"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"log_completions {value!r}: 'all', 'none', or N (an int >= 1: the groups generated with "
                     "weights 0, N, 2N, ...)")


def group_rows(group_id: int, prompt: Any, weight_version: int, rollouts: Any,
               parts: dict[str, list] | None) -> list[dict[str, Any]]:
    """The rows of one committed group (``rollouts``: its ``GroupRollouts``, scored; ``parts``: each reward
    function's values, or None when the generation backend scored it)."""
    texts = rollouts.texts or [""] * len(rollouts.completion_ids)
    reasons = rollouts.finish_reasons or [""] * len(texts)
    prompt_id = getattr(prompt, "id", "")
    prompt_text = getattr(rollouts, "prompt_text", None)  # an environment run's rendering: what the model read
    if prompt_text is None:
        prompt_text = prompt.text if hasattr(prompt, "text") else str(prompt)  # once a group: str() of a Prompt is slow
    prompt_tokens = len(rollouts.prompt_ids)
    named = [(f"reward/{name}", values) for name, values in (parts or {}).items()]  # column names once a group
    rows = []
    for i, (ids, text, reason, reward) in enumerate(zip(rollouts.completion_ids, texts, reasons, rollouts.rewards)):
        row = {"group_id": group_id, "prompt_id": prompt_id, "weight_version": weight_version,
               "completion_index": i, "prompt": prompt_text,
               "prompt_tokens": prompt_tokens, "tokens": len(ids), "completion": text,
               "finish_reason": reason, "reward": float(reward)}
        for key, values in named:
            row[key] = values[i]
        if getattr(rollouts, "turns", None):  # multi-turn: turns, tool_calls, env_tokens, turn_versions
            row.update(rollouts.turns[i])
        rows.append(row)
    return rows


def whole_length(path: Path) -> int:
    """The byte length of ``path``'s whole lines (a last line without its newline is not one)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return size
        f.seek(0)
        data = f.read()
    return data.rfind(b"\n") + 1


class CompletionsLog:
    """A run's completions log (see the module's invariants): ``add`` a committed group, ``open`` a file."""

    def __init__(self, every: str | int = "all", names: Sequence[str] = ()):
        self.every = check_every(every)
        self.names = list(names)  # the reward functions, for the columns' order
        self.rows = 0  # rows logged in this run's history (a checkpoint saves it)
        self._memory: list[dict[str, Any]] = []
        self.counts: dict[int, int] = {}  # group id -> rows logged (explain()'s ``completions`` column)
        self._fd: int | None = None
        self.path: Path | None = None
        self.error: RunDirError | None = None  # the write the disk refused: nothing is written after it

    def wants(self, weight_version: int) -> bool:
        if self.every == "none":
            return False
        return self.every == "all" or weight_version % self.every == 0

    def add(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        if self._fd is None:
            self._memory.extend(rows)
        else:  # one write of whole lines, or none (a full disk: cut back, RunDirError); O_APPEND: nothing
            # interleaves, nothing is left in a Python buffer
            if self.error is not None:  # a row written after a refused one would hide the gap
                raise self.error
            try:
                append(self._fd, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode(), self.path)
            except RunDirError as exc:
                self.error = exc
                raise
        self.rows += len(rows)
        for row in rows:
            self.counts[row["group_id"]] = self.counts.get(row["group_id"], 0) + 1

    def open(self, path: str | Path) -> CompletionsLog:
        """Write to ``path`` from now on, appending. The file is first cut to the rows of this run's history it
        should hold (a resumed run's: those logged before its checkpoint; a fresh run's: none), then the rows held
        in memory are written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        keep, end, self.counts = self.rows - len(self._memory), 0, {}
        if path.exists():
            try:
                with open(path, "r+b") as f:
                    for seen, line in enumerate(f):
                        if seen == keep or not line.endswith(b"\n"):
                            break
                        end += len(line)
                        gid = _group_id(line)
                        self.counts[gid] = self.counts.get(gid, 0) + 1
                    f.truncate(end)
            except OSError as exc:
                raise RunDirError(path, exc) from None
        self.close()
        self._fd = open_for_append(path, truncate=False)
        self.path = path
        memory, self._memory = self._memory, []
        self.rows -= len(memory)
        self.add(memory)  # counted again, as the file's rows were
        return self

    def count(self, group_id: int) -> int:
        """Rows logged for group ``group_id`` (0: none, or not yet: it is in flight)."""
        return self.counts.get(int(group_id), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def frame(self):
        """Every row logged (in this process, or in the file), as a DataFrame with ``COLUMNS`` then
        ``reward/<name>`` columns."""
        rows = self._memory if self.path is None else read_rows(self.path)
        return to_frame(rows, self.names)

    def state_dict(self) -> dict[str, int]:
        return {"rows": self.rows}

    def load_state_dict(self, state: dict | None) -> None:
        self.rows = int((state or {}).get("rows", 0))


def _group_id(line: bytes) -> int:
    """The ``group_id`` of a row (written first, so it is read without parsing the line)."""
    head = line[:40]
    if head.startswith(b'{"group_id": '):
        return int(head[13:head.index(b",")])
    return int(json.loads(line)["group_id"])


def read_rows(path: str | Path, start: int = 0, stop: int | None = None) -> list[dict[str, Any]]:
    """The whole rows of ``path`` between two byte offsets (a last line cut short is left out)."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read() if stop is None else f.read(stop - start)
    return [json.loads(line) for line in data.split(b"\n")[:-1] if line]


def to_frame(rows: Iterable[dict[str, Any]], names: Sequence[str] = ()):
    import pandas as pd

    rows = list(rows)
    extra = [f"reward/{n}" for n in names]
    extra += sorted({k for r in rows for k in r if k not in COLUMNS and k not in extra})
    return pd.DataFrame(rows, columns=[*COLUMNS, *extra])


class CompletionsFile:
    """A run directory's ``completions.jsonl`` read by group: an index of each group's byte range, grown as the
    file grows (a live run), so ``group(gid)`` reads only its rows."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offset = 0
        self._groups: dict[int, list[tuple[int, int]]] = {}

    def _scan(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break
                start = self._offset
                self._offset += len(line)
                gid = _group_id(line)
                self._groups.setdefault(gid, []).append((start, self._offset))

    def count(self, group_id: int) -> int:
        """Rows logged for group ``group_id``."""
        self._scan()
        return len(self._groups.get(int(group_id), ()))

    def group(self, group_id: int, names: Sequence[str] = ()):
        """The rows of group ``group_id`` (a DataFrame; empty when it logged none)."""
        self._scan()
        rows = [row for start, stop in self._groups.get(int(group_id), []) for row in read_rows(self.path, start, stop)]
        return to_frame(rows, names)

    def frame(self, names: Sequence[str] = ()):
        return to_frame(read_rows(self.path) if self.path.is_file() else [], names)
