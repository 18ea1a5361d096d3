"""What a multi-turn run records (issue 46): ``reward/<name>`` of the environment's part and each reward function's,
aborts at a turn boundary in ``groups_aborted``, each turn's text in the completions rows (and the conversation
view cut by them), and ``explain()``'s in-flight turn versions in order."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from asyncrl import Controller
from asyncrl.config import load_config


def _small(**kw):
    base = dict(groups_per_step=2, group_size=4, eval_every=None)
    base.update(kw)
    return load_config("guess_letter", **base)


def replies_bonus(completions, environments, **columns):
    """A reward function added to guess_letter's: 0.25 a reply the environment gave when the secret is in the
    alphabet's first half, else None (does not apply)."""
    return [0.25 * len(env.replies) if env.inner.secret in "abcd" else None for env in environments]


class CountingGuess:
    """guess_letter's environment, remembering its replies (what ``replies_bonus`` reads)."""

    def __init__(self):
        from asyncrl.environments.guess_letter import GuessLetter

        self.inner, self.replies = GuessLetter(), []

    def reset(self, **row):
        return self.inner.reset(**row)

    def step(self, action: str):
        out = self.inner.step(action)
        self.replies.append(out[0])
        return out


@pytest.mark.parametrize("workers", [0, 1])
def test_reward_parts_of_an_environment_run_are_the_environment_s_and_each_function_s_summing_to_the_reward(workers):
    cfg = _small(environment={"workers": workers, "timeout_s": 10.0}, seed=3)
    ctrl = Controller.from_config(cfg, environment_factory=CountingGuess, reward_funcs=[replies_bonus])
    while ctrl.trainer_version < 3:
        ctrl.tick()
    metrics = ctrl.metrics
    assert {"reward/environment", "reward/replies_bonus"} <= set(metrics.columns)
    assert metrics["reward/environment"].notna().all()
    rows = ctrl.completions
    assert {"reward/environment", "reward/replies_bonus"} <= set(rows.columns)
    bonus = rows["reward/replies_bonus"]
    assert bonus.notna().any() and bonus.isna().any()  # applied to some trajectories only (None elsewhere)
    assert rows["reward/environment"].isin([0.0, 1.0]).all()
    total = rows["reward/environment"] + bonus.fillna(0.0)
    assert (total - rows.reward).abs().max() < 1e-9  # the parts sum to the reward
    assert (bonus.dropna() == 0.25 * rows.turns[bonus.notna()]).all()  # the function's own values, unweighted
    # per step: each part's mean over the completions trained (that it applied to), as reward_mean is
    for _, m in metrics.iterrows():
        if math.isnan(m["reward/replies_bonus"]):
            assert m["reward/environment"] == pytest.approx(m.reward_mean)
        else:
            assert m["reward/replies_bonus"] > 0 and m["reward/environment"] < m.reward_mean
    ctrl.close()


def test_a_text_environment_without_reward_functions_reports_its_reward_as_reward_environment():
    ctrl = Controller.from_config(_small())
    while ctrl.trainer_version < 2:
        ctrl.tick()
    assert ctrl.metrics["reward/environment"].tolist() == pytest.approx(ctrl.metrics.reward_mean.tolist())
    assert (ctrl.completions["reward/environment"] == ctrl.completions.reward).all()
    ctrl.close()


def test_a_group_stopped_at_a_turn_boundary_counts_once_in_groups_aborted():
    cfg = _small(sampler={"name": "windowed", "max_staleness_versions": 1}, loss={"importance_correction": "token"})
    ctrl = Controller.from_config(cfg)
    stop = {"now": False}
    asked = ctrl.sampler.should_abort_inflight
    ctrl.sampler.should_abort_inflight = lambda w, T: stop["now"] or asked(w, T)
    ctrl.rollout_tick()  # dispatch, first turns
    stop["now"] = True  # the next turn boundary stops every group in flight
    ctrl.rollout_tick()
    stop["now"] = False
    trace = ctrl.trace
    boundary = trace[(trace.event == "abort") & trace.reason.str.contains("stopped at a turn boundary")]
    assert len(boundary) >= 1
    while ctrl.trainer_version < 2:
        ctrl.tick()
    aborts = ctrl.trace[ctrl.trace.event == "abort"]
    assert aborts.group_id.is_unique  # each aborted once
    assert ctrl.metrics.groups_aborted.sum() == len(aborts)  # every abort counted, the boundary's included
    assert ctrl.metrics.groups_aborted.iloc[0] >= len(boundary)  # in the step during which it happened
    ctrl.close()


