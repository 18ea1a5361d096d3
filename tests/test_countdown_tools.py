"""The countdown tool task (issue 46's GPU tool task, its CPU-reachable parts): the ``calculate`` tool evaluates
safely, the chat model directory built offline for it lays transcripts out as the turns module does, the
``gpu_countdown_tools`` preset validates, and a run of the task trains through the torch engine with its tool calls
counted and the tool results masked."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.data import GroupRollouts
from asyncrl.environments import check_template, describe_class
from asyncrl.environments.calculator import HINT, MAX_CHARS, Calculator, evaluate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
tool_model = pytest.importorskip("tool_model")


@pytest.mark.parametrize("expression, value", [
    ("(25 - 5) * 3", "60"), ("7 / 2", "3.5"), ("1/3", "0.3333333333"), ("-(2 + 3)", "-5"), ("0.1 + 0.2", "0.3"),
    (" 12 ", "12"), (12, "12")])
def test_calculate_evaluates_arithmetic_exactly(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('true')", "found Call"), ("x", "found Name"), ("(1).real", "found Attribute"),
    ("9 ** 9 ** 9", "found **"), ("2 ** 3", "found **"), ("7 // 2", "found //"), ("1 < 2", "found Compare"),
    ("[1, 2]", "found List"), ("'a' * 3", "found Constant"), ("True + 1", "found Constant"),
    ("1 / 0", "division by zero"), ("(1 + 2", "not an arithmetic expression"), ("", "not an arithmetic expression"),
    ("9" * 12 + " * " + "9" * 12, "too large"), ("1" + " + 1" * (MAX_CHARS // 4), "longer than"), (None, "must be text"),
    ("(" * 90 + "1" + ")" * 90, None)])
def test_calculate_refuses_names_attributes_powers_and_huge_values_with_an_error_string(expression, why):
    start = time.perf_counter()
    out = evaluate(expression)
    assert time.perf_counter() - start < 0.5  # bounded: never a huge power or a long computation
    if why is None:  # deep nesting within the size limit: evaluated or refused, never raised
        assert out == "1" or out.startswith("error:")
        return
    assert out.startswith("error: ") and why in out, out


def test_the_calculator_is_a_trl_style_tool_environment_whose_reset_extends_the_prompt():
    kind = describe_class(Calculator)
    assert kind.kind == "tool" and kind.names == ("calculate",) and not kind.has_reward
    (schema,) = kind.tools
    params = schema["function"]["parameters"]
    assert params["properties"]["expression"]["type"] == "string" and params["required"] == ["expression"]
    env = Calculator()
    assert env.reset(nums=[3, 5, 2], target=16, prompt="ignored") == HINT
    assert env.calculate("(3 + 5) * 2") == "16" and env.calculate("3 ** 5").startswith("error")
    assert env.calls == [("(3 + 5) * 2", "16"), ("3 ** 5", env.calls[1][1])]


def test_the_tool_chat_template_renders_tools_and_keeps_past_turns():
    from asyncrl.tokenizer import TOOL_CHAT_TEMPLATE, build_tokenizer

    tok = build_tokenizer(512)
    assert check_template(tok, TOOL_CHAT_TEMPLATE, describe_class(Calculator), "tool byte model") == "hermes"
    text = tok.apply_chat_template([{"role": "user", "content": "q"}], tools=tool_model.tools(), tokenize=False,
                                   add_generation_prompt=True, chat_template=TOOL_CHAT_TEMPLATE)
    assert "calculate(expression)" in text and "<tool_call>" in text and text.endswith("assistant: ")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool_model")
    info = tool_model.build_tool_model_dir(path, "tiny", steps=3, batch=2, rows=8, probe=2, device="cpu")
    return path, info


def test_the_chat_model_directory_is_built_offline_and_loads_as_the_run_loads_it(tiny_dir):
    import json

    from asyncrl.backends.hf import check_model, load_tokenizer
    from asyncrl.config import ModelConfig

    path, info = tiny_dir
    assert json.loads((path / "tool_model.json").read_text()) == info
    assert info["steps"] == 3 and info["loss_first"] > 0 and 0 <= info["probe_tool_call_rate"] <= 1
    model_cfg = ModelConfig(hf_path=str(path))
    tok = load_tokenizer(model_cfg)
    check_model(model_cfg, tok)  # the tokenizer fits the model's vocabulary
    assert len(tok) == 512 and model_cfg.max_position_embeddings == 1024
    assert check_template(tok, None, describe_class(Calculator), str(path)) == "hermes"  # its own template
    row = {"nums": [3, 5, 2], "target": 16, "solution": "(3 + 5) * 2"}
    import random

    after = tool_model.turns(row, random.Random(0))
    made = tool_model.encode(tool_model.tool_tokenizer(), tool_model.prompt_messages(row), after, tool_model.tools())
    assert tool_model.encode(tok, tool_model.prompt_messages(row), after, tool_model.tools()) == made


def test_transcripts_are_laid_out_token_for_token_as_the_turns_module_lays_a_trajectory_out():
    """What the warm-start trains on is what the RL run's trajectories hold: the same ids and the same mask."""
    from asyncrl.data import GenerationRequest
    from asyncrl.prompts import Prompt
    from asyncrl.turns import TurnGenerator
    from tests.test_environments import Scripted

    tok = tool_model.tool_tokenizer()
    row = {"nums": [70, 22, 33], "target": 81, "solution": "(70 - 22) + 33"}
    import random

    after = tool_model.turns(row, random.Random(1))
    model_turns = [m["content"] for m in after if m["role"] == "assistant"]
    assert len(model_turns) == 3 and after[1]["content"] == "125"  # a wrong try, the solution, the answer
    ids, mask = tool_model.encode(tok, tool_model.prompt_messages(row), after, tool_model.tools())
    question = tool_model.prompt_messages(row)[0]["content"].removesuffix(f"\n\n{HINT}")
    prompt = Prompt("", id="train/0", messages=[{"role": "user", "content": question}],
                    columns={"nums": row["nums"], "target": row["target"]})
    turns = TurnGenerator(Scripted(tok, model_turns), describe_class(Calculator), 3, 0, 5.0, 64, tok,
                          lambda gid: prompt)
    turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: pytest.fail(why))
    turns.submit([GenerationRequest(0, [1], 1)])
    out = []
    for _ in range(4):
        out += turns.poll()
    (group,) = out
    assert group.prompt_ids + group.completion_ids[0] == ids
    assert [0] * len(group.prompt_ids) + group.trained_mask[0] == mask
    assert group.turns[0]["tool_calls"] == 2 and group.turns[0]["turns"] == 3


