"""Figures and tables of a run that need no ipywidgets: pandas DataFrames and matplotlib Figures, for scripts, the
CLI, static notebooks and the interactive views in ``widgets/`` (which re-export these names).

Everything here reads the read API only (``asyncrl.read_view.ReadView``: ``state()``, ``explain()``, ``trace``,
``metrics``, ``evaluations``, ``task``), so it draws a controller (stepped or running), a recorded view
(``Recording.at``) and an attached run (``asyncrl.attach``) alike. Nothing here imports Jupyter packages.

    buffer_figure(ctrl)    buffer_table(ctrl)    verdict_table(ctrl, action="evict")
    metrics_figure(ctrl)   lag_table(ctrl)       bias_figure(ctrl)    skew_table(ctrl)    staleness_figure(ctrl)
    conversation_figure(ctrl, group_id)          conversation_table / conversation_html  (a multi-turn group)
    replay_figure(rec.at(step, event))           plot_simulation(sim) / plot_sweep / plot_grid  (asyncrl.simulate)
"""

from __future__ import annotations

import io

from asyncrl.plots.buffer import LABELS, STATES, buffer_figure, buffer_table, draw_buffer, step_events, verdict_table
from asyncrl.plots.conversation import (
    GUESS_LETTER_REPLIES, conversation_figure, conversation_groups, conversation_html, conversation_table,
)
from asyncrl.plots.metrics import (
    draw_lag_history, draw_lags, draw_reward, draw_throughput, lag_table, metrics_figure,
)
from asyncrl.plots.recording import replay_figure
from asyncrl.plots.simulation import plot_grid, plot_simulation, plot_sweep
from asyncrl.plots.skew import SKEW_COLOURS, SKEW_LABELS, bias_figure, draw_bias, skew_table
from asyncrl.plots.staleness import draw_gap, draw_token_staleness, staleness_figure


def png(fig, dpi: int = 80) -> bytes:
    """A Figure as PNG bytes (deterministic for the same drawing)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


__all__ = [
    "LABELS", "STATES", "SKEW_COLOURS", "SKEW_LABELS", "bias_figure", "buffer_figure", "buffer_table", "draw_bias",
    "draw_buffer", "draw_lag_history", "draw_lags", "draw_reward", "draw_throughput", "lag_table", "metrics_figure",
    "plot_grid", "plot_simulation", "plot_sweep", "png", "replay_figure", "skew_table", "step_events", "verdict_table",
    "draw_gap", "draw_token_staleness", "staleness_figure", "GUESS_LETTER_REPLIES", "conversation_figure",
    "conversation_groups", "conversation_html", "conversation_table",
]
