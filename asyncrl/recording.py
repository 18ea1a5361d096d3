"""A run as a flight recording: ``Recording(run_dir or controller)`` scrubs to any finished step, or any trace row
inside one, and gives a read-only view of the controller as it stood there, re-judged by the run's own sampler.

What makes that possible: the trace records every event with the stamps of its group (a ``dispatch`` row carries
the slot's ``weight_version`` and ``target_step``; ``commit`` makes it ready; ``select``/``evict``/``abort``/``skip``
remove it), so the buffer at any row is the slots dispatched and not yet removed. ``RunFiles`` writes a run
directory live through ``Controller.subscribe`` (``asyncrl run`` uses it): ``trace.csv`` and ``metrics.csv``, one
chunk of trace rows per step, and ``trace_index.csv``, one line per step: where its rows end in ``trace.csv`` and
where the rows of the oldest group still alive after it begin, with the counters the trace does not repeat on
every row (dispatch index, prompts taken). A scrub reads only that stretch of ``trace.csv``, so it costs the same at
step 10 or step 100,000, and opening reads one index line and one metrics row per step
(``benchmarks/bench_recording.py``: 100k steps open in ~5 s, a scrub takes ~5 ms; benchmarks/README.md).

Invariants:
- A view at step ``k`` is the state right after the ``step`` row of step ``k`` (the end of the train tick that took
  its optimizer step): ``view.explain()`` equals the live controller's ``explain()`` then, row for row
  (``tests/test_recording.py`` checks it for every built-in sampler). ``at(k, event=i)`` is the state right after the
  ``i``-th trace row of step ``k`` (rows after step ``k - 1``'s ``step`` row, through step ``k``'s).
- Every slot alive after step ``k`` was dispatched at or after ``live_offset`` of step ``k``: the index says so when
  it is written, so a scrub never needs older rows.
- A custom sampler named in a run directory is imported only with ``trust_code=True`` (as for restore); without
  it a view shows the step's recorded decisions instead of re-judging (``explain()`` says so in ``.attrs``).
- Read-only: a view has no ticks; nothing here writes to a controller.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from dataclasses import astuple, dataclass
from pathlib import Path
import pandas as pd

from asyncrl import metrics as M
from asyncrl.buffer import ReplayBuffer
from asyncrl.reports import ControllerState
from asyncrl.samplers import StalenessWindow, build_sampler, explain_frame
from asyncrl.trace import (
    ABORT, ADMIT, COMMIT, DISPATCH, EVICT, SELECT, SKIP, STEP, TRACE_COLUMNS, TRACE_DTYPES, StepEvent, TraceRow,
)

TRACE_FILE, METRICS_FILE, INDEX_FILE, CONFIG_FILE = "trace.csv", "metrics.csv", "trace_index.csv", "config.yaml"
ENDS = (SELECT, EVICT, ABORT, SKIP)  # the events that take a group out of the buffer
INDEX_COLUMNS = ["step", "seq", "offset", "live_seq", "live_offset", "dispatch_index", "data_position"]
_INT_COLUMNS = [c for c in TRACE_COLUMNS if c not in ("event", "detail", "reason")]
_REPLICA = re.compile(r" on replica (\d+)$")
_GENERATED = re.compile(r"generated with weights (\d+)\.\.(\d+)")


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
        elif row.event == ADMIT:
            self.dispatch_index = int(row.detail.rsplit(" ", 1)[-1])  # "batch k"

    def step_done(self, row: TraceRow, end: int) -> IndexEntry:
        live_seq, live_offset = min(self._alive.values(), default=(row.seq + 1, end))
        entry = IndexEntry(row.trainer_version - 1, row.seq, end, live_seq, live_offset, self.dispatch_index,
                           self.data_position)
        self.entries.append(entry)
        self._chunk = (row.seq + 1, end)
        return entry


# ------------------------------------------------------------------------------------------- writing a run
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
        out = Path(out)
        self.trace = CsvLog(out / TRACE_FILE, TRACE_COLUMNS)
        self.metrics = CsvLog(out / METRICS_FILE)
        self.index = CsvLog(out / INDEX_FILE, INDEX_COLUMNS)
        self._indexer = StepIndexer(self.trace.tell())
        self._events: list[TraceRow] = []
        self._subscription = None

    def attach(self, ctrl) -> RunFiles:
        self._subscription = ctrl.subscribe(self.on_event, history=True)
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


# ---------------------------------------------------------------------------------------- reading the rows
def _row(values: list[str]) -> TraceRow:
    seq, event, T, gid, w, target, lag, detail, reason, *numbers = values
    return TraceRow(int(seq), event, int(T), _int(gid), _int(w), _int(target), _int(lag), detail, reason,
                    *map(_int, numbers))


def _int(text: str) -> int | None:
    return int(text) if text != "" else None


class _FileRows:
    """Trace rows of a run directory, read by byte range."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            header = f.readline()
        if header.decode().strip().split(",") != TRACE_COLUMNS:
            raise ValueError(f"{path}: not an asyncrl trace (its header is {header.decode().strip()!r})")
        self.start = len(header)

    def rows(self, start: int, stop: int) -> list[TraceRow]:
        with open(self.path, "rb") as f:
            f.seek(start)
            text = f.read(stop - start).decode()
        return [_row(values) for values in csv.reader(io.StringIO(text, newline=""))]


