"""Multi-turn environments (issue 46): text and TRL-style tool environments, token custody (only sampled tokens
train), faults in environments, turn events and versions, the guess_letter task, determinism."""

from __future__ import annotations

import pytest
import torch

from asyncrl import Controller
from asyncrl.algorithms import make_train_batch
from asyncrl.config import load_config
from asyncrl.data import GroupRollouts
from asyncrl.environments import check_template, describe_class, parse_tool_calls
from asyncrl.environments.guess_letter import GuessLetter
from asyncrl.prompts import Prompt
from asyncrl.tokenizer import build_tokenizer
from asyncrl.turns import TurnGenerator
from tests.environment_classes import Calculator, Faulty

# A Hermes-style template for the byte tokenizer: it renders tools and <tool_call>, and past turns as they were.
TOOL_TEMPLATE = ("{%- if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %} <tool_call>\n{% endif %}"
                 "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{%- if add_generation_prompt %}assistant: {% endif %}")
THINK_STRIPPING = ("{%- for m in messages %}{% if m.role == 'assistant' and not loop.last %}{{ m.role }}: "
                   "{{ m.content.split('</think>')[-1] }}\n{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
                   "{% endfor %}{%- if add_generation_prompt %}assistant: {% endif %}")


class Scripted:
    """A generation backend whose turns are scripted texts (the Protocol's submit/poll/abort)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.queue, self.version, self.sent = tokenizer, list(script), [], 0, []

    def submit(self, requests):
        self.queue += list(requests)
        self.sent += [list(r.prompt_ids) for r in requests]

    def num_inflight(self):
        return len(self.queue)

    def abort(self, ids):
        self.queue = [r for r in self.queue if r.group_id not in set(ids)]
        return list(ids)

    def poll(self, timeout=0.0):
        out = []
        for r in self.queue:
            texts = [self.script.pop(0) for _ in range(r.n)]
            ids = [self.tokenizer.encode(t, add_special_tokens=False) + [self.tokenizer.eos_token_id] for t in texts]
            out.append(GroupRollouts(r.group_id, list(r.prompt_ids), ids, [[-0.5] * len(c) for c in ids],
                                     self.version, self.version, ["stop"] * r.n))
        self.queue = []
        return out

    def close(self):
        pass


def test_a_tool_environment_s_turns_keep_the_sampled_tokens_and_mask_the_tool_results():
    tok = build_tokenizer()
    kind = describe_class(Calculator)
    assert kind.kind == "tool" and [s["function"]["name"] for s in kind.tools] == ["add"]
    assert check_template(tok, TOOL_TEMPLATE, kind, "byte") == "hermes"
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    inner = Scripted(tok, [call, "done", call, call])  # trajectory 0: call, call, call (max_turns 3); 1: stop
    prompt = Prompt("add 2 and 3", id="train/0")
    turns = TurnGenerator(inner, kind, 3, 0, 5.0, 64, tok, lambda gid: prompt, TOOL_TEMPLATE)
    events = []
    turns.bind(lambda *e: events.append(e[:4]), lambda gid, turn: False, lambda gid, why: pytest.fail(why))
    from asyncrl.data import GenerationRequest

    turns.submit([GenerationRequest(7, [1, 2, 3], 2)])
    out = []
    for _ in range(4):
        out += turns.poll()
    (group,) = out
    assert group.rewards == [2.0, 0.0]  # get_reward: the tool calls run (the last turn's is past max_turns)
    assert [t["turns"] for t in group.turns] == [3, 1] and [t["tool_calls"] for t in group.turns] == [2, 0]
    assert [t["turn_versions"] for t in group.turns] == [[0, 0, 0], [0]]
    ids, mask, lps = group.completion_ids[0], group.trained_mask[0], group.logprobs[0]
    sampled = [i for i, m in zip(ids, mask) if m]
    context = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert context.count("tool: 5") == 2 and group.turns[0]["env_tokens"] == len(ids) - len(sampled)
    assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m) and all(lp == -0.5 for lp, m in zip(lps, mask) if m)
    one = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
    assert sampled == one * 3  # the model's tokens exactly as generated, never re-tokenised
    assert inner.sent[-1] == group.prompt_ids + ids[:len(inner.sent[-1]) - len(group.prompt_ids)]  # prefix continued
    assert sorted(e[2] for e in events if e[1] == 0) == [1, 2, 3]
    batch = make_train_batch([group], load_config("quickstart").loss, 0)
    row = batch.loss_mask[0, len(group.prompt_ids):len(group.prompt_ids) + len(ids)]
    assert row.tolist() == [float(m) for m in mask]
    assert batch.num_tokens == group.num_tokens == sum(map(sum, group.trained_mask))
    from asyncrl.algorithms import mark_versions
    from asyncrl.metrics import token_staleness

    counted = token_staleness([group], 2)  # observation tokens count in no staleness metric
    assert counted["token_staleness_mean"] == 2 * group.num_tokens
    assert sum(counted[f"token_staleness/{k}"] for k in range(4)) + counted["token_staleness/4+"] == group.num_tokens
    marked = mark_versions(batch, [group], 2, lambda b, v: None)  # nor in the importance weight's parts
    assert torch.equal(marked.stale_mask, batch.loss_mask)


def test_tool_calls_are_parsed_from_the_hermes_format():
    text = 'x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>nope</tool_call>'
    calls = parse_tool_calls(text)
    assert calls[0] == ("add", {"a": 1}) and isinstance(calls[1], str) and calls[1].startswith("error")
    assert parse_tool_calls("no call") == []


def test_a_template_without_tool_calls_or_one_that_re_renders_past_turns_is_refused_in_one_line():
    tok = build_tokenizer()
    with pytest.raises(ValueError, match="no tool-call format") as err:
        check_template(tok, THINK_STRIPPING, describe_class(Calculator), "byte")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="re-renders earlier turns") as err:
        check_template(tok, THINK_STRIPPING, describe_class(GuessLetter), "byte")
    assert "\n" not in str(err.value)
    cfg = load_config("guess_letter", model={"chat_template": THINK_STRIPPING}, task={
        "name": "guess_letter"}, groups_per_step=1, group_size=2, eval_every=None)
    with pytest.raises(ValueError, match="re-renders"):
        Controller.from_config(cfg)


def _small(**kw):
    base = dict(groups_per_step=2, group_size=4, eval_every=None)
    base.update(kw)
    return load_config("guess_letter", **base)


def test_guess_letter_trains_multi_turn_with_observations_masked_and_turn_versions():
    ctrl = Controller.from_config(_small(sampler={"name": "windowed", "max_staleness_versions": 1},
                                         loss={"importance_correction": "token"}))
    seen = []
    train = ctrl.policy.train_microbatches
    ctrl.policy.train_microbatches = lambda batch: (seen.append(batch), train(batch))[1]
    for _ in range(12):
        ctrl.tick()
    assert ctrl.trainer_version >= 2 and seen
    rows = ctrl.completions
    assert {"turns", "tool_calls", "env_tokens", "turn_versions"} <= set(rows.columns)
    assert (rows["env_tokens"] > 0).any() and rows["turns"].between(1, 3).all()
    assert all(len(v) == t for v, t in zip(rows["turn_versions"], rows["turns"]))
    turns = ctrl.trace[ctrl.trace.event == "turn"]
    assert len(turns) == rows["turns"].sum() or len(turns) >= rows["turns"].sum()
    assert turns.detail.str.match(r"trajectory \d+ turn \d+").all()
    for batch in seen:  # observation tokens (mask 0 inside a completion) carry no logprob and no loss
        inside = (batch.attention_mask > 0) & (batch.loss_mask == 0)
        assert (batch.gen_logprobs[inside] == 0).all()
    assert any(((b.attention_mask > 0) & (b.loss_mask == 0)).sum() > 0 for b in seen)
    assert ctrl.task.constant_answer_accuracy == 3 / 8
    ctrl.close()


def test_a_stepped_multi_turn_run_is_deterministic_for_a_seed():
    def run():
        ctrl = Controller.from_config(_small())
        for _ in range(8):
            ctrl.tick()
        out = ctrl.completions[["completion", "turn_versions", "reward"]].to_json(), ctrl.metrics["loss"].tolist()
        ctrl.close()
        return out

    assert run() == run()


@pytest.mark.parametrize("mode", ["raise", "hang", "die"])
def test_environment_faults_are_fault_rows_and_the_failing_groups_are_never_trained(mode, monkeypatch):
    from asyncrl.tasks import PromptStream, build_task

    cfg = _small(environment={"workers": 1, "timeout_s": 1.0}, task={"name": "guess_letter", "options": {
        "alphabet": "abcdefghijklmnop"}})  # a secret of 16: one group in 16 fails
    first = PromptStream(build_task(cfg.task).train_prompts, seed=cfg.seed).get(0)  # the first group's secret
    monkeypatch.setenv("GUESS_FAULT", mode)
    monkeypatch.setenv("GUESS_SECRET", first.columns["secret"])
    ctrl = Controller.from_config(cfg, environment_factory=Faulty)
    assert ctrl.cfg.environment.factory.endswith(":Faulty")
    for _ in range(10):
        ctrl.tick()
    trace = ctrl.trace
    faults = trace[(trace.event == "fault") & (trace.group_id == 0)]
    words = {"raise": "raised RuntimeError: broken environment", "hang": "ran past environment.timeout_s=1",
             "die": "worker died"}[mode]
    assert len(faults) >= 2 and faults.detail.str.contains(words).all()
    assert faults.reason.str.startswith("retried").any()
    skip = trace[(trace.event == "skip") & (trace.group_id == 0)]
    assert len(skip) == 1 and "max_dispatch_attempts" in skip.reason.iloc[0]  # given up once, replaced
    assert "replaced by group" in skip.detail.iloc[0]
    bad = {p.id for p in ctrl.task.train_prompts if p.columns["secret"] == first.columns["secret"]}
    assert not ctrl.completions.prompt_id.isin(bad).any()  # never committed, so never trained at reward 0
    assert ctrl.trainer_version >= 1  # the run goes on
    ctrl.close()


def test_in_order_without_lookahead_is_the_plain_turn_by_turn_loop_bit_for_bit():
    from examples.plain_multiturn import plain_multiturn
    from tests.test_controller import assert_same_weights

    cfg = _small(sampler={"name": "in_order", "max_lookahead_versions": 0})
    steps = 3
    ctrl = Controller.from_config(cfg)
    while ctrl.trainer_version < steps:
        ctrl.tick()
    policy, _, history = plain_multiturn(cfg, steps)
    assert_same_weights(ctrl.policy.export_weights(), policy.export_weights())
    assert ctrl.metrics.reward_mean.tolist() == [h["reward_mean"] for h in history]
    assert (ctrl.completions.turns > 1).any()  # multi-turn indeed
    ctrl.close()


def _cli(out, *argv) -> int:
    from asyncrl import cli

    return cli.main(["run", *argv, "--out", str(out), "--quiet", "--no-plot"])


def test_a_trl_style_tool_environment_and_a_text_environment_train_through_the_cli(tmp_path, capsys):
    import json

    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    code = _cli(tmp_path / "tool", "quickstart", "--steps", "2", "--set", "groups_per_step=2", "--set", "group_size=2",
                "--set", "environment.factory=tests.environment_classes:Calculator", "--set", "environment.workers=1",
                "--set", f"model.chat_template={template}", "--set", "model.max_position_embeddings=256",
                "--set", "generation.max_new_tokens=8", "--set", "eval_every=null")
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "tool" / "completions.jsonl").read_text().splitlines()]
    assert rows and all({"turns", "tool_calls", "env_tokens", "turn_versions"} <= set(r) for r in rows)
    assert json.loads((tmp_path / "tool" / "summary.json").read_text())["status"] == "completed"
    code = _cli(tmp_path / "text", "guess_letter", "--steps", "2", "--set", "groups_per_step=2", "--set",
                "group_size=2", "--set", "eval_every=null")
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "text" / "summary.json").read_text())
    assert summary["constant_answer_accuracy"] == 3 / 8 and 0 <= summary["final_eval_accuracy"] <= 1


def test_a_tool_environment_on_a_model_without_a_tool_call_format_exits_2_in_one_line(tmp_path, capsys):
    code = _cli(tmp_path / "run", "quickstart", "--steps", "1", "--set",
                "environment.factory=tests.environment_classes:Calculator")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no tool-call format" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_trajectories_span_versions_and_a_stale_one_is_stopped_mid_trajectory_saying_its_turn():
    cfg = _small(groups_per_step=1, group_size=2, sampler={"name": "windowed", "max_staleness_versions": 0},
                 loss={"importance_correction": "token"})
    ctrl = Controller.from_config(cfg)
    seen_in_flight = False
    for _ in range(8):
        ctrl.rollout_tick()
        frame = ctrl.trajectories()
        assert list(frame.columns[:5]) == ["group_id", "trajectory", "state", "turn", "turn_versions"]
        live = frame[frame.state == "in flight"]
        if len(live):
            seen_in_flight = True
            verdicts = ctrl.explain()
            pending = verdicts[verdicts.state == "pending"].set_index("group_id")
            for gid, turn in live.groupby("group_id").turn.max().items():
                assert pending.loc[gid, "turn"] == turn  # explain() says which turn each in-flight group is on
        ctrl.train_tick()
    assert seen_in_flight
    trace = ctrl.trace
    aborts = trace[trace.event == "abort"]
    assert len(aborts) and aborts.reason.str.contains(r"stopped at turn \d+ of at most 3").all()
    # a trajectory whose turns were generated at different versions says so, token by token
    cfg = _small(groups_per_step=1, group_size=2, sampler={"name": "windowed", "max_staleness_versions": 2},
                 loss={"importance_correction": "token"})
    ctrl = Controller.from_config(cfg)
    for _ in range(12):
        ctrl.tick()
    spanning = [s.rollouts for s in ctrl.buffer.ready_slots()
                if s.rollouts.gen_start_version != s.rollouts.gen_end_version]
    rows = ctrl.completions
    assert rows.turn_versions.map(lambda v: len(set(v)) > 1).any()
    for group in spanning:
        for versions, meta, mask in zip(group.token_versions, group.turns, group.trained_mask):
            assert len(versions) == sum(mask)
            assert sorted(set(versions)) == sorted(set(meta["turn_versions"]))
    assert ctrl.metrics.get("spanning_fraction", 0).max() > 0
    ctrl.close()


def used_add(completions, environments, **columns):
    """A TRL-style reward function that reads the environments (TRL's ``environments=``) and the conversation."""
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
    return [10.0 * env.used for env in environments]


@pytest.mark.parametrize("workers", [0, 1])
def test_reward_functions_get_the_environments_and_the_conversation_and_add_to_the_environment_s_reward(workers):
    from asyncrl.data import GenerationRequest
    from asyncrl.rewards import RewardFunctions

    tok = build_tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    inner = Scripted(tok, [call, "done", "done"])
    prompt = Prompt("add 2 and 3", id="train/0")
    turns = TurnGenerator(inner, describe_class(Calculator), 3, workers, 5.0, 64, tok, lambda gid: prompt,
                          TOOL_TEMPLATE, functions=RewardFunctions([used_add]))
    turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: pytest.fail(why))
    turns.submit([GenerationRequest(3, [1], 2)])
    out = turns.poll() + turns.poll()
    assert out[0].rewards == [1.0 + 10.0, 0.0]  # get_reward + 10 x the tool calls its environment saw
    turns.close()


