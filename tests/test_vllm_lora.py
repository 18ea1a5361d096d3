"""LoRA on the vLLM generator (``model.lora`` with ``generation.backend: vllm``), against the fake vLLM engine of
``tests/test_vllm_backend.py`` extended with vLLM's adapter API (``add_lora`` / ``remove_lora`` /
``add_request(..., lora_request=)``): one adapter per weight version, a group finishes on the adapter it started
with across a sync, adapters nobody uses are removed, and the sync sends the adapter's bytes, not the model's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncrl.backends.lora import LoraAdapter
from asyncrl.backends.vllm import VLLMGenerator
from asyncrl.config import ModelConfig, VLLMGenerationConfig
from asyncrl.config.backends import LoraConfig
from tests.faults import check_accounting
from tests.test_vllm_backend import EOS, FakeEngine, FakeLLM, FakeSamplingParams, make_tokenizer, req

pytest.importorskip("peft")


@dataclass(frozen=True)
class FakeLoRARequest:
    """``vllm.lora.request.LoRARequest``'s fields the generator sets."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeLoraEngine(FakeEngine):
    """The fake engine serving adapters as vLLM does: ``add_lora`` reads the peft directory (config and
    safetensors), a request names its adapter, and every step checks that each running request's adapter is still
    registered (removing one in use is an error here). A token's logprob is ``-lora id`` (``-scale`` without an
    adapter), so a group's logprobs say which adapter sampled each of its tokens."""

    def __init__(self, llm):
        super().__init__(llm)
        self.loras: dict[int, dict] = {}  # lora id -> what add_lora read
        self.removed: list[int] = []
        self.request_lora: dict[str, int | None] = {}

    def add_lora(self, lora_request):
        path = Path(lora_request.lora_path)
        config = json.loads((path / "adapter_config.json").read_text())
        from safetensors.torch import load_file

        tensors = load_file(str(path / "adapter_model.safetensors"))
        assert config["r"] >= 1 and tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
        assert lora_request.lora_int_id not in self.loras  # a new id for every version
        self.loras[lora_request.lora_int_id] = {"config": config, "tensors": tensors, "name": lora_request.lora_name}
        return True

    def remove_lora(self, lora_id):
        assert lora_id in self.loras
        del self.loras[lora_id]
        self.removed.append(lora_id)
        return True

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.request_lora[request_id] = None if lora_request is None else lora_request.lora_int_id
        return super().add_request(request_id, prompt, params)

    def step(self):
        for rid in self.requests:
            lora = self.request_lora[rid]
            assert lora is None or lora in self.loras, f"{rid} runs on adapter {lora}, which was removed"
        outputs = super().step()
        for out in outputs:
            lora = self.request_lora.pop(out.request_id)
            tag = -float(lora) if lora is not None else -self.llm.scale
            for c in out.outputs:
                c.logprobs = [{t: SimpleNamespace(logprob=tag, rank=1)} for t in c.token_ids]
        return outputs


class FakeLoraLLM(FakeLLM):
    def __init__(self):
        super().__init__()
        self.llm_engine = FakeLoraEngine(self)


def fake_adapter(value: float, rank: int = 2) -> LoraAdapter:
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    return LoraAdapter({f"{name}.lora_A.weight": torch.full((rank, 8), value),
                        f"{name}.lora_B.weight": torch.full((8, rank), value)},
                       {"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"], "peft_type": "LORA"})


def make_lora_gen(weight_update: str, max_new_tokens: int = 40):
    llm = FakeLoraLLM()
    llm.llm_engine.eos_p = 0.0  # every completion runs to its limit: groups stay in the engine across a sync
    gen_cfg = VLLMGenerationConfig(max_new_tokens=max_new_tokens, weight_update=weight_update)
    model_cfg = ModelConfig(lora=LoraConfig(rank=2))
    gen = VLLMGenerator(model_cfg, gen_cfg, 0, SimpleNamespace(eos_token_id=EOS), llm=llm,
                        sampling_params_cls=FakeSamplingParams, lora_request_cls=FakeLoRARequest)
    return gen, llm.llm_engine


def adapter_of(group) -> set[float]:
    return {lp for lps in group.logprobs for lp in lps}


