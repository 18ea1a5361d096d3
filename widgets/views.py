"""ipywidgets views of a controller: step controls, buffer, verdicts, a group's completions, metrics, and the
``Dashboard`` of them all.

Each view is an ipywidgets box with a ``refresh()`` that redraws it from the controller's read API. Figures are
shown as PNG ``Image`` widgets (not drawn inside an ``Output``), so they render the same in JupyterLab, in an
executed notebook and under nbval. Every view has a stable CSS class (``asyncrl-...``) for browser tests.
"""

from __future__ import annotations

import html
import threading
import time
import traceback
from collections.abc import Callable

import ipywidgets as W

from asyncrl.metrics import LAG_MEAN, REWARD_MEAN
from asyncrl.trace import STEP
from asyncrl import plots
from asyncrl.plots.conversation import conversation_groups, conversation_html, group_completions  # noqa: F401


TABLE_CSS = (
    "<style>.asyncrl-table{border-collapse:collapse;font-size:12px}"
    ".asyncrl-table th,.asyncrl-table td{padding:1px 6px;text-align:left!important;vertical-align:top;"
    "line-height:1.35;white-space:nowrap}"
    ".asyncrl-table td:last-child{white-space:normal;min-width:18em}"
    ".asyncrl-table tr:nth-child(even){background:rgba(127,127,127,.08)}</style>"
)


