"""What a TRL user passes as ``reward_funcs`` carries over: function objects with weights (``reward.weights`` or
``reward_weights=``), and reward models (a sequence-classification model with one label, as a directory in the
config or as an object with its tokenizer), scored in the reward workers exactly as a direct forward scores them."""

from __future__ import annotations

import os

import pytest
import torch

from asyncrl.rewards import RewardBatch, RewardConfig, RewardFunctions, RewardRunner
from asyncrl.tokenizer import build_tokenizer
from tests import reward_functions as rf
from tests.faults import small_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def stepped(cfg, steps=2, **kwargs):
    from asyncrl import Controller

    ctrl = Controller.from_config(cfg, **kwargs)
    while ctrl.trainer_version < steps:
        ctrl.tick()
    return ctrl


# ------------------------------------------------------------------------------------ reward objects with weights
def test_reward_objects_take_weights_from_the_config_or_reward_weights():
    for kwargs, cfg in (({}, small_config(reward={"weights": [1.0, 0.5]})),
                        ({"reward_weights": [1.0, 0.5]}, small_config())):
        ctrl = stepped(cfg, reward_funcs=[rf.first_char, rf.length], **kwargs)
        try:
            rows = ctrl.completions
            assert {"reward/first_char", "reward/length"} <= set(rows.columns)
            assert rows.reward.tolist() == (rows["reward/first_char"] + 0.5 * rows["reward/length"]).tolist()
            assert ctrl.cfg.reward.weights == [1.0, 0.5]
            assert rows["reward/length"].abs().sum() > 0  # the weight had something to weigh
        finally:
            ctrl.close()


def test_reward_weights_are_checked_against_the_functions_given():
    from asyncrl import Controller

    with pytest.raises(ValueError, match=r"^reward.weights has 3 values for 2 functions \['first_char', 'length'\]"):
        Controller.from_config(small_config(reward={"weights": [1, 2, 3]}), reward_funcs=[rf.first_char, rf.length])
    with pytest.raises(ValueError, match=r"^reward.weights has 1 values for 2 functions"):
        Controller.from_config(small_config(), reward_funcs=[rf.first_char, rf.length], reward_weights=[1.0])
    with pytest.raises(ValueError, match=r"^reward.weights \[2.0\] has 1 values for 0 reward functions"):
        Controller.from_config(small_config(reward={"weights": [2.0]}))  # the task's own reward: nothing to weigh
    with pytest.raises(ValueError, match="reward weights given twice"):
        Controller.from_config(small_config(reward={"weights": [1, 2]}), reward_funcs=[rf.first_char, rf.length],
                               reward_weights=[2, 1])


# ------------------------------------------------------------------------------------------------- reward models
def reward_model_dir(path, family="llama", seed=0):
    """A tiny random sequence-classification model with one label and the byte tokenizer (a chat template)."""
    from transformers import (LlamaConfig, LlamaForSequenceClassification, Qwen2Config,
                              Qwen2ForSequenceClassification)

    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    kw = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=256, num_labels=1, pad_token_id=tok.pad_token_id,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config_cls, model_cls = ((Qwen2Config, Qwen2ForSequenceClassification) if family == "qwen2"
                             else (LlamaConfig, LlamaForSequenceClassification))
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return model, tok


