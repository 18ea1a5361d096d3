"""Recordings (asyncrl/recording.py): a view at any step, or any trace row inside one, is the controller as it
stood there, re-judged by the run's sampler: its ``explain()`` equals the live controller's, row for row, for every
built-in sampler, from a live controller and from a run directory; a custom sampler is imported only when trusted;
the skew metrics say what was generated, trained and dropped."""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
import warnings

import pandas as pd
import pytest

from asyncrl import Controller, Recording, load_config
from asyncrl.read_view import ReadView
from asyncrl.recording import RunFiles

PATTERN = ["rollout"] * 4 + ["train"] * 3 + ["rollout", "train", "rollout", "rollout", "train", "train"]
SAMPLERS = [
    {"name": "windowed", "max_staleness_versions": 1},  # four rollout ticks ahead of the trainer: evictions
    {"name": "weight_fifo", "max_staleness_versions": 1},
    {"name": "in_order", "max_lookahead_versions": 1},
    {"name": "ready_first", "max_staleness_versions": 1},
]


def stepped(cfg, out=None, steps: int = 5):
    """Step a controller by the pattern; after every tick, the trace length and the live ``explain()``."""
    ctrl = Controller.from_config(cfg)
    files = RunFiles(out).attach(ctrl) if out is not None else None
    seen, i = [], 0
    while ctrl.trainer_version < steps:
        getattr(ctrl, f"{PATTERN[i % len(PATTERN)]}_tick")()
        seen.append((ctrl.num_events - 1, ctrl.trainer_version, ctrl.explain()))
        i += 1
    if files is not None:
        (out / "config.yaml").write_text(__import__("yaml").safe_dump(cfg.model_dump(mode="json")))
        files.close()
    return ctrl, seen


def where(rec: Recording, seq: int) -> tuple[int, int] | None:
    """``(step, event)`` of trace row ``seq``, or None when it is after the last finished step."""
    first = 0
    for step in rec.steps:
        n = rec.events(step)
        if seq < first + n:
            return step, seq - first
        first += n
    return None


@pytest.mark.parametrize("sampler", SAMPLERS, ids=[s["name"] for s in SAMPLERS])
def test_a_view_explains_what_the_live_controller_explained(sampler, tmp_path):
    cfg = load_config("quickstart", seed=7, sampler=sampler, eval_every=None)
    ctrl, seen = stepped(cfg, tmp_path)
    for rec in (Recording(ctrl), Recording(tmp_path)):  # a live controller, and the run directory it wrote
        assert rec.steps == list(range(ctrl.trainer_version))
        compared, steps = 0, set()
        for seq, T, live in seen:
            at = where(rec, seq)
            if at is None:
                continue
            view = rec.at(at[0], event=at[1])
            assert view.trainer_version == T and view.row.seq == seq
            pd.testing.assert_frame_equal(view.explain(), live)
            compared += 1
            if view.row.event == "step":  # right after the step: what rec.at(step) is
                pd.testing.assert_frame_equal(rec.at(at[0]).explain(), live)
                steps.add(at[0])
        assert sorted(steps) == rec.steps and compared > len(steps)  # every step, and rows inside steps
        view = rec.at(rec.steps[-1])
        pd.testing.assert_frame_equal(view.metrics.reset_index(drop=True)[["step", "loss", "reward_mean"]],
                                      ctrl.metrics[["step", "loss", "reward_mean"]], check_dtype=False)
        state = view.state()
        assert state.trainer_version == rec.steps[-1] + 1 and state.sampler == sampler["name"]
        if sampler["name"] == "windowed":
            found = rec.find("evict")
            assert found is not None and rec.at(*found).row.event == "evict"


def test_bad_scrubs_are_clear_errors(tmp_path):
    cfg = load_config("quickstart", seed=1, eval_every=None)
    ctrl, _ = stepped(cfg, tmp_path, steps=2)
    rec = Recording(tmp_path)
    with pytest.raises(ValueError, match=r"step must be a finished step of this recording \(0..1\), got 5"):
        rec.at(5)
    with pytest.raises(ValueError, match=r"event must be an int in \[0, \d+\)"):
        rec.at(0, event=10_000)
    with pytest.raises(ValueError, match="not a run directory"):
        Recording(tmp_path / "nowhere")
    assert not hasattr(rec.at(1), "rollout_tick")  # read-only
    steps, indexed = rec.steps, [rec.at(step).explain() for step in rec.steps]
    (tmp_path / "trace_index.csv").unlink()  # a run directory from before the index: one pass over trace.csv
    old = Recording(tmp_path)
    assert old.steps == steps
    for step, frame in zip(old.steps, indexed):
        pd.testing.assert_frame_equal(old.at(step).explain(), frame)
    # a trace.csv from before the typed columns (gen_start_version, ..., dispatch_index): read, not scrubbed
    trace = pd.read_csv(tmp_path / "trace.csv", keep_default_na=False)
    trace.iloc[:, :9].to_csv(tmp_path / "trace.csv", index=False)
    older = Recording(tmp_path)
    assert older.steps == steps and len(older.trace) == len(trace) and len(older.metrics) == len(steps)
    with pytest.raises(ValueError, match="written before asyncrl recorded gen_start_version, gen_end_version, "
                                         "replica and dispatch_index as columns, which a view needs"):
        older.at(0)