@pytest.mark.parametrize("weight_update", ["drain", "inflight"])
def test_each_version_is_an_adapter_and_a_group_finishes_on_the_one_it_started_with(weight_update):
    gen, engine = make_lora_gen(weight_update)
    root = gen._adapters.root
    try:
        gen.load_adapter(fake_adapter(0.0), 0)
        gen.submit([req(1)])
        assert gen.poll(1e-4) == []  # group 1 entered the engine under version 0's adapter and is mid-way
        assert engine.steps >= 1 and any(engine.requests.values())
        gen.submit([req(2)])  # queued under version 0, not yet in the engine
        gen.load_adapter(fake_adapter(1.0), 1)  # no drain: group 1 goes on on its own adapter
        assert engine.steps < 40 and gen.version == 1
        gen.submit([req(3)])
        done = {g.group_id: g for g in gen.poll(0)}
        assert sorted(done) == [1, 2, 3]
        ids = {engine.loras[i]["name"]: i for i in engine.loras} | {f"removed-{i}": i for i in engine.removed}
        assert len(engine.loras) + len(engine.removed) == 2  # one adapter per version, each its own id
        v0, v1 = 1, 2  # lora ids, in sync order
        assert adapter_of(done[1]) == {-float(v0)}  # all its tokens on version 0's adapter, the sync notwithstanding
        assert (done[1].gen_start_version, done[1].gen_end_version) == (0, 0)
        # drain: a group takes its adapter when submitted (version 0); inflight: when it enters the engine (1)
        v2 = 0 if weight_update == "drain" else 1
        assert adapter_of(done[2]) == {-float(v0 if v2 == 0 else v1)}
        assert (done[2].gen_start_version, done[2].gen_end_version) == (v2, v2)
        assert adapter_of(done[3]) == {-float(v1)} and done[3].gen_start_version == done[3].gen_end_version == 1
        # version 0's adapter went once no group used it: removed from the engine, its directory deleted
        assert engine.removed == [v0] and list(engine.loras) == [v1] and gen.adapters() == {v1: 1}
        assert ids and not (root / "v0-id1").exists() and (root / "v1-id2").exists()
        parts = gen.sync_parts()
        assert [p["version"] for p in parts] == [0, 1]
        assert parts[-1]["bytes"] == fake_adapter(1.0).nbytes
    finally:
        gen.close()
    assert not root.exists()  # every adapter directory goes with the generator


def test_an_aborted_group_gives_its_adapter_back():
    gen, engine = make_lora_gen("inflight")
    try:
        gen.load_adapter(fake_adapter(0.0), 0)
        gen.submit([req(1)])
        gen.poll(1e-4)
        gen.load_adapter(fake_adapter(1.0), 1)
        assert sorted(engine.loras) == [1, 2]  # group 1 still runs on version 0's
        assert gen.abort([1]) == [1]
        assert sorted(engine.loras) == [2] and engine.removed == [1]
    finally:
        gen.close()


def test_a_lora_generator_takes_adapters_not_weights():
    gen, _ = make_lora_gen("drain")
    try:
        with pytest.raises(ValueError, match="serves LoRA adapters"):
            gen.load_weights({"scale": torch.tensor(2.0)}, 1)
        assert gen.version == 0
    finally:
        gen.close()
    plain = VLLMGenerator(ModelConfig(), VLLMGenerationConfig(), 0, SimpleNamespace(eos_token_id=EOS),
                          llm=FakeLLM(), sampling_params_cls=FakeSamplingParams)
    with pytest.raises(ValueError, match="serves no adapters"):
        plain.load_adapter(fake_adapter(0.0), 1)
    plain.close()


def test_the_engine_is_built_with_lora_on_for_the_adapters_rank():
    from asyncrl.backends.vllm_build import build_llm
    from asyncrl.backends.vllm_build import vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 33, 320)] == [1, 8, 8, 16, 16, 64, 320]
    with pytest.raises(ValueError, match="model.lora.rank 600"):
        vllm_lora_rank(600)
    seen = {}
    fake_vllm = SimpleNamespace(LLM=lambda **kw: seen.update(kw) or SimpleNamespace())
    model_cfg = ModelConfig(lora=LoraConfig(rank=4))
    build_llm(fake_vllm, model_cfg.model_copy(update={"hf_path": "/nowhere"}), VLLMGenerationConfig(max_loras=3), 0,
              None)
    assert seen["enable_lora"] is True and seen["max_lora_rank"] == 8 and seen["max_loras"] == 3
    assert seen["max_cpu_loras"] == 4


def test_lora_on_vllm_configuration_mistakes_are_one_line():
    from asyncrl import load_config

    base = dict(model={"lora": {"rank": 2}}, sampler={"name": "weight_fifo", "max_staleness_versions": 4})
    with pytest.raises(ValueError, match=r"generation.max_loras 4 < the sampler's window 4 \+ 1"):
        load_config("quickstart", generation={"backend": "vllm"}, **base)
    cfg = load_config("quickstart", generation={"backend": "vllm", "max_loras": 5}, **base)
    assert cfg.generation.max_loras == 5
    with pytest.raises(ValueError, match="sends the adapter to one engine in the controller's process"):
        load_config("quickstart", generation={"backend": "vllm", "placement": "ray", "max_loras": 5}, **base)
    load_config("quickstart", **base)  # the torch generator takes merged weights, whatever the window


