"""A run directory, written live: ``RunFiles`` follows a controller through ``Controller.subscribe`` (``asyncrl run``
uses it) and writes ``trace.csv`` and ``metrics.csv``, one chunk of trace rows per step, and ``trace_index.csv``, one
line per step: where its rows end in ``trace.csv`` and where the rows of the oldest group still alive after it
begin, with the counters the trace does not repeat on every row (dispatch index, prompts taken). ``Recording``
(``asyncrl/recording.py``) reads them back.

Invariants:
- A finished step is on disk: its trace rows, its metrics row and its index line are written, in that order, each
  in one system call, when its ``step`` event arrives; the rows after the last step are written by ``close()``.
- Whole rows or nothing: a write the disk refuses part-way is cut back (``asyncrl/run_dir.py``) and raised as
  ``RunDirError`` (one line naming the file), and nothing is written after it; so an index line is never on disk
  without its step's trace rows and metrics row, which lets ``whole_steps`` tell a damaged directory (a copy cut
  short, a file cut mid-row) from a live one.
- Byte offsets in the index never move: the trace and the index have their columns up front.
- Every slot alive after step ``k`` was dispatched at or after ``live_offset`` of step ``k``.
- The index reads only typed trace columns (``dispatch_index`` of ``admit`` rows), never a reason's or detail's
  words.
- ``completions.jsonl`` (what the model wrote) is the controller's own log, pointed at the directory by ``attach``
  and written as groups are committed (``asyncrl/completions.py``).
"""

from __future__ import annotations

import csv
import io
import os
import re
import warnings
from dataclasses import astuple, dataclass
from pathlib import Path

from asyncrl.completions import FILE as COMPLETIONS_FILE, whole_length
from asyncrl.run_dir import RunDirError, append, open_for_append, replace
from asyncrl.trace import ABORT, ADMIT, DISPATCH, EVICT, SELECT, SKIP, TRACE_COLUMNS, StepEvent, TraceRow

TRACE_FILE, METRICS_FILE, INDEX_FILE, CONFIG_FILE = "trace.csv", "metrics.csv", "trace_index.csv", "config.yaml"
ENDS = (SELECT, EVICT, ABORT, SKIP)  # the events that take a group out of the buffer
INDEX_COLUMNS = ["step", "seq", "offset", "live_seq", "live_offset", "dispatch_index", "data_position"]


@dataclass(frozen=True)
class IndexEntry:
    """One line of ``trace_index.csv``: step ``step``'s ``step`` row is trace row ``seq``; its rows end at
    ``offset`` (a byte offset in ``trace.csv``, or a row number for a recording of a live controller); every group
    alive after it was dispatched at or after row ``live_seq`` (at ``live_offset``)."""

    step: int
    seq: int
    offset: int
    live_seq: int
    live_offset: int
    dispatch_index: int
    data_position: int


class StepIndexer:
    """Follows the trace row by row and makes one ``IndexEntry`` per step. ``start`` is where the first row begins;
    ``step_done(row, end)`` is called with a ``step`` row and where the rows through it end."""

    def __init__(self, start: int = 0) -> None:
        self.entries: list[IndexEntry] = []
        self._alive: dict[int, tuple[int, int]] = {}  # group id -> (seq, offset) of its step's first row
        self._chunk = (0, start)
        self.dispatch_index, self.data_position = -1, 0

    def add(self, row: TraceRow) -> None:
        if row.event == DISPATCH:
            self._alive[row.group_id] = self._chunk
            self.data_position += 1
        elif row.event in ENDS:
            self._alive.pop(row.group_id, None)
        elif row.event == ADMIT and row.dispatch_index is not None:  # None: a row from before the column
            self.dispatch_index = row.dispatch_index

    def step_done(self, row: TraceRow, end: int) -> IndexEntry:
        live_seq, live_offset = min(self._alive.values(), default=(row.seq + 1, end))
        entry = IndexEntry(row.trainer_version - 1, row.seq, end, live_seq, live_offset, self.dispatch_index,
                           self.data_position)
        self.entries.append(entry)
        self._chunk = (row.seq + 1, end)
        return entry