def test_completions_rows_carry_each_turn_s_text_and_version_and_the_conversation_view_cuts_by_them():
    from asyncrl.plots import conversation_table

    cfg = _small(sampler={"name": "windowed", "max_staleness_versions": 2}, loss={"importance_correction": "token"})
    ctrl = Controller.from_config(cfg)
    for _ in range(10):
        ctrl.tick()
    rows = ctrl.completions
    assert {"turns", "tool_calls", "env_tokens", "turn_versions", "turn_texts"} <= set(rows.columns)
    for _, row in rows.iterrows():
        texts = row.turn_texts
        model = [t for t in texts if t["role"] == "assistant"]
        assert [t["role"] for t in texts][::2] == ["assistant"] * len(model)  # model turns, replies between
        assert all(t["role"] == "user" and t["version"] is None for t in texts[1::2])
        assert len(model) == row.turns and [t["version"] for t in model] == list(row.turn_versions)
        assert "".join(t["text"] for t in texts) == row.completion  # the turns' texts are the whole completion
    gid = int(rows[rows.turns > 1].group_id.iloc[0])
    table = conversation_table(ctrl, gid)  # no replies= regex: the rows say where each turn is
    for i, segs in table[table.role != "prompt"].groupby("trajectory"):
        row = rows[(rows.group_id == gid) & (rows.completion_index == i)].iloc[0]
        assert list(segs.role) == ["model" if t["role"] == "assistant" else "environment" for t in row.turn_texts]
        assert list(segs.text) == [t["text"] for t in row.turn_texts]
        assert [int(v) for v in segs[segs.role == "model"].version] == list(row.turn_versions)
    # an old recording's rows (no turn_texts) are still cut by the regex
    old = rows.drop(columns=["turn_texts"])
    legacy = conversation_table(type("Old", (), {"completions": old})(), gid, replies=r" (?:higher|lower|correct|"
                                r"invalid) ?")
    assert (legacy.role == "model").sum() + (legacy.role == "conversation").sum() >= 1
    ctrl.close()


def test_recordings_and_replay_carry_the_turn_texts(tmp_path):
    import asyncrl
    from asyncrl import cli

    out = tmp_path / "run"
    assert cli.main(["run", "guess_letter", "--steps", "2", "--out", str(out), "--quiet", "--no-plot", "--set",
                     "groups_per_step=2", "--set", "group_size=2", "--set", "eval_every=null"]) == 0
    logged = pd.read_json(out / "completions.jsonl", lines=True)
    assert logged.turn_texts.map(len).eq(2 * logged.turns - 1).all()
    rec = asyncrl.Recording(out)
    view = rec.at(rec.steps[-1])
    gid = int(logged.group_id.iloc[0])
    assert view.completions(gid).turn_texts.tolist() == logged[logged.group_id == gid].turn_texts.tolist()
    replayed = rec.replay(sampler={"name": "weight_fifo", "max_staleness_versions": 1})
    served = replayed.controller.completions
    assert "turn_texts" in served and (served.turn_texts.map(
        lambda t: [x["version"] for x in t if x["role"] == "assistant"]) == served.turn_versions.map(list)).all()
    assert (served.turn_texts.map(lambda t: "".join(x["text"] for x in t)) == served.completion).all()


def test_explain_lists_each_in_flight_turn_s_version_in_order():
    cfg = _small(groups_per_step=1, group_size=2)
    ctrl = Controller.from_config(cfg)
    seen = False
    for _ in range(3):
        ctrl.rollout_tick()
        frame = ctrl.trajectories()
        live = frame[frame.state != "buffered"]
        if live.empty:
            continue
        pending = ctrl.explain().set_index("group_id")
        for gid, trajs in live.groupby("group_id"):
            furthest = trajs.loc[trajs.turn.idxmax()]
            assert pending.loc[gid, "turn_versions"] == list(furthest.turn_versions)  # one per turn, repeats kept
            assert len(pending.loc[gid, "turn_versions"]) == pending.loc[gid, "turn"]
            seen = seen or pending.loc[gid, "turn"] >= 2
    assert seen  # a group in flight at its second turn: [0, 0], not the distinct {0}
    ctrl.close()


class Delayed:
    """A text environment whose every reply takes the row's ``delay`` seconds."""

    def reset(self, delay: float = 0.0, **row):
        self.delay = float(delay)

    def step(self, action):
        import time

        time.sleep(self.delay)
        return " ok ", 0.0, False


