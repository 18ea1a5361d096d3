"""The figure of a replay comparison (``asyncrl.replay.compare(...).figure()``): a column per run (the recording
first, then each replay), the same panels in each row, on shared axes so the columns read against each other.

Rows: the lag of the trained groups; their tokens by how many versions before ``T`` they were sampled
(``token_staleness/k``, token-weighted over the run); the groups dropped, by their lag at the drop and how
(evicted, aborted, skipped); what the sampler skews (the mean completion length, then the mean reward, of what was
generated, trained and dropped); the schedule against the recording's (per step, the share of the groups trained
that the recording trained at that step). Returns a ``matplotlib.figure.Figure`` (no pyplot state).
"""

from __future__ import annotations

import math

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from asyncrl import metrics as M

KINDS = ("gen", "train", "drop")
KIND_COLORS = {"gen": "#8C8C8C", "train": "#4C72B0", "drop": "#C44E52"}
HOW_COLORS = {"evicted": "#C44E52", "aborted": "#DD8452", "skipped": "#8172B2"}


def comparison_figure(cmp) -> Figure:
    table, drops, sched = cmp.table, cmp.drops, cmp.schedule
    names = list(table.columns)
    rows = ["lag", "token staleness", "drops", "length", "reward", "schedule"]
    fig = Figure(figsize=(3.1 * len(names) + 0.6, 2.3 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(names), squeeze=False, sharey="row")
    lag_max = max(1, int(max(table.loc["lag_max"].max(), _max(drops.lag))))
    recorded = sched[sched.sampler == names[0]]
    for j, name in enumerate(names):
        col, s = table[name], sched[sched.sampler == name]
        ax = axes[0][j]
        counts = s.lag.value_counts().sort_index()
        ax.bar(counts.index, counts.values, color="#55A868")
        rate = "no time" if math.isnan(col["steps_per_s"]) else f"{col['steps_per_s']:.3g} steps/s ({col['time_base']})"
        ax.set_title(f"{name}\n{rate}, lag mean {col['lag_mean']:.2f}", fontsize=9)
        ax.set_xlim(-0.6, lag_max + 0.6)
        ax.set_xlabel("lag when trained (versions)", fontsize=8)
        ax = axes[1][j]
        shares = [col[m.name] for m in M.TOKEN_STALENESS_SHARES]
        if any(math.isnan(v) for v in shares):
            ax.text(0.5, 0.5, "no token staleness\nin these metrics", ha="center", va="center", transform=ax.transAxes,
                    color="grey", fontsize=8)
        else:
            ax.bar(range(len(shares)), shares, color="#8172B3")
        ax.set_xticks(range(len(shares)), [m.name.split("/")[1] for m in M.TOKEN_STALENESS_SHARES])
        mean = col[M.TOKEN_STALENESS_MEAN.name]
        ax.set_title("token staleness" + ("" if math.isnan(mean) else f": mean {mean:.2f}, "
                                          f"{col[M.SPANNING_FRACTION.name]:.0%} spanning"), fontsize=9)
        ax.set_xlabel("versions behind T when trained", fontsize=8)
        ax = axes[2][j]
        mine = drops[drops.sampler == name]
        bottom = {}
        for how, color in HOW_COLORS.items():
            part = mine[mine.how == how]
            if len(part):
                lags = part.lag.astype(int).tolist()
                ax.bar(lags, part.groups, bottom=[bottom.get(k, 0) for k in lags], color=color, label=how)
                for k, n in zip(lags, part.groups):
                    bottom[k] = bottom.get(k, 0) + n
        dropped = int(col["groups_evicted"] + col["groups_aborted"] + col["groups_skipped"])
        ax.set_title(f"dropped {dropped} of {int(col['groups_dispatched'])} groups", fontsize=9)
        ax.set_xlim(-0.6, lag_max + 0.6)
        ax.set_xlabel("lag when dropped (versions)", fontsize=8)
        if bottom:
            ax.legend(fontsize=7, loc="upper right")
        for row, skew in ((3, M.SKEW_LEN), (4, M.SKEW_REWARD)):
            ax = axes[row][j]
            values = [col[skew[k].name] for k in KINDS]
            ax.bar(list(KINDS), [0 if math.isnan(v) else v for v in values], color=[KIND_COLORS[k] for k in KINDS])
            for x, v in enumerate(values):
                ax.text(x, 0 if math.isnan(v) else v, "n/a" if math.isnan(v) else f"{v:.3g}", ha="center",
                        va="bottom", fontsize=7)
            ax.set_title("mean completion length" if row == 3 else "mean reward", fontsize=9)
        ax = axes[5][j]
        same = _agreement(s, recorded)
        ax.plot(same.index, same.values, color="#4C72B0", lw=1)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("step", fontsize=8)
        ax.set_title(f"the recording's groups at its step: {same.mean():.0%}", fontsize=9)
    axes[0][0].set_ylabel("groups trained")
    axes[1][0].set_ylabel("share of trained tokens")
    axes[2][0].set_ylabel("groups dropped")
    axes[3][0].set_ylabel("tokens")
    axes[4][0].set_ylabel("reward")
    axes[5][0].set_ylabel("share of the step's groups")
    for ax in [*axes[0], *axes[2]]:  # lags are whole versions
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes.flat:
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    return fig


def _max(values) -> int:
    values = values.dropna()
    return int(values.max()) if len(values) else 0


def _agreement(mine, recorded):
    """Per step, the share of the groups a run trained that the recording trained at the same step (a replayed
    group counts as the recorded group it was served)."""
    theirs = set(zip(recorded.step, recorded.recorded_group))
    hits = [(step, (step, group) in theirs) for step, group in zip(mine.step, mine.recorded_group)]
    frame = pd.DataFrame(hits, columns=["step", "same"])
    return frame.groupby("step").same.mean()
