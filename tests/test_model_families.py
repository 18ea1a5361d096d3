"""Model families in every CPU engine: Qwen3 (per-head q/k RMSNorm, a ``head_dim`` not tied to hidden / heads) and
Llama 3 (its ``llama3`` rope scaling) beside Llama and Qwen2, as Hugging Face directories given as ``model.hf_path``.

The Megatron engine maps their weights (``asyncrl/backends/megatron_weights.py``) and must compute the logits
transformers computes; the torch engines load them with transformers itself. Each directory is a small random
model written here with the project's byte tokenizer (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

from asyncrl.algorithms import GRPOLoss
from asyncrl.config import ModelConfig, TorchGenerationConfig, TorchTrainerConfig
from asyncrl.data import GenerationRequest, TrainBatch
from asyncrl.tokenizer import build_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 259


def family_config(family: str, **kw):
    """A small HF config of ``family``; Qwen3's head size (16) is not hidden / heads (48 / 4)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    tok = build_tokenizer()
    ids = dict(vocab_size=VOCAB, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    if family == "qwen3":
        return Qwen3Config(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                           tie_word_embeddings=kw.get("tied", True), **ids)
    if family == "llama3":  # Llama 3.2's rope: factor 32 over an original context of 8192, theta 500000
        return LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
                           rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                           rope_theta=500000.0, tie_word_embeddings=kw.get("tied", True), **ids)
    if family == "qwen2":
        return Qwen2Config(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, **ids)
    return LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, **ids)


FAMILIES = ["qwen3", "llama3", "qwen2", "llama"]


def write_model_dir(path, family: str, seed: int = 3, **kw):
    """A Hugging Face model directory: config, safetensors, tokenizer. Returns the model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **kw)).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    build_tokenizer().save_pretrained(str(path))
    return model


def make_batch(B=6, prompt=4, completion=40, seed=0) -> TrainBatch:
    """Right-padded sequences of up to 44 positions: long enough for Llama 3's scaled low frequencies to turn."""
    g = torch.Generator().manual_seed(seed)
    S = prompt + completion
    ids = torch.randint(3, VOCAB, (B, S), generator=g)
    attn = torch.ones(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S)
    loss_mask[:, prompt:] = 1
    for i in range(B):
        n = completion - 5 * (i % 3)
        loss_mask[i, prompt + n:] = 0
        attn[i, prompt + n:] = 0
        ids[i, prompt + n:] = 0
    return TrainBatch(ids, attn, loss_mask, torch.zeros(B, S), torch.randn(B, generator=g), [B])


def hf_logprobs(model, batch: TrainBatch) -> torch.Tensor:
    from asyncrl.algorithms import token_logprobs

    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    return token_logprobs(logits, batch.input_ids) * batch.loss_mask


# ---- the weight map, as pure tensor code --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_weight_map_round_trips_every_family(family):
    from transformers import AutoModelForCausalLM

    from asyncrl.backends.megatron_weights import ArchSpec, hf_to_megatron, megatron_to_hf, shard_for_tp, unshard_from_tp

    cfg = family_config(family)
    spec = ArchSpec(cfg)
    hf = dict(AutoModelForCausalLM.from_config(cfg).state_dict())
    full = hf_to_megatron(hf, spec)
    back = megatron_to_hf(full, spec)
    assert list(back) == list(hf)  # exactly the family's state_dict names, in its order
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    for name, t in full.items():  # tensor-parallel shards of every tensor, q/k norms included, join back
        pieces = [shard_for_tp(name, t, r, 2, 260) for r in range(2)]
        assert torch.equal(unshard_from_tp(name, pieces)[: t.shape[0]], t), name


def test_qwen3_s_spec_reads_its_head_size_and_q_k_norms_and_llama3_its_rope_scaling():
    from transformers import AutoModelForCausalLM

    from asyncrl.backends.megatron_weights import ArchSpec, hf_to_megatron

    q = ArchSpec(family_config("qwen3"))
    assert (q.head_dim, q.num_heads * q.head_dim, q.hidden_size, q.qk_norm, q.rope_kwargs) == (16, 64, 48, True, {})
    mg = hf_to_megatron(dict(AutoModelForCausalLM.from_config(family_config("qwen3")).state_dict()), q)
    assert mg["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (16,)
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 48)
    ll = ArchSpec(family_config("llama3"))
    assert ll.rope_kwargs == {"rope_scaling": True, "rope_scaling_factor": 32.0} and ll.rope_theta == 500000.0
    assert not ll.qk_norm


def test_what_megatron_would_compute_differently_is_refused_by_name():
    from transformers import LlamaConfig, Qwen3Config

    from asyncrl.backends.megatron_weights import ArchSpec

    base = dict(vocab_size=10, hidden_size=8, num_attention_heads=2, max_position_embeddings=131072)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="low_freq_factor"):
        ArchSpec(LlamaConfig(**base, rope_scaling=llama3))
    with pytest.raises(ValueError, match="'yarn'"):
        ArchSpec(LlamaConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 8192}))
    with pytest.raises(ValueError, match="use_sliding_window"):
        ArchSpec(Qwen3Config(**base, use_sliding_window=True, sliding_window=16))
    with pytest.raises(ValueError, match="attention_bias"):
        ArchSpec(Qwen3Config(**base, attention_bias=True))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        from transformers import GPT2Config

        ArchSpec(GPT2Config())


