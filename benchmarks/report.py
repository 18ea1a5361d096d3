"""The numbers of ``README.md`` and ``benchmarks/README.md``, regenerated from the run directories under
``benchmarks/data/`` (written by ``benchmarks/record.py``), never typed by hand.

    python benchmarks/report.py           # rewrite every marked table and number from the data
    python benchmarks/report.py --check   # change nothing; exit 1 naming each one that no longer matches the data

In the markdown, a generated part sits between two invisible markers, on one line (a number in prose) or around a
block (a table)::

    async ran <!-- report:two_gpus_async_over_sync -->1.75x<!-- /report --> the synchronous steps/s

    <!-- report:two_gpus_balanced -->
    | | sync | async |
    ...
    <!-- /report -->

``NAME`` is a key of ``REPORTS`` below: a function of no arguments that reads its run directory and returns the
text that goes between the markers. To add a table or a number: write its function here, add it to ``REPORTS``,
put the markers where it goes, run ``python benchmarks/report.py``. A marker whose name is not in ``REPORTS`` and a
function whose run directory is missing are errors (``--check`` names them too); ``tests/test_report.py`` runs
``--check``, so a README that drifts from its data fails the suite.

Invariants: a generator reads only committed files under ``benchmarks/data/`` (no clock, no machine), so its output
is the same wherever it runs; rewriting is idempotent (a second run changes nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
FILES = (ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md")))
# A marker written inside backticks (as in benchmarks/README.md's description of markers) is text, not a marker.
MARKER = re.compile(r"(?<!`)<!-- report:(?P<name>[\w.-]+) -->(?P<body>(?:(?!<!-- report:).)*?)<!-- /report -->", re.S)


class ReportError(RuntimeError):
    """A marker or a run directory that does not add up (unknown name, missing data)."""


def run(bench: str, name: str) -> tuple[dict, pd.DataFrame]:
    """(meta with results, rows) of ``benchmarks/data/<bench>/<name>``."""
    path = DATA / bench / name
    if not (path / "meta.json").is_file():
        raise ReportError(f"no run directory {path.relative_to(DATA.parent.parent)} (meta.json missing)")
    return json.loads((path / "meta.json").read_text()), pd.read_csv(path / "rows.csv")


def frame(bench: str, name: str, file: str) -> pd.DataFrame:
    return pd.read_csv(DATA / bench / name / file)


def table(rows: list[list], header: list[str]) -> str:
    """A markdown table as a block (leading and trailing newline, so the markers stay on lines of their own)."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n" + "\n".join(lines) + "\n"


def spread(values, fmt: str = "{:.2f}") -> str:
    """``median (min..max)`` of a series."""
    s = pd.Series(values, dtype=float)
    return f"{fmt.format(s.median())} ({fmt.format(s.min())}..{fmt.format(s.max())})"


def machine(meta: dict) -> str:
    """One line: where and when a run was made, from its meta.json (what is not recorded says so)."""
    m, v = meta.get("machine", {}), meta.get("versions", {})
    gpus = m.get("gpus") or []
    where = f"{len(gpus)} x {gpus[0].split(',')[0]}" if gpus else f"{m.get('cpu') or 'CPU not recorded'}"
    cores = f", {m['cores']} cores" if m.get("cores") else ""
    load = f", load {m['load_1min']} before the run" if m.get("load_1min") is not None else ", load not recorded"
    sw = ", ".join(f"{k} {v[k]}" for k in ("torch", "vllm", "megatron-core", "ray") if k in v)
    commit = (meta["commit"][:7] + (" (dirty)" if meta.get("dirty") else "")) if meta.get("commit") else "not recorded"
    return f"{meta['date_utc'][:16].replace('T', ' ')} UTC, {where}{cores}{load}; {sw}; commit {commit}"


# --- bench_two_gpus ----------------------------------------------------------------------------------------------
def _learning_curves(curves: pd.DataFrame, mode: str) -> int:
    """How many different reward trajectories the repeats of a mode trained (1: one seed, the repeats replay it)."""
    per = curves[curves["mode"] == mode]
    return len({tuple(g.reward.round(6)) for _, g in per.groupby("repeat")})


def two_gpus_table(name: str) -> Callable[[], str]:
    def make() -> str:
        meta, runs = run("bench_two_gpus", name)
        r, curves = meta["results"], frame("bench_two_gpus", name, "reward_curves.csv")
        by = {m: runs[runs["mode"] == m] for m in ("sync", "async")}
        reach = r["time_to_sync_final_reward"]

        def both(fn):
            return [fn(by["sync"]), fn(by["async"])]

        ms = lambda col: both(lambda d: f"{1e3 * d[col].median():.1f} ms")  # noqa: E731
        rows = [
            ["steps/s, median (min..max)", *both(lambda d: spread(d.steps_per_s))],
            ["async / sync (per repeat)", "", f"**{r['async_over_sync']:.2f}x** ("
             + ", ".join(f"{x:.2f}" for x in r["async_over_sync_per_repeat"]) + ")"],
            ["GPU busy a step, generation", *ms("gen_busy_per_step_s")],
            ["GPU busy a step, training", *ms("train_busy_per_step_s")],
            ["two-stage bound (from the sync runs) / async as a share of it", f"{r['two_stage_bound']:.2f}x",
             f"**{r['fraction_of_bound']:.0%}**"],
            ["trainer's wait for a push, median (largest)",
             *both(lambda d: f"{1e3 * d.push_wait_s_median.median():.1f} ms ({1e3 * d.push_wait_s_max.max():.0f} ms)")],
            ["train reward, last 5 steps, per repeat", *both(lambda d: ", ".join(f"{x:.3f}" for x in d.reward_last5))],
            ["different learning curves among the repeats",
             *[f"{_learning_curves(curves, m)} of {len(by[m])}" for m in ("sync", "async")]],
            ["sync run's final reward first reached, per repeat",
             ", ".join(f"{v['sync_wall_s']:.1f} s (its end)" for v in reach.values()),
             ", ".join("never" if v["async_reaches_it_at_s"] is None else f"{v['async_reaches_it_at_s']:.1f} s"
                       for v in reach.values())],
        ]
        if "groups_evicted" in runs:
            rows.append(["groups evicted", *both(lambda d: str(int(d.groups_evicted.sum())))])
        head = (f"\n`{meta['results']['preset']}` with {json.dumps(r['overrides'])}, {r['repeats']} repeats x "
                f"{r['steps']} sync / {r['async_steps']} async timed steps after {r['warmup']} warm-up; "
                f"{machine(meta)}; data `benchmarks/data/bench_two_gpus/{name}/`.\n")
        return head + table(rows, ["", "sync (`in_order` L=0)", "async (`weight_fifo` W=1)"])
    return make


def two_gpus_number(name: str, what: str) -> Callable[[], str]:
    """One figure of a bench_two_gpus run for prose."""
    def make() -> str:
        meta, runs = run("bench_two_gpus", name)
        r = meta["results"]
        reach = [v["async_reaches_it_at_s"] for v in r["time_to_sync_final_reward"].values()]
        values = {
            "async_over_sync": lambda: f"{r['async_over_sync']:.2f}x",
            "fraction_of_bound": lambda: f"{r['fraction_of_bound']:.0%}",
            "stage_ms": lambda: f"{1e3 * r['stage_gen_s']:.0f} / {1e3 * r['stage_train_s']:.0f} ms",
            "push_ms": lambda: f"{1e3 * runs[runs['mode'] == 'async'].push_wait_s_median.median():.1f} ms",
            "time_to_reward": lambda: (
                f"{min(reach):.1f}-{max(reach):.1f} s against "
                f"{min(v['sync_wall_s'] for v in r['time_to_sync_final_reward'].values()):.1f} s"
                if None not in reach else "not in every repeat"),
        }
        return values[what]()
    return make


# --- gpu_gen_heavy on one H200: the new settings against the shipped ones, in one invocation ----------------------
GEN_HEAVY = "2026-12-01-gen-heavy-one-h200-streaming"
GEN_HEAVY_SHIPPED = "2026-12-01-gen-heavy-one-h200-shipped-settings"
GEN_HEAVY_REPEATS = "2026-12-01-gen-heavy-one-h200-repeats"
FIRST_MACHINE = "2026-12-01-gen-heavy-streaming-drain"  # the first streaming runs, on another H200 an hour earlier


def _sync(name: str) -> pd.Series:
    runs = run("bench_two_gpus", name)[1]
    return runs[runs["mode"] == "sync"].median(numeric_only=True)


def gen_heavy_table() -> str:
    """Sync, async (drain) and async (inflight) steps/s, stage times and training TFLOP/s of the shipped settings and
    the new ones, and their ratio: the two runs of one invocation."""
    cols = ["steps_per_s", "gen_busy_per_step_s", "train_busy_per_step_s", "useful_train_tflops",
            "train_tflops_median", "mfu_median"]
    by = {}
    for label, name in (("shipped settings", GEN_HEAVY_SHIPPED), ("new", GEN_HEAVY)):
        runs = run("bench_two_gpus", name)[1]
        by[label] = runs.groupby("mode")[cols].median()
    old, new = by["shipped settings"], by["new"]
    bold = lambda text, on: f"**{text}**" if on else text  # noqa: E731
    rows = [[label, *(bold(f"{d.steps_per_s[m]:.3f}", label == "new" and m != "async_inflight")
                      for m in ("sync", "async", "async_inflight")),
             f"{d.gen_busy_per_step_s['sync']:.2f} s / {d.train_busy_per_step_s['sync']:.2f} s",
             bold(f"{d.useful_train_tflops['sync']:.1f}", label == "new"),
             f"{d.train_tflops_median['sync']:.1f} / {d.mfu_median['sync']:.3f}"] for label, d in by.items()]
    ratio = lambda col, m="sync": new[col][m] / old[col][m]  # noqa: E731
    rows.append(["new / shipped", *(bold(f"{ratio('steps_per_s', m):.2f}x", m != "async_inflight")
                                    for m in ("sync", "async", "async_inflight")),
                 f"{1 / ratio('gen_busy_per_step_s'):.1f}x / {1 / ratio('train_busy_per_step_s'):.1f}x",
                 f"**{ratio('useful_train_tflops'):.2f}x**", f"{ratio('train_tflops_median'):.2f}x"])
    return table(rows, ["", "sync steps/s", "async (drain)", "async (inflight)", "generation / training a sync step",
                        "useful train TFLOP/s", "`train_tflops` / `mfu` (sync)"])


def gen_heavy_number(what: str) -> Callable[[], str]:
    """One figure of the one-H200 gpu_gen_heavy runs for prose."""
    def make() -> str:
        meta = run("bench_two_gpus", GEN_HEAVY)[0]
        vs = meta["results"]["versus_baseline"]
        new, old = _sync(GEN_HEAVY), _sync(GEN_HEAVY_SHIPPED)
        ratios = [run("bench_two_gpus", n)[0]["results"]["async_over_sync"] for n in (GEN_HEAVY, GEN_HEAVY_REPEATS)]
        values = {
            "sync_over_shipped_2": lambda: f"{vs['sync_steps_per_s_over_baseline']:.2f}x",
            "tflops": lambda: f"{new.useful_train_tflops:.0f}",
            "shipped_tflops": lambda: f"{old.useful_train_tflops:.0f}",
            # the sync runs' ratio, as the figures beside it (the bench's own result takes the median of the modes)
            "tflops_over_shipped_2": lambda: f"{new.useful_train_tflops / old.useful_train_tflops:.2f}x",
            "async_over_sync": lambda: f"{min(ratios):.2f}-{max(ratios):.2f}x",
        }
        return values[what]()
    return make


RECHECK = "2026-12-01-gen-heavy-one-h200-recheck"  # main's gpu_gen_heavy against its shipped settings, 23:05 UTC
GEN_HEAVY_INVOCATIONS = (  # every one-H200 invocation of gpu_gen_heavy against the shipped settings, oldest first
    (GEN_HEAVY, "the new settings (first measurement)"),
    ("2026-12-01-gen-heavy-one-h200-unseeded-vs-seeded", "new side without per-group seeds, baseline with them"),
    (RECHECK, "main's preset"),
    ("2026-12-01-gen-heavy-one-h200-unseeded", "both sides without per-group seeds"),
    ("2026-12-01-gen-heavy-one-h200-flat-logprobs", "flat logprobs (not kept), a freshly started machine"),
)


def gen_heavy_invocations() -> str:
    """One row per invocation: the sync steps/s of both sides and their ratio, the sync runs' useful training
    TFLOP/s ratio, async/sync, generator / raw vLLM, and raw vLLM's tokens/s (with per-group seeds beside it where
    the run had none)."""
    rows = []
    for name, what in GEN_HEAVY_INVOCATIONS:
        meta, runs = run("bench_two_gpus", name)
        r = meta["results"]
        vs, st, new = r["versus_baseline"], r["stream"], runs[runs["mode"] == "sync"].median(numeric_only=True)
        old = vs["baseline"]
        raw = f"{st['tok_s_raw'] / 1e3:.1f}k" + (f" / {st['tok_s_raw_seeded'] / 1e3:.1f}k"
                                                 if "tok_s_raw_seeded" in st else "")
        rows.append([f"{meta['date_utc'][11:16]}", f"`{meta['commit']}`", what,
                     f"{old['steps_per_s']['sync']:.3f} -> {new.steps_per_s:.3f}",
                     f"**{vs['sync_steps_per_s_over_baseline']:.2f}x**",
                     f"{new.useful_train_tflops / old['useful_train_tflops']['sync']:.2f}x",
                     f"{r['async_over_sync']:.2f}x", f"{st['generator_over_raw']:.3f}", raw, f"`{name}`"])
    return table(rows, ["UTC", "commit", "what differed", "sync steps/s, shipped -> new", "new / shipped",
                        "useful train TFLOP/s, new / shipped", "async / sync", "generator / raw", "raw vLLM tok/s",
                        "data"])


def recheck_number(what: str) -> Callable[[], str]:
    """One figure of the invocation on main's code (RECHECK) for prose."""
    def make() -> str:
        meta, runs = run("bench_two_gpus", RECHECK)
        r, new = meta["results"], runs[runs["mode"] == "sync"].median(numeric_only=True)
        vs = r["versus_baseline"]
        old = run("bench_two_gpus", f"{RECHECK}/baseline")[1].query("mode == 'sync'").median(numeric_only=True)
        ratios = [run("bench_two_gpus", n)[0]["results"]["versus_baseline"]["sync_steps_per_s_over_baseline"]
                  for n, _ in GEN_HEAVY_INVOCATIONS if n != GEN_HEAVY_INVOCATIONS[1][0]]  # like for like only
        values = {
            "sync": lambda: f"{new.steps_per_s:.2f}", "shipped_sync": lambda: f"{old.steps_per_s:.2f}",
            "sync_over_shipped": lambda: f"{vs['sync_steps_per_s_over_baseline']:.2f}x",
            "tflops": lambda: f"{new.useful_train_tflops:.0f}", "shipped_tflops": lambda: f"{old.useful_train_tflops:.0f}",
            "tflops_over_shipped": lambda: f"{new.useful_train_tflops / old.useful_train_tflops:.2f}x",
            "generator_over_raw": lambda: f"{r['stream']['generator_over_raw']:.2f}x",
            "async_over_sync": lambda: f"{r['async_over_sync']:.2f}x",
            "sync_over_shipped_spread": lambda: (f"{min(ratios):.2f}-{max(ratios):.2f}x in {len(ratios)} invocations, "
                                                 f"{sum(x >= 3.5 for x in ratios)} of them >= 3.5x"),
        }
        return values[what]()
    return make