def test_a_running_controller_overlaps_a_slow_environment_and_accounts_for_every_group(monkeypatch):
    from collections import Counter

    monkeypatch.setenv("GUESS_SLEEP", "0.01")
    cfg = _small(sampler={"name": "windowed", "max_staleness_versions": 1}, loss={"importance_correction": "token"},
                 environment={"workers": 2, "timeout_s": 5.0}, pump_threads=2)
    ctrl = Controller.from_config(cfg, environment_factory=Faulty)
    ctrl.run(4, progress=False)
    assert ctrl.trainer_version == 4
    trace = ctrl.trace
    ends = Counter(trace[trace.event.isin(["select", "evict", "abort", "skip"])].group_id.astype(int))
    for gid in trace[trace.event == "dispatch"].group_id.astype(int):
        alive = int(gid in ctrl.buffer)
        assert ends[gid] + alive == 1, f"group {gid}"  # every admitted group ends exactly once, or is still held
    assert (ctrl.completions.turns >= 1).all()
    ctrl.close()


def test_guess_letter_says_higher_lower_correct_and_its_blind_bar_is_computed():
    from asyncrl.environments.guess_letter import GuessLetterTask

    env = GuessLetter()
    env.reset(secret="c", alphabet="abcdefgh")
    assert env.step("e") == (" lower ", 0.0, False) and env.step("a") == (" higher ", 0.0, False)
    assert env.step(" ") == (" invalid ", 0.0, False) and env.step("c") == (" correct", 1.0, True)
    assert GuessLetterTask("abcdefgh", 3).constant_answer_accuracy == 3 / 8
    assert GuessLetterTask("abcd", 5).constant_answer_accuracy == 1.0
    task = GuessLetterTask()
    assert sorted(p.columns["secret"] for p in task.eval_prompts) == list("abcdefgh")  # each secret once
    assert not {p.id for p in task.eval_prompts} & {p.id for p in task.train_prompts}


