"""The vLLM generation backend: its request/response, abort and weight-update logic against a small fake of the
``vllm.LLM`` surface it uses (``generate``, ``collective_rpc``, ``reset_prefix_cache``), and — on a machine with
CUDA and vLLM — the same against the real engine (``-m gpu``; skipped cleanly elsewhere)."""

from __future__ import annotations

import math
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from asyncrl.backends.base import GenerationBackend
from asyncrl.backends.vllm import VLLMGenerator, group_seed, write_model_dir
from asyncrl.config import ModelConfig, VLLMGenerationConfig
from asyncrl.data import GenerationRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
EOS = 258
VOCAB = 259


def make_tokenizer():
    from asyncrl.tokenizer import build_tokenizer

    return build_tokenizer()


# ---- a fake of the vllm.LLM surface ----------------------------------------------------------------------------


class FakeSamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, max_tokens=16, logprobs=None, seed=None,
                 stop_token_ids=None, detokenize=True):
        self.n, self.temperature, self.top_p, self.max_tokens = n, temperature, top_p, max_tokens
        self.logprobs, self.seed, self.stop_token_ids, self.detokenize = logprobs, seed, stop_token_ids, detokenize


class FakeLLM:
    """Samples tokens from a generator seeded by the request's seed (+ sample index, as vLLM does); the logprob of
    every sampled token is ``-scale`` where ``scale`` is the loaded weight ``"scale"``. ``gate`` (an Event) makes
    ``generate`` block until set, to hold a wave "running"."""

    def __init__(self):
        self.scale = 1.0
        self.calls: list[tuple[list, list]] = []
        self.log: list[str] = []
        self.gate: threading.Event | None = None
        self.started = threading.Event()
        self.fail_reload = False
        self.fail_generate = False

    def generate(self, prompts, params, use_tqdm=True):
        assert use_tqdm is False
        self.log.append("generate")
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append((prompts, params))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail_generate:
            raise RuntimeError("engine died")
        outs = []
        for prompt, p in zip(prompts, params):
            ids = prompt["prompt_token_ids"]
            completions = []
            for i in range(p.n):
                if p.temperature == 0:
                    rng = torch.Generator().manual_seed(sum(ids))
                else:
                    rng = torch.Generator().manual_seed((p.seed if p.seed is not None else 12345) + i)
                toks, lps, reason = [], [], "length"
                for _ in range(p.max_tokens):
                    t = int(torch.randint(0, VOCAB, (1,), generator=rng))
                    if float(torch.rand(1, generator=rng)) < 0.2:
                        t = EOS
                    toks.append(t)
                    lps.append({t: SimpleNamespace(logprob=-self.scale, rank=1)})
                    if p.stop_token_ids and t in p.stop_token_ids:
                        reason = "stop"
                        break
                completions.append(SimpleNamespace(index=i, token_ids=toks, logprobs=lps if p.logprobs is not None
                                                   else None, finish_reason=reason, text=""))
            outs.append(SimpleNamespace(prompt_token_ids=ids, outputs=completions[::-1]))  # any order: sorted by index
        return outs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.log.append(method)
        assert method == "reload_weights" and not args
        items = kwargs["weights_iterator"]
        assert isinstance(items, list) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in items)
        if self.fail_reload:
            raise RuntimeError("reload failed")
        self.loaded = dict(items)
        self.scale = float(self.loaded["scale"])
        return [None]

    def apply_model(self, fn):
        self.log.append("apply_model")
        model = SimpleNamespace(load_weights=lambda items: self.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(items)}) and {name for name, _ in items})
        return [fn(model)]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.log.append("reset_prefix_cache")
        return True


def make_gen(background=False, seed=0, **gen_kw):
    llm = FakeLLM()
    gen_cfg = VLLMGenerationConfig(max_new_tokens=gen_kw.pop("max_new_tokens", 6),
                                   temperature=gen_kw.pop("temperature", 0.9), top_p=gen_kw.pop("top_p", 0.95),
                                   background=background, **gen_kw)
    tok = SimpleNamespace(eos_token_id=EOS)
    return VLLMGenerator(ModelConfig(), gen_cfg, seed, tok, llm=llm, sampling_params_cls=FakeSamplingParams), llm


