"""The read view: what a live ``Controller``, a recording's ``RecordedView`` and ``attach``'s ``Remote`` all answer
(``ReadView``), and the one computation of ``explain()`` and ``state()`` behind the three.

A controller calls ``verdicts`` and ``snapshot`` with its live parts under its lock; a recorded view calls them with
the buffer and sampler it rebuilt from the trace; a remote receives what the run's controller computed, through
``encode_*``/``decode_*`` (JSON lines on its socket). The held-out evaluations of a run read from its files are
``evaluations_from_metrics`` (a recorded view, a remote); a controller keeps its own list.

Invariants:
- ``explain()`` and ``state()`` of one view speak of one ``T``: both are computed here from the same
  ``trainer_version``, and every verdict frame says which in ``frame.attrs["trainer_version"]``.
- The verdicts are the ones the next train tick would see: a step whose groups are all trained is complete (the
  next tick starts a new one), so the chunk bounds are those of a fresh step then.
- Nothing here changes anything: a sampler is asked ``explain``, never ``select`` or ``evict``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol, runtime_checkable

import pandas as pd

from asyncrl import metrics as M
from asyncrl.reports import ControllerState
from asyncrl.samplers import explain_frame

VERSION_COLUMNS = ("group_id", "weight_version", "target_step")  # nullable integers in a verdict frame


@runtime_checkable
class ReadView(Protocol):
    """What the widgets and scripts read: a ``Controller``, a ``RecordedView`` (``Recording.at``) and a ``Remote``
    (``asyncrl.attach``) all answer it, with the same types."""

    @property
    def trainer_version(self) -> int: ...

    @property
    def task(self) -> Any: ...  # its ``constant_answer_accuracy``: the bar the reward panel draws

    @property
    def metrics(self) -> pd.DataFrame: ...

    @property
    def trace(self) -> pd.DataFrame: ...

    @property
    def evaluations(self) -> pd.DataFrame: ...

    def explain(self, timeout: float | None = None) -> pd.DataFrame: ...

    def state(self) -> ControllerState: ...


# ------------------------------------------------------------------------------------- explain() and state()
def verdicts(cfg, sampler, buffer, trainer_version: int, step_groups_trained: int,
             completions=None) -> pd.DataFrame:
    """``explain()``: the sampler's verdict for every buffered group as the next train tick at ``trainer_version``
    would see it (this step's chunk bounds); with generation replicas, also which replica generated each group
    (empty while it is pending); with multi-turn groups in flight, ``turn`` (the turn the furthest of its
    trajectories reached) and ``turn_versions`` (the weight version of each of its turns so far, in order: those of
    the trajectory that reached ``turn``, the first of them on a tie).
    ``sampler``: anything with the sampler's ``explain(T, min_groups, max_groups)``.
    ``completions(group_id)``: the rows the completions log holds for a group, the ``completions`` column (what
    ``completions(group_id)`` of the view reads)."""
    N = cfg.groups_per_step
    remaining = N - step_groups_trained or N  # all trained: the step is complete, the next tick starts one
    lo, hi = cfg.chunk_bounds
    frame = explain_frame(sampler.explain(trainer_version, min(lo, remaining), min(hi, remaining)))
    if cfg.generation.replicas > 1:
        rollouts = [buffer[gid].rollouts for gid in frame.group_id]
        frame["replica"] = pd.array([None if r is None else r.replica for r in rollouts], dtype="Int64")
    if any(buffer[gid].turns for gid in frame.group_id):  # multi-turn groups in flight: the turn each has reached
        turns = [buffer[gid].turns or {} for gid in frame.group_id]
        frame["turn"] = pd.array([max((len(v) for v, _ in t.values()), default=None) for t in turns], dtype="Int64")
        frame["turn_versions"] = [_turn_versions(t) for t in turns]
    if completions is not None:
        frame["completions"] = pd.array([completions(gid) if buffer[gid].ready else 0 for gid in frame.group_id],
                                        dtype="Int64")  # a pending group has none yet (a view's, logged later)
    frame.attrs["trainer_version"] = trainer_version
    return frame


def _turn_versions(turns: dict) -> list[int] | None:
    """One turn version per turn of a multi-turn group in flight (``slot.turns``: trajectory -> (its turns'
    versions, done)), in order: the furthest trajectory's (the first of them on a tie); None before any turn."""
    furthest = max((versions for _, (versions, _) in sorted(turns.items())), key=len, default=None)
    return list(furthest) if furthest else None


def snapshot(*, cfg, sampler, buffer, trainer_version: int, generation_version: int, capacity: int,
             inflight: int, step_groups_trained: int, data_position: int, exhausted: bool, last_report,
             untrusted: dict | None = None) -> ControllerState:
    """``state()``: one consistent snapshot for widgets. ``sampler`` None with ``untrusted`` (a custom sampler's
    config, never imported): the snapshot names it without asking it anything."""
    T = trainer_version
    window = None if sampler is None else sampler.window  # None: the policy has no window (SamplerBase.window_knob)
    return ControllerState(
        trainer_version=T,
        generation_version=generation_version,
        sampler=sampler.name if sampler is not None else "custom",
        sampler_repr=repr(sampler) if sampler is not None else f"custom {untrusted} (not imported: trust_code=False)",
        window=window,
        lower_bound=None if window is None else sampler.lower_bound(T),
        buffer=buffer.summary(),
        capacity=capacity,
        inflight=inflight,
        step_groups_trained=step_groups_trained,
        groups_per_step=cfg.groups_per_step,
        data_position=data_position,
        exhausted=exhausted,
        last_report=last_report,
    )


def evaluations_from_metrics(metrics: pd.DataFrame) -> pd.DataFrame:
    """The held-out evaluations in a run's metrics rows (``eval_*`` columns), by the weight version they judged."""
    columns = [c.name for c in (M.EVALUATED_VERSION, M.HELD_OUT_REWARD, M.HELD_OUT_ACCURACY)]  # eval_every's
    if M.EVAL_REWARD.name not in metrics:
        return pd.DataFrame(columns=columns)
    done = metrics.dropna(subset=[M.EVAL_REWARD.name])
    return pd.DataFrame({M.EVALUATED_VERSION.name: done[M.TRAINER_VERSION.name].astype(int).values,
                         M.HELD_OUT_REWARD.name: done[M.EVAL_REWARD.name].values,
                         M.HELD_OUT_ACCURACY.name: done[M.EVAL_ACCURACY.name].values})


# --------------------------------------------------------------------------------- over a remote's socket
def encode_verdicts(frame: pd.DataFrame) -> dict:
    return {"split": json.loads(frame.to_json(orient="split", index=False)),
            "trainer_version": frame.attrs.get("trainer_version")}


def decode_verdicts(value: dict) -> pd.DataFrame:
    from asyncrl.samplers.verdict_frame import VerdictFrame

    split = value["split"]
    frame = VerdictFrame(split["data"], columns=split["columns"])
    frame = frame.astype({c: "Int64" for c in VERSION_COLUMNS if c in frame})
    frame.attrs["trainer_version"] = value["trainer_version"]
    return frame


def encode_state(state: ControllerState) -> dict:
    out = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    out["buffer"] = json.loads(state.buffer.to_json(orient="split"))
    out["last_report"] = None if state.last_report is None else str(state.last_report)
    return out


def decode_state(value: dict) -> ControllerState:
    """A ``ControllerState`` from ``encode_state``'s JSON (extra keys are ignored; ``last_report`` is its line)."""
    split = value["buffer"]
    buffer = pd.DataFrame(split["data"], columns=split["columns"],
                          index=pd.Index(split["index"], name="weight_version", dtype="int64"), dtype="int64")
    names = {f.name for f in dataclasses.fields(ControllerState)}
    return ControllerState(**{k: value[k] for k in names if k != "buffer"}, buffer=buffer)
