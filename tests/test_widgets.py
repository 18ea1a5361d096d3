"""The notebook layer without a browser: plain renderings (DataFrames, Figures) and a headless widget smoke test
(build the Dashboard, click its buttons with ``.click()``, check every view updates).

Controllers here use the simulated backends: the views only read the controller, so a model is not needed."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
pytest.importorskip("matplotlib")

import widgets  # noqa: E402
from asyncrl import Controller, load_config  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIMULATED = {"generation": {"backend": "simulated"}, "trainer": {"backend": "simulated"}, "eval_every": None}


def make(sampler=None, **overrides) -> Controller:
    cfg = {**SIMULATED, **overrides}
    if sampler is not None:
        cfg["sampler"] = sampler
    return Controller.from_config(load_config("quickstart", **cfg))


def wait_for(predicate, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def play(ctrl, pattern: str) -> None:
    for tick in pattern:
        ctrl.rollout_tick() if tick == "r" else ctrl.train_tick()


# ------------------------------------------------------------------------------------------- plain renderings
def test_buffer_table_counts_ready_then_selected_this_step():
    ctrl = make()  # in_order, lookahead 1: two batches fit
    play(ctrl, "rr")
    table = widgets.buffer_table(ctrl)
    assert list(table.columns) == ["ready", "doomed", "pending", "selected", "evicted"]
    assert table.loc[0].to_dict() == {"ready": 16, "doomed": 0, "pending": 0, "selected": 0, "evicted": 0}
    play(ctrl, "t")  # step 0 finished: the table falls back to the step that just finished
    assert ctrl.trainer_version == 1
    assert widgets.buffer_table(ctrl).loc[0].to_dict() == {"ready": 8, "doomed": 0, "pending": 0, "selected": 8,
                                                           "evicted": 0}
    play(ctrl, "rt")  # step 1 trains batch 1 (version 0); batch 2 was generated with weights 1
    table = widgets.buffer_table(ctrl)
    assert table.loc[0, "selected"] == 8 and table.loc[0, "ready"] == 0
    assert table.loc[1].to_dict() == {"ready": 8, "doomed": 0, "pending": 0, "selected": 0, "evicted": 0}


def test_buffer_table_shows_evictions_of_this_step():
    ctrl = make({"name": "windowed", "max_staleness_versions": 1})
    play(ctrl, "rrrtt")  # a third batch at version 0 is too stale once T = 2
    play(ctrl, "t")
    events = widgets.step_events(ctrl)
    assert set(events.event) == {"evict"} and len(events) == 8
    table = widgets.buffer_table(ctrl)
    assert table.loc[0, "evicted"] == 8 and table["ready"].sum() == 0


def test_verdict_table_filters_by_action():
    ctrl = make()
    play(ctrl, "rr")
    all_verdicts = widgets.verdict_table(ctrl)
    assert len(all_verdicts) == 16
    assert list(all_verdicts.columns) == ["group_id", "weight_version", "target_step", "state", "action", "code", "reason",
                                         "completions"]
    selected = widgets.verdict_table(ctrl, "select")
    assert len(selected) == 8 and set(selected.action) == {"select"}
    assert list(selected.index) == list(range(8))
    assert widgets.verdict_table(ctrl, "evict").empty


def test_lag_table_by_step():
    ctrl = make()
    play(ctrl, "rrtrt")
    table = widgets.lag_table(ctrl)
    assert table.to_dict() == {0: {0: 8, 1: 0}, 1: {0: 0, 1: 8}}
    assert widgets.lag_table(make()).empty


def test_figures_before_and_after_steps():
    ctrl = make()
    for fig in (widgets.buffer_figure(ctrl), widgets.metrics_figure(ctrl)):  # nothing happened yet: no crash
        assert isinstance(fig, Figure)
    play(ctrl, "rrtrtrt")
    buffer_fig = widgets.buffer_figure(ctrl)
    (ax,) = buffer_fig.axes
    assert "T=3" in ax.get_title()
    assert any(text.get_text() == "T = 3" for text in ax.get_legend().get_texts())
    assert any(text.get_text().startswith("window [") for text in ax.get_legend().get_texts())
    metrics_fig = widgets.metrics_figure(ctrl)
    reward, lags, throughput, _colourbar = metrics_fig.axes
    assert [a.get_title(loc) for a, loc in ((reward, "center"), (lags, "left"), (throughput, "center"))] == [
        "reward and held-out accuracy", "lag of trained groups, by step", "throughput"]
    assert len(reward.lines) >= 2  # batch reward and its running mean


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_metrics_figure_labels_colourbar_legends_and_the_untrained_evaluation():
    ctrl = make(eval_every=2)
    play(ctrl, "rtrtrtrt")
    evals = ctrl.evaluations
    assert evals.weight_version.tolist() == [0, 2, 4]  # the untrained model first, before step 0 trained
    fig = widgets.metrics_figure(ctrl)
    reward, lags, throughput, colourbar = fig.axes
    assert reward.get_ylabel() == "reward / accuracy" and reward.get_xlabel() == "optimizer step"
    assert lags.get_ylabel() and throughput.get_ylabel() == "tokens / s"
    assert colourbar.get_ylabel() == "groups trained" and lags.collections[0].colorbar is not None
    (accuracy,) = [line for line in reward.lines if line.get_label() == "held-out greedy accuracy"]
    assert list(accuracy.get_xdata()) == [0, 2, 4] and not accuracy.get_clip_on()  # a point on the axis shows whole
    assert list(accuracy.get_ydata()) == evals.accuracy.tolist()
    FigureCanvasAgg(fig).draw()  # legends are placed at draw time: none may cover a plotting area
    renderer = fig.canvas.get_renderer()
    for ax in (reward, lags):
        legend = ax.get_legend().get_window_extent(renderer)
        for other in (reward, lags, colourbar, throughput):
            assert not _overlaps(legend, other.get_window_extent(renderer)), (ax.get_title(), other.get_title())


def test_the_lag_panels_legend_leaves_its_title_readable_in_a_narrow_panel():
    """Five lag panels side by side (notebooks/sampler_debugging.ipynb): the "mean lag" legend beside the title
    covered it."""
    ctrl = make()
    play(ctrl, "rtrtrt")
    fig = Figure(figsize=(18, 3.2), layout="constrained")
    axes = fig.subplots(1, 5)
    for ax in axes:
        widgets.draw_lags(ctrl, ax)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        legend = ax.get_legend().get_window_extent(renderer)
        assert not _overlaps(legend, ax._left_title.get_window_extent(renderer))  # the title is left-aligned
        assert not _overlaps(legend, ax.get_window_extent(renderer))


def test_buffer_view_marks_what_the_next_train_tick_evicts_and_names_the_step_shown():
    ctrl = make({"name": "windowed", "max_staleness_versions": 1})
    play(ctrl, "rrrtt")  # T = 2: the third batch (version 0) is out of the window; evict runs on the next tick
    doomed = ctrl.explain().query("action == 'evict'")
    assert len(doomed) == 8
    table = widgets.buffer_table(ctrl)
    assert table.loc[0, "doomed"] == 8 and table.loc[0, "ready"] == 0
    (ax,) = widgets.buffer_figure(ctrl).axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "ready, evicted by the next train tick" in labels
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_height() == 8  # only the doomed bar is hatched
    # step 1 just finished (T = 2): its selection is labelled as step 1's, not as "this step"
    assert "selected for step 1" in labels and not any("this step" in label for label in labels)
    play(ctrl, "t")  # the eviction happens; the doomed bar becomes "evicted in step 2"
    labels = [t.get_text() for t in widgets.buffer_figure(ctrl).axes[0].get_legend().get_texts()]
    assert "evicted / aborted in step 2" in labels and "ready, evicted by the next train tick" not in labels


def test_custom_sampler_without_window_renders():
    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        ctrl = make({"name": "custom", "target": "my_sampler:NewestFirst", "max_lag": 1})
        play(ctrl, "rrtrtt")
        assert isinstance(widgets.buffer_figure(ctrl), Figure)
        verdicts = widgets.verdict_table(ctrl)
        assert set(verdicts.action) <= {"select", "evict", "keep"}
    finally:
        sys.path.remove(str(ROOT / "notebooks"))


# ----------------------------------------------------------------------------------------------- boundaries
def test_asyncrl_does_not_import_widgets_and_widgets_imports_ipywidgets_lazily():
    code = (
        "import sys, asyncrl, asyncrl.controller, asyncrl.samplers, asyncrl.plots, asyncrl.cli, asyncrl.recording\n"
        "assert 'widgets' not in sys.modules and 'ipywidgets' not in sys.modules, 'asyncrl imported jupyter'\n"
        "import widgets\n"
        "assert 'ipywidgets' not in sys.modules, 'plain renderings imported ipywidgets'\n"
        "widgets.Dashboard\n"
        "assert 'ipywidgets' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "MPLBACKEND": "Agg"})


def test_the_plain_renderings_live_in_the_package_and_widgets_re_exports_them():
    """``asyncrl.plots`` draws without Jupyter packages (the CLI uses it); ``widgets.buffer_figure`` & co. are the
    same functions, so notebooks and scripts that use the widgets' names do not change."""
    import asyncrl.plots
    from widgets import render

    names = ["buffer_figure", "buffer_table", "verdict_table", "metrics_figure", "lag_table", "bias_figure",
             "skew_table", "replay_figure", "draw_buffer", "draw_lags", "draw_reward", "draw_throughput", "draw_bias",
             "step_events"]
    assert set(names) <= set(widgets.__all__)
    for name in names:
        assert getattr(widgets, name) is getattr(asyncrl.plots, name) is getattr(render, name), name