def value(bench: str, name: str, fn: Callable[[dict, pd.DataFrame], str]) -> Callable[[], str]:
    """A figure for prose: ``fn(results, rows)`` of one run directory."""
    def make() -> str:
        meta, rows = run(bench, name)
        return fn(meta["results"], rows)
    return make


def _mode(rows: pd.DataFrame, mode: str, col: str = "steps_per_s") -> pd.Series:
    return rows[rows["mode"] == mode][col]


def _push_waits(mode: str) -> tuple[float, float]:
    """The smallest and largest median push wait of a mode's runs, in the invocation and its repeat."""
    waits = [w for n in (GEN_HEAVY, GEN_HEAVY_REPEATS) for w in _mode(run("bench_two_gpus", n)[1], mode,
                                                                       "push_wait_s_median")]
    return min(waits), max(waits)


def _inflight_over_sync(rows: pd.DataFrame) -> str:
    return f"{_mode(rows, 'async_inflight').median() / _mode(rows, 'sync').median():.2f}x"


def calibration_error(name: str, fitted: str, predicts: str, what: str, words: bool = False) -> Callable[[], str]:
    """The simulator's relative error on ``what`` in a calibrate_gpus run: ``4%`` (or ``29% low`` with words)."""
    def make() -> str:
        rows = run("calibrate_gpus", name)[1]
        hit = rows[(rows["fitted on"] == fitted) & (rows["predicts"] == predicts) & (rows["what"] == what)]
        if len(hit) != 1:
            raise ReportError(f"calibrate_gpus/{name}: {len(hit)} rows fitted on {fitted!r} predicting {predicts!r}")
        error = float(hit["error"].iloc[0])
        return f"{abs(error):.0%}" + ((" low" if error < 0 else " high") if words else "")
    return make


# --- calibrate_gpus: the simulator fitted on GPU runs ------------------------------------------------------------
# calibrate_gpus's rows name an output by the directory it read (some before the move under bench_two_gpus/)
OUTPUTS = {"two_gpus_balanced_lr5e-4": "2026-11-30-balanced-g6-lr5e-4",
           "two_gpus_balanced": "2026-11-30-balanced-g8-lr1e-3",
           "2026-12-01-balanced-colocated-one-h200": "2026-12-01-balanced-colocated-one-h200"}


def _stages(output: str) -> dict[str, float]:
    """A sync step of an output split as calibrate_gpus fits it (ms): g + t + p + d, d the rest."""
    med = _sync(OUTPUTS[output.split(" (")[0]])
    step = 1e3 / med.steps_per_s
    g, t, p = (1e3 * med[c] for c in ("gen_busy_per_step_s", "train_busy_per_step_s", "push_wait_s_median"))
    return {"step": step, "g": g, "t": t, "p": p, "d": step - g - t - p}


def _pm(hit: pd.DataFrame, what: str, bold_over: float = 0.15, fitted: bool = False) -> str:
    """``predicted / measured (error)`` of one quantity; the error bold where it is over ``bold_over``."""
    row = hit[hit["what"] == what].iloc[0]
    err = "fitted" if fitted else (f"**{row.error:+.0%}**" if abs(row.error) > bold_over else f"{row.error:+.0%}")
    return f"{row.predicted:.2f} / {row.measured:.2f} ({err})"


def calibrated_table(name: str, notes: dict[str, str]) -> Callable[[], str]:
    """Each two-H200 output predicted from its own sync runs: the step split, overlap_slowdown, async and async/sync."""
    def make() -> str:
        rows = run("calibrate_gpus", name)[1]
        body = []
        for output, note in notes.items():
            hit = rows[(rows["fitted on"] == output) & (rows["predicts"] == output)]
            st, async_ = _stages(output), hit[hit["what"] == "async"].iloc[0]
            ratio = hit[hit["what"] == "async/sync"].iloc[0]
            body.append([f"`{OUTPUTS[output.split(' (')[0]]}` ({note})",
                         "{step:.1f} = {g:.1f} + {t:.1f} + {p:.1f} + {d:.1f}".format(**st),
                         f"{async_.overlap_slowdown:.3f}", f"{async_.predicted:.2f} / {async_.measured:.2f}",
                         f"{ratio.predicted:.3f} / {ratio.measured:.3f}", f"**{ratio.error:+.1%}**"])
        return table(body, ["two-H200 output (`gpu_two_devices_balanced`)", "sync step = g + t + p + d (ms)",
                            "`overlap_slowdown`", "async steps/s predicted / measured",
                            "async / sync predicted / measured", "error"])
    return make


def across_table(name: str) -> Callable[[], str]:
    """Fitted on one layout (its sync and async runs), predicting the other; and one layout's sync runs alone."""
    def make() -> str:
        rows = run("calibrate_gpus", name)[1]
        where = {G6: "two H200s", ONE_H200: "one H200"}
        body = []
        for fitted, predicts in ((G6, ONE_H200), (ONE_H200, G6)):
            hit = rows[(rows["fitted on"] == fitted) & (rows["predicts"] == predicts)]
            st = _stages(fitted)
            body.append([f"{where[fitted]} (sync step {st['step']:.1f} ms, driver {st['d']:.1f} ms)", where[predicts],
                         f"{hit.kappa.iloc[0]:.2f}", _pm(hit, "sync"), _pm(hit, "async"), _pm(hit, "async/sync")])
        own = rows[(rows["fitted on"] == ONE_H200) & (rows["predicts"] == ONE_H200)]
        body.append([f"{where[ONE_H200]}, its sync runs only", "its own async runs", f"{own.kappa.iloc[0]:.0f}",
                     _pm(own, "sync", fitted=True), _pm(own, "async"), _pm(own, "async/sync")])
        return table(body, ["fitted on", "predicts", "`kappa`", "sync steps/s predicted / measured", "async steps/s",
                            "async / sync"])
    return make


def simulator_scaling(name: str) -> Callable[[], str]:
    """The simulator's scaling prediction: each split of GPUs, with waves and with streaming engines side by side."""
    def make() -> str:
        data = frame("bench_simulator", name, "scaling.csv").set_index(["engine", "replicas", "ranks", "gpus"])
        waves, streaming = data.loc["waves"], data.loc["streaming"]
        rows = [[f"{r} + {k} ({g})", f"{w.steps_per_s:.3f}", f"{w.tokens_per_s_per_gpu:,.0f}",
                 f"{w.per_gpu_vs_2_gpus:.2f}", f"{w.gen_idle:.2f} / {w.train_idle:.2f}",
                 f"{streaming.loc[(r, k, g)].steps_per_s:.3f}", f"{streaming.loc[(r, k, g)].tokens_per_s_per_gpu:,.0f}",
                 f"{streaming.loc[(r, k, g)].per_gpu_vs_2_gpus:.2f}"] for (r, k, g), w in waves.iterrows()]
        return table(rows, ["replicas + ranks (GPUs)", "waves: steps/s", "tokens/s per GPU", "vs 2 GPUs",
                            "gen / train idle", "streaming, 8 groups an engine: steps/s", "tokens/s per GPU",
                            "vs 2 GPUs"])
    return make


def simulator_goal(name: str, engine: str) -> Callable[[], str]:
    """Tokens/s per GPU against 2 GPUs at 4 and at 8 GPUs, one trainer rank (the goals' rows): ``0.56x, 0.32x``."""
    def make() -> str:
        data = frame("bench_simulator", name, "scaling.csv")
        hit = data[(data.engine == engine) & (data.ranks == 1) & data.gpus.isin((4, 8))].sort_values("gpus")
        return ", ".join(f"{v:.2f}x" for v in hit.per_gpu_vs_2_gpus)
    return make


# --- bench_async, bench_ab -----------------------------------------------------------------------------------------
def _met(met: bool) -> str:
    return "met" if met else "missed"


def bench_async_table(*names: str) -> Callable[[], str]:
    """One row per bench_async run: the modes' best ms/step against stepped synchronous, and the targets."""
    def make() -> str:
        rows, where = [], []
        for name in names:
            meta, runs = run("bench_async", name)
            r, m = meta["results"], meta["machine"]
            best = runs.groupby("mode").ms_per_step
            sp = r["speedup_vs_stepped"]
            rows.append([f"`{name}`", f"{meta['date_utc'][11:16]} UTC, load {m['load_1min']}",
                         f"{r['stepped_ms']:.1f}", " ".join(f"{v:.1f}" for v in best.get_group("stepped sync")),
                         f"**{r['sync_run_over_stepped']:.2f}x** ({_met(r['sync_run_over_stepped_met'])})",
                         f"**{r['async_run_speedup']:.2f}x** ({_met(r['async_run_speedup_met'])})",
                         f"{sp.get('async run (gen process)', float('nan')):.2f}x", f"{r['bound']:.2f}x",
                         f"{r['async_run_speedup'] / r['bound']:.0%}"])
            where.append(meta)
        head = (f"\n{where[0]['machine']['cpu']}, {where[0]['machine']['cores']} cores, Python "
                f"{where[0]['machine']['python']}, torch {where[0]['versions'].get('torch')}, commit "
                f"{where[0]['commit'][:7]}{' (with uncommitted changes)' if where[0].get('dirty') else ''}; "
                f"`{where[0]['command']}`; data `benchmarks/data/bench_async/<run>/`.\n")
        return head + table(rows, ["run", "when", "stepped sync ms (best)", "stepped, every repeat",
                                   "sync `run` / stepped (<= 1.05x)", "async `run` speed-up (>= 1.3x)",
                                   "async, gen process", "two-stage bound", "async of the bound"])
    return make


def busy_table(name: str) -> Callable[[], str]:
    """bench_async_busy: ms a step of each timed call, a column per run."""
    def make() -> str:
        meta, rows = run("bench_async_busy", name)
        wide = rows.pivot(index="what", columns="run", values="ms_per_step")[list(meta["results"])]
        body = [[what, *("" if v != v else f"{v:.2f}" for v in values)] for what, values in wide.iterrows()]
        return (f"\n{machine(meta)}; `{meta['command']}`; data `benchmarks/data/bench_async_busy/{name}/`.\n"
                + table(body, ["ms a step", *wide.columns]))
    return make


def bench_async_stages(name: str) -> Callable[[], str]:
    """The stage times of the fastest stepped synchronous repeat, and the interpreter-lock probe."""
    def make() -> str:
        stages = json.loads((DATA / "bench_async" / name / "stages.json").read_text())
        gil = frame("bench_async", name, "gil_probe.csv")
        rows = [[k, f"{v:.2f}"] for k, v in stages.items()]
        probe = [[c["call"], *(_cell(c[k], 2) for k in ("alone ms", "beside spinner ms", "slowdown",
                                                          "lock held (1 - spinner share)"))]
                 for c in gil.to_dict("records")]
        return (f"\nRun `{name}`: stage times of its fastest stepped synchronous repeat (mean ms a step):\n"
                + table(rows, ["stage", "ms"]) + "\nThe interpreter-lock probe of the same run (ms; 'slowdown' of the "
                "last two rows is against one after the other):\n"
                + table(probe, ["call", "alone", "beside the spinner", "slowdown", "lock held"]))
    return make


def bench_async_number(first: str, second: str, key: str) -> str:
    """A ratio of two bench_async runs for prose: ``0.90x and 0.91x``."""
    return " and ".join(f"{run('bench_async', n)[0]['results'][key]:.2f}x" for n in (first, second))


def bench_ab_line(name: str) -> Callable[[], str]:
    """A whole-process A/B: the median A/B wall ratio with its spread, and the CPU ratio."""
    def make() -> str:
        meta, rows = run("bench_ab", name)
        r = meta["results"]
        return (f"{r['wall_ratio_median']:.2f} median ({r['wall_ratio_min']:.2f}-{r['wall_ratio_max']:.2f}) over "
                f"{r['pairs']} pairs, CPU time {r['cpu_ratio_median']:.2f}")
    return make


def bench_ab_wall(name: str, side: str = "a") -> Callable[[], str]:
    """The wall seconds of one side of an A/B, as ``min-max s`` with the run count and the machine's load."""
    def make() -> str:
        meta, rows = run("bench_ab", name)
        wall = rows[rows.side == side].wall_s
        m = meta["machine"]
        return (f"{wall.min():.0f}-{wall.max():.0f} s ({len(wall)} runs, the whole command, on a {m['cores']}-core "
                f"{m['cpu']} machine at load {m['load_1min']}; `benchmarks/data/bench_ab/{name}`)")
    return make


# --- any run directory's CSV as a table ---------------------------------------------------------------------------
def _cell(value, digits: int) -> str:
    if value is pd.NA:
        return ""
    if isinstance(value, float):
        if pd.isna(value):
            return ""
        return f"{value:,.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.{digits}g}"
    return str(value)


def csv_table(bench: str, name: str, file: str = "rows.csv", columns: list[str] | None = None, digits: int = 2,
              note: str = "") -> Callable[[], str]:
    """``file`` of a run directory as a markdown table (``columns`` in that order; floats to ``digits``), under
    the line saying where and when it was measured."""
    def make() -> str:
        meta, _ = run(bench, name)
        data = frame(bench, name, file)
        data = data[columns] if columns else data
        for col in data.columns:  # a column of counts with gaps reads back as floats: show it as counts
            values = data[col].dropna()
            integral = len(values) and (values == values.round()).all()
            if data[col].dtype.kind == "f" and integral and data[col].isna().any():
                data[col] = data[col].astype("Int64")
        rows = [[_cell(v, digits) for v in row] for row in data.itertuples(index=False)]
        return (f"\n{machine(meta)}; `{meta['command']}`; data `benchmarks/data/{bench}/{name}/{file}`.{note}\n"
                + table(rows, list(data.columns)))
    return make


def run_loop_table(name: str) -> Callable[[], str]:
    def make() -> str:
        meta, rows = run("bench_run_loop", name)
        by = rows.groupby("request", sort=False).ms
        body = [[k, f"{v.median():.0f}", f"{v.max():.0f}", len(v)] for k, v in by]
        return (f"\n{machine(meta)}; a step took ~{meta['results']['step_ms']:.0f} ms there; `{meta['command']}`; "
                f"data `benchmarks/data/bench_run_loop/{name}/`.\n"
                + table(body, ["request", "median ms", "max ms", "reps"]))
    return make


def quickstart_number(name: str, what: str) -> Callable[[], str]:
    """Figures of the bench_quickstart run for the README's prose."""
    def make() -> str:
        meta, rows = run("bench_quickstart", name)
        acc, first = rows.final_eval_accuracy, rows.first_eval_step_above_constant
        seeds = ", ".join(str(s) for s in rows.seed)
        values = {
            "last_line": lambda: f"`{rows.last_line.iloc[0]}`",
            "accuracy": lambda: (f"{acc.min():.2f}-{acc.max():.2f} over seeds {seeds} (median {acc.median():.2f}; "
                                 f"the best constant answer scores {rows.constant_answer_accuracy.iloc[0]:.2f}, first "
                                 f"beaten at step {int(first.min())}-{int(first.max())})"),
            "figure": lambda: (f"![Reward and held-out accuracy of `asyncrl run quickstart --steps 300`, seed "
                               f"{rows.seed.iloc[0]}](benchmarks/data/bench_quickstart/{name}/reward.png)"),
        }
        return values[what]()
    return make


# --- bench_padding ------------------------------------------------------------------------------------------------
PLAN_NAMES = {"padded (one batch)": "one padded batch (the old path)",
              "sorted": "sorted, each micro-batch padded to its own longest",
              "packed": "packed, rows as wide as the step's longest (Megatron's default)"}