def _scan(rows: _FileRows) -> list[IndexEntry]:
    """The index of a ``trace.csv`` written without one: every row read once, each step's end offset counted."""
    indexer, offset = StepIndexer(rows.start), [rows.start]

    def lines():
        with open(rows.path, "rb") as f:
            f.readline()
            for line in f:  # csv.reader asks for lines only as it needs them: offset is the end of the last row
                offset[0] += len(line)
                yield line.decode()

    for values in csv.reader(lines()):
        row = _row(values)
        indexer.add(row)
        if row.event == STEP:
            indexer.step_done(row, offset[0])
    return indexer.entries


class _MemoryRows:
    """Trace rows of a live controller, collected through ``subscribe`` (positions are row numbers)."""

    start = 0

    def __init__(self) -> None:
        self.trace: list[TraceRow] = []

    def rows(self, start: int, stop: int) -> list[TraceRow]:
        return self.trace[start:stop]


# ----------------------------------------------------------------------------------------------- recording
class Recording:
    """A run to scrub. ``source``: a run directory written by ``asyncrl run`` (``config.yaml``, ``trace.csv``,
    ``metrics.csv``, ``trace_index.csv``; a live run's directory works too, and grows) or a ``Controller`` (live:
    the recording follows it). ``steps`` lists the finished steps; ``at(step, event=None)`` is a ``RecordedView``.
    ``trust_code``: import a custom sampler named in a run directory's config to re-judge with it (as for
    ``Controller.restore``); without it its views show the recorded decisions."""

    def __init__(self, source, trust_code: bool = False):
        from asyncrl.config import Config

        self._metrics_frame: pd.DataFrame | None = None
        if hasattr(source, "subscribe") and isinstance(getattr(source, "cfg", None), Config):
            self.source, self.cfg, self.trusted = source, source.cfg, True
            self._rows = _MemoryRows()
            self._indexer = StepIndexer()
            self._index = self._indexer.entries
            self._subscription = source.subscribe(self._on_event, history=True)
            self._metrics = lambda: source.metrics
            self.task = source.task
            return
        run_dir = Path(source)
        missing = [name for name in (CONFIG_FILE, TRACE_FILE, METRICS_FILE) if not (run_dir / name).is_file()]
        if missing:
            raise ValueError(f"Recording({str(source)!r}): not a run directory of `asyncrl run` (no "
                             f"{', '.join(missing)}); give the --out directory of a run, or a Controller")
        self.source, self._subscription = run_dir, None
        self.cfg, self.trusted = _load_config(run_dir / CONFIG_FILE, trust_code)
        self._rows = _FileRows(run_dir / TRACE_FILE)
        self._index: list[IndexEntry] = []
        self._index_read = 0  # bytes of trace_index.csv read so far (a live run's grows)
        self._scanned = not (run_dir / INDEX_FILE).is_file()
        if self._scanned:  # a run directory from before the index: one pass over trace.csv makes it, in memory
            self._index = _scan(self._rows)
        self._metrics = self._read_metrics
        self.task = None

    # -------------------------------------------------------------------------------------------- sources
    def _on_event(self, event) -> None:
        row = event.row if isinstance(event, StepEvent) else event
        self._rows.trace.append(row)
        self._indexer.add(row)
        if isinstance(event, StepEvent):
            self._indexer.step_done(row, row.seq + 1)

    def _entries(self) -> list[IndexEntry]:
        if self._subscription is None and not self._scanned:  # a run directory: the lines appended since
            with open(Path(self.source) / INDEX_FILE, "rb") as f:
                if self._index_read == 0:
                    self._index_read = len(f.readline())  # the header
                f.seek(self._index_read)
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]  # a line being written is read next time
            self._index_read += len(complete)
            for values in csv.reader(io.StringIO(complete.decode(), newline="")):
                self._index.append(IndexEntry(*map(int, values)))
        return self._index

    def _read_metrics(self) -> pd.DataFrame:
        n = len(self._entries())
        if self._metrics_frame is None or len(self._metrics_frame) < n:
            self._metrics_frame = pd.read_csv(Path(self.source) / METRICS_FILE)
        return self._metrics_frame.iloc[:n]

    # ---------------------------------------------------------------------------------------------- reading
    @property
    def steps(self) -> list[int]:
        """The finished steps, in order (a live source's list grows)."""
        return [e.step for e in self._entries()]

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per finished step (``metrics.csv``)."""
        return self._metrics()

    @property
    def trace(self) -> pd.DataFrame:
        """The whole trace through the last finished step, loaded on demand (a view reads only what it needs)."""
        entries = self._entries()
        rows = self._rows.rows(self._rows.start, entries[-1].offset) if entries else []
        return _frame(rows)

    def events(self, step: int) -> int:
        """How many trace rows step ``step`` has (``at(step, event=i)`` takes ``0 <= i < events(step)``)."""
        k = self._position(step)
        entries = self._entries()
        return entries[k].seq - (entries[k - 1].seq if k else -1)

    def find(self, event: str) -> tuple[int, int] | None:
        """``(step, event)`` of the first trace row of kind ``event`` (``EVICT``, ...), or None: read step by step."""
        entries, start = self._entries(), self._rows.start
        for k, entry in enumerate(entries):
            rows = self._rows.rows(start, entry.offset)
            for i, row in enumerate(rows):
                if row.event == event:
                    return entry.step, i
            start = entry.offset
        return None

    def at(self, step: int, event: int | None = None) -> RecordedView:
        """The controller right after step ``step``'s optimizer step (its ``step`` row), or right after the
        ``event``-th trace row of that step."""
        entries = self._entries()
        k = self._position(step)
        n = self.events(step)
        if event is not None and (isinstance(event, bool) or not isinstance(event, int) or not 0 <= event < n):
            raise ValueError(f"event must be an int in [0, {n}) (step {step} has {n} trace rows), got {event!r}")
        before = entries[k - 1] if k else None
        first_seq = before.seq + 1 if before else 0
        target = entries[k].seq if event is None else first_seq + event
        start = before.live_offset if before else self._rows.start
        rows = self._rows.rows(start, entries[k].offset)
        rows = rows[:len(rows) - (entries[k].seq - target)]
        return RecordedView(self, k, step, event, rows, first_seq, before)

    def _position(self, step: int) -> int:
        """Where step ``step`` is in the index (steps are consecutive from the first)."""
        entries = self._entries()
        k = step - entries[0].step if entries and isinstance(step, int) and not isinstance(step, bool) else -1
        if not 0 <= k < len(entries):
            span = f"{entries[0].step}..{entries[-1].step}" if entries else "none yet"
            raise ValueError(f"step must be a finished step of this recording ({span}), got {step!r}")
        return k

    def replay(self, sampler, steps: int | None = None, **options):
        """This run replayed under ``sampler`` (a sampler config or mapping) on the simulated clock, its own
        completions served to it, for ``steps`` steps (None: as many as recorded): a ``ReplayedRun``, read like a
        controller. It predicts schedules and data, not learning (``asyncrl/replay/replayed.py``)."""
        from asyncrl.replay import replay

        return replay(self, sampler, steps, **options)

    def close(self) -> None:
        """Stop following a live controller."""
        if self._subscription is not None:
            self._subscription.cancel()

    @property
    def task_info(self):
        """The run's task (its ``constant_answer_accuracy`` is the bar the reward panel draws), built once."""
        if self.task is None:
            from asyncrl.tasks import build_task

            self.task = build_task(self.cfg.task)
        return self.task

    def __repr__(self) -> str:
        steps = self.steps
        span = f"steps {steps[0]}..{steps[-1]}" if steps else "no step yet"
        return f"Recording({str(self.source) if self._subscription is None else 'live controller'}, {span})"