class Echo:
    """A text environment: its reset extends the prompt; every reply is long."""

    def reset(self, **row):
        return " (go)"

    def step(self, action):
        return " " + "x" * 40, 0.5, False


def test_reset_extends_the_prompt_observations_are_cut_to_max_env_tokens_and_a_full_context_ends_a_trajectory():
    from asyncrl.data import GenerationRequest

    tok = build_tokenizer()
    inner = Scripted(tok, ["a"] * 20)
    prompt = Prompt("q:", id="train/0")
    turns = TurnGenerator(inner, describe_class(Echo), 5, 0, 5.0, 6, tok, lambda gid: prompt, max_prefix=24)
    turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: pytest.fail(why))
    turns.submit([GenerationRequest(0, [1], 2)])
    out = []
    for _ in range(6):
        out += turns.poll()
    (group,) = out
    assert group.prompt_ids == tok.encode("q: (go)")  # reset's string extends the raw prompt
    for ids, mask, meta in zip(group.completion_ids, group.trained_mask, group.turns):
        observations = "".join("1" if m else "0" for m in mask).split("1")
        assert max(len(o) for o in observations) == 6  # each observation cut to max_env_tokens
        assert len(group.prompt_ids) + len(ids) > 24 and meta["turns"] < 5  # the context ended it, not max_turns
    assert group.rewards == [0.5 * group.turns[0]["turns"]] * 2  # the sum of step's rewards