def assert_observations_masked(batches, groups) -> int:
    """Every row of the train ``batches`` is a trajectory of ``groups`` (the ``GroupRollouts`` the generator
    returned): loss mask 0 over its prompt, then exactly its ``trained_mask`` (0 at the tool results), and a
    generation logprob of 0 at the tool results. Returns the tool-result tokens the batches held."""
    layout = {tuple(g.prompt_ids + c): (len(g.prompt_ids), m) for g in groups
              for c, m in zip(g.completion_ids, g.trained_mask)}
    seen = 0
    for b in batches:
        for row in range(b.input_ids.shape[0]):
            n = int(b.attention_mask[row].sum())
            start, mask = layout[tuple(b.input_ids[row, :n].tolist())]
            assert float(b.loss_mask[row, :start].sum()) == 0
            assert b.loss_mask[row, start:n].tolist() == [float(x) for x in mask]
            context = [start + i for i, x in enumerate(mask) if not x]
            assert all(float(b.gen_logprobs[row, i]) == 0.0 for i in context)
            seen += len(context)
    return seen


class CountdownScript:
    """A generation backend that plays the countdown tool task by rule: its first turn calls ``calculate`` with
    the sum of the prompt's numbers, its next turn answers that sum (right only when it is the target)."""

    def __init__(self, tok):
        self.tok, self.queue, self.version = tok, [], 0

    def submit(self, requests):
        self.queue += list(requests)

    def num_inflight(self):
        return len(self.queue)

    def abort(self, ids):
        self.queue = [r for r in self.queue if r.group_id not in set(ids)]
        return list(ids)

    def load_weights(self, weights, version):
        self.version = version

    def poll(self, timeout=0.0):
        out = []
        for r in self.queue:
            text = self.tok.decode(r.prompt_ids, skip_special_tokens=True)
            nums = re.search(r"Using the numbers \[([\d, ]+)\]", text).group(1).split(", ")
            sum_ = " + ".join(nums)
            turn = f"<answer>{sum_}</answer>" if "\ntool: " in text else tool_model.call(sum_)
            ids = [self.tok.encode(turn, add_special_tokens=False) + [self.tok.eos_token_id] for _ in range(r.n)]
            out.append(GroupRollouts(r.group_id, list(r.prompt_ids), ids, [[-1.0] * len(c) for c in ids],
                                     self.version, self.version, ["stop"] * r.n))
        self.queue = []
        return out

    def close(self):
        pass


