"""A multi-turn group's conversations turn by turn, each model turn tinted by the weight version that generated it
(``conversation_table``, ``conversation_html``, ``conversation_figure``), from the read API only: ``trajectories()``
for groups in flight or buffered, the completions log for what was written (buffered or trained groups).

What each segment holds:
- a ``model`` turn: sampled tokens, trained, generated at ``version``;
- an ``environment`` segment: a text environment's reply or a turn's tool results, context only (loss mask 0:
  ``trained`` False, no version);
- a ``conversation`` segment, when a completion's text cannot be cut into turns (see ``split_turns``): the whole
  transcript after the prompt, its turns' versions listed.

Cutting a transcript into turns: a row that carries ``turn_texts`` (what ``asyncrl/turns.py`` logs: one
``{"role", "text", "version"}`` per model turn (``assistant``) and observation, in order; or plain texts, model
and environment alternating) is cut there; otherwise (a recording made before rows carried them) ``replies`` (a
regular expression matching the environment's replies, e.g. ``guess_letter``'s ``GUESS_LETTER_REPLIES``) cuts it. A group still in flight has versions but no text yet: its
turns are listed with their versions and the text arrives when the group commits.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Patch

# guess_letter's replies (" higher ", " lower ", " correct", " invalid "): pass as ``replies=`` for its transcripts.
GUESS_LETTER_REPLIES = r" (?:higher|lower|correct|invalid) ?"
VERSION_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
                   "#64B5CD"]  # no grey: grey is the environment's
ENVIRONMENT_COLOUR = "#E6E6E6"  # observations and tool results: neutral, untrained
PROMPT_COLOUR = "#FFFFFF"
COLUMNS = ["group_id", "trajectory", "segment", "role", "turn", "version", "trained", "text", "state", "reward"]


def version_colour(version: int) -> str:
    """The tint of a weight version (cycles after eight)."""
    return VERSION_COLOURS[int(version) % len(VERSION_COLOURS)]


def group_completions(source, group_id: int) -> pd.DataFrame | None:
    """What the model wrote for one group: ``source.completions`` is a DataFrame (a controller) or a method of
    the group id (a recording's view); None when the source keeps none (an attached run: read its run directory)."""
    completions = getattr(source, "completions", None)
    if callable(completions):
        return completions(group_id)
    if completions is None:
        return None
    return completions[completions.group_id == group_id].reset_index(drop=True)


def _trajectories(source) -> pd.DataFrame | None:
    read = getattr(source, "trajectories", None)
    return read() if callable(read) else None


def conversation_groups(source) -> pd.DataFrame:
    """The multi-turn groups a conversation view can show: ``group_id``, ``state`` (``in flight``, ``buffered`` or
    ``trained``: in the completions log, no longer held) and ``turn_versions`` (every version its turns were
    generated with), newest group last."""
    rows: dict[int, dict] = {}
    live = _trajectories(source)
    if live is not None:
        for gid, frame in live.groupby("group_id", sort=True):
            state = "buffered" if (frame.state == "buffered").all() else "in flight"
            versions = sorted({int(v) for vs in frame.turn_versions for v in vs})
            rows[int(gid)] = {"group_id": int(gid), "state": state, "turn_versions": versions}
    logged = getattr(source, "completions", None)
    logged = logged() if callable(logged) else logged  # a recorded view's method: every row it logged
    if isinstance(logged, pd.DataFrame) and "turn_versions" in logged:
        for gid, frame in logged[logged.group_id >= 0].groupby("group_id", sort=True):
            if int(gid) not in rows:
                versions = sorted({int(v) for vs in frame.turn_versions for v in vs})
                rows[int(gid)] = {"group_id": int(gid), "state": "trained", "turn_versions": versions}
    frame = pd.DataFrame(sorted(rows.values(), key=lambda r: r["group_id"]),
                         columns=["group_id", "state", "turn_versions"])
    return frame.reset_index(drop=True)


def split_turns(text: str, turns: int, turn_texts: Sequence[str | dict] | None = None,
                replies: str | None = None) -> list[tuple[str, str]] | None:
    """``(role, text)`` segments of a transcript after the prompt: model and environment, ``turns`` model turns
    (``turn_texts`` when the row has them: entries with a ``role``, ``assistant`` being the model's, or texts
    alternating; else cut at ``replies``); None when it cannot be cut so that it has exactly ``turns`` model
    turns."""
    if isinstance(turn_texts, (list, tuple)) and len(turn_texts):  # (a frame's missing value is NaN: not a list)
        segments = [("model" if t.get("role") == "assistant" else "environment", str(t.get("text", "")))
                    if isinstance(t, dict) else ("model" if i % 2 == 0 else "environment", str(t))
                    for i, t in enumerate(turn_texts)]
        return segments if sum(role == "model" for role, _ in segments) == turns else None
    if replies is None:
        return None
    pieces = re.split(f"({replies})", text)
    segments = [("model" if i % 2 == 0 else "environment", p) for i, p in enumerate(pieces)]
    if segments and segments[-1] == ("model", "") and len(segments) > 1:  # ends with a reply (an evaluation's)
        segments.pop()
    if sum(role == "model" for role, _ in segments) != turns:
        return None
    return segments


def conversation_table(source, group_id: int, replies: str | None = None) -> pd.DataFrame:
    """One row per segment of each trajectory of group ``group_id``: its ``prompt``, then each ``model`` turn (its
    ``turn`` number and ``version``, ``trained`` True) and each ``environment`` reply (``trained`` False), with the
    trajectory's ``state`` and ``reward`` (when committed). A group in flight lists its turns' versions without
    text (the text is logged when the group commits). Raises ``KeyError`` naming the group when the source knows
    nothing of it."""
    logged = group_completions(source, group_id)
    live = _trajectories(source)
    live = live[live.group_id == group_id] if live is not None else pd.DataFrame()
    held = set(live.trajectory) if not live.empty else set()
    rows: list[dict] = []

    def add(i, role, text, state, reward, turn=None, version=None):
        rows.append({"group_id": group_id, "trajectory": int(i), "segment": sum(r["trajectory"] == i for r in rows),
                     "role": role, "turn": turn, "version": version, "trained": role == "model", "text": text,
                     "state": state, "reward": reward})

    if logged is not None and not logged.empty and "turn_versions" in logged:
        for _, row in logged.iterrows():
            i, versions = int(row.completion_index), [int(v) for v in row.turn_versions]
            state = "buffered" if i in held else "trained"
            add(i, "prompt", str(row.prompt), state, row.reward)
            segments = split_turns(str(row.completion), int(row.turns), row.get("turn_texts"), replies)
            if segments is None:
                add(i, "conversation", str(row.completion), state, row.reward, version=versions)
                continue
            turn = 0
            for role, text in segments:
                if role == "model":
                    turn += 1
                    add(i, role, text, state, row.reward, turn=turn, version=versions[turn - 1])
                else:
                    add(i, role, text, state, row.reward)
    elif not live.empty:
        for _, row in live.iterrows():
            for turn, version in enumerate(row.turn_versions, start=1):
                add(row.trajectory, "model", "", row.state, None, turn=turn, version=int(version))
    else:
        raise KeyError(f"group {group_id}: neither in flight, buffered nor in the completions log (a multi-turn "
                       "group with log_completions on)")
    frame = pd.DataFrame({c: pd.Series([r[c] for r in rows], dtype=object) for c in COLUMNS})
    return frame.astype({"trajectory": "int64", "segment": "int64", "turn": "Int64", "trained": bool,
                         "reward": "float64"})


def shown_text(text: str) -> str:
    """Text as a figure can draw it: unprintable characters as ``·``, a newline as ``⏎``, a blank turn as ``␣``."""
    text = "".join("⏎" if c == "\n" else c if c.isprintable() and c != "\ufffd" else "·" for c in text)
    return text if text.strip() else text.replace(" ", "␣") or "∅"


def _legend_versions(table: pd.DataFrame) -> list[int]:
    versions = set()
    for v in table.version.dropna():
        versions |= set(v) if isinstance(v, list) else {int(v)}
    return sorted(versions)


def conversation_html(source, group_id: int, replies: str | None = None) -> str:
    """The conversation view as an HTML table: a row per trajectory, its prompt, its model turns tinted by version
    (hover: turn and version) and the environment's replies in grey italics (untrained), its reward; a legend."""
    table = conversation_table(source, group_id, replies)
    cells = []
    for i, frame in table.groupby("trajectory", sort=True):
        parts = []
        for _, s in frame.iterrows():
            text = html.escape(s.text) if s.text else "&hellip;"
            if s.role == "prompt":
                parts.append(f'<span class="asyncrl-prompt" style="color:#555">{text}</span>')
            elif s.role == "model":
                parts.append(f'<span class="asyncrl-turn" data-version="{s.version}" title="turn {s.turn}: weights '
                             f'{s.version}" style="background:{version_colour(s.version)};color:white;'
                             f'padding:0 3px;border-radius:3px">{text}<sub>v{s.version}</sub></span>')
            elif s.role == "environment":
                parts.append(f'<span class="asyncrl-observation" title="environment: untrained" style="background:'
                             f'{ENVIRONMENT_COLOUR};font-style:italic;padding:0 3px">{text}</span>')
            else:
                parts.append(f'<span class="asyncrl-transcript" title="versions {s.version}">{text} '
                             f'<sub>v{s.version}</sub></span>')
        reward = frame.reward.iloc[0]
        shown = "" if reward is None or pd.isna(reward) else f"{float(reward):g}"
        cells.append(f"<tr><td>{i}</td><td>{html.escape(str(frame.state.iloc[0]))}</td><td>{shown}</td>"
                     f"<td style='white-space:pre-wrap'>{' '.join(parts)}</td></tr>")
    legend = " ".join(f'<span style="background:{version_colour(v)};color:white;padding:0 4px;border-radius:3px">'
                      f'weights {v}</span>' for v in _legend_versions(table))
    legend += f' <span style="background:{ENVIRONMENT_COLOUR};font-style:italic;padding:0 4px">environment (untrained)</span>'
    return (f'<div class="asyncrl-conversation"><p><b>group {group_id}</b>: {legend}</p>'
            '<table class="asyncrl-table"><tr><th>trajectory</th><th>state</th><th>reward</th><th>conversation</th>'
            f'</tr>{"".join(cells)}</table></div>')


def draw_conversation(table: pd.DataFrame, ax, max_chars: int = 18) -> None:
    """A conversation table on an Axes: a row per trajectory, a box per segment left to right (model turns tinted
    by version, the environment's replies grey), the reward at the right."""
    y_labels = []
    trajectories = list(table.groupby(["group_id", "trajectory"], sort=True))
    for y, ((gid, i), frame) in enumerate(trajectories):
        x = 0.0
        for _, s in frame.iterrows():
            text = shown_text(s.text) if s.text else "…"
            text = text if len(text) <= max_chars else text[:max_chars - 1] + "…"
            width = max(len(text), 2) * 0.55 + 0.6
            if s.role == "prompt":
                colour, edge, style, colour_text = PROMPT_COLOUR, "#999999", "normal", "#333333"
            elif s.role == "model":
                colour, edge, style, colour_text = version_colour(s.version), "none", "normal", "white"
            elif s.role == "environment":
                colour, edge, style, colour_text = ENVIRONMENT_COLOUR, "none", "italic", "#444444"
            else:
                colour, edge, style, colour_text = "#F4F4F4", "#999999", "normal", "#333333"
            ax.add_patch(_box(x, y, width, colour, edge))
            ax.text(x + width / 2, y, text, ha="center", va="center", fontsize=8, color=colour_text, style=style,
                    family="monospace")
            x += width + 0.15
        reward = frame.reward.iloc[0]
        if reward is not None and not pd.isna(reward):
            ax.text(x + 0.3, y, f"reward {float(reward):g}", va="center", fontsize=8, color="#333333")
        y_labels.append(f"group {gid} · {i}")
    ax.set_yticks(range(len(trajectories)), y_labels, fontsize=8)
    ax.set_ylim(len(trajectories) - 0.5, -0.5)
    ax.set_xlim(-0.2, max(ax.get_xlim()[1], 1))
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


def _box(x: float, y: float, width: float, colour: str, edge: str) -> FancyBboxPatch:
    return FancyBboxPatch((x, y - 0.34), width, 0.68, boxstyle="round,pad=0,rounding_size=0.15", facecolor=colour,
                          edgecolor=edge, lw=0.6)


def conversation_figure(source, group_id: int | Sequence[int], replies: str | None = None,
                        figsize: tuple[float, float] | None = None, max_chars: int = 18) -> Figure:
    """A group's (or several groups') conversations turn by turn, each model turn tinted by its weight version,
    the environment's replies grey (untrained), with a legend of the versions."""
    ids = [group_id] if isinstance(group_id, int) else list(group_id)
    table = pd.concat([conversation_table(source, g, replies) for g in ids], ignore_index=True)
    n = table.groupby(["group_id", "trajectory"]).ngroups
    longest = table.groupby(["group_id", "trajectory"]).text.apply(
        lambda t: sum(max(min(len(s), max_chars), 2) * 0.55 + 0.75 for s in t)).max()
    fig = Figure(figsize=figsize or (min(max(8.0, 2.5 + longest * 0.2), 16), 1.4 + 0.32 * n), layout="constrained")
    ax = fig.add_subplot()
    draw_conversation(table, ax, max_chars)
    ax.set_xlim(-0.2, longest + 3.5)
    handles = [Patch(facecolor=version_colour(v), label=f"turn generated with weights {v}")
               for v in _legend_versions(table)]
    handles.append(Patch(facecolor=ENVIRONMENT_COLOUR, label="environment reply (untrained)"))
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), frameon=False,
              ncol=min(len(handles), 4))
    ax.set_title("conversations turn by turn, tinted by the weight version of each model turn", fontsize=10,
                 loc="left")
    return fig