def test_a_raw_prompt_s_rows_hold_reset_s_text_as_the_model_read_it_and_a_checkpoint_keeps_it():
    from asyncrl.completions import group_rows

    tok = build_tokenizer()
    prompt = Prompt("q:", id="train/0")
    turns = TurnGenerator(Scripted(tok, ["a"] * 20), describe_class(Echo), 2, 0, 5.0, 6, tok, lambda gid: prompt)
    turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: pytest.fail(why))
    (group,) = _play(turns, n=2)
    rows = group_rows(0, prompt, 0, group, None)
    assert [r["prompt"] for r in rows] == ["q: (go)"] * 2  # every trajectory's row: the prompt reset extended
    assert all(tok.encode(r["prompt"]) == group.prompt_ids and r["prompt_tokens"] == len(group.prompt_ids)
               for r in rows)
    assert GroupRollouts(**group.to_json()).prompt_text == "q: (go)"  # a resumed run logs it as the model read it
    single = GroupRollouts(0, tok.encode("q:"), [[1]], [[0.0]], 0, 0, rewards=[0.0])
    assert "prompt_text" not in single.to_json() and group_rows(0, prompt, 0, single, None)[0]["prompt"] == "q:"


def test_turns_go_to_the_vllm_generator_as_token_prefixes():
    from asyncrl.data import GenerationRequest
    from tests.test_vllm_backend import make_gen

    gen, llm = make_gen(seed=1, max_new_tokens=3)
    seen = []
    add = llm.llm_engine.add_request
    llm.llm_engine.add_request = lambda rid, prompt, params: (seen.append(list(prompt["prompt_token_ids"])),
                                                              add(rid, prompt, params))[1]
    tok = build_tokenizer()
    prompt = Prompt("guess:", "c", "train/0", columns={"secret": "c"})
    turns = TurnGenerator(gen, describe_class(GuessLetter), 3, 0, 5.0, 16, tok, lambda gid: prompt)
    turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: pytest.fail(why))
    turns.submit([GenerationRequest(5, tok.encode("guess:"), 2)])
    out = []
    for _ in range(4):
        out += turns.poll()
    (group,) = out
    assert seen[0] == group.prompt_ids  # the first turn: one request for the group, from its prompt
    assert len(seen) == 1 + sum(t["turns"] - 1 for t in group.turns) > 1
    for ids in seen[1:]:  # each later turn: one trajectory's whole token prefix, as held (never re-tokenised)
        assert any(ids == group.prompt_ids + c[:len(ids) - len(group.prompt_ids)] for c in group.completion_ids)
        assert len(ids) > len(group.prompt_ids)