CUSTOM = '''
from asyncrl.samplers.windowed import WindowedSampler


class FreshFirst(WindowedSampler):
    name = "fresh_first_for_recording"
'''


def test_a_custom_sampler_is_imported_only_with_trust_code(tmp_path, monkeypatch):
    module = "recording_custom_sampler_fixture"
    (tmp_path / f"{module}.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config("quickstart", seed=3, eval_every=None,
                      sampler={"name": "custom", "target": f"{module}:FreshFirst", "max_staleness_versions": 1})
    out = tmp_path / "run"
    out.mkdir()
    ctrl, seen = stepped(cfg, out, steps=3)
    del sys.modules[module]
    view = Recording(out).at(2)
    assert module not in sys.modules  # nothing of the run's code ran
    recorded = view.explain()
    assert "trust_code=True" in recorded.attrs["note"] and set(recorded.action) <= {"select", "evict", "abort", "skip"}
    assert view.state().sampler == "custom"
    live = [frame for seq, T, frame in seen if seq == Recording(out, trust_code=True).at(2).row.seq][-1]
    pd.testing.assert_frame_equal(Recording(out, trust_code=True).at(2).explain(), live)
    assert module in sys.modules


WORDED = {"name": "custom", "target": "tests.custom_sampler_fixture:Worded", "max_staleness_versions": 1}


@pytest.mark.parametrize("sampler", SAMPLERS + [WORDED], ids=[s["name"] for s in SAMPLERS] + ["custom"])
def test_a_views_explain_and_state_speak_of_one_T_trusted_or_not(sampler, tmp_path):
    """At every row, ``explain()`` is about the ``T`` that ``state()`` gives: the re-judged verdicts, and for a
    custom sampler not trusted the decisions recorded at that ``T`` (not those of the step that had just ended)."""
    cfg = load_config("quickstart", seed=5, sampler=sampler, eval_every=None)
    ctrl, _ = stepped(cfg, tmp_path, steps=4)
    assert isinstance(ctrl, ReadView) and ctrl.explain().attrs["trainer_version"] == ctrl.state().trainer_version
    recorded = 0
    for trusted in (False, True):
        rec = Recording(tmp_path, trust_code=trusted)
        for step in rec.steps:
            for event in (None, *range(rec.events(step))):
                view = rec.at(step, event)
                assert isinstance(view, ReadView)
                frame, T = view.explain(), view.state().trainer_version
                assert T == view.trainer_version == frame.attrs["trainer_version"] == (step + 1 if event is None
                                                                                      else view.row.trainer_version)
                assert set(frame.group_id) <= {slot.group_id for slot in view.buffer}  # groups buffered here
                if sampler is WORDED:  # its reasons name the T they were given: "worded pick of group 3 at T=2"
                    assert all(reason.endswith(f"at T={T}") for reason in frame.reason if "worded" in reason)
                if view.sampler is None:
                    assert "trust_code=True" in frame.attrs["note"] and set(frame.code) <= {"recorded"}
                    rejudged = Recording(tmp_path, trust_code=True).at(step, event).explain()
                    assert set(frame.group_id) <= set(rejudged.group_id)  # what the re-judge saw, decided
                    recorded += len(frame)
    assert (recorded > 0) == (sampler is WORDED)  # an untrusted custom view shows decisions; a built-in re-judges


def test_skew_metrics_say_what_was_generated_trained_and_dropped():
    G = 8
    cfg = load_config("quickstart", seed=7, sampler=SAMPLERS[0], eval_every=None,
                      generation={"max_new_tokens": 3}, group_size=G)
    ctrl, _ = stepped(cfg, steps=6)
    m = ctrl.metrics
    assert (m.train_len_mean == m.completion_tokens / m.completions).all()
    assert (m.train_reward_mean - m.reward_mean).abs().max() < 1e-12
    committed = m.gen_completions > 0
    assert (m.gen_completions % G == 0).all() and committed.any() and (~committed).any()
    assert m.gen_len_mean[committed].between(1, 3).all() and m.gen_len_mean[~committed].map(math.isnan).all()
    commits = ctrl.trace[ctrl.trace.event == "commit"]
    assert m.gen_completions.sum() == G * len(commits[commits.seq <= ctrl.trace[ctrl.trace.event == "step"].seq.max()])
    dropped = m.groups_evicted > 0
    assert dropped.any() and (~dropped).any(), "the pattern should evict in some steps and not in others"
    assert (m.drop_completions == G * m.groups_evicted).all()  # an abort in flight has no completions
    assert m.drop_len_mean[dropped].between(1, 3).all() and m.drop_len_mean[~dropped].map(math.isnan).all()
    assert m.drop_reward_mean[~dropped].map(math.isnan).all()


