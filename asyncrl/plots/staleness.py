"""Staleness as the tokens saw it and the training-inference gap, by step, from the read API's ``metrics``: the
share of the trained tokens sampled 0, 1, ... versions before ``T`` (``token_staleness/k``) with the share of
completions that span versions, and the importance weight's two parts (``is_staleness_mean``,
``is_mismatch_mean``) with ``mismatch_kl``. The dashboard shows ``staleness_figure`` under the other metric plots.

A recording or a run from before these metrics existed has no such columns: the panels say so instead of drawing.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from asyncrl import metrics as M

SHADES = ("#4C72B0", "#55A868", "#DD8452", "#C44E52", "#8172B3")  # staleness 0, 1, 2, 3, 4+


def _empty(ax, metrics, names, what: str) -> bool:
    if metrics.empty or any(n not in metrics for n in names):
        ax.text(0.5, 0.5, f"no {what} in these metrics" if not metrics.empty else "no steps yet", ha="center",
                va="center", transform=ax.transAxes, color="grey")
        return True
    return False


def draw_token_staleness(ctrl, ax) -> None:
    """The trained tokens of each step by how many versions before ``T`` they were sampled (stacked shares), and
    the share of its completions whose tokens span versions."""
    metrics = ctrl.metrics
    shares = [m.name for m in M.TOKEN_STALENESS_SHARES]
    ax.set_title("token staleness, by step", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("share of trained tokens")
    if _empty(ax, metrics, shares + [M.SPANNING_FRACTION.name], "token staleness"):
        return
    step = metrics[M.STEP.name]
    ax.stackplot(step, [metrics[n].fillna(0) for n in shares], colors=SHADES,
                 labels=[f"{n.split('/')[1]} behind" for n in shares], alpha=0.85, step="mid")
    ax.plot(step, metrics[M.SPANNING_FRACTION.name], color="black", lw=1.2, ls="--", label="completions spanning")
    ax.set_ylim(0, 1.02)
    mean = metrics[M.TOKEN_STALENESS_MEAN.name].iloc[-1]
    ax.text(0.02, 0.96, f"last step: mean {mean:.2f} versions", transform=ax.transAxes, fontsize=8, va="top")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0)


def draw_gap(ctrl, ax) -> None:
    """The importance weight's two parts by step: staleness (trainer at ``T`` over trainer at the sampling
    weights) and mismatch (trainer over generator at the same weights), with the mismatch's KL on its own axis."""
    metrics = ctrl.metrics
    names = [M.IS_STALENESS_MEAN.name, M.IS_MISMATCH_MEAN.name, M.MISMATCH_KL.name]
    ax.set_title("the training-inference gap, apart", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean importance-weight part")
    if _empty(ax, metrics, names, "gap metrics"):
        return
    step = metrics[M.STEP.name]
    ax.plot(step, metrics[M.IS_STALENESS_MEAN.name], color="#DD8452", lw=1.5, label="staleness part")
    ax.plot(step, metrics[M.IS_MISMATCH_MEAN.name], color="#4C72B0", lw=1.5, label="mismatch part")
    kl = ax.twinx()
    kl.plot(step, metrics[M.MISMATCH_KL.name], color="#8172B3", lw=1, ls=":", label="mismatch KL (right)")
    kl.set_ylabel("mismatch KL (k3, per token)", fontsize=8)
    kl.set_ylim(bottom=0)
    lines = ax.get_lines() + kl.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="upper left", bbox_to_anchor=(1.12, 1.0),
              frameon=False, borderaxespad=0)


def staleness_figure(ctrl, figsize=(14.4, 3.0)) -> Figure:
    """Token staleness by step beside the training-inference gap."""
    fig = Figure(figsize=figsize, layout="constrained")
    left, right = fig.subplots(1, 2)
    draw_token_staleness(ctrl, left)
    draw_gap(ctrl, right)
    return fig