class CsvLog:
    """A CSV file that grows by rows while a run goes, each ``write`` one system call of whole rows (a finished step
    is on disk; a write the disk refuses part-way is cut back and raised as ``RunDirError``: ``asyncrl/run_dir.py``).
    With ``columns`` given up front (the trace, the index) the header is written at once, byte offsets of rows never
    move, and rows are sequences in column order, written as they come and not kept. Without (the metrics) rows are
    dicts, kept: a row bringing a new column replaces the file with one of the wider header (written beside it and
    renamed over it: a reader sees the old file or the new; metrics gain ``eval_*`` columns at the first
    evaluation)."""

    def __init__(self, path: Path, columns: list[str] | None = None):
        self.path = path
        self.fd = open_for_append(path)
        self.fixed = columns is not None
        self.columns: list[str] = list(columns or [])
        self.rows: list[dict] = []
        if self.fixed:
            self._append([self.columns])

    def _text(self, rows, header: bool = False) -> bytes:
        text = io.StringIO(newline="")
        if self.fixed:
            csv.writer(text).writerows(rows)
        else:
            writer = csv.DictWriter(text, self.columns)
            if header:
                writer.writeheader()
            writer.writerows(rows)
        return text.getvalue().encode()

    def _append(self, rows, header: bool = False) -> None:
        append(self.fd, self._text(rows, header), self.path)

    def write(self, rows) -> None:
        rows = list(rows)
        if not rows:
            return
        if self.fixed:
            self._append(rows)
            return
        new = list(dict.fromkeys(k for row in rows for k in row if k not in self.columns))
        if new:
            columns, self.columns = self.columns, self.columns + new
            try:
                replace(self.path, self._text([*self.rows, *rows], header=True))
            except RunDirError:
                self.columns = columns
                raise
            os.close(self.fd)
            self.fd = open_for_append(self.path, truncate=False)
        else:
            self._append(rows, header=not self.rows)
        self.rows.extend(rows)

    def tell(self) -> int:
        return os.lseek(self.fd, 0, os.SEEK_END)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RunFiles:
    """``trace.csv``, ``metrics.csv`` and ``trace_index.csv`` of a run directory, written live: ``attach(ctrl)``
    subscribes (with the history, so a resumed run's files start from its checkpoint's history); each finished step
    appends its trace rows, its metrics row and its index line; ``close()`` writes the rows after the last step.
    A file that cannot be written (``RunDirError``, raised into the tick that delivered the step, which stops a run)
    ends the writing: every file keeps its whole rows, and nothing more is written (``error`` holds it)."""

    def __init__(self, out: str | Path):
        out = self.out = Path(out)
        self.trace = CsvLog(out / TRACE_FILE, TRACE_COLUMNS)
        self.metrics = CsvLog(out / METRICS_FILE)
        self.index = CsvLog(out / INDEX_FILE, INDEX_COLUMNS)
        self._indexer = StepIndexer(self.trace.tell())
        self._events: list[TraceRow] = []
        self._subscription = None
        self.error: RunDirError | None = None

    def attach(self, ctrl) -> RunFiles:
        self._subscription = ctrl.subscribe(self.on_event, history=True)
        ctrl.log_completions_to(self.out / COMPLETIONS_FILE)
        return self

    def on_event(self, event: TraceRow | StepEvent) -> None:
        if self.error is not None:  # the files end at the last step written whole
            return
        row = event.row if isinstance(event, StepEvent) else event
        self._events.append(row)
        self._indexer.add(row)
        if isinstance(event, StepEvent):
            # in this order (``whole_steps`` relies on it): a step's index line is written after its rows
            self._write(self.trace, self._events)  # TraceRow: the trace's columns, in order
            self._events.clear()
            self._write(self.metrics, [dict(event.metrics)])
            self._write(self.index, [astuple(self._indexer.step_done(row, self.trace.tell()))])

    def _write(self, log: CsvLog, rows) -> None:
        try:
            log.write(rows)
        except OSError as exc:
            self.error = exc if isinstance(exc, RunDirError) else RunDirError(log.path, exc)
            raise self.error from None

    def close(self) -> None:
        """Stop following, write the rows after the last step (unless a write failed before) and close the files;
        a failure here is raised as ``RunDirError`` too, after every file is closed."""
        if self._subscription is not None:
            self._subscription.cancel()
        try:
            if self.error is None:
                self._write(self.trace, self._events)  # after the last step
        finally:
            self._events.clear()
            for log in (self.trace, self.metrics, self.index):
                log.close()