def req(gid, n=4, prompt=(257, 49, 50)):
    return GenerationRequest(group_id=gid, prompt_ids=list(prompt), n=n)


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def run_in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn(*args)), daemon=True)
    t.start()
    return t, box


# ---- request / response -------------------------------------------------------------------------------------------


def test_satisfies_the_protocol():
    gen, _ = make_gen()
    assert isinstance(gen, GenerationBackend)


def test_submit_only_queues_and_poll_generates_one_wave():
    gen, llm = make_gen(seed=3)
    gen.submit([req(7, n=4), req(8, n=2, prompt=(257, 51))])
    assert llm.calls == [] and gen.num_inflight() == 2
    groups = gen.poll()
    assert len(llm.calls) == 1 and gen.num_inflight() == 0  # one LLM.generate call for the whole queue
    prompts, params = llm.calls[0]
    assert prompts == [{"prompt_token_ids": [257, 49, 50]}, {"prompt_token_ids": [257, 51]}]
    p = params[0]
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.logprobs) == (4, 0.9, 0.95, 6, 0)
    assert p.stop_token_ids == [EOS] and p.seed == group_seed(3, 7) and params[1].seed == group_seed(3, 8)
    assert p.detokenize is False
    assert [g.group_id for g in groups] == [7, 8]
    g = groups[0]
    assert g.prompt_ids == [257, 49, 50] and len(g.completion_ids) == 4 and len(g.logprobs) == 4
    for ids, lps, reason in zip(g.completion_ids, g.logprobs, g.finish_reasons):
        assert len(ids) == len(lps) and all(lp == -1.0 for lp in lps)
        if reason == "stop":
            assert ids[-1] == EOS and EOS not in ids[:-1]
        else:
            assert reason == "length" and len(ids) == 6 and EOS not in ids
    assert (g.gen_start_version, g.gen_end_version) == (0, 0)
    assert gen.poll() == [] and len(llm.calls) == 1  # nothing queued: no engine call


def test_samples_are_returned_in_index_order_and_depend_only_on_the_group():
    gen, _ = make_gen(seed=1)
    gen.submit([req(5)])
    alone = gen.poll()[0]
    gen.submit([req(1), req(5), req(9)])
    together = {g.group_id: g for g in gen.poll()}
    assert together[5].completion_ids == alone.completion_ids  # per-group seeds: wave composition does not matter
    assert together[1].completion_ids != alone.completion_ids
    other_seed, _ = make_gen(seed=2)
    other_seed.submit([req(5)])
    assert other_seed.poll()[0].completion_ids != alone.completion_ids


def test_waves_can_be_bounded():
    gen, llm = make_gen(max_groups_per_wave=2)
    gen.submit([req(i) for i in range(5)])
    groups = gen.poll()
    assert [g.group_id for g in groups] == list(range(5)) and [len(c[0]) for c in llm.calls] == [2, 2, 1]


# ---- weights ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_load_weights_reloads_in_place_then_resets_the_prefix_cache_then_sets_the_version(prefix_caching):
    gen, llm = make_gen(enable_prefix_caching=prefix_caching)
    weights = {"scale": torch.tensor(2.5), "model.norm.weight": torch.ones(4)}
    gen.load_weights(weights, version=3)
    # the reset walks every KV block: only when a prefix cache exists to hold the old weights' keys and values
    assert llm.log == ["reload_weights"] + (["reset_prefix_cache"] if prefix_caching else [])
    (parts,) = gen.sync_parts()
    assert parts["version"] == 3 and parts["load_s"] >= 0 and (parts["reset_s"] == 0) == (not prefix_caching)
    assert set(llm.loaded) == set(weights) and all(llm.loaded[k] is weights[k] for k in weights)  # no copies
    assert gen.version == 3 and gen.last_sync_seconds is not None
    gen.submit([req(1)])
    g = gen.poll()[0]
    assert (g.gen_start_version, g.gen_end_version) == (3, 3)
    assert all(lp == -2.5 for row in g.logprobs for lp in row)