def test_trl_environment_classes_run_unchanged_a_row_less_reset_and_a_tool_named_step():
    from asyncrl.data import GenerationRequest
    from tests.environment_classes import Echo as EchoTool, Increment

    tok = build_tokenizer()
    assert describe_class(Increment).kind == "tool" and describe_class(EchoTool).kind == "tool"
    assert [s["function"]["name"] for s in describe_class(EchoTool).tools] == ["step"]
    assert describe_class(Echo).kind == "text"  # a step returning (observation, reward, done)
    prompt = Prompt("inc", id="train/0", columns={"unused": 1})
    for cls, call, result in ((Increment, '{"name": "increment", "arguments": {"a": 2}}', "tool: 2"),
                              (EchoTool, '{"name": "step", "arguments": {"message": "hi"}}', "tool: hi")):
        inner = Scripted(tok, [f"<tool_call>{call}</tool_call>", "done"])
        turns = TurnGenerator(inner, describe_class(cls), 3, 1, 10.0, 64, tok, lambda gid: prompt, TOOL_TEMPLATE)
        turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: pytest.fail(why))
        turns.submit([GenerationRequest(0, [1], 1)])
        out = turns.poll() + turns.poll()
        assert result in out[0].texts[0] and out[0].turns[0]["tool_calls"] == 1
        turns.close()