def test_widgets_use_only_the_controller_public_api():
    """No ``ctrl._private`` access, and the buffer only through ``state()`` (its ``summary()``): the views and the
    plots they draw (``asyncrl/plots``)."""
    for path in [*(ROOT / "widgets").glob("*.py"), *(ROOT / "asyncrl" / "plots").glob("*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = ast.unparse(node.value)
                assert "ctrl" not in base, f"{path.name}: {ast.unparse(node)} reaches into the controller"
            if isinstance(node, ast.Attribute) and node.attr == "buffer":
                base = ast.unparse(node.value)
                assert "ctrl" not in base or base == "ctrl.state()", f"{path.name}: {ast.unparse(node)}"


def test_the_controller_writes_the_metric_vocabulary():
    from asyncrl import metrics as M

    ctrl = make(eval_every=2)
    play(ctrl, "rtrt")
    columns = list(ctrl.metrics.columns)
    assert columns[:2] == [M.STEP.name, M.TRAINER_VERSION.name]
    assert columns[2:2 + len(M.STEP_METRICS)] == [m.name for m in M.STEP_METRICS]
    assert {c.name for c in (*M.STEP_FACTS, M.EVAL_REWARD, M.EVAL_ACCURACY)} <= set(columns)
    declared = [c.name for c in M.EVALUATION_COLUMNS]  # then mean@n and pass@n for each n evaluated
    assert list(ctrl.evaluations.columns) == declared + ["mean@1", "pass@1"]


def test_a_renamed_metric_fails_the_plots_loudly(monkeypatch):
    """The plots read column names from asyncrl.metrics: a name the controller's frame lacks is a KeyError naming
    it, not a blank panel."""
    import dataclasses
    import importlib

    from asyncrl import metrics as M
    from widgets import render

    ctrl = make()
    play(ctrl, "rtrt")
    try:
        for name in ("REWARD_MEAN", "TOKENS_PER_S"):
            monkeypatch.setattr(M, name, dataclasses.replace(getattr(M, name), name="renamed"))
        importlib.reload(render)
        with pytest.raises(KeyError, match="renamed"):
            render.metrics_figure(ctrl)
    finally:
        monkeypatch.undo()
        importlib.reload(render)
    assert isinstance(render.metrics_figure(ctrl), Figure)


# --------------------------------------------------------------------------------------- headless widgets
def test_dashboard_buttons_update_every_view():
    pytest.importorskip("ipywidgets")
    ctrl = make()
    dash = widgets.Dashboard(ctrl, steps=2)
    assert {"asyncrl-dashboard"} <= set(dash._dom_classes)
    buffer, table, metrics = dash.buffer.image.value, dash.verdicts.table.value, dash.metrics.image.value
    assert "no tick yet" in dash.controls.report.value

    dash.controls.buttons["rollout"].click()
    assert "rollout T=0" in dash.controls.report.value and "dispatched 8" in dash.controls.report.value
    assert dash.buffer.image.value != buffer and dash.verdicts.table.value != table
    dash.controls.buttons["rollout"].click()

    buffer, table = dash.buffer.image.value, dash.verdicts.table.value
    dash.controls.buttons["train"].click()
    assert ctrl.trainer_version == 1
    assert "train T=1" in dash.controls.report.value and "step finished" in dash.controls.report.value
    assert dash.buffer.image.value != buffer and dash.verdicts.table.value != table
    assert dash.metrics.image.value != metrics

    dash.controls.buttons["tick"].click()
    assert ctrl.trainer_version == 2 and "tick T=2" in dash.controls.report.value

    metrics = dash.metrics.image.value
    dash.controls.buttons["start"].click()  # N = 2, in the background
    assert "started: 2 steps from T=2" in dash.controls.report.value
    dash.controls.handle.wait()
    wait_for(lambda: "completed | step 4 of 4" in dash.controls.progress.value, "the watcher's last redraw")
    assert ctrl.trainer_version == 4 and dash.metrics.image.value != metrics
    assert not any(dash.controls.buttons[k].disabled for k in ("rollout", "train", "tick", "start"))
    assert dash.controls.buttons["pause"].disabled and dash.controls.buttons["stop"].disabled


def test_dashboard_start_pause_stop_a_background_run():
    pytest.importorskip("ipywidgets")
    ctrl = make(generation={"backend": "simulated", "clock": "wall", "prefill_s": 0.01})
    dash = widgets.Dashboard(ctrl, steps=100_000)
    controls, buttons = dash.controls, dash.controls.buttons
    controls.refresh_s = 0.05
    assert "no run yet" in controls.progress.value
    buttons["start"].click()
    assert buttons["start"].disabled and buttons["train"].disabled and not buttons["pause"].disabled
    follower = widgets.StepControls(ctrl)  # built beside a going run: follows it
    assert follower.handle is controls.handle and follower.buttons["tick"].disabled
    wait_for(lambda: ctrl.trainer_version >= 2 and "running | step" in controls.progress.value, "two steps")
    image = dash.buffer.image.value
    wait_for(lambda: dash.buffer.image.value != image, "a live redraw of the buffer view")

    buttons["pause"].click()
    assert controls.handle.paused and buttons["pause"].description == "Resume" and not buttons["train"].disabled
    assert "paused | step" in controls.progress.value
    T = ctrl.trainer_version
    buttons["tick"].click()  # by hand while paused
    assert "tick T=" in controls.report.value and ctrl.trainer_version in (T, T + 1)

    buttons["pause"].click()  # Resume
    assert not controls.handle.paused and buttons["pause"].description == "Pause" and buttons["train"].disabled
    wait_for(lambda: ctrl.trainer_version >= T + 2, "the resumed run")
    buttons["stop"].click()
    assert not controls.handle.running and controls.handle.status == "stopped"
    assert "stopped at T=" in controls.report.value and not buttons["start"].disabled
    wait_for(lambda: "stopped | step" in controls.progress.value, "the stopped run's last redraw")


def test_dashboard_shows_a_failed_run():
    pytest.importorskip("ipywidgets")
    # the default retries with a 1 ms backoff instead of ~7 s of it: what is shown once they are spent is the point
    ctrl = make(faults={"backoff_s": 0.001, "max_backoff_s": 0.001})
    controls = widgets.StepControls(ctrl, steps=50, refresh_s=0.05)

    def broken(*args, **kwargs):
        raise RuntimeError("generator went away")

    ctrl.generator.poll = broken
    controls.buttons["start"].click()
    # the watcher can redraw the progress line ("failed |") one pass before it writes the report line
    wait_for(lambda: "failed |" in controls.progress.value and "run failed:" in controls.report.value,
             "the failed run's last redraw")
    # retried, then given up on (asyncrl/faults.py): GenerationFailed names the backend's error
    assert "run failed: GenerationFailed" in controls.report.value and "generator went away" in controls.report.value
    assert "failed" in controls.progress.value and not controls.buttons["start"].disabled


def test_a_dashboard_refresh_computes_the_verdicts_once(monkeypatch):
    pytest.importorskip("ipywidgets")
    ctrl = make()
    play(ctrl, "rr")
    dash = widgets.Dashboard(ctrl)
    calls = []
    original = ctrl.explain
    monkeypatch.setattr(ctrl, "explain", lambda: calls.append(1) or original())
    dash.refresh()
    assert len(calls) == 1  # the verdict table's; the buffer view (evictions to come) reuses it
    dash.verdicts.filter.value = "keep"  # filtering slices the verdicts it has
    assert len(calls) == 1 and dash.verdicts.table.value.count("wrong_target_step") == 8


def test_verdict_filter_and_counts():
    pytest.importorskip("ipywidgets")
    ctrl = make()
    play(ctrl, "rr")
    view = widgets.VerdictTable(ctrl)
    assert [label for label, _ in view.filter.options] == ["all (16)", "select (8)", "evict (0)", "keep (8)"]
    view.filter.value = "keep"
    assert view.table.value.count("wrong_target_step") == 8 and "selected as" not in view.table.value
    play(ctrl, "t")
    view.refresh()  # the chosen filter survives a refresh; the counts follow the buffer
    assert view.filter.value == "keep"
    assert [label for label, _ in view.filter.options] == ["all (8)", "select (8)", "evict (0)", "keep (0)"]
    assert "no buffered groups with action keep" in view.table.value


def test_a_failing_action_is_reported_not_raised():
    pytest.importorskip("ipywidgets")
    ctrl = make()

    def broken():
        raise RuntimeError("backend went away")

    ctrl.train_tick = broken  # the buttons bind the controller's methods when the controls are built
    controls = widgets.StepControls(ctrl)
    refreshed = []
    controls.on_action(lambda: refreshed.append(True))
    controls.buttons["train"].click()
    assert "RuntimeError: backend went away" in controls.report.value
    assert refreshed == [True] and not controls.buttons["train"].disabled


# ------------------------------------------------------------------------------- multi-turn conversations
def _guess_letter(**overrides) -> Controller:
    cfg = {"groups_per_step": 2, "group_size": 2, "eval_every": None, **overrides}
    return Controller.from_config(load_config("guess_letter", **cfg))


def test_the_conversation_view_lists_each_turn_with_the_version_that_generated_it():
    """A group whose turns span a weight sync: its first turns at weights 0, its last at 1; the environment's
    replies between them are untrained and have no version. In flight it lists versions; committed, the text."""
    ctrl = _guess_letter(sampler={"name": "in_order", "max_lookahead_versions": 2})
    play(ctrl, "rrrtr")  # step 0 trained while group 4 was one turn in; its second turn was already on its way
    live = widgets.conversation_table(ctrl, 4)
    assert live.role.tolist() == ["model"] * 4 and live.version.tolist() == [0, 0] * 2 and live.text.eq("").all()
    assert set(live.state) == {"in flight"}
    play(ctrl, "r")  # its third turn is generated with weights 1
    table = widgets.conversation_table(ctrl, 4, replies=widgets.GUESS_LETTER_REPLIES)
    for i, frame in table.groupby("trajectory"):
        assert frame.role.iloc[0] == "prompt" and frame.text.iloc[0] == "guess:"
        model = frame[frame.role == "model"]
        assert model.turn.tolist() == [1, 2, 3] and model.version.tolist() == [0, 0, 1] and model.trained.all()
        replies = frame[frame.role == "environment"]
        assert len(replies) == 2 and not replies.trained.any() and replies.version.isna().all()
        assert all(t.strip() in {"higher", "lower", "invalid"} for t in replies.text)
        row = ctrl.completions.query(f"group_id == 4 and completion_index == {i}").iloc[0]
        assert "".join(frame.text.iloc[1:]) == row.completion  # the transcript, cut, not rewritten
    assert set(table.state) == {"buffered"}
    from asyncrl.plots import conversation_groups

    groups = conversation_groups(ctrl)
    assert groups.set_index("group_id").loc[4, "turn_versions"] == [0, 1]
    assert groups.set_index("group_id").loc[0, "state"] == "trained"  # trained by step 0: from the log


class _BeforeTurnTexts:
    """A controller read as a recording made before completions rows carried ``turn_texts`` (cut only by a
    ``replies`` pattern)."""

    def __init__(self, ctrl):
        self.ctrl = ctrl

    @property
    def completions(self):
        return self.ctrl.completions.drop(columns=["turn_texts"])

    def trajectories(self):
        return self.ctrl.trajectories()


def test_a_transcript_that_cannot_be_cut_into_its_turns_is_shown_whole_with_its_versions():
    ctrl = _guess_letter()
    play(ctrl, "rrr")
    table = widgets.conversation_table(_BeforeTurnTexts(ctrl), 0)  # no turn_texts, no replies pattern: not cut
    whole = table[table.role == "conversation"]
    assert len(whole) == 2 and whole.version.tolist() == [[0, 0, 0]] * 2
    with pytest.raises(KeyError, match="group 99"):
        widgets.conversation_table(ctrl, 99)


def test_the_conversation_figure_and_html_tint_turns_by_version_with_a_legend():
    ctrl = _guess_letter(sampler={"name": "in_order", "max_lookahead_versions": 2})
    play(ctrl, "rrrtrr")
    fig = widgets.conversation_figure(ctrl, [0, 4], replies=widgets.GUESS_LETTER_REPLIES)
    (ax, *_), legend = fig.axes, fig.axes[0].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["turn generated with weights 0", "turn generated with weights 1",
                      "environment reply (untrained)"]
    from asyncrl.plots.conversation import version_colour

    colours = {p.get_facecolor()[:3] for p in ax.patches}
    from matplotlib.colors import to_rgb

    assert to_rgb(version_colour(0)) in colours and to_rgb(version_colour(1)) in colours
    assert [t.get_text() for t in ax.get_yticklabels()] == ["group 0 · 0", "group 0 · 1", "group 4 · 0",
                                                            "group 4 · 1"]
    page = widgets.conversation_html(ctrl, 4, replies=widgets.GUESS_LETTER_REPLIES)
    assert page.count('class="asyncrl-turn"') == 6 and page.count('data-version="1"') == 2
    assert page.count('class="asyncrl-observation"') == 4 and "environment (untrained)" in page


def test_the_dashboard_has_a_conversations_tab_for_a_multi_turn_run():
    pytest.importorskip("ipywidgets")
    assert widgets.Dashboard(make()).conversations is None  # single-turn: no tab
    ctrl = _guess_letter()
    dash = widgets.Dashboard(ctrl, replies=widgets.GUESS_LETTER_REPLIES)
    assert "no multi-turn group" in dash.conversations.table.value
    dash.controls.buttons["rollout"].click()
    assert dash.conversations.group.value == 1 and "1: in flight, weights 0" in dash.conversations.group.options[-1][0]
    dash.controls.buttons["rollout"].click()
    dash.controls.buttons["rollout"].click()
    view = dash.conversations
    view.group.value = 0
    assert view.table.value.count('class="asyncrl-turn"') == 6 and "guess:" in view.table.value
