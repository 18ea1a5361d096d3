"""``trainer.gradient_checkpointing``: the torch engine recomputes each decoder layer in the backward pass
(transformers' ``gradient_checkpointing_enable``, torch.utils.checkpoint) and gets the same loss and gradients as
without, for the built-in model and a Hugging Face directory alike. (Its memory: benchmarks/bench_gradient_checkpointing.py.)"""

from __future__ import annotations

import pytest
import torch

from asyncrl.algorithms import GRPOLoss, LossConfig, make_train_batch
from asyncrl.backends.torch import TorchPolicy
from asyncrl.config import ModelConfig, TorchTrainerConfig, load_config
from asyncrl.data import GroupRollouts
from asyncrl.tokenizer import build_tokenizer


def _groups(seed=0, n=3, G=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid in range(n):
        comps = [torch.randint(0, 256, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(G)]
        out.append(GroupRollouts(gid, [257, 97 + gid, 61], comps, [[-2.0] * len(c) for c in comps], 0, 0,
                                 rewards=torch.rand(G, generator=g).tolist()))
    return out


def _one_step(model_cfg, checkpointing, tok=None):
    loss = GRPOLoss(LossConfig(entropy_coef=0.01, kl="k3", kl_coef=0.05))
    policy = TorchPolicy(model_cfg, TorchTrainerConfig(lr=1e-3, gradient_checkpointing=checkpointing), loss, seed=0,
                         tokenizer=tok)
    batch = make_train_batch(_groups(), loss.cfg, pad_id=256)
    saved = []  # bytes the forward keeps for backward outside checkpointed layers (those keep only their inputs)
    policy.begin_train_step()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = policy.train_microbatches(batch)
    out["saved_bytes"] = sum(saved)
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    metrics = policy.finish_train_step()
    return out, grads, metrics, policy


@pytest.mark.parametrize("where", ["built-in", "hf_path"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(where, tmp_path):
    model_cfg = ModelConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2)
    tok = None
    if where == "hf_path":
        from tests.test_model_families import write_model_dir

        write_model_dir(tmp_path / "qwen3", "qwen3")
        model_cfg, tok = ModelConfig(hf_path=str(tmp_path / "qwen3")), build_tokenizer()
    plain_out, plain_grads, plain_m, _ = _one_step(model_cfg, False, tok)
    ckpt_out, ckpt_grads, ckpt_m, policy = _one_step(model_cfg, True, tok)
    assert ckpt_out["saved_bytes"] < 0.5 * plain_out["saved_bytes"]  # the layers' activations were not kept
    assert ckpt_out["loss_sum"] == pytest.approx(plain_out["loss_sum"], rel=1e-5, abs=1e-6)
    assert ckpt_m["loss"] == pytest.approx(plain_m["loss"], rel=1e-5, abs=1e-6)
    assert ckpt_m["grad_norm"] == pytest.approx(plain_m["grad_norm"], rel=1e-5)
    assert plain_grads.keys() == ckpt_grads.keys() and len(plain_grads) > 5
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_is_a_trainer_knob_of_the_model_engines():
    assert load_config("grpo", trainer={"gradient_checkpointing": True}).trainer.gradient_checkpointing
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        load_config("quickstart", trainer={"backend": "simulated", "gradient_checkpointing": True},
                    generation={"backend": "simulated"})



def test_megatron_recompute_is_refused_off_cuda_in_one_line():
    """Megatron-core's recompute restores the CUDA RNG state (a CPU step fails deep inside it): refused up front."""
    with pytest.raises(ValueError, match="trainer.gradient_checkpointing with the Megatron trainer needs a CUDA"):
        load_config("grpo", trainer={"backend": "megatron", "gradient_checkpointing": True})
    cfg = load_config("grpo", device="cuda", trainer={"backend": "megatron", "gradient_checkpointing": True})
    assert cfg.trainer.gradient_checkpointing and cfg.trainer.device == "cuda"
