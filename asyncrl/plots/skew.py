"""What the sampler skews: completion length and reward of the groups generated, trained and dropped, from the
per-step ``*_len_mean`` / ``*_reward_mean`` metrics of a controller, a recorded view or an attached run.

Figures are built with ``matplotlib.figure.Figure`` (not pyplot): nothing is kept in pyplot's global registry, so a
figure shows exactly once when it is a cell's value, and never leaks. Metric names are read from ``asyncrl.metrics``
when a figure is drawn: a column the frame lacks is a ``KeyError`` naming it, not a blank panel.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from asyncrl import metrics as M


SKEW_COLOURS = {"gen": "#8C8C8C", "train": "#55A868", "drop": "#C44E52"}
SKEW_LABELS = {"gen": "generated", "train": "trained", "drop": "dropped"}


def skew_table(ctrl) -> pd.DataFrame:
    """What the sampler skews, over the run so far: for the groups generated, trained and dropped (evicted or
    aborted), the completion-weighted mean completion length and reward, the completions, and the steps that had
    any (from the per-step ``*_len_mean`` / ``*_reward_mean`` metrics)."""
    metrics, rows = ctrl.metrics, {}
    for kind in M.SKEW_KINDS:
        if metrics.empty or M.SKEW_LEN[kind].name not in metrics:
            rows[SKEW_LABELS[kind]] = {"completions": 0, "steps": 0, "len_mean": float("nan"),
                                       "reward_mean": float("nan")}
            continue
        n = metrics[M.SKEW_COUNT[kind]].fillna(0)
        has = n > 0
        rows[SKEW_LABELS[kind]] = {
            "completions": int(n.sum()), "steps": int(has.sum()),
            "len_mean": float((metrics[M.SKEW_LEN[kind].name][has] * n[has]).sum() / n.sum()) if n.sum() else
            float("nan"),
            "reward_mean": float((metrics[M.SKEW_REWARD[kind].name][has] * n[has]).sum() / n.sum()) if n.sum() else
            float("nan"),
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def draw_bias(ctrl, axes) -> None:
    """Two Axes: completion length and reward of the groups generated, trained and dropped, side by side: the
    distribution of the per-step means (a box per kind) and the run's completion-weighted mean (a diamond)."""
    metrics, table = ctrl.metrics, skew_table(ctrl)
    for ax, (what, metric) in zip(axes, (("completion length (tokens)", M.SKEW_LEN), ("reward", M.SKEW_REWARD))):
        data, labels, colours, means = [], [], [], []
        for kind in M.SKEW_KINDS:
            values = metrics[metric[kind].name].dropna() if metric[kind].name in metrics else pd.Series(dtype=float)
            row = table.loc[SKEW_LABELS[kind]]
            data.append(values.values)
            labels.append(f"{SKEW_LABELS[kind]}\n({int(row.completions):,})")
            colours.append(SKEW_COLOURS[kind])
            means.append(row.len_mean if metric is M.SKEW_LEN else row.reward_mean)
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