# ---- through the controller: a real LoRA torch policy, the generator around the fake engine ----------------------


def test_a_lora_run_on_vllm_syncs_the_adapter_only_and_loses_nothing():
    from asyncrl import Controller, load_config
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends.torch import TorchPolicy
    from asyncrl.tasks import build_task

    cfg = load_config("quickstart", sampler={"name": "weight_fifo", "max_staleness_versions": 1}, eval_every=None,
                      groups_per_step=4, group_size=4, torch_threads=1, model={"lora": {"rank": 2}},
                      generation={"backend": "vllm", "max_new_tokens": 6, "weight_update": "inflight"})
    tok = make_tokenizer()
    policy = TorchPolicy(cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok)
    llm = FakeLoraLLM()
    gen = VLLMGenerator(cfg.model, cfg.generation, cfg.seed, tok, llm=llm, sampling_params_cls=FakeSamplingParams,
                        lora_request_cls=FakeLoRARequest)
    adapter = policy.export_adapter()
    model_bytes = sum(t.numel() * t.element_size() for t in policy.export_weights().values())
    with Controller(cfg, build_task(cfg.task), policy, gen, tok) as ctrl:
        m = ctrl.run(4, progress=False)
        engine = llm.llm_engine
        # the sync sent the adapter: its bytes, a small part of the model's
        assert (m.sync_bytes == adapter.nbytes).all() and adapter.nbytes < model_bytes / 10
        assert (m.sync_time_s > 0).all()
        # one adapter per version (version 0 at the start, then one a step), each peft's format with the policy's
        # adapter names; those no group uses any more were removed, so the engine holds at most W + 1 = 2
        assert len(engine.loras) + len(engine.removed) == 5 and 1 <= len(engine.loras) <= 2
        (held,) = [v for i, v in engine.loras.items() if i == max(engine.loras)]
        assert set(held["tensors"]) == set(adapter.tensors) and held["config"]["r"] == 2
        trace = ctrl.trace
        commits = trace[trace.event == "commit"]
        spans = [r.reason.split("weights ")[1] for r in commits.itertuples()]
        assert all(a == b for a, b in (s.split("..") for s in spans))  # every group on one version's adapter
        check_accounting(ctrl)  # nothing lost: every dispatched group trained, evicted, aborted or skipped, or live
        assert len(trace[trace.event == "select"]) == 4 * 4


def test_the_adapter_sent_is_a_directory_peft_loads_to_the_policys_merged_weights(tmp_path):
    """What vLLM reads (``write_adapter_dir`` of ``export_adapter``) is peft's own format: loaded on the base with
    ``peft.PeftModel.from_pretrained`` and merged, it gives the trained policy's merged weights."""
    import peft

    from asyncrl import load_config
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends.hf import build_model
    from asyncrl.backends.lora import write_adapter_dir
    from asyncrl.backends.torch import TorchPolicy

    cfg = load_config("quickstart", model={"lora": {"rank": 2}}, torch_threads=1)
    tok = make_tokenizer()
    policy = TorchPolicy(cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)  # as if trained: the adapter changes the model
    path = write_adapter_dir(policy.export_adapter(), tmp_path / "v1")
    base = build_model(cfg.model, len(tok), cfg.seed, "cpu", tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    merged = peft.PeftModel.from_pretrained(base, str(path)).merge_and_unload().state_dict()
    want = policy.export_weights()
    assert set(merged) <= set(want)
    for k, v in merged.items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-5)
    assert any(not torch.equal(want[k], v) for k, v in build_model(
        cfg.model, len(tok), cfg.seed, "cpu", tok.pad_token_id, tok.bos_token_id, tok.eos_token_id).state_dict().items()
        if k in want)


def test_a_full_weights_sync_reports_the_models_bytes():
    """Without LoRA the driver's sync sends every weight: ``sync_bytes`` is the exported model's size."""
    from asyncrl import Controller, load_config

    cfg = load_config("quickstart", eval_every=None, groups_per_step=2, group_size=2, torch_threads=1)
    with Controller.from_config(cfg) as ctrl:
        m = ctrl.run(2, progress=False)
        weights = ctrl.policy.export_weights()
    assert (m.sync_bytes == sum(t.numel() * t.element_size() for t in weights.values())).all()
