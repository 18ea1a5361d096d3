"""The trained model out: ``ctrl.save_pretrained(dir)`` and ``asyncrl export RUN_OR_CHECKPOINT DIR`` write a Hugging
Face directory that transformers loads (``AutoModelForCausalLM`` / ``AutoTokenizer``) holding exactly the trained
policy's weights: from the torch engine, from the Megatron engine through its weight map, and with tensor-parallel
shards gathered (TP=2 over gloo, two processes). vLLM reads the same format (its GPU test is in
tests/test_vllm_backend.py)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.data import TrainBatch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _batch(vocab=259, B=4, S=12, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.ones(B, S)
    mask[:, :3] = 0
    return TrainBatch(ids, torch.ones(B, S, dtype=torch.long), mask, torch.zeros(B, S), torch.randn(B, generator=g),
                      [B])


def _hf_logprobs(model, batch: TrainBatch) -> torch.Tensor:
    from asyncrl.algorithms import token_logprobs

    with torch.no_grad():
        return token_logprobs(model(input_ids=batch.input_ids).logits.float(), batch.input_ids) * batch.loss_mask


def _assert_loads_as(path, weights: dict[str, torch.Tensor], policy_logprobs: torch.Tensor, batch: TrainBatch,
                     atol: float = 2e-5):
    """transformers loads ``path`` strictly, its tensors are ``weights`` bit for bit, its logprobs the policy's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    state = model.state_dict()
    assert set(state) == set(weights)
    for name, tensor in weights.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor.cpu()), name
    torch.testing.assert_close(_hf_logprobs(model, batch), policy_logprobs, atol=atol, rtol=0)
    return model


def test_save_pretrained_writes_the_trained_torch_policy(tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.controller import Controller

    with Controller.from_config(load_config("quickstart", seed=3)) as ctrl:
        ctrl.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ctrl.run(3, progress=False)
        trained = ctrl.policy.export_weights()
        initial = Controller.from_config(load_config("quickstart", seed=3)).policy.export_weights()
        assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])
        out = ctrl.save_pretrained(tmp_path / "hf")
        batch = _batch()
        _assert_loads_as(out, trained, ctrl.policy.logprobs(batch), batch)
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
        tok = AutoTokenizer.from_pretrained(str(out))
        assert len(tok) == len(ctrl.tokenizer) and tok.encode("7=") == ctrl.tokenizer.encode("7=")
        assert (tok.pad_token_id, tok.eos_token_id) == (ctrl.tokenizer.pad_token_id, ctrl.tokenizer.eos_token_id)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
        with pytest.raises(ValueError, match="not an empty directory"):  # never over an existing export
            ctrl.save_pretrained(out)


def test_an_exported_directory_trains_on_as_hf_path(tmp_path):
    """What a researcher does next: the exported directory is a model directory asyncrl itself takes."""
    from asyncrl.controller import Controller

    with Controller.from_config(load_config("quickstart", seed=1)) as ctrl:
        ctrl.run(2, progress=False)
        out = ctrl.save_pretrained(tmp_path / "hf")
        trained = ctrl.policy.export_weights()
    with Controller.from_config(load_config("quickstart", seed=1, model={"hf_path": str(out)})) as again:
        start = again.policy.export_weights()
        assert all(torch.equal(start[k], v) for k, v in trained.items())


def test_asyncrl_export_writes_a_checkpoint_s_policy(tmp_path, capsys):
    from asyncrl import cli

    run = tmp_path / "run"
    assert cli.main(["run", "quickstart", "--steps", "2", "--checkpoint-every", "2", "--out", str(run), "--quiet",
                     "--no-plot"]) == 0
    saved = torch.load(run / "checkpoints" / "step-000002" / "tensors.pt", weights_only=True)["policy"]["model"]
    capsys.readouterr()
    assert cli.main(["export", str(run), str(tmp_path / "hf")]) == 0
    assert "step 2" in capsys.readouterr().err
    from asyncrl.controller import Controller

    with Controller.restore(run) as ctrl:
        batch = _batch()
        _assert_loads_as(tmp_path / "hf", saved, ctrl.policy.logprobs(batch), batch)
    capsys.readouterr()
    # a bad source or an occupied target: one line, exit 2, nothing written
    assert cli.main(["export", str(tmp_path / "nothing"), str(tmp_path / "hf2")]) == 2
    assert cli.main(["export", str(run), str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("asyncrl export: ") for line in err), err
    assert not (tmp_path / "hf2").exists() and not (run / "config.json").exists()


# ---- the Megatron engine: through its weight map, tensor-parallel shards gathered ---------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_policy(tp: int, model_kw: dict):
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends.megatron import MegatronPolicy
    from asyncrl.config import MegatronTrainerConfig, ModelConfig
    from asyncrl.tokenizer import build_tokenizer

    trainer = MegatronTrainerConfig(device="cpu", lr=1e-2, optimizer="torch", tensor_parallel=tp)
    return MegatronPolicy(ModelConfig(**model_kw), trainer, GRPOLoss(), 0, build_tokenizer())


def _train_once(policy) -> None:
    from dataclasses import replace

    batch = _batch(seed=5)
    lp = policy.logprobs(batch)
    batch = replace(batch, prev_logprobs=lp, gen_logprobs=lp - 0.1 * batch.loss_mask)
    policy.begin_train_step()
    policy.train_microbatches(batch)
    policy.finish_train_step()


MODEL = {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}


def _tp_worker(rank: int, world: int, port: int, out: str) -> None:
    """Both ranks export (the gather is collective); rank 0 writes, and saves what its policy computes."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from asyncrl.backends.hf import export_pretrained
    from asyncrl.tokenizer import build_tokenizer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # Megatron-core on a CPU (tests/test_megatron_backend.py)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(world, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    policy = _megatron_policy(world, MODEL)
    _train_once(policy)
    shard = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    written = export_pretrained(policy, policy.model_cfg, build_tokenizer(), os.path.join(out, "hf"))
    assert (written is None) == (rank != 0)
    lp = policy.logprobs(_batch())
    torch.save({"shard": shard, "logprobs": lp, "export": policy.export_weights()}, os.path.join(out, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.slow
def test_megatron_tensor_parallel_export_gathers_the_shards(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'asyncrl[megatron]')")
    import torch.multiprocessing as mp

    mp.start_processes(_tp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    exported = ranks[0]["export"]
    _assert_loads_as(tmp_path / "hf", exported, ranks[0]["logprobs"], _batch())
    # the directory holds both ranks' halves: rank 1's shard of the first MLP's down projection is its second half
    down = exported["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.chunk(2, dim=1)[1], ranks[1]["shard"]["decoder.layers.0.mlp.linear_fc2.weight"])
    assert not torch.equal(down.chunk(2, dim=1)[0], down.chunk(2, dim=1)[1])
    assert {p.name for p in (tmp_path / "hf").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
