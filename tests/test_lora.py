"""LoRA on the torch engine (``model.lora``, peft): only the adapter trains (its parameters alone have gradients and
optimizer state), the generator gets the merged weights each step, a checkpoint holds the adapter and names the
base, ``asyncrl export`` writes the merged model or (``--adapter``) the adapter that peft loads, and a resume is
exact. The built-in model is a transformers Llama, so it takes the same path as a ``model.hf_path`` directory."""

from __future__ import annotations

import os

import pytest
import torch

from tests.faults import small_config

peft = pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def stepped(ctrl, steps):
    while ctrl.trainer_version < steps:
        ctrl.tick()
    return ctrl


def test_only_the_adapter_trains_and_the_generator_gets_the_merged_weights():
    from asyncrl import Controller
    from asyncrl.backends.lora import adapted_layers

    cfg = small_config(model={"lora": {"rank": 4}})
    assert cfg.model.lora.alpha == 8.0 and cfg.model.lora.dropout == 0.0  # defaults: alpha 2 x rank, no dropout
    base = Controller.from_config(small_config())
    initial = base.policy.export_weights()
    base.close()
    with Controller.from_config(cfg) as ctrl:
        policy = ctrl.policy
        layers = adapted_layers(policy.model)
        assert {name.rsplit(".", 1)[-1] for name in layers} == LINEAR  # every linear layer of the blocks
        assert len(layers) == len(LINEAR) * cfg.model.num_hidden_layers  # and not the output layer
        adapter = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
        assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
        assert len(adapter) == 2 * len(layers)
        assert sum(p.numel() for p in adapter.values()) == sum(
            4 * (layer.in_features + layer.out_features) for layer in layers.values())
        assert {id(p) for p in policy.params} == {id(p) for p in adapter.values()}
        assert {k: torch.equal(v, initial[k]) for k, v in policy.export_weights().items()} == \
            {k: True for k in initial}  # version 0: lora_B is zero, the merged model is the base
        stepped(ctrl, 2)
        # gradients and optimizer state: the adapter's only
        frozen = [p for p in policy.model.parameters() if not p.requires_grad]
        assert frozen and all(p.grad is None for p in frozen)
        assert all(p.grad is not None for p in policy.params)
        state = policy.optimizer.state_dict()
        assert len(state["state"]) == len(adapter)
        assert sum(s["exp_avg"].numel() for s in state["state"].values()) == sum(p.numel() for p in adapter.values())
        # the base did not move; the merged weights did, and the generator holds them
        merged = policy.export_weights()
        assert set(merged) == set(initial)
        for name, tensor in policy.model.state_dict().items():
            if ".base_layer." in name:
                assert torch.equal(tensor, initial[name.replace(".base_layer.", ".")]), name
        assert not torch.equal(merged["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])
        assert torch.equal(merged["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
        held = ctrl.generator.model.state_dict()
        assert all(torch.equal(held[k], v) for k, v in merged.items())
        assert ctrl.generator.version == 2
        # a kept version is the adapter's copy (the base is the same in every version), and it scores as before
        from tests.test_export import _batch

        batch, before = _batch(), policy.logprobs(_batch())
        assert policy.keep_versions([2], 2) == [2]
        assert policy.kept_bytes() == sum(p.numel() * p.element_size() for p in adapter.values())
        with torch.no_grad():  # what an optimizer step does to the adapter
            for p in policy.params:
                p.add_(0.01)
        assert torch.equal(policy.logprobs_at(batch, 2, 3), before)
        assert not torch.equal(policy.logprobs(batch), before)


def test_lora_config_mistakes_are_one_line():
    from asyncrl import Controller

    with pytest.raises(ValueError, match="rank"):
        small_config(model={"lora": {"rank": 0}})
    with pytest.raises(ValueError, match=r"model.lora.target_modules \['nothing_here'\]"):
        Controller.from_config(small_config(model={"lora": {"target_modules": ["nothing_here"]}}))
    with pytest.raises(ValueError, match=r"model.lora trains an adapter on the torch engine; trainer.backend is "
                                         r"'megatron'"):
        from asyncrl.backends import build_backends

        build_backends(small_config(model={"lora": {}}, trainer={"backend": "megatron"}))


def test_a_lora_run_checkpoints_the_adapter_exports_merged_or_alone_and_resumes_exactly(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from asyncrl import Controller, cli
    from tests.test_model_families import write_model_dir

    write_model_dir(tmp_path / "base", "llama")  # untied output layer: it stays the base's
    lora = {"rank": 2, "alpha": 3.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}
    cfg = small_config(model={"hf_path": str(tmp_path / "base"), "lora": lora}, groups_per_step=2)
    with Controller.from_config(cfg) as ctrl:
        stepped(ctrl, 2)
        saved = ctrl.save(tmp_path / "ckpt")
        stepped(ctrl, 4)
        want_loss, want = ctrl.metrics.loss.tolist(), ctrl.policy.export_weights()
        out = ctrl.save(tmp_path / "ckpt4")
    tensors = torch.load(saved / "tensors.pt", weights_only=True)
    assert tensors["policy"]["base"] == str(tmp_path / "base")
    assert tensors["policy"]["model"] and all(".lora_" in k for k in tensors["policy"]["model"])
    assert "weights" not in tensors["generator"]  # no merged copy: the adapter is the checkpoint
    with Controller.restore(saved) as again:
        stepped(again, 4)
        assert again.metrics.loss.tolist() == want_loss
        assert all(torch.equal(again.policy.export_weights()[k], v) for k, v in want.items())

    capsys.readouterr()
    assert cli.main(["export", str(out), str(tmp_path / "merged")]) == 0, capsys.readouterr().err
    assert cli.main(["export", str(out), str(tmp_path / "adapter"), "--adapter"]) == 0, capsys.readouterr().err
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True).state_dict()
    assert all(torch.equal(merged[k], v) for k, v in want.items() if k in merged) and set(merged) <= set(want)
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), local_files_only=True)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    for name, tensor in want.items():
        torch.testing.assert_close(adapted[name], tensor, atol=1e-6, rtol=0)
    assert not torch.equal(adapted["model.layers.0.self_attn.q_proj.weight"],
                           AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).state_dict()[
                               "model.layers.0.self_attn.q_proj.weight"])
    capsys.readouterr()
    assert cli.main(["export", str(out), str(tmp_path / "merged")]) == 2  # not empty: refused
    plain = Controller.from_config(small_config(groups_per_step=2))
    plain.save(tmp_path / "plain")
    plain.close()
    assert cli.main(["export", str(tmp_path / "plain"), str(tmp_path / "y"), "--adapter"]) == 2
    assert "has no adapter" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_with_dropout_a_logprob_is_the_policy_s_without_it():
    from asyncrl import Controller
    from tests.test_export import _batch

    with Controller.from_config(small_config(model={"lora": {"rank": 4, "dropout": 0.5}})) as ctrl:
        stepped(ctrl, 2)  # lora_B is no longer zero: dropout on the adapter's input changes the output
        policy, batch = ctrl.policy, _batch()
        first = policy.logprobs(batch)
        assert torch.equal(first, policy.logprobs(batch)) and policy.model.training
        with torch.no_grad():
            noisy = policy.model(input_ids=batch.input_ids).logits
            again = policy.model(input_ids=batch.input_ids).logits
        assert not torch.equal(noisy, again)  # the training forward is random: not the previous policy's
        assert ctrl.metrics.loss.notna().all()