# ---- the engines, from a model directory ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_cpu():
    """A world of one (gloo), Megatron's model-parallel groups (1, 1) and its CPU workarounds, as
    tests/test_megatron_backend.py sets them up."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'asyncrl[megatron]')")
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    owned = not dist.is_initialized()
    if owned:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    yield
    parallel_state.destroy_model_parallel()
    if owned:
        dist.destroy_process_group()
    mp.undo()


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_megatron_computes_transformers_logits(megatron_cpu, tmp_path, family):
    """HF vs Megatron logprobs (fp32) for a directory given as hf_path; its export is the directory's weights."""
    from asyncrl.backends.megatron import MegatronPolicy
    from asyncrl.config import MegatronTrainerConfig

    hf = write_model_dir(tmp_path, family, tied=family == "qwen3")
    policy = MegatronPolicy(ModelConfig(hf_path=str(tmp_path)), MegatronTrainerConfig(device="cpu", optimizer="torch"),
                            GRPOLoss(), 0, build_tokenizer())
    batch = make_batch()
    ref = hf_logprobs(hf, batch)
    torch.testing.assert_close(policy.logprobs(batch), ref, atol=2e-5, rtol=0)
    exported = policy.export_weights()
    assert list(exported) == list(hf.state_dict())
    assert all(torch.equal(exported[k], v) for k, v in hf.state_dict().items())
    if family == "llama3":  # the scaling matters at these lengths: without it the logprobs differ
        from transformers import LlamaForCausalLM

        plain_cfg = family_config("llama3")
        plain_cfg.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
        plain = LlamaForCausalLM(plain_cfg).eval()
        plain.load_state_dict(hf.state_dict())
        assert (hf_logprobs(plain, batch) - ref).abs().max() > 1e-3
    if family == "qwen3":  # and so do the q/k norms: scaled, they change what Megatron computes
        with torch.no_grad():
            for layer in policy.model.decoder.layers:
                layer.self_attention.q_layernorm.weight.mul_(2.0)
        assert (policy.logprobs(batch) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_torch_engines_take_the_directory(tmp_path, family):
    from asyncrl.backends.torch import TorchGenerator, TorchPolicy

    hf = write_model_dir(tmp_path, family)
    model_cfg = ModelConfig(hf_path=str(tmp_path))
    policy = TorchPolicy(model_cfg, TorchTrainerConfig(), GRPOLoss(), 0, build_tokenizer())
    assert type(policy.model).__name__ == type(hf).__name__
    batch = make_batch()
    torch.testing.assert_close(policy.logprobs(batch), hf_logprobs(hf, batch), atol=2e-5, rtol=0)
    gen = TorchGenerator(model_cfg, TorchGenerationConfig(max_new_tokens=6), 0, build_tokenizer())
    gen.submit([GenerationRequest(group_id=0, prompt_ids=[1, 50, 51], n=3)])
    (group,) = gen.poll()
    assert len(group.completion_ids) == 3 and all(1 <= len(c) <= 6 for c in group.completion_ids)
    # the generator's logprobs are the policy's up to the two forward paths' float differences
    ids = torch.tensor([[1, 50, 51] + group.completion_ids[0]])
    full = TrainBatch(ids, torch.ones_like(ids), torch.ones(ids.shape), torch.zeros(ids.shape), torch.zeros(1), [1])
    torch.testing.assert_close(policy.logprobs(full)[0, 3:], torch.tensor(group.logprobs[0]), atol=1e-4, rtol=0)


# ---- a bad model is one line naming it, before anything is written -----------------------------------------------


def _run_cli(out, *argv) -> int:
    from asyncrl import cli

    return cli.main(["run", "quickstart", "--steps", "1", "--out", str(out), "--quiet", "--no-plot", *argv])


def _broken_dir(root, case: str):
    path = root / case
    if case == "not_a_directory":
        return path
    if case == "vocabulary_too_small":  # the byte tokenizer's 259 ids against a 258-row embedding
        from transformers import Qwen3ForCausalLM

        cfg = family_config("qwen3")
        cfg.vocab_size = 258
        Qwen3ForCausalLM(cfg).save_pretrained(str(path))
        build_tokenizer().save_pretrained(str(path))
        return path
    write_model_dir(path, "qwen3")
    if case == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).unlink()
    elif case == "no_weights":
        (path / "model.safetensors").unlink()
    elif case == "no_config":
        (path / "config.json").unlink()
    elif case == "unknown_model_type":
        (path / "config.json").write_text('{"model_type": "not_a_model", "vocab_size": 259}')
    return path


@pytest.mark.parametrize("case", ["not_a_directory", "no_config", "no_weights", "no_tokenizer",
                                  "vocabulary_too_small", "unknown_model_type"])
def test_a_bad_model_directory_is_one_line_naming_it_and_nothing_is_written(tmp_path, capsys, case):
    path = _broken_dir(tmp_path, case)
    capsys.readouterr()  # what writing the directory printed
    out = tmp_path / "run"
    assert _run_cli(out, "--set", f"model.hf_path={path}") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"model.hf_path {str(path)!r}" in err, err
    assert {"no_config": "config.json", "no_weights": "weights", "no_tokenizer": "no tokenizer",
            "vocabulary_too_small": "vocab_size is 258", "not_a_directory": "not a directory",
            "unknown_model_type": "config.json"}[case] in err
    assert not out.exists()


def test_an_architecture_transformers_refuses_is_one_line_naming_the_knob(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run_cli(out, "--set", "model.hidden_size=130") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.hidden_size=130" in err and "attention heads" in err, err
    assert not out.exists()


def test_config_yaml_of_an_hf_path_run_records_the_architecture_trained(tmp_path):
    import yaml

    path = tmp_path / "model"
    write_model_dir(path, "qwen3")
    assert _run_cli(tmp_path / "run", "--set", f"model.hf_path={path}") == 0
    model = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert {k: model[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "max_position_embeddings")} == {
        "hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128}
