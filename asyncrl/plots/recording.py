"""A recorded view at a glance (``Recording.at``): the buffer by weight version at its trace row and the lag history
to it.

Built with ``matplotlib.figure.Figure`` (no pyplot state), so it works headless and in notebooks alike.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from asyncrl.plots.buffer import draw_buffer
from asyncrl.plots.metrics import draw_lag_history


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