def _load_config(path: Path, trust_code: bool):
    """The run's config, and whether its sampler may be built. A custom sampler is not imported without
    ``trust_code``: the config is checked with a stand-in (in_order, no lookahead) and the view does not re-judge."""
    import yaml

    from asyncrl.config import Config

    data = yaml.safe_load(path.read_text()) or {}
    sampler = data.get("sampler") or {}
    if sampler.get("name") != "custom" or trust_code:
        return Config.model_validate(data), True
    cfg = Config.model_validate({**data, "sampler": {"name": "in_order", "max_lookahead_versions": 0}})
    return cfg.model_copy(update={"sampler": _Untrusted(sampler)}), False


@dataclass(frozen=True)
class _Untrusted:
    """A custom sampler's config, kept as written, never imported."""

    config: dict

    name = "custom"

    def model_dump(self, **_):
        return dict(self.config)


def _frame(rows: Iterable[TraceRow]) -> pd.DataFrame:
    return pd.DataFrame(list(rows), columns=TRACE_COLUMNS).astype(TRACE_DTYPES)


# --------------------------------------------------------------------------------------------------- views
class RecordedView:
    """The controller as it stood at one trace row of a recording: ``state()``, ``explain()``, ``trace`` (the rows of
    its step through that row), ``metrics`` (the steps finished by then), ``evaluations``, ``trainer_version``,
    ``buffer`` and ``sampler`` (rebuilt; ``sampler`` is None for a custom sampler not trusted), ``row`` (the trace
    row it stands at). Widgets take it wherever they take a controller. Nothing here changes anything."""

    def __init__(self, rec: Recording, position: int, step: int, event: int | None, rows: list[TraceRow],
                 first_seq: int, before: IndexEntry | None):
        self.recording, self.step, self.event, self.cfg = rec, step, event, rec.cfg
        self._position = position
        self.row = rows[-1]
        self.trainer_version = self.row.trainer_version
        self.generation_version = self.trainer_version  # they move together, under the controller's lock
        slots: dict[int, dict] = {}
        self.dispatch_index = before.dispatch_index if before else -1
        self.data_position = before.data_position if before else 0
        self.step_groups_trained = 0
        step_rows = []
        for row in rows:
            mine = row.seq >= first_seq
            if mine:
                step_rows.append(row)
            if row.event == DISPATCH:
                slots[row.group_id] = {"group_id": row.group_id, "weight_version": row.weight_version,
                                       "target_step": row.target_step, "prompt": row.detail, "ready": False,
                                       "rollouts": None, "end_weight_version": None}
            elif row.event == COMMIT and row.group_id in slots:
                slot = slots[row.group_id]
                slot["ready"] = True
                generated = _GENERATED.search(row.reason)
                slot["end_weight_version"] = int(generated.group(2)) if generated else row.weight_version
                replica = _REPLICA.search(row.reason)
                slot["rollouts"] = _Recorded(int(replica.group(1)) if replica else None)
            elif row.event in ENDS:
                slots.pop(row.group_id, None)
            if not mine:
                continue
            if row.event == DISPATCH:
                self.data_position += 1
            elif row.event == ADMIT:
                self.dispatch_index = int(row.detail.rsplit(" ", 1)[-1])
            elif row.event == SELECT:
                self.step_groups_trained += 1
            elif row.event == STEP:
                self.step_groups_trained = 0
        self.buffer = ReplayBuffer.from_state_dict({"capacity": None, "next_group_id": max(slots, default=-1) + 1,
                                                    "slots": [slots[g] for g in sorted(slots)]})
        self.inflight = {s.group_id: s.weight_version for s in self.buffer if not s.ready}
        self._trace_rows = step_rows
        self.sampler = None
        if rec.trusted:
            self.sampler = build_sampler(self.cfg.sampler, self.buffer)
            self.sampler.dispatch_index = self.dispatch_index
            required = self.sampler.required_buffer_capacity(self.cfg.groups_per_step)
        else:
            required = None
        self.capacity = self.cfg.buffer_capacity(required)
        self.task = rec.task_info
        self.last_report = None
        self.exhausted = False

    @property
    def trace(self) -> pd.DataFrame:
        """The rows of this view's step through the row it stands at."""
        return _frame(self._trace_rows)

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per step finished by this row."""
        done = self._position + (self.event is None or self.row.event == STEP)
        return self.recording.metrics.iloc[:done]

    @property
    def evaluations(self) -> pd.DataFrame:
        """The held-out evaluations in the metrics rows so far (by the weight version they judged)."""
        metrics = self.metrics
        columns = [c.name for c in M.EVALUATION_COLUMNS]
        if M.EVAL_REWARD.name not in metrics:
            return pd.DataFrame(columns=columns)
        done = metrics.dropna(subset=[M.EVAL_REWARD.name])
        return pd.DataFrame({M.EVALUATED_VERSION.name: done[M.TRAINER_VERSION.name].astype(int).values,
                             M.HELD_OUT_REWARD.name: done[M.EVAL_REWARD.name].values,
                             M.HELD_OUT_ACCURACY.name: done[M.EVAL_ACCURACY.name].values})

    def explain(self, timeout: float | None = None) -> pd.DataFrame:
        """The run's sampler's verdict for every buffered group, as the next train tick would see it (the live
        controller's ``explain()`` at this row). Without a trusted sampler: the step's recorded decisions."""
        if self.sampler is None:
            rows = [r for r in self._trace_rows if r.event in ENDS]
            frame = pd.DataFrame({"group_id": [r.group_id for r in rows], "weight_version": [r.weight_version for r in rows],
                                  "target_step": [r.target_step for r in rows], "state": "ready",
                                  "action": [r.event for r in rows], "code": "recorded",
                                  "reason": [r.reason for r in rows]})
            frame.attrs["note"] = ("recorded decisions, not re-judged: the run's custom sampler is imported only "
                                   "with Recording(..., trust_code=True)")
            return frame.astype({"group_id": "Int64", "weight_version": "Int64", "target_step": "Int64"})
        # between a step's last select and its step row the step is complete: the next train tick starts a new one
        remaining = self.cfg.groups_per_step - self.step_groups_trained or self.cfg.groups_per_step
        lo, hi = self.cfg.chunk_bounds
        frame = explain_frame(self.sampler.explain(self.trainer_version, min(lo, remaining), min(hi, remaining)))
        if self.cfg.generation.replicas > 1:
            rollouts = [self.buffer[gid].rollouts for gid in frame.group_id]
            frame["replica"] = pd.array([None if r is None else r.replica for r in rollouts], dtype="Int64")
        return frame

    def state(self) -> ControllerState:
        T, sampler = self.trainer_version, self.sampler
        windowed = isinstance(sampler, StalenessWindow)
        return ControllerState(
            trainer_version=T, generation_version=self.generation_version,
            sampler=sampler.name if sampler is not None else "custom",
            sampler_repr=repr(sampler) if sampler is not None else f"custom {self.cfg.sampler.model_dump()} "
                                                                   "(not imported: trust_code=False)",
            window=sampler.window if windowed else None, lower_bound=sampler.lower_bound(T) if windowed else None,
            buffer=self.buffer.summary(), capacity=self.capacity, inflight=len(self.inflight),
            step_groups_trained=self.step_groups_trained, groups_per_step=self.cfg.groups_per_step,
            data_position=self.data_position, exhausted=False, last_report=None,
        )

    def __repr__(self) -> str:
        where = "" if self.event is None else f", event {self.event} ({self.row.event})"
        return (f"RecordedView(step {self.step}{where}, T={self.trainer_version}, buffer {len(self.buffer)} slots, "
                f"{len(self.inflight)} in flight)")


@dataclass(frozen=True)
class _Recorded:
    """What a view knows of a committed group's rollouts: the replica that made it (the trace says)."""

    replica: int | None