def _play(turns, gid=0, n=1, free=False, prompt_ids=(1,)):
    """Submit one group and poll (free turns: a running pump's polls) until it is returned."""
    from asyncrl.data import GenerationRequest

    turns.free_turns = free
    turns.submit([GenerationRequest(gid, list(prompt_ids), n)])
    out = []
    for _ in range(200):
        out += turns.poll(0.05 if free else 0.0)
        if out:
            return out
    pytest.fail("the group never came back")


@pytest.mark.parametrize("workers,free", [(0, False), (1, False), (1, True)])
def test_a_model_calls_only_the_tools_the_environment_advertises_anything_else_is_an_error_it_reads(workers, free):
    from tests.environment_classes import Guarded

    tok = build_tokenizer()
    kind = describe_class(Guarded)
    assert kind.names == ("add",)  # what the template renders: reset, get_reward, private methods are no tools
    names = ["reset", "get_reward", "_poke", "__init__", "__class__", "used", "step", "nope"]
    calls = [f'{{"name": "{name}", "arguments": {{}}}}' for name in names]
    calls += ['{"name": "add", "arguments": [2, 3]}', '{"name": "add", "arguments": "\\"2, 3\\""}',
              '{"name": "add", "arguments": {"a": 2, "b": 3}}']
    inner = Scripted(tok, ["".join(f"<tool_call>{c}</tool_call>" for c in calls), "done"])
    prompt = Prompt("add 2 and 3", id="train/0")
    turns = TurnGenerator(inner, kind, 3, workers, 10.0, 4096, tok, lambda gid: prompt, TOOL_TEMPLATE)
    turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: pytest.fail(why))
    (group,) = _play(turns, free=free)
    turns.close()
    assert group.rewards == [1.0]  # only the real tool ran: no second reset, no get_reward, _poke or __init__
    text = group.texts[0]
    for name in names:
        assert f"tool: error: unknown tool '{name}' (tools: add)\n" in text
    assert "tool: error: the arguments of tool call 'add' must be a JSON object, got list\n" in text
    assert "tool: error: the arguments of tool call 'add' must be a JSON object, got str\n" in text
    assert "tool: 5\n" in text and "poked" not in text
    assert group.turns[0]["tool_calls"] == len(calls)  # every call the model wrote counts, refused ones too (TRL)


def test_the_host_runs_no_method_but_an_advertised_tool_and_no_arguments_but_a_json_object():
    from asyncrl.environments.host import apply
    from tests.environment_classes import Guarded

    instances: dict = {}
    assert apply(Guarded, instances, 0, "make", ({},)).ok
    for method, kwargs in (("reset", {}), ("get_reward", {}), ("_poke", {}), ("__class__", {}), ("used", {}),
                           (None, {}), ("add", [2, 3]), ("add", "2, 3"), ("add", None)):
        got = apply(Guarded, instances, 0, "tool", (method, kwargs))
        assert got.ok and got.value.startswith("error: "), (method, kwargs, got)
    assert apply(Guarded, instances, 0, "tool", ("add", {"a": 2, "b": 3})).value == "5"
    assert apply(Guarded, instances, 0, "reward", ()).value == 1.0  # nothing but add ran
    env = instances[0]
    assert (env.resets, env.poked, env.inits) == (1, 0, 1)