def test_the_tool_task_trains_through_the_torch_engine_with_tool_calls_counted_and_tool_results_masked(tiny_dir):
    from asyncrl import Controller
    from asyncrl.backends import build_backends
    from asyncrl.rewards.builtin import countdown_score
    from asyncrl.tasks import build_task

    path, _ = tiny_dir
    preset = load_config("gpu_countdown_tools")
    cfg = load_config("quickstart", task={"name": "countdown", "options": {
        **preset.task.options, "train_size": 12, "eval_size": 2}}, environment=preset.environment.model_dump(),
        reward=preset.reward.model_dump(mode="json"), model={"hf_path": str(path), "dtype": "float32"},
        generation={"max_new_tokens": preset.generation.max_new_tokens}, groups_per_step=2, group_size=2,
        eval_every=None, sampler={"name": "in_order", "max_lookahead_versions": 0}, loss={"entropy_coef": 0.0})
    policy, generator, tok = build_backends(cfg)
    generator.close()
    ctrl = Controller(cfg, build_task(cfg.task), policy, CountdownScript(tok), tok)
    seen, groups = [], []
    train, poll = ctrl.policy.train_microbatches, ctrl.generator.poll
    ctrl.policy.train_microbatches = lambda batch: (seen.append(batch), train(batch))[1]
    ctrl.generator.poll = lambda *a, **k: (lambda out: (groups.extend(out), out)[1])(poll(*a, **k))
    while ctrl.trainer_version < 2:
        ctrl.tick()
    rows = ctrl.completions
    assert (rows.turns == 2).all() and (rows.tool_calls == 1).all() and (rows.env_tokens > 0).all()
    targets = {p.id: p.columns["target"] for p in ctrl.task.train_prompts}
    for r in rows.itertuples():  # the reward is countdown's grade of the final answer, through reward.funcs
        text = r.completion if isinstance(r.completion, str) else "".join(m["content"] for m in r.completion)
        assert "<tool_call>" in text and "tool: " in tok.decode(tok.encode(text)) or "tool" in str(r.completion)
        nums = [int(n) for n in re.search(r"<answer>([\d + ]+)</answer>", text).group(1).split(" + ")]
        assert r.reward == countdown_score(f"<answer>{' + '.join(map(str, nums))}</answer>", nums,
                                           targets[r.prompt_id]) == float(sum(nums) == targets[r.prompt_id])
    assert seen and assert_observations_masked(seen, groups) == sum(rows.env_tokens)  # every trained row checked
    ctrl.close()


def test_the_gpu_preset_validates_and_names_the_tool_task():
    cfg = load_config("gpu_countdown_tools")
    assert (cfg.generation.backend, cfg.trainer.backend) == ("vllm", "megatron")
    assert cfg.environment.factory == "asyncrl.environments.calculator:Calculator" and cfg.environment.max_turns == 3
    assert cfg.generation.enable_prefix_caching and cfg.generation.weight_update == "drain"
    assert cfg.task.name == "countdown" and cfg.reward.funcs == ["countdown"]
    assert cfg.sampler.name == "weight_fifo" and cfg.model.hf_path is None
    shape = tool_model.SHAPES["small"]
    assert cfg.model.max_position_embeddings == shape["max_position_embeddings"]
    assert cfg.model.vocab_size == shape["vocab_size"]
    # a prompt with the tools and the hint, then max_turns turns of max_new_tokens with short tool results between
    # them (a number, ~20 tokens as rendered), fit the context; an error message fits max_env_tokens whole
    row = {"nums": [99, 98, 97, 96], "target": 100}
    tok = tool_model.tool_tokenizer()
    assert len(tok.encode("\ntool: " + evaluate("(1).real") + "\nassistant: ")) < cfg.environment.max_env_tokens
    prompt = tok.apply_chat_template(tool_model.prompt_messages(row), tools=tool_model.tools(), tokenize=False,
                                     add_generation_prompt=True)
    turns = cfg.environment.max_turns * cfg.generation.max_new_tokens
    assert len(tok.encode(prompt, add_special_tokens=False)) + turns + 2 * 32 <= cfg.model.max_position_embeddings