class StepControls(W.VBox):
    """Buttons "Rollout tick", "Train tick" and "Tick" step by hand; "Start" runs N optimizer steps in the background
    (``ctrl.start``), "Pause"/"Resume" parks and resumes its pumps (tick by hand while paused), "Stop" ends it. The
    last action's report and a progress line (step, reward, lag) sit under the buttons. ``on_action(callback)``
    registers a callable run after every action and, while a run goes, at most every ``refresh_s`` seconds (the
    dashboard redraws its views), from a thread of its own so the kernel stays responsive. Built while a run started
    in code (``ctrl.start``) goes, the controls follow that run."""

    def __init__(self, ctrl, steps: int = 10, refresh_s: float = 0.75):
        self.ctrl = ctrl
        self.refresh_s = refresh_s
        self.handle = None  # the run these controls started or follow
        self._callbacks: list[Callable[[], None]] = []
        self._watcher: threading.Thread | None = None
        self._redraw = threading.Lock()
        self.buttons = {
            "rollout": self._button("Rollout tick", "asyncrl-rollout-tick", "one rollout tick: admit, dispatch, commit"),
            "train": self._button("Train tick", "asyncrl-train-tick", "one train tick: evict, select, train"),
            "tick": self._button("Tick", "asyncrl-tick", "a rollout tick, then a train tick"),
            "start": self._button("Start", "asyncrl-start", "run N optimizer steps in the background"),
            "pause": self._button("Pause", "asyncrl-pause", "park both pumps at a safe point (tick by hand meanwhile)"),
            "stop": self._button("Stop", "asyncrl-stop", "end the run at a safe point"),
        }
        self.steps = W.BoundedIntText(value=steps, min=1, max=1_000_000, description="N",
                                      style={"description_width": "initial"}, layout=W.Layout(width="150px"))
        self.steps.add_class("asyncrl-run-steps")
        self.report = W.HTML()
        self.report.add_class("asyncrl-report")
        self.progress = W.HTML()
        self.progress.add_class("asyncrl-progress")
        actions = {"rollout": ctrl.rollout_tick, "train": ctrl.train_tick, "tick": ctrl.tick}
        for key, action in actions.items():
            self.buttons[key].on_click(lambda _button, action=action: self._act(action))
        self.buttons["start"].on_click(lambda _button: self._act(self._start))
        self.buttons["pause"].on_click(lambda _button: self._act(self._pause_or_resume))
        self.buttons["stop"].on_click(lambda _button: self._act(self._stop))
        row = W.HBox([*self.buttons.values(), self.steps])
        super().__init__([row, self.report, self.progress])
        self.add_class("asyncrl-controls")
        self._show(self._last_report())
        if ctrl.last_run is not None and ctrl.last_run.running:  # built beside a run started in code: follow it
            self._follow(ctrl.last_run)
        self._sync()

    @staticmethod
    def _button(label: str, css: str, tooltip: str) -> W.Button:
        button = W.Button(description=label, tooltip=tooltip, layout=W.Layout(width="auto"))
        button.add_class(css)
        return button

    def on_action(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    # -------------------------------------------------------------------------------------- background run
    def _start(self) -> str:
        T = self.ctrl.trainer_version
        self._follow(self.ctrl.start(self.steps.value, progress=False))
        return f"started: {self.steps.value} steps from T={T}"

    def _follow(self, handle) -> None:
        self.handle = handle
        self._watcher = threading.Thread(target=self._watch, args=(handle,), daemon=True, name="asyncrl-dashboard")
        self._watcher.start()

    def _pause_or_resume(self) -> str:
        if self.handle.paused:
            self.handle.resume()
            return f"resumed at T={self.ctrl.trainer_version}"
        self.handle.pause()
        return f"paused at T={self.ctrl.trainer_version}: tick by hand, or Resume"

    def _stop(self) -> str:
        self.handle.stop()
        return f"stopped at T={self.ctrl.trainer_version}"

    def _watch(self, handle) -> None:
        """While the run goes: redraw when something moved, at most every ``refresh_s`` and never more than a
        quarter of the time (drawing holds the GIL the pumps need); once the run ended, a last redraw."""
        seen, pause, moved = None, self.refresh_s, threading.Event()
        subscription = self.ctrl.subscribe(lambda _step: moved.set(), events=STEP)  # a step finished
        try:
            while handle.running:
                time.sleep(pause)
                if (moved.is_set() or handle.status != seen) and not handle.paused:  # a paused run is redrawn
                    moved.clear()  # by the action that paused it
                    seen, started = handle.status, time.perf_counter()
                    self._notify()
                    pause = max(self.refresh_s, 3 * (time.perf_counter() - started))
            if handle.error is not None:
                error = handle.error
                self._show(f"run failed: {type(error).__name__}: {error}",
                           error="".join(traceback.format_exception(error)))
            elif handle.breakpoint is not None:
                self._show(f"stopped at breakpoint: trace row {handle.breakpoint.seq} ({handle.breakpoint.event})")
            self._notify()
        except Exception as exc:  # a thread's error is printed nowhere a person looks: show it
            self._show(f"live refresh failed: {type(exc).__name__}: {exc}", error=traceback.format_exc())
        finally:
            subscription.cancel()

    def _running(self) -> bool:
        return self.handle is not None and self.handle.running

    def _sync(self) -> None:
        """Buttons and the progress line from the run's state: no hand ticks while its pumps go."""
        running = self._running()
        paused = running and self.handle.paused
        for key in ("rollout", "train", "tick"):
            self.buttons[key].disabled = running and not paused
        self.buttons["start"].disabled = running
        self.buttons["pause"].disabled = self.buttons["stop"].disabled = not running
        self.buttons["pause"].description = "Resume" if paused else "Pause"
        self.progress.value = f"<code>{html.escape(self._progress_line())}</code>"

    def _progress_line(self) -> str:
        T = self.ctrl.trainer_version
        if self.handle is None:
            return f"T={T} | no run yet: Start runs N steps in the background"
        metrics = self.ctrl.metrics
        parts = [self.handle.status, f"step {T} of {self.handle.target}"]
        if len(metrics):
            last = metrics.iloc[-1]
            parts += [f"reward {last[REWARD_MEAN.name]:.3f}", f"lag {last[LAG_MEAN.name]:.2f}"]
        return " | ".join(parts)

    # ------------------------------------------------------------------------------------------------ actions
    def _act(self, action: Callable) -> None:
        for button in self.buttons.values():
            button.disabled = True
        try:
            self._show(str(action()))
        except Exception as exc:  # shown where the user looks, not lost in a log console
            self._show(f"{type(exc).__name__}: {exc}", error=traceback.format_exc())
        finally:
            self._notify()

    def _notify(self) -> None:
        with self._redraw:  # the watcher and a button's action never redraw at once
            self._sync()
            for callback in self._callbacks:
                callback()

    def _last_report(self) -> str:
        report = self.ctrl.state().last_report
        return str(report) if report is not None else f"T={self.ctrl.trainer_version}: no tick yet"

    def _show(self, text: str, error: str | None = None) -> None:
        colour = "#C44E52" if error else "inherit"
        title = f' title="{html.escape(error)}"' if error else ""
        self.report.value = f'<code style="color:{colour}"{title}>{html.escape(text)}</code>'

    def refresh(self) -> None:
        """The buttons and the progress line follow the run; the report changes only with an action."""
        self._sync()


class BufferView(W.VBox):
    """Slot counts by weight version, stacked ready / ready but evicted by the next train tick / pending /
    selected / evicted (in the step ``plots.step_events`` shows), with ``T`` and the sampler's window marked."""

    def __init__(self, ctrl):
        self.ctrl = ctrl
        self.image = W.Image(format="png")
        self.image.add_class("asyncrl-buffer-image")
        super().__init__([self.image])
        self.add_class("asyncrl-buffer")
        self.refresh()

    def refresh(self, verdicts=None) -> None:
        self.image.value = plots.png(plots.buffer_figure(self.ctrl, verdicts=verdicts), dpi=88)


class VerdictTable(W.VBox):
    """The sampler's verdict for every buffered group (``explain()``), filterable by action."""

    def __init__(self, ctrl, max_height: str = "300px"):
        self.ctrl = ctrl
        self.filter = W.Dropdown(description="action", layout=W.Layout(width="220px"))
        self.filter.add_class("asyncrl-verdict-filter")
        self.table = W.HTML(layout=W.Layout(max_height=max_height, overflow="auto"))
        self.table.add_class("asyncrl-verdict-table")
        self._updating = False
        self.filter.observe(lambda _change: self._updating or self._draw(), names="value")
        super().__init__([self.filter, self.table], layout=W.Layout(flex="1 1 auto", min_width="0"))
        self.add_class("asyncrl-verdicts")
        self.refresh()

    def refresh(self) -> None:
        self._verdicts = plots.verdict_table(self.ctrl)  # once per refresh; the filter only slices it
        counts = self._verdicts.action.value_counts()
        options = [(f"all ({int(counts.sum())})", "all")]
        options += [(f"{a} ({int(counts.get(a, 0))})", a) for a in ("select", "evict", "keep")]
        current = self.filter.value or "all"
        self._updating = True  # new counts in the labels; keep the chosen action
        try:
            self.filter.options = options
            self.filter.value = current
        finally:
            self._updating = False
        self._draw()

    def _draw(self) -> None:
        action = None if self.filter.value in (None, "all") else self.filter.value
        frame = self._verdicts if action is None else self._verdicts[self._verdicts.action == action]
        T = self.ctrl.trainer_version
        if frame.empty:
            self.table.value = f"<p>T={T}: no buffered groups{'' if action is None else f' with action {action}'}</p>"
            return
        rows = frame.drop(columns=["state"]).to_html(index=False, na_rep="", border=0, classes="asyncrl-table")
        self.table.value = f"{TABLE_CSS}<p><b>verdicts at T={T}</b>: what evict / select would do now</p>{rows}"


class CompletionsView(W.VBox):
    """The completions of one buffered group, with their rewards: pick a group that has them (the verdicts'
    ``completions`` column), read what the model wrote next to the sampler's verdict."""

    def __init__(self, ctrl):
        self.ctrl = ctrl
        self.group = W.Dropdown(description="group", layout=W.Layout(width="220px"))
        self.group.add_class("asyncrl-completions-group")
        self.table = W.HTML(layout=W.Layout(max_height="260px", overflow="auto"))
        self.table.add_class("asyncrl-completions-table")
        self._updating = False
        self.group.observe(lambda _change: self._updating or self._draw(), names="value")
        super().__init__([self.group, self.table])
        self.add_class("asyncrl-completions")
        self.refresh()

    def refresh(self, verdicts=None) -> None:
        verdicts = plots.verdict_table(self.ctrl) if verdicts is None else verdicts
        counts = verdicts.completions if "completions" in verdicts else []
        ids = [int(g) for g, n in zip(verdicts.group_id, counts) if n]
        _choose_among(self, ids, ids)
        self._draw()

    def _draw(self) -> None:
        gid = self.group.value
        frame = None if gid is None else group_completions(self.ctrl, gid)
        if frame is None or frame.empty:
            self.table.value = "<p>no buffered group with completions logged (log_completions) to show</p>"
            return
        rewards = [c for c in frame if c == "reward" or c.startswith("reward/")]
        shown = frame[["completion_index", "completion", *rewards, "tokens", "finish_reason"]]
        rows = shown.to_html(index=False, na_rep="", border=0, classes="asyncrl-table")  # to_html escapes the text
        prompt = html.escape(str(frame.prompt.iloc[0]))
        self.table.value = (f"{TABLE_CSS}<p><b>group {gid}</b> ({html.escape(str(frame.prompt_id.iloc[0]))}): "
                            f"<code>{prompt}</code></p>{rows}")


def _choose_among(view, options: list, ids: list[int]) -> None:
    """New ``options`` for ``view.group``: its choice kept while it is still there, else the newest group; no redraw
    on the way (``view._updating``)."""
    current = view.group.value
    view._updating = True
    try:
        view.group.options = options
        view.group.value = current if current in ids else (ids[-1] if ids else None)
    finally:
        view._updating = False


class ConversationView(W.VBox):
    """A multi-turn group's conversations turn by turn (``plots.conversation_html``): pick a group in flight,
    buffered or trained (in the completions log); each trajectory's prompt, then its model turns tinted by the
    weight version that generated them (a legend names them) and the environment's replies in grey, untrained.
    A logged row is cut into turns by its ``turn_texts``; ``replies``, a regular expression of the environment's
    replies, cuts those of a recording made before rows carried them (``plots.GUESS_LETTER_REPLIES`` for
    guess_letter; see ``asyncrl/plots/conversation.py``)."""

    def __init__(self, ctrl, replies: str | None = None):
        self.ctrl, self.replies = ctrl, replies
        self.group = W.Dropdown(description="group", layout=W.Layout(width="320px"))
        self.group.add_class("asyncrl-conversation-group")
        self.table = W.HTML(layout=W.Layout(max_height="360px", overflow="auto"))
        self.table.add_class("asyncrl-conversation-table")
        self._updating = False
        self.group.observe(lambda _change: self._updating or self._draw(), names="value")
        super().__init__([self.group, self.table])
        self.add_class("asyncrl-conversations")
        self.refresh()

    def refresh(self) -> None:
        groups = conversation_groups(self.ctrl)
        options = [(f"{int(g)}: {state}, weights {', '.join(map(str, versions))}", int(g))
                   for g, state, versions in zip(groups.group_id, groups.state, groups.turn_versions)]
        _choose_among(self, options, [gid for _, gid in options])
        self._draw()

    def _draw(self) -> None:
        gid = self.group.value
        if gid is None:
            self.table.value = "<p>no multi-turn group in flight, buffered or logged yet (an environment: run)</p>"
            return
        self.table.value = TABLE_CSS + conversation_html(self.ctrl, gid, self.replies)


class MetricsView(W.VBox):
    """Reward over steps, lag distribution by step, throughput; under them token staleness by step and the
    training-inference gap (``plots.staleness_figure``)."""

    def __init__(self, ctrl):
        self.ctrl = ctrl
        self.image = W.Image(format="png")
        self.image.add_class("asyncrl-metrics-image")
        self.staleness = W.Image(format="png")
        self.staleness.add_class("asyncrl-staleness-image")
        super().__init__([self.image, self.staleness])
        self.add_class("asyncrl-metrics")
        self.refresh()

    def refresh(self) -> None:
        self.image.value = plots.png(plots.metrics_figure(self.ctrl))
        self.staleness.value = plots.png(plots.staleness_figure(self.ctrl))


class Dashboard(W.VBox):
    """Step controls above the buffer view and the verdict table, with the metric plots below; every action, and a
    background run while it goes (throttled), refreshes every view. A multi-turn run (an environment) shows a
    group's conversations (``ConversationView``) in a tab beside its completions; ``replies``: see there."""

    def __init__(self, ctrl, steps: int = 10, replies: str | None = None):
        self.ctrl = ctrl
        self.controls = StepControls(ctrl, steps=steps)
        self.buffer = BufferView(ctrl)
        self.verdicts = VerdictTable(ctrl)
        self.completions = CompletionsView(ctrl)
        self.conversations = None
        what = self.completions
        if callable(getattr(ctrl, "trajectories", None)) and _multi_turn(ctrl):
            self.conversations = ConversationView(ctrl, replies)
            what = W.Tab([self.conversations, self.completions])
            what.set_title(0, "conversations")
            what.set_title(1, "completions")
            what.add_class("asyncrl-dashboard-tabs")
        self.metrics = MetricsView(ctrl)
        self.controls.on_action(self.refresh)
        super().__init__([self.controls, W.HBox([self.buffer, self.verdicts]), what, self.metrics])
        self.add_class("asyncrl-dashboard")

    def refresh(self) -> None:
        views = [self.controls, self.verdicts, self.metrics]
        for view in views + ([self.conversations] if self.conversations is not None else []):
            view.refresh()
        self.buffer.refresh(verdicts=self.verdicts._verdicts)  # the table's explain(): one per refresh
        self.completions.refresh(verdicts=self.verdicts._verdicts)


def _multi_turn(ctrl) -> bool:
    """The run has an environment (its config's ``environment.factory``; a source without a config: it has
    trajectories to show)."""
    cfg = getattr(ctrl, "cfg", None)
    environment = getattr(cfg, "environment", None)
    if environment is not None:
        return bool(environment.factory)
    return not ctrl.trajectories().empty


class Replay(W.VBox):
    """Scrub a recording (``asyncrl.Recording``): a slider over its finished steps and one over the trace rows of
    the chosen step (the last row is the step itself, ``rec.at(step)``); each move redraws the buffer by weight
    version and the lag to that point (``plots.replay_figure``) and the sampler's verdicts there
    (``view.explain()``). ``view`` is the ``RecordedView`` shown."""

    def __init__(self, rec, step: int | None = None, event: int | None = None):
        self.rec = rec
        steps = rec.steps
        if not steps:
            raise ValueError(f"{rec!r} has no finished step to replay yet")
        step = steps[-1] if step is None else step
        self.step = W.IntSlider(value=step, min=steps[0], max=steps[-1], description="step",
                                continuous_update=False, layout=W.Layout(width="520px"))
        self.step.add_class("asyncrl-replay-step")
        self.event = W.IntSlider(description="event", continuous_update=False, layout=W.Layout(width="520px"))
        self.event.add_class("asyncrl-replay-event")
        self.caption = W.HTML()
        self.image = W.Image(format="png")
        self.image.add_class("asyncrl-replay-image")
        self.table = W.HTML(layout=W.Layout(max_height="260px", overflow="auto"))
        self.table.add_class("asyncrl-replay-verdicts")
        self._moving = False
        super().__init__([W.HBox([self.step, self.event]), self.caption, self.image, self.table])
        self.add_class("asyncrl-replay")
        self.step.observe(lambda change: self._set_events(change["new"], None), names="value")
        self.event.observe(lambda _change: self._moving or self.refresh(), names="value")
        self._set_events(step, event)

    def _set_events(self, step: int, event: int | None) -> None:
        """The event slider spans the step's rows; a new step starts at its end (the step itself)."""
        n = self.rec.events(step)
        self._moving = True
        try:
            self.event.max = n - 1
            self.event.value = n - 1 if event is None else event
        finally:
            self._moving = False
        self.refresh()

    def refresh(self) -> None:
        self.view = self.rec.at(self.step.value, event=self.event.value)
        verdicts = self.view.explain()
        self.caption.value = f"<code>{html.escape(repr(self.view))}</code>"
        self.image.value = plots.png(plots.replay_figure(self.view, verdicts=verdicts
                                                           if "note" not in verdicts.attrs else None), dpi=80)
        if verdicts.empty:
            self.table.value = f"<p>T={self.view.trainer_version}: no buffered groups</p>"
            return
        note = f"<p>{html.escape(verdicts.attrs['note'])}</p>" if "note" in verdicts.attrs else ""
        rows = verdicts.drop(columns=["state"]).to_html(index=False, na_rep="", border=0, classes="asyncrl-table")
        self.table.value = (f"{TABLE_CSS}<p><b>verdicts at T={self.view.trainer_version}</b> (re-judged by the run's "
                            f"sampler)</p>{note}{rows}")