def test_weights_can_load_through_the_models_own_load_weights():
    gen, llm = make_gen(weight_load="load_weights")
    gen.load_weights({"scale": torch.tensor(4.0)}, version=2)
    assert llm.log == ["apply_model", "reload_weights"] and gen.version == 2
    gen.submit([req(1)])
    assert gen.poll()[0].logprobs[0][0] == -4.0
    with pytest.raises(ValueError, match="weight_load"):
        make_gen(weight_load="nope")


def test_a_failed_weight_load_keeps_the_old_version():
    gen, llm = make_gen()
    llm.fail_reload = True
    with pytest.raises(RuntimeError, match="reload failed"):
        gen.load_weights({"scale": torch.tensor(2.0)}, version=1)
    assert gen.version == 0 and "reset_prefix_cache" not in llm.log


def test_a_weight_load_waits_for_the_running_wave():
    gen, llm = make_gen()
    llm.gate = threading.Event()
    gen.submit([req(1)])
    poller, box = run_in_thread(gen.poll)
    assert llm.started.wait(5)
    loader, _ = run_in_thread(gen.load_weights, {"scale": torch.tensor(3.0)}, 1)
    time.sleep(0.2)
    assert loader.is_alive() and gen.version == 0 and "reload_weights" not in llm.log
    llm.gate.set()
    poller.join(5)
    loader.join(5)
    (g,) = box["out"]
    assert (g.gen_start_version, g.gen_end_version) == (0, 0) and all(lp == -1.0 for lp in g.logprobs[0])
    assert gen.version == 1 and llm.log == ["generate", "reload_weights"]


def test_staged_weights_arrive_during_a_wave_and_are_swapped_in_between_waves():
    gen, llm = make_gen()
    llm.gate = threading.Event()
    gen.submit([req(1)])
    poller, box = run_in_thread(gen.poll)
    assert llm.started.wait(5)
    buffers = {"scale": torch.tensor(0.0)}
    filled = []

    def fill():  # what the collective sync's receive does: write the buffers
        buffers["scale"].fill_(3.0)
        filled.append(True)

    stager, _ = run_in_thread(gen.stage_weights, buffers, 1, fill)
    stager.join(5)
    assert not stager.is_alive() and filled  # the receive did not wait for the wave
    assert "reload_weights" not in llm.log  # nor touched the engine during it
    assert gen.version == 1  # what a group dispatched now will run with: no wave starts before the swap
    llm.gate.set()
    poller.join(5)
    (g,) = box["out"]
    assert (g.gen_start_version, g.gen_end_version) == (0, 0) and all(lp == -1.0 for lp in g.logprobs[0])
    assert gen.version == 1 and llm.log == ["generate", "reload_weights"]  # swapped in as the wave ended
    gen.submit([req(2)])
    (g,) = gen.poll()
    assert g.gen_start_version == 1 and all(lp == -3.0 for lp in g.logprobs[0])
    (parts,) = gen.sync_parts()
    assert parts["version"] == 1 and parts["swap_wait_s"] > 0 and parts["reset_s"] == 0


@pytest.mark.parametrize("background", [False, True])
def test_staged_weights_count_at_once_load_before_the_next_wave_and_a_newer_set_replaces_an_older_one(background):
    """The receive returns without loading (the trainer's sync does not wait for the engine); ``version`` says the
    staged one at once, and no wave runs before it is loaded: at the next poll, or at once by the wave thread."""
    gen, llm = make_gen(background=background)
    gen.stage_weights({"scale": torch.tensor(2.0)}, 1)
    assert gen.version == 1  # a synchronous run sees the version move before its sync returns
    gen.submit([req(1)])
    (g,) = gen.poll(timeout=5)
    assert g.gen_start_version == 1 and llm.scale == 2.0 and llm.log == ["reload_weights", "generate"]
    llm.gate = threading.Event()
    llm.started.clear()
    gen.submit([req(2)])
    poller, _ = run_in_thread(gen.poll, 5)
    assert llm.started.wait(5)
    gen.stage_weights({"scale": torch.tensor(3.0)}, 2)
    gen.stage_weights({"scale": torch.tensor(4.0)}, 3)
    assert gen.version == 3 and llm.scale == 2.0  # the running wave keeps its weights
    llm.gate.set()
    poller.join(5)
    wait_until(lambda: llm.scale == 4.0)
    assert [p["version"] for p in gen.sync_parts()] == [1, 3]
    gen.close()


