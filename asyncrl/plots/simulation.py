"""Figures of simulated runs (``asyncrl.simulate``): one run at a glance, and a sweep's throughput against staleness.

Both return a ``matplotlib.figure.Figure`` (no pyplot state), so they work headless and in notebooks alike.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

COLORS = {"in_order": "#4C72B0", "weight_fifo": "#55A868", "windowed": "#C44E52", "ready_first": "#8172B2"}
STYLES = {"in_order": ("o", "-"), "weight_fifo": ("s", "--"), "windowed": ("^", ":"), "ready_first": ("D", "-.")}


def sampler_label(sampler: dict) -> str:
    letters = {"max_staleness_versions": "W", "max_lookahead_versions": "L"}
    knobs = ", ".join(f"{letters[k]}={v}" for k, v in sampler.items() if k in letters)
    return f"{sampler['name']} {knobs}".strip()


def plot_simulation(sim) -> Figure:
    """Reward over simulated time, the lag of the trained groups, and each side's busy/idle share."""
    s, m = sim.summary(), sim.metrics
    fig = Figure(figsize=(12, 3.4), layout="constrained")
    ax_reward, ax_lag, ax_busy = fig.subplots(1, 3, width_ratios=[2, 1, 1])
    ax_reward.plot(m.sim_time_s / 3600, m.reward_mean, color="#4C72B0", lw=1)
    ax_reward.set_xlabel("simulated time (hours)")
    ax_reward.set_ylabel("train reward (mean per step)")
    ax_reward.set_ylim(-0.02, 1.02)
    ax_reward.grid(alpha=0.3)
    ax_reward.set_title(f"{s['sim_steps_per_hour']:.0f} steps per simulated hour", fontsize=10)
    lags = {int(k): v for k, v in s["lag_counts"].items()}
    ax_lag.bar(list(lags), list(lags.values()), color="#55A868")
    ax_lag.set_xticks(list(lags) or [0])
    ax_lag.set_xlabel("lag when trained (versions)")
    ax_lag.set_ylabel("groups trained")
    ax_lag.set_title(f"dropped {s['groups_dropped']} of {s['groups_dispatched']} groups", fontsize=10)
    sides = ["generator", "trainer"]
    busy = [s["gen_busy_frac"], s["train_busy_frac"]]
    ax_busy.barh(sides, busy, color="#4C72B0", label="busy")
    ax_busy.barh(sides, [1 - b for b in busy], left=busy, color="#DDDDDD", label="idle")
    for y, b in enumerate(busy):
        ax_busy.text(min(b, 0.97) / 2, y, f"{b:.0%}", ha="center", va="center", color="white", fontsize=9)
    ax_busy.set_xlim(0, 1)
    ax_busy.set_xlabel("share of simulated time")
    ax_busy.set_title("busy / idle", fontsize=10)
    ax_busy.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"{sampler_label(s['sampler'])}: {s['steps']} simulated steps, seed {s['seed']}", fontsize=11)
    return fig


def plot_sweep(df: pd.DataFrame, limit: float | None = None, ax=None):
    """Steps per simulated hour (y) against mean lag (x), one colour per sampler, windows annotated. ``limit``
    (steps per hour) draws the two-stage limit: no overlap can beat the slower stage alone. Returns the figure."""
    if ax is None:
        fig = Figure(figsize=(7, 4.2), layout="constrained")
        ax = fig.subplots()
    else:
        fig = ax.figure
    notes = []  # (lag, steps per hour, label, colour) of every point, placed once the axes' ranges are known
    for name, rows in df.groupby("sampler", sort=False):
        rows = rows.groupby("window", as_index=False)[["lag_mean", "sim_steps_per_hour", "drop_frac"]].mean()
        marker, line = STYLES.get(name, ("o", "-"))
        ax.plot(rows.lag_mean, rows.sim_steps_per_hour, marker=marker, ls=line, color=COLORS.get(name), label=name,
                ms=5, mfc="none" if line != "-" else None)
        for _, r in rows.iterrows():
            note = f"W={int(r.window)}" + (f", {r.drop_frac:.0%} dropped" if r.drop_frac > 0.005 else "")
            notes.append((r.lag_mean, r.sim_steps_per_hour, note, COLORS.get(name, "#333333")))
    if limit is not None:
        ax.axhline(limit, color="#333333", ls="--", lw=1, label="two-stage limit (slower stage alone)")
    ax.set_xlabel("mean lag of trained groups (versions)")
    ax.set_ylabel("steps per simulated hour")
    top = max(df.sim_steps_per_hour.max(), limit or 0)
    ax.set_ylim(0, top * 1.15)
    _place_notes(ax, notes)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("throughput against staleness", fontsize=10)
    return fig


