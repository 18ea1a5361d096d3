"""Plain renderings of a controller: pandas DataFrames and matplotlib Figures, no ipywidgets.

Everything here reads the controller's public read API only (``state()``, ``trace``, ``metrics``, ``explain()``),
so it works on any controller, stepped or running, and shows in static renderings of a notebook.

Figures are built with ``matplotlib.figure.Figure`` (not pyplot): nothing is kept in pyplot's global registry,
so a figure shows exactly once when it is a cell's value, and never leaks.
"""

from __future__ import annotations

import io

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from asyncrl.metrics import (
    EVALUATED_VERSION,
    GEN_TOKENS_PER_S,
    HELD_OUT_ACCURACY,
    LAG_MEAN,
    MFU,
    REWARD_MEAN,
    SKEW_COUNT,
    SKEW_KINDS,
    SKEW_LEN,
    SKEW_REWARD,
    STEP,
    TOKENS_PER_S,
    TRAIN_PADDED_TOKENS,
    TRAIN_TFLOPS,
    TRAIN_TOKENS,
)
from asyncrl.trace import ABORT, EVICT, SELECT

# Colours of the buffer states (stack order, bottom to top). "doomed": ready groups the next train tick evicts.
STATES = {
    "ready": "#4C72B0",
    "doomed": "#F4D4D5",
    "pending": "#B0C4DE",
    "selected": "#55A868",
    "evicted": "#C44E52",
}
LABELS = {  # {step}: the step whose events are shown (see step_events)
    "ready": "ready",
    "doomed": "ready, evicted by the next train tick",
    "pending": "pending",
    "selected": "selected for step {step}",
    "evicted": "evicted / aborted in step {step}",
}


def _shown_step(ctrl) -> tuple[int, pd.DataFrame]:
    trace = ctrl.trace
    events = trace[trace.event.isin([SELECT, EVICT, ABORT])]
    T = ctrl.trainer_version
    # select/evict are stamped with the T they ran at; an abort happens just after T += 1, so it counts for T - 1.
    step = events.trainer_version - (events.event == ABORT).astype(int)
    current = events[step == T]
    return (T, current) if not current.empty else (T - 1, events[step == T - 1])


def step_events(ctrl) -> pd.DataFrame:
    """The select, evict and abort events of the current step ``T``, or, when it has none yet (it just started),
    those of step ``T - 1``, the one that just finished. The buffer view labels them with that step's number."""
    return _shown_step(ctrl)[1]


def buffer_table(ctrl, verdicts: pd.DataFrame | None = None) -> pd.DataFrame:
    """Slot counts by weight version: ``pending`` and ``ready`` (in the buffer now; ``doomed`` are the ready ones
    the next train tick will evict, by ``explain()``) and ``selected`` / ``evicted`` (taken out in the step
    ``step_events`` shows; evicted includes aborted), one row per version. ``verdicts``: ``explain()`` when the
    caller has it already (it costs a pass over the buffer)."""
    summary = ctrl.state().buffer
    verdicts = ctrl.explain() if verdicts is None else verdicts
    table = pd.DataFrame(
        {"pending": summary["pending"], "ready": summary["ready"]}, index=summary.index, dtype="int64"
    )
    doomed = verdicts[(verdicts.action == "evict") & (verdicts.state == "ready")].weight_version.astype(int)
    table["doomed"] = doomed.value_counts().reindex(table.index, fill_value=0).astype("int64")
    table["ready"] -= table["doomed"]
    events = step_events(ctrl)
    for column, kinds in (("selected", [SELECT]), ("evicted", [EVICT, ABORT])):
        counts = events[events.event.isin(kinds)].weight_version.astype(int).value_counts()
        table = table.reindex(table.index.union(counts.index), fill_value=0)
        table[column] = counts.reindex(table.index, fill_value=0).astype("int64")
    table.index.name = "weight_version"
    return table[list(STATES)]