# ------------------------------------------------------------------------------------- damaged run directories
@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """A run directory of 8 steps, written by ``RunFiles`` (trace, metrics, index, completions)."""
    out = tmp_path_factory.mktemp("whole")
    stepped(load_config("quickstart", seed=3, sampler={"name": "weight_fifo", "max_staleness_versions": 1},
                        eval_every=None, torch_threads=1), out, steps=8)
    return out


def cut_mid_row(path, fraction: float = 0.6) -> int:
    """Cut ``path`` inside a row near ``fraction`` of its length (what a full disk or a kill mid-write leaves);
    returns the length of its whole lines."""
    data = path.read_bytes()
    end = data.rfind(b"\n", 0, int(len(data) * fraction)) + 1
    path.write_bytes(data[:end + max(1, (data.index(b"\n", end) - end) // 2)])
    return end


def whole_steps(run, name: str, end: int) -> int:
    """How many steps a copy of ``run`` whose file ``name`` holds only its first ``end`` bytes whole has whole,
    counted from the intact files."""
    trace = Recording(run).trace
    if name == "trace.csv":
        kept = pd.read_csv(io.BytesIO((run / name).read_bytes()[:end]), keep_default_na=False)
        return int((kept.event == "step").sum())
    if name == "metrics.csv":
        return (run / name).read_bytes()[:end].count(b"\n") - 1
    cut_row = json.loads((run / name).read_bytes()[end:].split(b"\n")[0])  # the completions row cut short
    committed = trace[(trace.event == "commit") & (trace.group_id == cut_row["group_id"])].seq.iloc[0]
    return int(((trace.event == "step") & (trace.seq < committed)).sum())


@pytest.mark.parametrize("indexed", [True, False], ids=["with-index", "without-index"])
@pytest.mark.parametrize("name", ["trace.csv", "metrics.csv", "completions.jsonl"])
def test_a_file_cut_mid_row_opens_through_the_last_whole_step_and_says_where(whole_run, tmp_path, name, indexed):
    from asyncrl.recording import RecordingDamaged

    run = tmp_path / "run"
    shutil.copytree(whole_run, run)
    if not indexed:
        (run / "trace_index.csv").unlink()
    end = cut_mid_row(run / name)
    whole = whole_steps(whole_run, name, end)
    assert 0 < whole < 8
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        rec = Recording(run)
    damaged = [str(w.message) for w in said if issubclass(w.category, RecordingDamaged)]
    assert len(damaged) == 1 and "\n" not in damaged[0], damaged
    assert damaged[0].startswith(f"{name} ends mid-row") and f"(byte {end} of " in damaged[0], damaged
    assert f"steps 0..{whole - 1}" in damaged[0], damaged
    assert rec.steps == list(range(whole))
    intact = Recording(whole_run)
    last = rec.at(rec.steps[-1])  # steps and at() agree
    assert last.trainer_version == whole and last.row.event == "step"
    pd.testing.assert_frame_equal(last.explain(), intact.at(whole - 1).explain())
    pd.testing.assert_frame_equal(rec.metrics, intact.metrics.iloc[:whole])
    assert len(rec.trace) == len(intact.trace[intact.trace.seq <= intact.at(whole - 1).row.seq])


def test_an_intact_run_directory_opens_without_a_warning(whole_run):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Recording(whole_run).steps == list(range(8))


def test_a_trace_whose_last_row_is_cut_after_the_last_indexed_step_still_says_so(whole_run, tmp_path):
    """The end of trace.csv cut mid-row past the index's last step (a kill mid-write, a copy cut short): every
    indexed step is whole, so all of them open, but the file is damaged and the recording says where it ends."""
    from asyncrl.recording import RecordingDamaged

    run = tmp_path / "run"
    shutil.copytree(whole_run, run)
    whole = (run / "trace.csv").read_bytes()
    with open(run / "trace.csv", "ab") as f:
        f.write(whole.splitlines(keepends=True)[-1][:7])  # the start of one more row, no newline
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        rec = Recording(run)
    damaged = [str(w.message) for w in said if issubclass(w.category, RecordingDamaged)]
    assert len(damaged) == 1 and damaged[0].startswith("trace.csv ends mid-row"), damaged
    assert f"(byte {len(whole)} of {len(whole) + 7})" in damaged[0], damaged
    assert rec.steps == list(range(8)) and rec.at(7).trainer_version == 8
