"""A run directory, written live: ``RunFiles`` follows a controller through ``Controller.subscribe`` (``asyncrl run``
uses it) and writes ``trace.csv`` and ``metrics.csv``, one chunk of trace rows per step, and ``trace_index.csv``, one
line per step: where its rows end in ``trace.csv`` and where the rows of the oldest group still alive after it
begin, with the counters the trace does not repeat on every row (dispatch index, prompts taken). ``Recording``
(``asyncrl/recording.py``) reads them back.

Invariants:
- A finished step is on disk: its trace rows, its metrics row and its index line are written and flushed when its
  ``step`` event arrives; the rows after the last step are written by ``close()``.
- Byte offsets in the index never move: the trace and the index have their columns up front.
- Every slot alive after step ``k`` was dispatched at or after ``live_offset`` of step ``k``.
- The index reads only typed trace columns (``dispatch_index`` of ``admit`` rows), never a reason's or detail's
  words.
- ``completions.jsonl`` (what the model wrote) is the controller's own log, pointed at the directory by ``attach``
  and written as groups are committed (``asyncrl/completions.py``).
"""

from __future__ import annotations

import csv
from dataclasses import astuple, dataclass
from pathlib import Path

from asyncrl.completions import FILE as COMPLETIONS_FILE
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
    """A CSV file that grows by rows while a run goes, flushed after every write (one write per finished step: a
    finished step is on disk). With ``columns`` given up front (the trace, the index) the header is written at once,
    byte offsets of rows never move, and rows are sequences in column order, written as they come and not kept.
    Without (the metrics) rows are dicts, kept: a row bringing a new column rewrites the file with the wider header
    (metrics gain ``eval_*`` columns at the first evaluation)."""

    def __init__(self, path: Path, columns: list[str] | None = None):
        self.file = open(path, "w", newline="")
        self.fixed = columns is not None
        self.columns: list[str] = list(columns or [])
        self.rows: list[dict] = []
        self._writer = csv.writer(self.file)
        if self.fixed:
            self._writer.writerow(self.columns)
            self.file.flush()

    def write(self, rows) -> None:
        rows = list(rows)
        if not rows:
            return
        if self.fixed:
            self._writer.writerows(rows)
            self.file.flush()
            return
        self.rows.extend(rows)
        new = list(dict.fromkeys(k for row in rows for k in row if k not in self.columns))
        if new:
            self.columns += new
            self.file.seek(0)
            self.file.truncate()
            writer = csv.DictWriter(self.file, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        else:
            csv.DictWriter(self.file, self.columns).writerows(rows)
        self.file.flush()

    def tell(self) -> int:
        return self.file.tell()

    def close(self) -> None:
        self.file.close()


class RunFiles:
    """``trace.csv``, ``metrics.csv`` and ``trace_index.csv`` of a run directory, written live: ``attach(ctrl)``
    subscribes (with the history, so a resumed run's files start from its checkpoint's history); each finished step
    appends its trace rows, its metrics row and its index line; ``close()`` writes the rows after the last step."""

    def __init__(self, out: str | Path):
        out = self.out = Path(out)
        self.trace = CsvLog(out / TRACE_FILE, TRACE_COLUMNS)
        self.metrics = CsvLog(out / METRICS_FILE)
        self.index = CsvLog(out / INDEX_FILE, INDEX_COLUMNS)
        self._indexer = StepIndexer(self.trace.tell())
        self._events: list[TraceRow] = []
        self._subscription = None

    def attach(self, ctrl) -> RunFiles:
        self._subscription = ctrl.subscribe(self.on_event, history=True)
        ctrl.log_completions_to(self.out / COMPLETIONS_FILE)
        return self

    def on_event(self, event: TraceRow | StepEvent) -> None:
        row = event.row if isinstance(event, StepEvent) else event
        self._events.append(row)
        self._indexer.add(row)
        if isinstance(event, StepEvent):
            self.trace.write(self._events)  # TraceRow: the trace's columns, in order
            self._events.clear()
            self.metrics.write([dict(event.metrics)])
            self.index.write([astuple(self._indexer.step_done(row, self.trace.tell()))])

    def close(self) -> None:
        if self._subscription is not None:
            self._subscription.cancel()
        self.trace.write(self._events)  # after the last step
        self._events.clear()
        for log in (self.trace, self.metrics, self.index):
            log.close()