def _place_notes(ax, notes: list[tuple[float, float, str, str]]) -> None:
    """Label each point below and right of it. Points closer than a label's size share one label when they would
    say the same (samplers that agree); a different label near a labelled point goes above it instead."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    placed: list[tuple[float, float, str, bool]] = []
    for x, y, note, color in notes:
        near = [p for p in placed if abs(p[0] - x) < 0.08 * (x1 - x0) and abs(p[1] - y) < 0.06 * (y1 - y0)]
        if any(p[2] == note for p in near):
            continue
        above = any(not p[3] for p in near)
        ax.annotate(note, (x, y), textcoords="offset points", xytext=(5, 4 if above else -11), fontsize=7,
                    color=color)
        placed.append((x, y, note, above))


def plot_grid(df: pd.DataFrame, axes: list[str]) -> Figure:
    """A sweep (``asyncrl.simulate.grid``): tokens/s per GPU at each point, the best one marked, and each side's
    idle share beside it. ``axes``: the swept columns (dotted config keys), which label the points."""
    short = {"generation.replicas": "gen", "trainer.data_parallel": "train", "sampler.max_staleness_versions": "W",
             "sampler.max_lookahead_versions": "L", "generation.concurrency": "slots"}
    if set(axes) == {"generation.replicas", "trainer.data_parallel"}:
        labels = [f"{r.replicas} gen + {r.data_parallel} train" for r in df.itertuples()]
    else:
        labels = [", ".join(f"{short.get(k, k.split('.')[-1])}={v}" for k, v in zip(axes, row))
                  for row in df[axes].itertuples(index=False)]
    x = list(range(len(df)))
    fig = Figure(figsize=(max(7.0, 0.55 * len(df) + 5), 4.0), layout="constrained")
    ax_rate, ax_idle = fig.subplots(1, 2, width_ratios=[3, 2])
    colors = ["#C44E52" if best else "#4C72B0" for best in df.best]
    ax_rate.bar(x, df.tokens_per_s_per_gpu, color=colors)
    i = int(df.best.to_numpy().argmax())
    best = df.iloc[i]
    ax_rate.annotate(f"best: {best.tokens_per_s_per_gpu:,.0f}", (i, best.tokens_per_s_per_gpu),
                     textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8, color="#C44E52")
    ax_rate.set_ylim(0, df.tokens_per_s_per_gpu.max() * 1.15)
    ax_rate.set_ylabel("trained tokens / simulated s / GPU")
    gpus = sorted(set(df.gpus))
    ax_rate.set_title(f"throughput per GPU ({', '.join(map(str, gpus))} GPUs)" if len(gpus) <= 3 else
                      "throughput per GPU", fontsize=10)
    width = 0.4
    ax_idle.bar([v - width / 2 for v in x], df.gen_idle, width, color="#55A868", label="generation (mean replica)")
    ax_idle.bar([v + width / 2 for v in x], df.train_idle, width, color="#8172B2", label="training")
    ax_idle.set_ylim(0, 1.18)
    ax_idle.set_ylabel("idle share of simulated time")
    ax_idle.set_title("idle", fontsize=10)
    ax_idle.legend(loc="upper left", fontsize=7, frameon=False)
    for ax in (ax_rate, ax_idle):
        ax.set_xticks(x, labels, rotation=35 if len(df) > 3 else 0, ha="right" if len(df) > 3 else "center",
                      fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("simulated sweep: predictions of the simulator, not measurements", fontsize=11)
    return fig