def test_a_running_pump_s_trajectories_go_on_without_waiting_for_a_slower_environment_call():
    """Free turns: with an asynchronous sampler a running pump's poll (a timeout) does not wait for the slowest
    environment call of a turn; a stepped poll (no timeout) still does (what keeps stepped runs deterministic)."""
    import time

    from asyncrl.data import GenerationRequest
    from asyncrl.environments import describe_class
    from asyncrl.prompts import Prompt
    from asyncrl.tokenizer import build_tokenizer
    from asyncrl.turns import TurnGenerator
    from tests.test_environments import Scripted

    tok = build_tokenizer()
    prompts = {0: Prompt("slow:", id="train/0", columns={"delay": 1.5}),
               1: Prompt("fast:", id="train/1", columns={"delay": 0.0})}
    for free in (True, False):
        turns = TurnGenerator(Scripted(tok, ["a"] * 100), describe_class(Delayed), 3, 2, 20.0, 8, tok,
                              lambda gid: prompts[gid])
        seen = []
        turns.bind(lambda gid, i, turn, version, done: seen.append((gid, turn)), lambda gid, turn: False,
                   lambda gid, why: pytest.fail(why))
        turns.free_turns = free
        turns.submit([GenerationRequest(0, tok.encode("slow:"), 2), GenerationRequest(1, tok.encode("fast:"), 2)])
        out = turns.poll(0.05 if free else 0.0)  # the workers start, the first turns are generated
        start = time.monotonic()
        while not out:
            out += turns.poll(0.05 if free else 0.0)
        elapsed = time.monotonic() - start
        if free:  # group 1 (its own worker) played its 3 turns while group 0's first replies were being made
            assert [g.group_id for g in out] == [1] and elapsed < 1.4
            assert {t for gid, t in seen if gid == 0} <= {1}
        else:  # lockstep: every turn waits for the slow replies
            assert sorted(g.group_id for g in out) == [0, 1] and elapsed >= 2 * 1.5
        while len(out) < 2:
            out += turns.poll(0.05 if free else 0.0)
        assert all(t["turns"] == 3 for g in out for t in g.turns)
        turns.close()


def test_trajectories_counts_are_integers_with_na_where_a_trajectory_has_none_yet():
    """A frame mixing buffered and in-flight trajectories: counts stay integers (``6``, not ``6.0``), ``<NA>`` for
    an in-flight trajectory's tool calls, observation tokens and reward-less columns."""
    ctrl = Controller.from_config(load_config("guess_letter", groups_per_step=2, group_size=2, eval_every=None))
    frame = ctrl.trajectories()
    for _ in range(6):
        ctrl.rollout_tick()
        frame = ctrl.trajectories()
        if {"buffered", "in flight"} <= set(frame.state):
            break
    assert {"buffered", "in flight"} <= set(frame.state)
    for column in ("turn", "weight_version", "tool_calls", "env_tokens"):
        assert str(frame[column].dtype) == "Int64", (column, frame[column].dtype)
    live = frame[frame.state == "in flight"]
    assert live.tool_calls.isna().all() and live.env_tokens.isna().all() and live.reward.isna().all()
    assert (frame[frame.state == "buffered"].env_tokens > 0).all()
    ctrl.close()


def test_an_environment_run_s_prompt_column_is_the_rendered_prompt_the_model_read(tmp_path):
    """On a tool environment with a chat template, a row's ``prompt`` is what the model read: the rendering with the
    tools and ``reset``'s hint, whose tokens are the ``prompt_tokens`` (as a single-turn chat row's are), in the run
    directory's log, a recording's view and the conversation view's prompt box; a replay of the run still runs."""
    import asyncrl
    from asyncrl import cli
    from asyncrl.plots import conversation_table
    from asyncrl.tokenizer import TOOL_CHAT_TEMPLATE, build_tokenizer
    from tests.environment_classes import HintedCalculator

    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    out = tmp_path / "run"
    sets = ["groups_per_step=2", "group_size=2", "eval_every=null", "environment.workers=0",
            "environment.factory=tests.environment_classes:HintedCalculator", f"model.chat_template={template}",
            "model.max_position_embeddings=256"]
    assert cli.main(["run", "quickstart", "--steps", "2", "--out", str(out), "--quiet", "--no-plot",
                     *[a for s in sets for a in ("--set", s)]]) == 0
    tok = build_tokenizer()
    logged = pd.read_json(out / "completions.jsonl", lines=True)
    assert len(logged) >= 2
    for _, row in logged.iterrows():
        assert HintedCalculator.HINT in row.prompt and "add(a, b)" in row.prompt  # reset's text, the tools rendered
        assert row.prompt.endswith("assistant: ")  # the generation prompt: where the model began
        assert len(tok.encode(row.prompt, add_special_tokens=False)) == row.prompt_tokens
    rec = asyncrl.Recording(out)
    gid = int(logged.group_id.iloc[0])
    view = rec.at(rec.steps[-1])
    assert view.completions(gid).prompt.tolist() == logged[logged.group_id == gid].prompt.tolist()
    table = conversation_table(view, gid)
    assert table[table.role == "prompt"].text.tolist() == logged[logged.group_id == gid].prompt.tolist()
    replayed = rec.replay(sampler={"name": "weight_fifo", "max_staleness_versions": 1})  # dispatch prompts match
    served = replayed.controller.completions  # the simulated generator's rows: its prompt's text, as it was given
    assert len(served) > 0 and all(len(tok.encode(r.prompt)) == r.prompt_tokens for _, r in served.iterrows())