def padding_plans(name: str) -> Callable[[], str]:
    def make() -> str:
        plans = {p["plan"]: p for p in run("bench_padding", name)[0]["results"]["plans"]}
        rows = [[label, f"{plans[plan]['positions_per_token']:.2f}", f"{plans[plan]['passes']:.0f}"]
                for plan, label in PLAN_NAMES.items() if plan in plans]
        return table(rows, ["plan", "positions / real token", "passes"])
    return make


def padding_steps(name: str) -> Callable[[], str]:
    def make() -> str:
        timed = sorted(run("bench_padding", name)[0]["results"]["timed"],
                       key=lambda t: (t["engine"], ["rows", "sorted", "packed"].index(t["plan"])))
        rows = [[t["engine"], t["plan"], f"{t['positions_per_token']:.2f}", f"{t['passes']:.0f}",
                 f"{t['step_ms']:,.0f}", f"{t['speedup_vs_padded']:.2f}"] for t in timed]
        return table(rows, ["engine", "plan", "positions / real token", "passes", "step ms", "vs padded"])
    return make


def recording_table(*names: str) -> Callable[[], str]:
    """One row per bench_recording run: its size, how long recording and opening took, the scrubs' spread."""
    def make() -> str:
        rows = []
        for name in names:
            meta = run("bench_recording", name)[0]
            r = meta["results"]
            rows.append([f"{r['steps']:,}", f"{r['trace_rows']:,}", f"{r['file_bytes']['trace.csv'] / 1e6:.0f} MB",
                         "-" if r["record_s"] is None else f"{r['record_s']:.0f} s", f"{r['open_s']:.2f} s",
                         f"{r['scrub_median_ms']:.1f} ms", f"{r['scrub_p95_ms']:.1f} ms", f"{r['scrub_max_ms']:.1f} ms",
                         f"{meta['machine']['load_1min']:.1f}", f"`{name}`"])
        return table(rows, ["steps", "trace rows", "trace.csv", "record", "open", "scrub median", "p95", "max",
                            "load before", "data"])
    return make


# --- the registry: marker name -> the function that writes what goes between its markers -------------------------
TWO_GPUS = "2026-11-30-balanced-g6-lr5e-4"
QUICKSTART, SAMPLER, RUN_LOOP = "2026-12-01-seeds-0-2", "2026-12-01-loaded-box", "2026-12-01-loaded-box"
DATASET, COUNTDOWN = "2026-12-02-100k", "2026-12-02-random-init"  # bench_dataset, bench_countdown (issue 31)
SIMULATOR, SIMULATOR_REAL, ASYNC_LEARNING = "2026-12-01T2017Z", "2026-12-01-loaded-box", "2026-12-01-seeds-0-2"
CALIBRATED, ACROSS = "2026-12-01T2026Z", "2026-12-01T2058Z"  # calibrate_gpus: on the two-H200 runs; across layouts
G6, G8 = "two_gpus_balanced_lr5e-4 (two GPUs)", "two_gpus_balanced (two GPUs)"  # its outputs, as its rows name them
ONE_H200 = "2026-12-01-balanced-colocated-one-h200 (one GPU)"
GAP_RUNS = {"CPU, torch trains and generates": "2026-12-02-cpu", "one H200, vLLM generates, Megatron trains":
            "2026-12-02-gpu-h200"}


def gap_table() -> str:
    """bench_gap's runs, one row each: what the gap metrics read, and what the kept weights cost."""
    rows = []
    for where, name in GAP_RUNS.items():
        meta, _ = run("bench_gap", name)
        r = meta["results"]
        ab = r.get("train_time_ratio_with_over_without")
        rows.append([where, f"`{r['preset']}` {json.dumps(r['overrides'])}, {r['steps']} steps",
                     f"{r['mismatch_kl_median']:.2g} ({r['mismatch_kl_max']:.2g})", f"{r['is_mismatch_max']:.4f}",
                     f"{r['is_staleness_mean_median']:.4f} ({r['is_staleness_max']:.2f})", f"{r['gap_token_share']:.0%}",
                     f"{r['kept_versions_max']} x {r['param_bytes'] / 1e6:.1f} MB",
                     f"{1e3 * r['logprobs_at_s_median']:.1f} + {1e3 * r['keep_versions_s_median']:.2f} ms "
                     f"({r['extra_share_of_train_time']:.0%} of {1e3 * r['train_time_s_median']:.0f} ms)",
                     "-" if ab is None else f"{ab:.2f}x", machine(meta)])
    return table(rows, ["", "run", "mismatch_kl median (max)", "is_mismatch_max", "is_staleness_mean median (max)",
                        "stale tokens measured", "kept weights", "extra pass + copy a step (share of train_time_s)",
                        "train_time_s with / without (A/B)", "where and when"])


REPLAY = "2026-12-02-cpu"
REPLAY_FIDELITY = ["recording", "replayed_into", "steps_per_s_real", "steps_per_s_real_range", "steps_per_s_replay",
                   "steps_per_s_error", "lag_mean_real", "lag_mean_replay", "lag_tv_distance", "drop_frac_real",
                   "drop_frac_replay"]


def _replay_error(rows: pd.DataFrame, diagonal: bool) -> str:
    """The median of |replayed / real steps/s - 1| over the fidelity table's off-diagonal (or diagonal) rows."""
    f = frame("bench_replay", REPLAY, "fidelity.csv")
    part = f[(f.recording == f.replayed_into) == diagonal]
    return f"{100 * part.steps_per_s_error.abs().median():.0f}%"


REPORTS: dict[str, Callable[[], str]] = {
    "two_gpus_balanced": two_gpus_table(TWO_GPUS),
    "two_gpus_balanced_lr1e-3": two_gpus_table("2026-11-30-balanced-g8-lr1e-3"),
    "two_gpus_async_over_sync": two_gpus_number(TWO_GPUS, "async_over_sync"),
    "two_gpus_fraction_of_bound": two_gpus_number(TWO_GPUS, "fraction_of_bound"),
    "two_gpus_stage_ms": two_gpus_number(TWO_GPUS, "stage_ms"),
    "two_gpus_push_ms": two_gpus_number(TWO_GPUS, "push_ms"),
    "two_gpus_time_to_reward": two_gpus_number(TWO_GPUS, "time_to_reward"),
    "bench_async": bench_async_table("2026-12-01-issue20-run1", "2026-12-01-issue20-run2"),
    "bench_async_after_30": bench_async_table("2026-12-02-issue30-final", "2026-12-03-gap-cost",
                                              "2026-12-03-after-thread-fixes", "2026-12-03-evening", "2026-12-03-night",
                                              "2026-12-04-morning"),
    "bench_async_busy": busy_table("2026-12-03"),
    "bench_async_busy_line": value("bench_async_busy", "2026-12-03", lambda r, _: (
        f"the train pump's ticks took {r['async']['train pump: its ticks']:.1f} of the asynchronous run's "
        f"{r['async']['wall']:.1f} ms a step; the gap metrics' pass {r['async']['policy.logprobs_at']:.1f} ms and keeping "
        f"the weights {r['async']['policy.keep_versions']:.1f} ms of it; without them the step took "
        f"{r['async, no gap metrics']['wall']:.1f} ms, against {r['sync']['wall']:.1f} ms synchronous "
        f"({r['sync']['wall'] / r['async']['wall']:.2f}x and {r['sync']['wall'] / r['async, no gap metrics']['wall']:.2f}x)")),
    "bench_async_gap_cost": value("bench_async", "2026-12-03-gap-cost", lambda r, _: (
        f"{r['speedup_vs_stepped']['async run']:.2f}x with the gap metrics and "
        f"{r['speedup_vs_stepped']['async run (no gap metrics)']:.2f}x without (best of 3 each)")),
    "bench_async_stages": bench_async_stages("2026-12-01-issue20-run1"),
    "bench_async_sync_run": lambda: bench_async_number("2026-12-01-issue20-run1", "2026-12-01-issue20-run2",
                                                        "sync_run_over_stepped"),
    "bench_async_async_run": lambda: bench_async_number("2026-12-01-issue20-run1", "2026-12-01-issue20-run2",
                                                         "async_run_speedup"),
    "ab_sync_run_vs_1eef95c": bench_ab_line("2026-12-01-issue20-sync-run-new-vs-1eef95c"),
    "quickstart_wall": bench_ab_wall("2026-12-01-quickstart-300-steps", "a"),
    "quickstart_accuracy": quickstart_number(QUICKSTART, "accuracy"),
    "quickstart_last_line": quickstart_number(QUICKSTART, "last_line"),
    "quickstart_figure": quickstart_number(QUICKSTART, "figure"),
    "bench_quickstart": csv_table("bench_quickstart", QUICKSTART, columns=[
        "seed", "steps", "wall_s", "untrained_eval_accuracy", "final_eval_accuracy", "constant_answer_accuracy",
        "first_eval_step_above_constant"]),
    "bench_sampler": csv_table("bench_sampler", SAMPLER, digits=1),
    "bench_run_loop": run_loop_table(RUN_LOOP),
    "simulator_equal_stages": csv_table("bench_simulator", SIMULATOR, "equal_stages.csv", digits=3),
    "simulator_long_tail": csv_table("bench_simulator", SIMULATOR, "long_tail.csv", digits=3),
    "simulator_determinism": csv_table("bench_simulator", SIMULATOR, "determinism.csv"),
    "simulator_scaling": simulator_scaling(SIMULATOR),
    "simulator_goal_waves": simulator_goal(SIMULATOR, "waves"),
    "simulator_goal_streaming": simulator_goal(SIMULATOR, "streaming"),
    "simulator_calibration": csv_table("bench_simulator", SIMULATOR_REAL, "calibration.csv", digits=3),
    "recording": recording_table("28k-open", "2026-12-01-100k"),
    "gap": gap_table,
    "dataset_table": csv_table("bench_dataset", DATASET, columns=[
        "format", "file_mb", "load_s", "cached_s", "render_and_check_s", "rss_kept_mb", "peak_rss_mb",
        "resume_build_s", "resume_first_batch_s", "resume_matches"]),
    "dataset_load": value("bench_dataset", DATASET, lambda r, rows: (
        f"{r['rows']:,} rows load in {rows.load_s.min():.1f}-{rows.load_s.max():.1f} s (every format, each row "
        f"checked) and keep {rows.rss_kept_mb.min():.0f}-{rows.rss_kept_mb.max():.0f} MB with the controller's "
        f"rendering and length check")),
    "dataset_resume": value("bench_dataset", DATASET, lambda r, _: (
        f"a controller stepped {r['controller_steps']} steps to row {r['controller_position']:,}, saved and restored "
        f"in a new process ({r['restore_s']:.1f} s, reading and checking the {r['rows']:,} rows again) dispatched "
        f"{'the same' if r['controller_resume_matches'] else 'OTHER'} prompts for the next two steps")),
    "countdown_random": value("bench_countdown", COUNTDOWN, lambda r, _: "; ".join(
        f"seed {s['seed']}: held-out greedy accuracy {s['eval_accuracy_before']:.2f} untrained and "
        f"{s['eval_accuracy_after']:.2f} after {s['steps']} steps, pass@8 {s['pass@8_after']:.2f}, training reward "
        f"{s['train_reward_max']:.2f} at best ({s['s_per_step']:.1f} s a step)" for s in r["seeds"])),
    "replay_speed": csv_table("bench_replay", REPLAY, "speed.csv", columns=[
        "recording", "sampler", "steps", "tokens_per_step", "replay_s", "own_sampler", "same_schedule"]),
    "replay_fidelity": csv_table("bench_replay", REPLAY, "fidelity.csv", columns=REPLAY_FIDELITY, digits=3),
    "replay_speed_max": value("bench_replay", REPLAY, lambda r, _: f"{r['replay_s_max']:.1f} s"),
    "replay_speed_median": value("bench_replay", REPLAY, lambda r, _: f"{r['replay_s_median']:.1f} s"),
    "replay_error_off": value("bench_replay", REPLAY, lambda _, rows: _replay_error(rows, False)),
    "replay_error_own": value("bench_replay", REPLAY, lambda _, rows: _replay_error(rows, True)),
    "recording_100k": value("bench_recording", "2026-12-01-100k", lambda r, _: (
        f"a recording of {r['steps']:,} steps ({r['trace_rows'] / 1e6:.1f}M trace rows) opens in {r['open_s']:.1f} s "
        f"and a jump costs {r['scrub_median_ms']:.0f} ms (median; at most {r['scrub_max_ms']:.0f} ms)")),
    "padding_plans": padding_plans("2026-12-01T2028Z"),
    "padding_steps": padding_steps("2026-12-01T2028Z"),
    "padding_load": lambda: f"{run('bench_padding', '2026-12-01T2028Z')[0]['machine']['load_1min']:.1f}",
    "bench_async_learning": csv_table("bench_async_learning", ASYNC_LEARNING, digits=3),
    "gen_heavy_one_h200": gen_heavy_table,
    "gen_heavy_invocations": gen_heavy_invocations,
    **{f"recheck_{what}": recheck_number(what) for what in (
        "sync", "shipped_sync", "sync_over_shipped", "tflops", "shipped_tflops", "tflops_over_shipped",
        "generator_over_raw", "async_over_sync", "sync_over_shipped_spread")},
    **{f"gen_heavy_{what}": gen_heavy_number(what) for what in (
        "sync_over_shipped_2", "tflops", "shipped_tflops", "tflops_over_shipped_2", "async_over_sync")},
    "gen_heavy_stream": value("bench_two_gpus", GEN_HEAVY, lambda r, _: (
        f"raw {r['stream']['tok_s_raw']:,.0f} tok/s, generator {r['stream']['tok_s_generator']:,.0f} tok/s, "
        f"**generator / raw {r['stream']['generator_over_raw']:.3f}** (median of the per-rep ratios "
        + ", ".join(f"{x:.3f}" for x in r["stream"]["per_rep"]))),
    "gen_heavy_ratio_3": value("bench_two_gpus", GEN_HEAVY, lambda r, _: f"{r['stream']['generator_over_raw']:.3f}"),
    "gen_heavy_async_over_sync_2": value("bench_two_gpus", GEN_HEAVY, lambda r, _: f"{r['async_over_sync']:.2f}x"),
    "gen_heavy_inflight_over_sync": value("bench_two_gpus", GEN_HEAVY, lambda _, rows: _inflight_over_sync(rows)),
    "gen_heavy_shipped_sync": value("bench_two_gpus", GEN_HEAVY_SHIPPED,
                                    lambda _, rows: f"{_mode(rows, 'sync').median():.3f}"),
    "gen_heavy_repeats": value("bench_two_gpus", GEN_HEAVY_REPEATS, lambda _, rows: ", ".join(
        f"{label} {spread(_mode(rows, mode), '{:.3f}')}"
        for label, mode in (("sync", "sync"), ("async drain", "async"), ("async inflight", "async_inflight")))),
    "gen_heavy_repeats_async_over_sync": value("bench_two_gpus", GEN_HEAVY_REPEATS,
                                               lambda r, _: f"{r['async_over_sync']:.2f}x"),
    "gen_heavy_repeats_inflight_over_sync": value("bench_two_gpus", GEN_HEAVY_REPEATS,
                                                  lambda _, rows: _inflight_over_sync(rows)),
    "gen_heavy_first_machine": value("bench_two_gpus", FIRST_MACHINE, lambda r, _: (
        f"{r['stream']['generator_over_raw']:.3f} (raw {r['stream']['tok_s_raw']:,.0f} tok/s")),
    "gen_heavy_first_ratio": value("bench_two_gpus", FIRST_MACHINE,
                                   lambda r, _: f"{r['stream']['generator_over_raw']:.3f}"),
    "gen_heavy_first_runs": lambda: " and ".join(
        f"sync {_mode(rows, 'sync').median():.2f} / async {_mode(rows, 'async').median():.2f} with {how}"
        for how, rows in ((how, run("bench_two_gpus", f"2026-12-01-gen-heavy-streaming-{how}")[1])
                          for how in ("drain", "inflight"))),
    "balanced_colocated": value("bench_two_gpus", "2026-12-01-balanced-colocated-one-h200", lambda r, rows: (
        f"sync {_mode(rows, 'sync').median():.2f}, async {_mode(rows, 'async').median():.2f} steps/s "
        f"({r['async_over_sync']:.2f}x), generation {1e3 * r['stage_gen_s']:.1f} / training "
        f"{1e3 * r['stage_train_s']:.1f} ms a sync step")),
    "gpu_checks_notebook": value("gpu_checks", "2026-12-01-one-h200", lambda _, rows: (
        "in {seconds:.0f} s (reward {reward_first5:.3f} -> {reward_last5:.3f}, held-out accuracy "
        "{held_out_accuracy:.2f}".format(**rows.iloc[0]))),
    "gpu_checks_notebook_s": value("gpu_checks", "2026-12-01-one-h200",
                                   lambda _, rows: f"{rows.seconds.iloc[0]:.0f} s"),
    "gpu_recheck_notebook_s": value("gpu_checks", "2026-12-01-one-h200-recheck",
                                    lambda _, rows: f"{rows.seconds.iloc[0]:.0f} s"),
    "gpu_recheck_tests": value("gpu_checks", "2026-12-01-one-h200-recheck", lambda _, rows: "; ".join(
        f"{c.split(' ')[0]} {s:.0f} s" for c, s in zip(rows.check.iloc[1:], rows.seconds.iloc[1:]))),
    "gpu_checks_colocated": value("gpu_checks", "2026-12-01-one-h200",
                                  lambda _, rows: f"{rows.seconds.iloc[1]:.0f} s"),
    "gen_heavy_generation_share": lambda: (
        f"{_sync(GEN_HEAVY).gen_busy_per_step_s * _sync(GEN_HEAVY).steps_per_s:.0%} of a sync step "
        f"({_sync(GEN_HEAVY).gen_busy_per_step_s:.2f} of {1 / _sync(GEN_HEAVY).steps_per_s:.2f} s)"),
    "gen_heavy_gen_tok_s": value("bench_two_gpus", GEN_HEAVY, lambda r, rows: (
        f"{_mode(rows, 'sync', 'gen_tokens_per_s_median').median() / 1e3:.1f}k tok/s in the sync runs, "
        f"{r['stream']['tok_s_raw'] / 1e3:.1f}k raw")),
    "gen_heavy_positions": lambda: (
        f"{_sync(GEN_HEAVY).train_padded_tokens_median / 1e3:.1f}k positions for "
        f"{_sync(GEN_HEAVY).train_tokens_median / 1e3:.1f}k real tokens, where the padded rows computed "
        f"{_sync(GEN_HEAVY_SHIPPED).train_padded_tokens_median / 1e3:.1f}k"),
    "gen_heavy_push_wait": lambda: "{:.2f}-{:.2f} s a step".format(*_push_waits("async")),
    "gen_heavy_push_wait_inflight": lambda: "{:.0f}-{:.0f} ms".format(
        *(1e3 * w for w in _push_waits("async_inflight"))),
    "gen_heavy_raw_two_machines": lambda: (
        f"raw vLLM {run('bench_two_gpus', GEN_HEAVY)[0]['results']['stream']['tok_s_raw'] / 1e3:.1f}k tok/s here, "
        f"{run('bench_two_gpus', FIRST_MACHINE)[0]['results']['stream']['tok_s_raw'] / 1e3:.1f}k"
        " an hour earlier"),
    "gen_heavy_build": lambda: (lambda old, new: (
        f"eager {old['engine_s']:.1f} s (engine core {old['engine_core_init_s']:.1f} s), with CUDA graphs "
        f"{new['engine_s']:.1f} s (engine core {new['engine_core_init_s']:.1f} s: torch.compile "
        f"{new['compile_s']:.1f} s + graph capture {new['graph_capture_s']:.1f} s"))(
        *(run("bench_two_gpus", n)[0]["results"]["build_timings"] for n in (GEN_HEAVY_SHIPPED, GEN_HEAVY))),
    "calibration_two_h200": calibrated_table(CALIBRATED, {
        G6: "6 completions, 2026-11-30 14:35, after the driver-side fixes", G8: "8 completions, 2026-11-30 11:20"}),
    "calibration_across_layouts": across_table(ACROSS),
    "calibration_g6_error": value("calibrate_gpus", CALIBRATED, lambda _, rows: "{:+.1%}".format(
        rows[(rows["fitted on"] == G6) & (rows["predicts"] == G6) & (rows["what"] == "async/sync")].error.iloc[0])),
    "calibration_fitted_sync": value("calibrate_gpus", CALIBRATED, lambda _, rows: "{:+.2%}".format(
        rows[(rows["fitted on"] == rows["predicts"]) & (rows["what"] == "sync")].error.abs().max())),
    "calibration_driver_shares": lambda: "{:.0%} of the 11:20 step against {:.0%}".format(
        *(_stages(o)["d"] / _stages(o)["step"] for o in (G8, G6))),
    "calibration_across_load": lambda: f"{run('calibrate_gpus', ACROSS)[0]['machine']['load_1min']:.1f}",
    "calibration_driver_ms": lambda: f"{_stages(G6)['d']:.1f} ms",
    "calibration_generation_ms": lambda: f"{_stages(G6)['g']:.1f} vs {_stages(ONE_H200)['g']:.1f} ms",
    "balanced_colocated_lock": value("bench_two_gpus", "2026-12-01-balanced-colocated-one-h200", lambda r, rows: (
        f"{r['async_over_sync']:.2f}x: the engines waited "
        f"{1e3 * _mode(rows, 'async', 'device_lock_wait_per_step_s').median():.0f} ms a step for the device lock")),
    "calibration_g6_async_over_sync": calibration_error(CALIBRATED, G6, G6, "async/sync"),
    "calibration_g8_async_over_sync": calibration_error(CALIBRATED, G8, G8, "async/sync"),
    "calibration_across_sync": calibration_error(ACROSS, G6, ONE_H200, "sync", True),
    "calibration_across_async_over_sync": calibration_error(ACROSS, G6, ONE_H200, "async/sync", True),
}