def test_the_agents_gpu_bench_reads_vllm_s_prefix_cache_counters_and_derives_its_ratios(tmp_path):
    """benchmarks/bench_agents_gpu.py's bookkeeping without a GPU: vLLM's counters (or none when its stats are
    off), each pass's hit rate, the ratios in meta.json, and the run directory."""
    import json
    from types import SimpleNamespace

    import pandas as pd

    bench = pytest.importorskip("bench_agents_gpu")
    from record import load, save

    counters = {"vllm:prefix_cache_queries": 1000, "vllm:prefix_cache_hits": 600}

    class LLM:
        def get_metrics(self):
            return [SimpleNamespace(name=k, value=v, labels={}) for k, v in counters.items()] + [
                SimpleNamespace(name="vllm:num_requests_running", value=3, labels={})]

    class Off:
        def get_metrics(self):
            raise AssertionError("Stat logging disabled")

    before = bench.prefix_cache_counts(SimpleNamespace(llm=LLM()))
    counters.update({"vllm:prefix_cache_queries": 3000, "vllm:prefix_cache_hits": 2100})
    delta = bench.cache_delta(before, bench.prefix_cache_counts(SimpleNamespace(llm=LLM())))
    assert delta == {"prefix_cache_queries": 2000, "prefix_cache_hits": 1500, "prefix_cache_hit_rate": 0.75}
    assert bench.prefix_cache_counts(SimpleNamespace(llm=Off())) is None
    assert bench.prefix_cache_counts(SimpleNamespace()) is None  # no vLLM engine (the torch generator)
    assert bench.cache_delta(None, None)["prefix_cache_hit_rate"] != bench.cache_delta(None, None)["prefix_cache_hit_rate"]
    multi = GroupRollouts(1, [1], [[5, 6, 7, 8], [5, 6]], [[0.0] * 4, [0.0] * 2], 0, 0, trained_mask=[[1, 0, 0, 1], [1, 1]],
                          turns=[{"turns": 2, "tool_calls": 1, "env_tokens": 2}, {"turns": 1, "tool_calls": 0,
                                                                               "env_tokens": 0}])
    single = GroupRollouts(2, [1], [[5, 6, 7], [5]], [[0.0] * 3, [0.0]], 0, 0)
    rows = [bench.generator_row("multi_turn", [multi], 2.0, 10.0, delta),
            bench.generator_row("single_turn", [single], 1.0, 8.0, bench.cache_delta(before, before)),
            {"part": "controller", "mode": "sync", "steps": 6, "steps_per_s": 0.5},
            {"part": "controller", "mode": "async", "steps": 6, "steps_per_s": 0.6}]
    assert rows[0]["sampled_tokens"] == 4 and rows[0]["tokens_per_s"] == 2.0 and rows[0]["turns_mean"] == 1.5
    assert rows[1]["sampled_tokens"] == 4 and rows[1]["tokens_per_s"] == 4.0 and rows[1]["tool_calls_mean"] == 0
    frame = pd.DataFrame(rows)
    results = bench.results_of(frame)
    assert results["multi_over_single_tokens_per_s"] == 0.5 and results["async_over_sync_steps_per_s"] == 1.2
    assert results["multi_over_single_engine_tokens_per_s"] == 1.25 and results["prefix_cache_hit_rate_multi_turn"] == 0.75
    assert results["prefix_cache_hit_rate_sync"] is None  # no counts there: null, not NaN, in meta.json
    assert "multi_turn" in bench.table(frame) and "steps_per_s" in bench.table(frame)
    out = save("bench_agents_gpu", frame, results, out=tmp_path / "run")
    saved, back = load(out)
    assert saved["bench"] == "bench_agents_gpu" and saved["results"] == json.loads(json.dumps(results))
    assert list(back["mode"]) == ["multi_turn", "single_turn", "sync", "async"]
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "rows.csv"]
