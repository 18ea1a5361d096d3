"""One recording replayed under several samplers, side by side with the run as recorded: one table, one figure, and
at any step which groups each sampler trained.

    cmp = compare(asyncrl.Recording("runs/q"), ["in_order", "weight_fifo", {"name": "windowed",
                                                                             "max_staleness_versions": 2}])
    cmp.table          # a column per sampler (the recording first): steps/s, lag, drops, skew, drawn share
    cmp.figure()       # a column per sampler: lag, token staleness, drops and why, skew, the schedule
    cmp.trained(12)    # the groups each sampler trained at step 12, with their prompts
    cmp.write("out/")  # replay.csv, schedule.csv, drops.csv, replay.png, and each replay's metrics and trace

Every figure is computed the same way for the recording and for a replay (``summarize``), from their traces and
metrics; the recording's times are its own (wall-clock seconds of the steps, or simulated ones for a simulated
run), a replay's are simulated seconds of the fitted latency model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from asyncrl import metrics as M
from asyncrl.replay.recorded import RecordedRun, read, schedule
from asyncrl.replay.replayed import ReplayedRun, replay, steps_per_s
from asyncrl.samplers import sampler_config
from asyncrl.trace import ABORT, DISPATCH, EVICT, SKIP

DROPS = {EVICT: "evicted", ABORT: "aborted", SKIP: "skipped"}
RECORDED = "recorded"


def label(sampler: Mapping) -> str:
    """``windowed W=2``, ``in_order L=0``, ``custom my_sampler:NewestFirst``: a sampler config in a few words."""
    letters = {"max_staleness_versions": "W", "max_lookahead_versions": "L"}
    knobs = [f"{letters[k]}={v}" for k, v in sampler.items() if k in letters]
    knobs += [f"{k}={v}" for k, v in sampler.items()
              if k not in letters and k not in ("name", "target") and v not in (False, None)]
    head = sampler["name"] if sampler["name"] != "custom" else f"custom {sampler.get('target')}"
    return " ".join([head, *knobs])


def summarize(trace: pd.DataFrame, metrics: pd.DataFrame, cfg=None) -> dict[str, Any]:
    """One run's column of the table: throughput (``steps_per_s``, counted in ``time_base``: ``steps_per_s``),
    lag and token staleness of what it trained, what it dropped, and the skew (length and reward of what was
    generated, trained and dropped), over all its steps."""
    lags = trace.lag[trace.event == "select"].dropna().astype(int)
    counts = trace.event.value_counts()
    dispatched = int(counts.get(DISPATCH, 0))
    dropped = {name: int(counts.get(event, 0)) for event, name in DROPS.items()}
    out = {
        "steps": len(metrics), **dict(zip(("steps_per_s", "time_base"), steps_per_s(metrics, cfg))),
        "lag_mean": float(lags.mean()) if len(lags) else math.nan,
        "lag_p90": float(lags.quantile(0.9)) if len(lags) else math.nan,
        "lag_max": int(lags.max()) if len(lags) else 0,
        "lag_counts": " ".join(f"{k}:{v}" for k, v in sorted(lags.value_counts().items())),
    }
    staleness = [M.TOKEN_STALENESS_MEAN, M.TOKEN_STALENESS_MAX, *M.TOKEN_STALENESS_SHARES, M.SPANNING_FRACTION]
    out.update({m.name: math.nan for m in staleness})  # a run from before these metrics has none
    tokens, n = (metrics.get(c.name) for c in (M.COMPLETION_TOKENS, M.COMPLETIONS))
    if M.TOKEN_STALENESS_MEAN.name in metrics and tokens is not None and tokens.sum() > 0:  # token-weighted
        for m in staleness:
            values = metrics[m.name]
            out[m.name] = (float(values.max()) if m is M.TOKEN_STALENESS_MAX else
                           float((values.fillna(0) * n).sum() / n.sum()) if m is M.SPANNING_FRACTION else
                           float((values.fillna(0) * tokens).sum() / tokens.sum()))
    out.update({"groups_dispatched": dispatched, "groups_trained": len(lags), **{f"groups_{k}": v for k, v in
                                                                                 dropped.items()},
                "drop_frac": (dropped["evicted"] + dropped["aborted"]) / dispatched if dispatched else 0.0})
    for kind, count in M.SKEW_COUNT.items():
        for metric in (M.SKEW_LEN[kind], M.SKEW_REWARD[kind]):
            n = metrics[count] if count in metrics else None
            ok = n is not None and metric.name in metrics and (n > 0).any()
            out[metric.name] = float((metrics[metric.name].fillna(0) * n).sum() / n.sum()) if ok else math.nan
    return out


class Comparison:
    """The recording and its replays (``runs``: label -> ``ReplayedRun``), read side by side."""

    def __init__(self, recorded: RecordedRun, runs: dict[str, ReplayedRun]):
        self.recorded, self.runs = recorded, runs
        self.recorded_label = f"{RECORDED} ({label(recorded.cfg.sampler.model_dump())})"

    @property
    def table(self) -> pd.DataFrame:
        """A column per run (the recording first), a row per figure of ``summarize``, plus for each replay the
        share of its groups that were drawn (their prompt never generated in the recording)."""
        columns = {self.recorded_label: {**summarize(self.recorded.trace, self.recorded.metrics, self.recorded.cfg),
                                         "drawn_fraction": 0.0}}
        for name, run in self.runs.items():
            columns[name] = {**summarize(run.trace, run.metrics), "drawn_fraction": run.drawn_fraction}
        return pd.DataFrame(columns)

    @property
    def schedule(self) -> pd.DataFrame:
        """Every trained group of every run: ``sampler``, ``step``, ``group_id``, ``weight_version``, ``lag``,
        ``prompt``, and for a replay the ``recorded_group`` it was served and whether it was ``drawn``."""
        recorded = schedule(self.recorded.trace)
        prompts = {g.group_id: g.prompt for g in self.recorded.groups}
        recorded["prompt"] = [prompts.get(g) for g in recorded.group_id]
        recorded["recorded_group"], recorded["drawn"] = recorded.group_id, False
        frames = [recorded.assign(sampler=self.recorded_label)]
        frames += [run.schedule.assign(sampler=name) for name, run in self.runs.items()]
        out = pd.concat(frames, ignore_index=True)
        return out[["sampler"] + [c for c in out.columns if c != "sampler"]]

    def trained(self, step: int) -> pd.DataFrame:
        """The groups each run trained at ``step`` (its optimizer step ``step``), with their prompts."""
        s = self.schedule
        return s[s.step == step].reset_index(drop=True)

    @property
    def drops(self) -> pd.DataFrame:
        """The groups each run dropped, by how (``evicted``, ``aborted``, ``skipped``) and their lag then (``T -
        weight_version`` at the drop), with one of the reasons the trace gives, as an example."""
        frames = []
        for name, trace in [(self.recorded_label, self.recorded.trace)] + [(n, r.trace) for n, r in self.runs.items()]:
            rows = trace[trace.event.isin(list(DROPS))]
            lag = rows.trainer_version - rows.weight_version
            frame = pd.DataFrame({"sampler": name, "how": rows.event.map(DROPS), "lag": lag.astype("Int64"),
                                  "reason": rows.reason})
            frames.append(frame.groupby(["sampler", "how", "lag"], sort=False, dropna=False)
                          .agg(groups=("reason", "size"), example_reason=("reason", "first")).reset_index())
        return pd.concat(frames, ignore_index=True)

    def figure(self):
        from asyncrl.plots.comparison import comparison_figure

        return comparison_figure(self)

    def write(self, out: str | Path, plots: bool = True) -> Path:
        """``replay.csv`` (the table), ``schedule.csv``, ``drops.csv``, ``replay.png`` and, per replay, a directory
        with its ``metrics.csv``, ``trace.csv`` and ``summary.json``."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.table.to_csv(out / "replay.csv", index_label="quantity")
        self.schedule.to_csv(out / "schedule.csv", index=False)
        self.drops.to_csv(out / "drops.csv", index=False)
        for name, run in self.runs.items():
            where = out / name.replace(" ", "_").replace("=", "").replace(":", "_").replace("/", "_")
            where.mkdir(exist_ok=True)
            run.metrics.to_csv(where / "metrics.csv", index=False)
            run.trace.to_csv(where / "trace.csv", index=False)
            (where / "summary.json").write_text(json.dumps(run.summary(), indent=2, default=str) + "\n")
        if plots:
            self.figure().savefig(out / "replay.png", dpi=110)
        return out


def compare(recording, samplers: Iterable[Any], steps: int | None = None,
            overlap_slowdown: float | None = None) -> Comparison:
    """``recording`` replayed under each of ``samplers`` (names with their default knobs, or mappings), read
    once. Labels follow ``label``; a sampler given twice is an error."""
    run = read(recording)
    runs: dict[str, ReplayedRun] = {}
    for sampler in samplers:
        knobs = sampler_config({"name": sampler} if isinstance(sampler, str) else sampler).model_dump(mode="json")
        name = label(knobs)
        if name in runs:
            raise ValueError(f"sampler {name!r} is given twice; each sampler replays once")
        runs[name] = replay(recording, knobs, steps, overlap_slowdown, recorded=run)
    if not runs:
        raise ValueError("compare needs at least one sampler")
    return Comparison(run, runs)
