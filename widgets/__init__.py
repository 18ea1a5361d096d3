"""Notebook views of an ``asyncrl.Controller``: step it, watch its buffer by weight version, read its sampler's
verdicts, and plot its metrics.

Plain renderings (pandas DataFrames and matplotlib Figures, for static notebooks and scripts; they live in
``asyncrl.plots``, which needs no Jupyter package, and are re-exported here)::

    widgets.buffer_figure(ctrl)    widgets.buffer_table(ctrl)
    widgets.verdict_table(ctrl, action="evict")
    widgets.metrics_figure(ctrl)   widgets.lag_table(ctrl)
    widgets.bias_figure(ctrl)      widgets.skew_table(ctrl)     (what the sampler skews)
    widgets.replay_figure(rec.at(step, event))                  (a recorded view: asyncrl.Recording)
    widgets.conversation_figure(ctrl, group_id)   widgets.conversation_table / conversation_html
                                                  (a multi-turn group turn by turn, tinted by weight version)

Interactive views (ipywidgets): ``StepControls``, ``BufferView``, ``VerdictTable``, ``CompletionsView`` (what
the model wrote for a chosen group), ``ConversationView`` (a multi-turn group's turns by version), ``MetricsView`` and ``Dashboard(ctrl)`` composing them, and ``Replay(rec)`` (sliders over a recording). Only the controller's public
read API and its stepping/run methods are used, so every view takes a recorded view (``Recording.at``) where it
takes a controller, and ``Dashboard`` takes an attached run (``asyncrl.attach``).
"""

from widgets.render import (  # noqa: F401
    GUESS_LETTER_REPLIES,
    bias_figure,
    buffer_figure,
    conversation_figure,
    conversation_html,
    conversation_table,
    buffer_table,
    draw_bias,
    draw_buffer,
    draw_lags,
    draw_reward,
    draw_throughput,
    lag_table,
    metrics_figure,
    replay_figure,
    skew_table,
    step_events,
    verdict_table,
)

_VIEWS = ("StepControls", "BufferView", "VerdictTable", "CompletionsView", "ConversationView", "MetricsView", "Dashboard", "Replay")


def __getattr__(name: str):
    if name in _VIEWS:  # ipywidgets is imported only when a view is asked for
        from widgets import views

        return getattr(views, name)
    raise AttributeError(f"module 'widgets' has no attribute {name!r}")


__all__ = [
    "buffer_figure", "buffer_table", "draw_buffer", "draw_lags", "draw_reward", "draw_throughput", "lag_table",
    "metrics_figure", "step_events", "verdict_table", "bias_figure", "draw_bias", "skew_table", "replay_figure",
    "conversation_figure", "conversation_html", "conversation_table", "GUESS_LETTER_REPLIES", *_VIEWS,
]