def test_a_failed_staged_receive_keeps_the_old_weights_and_version():
    gen, llm = make_gen()

    def fill():
        raise RuntimeError("sender failed")

    with pytest.raises(RuntimeError, match="sender failed"):
        gen.stage_weights({"scale": torch.tensor(9.0)}, 1, fill)
    gen.submit([req(1)])
    (g,) = gen.poll()
    assert gen.version == 0 and g.gen_start_version == 0 and "reload_weights" not in llm.log


def test_long_tailed_completion_limits_are_per_group_and_seeded():
    gen, llm = make_gen(max_new_tokens=200, min_new_tokens_tail=8, length_sigma=1.0)
    gen.submit([req(gid, n=1) for gid in range(400)])
    gen.poll()
    limits = [p.max_tokens for p in llm.calls[0][1]]
    assert all(8 <= m <= 200 for m in limits)
    median = sorted(limits)[len(limits) // 2]
    assert median < 20 and max(limits) > 5 * median  # a long tail, not a spread around the mean
    again, llm2 = make_gen(max_new_tokens=200, min_new_tokens_tail=8, length_sigma=1.0)
    again.submit([req(gid, n=1) for gid in reversed(range(400))])
    again.poll()
    assert [p.max_tokens for p in llm2.calls[0][1]][::-1] == limits  # a group's limit does not depend on its wave
    fixed, llm3 = make_gen(max_new_tokens=7)
    fixed.submit([req(1)])
    fixed.poll()
    assert llm3.calls[0][1][0].max_tokens == 7
    with pytest.raises(ValueError, match="min_new_tokens_tail 300 exceeds max_new_tokens 200"):
        VLLMGenerationConfig(max_new_tokens=200, min_new_tokens_tail=300)


def test_kv_pool_bytes_follow_the_token_budget():
    from asyncrl.backends.vllm import kv_cache_bytes

    hf = SimpleNamespace(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=20)
    # keys and values x 20 layers x 8 KV heads x 64 dims x 2 bytes (bf16) per token
    assert kv_cache_bytes(ModelConfig(dtype="bfloat16"), hf, 1000) == 1000 * 2 * 20 * 8 * 64 * 2
    assert kv_cache_bytes(ModelConfig(dtype="float32"), hf, 10) == 10 * 2 * 20 * 8 * 64 * 4


# ---- abort ---------------------------------------------------------------------------------------------------------


def test_abort_drops_queued_groups_before_they_reach_the_engine():
    gen, llm = make_gen()
    gen.submit([req(1), req(2), req(3)])
    assert sorted(gen.abort([2, 3, 99])) == [2, 3]
    assert gen.num_inflight() == 1
    assert [g.group_id for g in gen.poll()] == [1]
    assert len(llm.calls[0][0]) == 1
    assert gen.abort([1]) == []  # finished and returned: nothing to cancel


def test_abort_cancels_groups_of_the_running_wave():
    gen, llm = make_gen()
    llm.gate = threading.Event()
    gen.submit([req(1), req(2)])
    poller, box = run_in_thread(gen.poll)
    assert llm.started.wait(5)
    assert gen.num_inflight() == 2
    assert gen.abort([2]) == [2]
    assert gen.abort([2]) == []  # already cancelled
    assert gen.num_inflight() == 1
    llm.gate.set()
    poller.join(5)
    assert [g.group_id for g in box["out"]] == [1]
    assert gen.num_inflight() == 0


def test_finished_groups_waiting_for_poll_are_not_cancelled():
    gen, llm = make_gen(background=True)
    try:
        gen.submit([req(4)])
        deadline = time.monotonic() + 5
        while gen._done == [] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gen.abort([4]) == [] and gen.num_inflight() == 1
        assert [g.group_id for g in gen.poll(timeout=1)] == [4]
    finally:
        gen.close()


# ---- background thread -------------------------------------------------------------------------------------------


def test_background_mode_generates_in_its_own_thread():
    gen, llm = make_gen(background=True)
    try:
        assert gen.poll(timeout=None) == []  # nothing in flight: returns at once
        llm.gate = threading.Event()
        gen.submit([req(1), req(2)])
        assert llm.started.wait(5)
        t0 = time.monotonic()
        assert gen.poll(timeout=0.1) == []  # still generating: waits at most the timeout
        assert time.monotonic() - t0 < 2
        llm.gate.set()
        got = gen.poll(timeout=5)
        assert [g.group_id for g in got] == [1, 2]
        llm.gate = None
        gen.submit([req(3)])
        assert [g.group_id for g in gen.poll(timeout=None)] == [3]
    finally:
        gen.close()
    assert not gen._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        gen.submit([req(9)])


def test_a_background_failure_surfaces_in_poll():
    gen, llm = make_gen(background=True)
    try:
        llm.fail_generate = True
        gen.submit([req(1)])
        with pytest.raises(RuntimeError, match="background") as info:
            gen.poll(timeout=5)
        assert "engine died" in str(info.value.__cause__)
        assert gen.num_inflight() == 0
    finally:
        gen.close()


def test_a_synchronous_failure_leaves_no_group_in_flight():
    gen, llm = make_gen()
    llm.fail_generate = True
    gen.submit([req(1)])
    with pytest.raises(RuntimeError, match="engine died"):
        gen.poll()
    assert gen.num_inflight() == 0


def test_generate_greedy_and_state():
    gen, llm = make_gen()
    out = gen.generate_greedy([[257, 50], [257, 51]], max_new_tokens=3)
    assert len(out) == 2 and all(1 <= len(c) <= 3 for c in out)
    p = llm.calls[-1][1][0]
    assert (p.temperature, p.n, p.max_tokens, p.stop_token_ids) == (0.0, 1, 3, [EOS])
    assert gen.generate_greedy([[257, 50], [257, 51]], max_new_tokens=3) == out
    gen.load_weights({"scale": torch.tensor(1.0)}, 4)
    state = gen.state_dict()
    other, _ = make_gen()
    other.load_state_dict(state)
    assert other.version == 4


def test_imports_without_vllm():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ImportError):
        VLLMGenerator(ModelConfig(), VLLMGenerationConfig(), 0, make_tokenizer())