# --- issue 32: a real model's shape on one H200 ----------------------------------------------------------------
REAL_SHAPE, GEN_HEAVY_FLEX = "2026-12-02-real-shape-one-h200", "2026-12-02-gen-heavy-one-h200-flex"
TRL_GPU, CHECKS_32 = "2026-12-02-one-h200", "2026-12-02-one-h200-issue32"
ISSUE_32_TODAY_TFLOPS = 128  # issue 32's train_tflops at this shape on main 2b45af3 (its data was not committed)


def real_shape_table(name: str = REAL_SHAPE) -> str:
    """The gpu_real_shape preset's sync and async runs: steps/s, stage times, training rate, memory, waits."""
    meta, rows = run("bench_two_gpus", name)
    out = []
    for r in rows.itertuples():
        plan = json.loads(r.memory_plan)
        out.append([r.mode, f"**{r.steps_per_s:.3f}**", f"{r.gen_busy_per_step_s:.2f} s / {r.train_busy_per_step_s:.2f} s",
                    f"{r.train_tflops_median:.1f} / {r.mfu_median:.3f}", f"{r.useful_train_tflops:.1f}",
                    f"{r.completion_tokens_per_step / 1e3:.1f}k / {r.train_padded_tokens_median / 1e3:.1f}k",
                    f"{r.peak_allocated_gib:.1f} / {r.peak_reserved_gib:.1f}",
                    f"{plan['micro_batch_tokens']:,} ({plan['free_gib']:.0f} GiB free)",
                    f"{r.device_lock_wait_per_step_s:.2f} s / {r.push_wait_s_median:.2f} s"])
    return (f"\n{machine(meta)}; `{meta['command']}`; data `benchmarks/data/bench_two_gpus/{name}/`.\n"
            + table(out, ["mode", "steps/s", "generation / training a step", "`train_tflops` / `mfu`",
                          "useful train TFLOP/s", "completion tokens / positions a step",
                          "peak GiB allocated / reserved", "micro_batch_tokens chosen",
                          "device-lock wait / push wait a step"]))


def real_shape_number(what: str, name: str = REAL_SHAPE) -> Callable[[], str]:
    def make() -> str:
        meta, rows = run("bench_two_gpus", name)
        sync = rows[rows["mode"] == "sync"].iloc[0]
        if what == "async_over_sync":
            return f"{meta['results']['async_over_sync']:.3f}x"
        if what == "inflight_over_sync":
            return f"{_inflight_over_sync(rows)}"
        if what == "useful_over_today":
            return f"{sync.useful_train_tflops / ISSUE_32_TODAY_TFLOPS:.2f}x"
        if what == "over_today":
            return f"{sync.train_tflops_median / ISSUE_32_TODAY_TFLOPS:.2f}x"
        if what == "estimate":
            plan = json.loads(sync.memory_plan)
            return (f"{plan['per_position_mib']:.2f} MiB a position planned, "
                    f"{sync.peak_allocated_gib:.0f} GiB allocated at the peak for a pass of "
                    f"{sync.train_padded_tokens_median / 1e3:.1f}k positions")
        raise KeyError(what)
    return make


def trl_table() -> str:
    meta, rows = run("bench_trl_gpu", TRL_GPU)
    return (f"\n{machine(meta)}; data `benchmarks/data/bench_trl_gpu/{TRL_GPU}/` ({meta['note'].split('; ')[-1]}).\n"
            + trl_side_table(rows))


def trl_side_table(rows: pd.DataFrame) -> str:
    out = [[f"{r.side} ({r.mode})", f"**{r.steps_per_s:.4f}**", f"{r.gen_s:.2f} s", f"{r.train_s:.2f} s",
            f"{r.completion_tokens_per_step / 1e3:.1f}k", f"**{r.useful_train_tflops:.1f}**",
            f"{r.peak_allocated_gib:.1f}"] for r in rows.itertuples()]
    return table(out, ["side", "steps/s", "generation a step", "training a step", "completion tokens a step",
                       "useful train TFLOP/s", "peak GiB allocated"])


def trl_ratio(key: str) -> Callable[[], str]:
    return value("bench_trl_gpu", TRL_GPU, lambda r, _: f"{r['ratios'][key]:.2f}x")


def gen_heavy_flex_number() -> str:
    meta, rows = run("bench_two_gpus", GEN_HEAVY_FLEX)
    s, a = (rows[rows["mode"] == m].iloc[0] for m in ("sync", "async"))
    return (f"sync {s.steps_per_s:.3f}, async {a.steps_per_s:.3f} steps/s ({meta['results']['async_over_sync']:.2f}x), "
            f"with training {s.train_busy_per_step_s:.2f} s a step in the sync run against "
            f"{a.train_busy_per_step_s:.2f} s in the async one")


def checks_32(what: str) -> Callable[[], str]:
    return value("gpu_checks", CHECKS_32, lambda r, _: r[what] if isinstance(r[what], str) else json.dumps(r[what]))


REPORTS.update({
    "real_shape_one_h200": real_shape_table,
    "real_shape_async_over_sync": real_shape_number("async_over_sync"),
    "real_shape_over_today": real_shape_number("over_today"),
    "real_shape_memory_estimate": real_shape_number("estimate"),
    "trl_one_h200": trl_table,
    "trl_sync_steps": trl_ratio("asyncrl_sync_over_trl_steps_per_s"),
    "trl_async_steps": trl_ratio("asyncrl_async_over_trl_steps_per_s"),
    "trl_sync_tflops": trl_ratio("asyncrl_sync_over_trl_useful_train_tflops"),
    "trl_async_tflops": trl_ratio("asyncrl_async_over_trl_useful_train_tflops"),
    "gen_heavy_flex": gen_heavy_flex_number,
    "checks_32_tests": checks_32("pytest_tests_gpu_one_process"),
    "checks_32_notebook": checks_32("notebook_gpu_quickstart"),
    "checks_32_flex": value("gpu_checks", CHECKS_32, lambda r, _: (lambda f, m: (
        f"mean |logprob error| {f['flex']['logprob_err']:.5f} (unfused {f['unfused']['logprob_err']:.5f}), gradient "
        f"relative error {f['flex']['update_rel_err']:.4f} (unfused {f['unfused']['update_rel_err']:.4f}), both "
        f"against the fp32 unfused path; a pass of 8 x 1,024 positions kept {m['flex']:.2f} GiB against "
        f"{m['unfused']:.2f} GiB"))(r["flex_vs_unfused"], r["pass_peak_gib"])),
})

# --- bench_rewards / bench_completions (issue 31: rewards off the rollout pump, the completions log) -------------
REWARDS_RUN, COMPLETIONS_RUN = "2026-12-03-lookahead-1", "2026-12-02"
REWARDS_L2 = "2026-12-03-lookahead-2"  # the same bench with in_order's max_lookahead_versions 2, right after it


def rewards_table(name: str) -> Callable[[], str]:
    """steps/s per reward and workers, median (min..max) over the reps, and the median against instant inline."""
    def make() -> str:
        meta, rows = run("bench_rewards", name)
        base = rows[(rows.reward == "instant") & (rows.workers == 0)].steps_per_s.median()
        body = [[reward, workers, spread(cell.steps_per_s), f"{cell.steps_per_s.median() / base:.2f}"]
                for (reward, workers), cell in rows.groupby(["reward", "workers"], sort=False)]
        return (f"\n{machine(meta)}; `{meta['command']}`; data `benchmarks/data/bench_rewards/{name}/`.\n"
                + table(body, ["reward", "workers", "steps/s, median (min..max)", "vs instant inline"]))
    return make


def rewards_ceiling(r: dict) -> str:
    """The ceiling the sampler's lookahead L leaves (bench_rewards.py): (L+1) x step / (L x step + gen + scoring)."""
    c, L = r["ceiling"], r.get("lookahead", 1)
    return (f"{L + 1} x {c['step_s'] * 1e3:.1f} ms / ({L} x {c['step_s'] * 1e3:.1f} ms + {c['gen_s'] * 1e3:.1f} ms "
            f"generating + {c['scoring_s'] * 1e3:.0f} ms scoring) = {c['ratio']:.2f}")


def completions_table(name: str) -> Callable[[], str]:
    def make() -> str:
        meta, rows = run("bench_completions", name)
        r = meta["results"]
        body = [[mode, spread(cell.steps_per_s)] for mode, cell in rows.groupby("log_completions", sort=False)]
        return (f"\n{machine(meta)}; `{meta['command']}`; data `benchmarks/data/bench_completions/{name}/`; "
                f"all / none = {r['all_over_none']:.3f} (medians), {r['rows']:,} rows, {r['bytes'] / 1e6:.1f} MB "
                "written.\n" + table(body, ["log_completions", "steps/s, median (min..max)"]))
    return make


REPORTS.update({
    "bench_rewards": rewards_table(REWARDS_RUN),
    "bench_rewards_waits_4": value("bench_rewards", REWARDS_RUN, lambda r, _: f"{r['waits_10ms/4']['ratio']:.2f}"),
    "bench_rewards_instant_4": value("bench_rewards", REWARDS_RUN, lambda r, _: f"{r['instant/4']['ratio']:.2f}"),
    "bench_rewards_ceiling": value("bench_rewards", REWARDS_RUN, lambda r, _: rewards_ceiling(r)),
    "bench_rewards_l2": rewards_table(REWARDS_L2),
    "bench_rewards_l2_waits_4": value("bench_rewards", REWARDS_L2, lambda r, _: f"{r['waits_10ms/4']['ratio']:.2f}"),
    "bench_rewards_l2_instant_4": value("bench_rewards", REWARDS_L2, lambda r, _: f"{r['instant/4']['ratio']:.2f}"),
    "bench_rewards_l2_ceiling": value("bench_rewards", REWARDS_L2, lambda r, _: rewards_ceiling(r)),
    "bench_completions": completions_table(COMPLETIONS_RUN),
})