def direct(model, tok, text: str, templated: bool = False) -> float:
    """What the reward model says of one text: one forward, no padding, its one logit (a templated text is
    encoded as apply_chat_template(tokenize=True) encodes it: nothing added again)."""
    with torch.no_grad():
        ids = tok(text, return_tensors="pt", add_special_tokens=not templated)
        return float(model(**ids).logits[0, 0])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_reward_model_directory_scores_in_a_worker_as_a_direct_forward(tmp_path, family):
    model, tok = reward_model_dir(tmp_path / "my-rm", family)
    functions = RewardConfig(funcs=[{"model": str(tmp_path / "my-rm"), "batch_size": 2}, rf.length],
                             weights=[2.0, 1.0]).functions()
    assert functions.names == ["my-rm", "length"]
    completions = ["a", "bcd efg", "hello there", ""]  # different lengths: padded in a batch of 2
    prompts = ["cab=", "x=", "longer prompt=", "q="]
    conversational = [[{"role": "user", "content": p}] for p in prompts]
    chat = [[{"role": "assistant", "content": c}] for c in completions]
    r = RewardRunner(functions, workers=1, timeout_s=60)
    try:
        r.submit(0, RewardBatch(prompts, completions, [[1]] * 4))
        r.submit(1, RewardBatch(conversational, chat, [[1]] * 4))
        plain, conv = r.wait([0, 1])
        assert r.worker_pids and os.getpid() not in r.worker_pids
    finally:
        r.close()
    assert plain.bug is None and plain.problem is None, plain
    want = [direct(model, tok, p + c) for p, c in zip(prompts, completions)]
    torch.testing.assert_close(plain.parts["my-rm"], want, atol=1e-5, rtol=0)
    assert plain.rewards == pytest.approx([2 * s + len(c) for s, c in zip(plain.parts["my-rm"], completions)])
    want_chat = [direct(model, tok, f"<user>{p}<assistant>{c}", templated=True) for p, c in zip(prompts, completions)]
    ids = tok.apply_chat_template(conversational[0] + chat[0], tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        assert conv.parts["my-rm"][0] == pytest.approx(float(model(input_ids=torch.tensor([ids])).logits[0, 0]),
                                                       abs=1e-5)
    torch.testing.assert_close(conv.parts["my-rm"], want_chat, atol=1e-5, rtol=0)
    assert want_chat != want  # the chat template was used


def test_a_reward_model_object_scores_a_run_through_from_config(tmp_path):
    from transformers import AutoModelForSequenceClassification

    _, tok = reward_model_dir(tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()  # as a TRL user has it
    cfg = small_config(reward={"workers": 1, "weights": [1.0, 0.0]})
    ctrl = stepped(cfg, reward_funcs=[model, rf.length], reward_processing_classes=[tok, None])
    try:
        rows = ctrl.completions
        assert "reward/rm" in rows.columns and len(rows) >= 8
        for prompt, completion, score in zip(rows.prompt, rows.completion, rows["reward/rm"]):
            assert score == pytest.approx(direct(model, tok, prompt + completion), abs=1e-5)
        assert rows.reward.tolist() == rows["reward/rm"].tolist()
        assert ctrl.cfg.reward.model_dump(mode="json")["funcs"][0] == {"model": str(tmp_path / "rm"), "batch_size": 32}
    finally:
        ctrl.close()
    # (model, tokenizer) as TRL's pair, inline this time: the same scores
    functions = RewardFunctions([(model, tok)])
    assert functions.names == ["rm"]
    out = functions.funcs[0](prompts=["ab="], completions=["c"])
    assert out == pytest.approx([direct(model, tok, "ab=c")], abs=1e-6)


def test_a_reward_model_that_is_not_one_is_one_line(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    with pytest.raises(ValueError, match=r"reward model '.*nothing' is not a directory"):
        RewardConfig(funcs=[{"model": str(tmp_path / "nothing")}])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['size'\]"):
        RewardConfig(funcs=[{"model": str(tmp_path), "size": 3}])
    LlamaForSequenceClassification(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=16,
                                               num_hidden_layers=1, num_attention_heads=2)).save_pretrained(
        str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"reward model '.*two' has 2 labels"):
        RewardConfig(funcs=[{"model": str(tmp_path / "two")}])


def test_an_accuracy_function_is_checked_against_the_functions_given():
    from asyncrl import Controller

    ctrl = Controller.from_config(small_config(reward={"accuracy": "first_char"}), reward_funcs=[rf.first_char])
    assert ctrl.cfg.reward.accuracy == "first_char"
    ctrl.close()
    with pytest.raises(ValueError, match=r"reward.accuracy 'nope' is not one of the reward functions \['first_char'\]"):
        Controller.from_config(small_config(reward={"accuracy": "nope"}), reward_funcs=[rf.first_char])
    with pytest.raises(ValueError, match=r"reward.accuracy 'nope' names a function, and no reward function is named"):
        Controller.from_config(small_config(reward={"accuracy": "nope"}))