# ------------------------------------------------------------------------------------ reading damage honestly
class RecordingDamaged(UserWarning):
    """A run directory whose files end mid-row (a full disk, a kill mid-write, a copy cut short): the recording opens
    through its last whole step. The message names the file and where it ends."""


def _lines_before(path: Path, end: int) -> int:
    """How many lines ``path`` holds before byte ``end``."""
    with open(path, "rb") as f:
        return f.read(end).count(b"\n")


def _rows_before(path: Path, end: int) -> int:
    """How many rows (lines after the header) a CSV file holds before byte ``end``."""
    return max(0, _lines_before(path, end) - 1)


def whole_steps(run_dir: Path, entries: list[IndexEntry], indexed: bool) -> int | None:
    """How many of ``entries`` (the steps the index, or a scan of trace.csv, found) every file of ``run_dir``
    holds whole, with a ``RecordingDamaged`` warning for each file that ends short (None: all of them).

    What counts as damage, and why a live run's directory never shows it: ``RunFiles`` flushes a step's trace rows,
    then its metrics row, then its index line, so an index line whose trace rows or metrics row is not whole was cut
    after it was written. A trace row cut short after the last indexed step cuts no step the recording holds, but
    a row goes out in one write, so it is damage too (a live run shows one only for the instant of a write), and so
    is a completions row cut short (a group's rows are one write of whole lines)."""
    whole, notes = len(entries), []

    def cut(k: int, text: str) -> None:  # step ``entries[k]`` is the first the file does not hold whole
        nonlocal whole
        whole = min(whole, k)
        notes.append(text)

    def ends(path: Path, rows: int, size: int, end: int) -> str:
        return f"{path.name} ends {'mid-row ' if size > end else ''}after {rows} whole rows (byte {end} of {size})"

    trace = run_dir / TRACE_FILE
    size, end = trace.stat().st_size, whole_length(trace)
    k = next((i for i, e in enumerate(entries) if e.offset > end), len(entries))
    if k < len(entries) or size > end:  # a trailing row cut short after the last indexed step is damage too
        step = entries[k].step if k < len(entries) else (entries[-1].step + 1 if entries else 0)
        cut(k, f"{ends(trace, _rows_before(trace, end), size, end)}, inside step {step}'s rows")

    metrics = run_dir / METRICS_FILE
    size, end = metrics.stat().st_size, whole_length(metrics)
    rows = _rows_before(metrics, end)
    if rows < len(entries):
        cut(rows, f"{ends(metrics, rows, size, end)}, before step {entries[rows].step}'s row")

    completions = run_dir / COMPLETIONS_FILE
    if completions.is_file() and completions.stat().st_size > whole_length(completions):
        size, end = completions.stat().st_size, whole_length(completions)
        with open(completions, "rb") as f:
            f.seek(end)
            head = re.match(rb'\{"group_id": (\d+)', f.read(64))
        text = ends(completions, _lines_before(completions, end), size, end)
        if head is None:
            cut(len(entries), text)
        else:  # its group's rows are missing from the step that committed it on
            gid = int(head.group(1))
            with open(trace, "rb") as f:
                found = re.search(rb"^(\d+),commit,-?\d+,%d," % gid, f.read(whole_length(trace)), re.MULTILINE)
            k = len(entries) if found is None else next(
                (i for i, e in enumerate(entries) if e.seq >= int(found.group(1))), len(entries))
            step = f", in a row of group {gid}" + (f", committed in step {entries[k].step}" if k < len(entries) else "")
            cut(k, text + step)
    span = f"steps {entries[0].step}..{entries[whole - 1].step}" if whole else "no step"
    for text in notes:
        warnings.warn(RecordingDamaged(f"{text}: the recording reads its whole steps only, {span}"), stacklevel=3)
    return whole if whole < len(entries) else None