# --- rewriting and checking ------------------------------------------------------------------------------------
def render(text: str, where: str, problems: list[str]) -> str:
    """``text`` with every marker's body regenerated; a marker that cannot be made is left as it is and named in
    ``problems``."""
    def body(match: re.Match) -> str:
        name = match["name"]
        if name not in REPORTS:
            problems.append(f"{where}: marker report:{name} is not in benchmarks/report.py's REPORTS")
            return match[0]
        try:
            new = REPORTS[name]()
        except (ReportError, OSError, KeyError, ValueError) as exc:
            problems.append(f"{where}: report:{name} cannot be made from its data: {exc}")
            return match[0]
        return f"<!-- report:{name} -->{new}<!-- /report -->"

    return MARKER.sub(body, text)


# --- one H200, 2026-12-03: the GPU checks after issues 30-33, countdown on a GPU preset, gpu_gen_heavy again ------
CHECKS_1203, GEN_HEAVY_1203 = "2026-12-03-one-h200", "2026-12-03-gen-heavy-one-h200"
COUNTDOWN_GPU = "2026-12-03-gpu-quickstart-one-h200"


def checks_1203(what: str) -> Callable[[], str]:
    return value("gpu_checks", CHECKS_1203, lambda r, _: r[what])


REPORTS.update({
    "checks_1203_tests": checks_1203("pytest_tests_gpu_one_process"),
    "checks_1203_gap": checks_1203("test_gap_rerun"),
    "checks_1203_vllm": checks_1203("pytest_vllm_backend_gpu"),
    "checks_1203_notebook": checks_1203("notebook_gpu_quickstart"),
    "gen_heavy_1203": two_gpus_table(GEN_HEAVY_1203),
    "gen_heavy_1203_async_over_sync": value("bench_two_gpus", GEN_HEAVY_1203, lambda r, _: (
        f"{r['async_over_sync']:.2f}x (per repeat " + ", ".join(f"{x:.2f}" for x in r["async_over_sync_per_repeat"])
        + ")")),
    "countdown_gpu": value("bench_countdown", COUNTDOWN_GPU, lambda r, _: "; ".join(
        f"`{r['preset']}`'s 3.1M model (context 1,024, {r['max_new_tokens']} new tokens), seed {s['seed']}: held-out "
        f"greedy accuracy {s['eval_accuracy_before']:.2f} untrained and {s['eval_accuracy_after']:.2f} after "
        f"{s['steps']} steps, pass@8 {s['pass@8_after']:.2f} (sampled by vLLM), training reward "
        f"{s['train_reward_max']:.2f} at best ({s['s_per_step']:.1f} s a step)" for s in r["seeds"])),
})


# --- 2026-12-03, later: the gap pass beside training (issue 30), TRL in one invocation and gen_heavy again (32) ---
GAP_PASS, VS_OLD_GAP_PASS = "2026-12-03-gap-pass", "2026-12-03-vs-2b45af3-gap-pass"
TRL_1203, GEN_HEAVY_1203B = "2026-12-03-one-invocation", "2026-12-03-gen-heavy-inflight-one-h200"


def vs_old_line(name: str) -> Callable[[], str]:
    """Each side's own bench_async against its own package, alternating: the medians and each invocation's."""
    return value("bench_async", name, lambda r, rows: (
        "stepped sync " + f"{r['old/stepped sync']:.1f} ms (2b45af3) vs {r['new/stepped sync']:.1f} ms (main); async "
        f"`run` {r['old/async run']:.1f} vs {r['new/async run']:.1f} ms ({r['new_over_old_async_ms']:.2f}x the time); "
        f"async speed-up {r['old/async_speedup_median']:.2f}x vs {r['new/async_speedup_median']:.2f}x (medians of "
        f"{rows.pair.nunique()} invocations each; per invocation " + ", ".join(
            f"{side} " + "/".join(f"{o / a:.2f}" for o, a in zip(
                rows[(rows.side == side) & (rows["mode"] == "stepped sync")].ms_per_step,
                rows[(rows.side == side) & (rows["mode"] == "async run")].ms_per_step)) for side in ("old", "new"))
        + ")"))


def vs_old_sync_line(name: str) -> Callable[[], str]:
    """The synchronous target of the same alternating run: sync ``run`` / stepped, medians and per invocation."""
    return value("bench_async", name, lambda r, rows: (
        f"sync `run` / stepped {r['old/sync_run_over_stepped_median']:.2f}x (2b45af3) vs "
        f"**{r['new/sync_run_over_stepped_median']:.2f}x** (main); per invocation "
        + ", ".join(f"{side} " + per_invocation(rows, side, "sync run", "stepped sync", "/") for side in ("old", "new"))))


def gap_pass_line(r: dict, rows: pd.DataFrame) -> str:
    best, up = r["best_ms"], r["speedup_vs_stepped"]
    return (f"stepped sync {best['stepped sync']:.1f} ms a step; sync `run` {r['sync_run_over_stepped']:.2f}x the "
            f"stepped time; async `run` {best['async run']:.1f} ms, **{up['async run']:.2f}x** faster than stepped "
            f"(without the gap metrics {up['async run (no gap metrics)']:.2f}x, generator in a child process "
            f"{up['async run (gen process)']:.2f}x); best of 3 repeats alternating")


def trl_rows(name: str) -> Callable[[], str]:
    def make() -> str:
        meta, rows = run("bench_trl_gpu", name)
        return (f"\n{machine(meta)}; `{meta['command']}`; data `benchmarks/data/bench_trl_gpu/{name}/`.\n"
                + trl_side_table(rows))
    return make


def gen_heavy_1203b(r: dict, rows: pd.DataFrame) -> str:
    med = lambda mode, col="steps_per_s": rows[rows["mode"] == mode][col].median()  # noqa: E731
    return (f"async/sync {r['async_over_sync']:.2f}x (per repeat "
            + ", ".join(f"{x:.2f}" for x in r["async_over_sync_per_repeat"])
            + f"), async with `weight_update: inflight` {med('async_inflight') / med('sync'):.2f}x; the trainer's "
            f"push waited {1e3 * med('async', 'push_wait_s_median'):.0f} ms a step (median) with `drain`, "
            f"{1e3 * med('async_inflight', 'push_wait_s_median'):.0f} ms with `inflight`, "
            f"{1e3 * med('sync', 'push_wait_s_median'):.0f} ms synchronous")


REPORTS.update({
    "bench_async_gap_pass": value("bench_async", GAP_PASS, gap_pass_line),
    "bench_async_vs_2b45af3": vs_old_line("2026-12-03-vs-2b45af3"),
    "bench_async_vs_2b45af3_gap_pass": vs_old_line(VS_OLD_GAP_PASS),
    "bench_async_vs_2b45af3_after_merge": vs_old_line("2026-12-03-vs-2b45af3-after-merge"),
    "bench_async_vs_2b45af3_evening": vs_old_line("2026-12-03-vs-2b45af3-evening"),
    "bench_async_vs_2b45af3_evening_sync": vs_old_sync_line("2026-12-03-vs-2b45af3-evening"),
    "bench_async_vs_2b45af3_morning": vs_old_line("2026-12-04-vs-2b45af3-morning"),
    "bench_async_morning_line": value("bench_async", "2026-12-04-morning", lambda r, _: (
        f"sync `run` {r['sync_run_over_stepped']:.2f}x the stepped time, async `run` {r['async_run_speedup']:.2f}x "
        f"faster (`2026-12-04-morning`, best of 3 repeats alternating)")),
    "bench_async_vs_2b45af3_morning_sync": vs_old_sync_line("2026-12-04-vs-2b45af3-morning"),
    "bench_async_evening_1205": lambda: "; ".join(  # the day's first and last commit, the same evening
        f"`{n}`: async `run` {run('bench_async', n)[0]['results']['async_run_speedup']:.2f}x"
        for n in ("2026-12-05-evening-c128a1a", "2026-12-05-evening-dbed6fd")),
    "bench_async_vs_2b45af3_no_gap": value("bench_async", "2026-12-03-vs-2b45af3-no-gap", lambda r, _: (
        f"async `run` {r['old/async run']:.1f} ms (2b45af3), {r['new/async run']:.1f} ms (main), "
        f"{r['new/async run (no gap metrics)']:.1f} ms (main without the gap metrics); async speed-up "
        f"{r['old/async_speedup_median']:.2f}x vs {r['new/async_speedup_median']:.2f}x (medians of 3 invocations each)")),
    "call_counts": value("bench_async", "2026-12-03-call-counts", lambda r, _: "; ".join(
        f"{tick} tick " + " / ".join(f"{r[c][tick]:,.0f} ({c})" for c in r) for tick in ("rollout", "train"))),
    "trl_1203": trl_rows(TRL_1203),
    "trl_1203_sync_steps": value("bench_trl_gpu", TRL_1203,
                                 lambda r, _: f"{r['ratios']['asyncrl_sync_over_trl_steps_per_s']:.2f}x"),
    "trl_1203_sync_tflops": value("bench_trl_gpu", TRL_1203,
                                  lambda r, _: f"{r['ratios']['asyncrl_sync_over_trl_useful_train_tflops']:.2f}x"),
    "gen_heavy_1203b": value("bench_two_gpus", GEN_HEAVY_1203B, gen_heavy_1203b),
})


# --- issue 32, later on 2026-12-03: the fused logprob chunk and Megatron's fused SwiGLU ----------------------------
REAL_FUSED, REAL_FUSED_INFLIGHT = "2026-12-03-real-shape-fused", "2026-12-03-real-shape-fused-inflight"
TRL_FUSED, CHECKS_FUSED = "2026-12-03-fused", "2026-12-03-one-h200-fused"
STEP_RUNS = ("2026-12-03-fused-chunk", "2026-12-03-fused-swiglu")
STEP_VARIANTS = {"eager-2048": "eager chunk, SwiGLU unfused (before)", "fused-2048": "fused chunk, SwiGLU unfused",
                 "fused-8192": "fused chunk of 8,192 positions, SwiGLU unfused",
                 "swiglu-2048": "fused chunk and fused SwiGLU (now the CUDA default)"}


def _fused_check(file: str) -> dict:
    """A JSON file of the GPU checks after the fused chunk (written by the tests or by hand: no meta.json)."""
    return json.loads((DATA / "gpu_checks" / CHECKS_FUSED / file).read_text())


def megatron_step_table() -> str:
    out, metas = [], []
    for i, name in enumerate(STEP_RUNS, 1):
        meta, rows = run("bench_megatron_step", name)
        metas.append(f"invocation {i}: {meta['date_utc'][11:16]} UTC, `{meta['command']}`, data "
                     f"`benchmarks/data/bench_megatron_step/{name}/`")
        out += [[str(i), STEP_VARIANTS[r.variant], f"{r.step_s:.3f} s", f"**{r.useful_train_tflops:.1f}**",
                 f"{r.peak_allocated_gib:.1f}"] for r in rows.itertuples()]
    return (f"\n{machine(meta)}: the dirty tree was this change, before its commit; "
            + "; ".join(metas) + ".\n"
            + table(out, ["invocation", "variant", "step", "useful train TFLOP/s", "peak GiB allocated"]))


def fused_chunk_line(r: dict, _rows: pd.DataFrame) -> str:
    t, m, e = r["forward_backward_ms"], r["peak_gib_above_inputs"], r["relative_error_vs_float64"]
    return (f"{r['positions']:,} positions x {r['vocab']:,} ids, bf16, forward and backward: {t['fused']:.1f} ms fused "
            f"against {t['eager']:.1f} ms eager ({t['eager_over_fused']:.2f}x), {m['fused']:.2f} against "
            f"{m['eager']:.2f} GiB at the peak; relative error against float64, fused / eager: "
            + ", ".join(f"{k} {v['fused']:.2e} / {v['eager']:.2e}" for k, v in e.items()))


REPORTS.update({
    "megatron_step": megatron_step_table,
    "checks_fused_tests": lambda: _fused_check("summary.json")["pytest_tests_gpu_one_process"],
    "checks_fused_notebook": lambda: _fused_check("summary.json")["notebook_gpu_quickstart"],
    "fused_chunk_test": lambda: fused_chunk_line(_fused_check("fused_logprobs.json"), None),
    "real_shape_fused": lambda: real_shape_table(REAL_FUSED),
    "real_shape_fused_inflight": lambda: real_shape_table(REAL_FUSED_INFLIGHT),
    "real_shape_fused_over_today": real_shape_number("over_today", REAL_FUSED),
    "real_shape_fused_useful_over_today": real_shape_number("useful_over_today", REAL_FUSED),
    "real_shape_fused_async_over_sync": real_shape_number("async_over_sync", REAL_FUSED),
    "real_shape_fused_inflight_async_over_sync": real_shape_number("async_over_sync", REAL_FUSED_INFLIGHT),
    "real_shape_fused_inflight_over_sync": real_shape_number("inflight_over_sync", REAL_FUSED_INFLIGHT),
    "real_shape_fused_inflight_over_today": real_shape_number("over_today", REAL_FUSED_INFLIGHT),
    "trl_fused": trl_rows(TRL_FUSED),
    "trl_fused_steps": value("bench_trl_gpu", TRL_FUSED,
                             lambda r, _: f"{r['ratios']['asyncrl_sync_over_trl_steps_per_s']:.2f}x"),
    "trl_fused_tflops": value("bench_trl_gpu", TRL_FUSED,
                              lambda r, _: f"{r['ratios']['asyncrl_sync_over_trl_useful_train_tflops']:.2f}x"),
})


# --- issue 32, evening of 2026-12-03: both one-GPU presets again on 90ad84d, and the GPU tests after results.py ----
REAL_90AD, GEN_HEAVY_90AD, CHECKS_90AD = ("2026-12-03-real-shape-90ad84d", "2026-12-03-gen-heavy-90ad84d",
                                          "2026-12-03-one-h200-90ad84d")


def gen_heavy_line(r: dict, rows: pd.DataFrame) -> str:
    med = lambda mode, col: rows[rows["mode"] == mode][col].median()  # noqa: E731
    return (f"sync {med('sync', 'steps_per_s'):.3f}, async {med('async', 'steps_per_s'):.3f} steps/s (medians of "
            f"{r['repeats']} repeats); async/sync {r['async_over_sync']:.2f}x (per repeat "
            + ", ".join(f"{x:.2f}" for x in r["async_over_sync_per_repeat"])
            + f"); generation busy {1e3 * med('sync', 'gen_busy_per_step_s'):.0f} ms a step synchronous against "
            f"{1e3 * med('async', 'gen_busy_per_step_s'):.0f} ms asynchronous; the trainer's push waited "
            f"{1e3 * med('async', 'push_wait_s_median'):.0f} ms a step (median) asynchronous, "
            f"{1e3 * med('sync', 'push_wait_s_median'):.0f} ms synchronous")


REPORTS.update({
    "real_shape_90ad84d": lambda: real_shape_table(REAL_90AD),
    "real_shape_90ad84d_async_over_sync": real_shape_number("async_over_sync", REAL_90AD),
    "gen_heavy_90ad84d": value("bench_two_gpus", GEN_HEAVY_90AD, gen_heavy_line),
    "checks_e8112ad": lambda: "; ".join(json.loads(
        (DATA / "gpu_checks" / "2026-12-03-one-h200-e8112ad" / "summary.json").read_text())[k]
        for k in ("notebook_gpu_quickstart", "colocated_async")),
    "checks_90ad84d_tests": lambda: json.loads(
        (DATA / "gpu_checks" / CHECKS_90AD / "summary.json").read_text())["pytest_tests_gpu_one_process"],
    "checks_2c7ffa1_tests": lambda: json.loads(
        (DATA / "gpu_checks" / "2026-12-04-one-h200-2c7ffa1" / "summary.json").read_text())["pytest_tests_gpu_one_process"],
})