# ---- the model directory vLLM loads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_dir_holds_config_tokenizer_and_the_policies_initial_weights(tmp_path, dtype):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from asyncrl.backends.torch import TorchPolicy
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.config import TorchTrainerConfig

    tok = make_tokenizer()
    model_cfg = ModelConfig(dtype=dtype)
    write_model_dir(model_cfg, tok, 5, tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert (cfg.model_type, cfg.vocab_size, cfg.eos_token_id, cfg.hidden_size) == ("llama", 259, EOS, 128)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("7=") == tok.encode("7=")
    saved = load_file(str(tmp_path / "model.safetensors"))
    ref = TorchPolicy(ModelConfig(), TorchTrainerConfig(), GRPOLoss(), 5, tok).export_weights()
    want = getattr(torch, dtype)
    for k, v in saved.items():
        assert v.dtype == want and torch.equal(v, ref[k].to(want)), k
    assert set(ref) - set(saved) <= {"lm_head.weight"}  # tied: saved once


# ---- the real engine (H200) ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    from asyncrl.backends.hf import build_hf_config, init_hf_model

    tok = make_tokenizer()
    model_cfg = ModelConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=128, dtype="float32")
    gen_cfg = VLLMGenerationConfig(max_new_tokens=12, temperature=1.0, gpu_memory_utilization=0.2)
    gen = VLLMGenerator(model_cfg, gen_cfg, 0, tok)
    hf = init_hf_model(build_hf_config(model_cfg, tok), 0).cuda()
    yield SimpleNamespace(gen=gen, hf=hf, tok=tok)
    gen.close()


