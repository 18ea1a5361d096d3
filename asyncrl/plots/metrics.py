"""Metric panels of a run: reward and held-out accuracy, the lag distribution, throughput, and the lag history, from
the read API only (``metrics``, ``trace``, ``evaluations``, ``task``): a controller, a recorded view or an attached run.

Figures are built with ``matplotlib.figure.Figure`` (not pyplot): nothing is kept in pyplot's global registry, so a
figure shows exactly once when it is a cell's value, and never leaks. Metric names are read from ``asyncrl.metrics``
when a figure is drawn: a column the frame lacks is a ``KeyError`` naming it, not a blank panel.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from asyncrl import metrics as M
from asyncrl.trace import SELECT


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
    metrics, evals = ctrl.metrics, ctrl.evaluations.drop_duplicates(M.EVALUATED_VERSION.name, keep="last")
    ax.set_title("reward and held-out accuracy", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    if metrics.empty and evals.empty:
        ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    if not metrics.empty:
        step, reward = metrics[M.STEP.name], metrics[M.REWARD_MEAN.name]
        ax.plot(step, reward, color="#4C72B0", lw=1, alpha=0.5, label="train reward (batch)")
        ax.plot(step, reward.rolling(10, min_periods=1).mean(), color="#4C72B0", lw=2,
                label="train reward (10-step mean)")
    if not evals.empty:
        ax.plot(evals[M.EVALUATED_VERSION.name], evals[M.HELD_OUT_ACCURACY.name], "o-", color="#DD8452", ms=4,
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
    """Completion tokens trained and generated per second by step; the last step's useful training TFLOP/s, M.MFU
    (on a GPU with a known peak) and padding (positions computed per real token) as a line of text."""
    metrics = ctrl.metrics
    ax.set_title("throughput", fontsize=10)
    ax.set_xlabel("optimizer step")
    if metrics.empty:
        ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    ax.plot(metrics[M.STEP.name], metrics[M.TOKENS_PER_S.name], color="#8172B3", lw=1.5, label="trained")
    if M.GEN_TOKENS_PER_S.name in metrics:  # a simulated or older run may lack the engine-side columns
        ax.plot(metrics[M.STEP.name], metrics[M.GEN_TOKENS_PER_S.name], color="#55A868", lw=1.2, label="generated")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower left", frameon=False)
    last = metrics.iloc[-1]
    facts = []
    if pd.notna(last.get(M.TRAIN_TFLOPS.name)):
        facts.append(f"train {last[M.TRAIN_TFLOPS.name]:.3g} TFLOP/s")
    if pd.notna(last.get(M.MFU.name)):
        facts.append(f"M.MFU {100 * last[M.MFU.name]:.1f}%")
    if last.get(M.TRAIN_TOKENS.name):  # positions computed per real token: what padding costs
        facts.append(f"padding x{last[M.TRAIN_PADDED_TOKENS.name] / last[M.TRAIN_TOKENS.name]:.2f}")
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


def draw_lag_history(ctrl, ax) -> None:
    """Mean and largest lag of the groups trained per step, so far (a view: through its step)."""
    metrics = ctrl.metrics
    ax.set_title("lag of trained groups", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("lag (T - weight version)")
    if metrics.empty:
        ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    ax.step(metrics[M.STEP.name], metrics["lag_max"], where="mid", color="#C44E52", lw=1, label="largest")
    ax.plot(metrics[M.STEP.name], metrics[M.LAG_MEAN.name], color="#4C72B0", lw=1.5, label="mean")
    ax.plot(metrics[M.STEP.name].iloc[-1:], metrics[M.LAG_MEAN.name].iloc[-1:], "o", color="#4C72B0")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.1, max(1, int(metrics["lag_max"].max())) + 0.6)
    ax.legend(fontsize=8, loc="upper left", frameon=False, ncols=2)