# --- a run lets the caller's idle OpenMP workers go (2 torch threads on 2 cores) ------------------------------------
def per_invocation(rows: pd.DataFrame, side: str, over: str, under: str, sep: str = " / ") -> str:
    """One side's ratio of two modes' ms/step in each invocation of an alternating run (``over / under``)."""
    ms = lambda mode: rows[(rows.side == side) & (rows["mode"] == mode)].ms_per_step  # noqa: E731
    return sep.join(f"{a / b:.2f}" for a, b in zip(ms(over), ms(under)))


def openmp_pools_line(r: dict, rows: pd.DataFrame) -> str:
    ratio = lambda side: per_invocation(rows, side, "sync run", "stepped sync")  # noqa: E731
    return (f"sync `run` / stepped {r['old/sync_run_over_stepped_median']:.2f}x before (60564a5; per invocation "
            f"{ratio('old')}) and **{r['new/sync_run_over_stepped_median']:.2f}x** after (0476edc; {ratio('new')}); "
            f"sync `run` {r['old/sync run']:.1f} vs {r['new/sync run']:.1f} ms a step (medians of 3 invocations each)")


REPORTS.update({
    "openmp_pools": value("bench_async", "2026-12-03-openmp-pools", openmp_pools_line),
    "openmp_pools_short": value("bench_async", "2026-12-03-openmp-pools", lambda r, _: (
        f"took {r['old/sync_run_over_stepped_median']:.2f}x the hand-ticked time on 2 cores, now "
        f"{r['new/sync_run_over_stepped_median']:.2f}x")),
})


# --- two pumps on one CPU share its torch threads when torch_threads is unset -------------------------------------
def threads_per_pump_line(r: dict, rows: pd.DataFrame) -> str:
    per = lambda side: per_invocation(rows, side, "stepped sync", "async run", "/")  # noqa: E731
    return (f"async `run` {r['old/async run']:.1f} ms a step before (e18d80e) and **{r['new/async run']:.1f} ms** "
            f"after (d75eabf); its speed-up over stepping {r['old/async_speedup_median']:.2f}x before (per invocation "
            f"{per('old')}) and {r['new/async_speedup_median']:.2f}x after ({per('new')}); stepped "
            f"{r['old/stepped sync']:.1f} / {r['new/stepped sync']:.1f} ms (medians of 3 invocations each)")


REPORTS.update({
    "threads_per_pump": value("bench_async", "2026-12-03-threads-per-pump", threads_per_pump_line),
    "threads_per_pump_short": value("bench_async", "2026-12-03-threads-per-pump", lambda r, _: (
        f"{r['old/async_speedup_median']:.2f}x the stepped speed before, {r['new/async_speedup_median']:.2f}x now")),
})



# --- one GPU: what an asynchronous run pays that a synchronous one does not (the gap pass, slower generation) -----
GAP_ONE_GPU = {"2026-12-03-gen-heavy-nogap-90c23fa": "gap metrics on, as it was",
               "2026-12-03-real-shape-nogap-90c23fa": "gap metrics on, as it was",
               "2026-12-03-gen-heavy-presets-f9727a9": "gap metrics off, as it is now",
               "2026-12-03-real-shape-presets-f9727a9": "gap metrics off, as it is now"}
MODE_WORDS = {"sync": "sync", "async": "async", "async_nogap": "async, gap metrics off",
              "async_gap": "async, gap metrics on", "async_two_threads": "async, two pump threads"}


def one_gpu_gap_table() -> str:
    """Every mode of the four invocations: steps/s, its ratio to sync per repeat, and where the GPU's time went."""
    out, head = [], []
    for name, preset_words in GAP_ONE_GPU.items():
        meta, rows = run("bench_two_gpus", name)
        per = rows.pivot(index="repeat", columns="mode", values="steps_per_s")
        head.append(f"`{name}` ({machine(meta).split(';')[0]}; {meta['results']['repeats']} repeat(s); `async` is "
                    f"the preset with {preset_words})")
        out += _one_gpu_rows(meta, rows)
    v = run("bench_two_gpus", next(iter(GAP_ONE_GPU)))[0]["versions"]
    return (f"\nFour invocations in a row on one freshly started H200 (torch {v['torch']}, vLLM {v['vllm']}, "
            f"megatron-core {v['megatron-core']}); each directory's meta.json has its command: "
            + "; ".join(head) + ". Medians over the repeats; each ratio is to sync in the same invocation.\n"
            + table(out, ONE_GPU_COLUMNS))


ONE_GPU_COLUMNS = ["preset", "mode", "steps/s", "/ sync (per repeat)", "generation busy ms a step",
                   "completion tokens per busy second", "training busy ms a step", "device-lock wait ms a step",
                   "push wait ms a step"]


def _one_gpu_rows(meta: dict, rows: pd.DataFrame, words: dict[str, str] = MODE_WORDS) -> list[list[str]]:
    """One table row per mode of a one-GPU invocation (ONE_GPU_COLUMNS), its ratio to that invocation's sync."""
    per = rows.pivot(index="repeat", columns="mode", values="steps_per_s")
    sync, out = rows[rows["mode"] == "sync"].steps_per_s.median(), []
    for mode in [m for m in words if m in per]:
        d = rows[rows["mode"] == mode]
        ratio = "" if mode == "sync" else (f"**{d.steps_per_s.median() / sync:.2f}x** ("
                                           + ", ".join(f"{x:.2f}" for x in per[mode] / per["sync"]) + ")")
        tok_s = (d.completion_tokens_per_step / d.gen_busy_per_step_s).median()
        out.append([meta["results"]["preset"].removeprefix("gpu_"), words[mode], f"{d.steps_per_s.median():.3f}",
                    ratio, f"{1e3 * d.gen_busy_per_step_s.median():.0f}", f"{tok_s / 1e3:.1f}k",
                    f"{1e3 * d.train_busy_per_step_s.median():.0f}",
                    f"{1e3 * d.device_lock_wait_per_step_s.median():.0f}", f"{1e3 * d.push_wait_s_median.median():.0f}"])
    return out


THREADS_ONE_GPU = "2026-12-03-gen-heavy-threads-1372f0a"


def one_gpu_spread_line() -> str:
    """For prose: per gpu_gen_heavy invocation on this page, the generator's device time a step in sync and in async
    (the preset's async mode; medians over the repeats)."""
    parts, ratios = [], []
    for name in ("2026-12-03-gen-heavy-one-h200", "2026-12-03-gen-heavy-nogap-90c23fa",
                 "2026-12-03-gen-heavy-presets-f9727a9", THREADS_ONE_GPU):
        meta, rows = run("bench_two_gpus", name)
        med = rows.groupby("mode").gen_busy_per_step_s.median()
        ratios.append(med["async"] / med["sync"])
        parts.append(f"{meta['commit'][:7]} {1e3 * med['sync']:.0f} / {1e3 * med['async']:.0f} ms")
    return (f"sync / async, per invocation: {'; '.join(parts)} (async {min(ratios):.2f}-{max(ratios):.2f}x "
            f"sync's)")


ENGINE_STEPS = ("2026-12-03-gen-heavy-f3c0477", "2026-12-03-gen-heavy-1372f0a", "2026-12-04-gen-heavy-2c7ffa1")
ENGINE_MODE_WORDS = {"sync": "sync", "async": "async", "async_lockstep": "async, one pump thread (patched)",
                     "async_si": "async, 0.5 ms switch interval", "async_two_threads": "async, two pump threads",
                     "async_sliced": "async, drain in 30 ms slices", "async_inflight": "async, weight_update inflight"}


def engine_steps_table() -> str:
    """bench_engine_steps: per invocation and mode, steps/s and its ratio to sync per repeat, and how the vLLM engine
    stepped (engine steps a run, sequences decoded per millisecond of engine step)."""
    out = []
    for name in ENGINE_STEPS:
        meta, rows = run("bench_engine_steps", name)
        steps = frame("bench_engine_steps", name, "steps.csv.gz")
        eng = steps.groupby("run").agg(n=("dt", "size"), s=("dt", "sum"), seqs=("running", "sum"))
        rows = rows.merge(eng, left_on="run", right_index=True)
        per = rows.pivot(index="repeat", columns="mode", values="steps_per_s")
        for mode in [m for m in ENGINE_MODE_WORDS if m in per]:
            d = rows[rows["mode"] == mode]
            ratio = "" if mode == "sync" else ", ".join(f"{x:.2f}" for x in per[mode] / per["sync"])
            out.append([f"`{name}`", ENGINE_MODE_WORDS[mode], f"{d.steps_per_s.median():.3f}", ratio,
                        f"{1e3 * d.gen_busy_per_step_s.median():.0f}", f"{d.n.median():.0f}",
                        f"{(d.seqs / d.s).median() / 1e3:.1f}"])
    return ("\nEach invocation on a freshly started H200, its directory's meta.json has the command and what the code was"
            "; 2 repeats alternating, 3 warm-up and 6 timed steps a run; medians over the repeats. Engine steps and "
            "sequences a millisecond count the whole run (warm-up included).\n"
            + table(out, ["invocation", "mode", "steps/s", "/ sync, per repeat", "generation busy ms a step",
                          "engine steps a run", "sequences decoded per engine-step ms"])
            + "\nIn the first invocation (before `pump_threads`) `async` ran two pump threads, and the one-thread "
            "row patched `Controller.lockstep` for its runs (what `pump_threads: 1` does now); from the second on, "
            "`async` is `pump_threads: auto`, one thread on one GPU.\n")