def _hf_sampled_logprobs(hf, groups):
    from asyncrl.algorithms import token_logprobs

    got, ref = [], []
    torch.backends.cuda.matmul.allow_tf32 = False
    for g in groups:
        for ids, lps in zip(g.completion_ids, g.logprobs):
            seq = torch.tensor([g.prompt_ids + ids], device="cuda")
            with torch.no_grad():
                lp = token_logprobs(hf(input_ids=seq).logits.float(), seq)[0, len(g.prompt_ids):]
            ref.append(lp.cpu())
            got.append(torch.tensor(lps))
    return torch.cat(got), torch.cat(ref)


@pytest.mark.gpu
def test_real_vllm_samples_groups_with_logprobs_of_the_sampled_tokens(real):
    gen, tok = real.gen, real.tok
    prompts = [tok.encode(s) for s in ("7=", "hello", "abc>", "0123")]
    gen.submit([GenerationRequest(i, p, 4) for i, p in enumerate(prompts)])
    groups = gen.poll()
    assert [g.group_id for g in groups] == [0, 1, 2, 3]
    for g in groups:
        assert len(g.completion_ids) == 4
        for ids, lps, reason in zip(g.completion_ids, g.logprobs, g.finish_reasons):
            assert len(ids) == len(lps) and all(lp <= 0 and math.isfinite(lp) for lp in lps)
            assert (reason == "stop" and ids[-1] == EOS) or (reason == "length" and len(ids) == 12)
    got, ref = _hf_sampled_logprobs(real.hf, groups)
    assert (got - ref).abs().mean() < 1e-2  # fp32 engine vs fp32 transformers
    # per-group seeds: the same group samples the same completions again
    gen.submit([GenerationRequest(2, prompts[2], 4)])
    assert gen.poll()[0].completion_ids == groups[2].completion_ids


@pytest.mark.gpu
def test_real_vllm_weight_update_in_place(real):
    gen, tok = real.gen, real.tok
    original = {k: v.detach().clone() for k, v in real.hf.state_dict().items()}
    uniform = {k: (torch.zeros_like(v) if k in ("lm_head.weight", "model.embed_tokens.weight") else v)
               for k, v in original.items()}
    gen.load_weights(uniform, version=1)  # zero output layer: every token has logprob -log(259)
    assert gen.version == 1 and gen.last_sync_seconds < 5
    gen.submit([GenerationRequest(10, tok.encode("7="), 8)])
    (g,) = gen.poll()
    assert (g.gen_start_version, g.gen_end_version) == (1, 1)
    flat = torch.tensor([lp for row in g.logprobs for lp in row])
    torch.testing.assert_close(flat, torch.full_like(flat, -math.log(259)), atol=1e-4, rtol=0)
    gen.load_weights(original, version=2)
    gen.submit([GenerationRequest(11, tok.encode("7="), 8)])
    got, ref = _hf_sampled_logprobs(real.hf, gen.poll())
    assert (got - ref).abs().mean() < 1e-2


@pytest.mark.gpu
def test_real_vllm_abort_and_greedy(real):
    gen, tok = real.gen, real.tok
    gen.submit([GenerationRequest(20, tok.encode("ab"), 2), GenerationRequest(21, tok.encode("cd"), 2)])
    assert gen.abort([21]) == [21]
    assert [g.group_id for g in gen.poll()] == [20]
    prompts = [tok.encode("7="), tok.encode("xyz")]
    a, b = gen.generate_greedy(prompts, 6), gen.generate_greedy(prompts, 6)
    assert a == b and all(1 <= len(c) <= 6 for c in a)
