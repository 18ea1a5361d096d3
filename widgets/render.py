"""Plain renderings of a controller (pandas DataFrames and matplotlib Figures, no ipywidgets): they live in
``asyncrl.plots``, so scripts and the CLI draw them without the notebook package; the views here use them through
this module, and ``widgets`` re-exports them (``widgets.buffer_figure``, ``widgets.metrics_figure``, ...)."""

from asyncrl.plots import (  # noqa: F401
    GUESS_LETTER_REPLIES,
    LABELS,
    SKEW_COLOURS,
    SKEW_LABELS,
    STATES,
    bias_figure,
    buffer_figure,
    buffer_table,
    conversation_figure,
    conversation_html,
    conversation_table,
    draw_bias,
    draw_buffer,
    draw_lag_history,
    draw_lags,
    draw_reward,
    draw_throughput,
    lag_table,
    metrics_figure,
    png,
    replay_figure,
    skew_table,
    step_events,
    verdict_table,
)