def engine_steps_buckets_line() -> str:
    """For prose: per bench_engine_steps invocation, an async engine step's median time over a sync one's at the same
    number of running sequences (buckets of 32, up to a synchronous batch's 256): the median over the buckets, and
    the range."""
    parts = []
    for name in ENGINE_STEPS:
        st = frame("bench_engine_steps", name, "steps.csv.gz")
        st = st.assign(mode=st.run.str.split("#").str[0], bucket=st.running // 32 * 32)
        med = st[st.running < 256].groupby(["bucket", "mode"]).dt.median().unstack()
        ratio = med["async"] / med["sync"]
        parts.append(f"{ratio.median():.2f}x ({ratio.min():.2f}-{ratio.max():.2f})")
    return "; ".join(parts)


def one_gpu_threads_table() -> str:
    """Sync, async on one pump thread (pump_threads auto on one GPU) and on two, one invocation; and from the
    repeat-0 timelines, how the generator held the device."""
    meta, rows = run("bench_two_gpus", THREADS_ONE_GPU)
    blocks = []
    for mode in ("sync", "async", "async_two_threads"):
        t = frame("bench_two_gpus", THREADS_ONE_GPU, f"timeline_{mode}.csv")
        steps, gen = int((t.name == "finish_step").sum()), t[t.lane == "gen GPU"].ms
        blocks.append(f"{MODE_WORDS[mode]}: {gen.sum() / steps:.0f} ms a step in {len(gen) / steps:.0f} blocks "
                      f"(longest {gen.max():.0f} ms)")
    return (f"\n`{THREADS_ONE_GPU}` ({machine(meta).split(';')[0]}; {meta['results']['repeats']} repeats alternating; "
            f"its meta.json has the command). Medians over the repeats; each ratio is to sync in the same invocation.\n"
            + table(_one_gpu_rows(meta, rows), ONE_GPU_COLUMNS)
            + "\nThe generator's device blocks in repeat 0 (`timeline_*.csv`): " + "; ".join(blocks) + ".\n")


def one_gpu_timeline_line() -> str:
    """From the timelines of repeat 0 (`--timeline`): submits a step and the generator's blocks on the device."""
    parts = []
    for mode in ("sync", "async", "async_gap"):
        t = frame("bench_two_gpus", "2026-12-03-gen-heavy-presets-f9727a9", f"timeline_{mode}.csv")
        steps = int((t.name == "finish_step").sum())
        gen = t[t.lane == "gen GPU"].ms
        train = t[(t.lane == "train GPU")].ms
        parts.append(f"{MODE_WORDS[mode]}: {int((t.name == 'gen.submit').sum()) / steps:.0f} submit a step, the "
                     f"generator held the device {gen.sum() / steps:.0f} ms a step in {len(gen) / steps:.0f} blocks "
                     f"(longest {gen.max():.0f} ms), the trainer {train.sum() / steps:.0f} ms in {len(train) / steps:.0f}")
    return "; ".join(parts)


def one_gpu_gap_short() -> str:
    """For prose: async/sync per invocation with the gap metrics off and on, and what the gap pass adds to training."""
    off, on, extra = [], [], []
    for name in GAP_ONE_GPU:
        meta, rows = run("bench_two_gpus", name)
        med = rows.groupby("mode")[["steps_per_s", "train_busy_per_step_s"]].median()
        preset = meta["results"]["preset"]
        no, yes = ("async_nogap", "async") if "async_nogap" in med.index else ("async", "async_gap")
        off.append((preset, med.loc[no, "steps_per_s"] / med.loc["sync", "steps_per_s"]))
        if yes in med.index:  # the real shape after the change ran without a mode with them on
            on.append((preset, med.loc[yes, "steps_per_s"] / med.loc["sync", "steps_per_s"]))
            extra.append(1e3 * (med.loc[yes, "train_busy_per_step_s"] - med.loc[no, "train_busy_per_step_s"]))
    words = lambda pairs, p: ", ".join(f"{r:.2f}x" for q, r in pairs if q == p)  # noqa: E731
    return (f"async/sync with the gap metrics off: `gpu_gen_heavy` {words(off, 'gpu_gen_heavy')}, `gpu_real_shape` "
            f"{words(off, 'gpu_real_shape')} (four invocations); with them on, in the {len(on)} of those invocations "
            f"that also ran that mode: `gpu_gen_heavy` {words(on, 'gpu_gen_heavy')}, `gpu_real_shape` "
            f"{words(on, 'gpu_real_shape')}; their pass added {min(extra):.0f}-{max(extra):.0f} ms of training a step")


def one_gpu_speed_line() -> str:
    """For prose: each async mode's completion tokens per second of the generator's device time, as a share of sync's
    in the same invocation; and the share of a step in which neither engine held the GPU."""
    shares, idle = [], {"sync": [], "async": []}
    for name in GAP_ONE_GPU:
        rows = run("bench_two_gpus", name)[1].assign(
            tps=lambda d: d.completion_tokens_per_step / d.gen_busy_per_step_s,
            idle=lambda d: 1 - (d.gen_busy_per_step_s + d.train_busy_per_step_s) * d.steps_per_s)
        med = rows.groupby("mode")[["tps", "idle"]].median()
        shares += [med.loc[m, "tps"] / med.loc["sync", "tps"] for m in MODE_WORDS if m in med.index and m != "sync"]
        for m in med.index:
            idle["sync" if m == "sync" else "async"].append(med.loc[m, "idle"])
    below = [x for x in shares if x < 1]
    return (f"in {len(below)} of the {len(shares)} asynchronous rows the generator made {1 - max(below):.0%}-"
            f"{1 - min(below):.0%} fewer completion tokens per second of its device time than that invocation's sync "
            f"run (the other {len(shares) - len(below)}: " + ", ".join(f"{x:.2f}x" for x in shares if x >= 1)
            + f"); neither engine held the GPU for {min(idle['sync']):.1%}-{max(idle['sync']):.1%} of a synchronous "
            f"step and {min(idle['async']):.1%}-{max(idle['async']):.1%} of an asynchronous one")


REPORTS.update({"one_gpu_gap_table": one_gpu_gap_table, "one_gpu_timeline": one_gpu_timeline_line,
                "one_gpu_gap_short": one_gpu_gap_short,
                "one_gpu_speed": one_gpu_speed_line, "one_gpu_threads": one_gpu_threads_table,
                "one_gpu_spread": one_gpu_spread_line, "engine_steps": engine_steps_table,
                "engine_steps_buckets": engine_steps_buckets_line})


# --- one GPU: in-flight weight loads (the presets' weight_update since a99b0ce) -----------------------------------
INFLIGHT_ONE_GPU = {"2026-12-04-gen-heavy-inflight-7860eb8": "`drain`, as it was; `async_inflight` with `inflight`",
                    "2026-12-04-real-shape-inflight-7860eb8": "`drain`, as it was; `async_inflight` with `inflight`",
                    "2026-12-04-gen-heavy-inflight-presets-a99b0ce": "`inflight`, as it is now",
                    "2026-12-04-gen-heavy-inflight-presets-a99b0ce-repeat": "`inflight`, as it is now"}
INFLIGHT_WORDS = {**MODE_WORDS, "async_inflight": "async, weight_update inflight"}


def one_gpu_inflight_table() -> str:
    """Four invocations: the presets with drain against inflight in one invocation each, then the presets with
    inflight (their `async`) twice; steps/s, ratios to sync per repeat, where the GPU's time went."""
    out, head = [], []
    for name, loads in INFLIGHT_ONE_GPU.items():
        meta, rows = run("bench_two_gpus", name)
        head.append(f"`{name}` ({meta['date_utc'][11:16]} UTC; {meta['results']['repeats']} repeats; `async` "
                    f"loads weights with {loads})")
        words = INFLIGHT_WORDS if "presets" not in name else {**INFLIGHT_WORDS, "async": "async (inflight)"}
        out += [[f"`{name[11:]}`"] + row[1:] for row in _one_gpu_rows(meta, rows, words)]
    v = run("bench_two_gpus", next(iter(INFLIGHT_ONE_GPU)))[0]["versions"]
    return (f"\nOne H200 (torch {v['torch']}, vLLM {v['vllm']}, megatron-core {v['megatron-core']}), two machine "
            "starts (the first two invocations on one, the last two on the next); each directory's meta.json has its "
            "command: " + "; ".join(head) + ". Medians over the repeats; each ratio is to sync in the same "
            "invocation.\n" + table(out, ["invocation"] + ONE_GPU_COLUMNS[1:]))


def one_gpu_inflight_short() -> str:
    """For prose: async/sync per invocation with inflight, and with drain where the same invocation ran both."""
    inflight, drain = [], []
    for name in INFLIGHT_ONE_GPU:
        meta, rows = run("bench_two_gpus", name)
        med = rows.groupby("mode").steps_per_s.median()
        preset = meta["results"]["preset"].removeprefix("gpu_")
        if "async_inflight" in med.index:
            drain.append(f"{preset} {med['async'] / med['sync']:.2f}x")
            inflight.append(f"{preset} {med['async_inflight'] / med['sync']:.2f}x")
        else:
            inflight.append(f"{preset} {med['async'] / med['sync']:.2f}x")
    return (f"async/sync with in-flight loads: {', '.join(inflight)} (four invocations, medians of 2-3 repeats); "
            f"with `drain` in the two invocations that ran both: {', '.join(drain)}")


def one_gpu_inflight_repeats() -> str:
    """For prose: every repeat's async-with-inflight / sync ratio over the four invocations."""
    ratios = []
    for name in INFLIGHT_ONE_GPU:
        per = run("bench_two_gpus", name)[1].pivot(index="repeat", columns="mode", values="steps_per_s")
        ratios += list(per["async_inflight" if "async_inflight" in per else "async"] / per["sync"])
    below = sum(r < 1 for r in ratios)
    return f"{below} of the {len(ratios)} repeats below 1 ({min(ratios):.2f} to {max(ratios):.2f})"


REPORTS.update({"one_gpu_inflight": one_gpu_inflight_table, "one_gpu_inflight_short": one_gpu_inflight_short,
                "one_gpu_inflight_repeats": one_gpu_inflight_repeats,
                **{f"checks_a99b0ce_{short}": (lambda key=key: json.loads(
                    (DATA / "gpu_checks" / "2026-12-04-one-h200-a99b0ce" / "summary.json").read_text())[key])
                   for short, key in (("tests", "pytest_tests_gpu_one_process"),
                                      ("notebook", "gpu_quickstart_notebook"))}})


# --- one GPU: how many steps before comparing async with sync (issue 48) -------------------------------------------
# The gen_heavy invocations with in-flight loads (the presets' weight_update since a99b0ce): their in-flight mode.
STEPS_NEEDED_RUNS = {"2026-12-04-gen-heavy-inflight-7860eb8": "async_inflight",
                     "2026-12-04-gen-heavy-inflight-presets-a99b0ce": "async",
                     "2026-12-04-gen-heavy-inflight-presets-a99b0ce-repeat": "async"}
STEPS_NEEDED_WITHIN = (0.20, 0.10)  # the ratio's +-band at two standard deviations


def _timed_steps(name: str, mode: str) -> dict[int, list[float]]:
    """Each repeat's timed step durations in ``mode`` (reward_curves.csv's wall clock, warm-up steps dropped)."""
    meta, _ = run("bench_two_gpus", name)
    curves = frame("bench_two_gpus", name, "reward_curves.csv")
    warmup = meta["results"]["warmup"]
    out = {}
    for repeat, per in curves[curves["mode"] == mode].groupby("repeat"):
        wall = per.sort_values("step").wall_s.tolist()
        out[int(repeat)] = [b - a for a, b in zip(wall, wall[1:])][warmup - 1:]
    return out


def steps_needed() -> dict:
    """Per-window async/sync ratios of the in-flight gen_heavy runs: for ``k`` consecutive timed steps, every window
    of a sync repeat against the same window of the async repeat with its index (same invocation), as a repeat of
    ``k`` steps would have measured it. The spread's fit: var(log ratio) = b / k over the even windows (in-flight
    loads alternate a long and a short step, so an odd window is biased by where it starts), the model of steps
    that vary independently; the steps a mode needs for the ratio to sit within each band at two sd."""
    logs: dict[int, list[float]] = {}
    pairs = 0
    for name, mode in STEPS_NEEDED_RUNS.items():
        sync, inflight = _timed_steps(name, "sync"), _timed_steps(name, mode)
        for r in sync.keys() & inflight.keys():
            pairs += 1
            s, a = sync[r], inflight[r]
            for k in range(1, min(len(s), len(a)) + 1):
                logs.setdefault(k, []).extend(
                    math.log(sum(s[i:i + k]) / sum(a[i:i + k])) for i in range(min(len(s), len(a)) - k + 1))
    per_k = {k: pd.Series(v) for k, v in logs.items()}
    even = [k for k in per_k if k % 2 == 0]
    b = sum(per_k[k].var(ddof=0) / k for k in even) / sum(1 / k**2 for k in even)  # least squares through 0
    need = {band: 2 * math.ceil(b / (band / 2) ** 2 / 2) for band in STEPS_NEEDED_WITHIN}  # even, rounded up
    return {"per_k": per_k, "b": b, "need": need, "pairs": pairs, "k_max": max(per_k)}


def _ratio_range(logs: pd.Series) -> str:
    return f"{math.exp(logs.min()):.2f}-{math.exp(logs.max()):.2f}x"


def steps_needed_table() -> str:
    got = steps_needed()
    rows = [[k, len(v), _ratio_range(v), f"{math.exp(v.median()):.2f}x", f"{v.std(ddof=0):.3f}",
             f"{math.sqrt(got['b'] / k):.3f}" if k % 2 == 0 else "(odd: biased)"] for k, v in got["per_k"].items()]
    return ("\nEvery window of k consecutive timed steps in the " + ", ".join(f"`{n}`" for n in STEPS_NEEDED_RUNS)
            + f" runs (`gpu_gen_heavy` with in-flight loads, one H200; {got['pairs']} pairs of a sync and an async "
            "repeat of the same invocation, 3 warm-up steps each), the sync window's seconds over the async one's: "
            "what a repeat of k steps would have measured.\n"
            + table(rows, ["k steps", "windows", "async/sync", "median", "sd of log ratio", "fit sqrt(b/k)"]))


def steps_needed_short() -> str:
    got = steps_needed()
    per_k, k_max = got["per_k"], got["k_max"]
    bands = " and ".join(f"within +-{band:.0%} about {n}" for band, n in got["need"].items())
    return (f"at `gpu_gen_heavy` with in-flight loads, {got['pairs']} sync/async repeat pairs of {k_max} timed steps "
            f"on one H200 gave async/sync {_ratio_range(per_k[k_max])}, windows of 2 steps "
            f"{_ratio_range(per_k[2])}; the spread falls as 1/sqrt(steps) (sd of the log ratio "
            f"{math.sqrt(got['b']):.2f}/sqrt(n), fitted on windows of 2 to {k_max} steps), so for the ratio to sit "
            f"{bands} timed steps a mode are needed (two sd), an even number (in-flight loads alternate a long "
            "and a short step), after 3 or more warm-up steps, with sync and async repeats alternating")


REPORTS.update({"one_gpu_steps_needed": steps_needed_table, "one_gpu_steps_needed_short": steps_needed_short})


# --- trainer.gradient_checkpointing and the grpo preset (issue 47) ----------------------------------------------------
GRAD_CKPT = "cpu-6x256-256-tokens"
GRPO_PRESET = "cpu-qwen3-warm-50-steps"


def gradient_checkpointing_table() -> str:
    """Off / on: saved-for-backward MiB, peak RSS growth, step time (medians), loss and grad norm; the machine."""
    meta, rows = run("bench_gradient_checkpointing", GRAD_CKPT)
    r = meta["results"]
    out = []
    for on, part in rows.groupby("gradient_checkpointing"):
        out.append(["on" if on else "off", f"{part.saved_for_backward_mib.median():.0f}",
                    f"{part.peak_rss_growth_mib.median():.0f}", f"{part.step_s.median():.1f}",
                    f"{part.loss.iloc[0]:.6g}", f"{part.grad_norm.iloc[0]:.6g}"])
    shape = r["shape"]
    note = (f"\n{r['parameters'] / 1e6:.1f}M-parameter Llama ({shape['layers']} layers x {shape['hidden']}), "
            f"{shape['groups'] * 8} sequences x {shape['tokens']} completion tokens, one train step per process, "
            f"{len(rows) // 2} repeats alternating; {machine(meta)}; data `benchmarks/data/bench_gradient_checkpointing/"
            f"{GRAD_CKPT}/`.\n")
    return table(out, ["gradient_checkpointing", "saved for backward (MiB)", "peak RSS growth (MiB)", "step (s)",
                       "loss", "grad norm"]) + note


def grpo_preset_table() -> str:
    """Per configuration: entropy first / max / last over the steps, reward, held-out greedy accuracy before / after."""
    meta, _ = run("bench_grpo_preset", GRPO_PRESET)
    r = meta["results"]
    out = [[f"`{s['config']}`", f"{s['lr']:g}", f"{s['entropy_coef']:g}",
            f"{s['entropy_first']:.2f} / {s['entropy_max']:.2f} / {s['entropy_last']:.2f}",
            f"{s['reward_first']:.2f} -> {s['reward_last5']:.2f}",
            f"{s['heldout_accuracy_before']:.2f} -> {s['heldout_accuracy_after']:.2f}"] for s in r["summary"]]
    note = (f"\n{r['steps']} steps each from the same warm-started tiny Qwen3 ({r['sft_steps']} supervised steps), "
            f"seed {r['seed']}; the largest possible entropy is {r['max_entropy_possible']:.2f} nats (259 tokens); "
            f"{machine(meta)}; data `benchmarks/data/bench_grpo_preset/{GRPO_PRESET}/`.\n")
    return table(out, ["configuration", "lr", "entropy_coef", "entropy first / max / last", "reward (first -> last 5)",
                       "held-out greedy accuracy"]) + note


REPORTS.update({"gradient_checkpointing": gradient_checkpointing_table, "grpo_preset": grpo_preset_table})


# --- issue 48: beside TRL on one H100 80GB, 3 warm-up + 8 timed steps a side, and tests/gpu in one process there ----
TRL_H100, CHECKS_H100 = "2026-12-05-one-h100", "2026-12-05-one-h100-ef00b21"


def _trl_ratio(key: str) -> Callable[[], str]:
    return value("bench_trl_gpu", TRL_H100, lambda r, _: f"{r['ratios'][key]:.2f}x")


REPORTS.update({
    "trl_h100": trl_rows(TRL_H100),
    "trl_h100_sync_steps": _trl_ratio("asyncrl_sync_over_trl_steps_per_s"),
    "trl_h100_async_steps": _trl_ratio("asyncrl_async_over_trl_steps_per_s"),
    "trl_h100_sync_tflops": _trl_ratio("asyncrl_sync_over_trl_useful_train_tflops"),
    "checks_h100_tests": lambda: json.loads(
        (DATA / "gpu_checks" / CHECKS_H100 / "summary.json").read_text())["pytest_tests_gpu_one_process"],
    "checks_h100_after_merges": lambda: json.loads((DATA / "gpu_checks" / "2026-12-05-one-h100-52ad9bb" /
                                                    "summary.json").read_text())["pytest_tests_gpu_one_process"],
})


# --- bench_agents (issue 46) -------------------------------------------------------------------------------------
AGENTS = "2026-12-05-g4x4-w4-free-sim"


def agents_table(name: str = AGENTS) -> str:
    """bench_agents: real, simulated and replayed steps/s, step time and lag per mode, and the async speed-up."""
    meta, _ = run("bench_agents", name)
    rows = [[r["mode"], r["source"], f"{r['steps_per_s']:.3f}", f"{r['step_ms']:.0f}", f"{r['lag_mean']:.2f}",
             f"{r['speedup']:.2f}x" if r["mode"] == "async" else "1 (base)"]
            for _, r in frame("bench_agents", name, "predicted.csv").iterrows()]
    return table(rows, ["mode", "source", "steps/s", "ms/step", "lag", "async/sync"]) + f"\n{machine(meta)}; " \
        f"data `benchmarks/data/bench_agents/{name}`\n"


def agents_number(what: str, name: str = AGENTS) -> Callable[[], str]:
    def make() -> str:
        r = run("bench_agents", name)[0]["results"]
        if what == "speedup":
            per = ", ".join(f"{x:.2f}" for x in r["speedup_repeats"])
            return (f"{r['speedup_real']:.2f}x (the median repeat of each mode; per repeat {per}), against "
                    f"{r['speedup_simulate']:.2f}x predicted by `asyncrl simulate` and {r['speedup_replay']:.2f}x by "
                    f"the replay")
        return (f"a synchronous step took {r['sync_step_ms_median']:.0f} ms, training {r['train_ms_median']:.0f} ms "
                f"of it, for {r['env_calls_per_step']:.0f} environment calls ({r['turns_mean']:.2f} turns a "
                f"trajectory); the fit: {r['fit']['rule'].split('multi-turn: ')[-1]}")
    return make


AGENTS_W8 = "2026-12-05-g4x4-w8-free-sim"


def agents_workers(name: str = AGENTS_W8) -> str:
    """The same bench with more environment workers: the speed-ups and the synchronous step."""
    meta, _ = run("bench_agents", name)
    r = meta["results"]
    per = ", ".join(f"{x:.2f}" for x in r["speedup_repeats"])
    return (f"with {r['settings']['workers']} workers async ran {r['speedup_real']:.2f}x (per repeat {per}; "
            f"`simulate` {r['speedup_simulate']:.2f}x, replay {r['speedup_replay']:.2f}x), a synchronous step "
            f"{r['sync_step_ms_median']:.0f} ms; {machine(meta)}; data `benchmarks/data/bench_agents/{name}`")


def agents_short() -> str:
    """One line for the README: the async speed-up with 8 and with 4 environment workers, and what simulate said."""
    w8, w4 = (run("bench_agents", n)[0]["results"] for n in (AGENTS_W8, AGENTS))
    return (f"{w8['speedup_real']:.2f}x the synchronous steps/s with {w8['settings']['workers']} environment workers "
            f"and {w4['speedup_real']:.2f}x with {w4['settings']['workers']} (`asyncrl simulate` predicted "
            f"{w8['speedup_simulate']:.2f}x and {w4['speedup_simulate']:.2f}x)")


REPORTS.update({
    "agents_short": agents_short,
    "agents_workers": agents_workers,
    "agents_table": agents_table,
    "agents_speedup": agents_number("speedup"),
    "agents_where": agents_number("where"),
})


# --- issue 46: guess_letter, does the model use what the environment said? (bench_guess_letter.py) ---------------
GUESS_LETTER = "2026-12-05-400-steps-seeds-0-1-2"


def guess_letter_short() -> str:
    """Final held-out accuracy per seed against the blind-play bar, and how many seeds beat it."""
    meta, rows = run("bench_guess_letter", GUESS_LETTER)
    bar = float(rows.constant_answer_accuracy.iloc[0])
    seeds = ", ".join(str(s) for s in rows.seed)
    return (f"final held-out accuracy {' / '.join(f'{a:.2f}' for a in rows.final_eval_accuracy)} over seeds "
            f"{seeds} after {int(rows.steps.iloc[0])} steps against the blind-play bar {bar:.3f}: "
            f"{int(rows.beat.sum())} of {len(rows)} above")


REPORTS.update({
    "guess_letter": csv_table("bench_guess_letter", GUESS_LETTER, columns=[
        "seed", "steps", "wall_s", "untrained_eval_accuracy", "final_eval_accuracy", "constant_answer_accuracy",
        "beat"], note=" Held-out accuracy by step is in `curves.csv` beside it."),
    "guess_letter_short": guess_letter_short,
    "guess_letter_figure": lambda: (f"![Held-out accuracy of `asyncrl run guess_letter --steps 400` by step, seeds "
                                    f"0, 1, 2, with the blind-play bar](data/bench_guess_letter/{GUESS_LETTER}/"
                                    f"accuracy.png)"),
})


# --- the GPU run of 2026-12-05, evening, on one H100 (issues 46 and 48) -------------------------------------------
H100_EVENING, CHECKS_EVENING = "2026-12-05-one-h100", "2026-12-05-one-h100-a2af9d5"


def _checks_evening(file: str) -> dict:
    return json.loads((DATA / "gpu_checks" / CHECKS_EVENING / file).read_text())


def agents_gpu_test() -> str:
    """The countdown tool task's GPU test: what one asynchronous run did (tests/gpu/test_agents_gpu.py)."""
    info = _checks_evening("agents_gpu.json")
    a, tool = info["agents_gpu"], info["tool_model"]
    return (f"{a['steps']} asynchronous steps of {a['groups'] // a['steps']} groups x 8 in {a['wall_s']:.0f} s: "
            f"{a['turns_mean']:.2f} model turns and {a['tool_calls_per_trajectory']:.2f} tool calls a trajectory "
            f"({a['multi_turn_share']:.0%} of them more than one turn), {a['env_tokens_mean']:.0f} observation tokens "
            f"a trajectory ({a['observation_tokens_in_batches']:,} in the train batches, all with loss mask 0), "
            f"{a['spanning_groups']} groups spanning two weight versions, vLLM's prefix-cache hit rate "
            f"{a['prefix_cache_hit_rate']:.2f}, reward {a['reward_mean']:.1f} (the ~{tool['parameters'] / 1e6:.0f}M "
            f"model, warm-started in {tool['sft_s']:.0f} s on the device, called the tool in "
            f"{tool['probe_tool_call_rate']:.0%} of sampled first turns but never solved a held-out countdown); "
            f"`tests/gpu/test_agents_gpu.py` passed; data `benchmarks/data/gpu_checks/{CHECKS_EVENING}/agents_gpu.json`")


def agents_gpu_line(r: dict, _) -> str:
    return (f"multi-turn generation ran {r['multi_over_single_tokens_per_s']:.2f}x the single-turn tokens/s over a "
            f"pass's wall time ({r['multi_over_single_engine_tokens_per_s']:.2f}x per second the engine stepped); "
            f"asynchronous {r['async_over_sync_steps_per_s']:.2f}x the synchronous steps/s over "
            f"{r['steps']} timed steps; prefix-cache hit rate {r['prefix_cache_hit_rate_sync']:.2f} synchronous, "
            f"{r['prefix_cache_hit_rate_async']:.2f} asynchronous")


def lora_8b_line(r: dict, _) -> str:
    return (f"synchronous {r['steps_per_s']['sync']:.3f} and asynchronous {r['steps_per_s']['async']:.3f} steps/s "
            f"({r['async_over_sync']:.2f}x, {r['steps']} timed steps each after {r['warmup']}), peak "
            f"{r['peak_allocated_gib']['async']:.1f} GiB allocated; a sync sent the adapter, "
            f"{r['sync_bytes']['adapter'] / 1e6:.0f} MB in {r['sync_ms']['adapter']:.0f} ms (median of {r['syncs']}), "
            f"against the full weights of the 0.5B shape, {r['sync_bytes']['full_weights'] / 1e9:.2f} GB in "
            f"{r['sync_ms']['full_weights']:.0f} ms")


def mfu_h100_line(r: dict, _) -> str:
    return (f"default {r['default']['mfu']:.1%} of the H100's dense bf16 peak ({r['default']['step_s']:.2f} s a "
            f"step), `trainer.compile: layers` {r['best']['mfu']:.1%} ({r['best']['step_s']:.2f} s), against the "
            f"{r['target_mfu']:.0%} aimed at")


REPORTS.update({
    "agents_gpu_test": agents_gpu_test,
    "agents_gpu_line": value("bench_agents_gpu", H100_EVENING, agents_gpu_line),
    "agents_gpu_table": csv_table("bench_agents_gpu", H100_EVENING, columns=[
        "part", "mode", "trajectories", "turns_mean", "tool_calls_mean", "sampled_tokens", "env_tokens", "wall_s",
        "tokens_per_s", "engine_tokens_per_s", "prefix_cache_hit_rate", "steps_per_s", "gen_busy_per_step_s",
        "train_busy_per_step_s"]),
    "lora_8b_line": value("bench_lora_gpu", H100_EVENING, lora_8b_line),
    "lora_8b_table": csv_table("bench_lora_gpu", H100_EVENING, columns=[
        "mode", "steps", "steps_per_s", "gen_busy_per_step_s", "train_busy_per_step_s", "train_tflops_median",
        "mfu_median", "sync_time_s_median", "sync_bytes_median", "peak_allocated_gib"]),
    "mfu_h100_line": value("bench_mfu_gpu", H100_EVENING, mfu_h100_line),
    "lora_8b_short": value("bench_lora_gpu", H100_EVENING, lambda r, _: (
        f"{r['steps_per_s']['async']:.2f} steps/s asynchronous, {r['async_over_sync']:.2f}x synchronous, "
        f"{r['peak_allocated_gib']['async']:.0f} GiB peak")),
    "mfu_h100_table": csv_table("bench_mfu_gpu", H100_EVENING, columns=[
        "variant", "status", "step_s", "train_tflops", "mfu", "static_gib", "step_extra_gib", "peak_allocated_gib"],
        digits=3, note=" Each failed row's error is in the same file; the kernel time by category in "
        "`categories.csv`."),
    "checks_h100_evening_lora": lambda: _checks_evening("summary.json")["steps"]["tests-rest"],
    "checks_h100_evening_notebook": lambda: _checks_evening("summary.json")["steps"]["notebook"],
})


# --- issue 48, 2026-12-06 on one H100: varlen attention, compiled layers, unseeded groups ----------------------
TRL_0612, MFU_REAL_0612, CHECKS_0612 = "2026-12-06-one-h100-varlen", "2026-12-06-real-shape-h100", \
    "2026-12-06-one-h100-2db142f"


def _ratio_0612(key: str) -> Callable[[], str]:
    return value("bench_trl_gpu", TRL_0612, lambda r, _: f"{r['ratios'][key]:.2f}x")


def _asyncrl_mfu(rows: pd.DataFrame, mode: str) -> str:
    row = rows[(rows["side"] == "asyncrl") & (rows["mode"] == mode)].iloc[0]
    return f"{row['mfu']:.1%}"


def mfu_real_line(r: dict, rows: pd.DataFrame) -> str:
    ok = rows[rows["status"] == "ok"].set_index("variant")
    flex = ok.loc["attention=flex"] if "attention=flex" in ok.index else None
    return (f"the preset's step (varlen attention, compiled layers) {r['default']['mfu']:.1%} of the H100's dense "
            f"bf16 peak ({r['default']['step_s']:.3f} s for {r['positions']:,} positions)"
            + ("" if flex is None else f", the same with FlexAttention {flex['mfu']:.1%} ({flex['step_s']:.3f} s)"))


def checks_0612_tests() -> str:
    """tests/gpu in one process: pytest's summary line, and the varlen kernel's errors beside flex's."""
    log = (DATA / "gpu_checks" / CHECKS_0612 / "pytest_gpu.log").read_text().splitlines()
    summary = next(line for line in reversed(log) if " passed" in line).strip("= ")
    errs = json.loads((DATA / "gpu_checks" / CHECKS_0612 / "flex_attention.json").read_text())["flex_vs_unfused"]
    return (f"tests/gpu in one process on an H100 80GB: {summary} (the skip: test_megatron_dp needs 2 GPUs); "
            f"test_flex_attention's bf16 logprob error against fp32 was {errs['varlen']['logprob_err']:.4f} for "
            f"varlen, {errs['flex']['logprob_err']:.4f} for flex and {errs['unfused']['logprob_err']:.4f} for the "
            f"unfused path")


REPORTS.update({
    "trl_0612": trl_rows(TRL_0612),
    "trl_0612_sync_steps": _ratio_0612("asyncrl_sync_over_trl_steps_per_s"),
    "trl_0612_async_steps": _ratio_0612("asyncrl_async_over_trl_steps_per_s"),
    "trl_0612_sync_tflops": _ratio_0612("asyncrl_sync_over_trl_useful_train_tflops"),
    "trl_0612_sync_mfu": value("bench_trl_gpu", TRL_0612, lambda _, rows: _asyncrl_mfu(rows, "sync")),
    "mfu_real_0612_line": value("bench_mfu_gpu", MFU_REAL_0612, mfu_real_line),
    "mfu_real_0612_short": value("bench_mfu_gpu", MFU_REAL_0612, lambda r, _: f"{r['default']['mfu']:.0%}"),
    "mfu_real_0612_table": csv_table("bench_mfu_gpu", MFU_REAL_0612, columns=[
        "variant", "status", "step_s", "train_tflops", "mfu", "micro_batch_tokens", "peak_allocated_gib"], digits=3,
        note=" The kernel time by category in `categories.csv`."),
    "checks_0612_tests": checks_0612_tests,
})


# --- issue 48, 2026-12-06 (second session): the varlen pass as one row, where a generation batch goes -------------
TRL_0612B, DECODE_0612, DECODE_0612_DICT = "2026-12-06-one-h100-onerow", "2026-12-06-one-h100", \
    "2026-12-06-one-h100-dict-logprobs"


def _ratio_0612b(key: str) -> Callable[[], str]:
    return value("bench_trl_gpu", TRL_0612B, lambda r, _: f"{r['ratios'][key]:.2f}x")


def decode_table() -> str:
    """bench_vllm_decode_gpu's medians by variant and way of generating, both H100 runs of 2026-12-06."""
    parts, where = [], []
    for name in (DECODE_0612, DECODE_0612_DICT):
        meta, rows = run("bench_vllm_decode_gpu", name)
        rows = rows[rows["run"] != "failed"]
        rows = rows if "gpu_busy" in rows else rows.assign(gpu_busy=float("nan"))  # a run without the profiled batch
        parts.append(rows.groupby(["variant", "run"], sort=False)[
            ["wall_s", "tokens_per_s", "engine_steps", "ms_per_step", "gpu_busy"]].median().reset_index())
        where.append(f"{machine(meta)}; `{meta['command']}`; data `benchmarks/data/bench_vllm_decode_gpu/{name}/`")
    data = pd.concat(parts)
    lines = ["| variant | run | seconds a batch | tokens/s | engine steps | ms a step | GPU busy |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in data.itertuples():
        cell = lambda x, f: "" if pd.isna(x) else format(x, f)  # noqa: E731
        lines.append(f"| {r.variant} | {r.run} | {r.wall_s:.2f} | {r.tokens_per_s / 1e3:.1f}k | "
                     f"{cell(r.engine_steps, '.0f')} | {cell(r.ms_per_step, '.1f')} | {cell(r.gpu_busy, '.0%')} |")
    return "\n" + "\n\n".join(where) + "\n\n" + "\n".join(lines)


def decode_share(what: str) -> Callable[[], str]:
    """From the first decode run: the GPU's busy share of a profiled batch, or the sampled token's logprob's cost
    (``LLM.generate`` with it against without it)."""
    def make() -> str:
        _, rows = run("bench_vllm_decode_gpu", DECODE_0612)
        med = rows[rows["variant"] == "default"].groupby("run")["wall_s"].median()
        if what == "gpu_busy":
            return f"{rows['gpu_busy'].dropna().iloc[0]:.0%}"
        return f"{1 - med['generate_nolp'] / med['generate']:.0%}"
    return make


REPORTS.update({
    "trl_0612b": trl_rows(TRL_0612B),
    "trl_0612b_sync_steps": _ratio_0612b("asyncrl_sync_over_trl_steps_per_s"),
    "trl_0612b_async_steps": _ratio_0612b("asyncrl_async_over_trl_steps_per_s"),
    "trl_0612b_sync_tflops": _ratio_0612b("asyncrl_sync_over_trl_useful_train_tflops"),
    "trl_0612b_async_tflops": _ratio_0612b("asyncrl_async_over_trl_useful_train_tflops"),
    "trl_0612b_async_mfu": value("bench_trl_gpu", TRL_0612B, lambda _, rows: _asyncrl_mfu(rows, "async")),
    "trl_0612b_sync_mfu": value("bench_trl_gpu", TRL_0612B, lambda _, rows: _asyncrl_mfu(rows, "sync")),
    "decode_0612_table": decode_table,
    "decode_0612_gpu_busy": decode_share("gpu_busy"),
    "decode_0612_logprob_cost": decode_share("logprobs"),
})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 naming every table or number that does not match its data")
    args = parser.parse_args(argv)
    problems: list[str] = []
    for path in FILES:
        where = str(path.relative_to(ROOT))
        old = path.read_text()
        new = render(old, where, problems)
        if new == old:
            continue
        if args.check:
            for a, b in zip(MARKER.finditer(old), MARKER.finditer(new)):
                if a[0] != b[0]:
                    problems.append(f"{where}: report:{a['name']} no longer matches its data "
                                    f"(python benchmarks/report.py rewrites it)")
        else:
            path.write_text(new)
            print(f"rewrote {where}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