def draw_buffer(ctrl, ax, verdicts: pd.DataFrame | None = None) -> None:
    """The buffer view on a matplotlib Axes: stacked bars by weight version, ``T`` and the window marked."""
    state = ctrl.state()
    table = buffer_table(ctrl, verdicts)
    shown = _shown_step(ctrl)[0]
    T, lo = state.trainer_version, state.lower_bound
    versions = list(table.index) + [T] + ([lo] if lo is not None else [])
    x0, x1 = min(versions), max(versions)
    if lo is not None:
        ax.axvspan(lo - 0.45, T + 0.45, color="#F2C14E", alpha=0.25, lw=0, label=f"window [{lo}, {T}]")
    bottom = pd.Series(0, index=table.index)
    for column, colour in STATES.items():
        if table[column].any():
            doomed = column == "doomed"  # hatched in the eviction colour: still in the buffer, not for long
            ax.bar(table.index, table[column], bottom=bottom, color=colour, width=0.7,
                   label=LABELS[column].format(step=shown), hatch="///" if doomed else None,
                   edgecolor=STATES["evicted"] if doomed else None, lw=0)
            bottom = bottom + table[column]
    spanning = state.buffer["spanning"] if "spanning" in state.buffer else pd.Series(dtype="int64")
    spanning = spanning[spanning > 0]
    if len(spanning):  # in-flight weight updates: ready groups whose tokens came from more than one version
        ax.bar(spanning.index, spanning, bottom=0, width=0.7, fill=False, hatch="xx", edgecolor="#222222", lw=0.6,
               label="ready, generated by several versions")
    ax.axvline(T, color="#333333", ls="--", lw=1.2, label=f"T = {T}")
    ax.set_xlim(x0 - 0.6, x1 + 0.6)
    ax.set_xticks(range(x0, x1 + 1))
    top = max(int(bottom.max()) if len(bottom) else 0, 1)
    ax.set_ylim(0, top * 1.1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("weight version")
    ax.set_ylabel("prompt groups")
    held = int(table["pending"].sum() + table["ready"].sum())
    ax.set_title(
        f"{state.sampler}: T={T}, generator at {state.generation_version}, "
        f"{held}/{state.capacity} slots, {state.inflight} in flight",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def buffer_figure(ctrl, figsize=(7.2, 3.4), verdicts: pd.DataFrame | None = None) -> Figure:
    """The buffer view as a Figure (see ``draw_buffer``)."""
    fig = Figure(figsize=figsize, layout="constrained")
    draw_buffer(ctrl, fig.add_subplot(), verdicts)
    return fig


def verdict_table(ctrl, action: str | None = None) -> pd.DataFrame:
    """The sampler's verdicts for the current buffer (``ctrl.explain()``), optionally only one ``action``
    (``select``, ``evict`` or ``keep``)."""
    verdicts = ctrl.explain()
    if action is not None:
        verdicts = verdicts[verdicts.action == action]
    return verdicts.reset_index(drop=True)


def lag_table(ctrl) -> pd.DataFrame:
    """Groups trained per step (rows) by lag ``T - weight_version`` (columns), from the trace's select events."""
    trace = ctrl.trace
    selected = trace[trace.event == SELECT]
    if selected.empty:
        return pd.DataFrame(index=pd.Index([], name="step", dtype="int64"))
    table = pd.crosstab(selected.trainer_version.astype(int), selected.lag.astype(int))
    table.index.name, table.columns.name = "step", "lag"
    return table


def _legend_outside(ax) -> None:
    """The legend right of the axes, so it never covers data (constrained layout makes room for it)."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0)


def draw_reward(ctrl, ax) -> None:
    """Train reward by step (each batch and a 10-step mean), held-out greedy accuracy by the weight version it
    judged (the untrained model's at 0 when ``eval_every`` is set), and the best constant answer's accuracy."""
    metrics, evals = ctrl.metrics, ctrl.evaluations.drop_duplicates(EVALUATED_VERSION.name, keep="last")
    ax.set_title("reward and held-out accuracy", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    if metrics.empty and evals.empty:
        ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    if not metrics.empty:
        step, reward = metrics[STEP.name], metrics[REWARD_MEAN.name]
        ax.plot(step, reward, color="#4C72B0", lw=1, alpha=0.5, label="train reward (batch)")
        ax.plot(step, reward.rolling(10, min_periods=1).mean(), color="#4C72B0", lw=2,
                label="train reward (10-step mean)")
    if not evals.empty:
        ax.plot(evals[EVALUATED_VERSION.name], evals[HELD_OUT_ACCURACY.name], "o-", color="#DD8452", ms=4,
                clip_on=False, label="held-out greedy accuracy")
    bar = ctrl.task.constant_answer_accuracy  # the best any prompt-independent answer scores: the bar to beat
    ax.axhline(bar, color="#DD8452", ls=":", lw=1, label=f"best constant answer ({bar:.2f})")
    _legend_outside(ax)


def draw_lags(ctrl, ax) -> None:
    """Lag distribution by step: a 2-D histogram (step × lag, shade = groups trained, scale in the colourbar) with
    the mean lag on top."""
    table = lag_table(ctrl)
    # the title sits a line higher than usual: the legend goes between it and the plot (see below)
    ax.set_title("lag of trained groups, by step", fontsize=10, loc="left", pad=15)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("lag (T - weight version)")
    if table.empty:
        ax.text(0.5, 0.5, "nothing trained yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    steps = range(int(table.index.min()), int(table.index.max()) + 1)
    lags = range(0, int(table.columns.max()) + 1)
    grid = table.reindex(index=steps, columns=lags, fill_value=0).T
    mesh = ax.pcolormesh([s - 0.5 for s in [*steps, steps[-1] + 1]], [lag - 0.5 for lag in [*lags, lags[-1] + 1]],
                         grid.values, cmap="Blues", vmin=0, shading="flat")
    ax.figure.colorbar(mesh, ax=ax, label="groups trained", pad=0.02)
    mean = (grid.mul(list(lags), axis=0).sum() / grid.sum().where(grid.sum() > 0))
    ax.plot(list(steps), mean.values, color="#C44E52", lw=1.5, label="mean lag")
    ax.set_yticks(list(lags))
    # above the plot, under the title (beside it, a narrow panel's title ran into it); right is the colourbar
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, borderaxespad=0.1,
              borderpad=0.0, handlelength=1.5)


def draw_throughput(ctrl, ax) -> None:
    """Completion tokens trained and generated per second by step; the last step's useful training TFLOP/s, MFU
    (on a GPU with a known peak) and padding (positions computed per real token) as a line of text."""
    metrics = ctrl.metrics
    ax.set_title("throughput", fontsize=10)
    ax.set_xlabel("optimizer step")
    if metrics.empty:
        ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    ax.plot(metrics[STEP.name], metrics[TOKENS_PER_S.name], color="#8172B3", lw=1.5, label="trained")
    if GEN_TOKENS_PER_S.name in metrics:  # a simulated or older run may lack the engine-side columns
        ax.plot(metrics[STEP.name], metrics[GEN_TOKENS_PER_S.name], color="#55A868", lw=1.2, label="generated")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower left", frameon=False)
    last = metrics.iloc[-1]
    facts = []
    if pd.notna(last.get(TRAIN_TFLOPS.name)):
        facts.append(f"train {last[TRAIN_TFLOPS.name]:.3g} TFLOP/s")
    if pd.notna(last.get(MFU.name)):
        facts.append(f"MFU {100 * last[MFU.name]:.1f}%")
    if last.get(TRAIN_TOKENS.name):  # positions computed per real token: what padding costs
        facts.append(f"padding x{last[TRAIN_PADDED_TOKENS.name] / last[TRAIN_TOKENS.name]:.2f}")
    if facts:  # a line of text above the curves: the top of the axis moves up to make room
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
        ax.text(0.02, 0.97, "last step: " + ", ".join(facts), transform=ax.transAxes, fontsize=8, va="top",
                color="#333333")


def metrics_figure(ctrl, figsize=(14.4, 3.2)) -> Figure:
    """Reward over steps, lag distribution by step, and throughput, side by side."""
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(1, 3)
    draw_reward(ctrl, axes[0])
    draw_lags(ctrl, axes[1])
    draw_throughput(ctrl, axes[2])
    return fig


SKEW_COLOURS = {"gen": "#8C8C8C", "train": "#55A868", "drop": "#C44E52"}
SKEW_LABELS = {"gen": "generated", "train": "trained", "drop": "dropped"}


def skew_table(ctrl) -> pd.DataFrame:
    """What the sampler skews, over the run so far: for the groups generated, trained and dropped (evicted or
    aborted), the completion-weighted mean completion length and reward, the completions, and the steps that had
    any (from the per-step ``*_len_mean`` / ``*_reward_mean`` metrics)."""
    metrics, rows = ctrl.metrics, {}
    for kind in SKEW_KINDS:
        if metrics.empty or SKEW_LEN[kind].name not in metrics:
            rows[SKEW_LABELS[kind]] = {"completions": 0, "steps": 0, "len_mean": float("nan"),
                                       "reward_mean": float("nan")}
            continue
        n = metrics[SKEW_COUNT[kind]].fillna(0)
        has = n > 0
        rows[SKEW_LABELS[kind]] = {
            "completions": int(n.sum()), "steps": int(has.sum()),
            "len_mean": float((metrics[SKEW_LEN[kind].name][has] * n[has]).sum() / n.sum()) if n.sum() else
            float("nan"),
            "reward_mean": float((metrics[SKEW_REWARD[kind].name][has] * n[has]).sum() / n.sum()) if n.sum() else
            float("nan"),
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def draw_bias(ctrl, axes) -> None:
    """Two Axes: completion length and reward of the groups generated, trained and dropped, side by side: the
    distribution of the per-step means (a box per kind) and the run's completion-weighted mean (a diamond)."""
    metrics, table = ctrl.metrics, skew_table(ctrl)
    for ax, (what, metric) in zip(axes, (("completion length (tokens)", SKEW_LEN), ("reward", SKEW_REWARD))):
        data, labels, colours, means = [], [], [], []
        for kind in SKEW_KINDS:
            values = metrics[metric[kind].name].dropna() if metric[kind].name in metrics else pd.Series(dtype=float)
            row = table.loc[SKEW_LABELS[kind]]
            data.append(values.values)
            labels.append(f"{SKEW_LABELS[kind]}\n({int(row.completions):,})")
            colours.append(SKEW_COLOURS[kind])
            means.append(row.len_mean if metric is SKEW_LEN else row.reward_mean)
        positions = range(1, len(data) + 1)
        shown = [(p, d, c) for p, d, c in zip(positions, data, colours) if len(d)]
        if shown:
            boxes = ax.boxplot([d for _, d, _ in shown], positions=[p for p, _, _ in shown], widths=0.55,
                               patch_artist=True, showfliers=False, medianprops={"color": "black"})
            for patch, (_, _, colour) in zip(boxes["boxes"], shown):
                patch.set(facecolor=colour, alpha=0.45)
        ax.scatter(list(positions), means, marker="D", color=colours, zorder=3, s=30, label="run mean")
        ax.set_xticks(list(positions), labels, fontsize=8)
        ax.set_xlim(0.4, len(data) + 0.6)
        ax.set_title(what, fontsize=10)
        ax.set_ylabel("per-step mean")
        ax.set_xlabel("groups (completions)", fontsize=8)
        if not any(len(d) for d in data):
            ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes, color="grey")
    axes[0].legend(fontsize=8, loc="upper right", frameon=False)


def bias_figure(ctrl, figsize=(8.4, 3.2), title: str | None = None) -> Figure:
    """What the sampler skews (``draw_bias``): a controller, a recorded view or an attached run."""
    fig = Figure(figsize=figsize, layout="constrained")
    draw_bias(ctrl, fig.subplots(1, 2))
    state = ctrl.state()
    fig.suptitle(title or f"{state.sampler}: what is generated, trained and dropped", fontsize=10)
    return fig


def draw_lag_history(ctrl, ax) -> None:
    """Mean and largest lag of the groups trained per step, so far (a view: through its step)."""
    metrics = ctrl.metrics
    ax.set_title("lag of trained groups", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("lag (T - weight version)")
    if metrics.empty:
        ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    ax.step(metrics[STEP.name], metrics["lag_max"], where="mid", color="#C44E52", lw=1, label="largest")
    ax.plot(metrics[STEP.name], metrics[LAG_MEAN.name], color="#4C72B0", lw=1.5, label="mean")
    ax.plot(metrics[STEP.name].iloc[-1:], metrics[LAG_MEAN.name].iloc[-1:], "o", color="#4C72B0")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.1, max(1, int(metrics["lag_max"].max())) + 0.6)
    ax.legend(fontsize=8, loc="upper left", frameon=False, ncols=2)


def replay_figure(view, figsize=(12.0, 3.4), verdicts: pd.DataFrame | None = None) -> Figure:
    """A recorded view (``Recording.at``): the buffer by weight version at that row, and the lag history to it."""
    fig = Figure(figsize=figsize, layout="constrained")
    left, right = fig.subfigures(1, 2, width_ratios=[1.75, 1])
    draw_buffer(view, left.add_subplot(), verdicts)
    draw_lag_history(view, right.add_subplot())
    row = view.row
    fig.suptitle(f"step {view.step}, trace row {row.seq}: {row.event}"
                 + (f" group {row.group_id}" if row.group_id is not None else "")
                 + (f" ({row.reason[:90]})" if row.reason else ""), fontsize=10)
    return fig


def png(fig: Figure, dpi: int = 80) -> bytes:
    """A Figure as PNG bytes (deterministic for the same drawing)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