@pytest.mark.parametrize("workers,free", [(0, False), (1, True)])
def test_a_long_observation_is_cut_in_its_content_and_the_conversation_goes_on(workers, free):
    """max_env_tokens cuts a chat observation's content, then the template renders it: the template's text after
    the message (the next ``assistant:`` header) stays whole, so the next turn continues the held tokens."""
    tok = build_tokenizer()
    inner = Scripted(tok, ["a"] * 6)
    prompt = Prompt("q:", id="train/0", messages=[{"role": "user", "content": "q:"}])
    turns = TurnGenerator(inner, describe_class(Echo), 3, workers, 10.0, 6, tok, lambda gid: prompt, TOOL_TEMPLATE)
    turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: pytest.fail(why))
    (group,) = _play(turns, n=2, free=free, prompt_ids=tok.encode("x"))
    turns.close()
    for ids, meta in zip(group.completion_ids, group.turns):
        assert meta["turns"] == 3  # max_turns ended it, not a prefix-check failure
        replies = [x["text"] for x in meta["turn_texts"] if x["role"] == "user"]
        assert replies == ["\nuser:  xx…\nassistant: "] * 2  # 6 content tokens, the header whole
        content = replies[0][len("\nuser: "):-len("\nassistant: ")]
        assert len(tok.encode(content, add_special_tokens=False)) == 6
    assert group.rewards == [1.5, 1.5]  # step ran after each of the 3 turns
    for sent in inner.sent[1:]:  # each later turn: the held tokens exactly, as rendered
        assert any(sent == group.prompt_ids + c[:len(sent) - len(group.prompt_ids)] for c in group.completion_ids)


def test_a_turn_s_tool_results_share_max_env_tokens_of_content():
    from tests.environment_classes import Echo as EchoTool

    tok = build_tokenizer()
    call = '<tool_call>{"name": "step", "arguments": {"message": "abcdefghijklmnop"}}</tool_call>'
    inner = Scripted(tok, [call * 2, "done"])
    turns = TurnGenerator(inner, describe_class(EchoTool), 3, 0, 10.0, 10, tok,
                          lambda gid: Prompt("echo", id="train/0"), TOOL_TEMPLATE)
    turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: pytest.fail(why))
    (group,) = _play(turns)
    (tools,) = [x["text"] for x in group.turns[0]["turn_texts"] if x["role"] == "tool"]
    assert tools == "\ntool: abcdefg…\ntool: \nassistant: "  # 10 content tokens for the turn, the wrapping whole
    assert group.turns[0]["tool_calls"] == 2 and group.rewards == [2.0]
    from asyncrl.environments.trajectory import cut_contents

    assert cut_contents(tok, ["abc", "defghijklm", "nop"], 9) == ["abc", "def…", ""]  # 3 + 6 (3, a 3-byte marker) + 0
    assert cut_contents(tok, ["abcdefgh"], 3) == ["abc"]  # no room for the marker and a token more: cut bare
    assert cut_contents(tok, ["short"], 5) == ["short"]


def test_a_cpu_user_s_tool_environment_runs_on_the_quickstart_model_with_the_tool_chat_template(tmp_path, capsys):
    """docs/environments.md, "Tools on CPU": the one-line refusal names the template that renders tool calls for
    the built-in byte tokenizer, and with it (a file for YAML/--set, the string in Python) the controller builds."""
    from asyncrl.tokenizer import TOOL_CHAT_TEMPLATE

    code = _cli(tmp_path / "run", "quickstart", "--steps", "1", "--set",
                "environment.factory=tests.environment_classes:Calculator")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "asyncrl.tokenizer.TOOL_CHAT_TEMPLATE" in err and len(err.splitlines()) == 1
    cfg = load_config("quickstart", model={"chat_template": TOOL_CHAT_TEMPLATE, "max_position_embeddings": 256},
                      groups_per_step=1, group_size=2, eval_every=None, environment={"workers": 0})
    ctrl = Controller.from_config(cfg, environment_factory=Calculator)
    ctrl.run(1, progress=False)
    rows = ctrl.completions
    assert len(rows) >= 2 and (rows.prompt_tokens > 50).all()  # the tool's schema rendered before the 4-byte prompt
