"""The vLLM generation backend: its streaming, abort, weight-update (drain, inflight, staged) and failure logic
against a small fake of the vLLM surface it uses (``LLM.llm_engine``'s ``add_request`` / ``step`` /
``abort_request`` / ``has_unfinished_requests``, ``collective_rpc``, ``apply_model``, ``reset_prefix_cache``), and —
on a machine with CUDA and vLLM — the same against the real engine (``-m gpu``; skipped cleanly elsewhere)."""

from __future__ import annotations

import math
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from asyncrl.backends.base import GenerationBackend
from asyncrl.backends.vllm import VLLMGenerator, group_seed
from asyncrl.backends.vllm_build import write_model_dir
from asyncrl.config import ModelConfig, VLLMGenerationConfig
from asyncrl.data import GenerationRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
EOS = 258
VOCAB = 259


def make_tokenizer():
    from asyncrl.tokenizer import build_tokenizer

    return build_tokenizer()


# ---- a fake of the vLLM surface: LLM.llm_engine's request-level API, collective_rpc, apply_model -------------------


class FakeSamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, logprobs=None, seed=None,
                 stop=None, stop_token_ids=None, detokenize=True, output_kind=None):
        self.n, self.temperature, self.top_p, self.max_tokens = n, temperature, top_p, max_tokens
        self.logprobs, self.seed, self.stop_token_ids, self.detokenize = logprobs, seed, stop_token_ids, detokenize
        self.output_kind, self.top_k, self.stop = output_kind, top_k, list(stop or [])
        if self.stop and not detokenize:  # vLLM's own rule: it matches stop strings on the text it decodes
            raise ValueError("stop strings are only supported when detokenize is True")


class FakeEngine:
    """vLLM's ``LLMEngine`` request API in miniature. Every ``step`` samples one token for each unfinished sequence
    (the first ``max_num_seqs`` of them, in arrival order, as vLLM's scheduler would), from a generator seeded by the
    request's seed + sample index, so a sequence's tokens do not depend on what else runs; a token's logprob is
    ``-scale``, the weights loaded *when it is sampled*. A request is returned (FINAL_ONLY) at the step its last
    sample ends. ``on_step(engine)`` runs at the start of every step; ``fail_step`` makes the next step raise."""

    def __init__(self, llm):
        self.llm = llm
        self.requests: dict[str, dict] = {}
        self.added: list[tuple[str, int]] = []  # (request id, step count when added)
        self.aborted: list[str] = []
        self.steps = 0
        self.max_num_seqs: int | None = None
        self.on_step = None
        self.fail_step = False
        self.eos_p = 0.2  # chance that a sampled token is eos
        self.tokenizer = make_tokenizer()  # what vLLM detokenizes with, for stop strings
        self.seen: list[list[int]] = []  # prompts added so far (num_cached_tokens)

    def add_request(self, request_id, prompt, params):
        assert isinstance(request_id, str) and request_id not in self.requests
        assert set(prompt) == {"type", "prompt_token_ids"} and prompt["type"] == "token"
        assert params.output_kind == "final_only"  # one output per group, when it finished
        ids = list(prompt["prompt_token_ids"])
        samples = []
        for i in range(params.n):
            seed = sum(ids) if params.temperature == 0 else (params.seed if params.seed is not None else 12345) + i
            samples.append({"rng": torch.Generator().manual_seed(seed), "tokens": [], "lps": [], "reason": None})
        # a prefix cache in miniature: the longest prefix this prompt shares with an earlier one
        cached = max((next((i for i, (a, b) in enumerate(zip(ids, old)) if a != b), min(len(ids), len(old)))
                      for old in self.seen), default=0)
        self.seen.append(ids)
        self.requests[request_id] = {"params": params, "samples": samples, "prompt": ids, "cached": cached}
        self.added.append((request_id, self.steps))
        return request_id

    def has_unfinished_requests(self):
        return bool(self.requests)

    def abort_request(self, request_ids, internal=False):
        for rid in request_ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def step(self):
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self)
        if self.fail_step:
            self.fail_step = False
            raise RuntimeError("engine died")
        budget = self.max_num_seqs if self.max_num_seqs is not None else 10**9
        outputs = []
        for rid, req in list(self.requests.items()):
            p = req["params"]
            for s in req["samples"]:
                if s["reason"] is not None or budget == 0:
                    continue
                budget -= 1
                t = int(torch.randint(0, VOCAB, (1,), generator=s["rng"]))
                if float(torch.rand(1, generator=s["rng"])) < self.eos_p:
                    t = EOS
                s["tokens"].append(t)
                s["lps"].append({t: SimpleNamespace(logprob=-self.llm.scale, rank=1)})
                if p.stop_token_ids and t in p.stop_token_ids:
                    s["reason"] = "stop"
                elif p.stop and any(x in self.tokenizer.decode(s["tokens"], skip_special_tokens=True) for x in p.stop):
                    s["reason"] = "stop"  # as vLLM: the token that completes a stop string ends the sequence
                elif len(s["tokens"]) >= p.max_tokens:
                    s["reason"] = "length"
            if all(s["reason"] is not None for s in req["samples"]):
                del self.requests[rid]
                comps = [SimpleNamespace(index=i, token_ids=s["tokens"], finish_reason=s["reason"],
                                         logprobs=s["lps"] if p.logprobs is not None else None)
                         for i, s in enumerate(req["samples"])]
                outputs.append(SimpleNamespace(request_id=rid, finished=True, prompt_token_ids=req["prompt"],
                                               num_cached_tokens=req["cached"],
                                               outputs=comps[::-1]))  # any order: sorted by index
        return outputs


class FakeLLM:
    """The ``vllm.LLM`` around a ``FakeEngine``: in-place weight loads set ``scale`` from the weight ``"scale"``
    (other weights, such as a real policy's, leave it)."""

    def __init__(self):
        self.scale = 1.0
        self.log: list[str] = []
        self.fail_reload = False
        self.llm_engine = FakeEngine(self)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.log.append(method)
        assert method == "reload_weights" and not args
        items = kwargs["weights_iterator"]
        assert isinstance(items, list) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in items)
        if self.fail_reload:
            raise RuntimeError("reload failed")
        self.loaded = dict(items)
        if "scale" in self.loaded:
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

    def generate(self, prompts, params, use_tqdm=True):
        """``LLM.generate`` as vLLM runs it: every request into the engine, then steps until none is left."""
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            self.llm_engine.add_request(f"generate-{i}", {"type": "token", **prompt}, sp)
        outs = {}
        while self.llm_engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in self.llm_engine.step())
        return [outs[f"generate-{i}"] for i in range(len(prompts))]


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


def step_until_running(gen, llm, steps: int = 2) -> None:
    """Submitted groups into the engine and ``steps`` engine steps run, none of them finished yet: from here on
    the engine samples no eos, so every completion runs to ``max_new_tokens``."""
    llm.llm_engine.eos_p = 0.0
    target = llm.llm_engine.steps + steps
    llm.llm_engine.on_step = lambda engine: None
    while llm.llm_engine.steps < target:
        assert gen.poll(timeout=1e-9) == []


# ---- request / response -------------------------------------------------------------------------------------------


def test_prefix_cache_tokens_count_each_finished_groups_prompt_and_what_the_engine_served_from_cache():
    # what bench_agents_gpu reads for vLLM's prefix-cache hits: vLLM's per-request num_cached_tokens, summed
    gen, _ = make_gen(seed=3)
    assert gen.prefix_cache_tokens() == {"queries": 0, "hits": 0}
    gen.submit([req(1, n=2, prompt=(257, 51, 52))])
    gen.poll()
    gen.submit([req(2, n=2, prompt=(257, 51, 52, 53, 54))])  # a later turn: the earlier prompt is its prefix
    gen.poll()
    assert gen.prefix_cache_tokens() == {"queries": 3 + 5, "hits": 3}


def test_satisfies_the_protocol():
    gen, _ = make_gen()
    assert isinstance(gen, GenerationBackend)


def test_submit_only_queues_and_poll_runs_the_groups_through_the_engine():
    gen, llm = make_gen(seed=3)
    engine = llm.llm_engine
    gen.submit([req(7, n=4), req(8, n=2, prompt=(257, 51))])
    assert engine.added == [] and gen.num_inflight() == 2
    groups = gen.poll()  # timeout 0: everything in flight, to the end
    assert gen.num_inflight() == 0 and not engine.requests
    assert [rid for rid, _ in engine.added] == ["group-7", "group-8"]  # one request a group, both at once
    assert sorted(g.group_id for g in groups) == [7, 8]
    g = next(g for g in groups if g.group_id == 7)
    assert g.prompt_ids == [257, 49, 50] and len(g.completion_ids) == 4 and len(g.logprobs) == 4
    for ids, lps, reason in zip(g.completion_ids, g.logprobs, g.finish_reasons):
        assert len(ids) == len(lps) and all(lp == -1.0 for lp in lps)
        if reason == "stop":
            assert ids[-1] == EOS and EOS not in ids[:-1]
        else:
            assert reason == "length" and len(ids) == 6 and EOS not in ids
    assert (g.gen_start_version, g.gen_end_version) == (0, 0)
    assert gen.poll() == [] and engine.steps == max(len(c) for g in groups for c in g.completion_ids)


def test_sampling_params_of_a_group():
    gen, llm = make_gen(seed=3)
    p = gen._params(req(7, n=4))
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.logprobs) == (4, 0.9, 0.95, 6, 0)
    assert p.stop_token_ids == [EOS] and p.seed == group_seed(3, 7) and gen._params(req(8)).seed == group_seed(3, 8)
    assert p.detokenize is False and p.output_kind == "final_only"
    assert p.top_k == 0 and p.stop == []  # off: vLLM's defaults, not passed


def test_logprobs_come_flat_where_vllm_has_it_and_are_read_from_the_flat_lists():
    """vLLM >= 0.12 returns a completion's logprobs as flat lists (``flat_logprobs``): asked for where
    ``SamplingParams`` has the field, read straight from them, and position by position when they are not exactly
    one entry (the sampled token) a position."""
    from asyncrl.backends.vllm_requests import completion_logprobs, flat_logprobs

    class FlatParams(FakeSamplingParams):
        flat_logprobs = False

        def __init__(self, flat_logprobs=False, **kw):
            super().__init__(**kw)
            self.flat_logprobs = flat_logprobs

    assert flat_logprobs(FakeSamplingParams) == {} and flat_logprobs(FlatParams) == {"flat_logprobs": True}
    gen, _ = make_gen(seed=3)
    gen._sp = FlatParams
    assert gen._params(req(7)).flat_logprobs is True
    flat = SimpleNamespace(token_ids=[5, 9, 5], logprobs=[-0.5, -1.25, -2.0])
    assert completion_logprobs(flat, [5, 9, 5]) == [-0.5, -1.25, -2.0]

    class Listed(list):  # what a list of {token_id: logprob} positions is, with flat lists that do not match
        token_ids, logprobs = [5, 1, 9, 5], [-0.5, -3.0, -1.25, -2.0]

    per_position = Listed([{5: -0.5, 1: -3.0}, {9: -1.25}, {5: -2.0}])
    assert completion_logprobs(per_position, [5, 9, 5]) == [-0.5, -1.25, -2.0]


def test_top_k_and_stop_strings_reach_vllm_and_a_stop_ends_the_completion_at_its_token():
    """``generation.top_k`` and ``generation.stop`` become vLLM's ``top_k`` and ``stop`` (which vLLM matches on
    the text it detokenizes, so detokenizing is on exactly then); the group comes back cut at the stop."""
    tok = make_tokenizer()
    plain, llm = make_gen(seed=4, max_new_tokens=40)
    llm.llm_engine.eos_p = 0.02
    plain.submit([req(3, n=4)])
    (free,) = plain.poll()
    long = max(free.completion_ids, key=len)
    # an ASCII character that first appears after the completion's second token
    j = next(j for j, t in enumerate(long) if j >= 2 and 32 <= t < 127 and t not in long[:j])
    stop = chr(long[j])
    gen, llm = make_gen(seed=4, max_new_tokens=40, top_k=5, stop=[stop])
    llm.llm_engine.eos_p = 0.02
    p = gen._params(req(3, n=4))
    assert (p.top_k, p.stop, p.detokenize) == (5, [stop], True)
    gen.submit([req(3, n=4)])
    (cut,) = gen.poll()
    for before, after, reason in zip(free.completion_ids, cut.completion_ids, cut.finish_reasons):
        assert before[:len(after)] == after  # the same draws, cut short
        if reason == "stop" and after[-1] != EOS:
            assert stop in tok.decode(after, skip_special_tokens=True)
            assert stop not in tok.decode(after[:-1], skip_special_tokens=True)
        else:
            assert after == before and stop not in tok.decode(after, skip_special_tokens=True)
    i = free.completion_ids.index(long)
    assert cut.completion_ids[i] == long[:j + 1] and cut.finish_reasons[i] == "stop"
    from asyncrl.backends.vllm_requests import greedy_params

    # evaluation's requests carry the stop strings too (and detokenize: vLLM refuses them otherwise)
    greedy = greedy_params(FakeSamplingParams, 40, EOS, "final_only", [stop])
    assert (greedy.stop, greedy.detokenize, greedy.temperature) == ([stop], True, 0.0)
    (ids,) = gen.generate_greedy([[257, 49, 50]], 40)
    assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)


def test_samples_are_returned_in_index_order_and_depend_only_on_the_group():
    gen, _ = make_gen(seed=1)
    gen.submit([req(5)])
    alone = gen.poll()[0]
    gen.submit([req(1), req(5), req(9)])
    together = {g.group_id: g for g in gen.poll()}
    assert together[5].completion_ids == alone.completion_ids  # per-group seeds: other groups do not matter
    assert together[1].completion_ids != alone.completion_ids
    other_seed, _ = make_gen(seed=2)
    other_seed.submit([req(5)])
    assert other_seed.poll()[0].completion_ids != alone.completion_ids


def test_a_group_returns_when_its_last_completion_ends_and_a_new_one_joins_the_running_engine(monkeypatch):
    """No waves: a streaming poll returns each group at the step its last completion ended, while others go on,
    and a group submitted meanwhile enters the engine at the next step instead of waiting for them."""
    import asyncrl.backends.vllm as backend

    monkeypatch.setattr(backend, "STREAM_SLICE_S", 0.0)  # return at the first step a group ended in
    gen, llm = make_gen(seed=0, max_new_tokens=40)
    engine = llm.llm_engine
    gen.submit([req(g, n=2) for g in range(6)])
    first = gen.poll(timeout=5)
    assert first and gen.num_inflight() == 6 - len(first) and engine.requests  # the others still run
    ended = engine.steps
    for g in first:
        assert max(len(c) for c in g.completion_ids) == ended  # it ended in the step poll returned after
    gen.submit([req(10, n=2)])
    rest = gen.poll(timeout=5)
    assert dict(engine.added)["group-10"] == ended  # added before the next step, others still running
    while gen.num_inflight():
        rest += gen.poll(timeout=5)
    done = first + rest
    assert sorted(g.group_id for g in done) == [0, 1, 2, 3, 4, 5, 10]
    lengths = [max(len(c) for c in g.completion_ids) for g in done if g.group_id != 10]
    assert lengths[:len(first)] == [min(lengths)] * len(first) and len(set(lengths)) > 1


def test_the_engine_decodes_only_max_num_seqs_sequences_at_once_and_queues_the_rest():
    gen, llm = make_gen(seed=0, max_new_tokens=20)
    llm.llm_engine.max_num_seqs = 4
    gen.submit([req(g, n=4) for g in range(3)])
    groups = gen.poll()
    assert sorted(g.group_id for g in groups) == [0, 1, 2]
    alone, _ = make_gen(seed=0, max_new_tokens=20)
    alone.submit([req(2, n=4)])
    assert alone.poll()[0].completion_ids == next(g for g in groups if g.group_id == 2).completion_ids


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


def test_weight_update_must_be_drain_or_inflight():
    with pytest.raises(ValueError, match="weight_update"):
        VLLMGenerationConfig(weight_update="sometimes")
    assert VLLMGenerationConfig().weight_update == "drain"


def test_drain_lets_the_groups_submitted_before_a_load_finish_under_the_old_weights():
    gen, llm = make_gen(max_new_tokens=30)
    engine = llm.llm_engine
    gen.submit([req(1), req(2)])
    step_until_running(gen, llm)
    assert len(engine.requests) == 2
    late = []

    def submit_during_the_drain(engine):  # another thread's dispatch, while the load drains
        if not late:
            late.append(gen.submit([req(3)]))

    engine.on_step = submit_during_the_drain
    gen.load_weights({"scale": torch.tensor(3.0)}, version=1)
    assert not engine.requests and "group-3" not in dict(engine.added)  # drained; the late group was held back
    assert gen.version == 1 and gen.num_inflight() == 3
    old = gen.poll()
    assert sorted(g.group_id for g in old) == [1, 2, 3]
    for g in old:
        versions = (0, 0) if g.group_id != 3 else (1, 1)  # every group is generated by one version
        assert (g.gen_start_version, g.gen_end_version) == versions
        assert all(lp == -(1.0 if g.group_id != 3 else 3.0) for row in g.logprobs for lp in row)


def test_step_metrics_count_the_tokens_a_drain_generates_per_second_the_engine_was_stepped():
    """On one GPU a run's weight load drains the groups in flight on the trainer's thread, outside any poll: the
    generator's own gen_tokens_per_s counts those tokens over the seconds its engine was stepped (a poll-only
    count would divide them by almost nothing)."""
    gen, llm = make_gen(max_new_tokens=30)
    gen.submit([req(1), req(2)])
    step_until_running(gen, llm)
    llm.llm_engine.on_step = lambda engine: time.sleep(0.002)  # each step takes >= 2 ms
    gen.step_metrics()  # the window starts here
    before = llm.llm_engine.steps
    gen.load_weights({"scale": torch.tensor(3.0)}, version=1)  # steps to the end, no poll
    steps = llm.llm_engine.steps - before
    assert steps > 10
    tokens = sum(g.num_tokens for g in gen.poll())
    rate = gen.step_metrics()["gen_tokens_per_s"]
    assert tokens / (5 * steps * 0.002) < rate <= tokens / (steps * 0.002)  # every token, over the drain's seconds
    assert math.isnan(gen.step_metrics()["gen_tokens_per_s"])  # nothing since: no rate


def test_inflight_loads_between_two_steps_and_each_token_keeps_the_logprob_it_was_sampled_with():
    gen, llm = make_gen(max_new_tokens=30, weight_update="inflight")
    engine = llm.llm_engine
    gen.submit([req(1, n=2)])
    step_until_running(gen, llm, steps=2)
    gen.load_weights({"scale": torch.tensor(3.0)}, version=1)
    assert gen.version == 1 and "group-1" in engine.requests  # no drain: it goes on under the new weights
    (g,) = gen.poll()
    assert (g.gen_start_version, g.gen_end_version) == (0, 1)
    for row in g.logprobs:
        assert row[:2] == [-1.0, -1.0] and all(lp == -3.0 for lp in row[2:])  # sampled before / after the load
    gen.submit([req(2)])
    assert gen.poll()[0].gen_start_version == 1


def test_staged_weights_wait_for_the_drain_and_later_groups_wait_for_them():
    gen, llm = make_gen(max_new_tokens=30)
    engine = llm.llm_engine
    gen.submit([req(1)])
    step_until_running(gen, llm)
    buffers = {"scale": torch.tensor(0.0)}
    gen.stage_weights(buffers, 1, lambda: buffers["scale"].fill_(3.0))
    assert "reload_weights" not in llm.log  # the receive did not wait for the engine, nor touched it
    assert gen.version == 1  # what a group dispatched now runs with
    gen.submit([req(2)])
    done = []
    while gen.num_inflight():
        done += gen.poll(timeout=5)
        if "group-2" in dict(engine.added):
            assert "group-1" not in engine.requests  # group 2 entered only after group 1 ended and the swap
    g1, g2 = sorted(done, key=lambda g: g.group_id)
    assert (g1.gen_start_version, g1.gen_end_version) == (0, 0) and all(lp == -1.0 for lp in g1.logprobs[0])
    assert (g2.gen_start_version, g2.gen_end_version) == (1, 1) and all(lp == -3.0 for lp in g2.logprobs[0])
    (parts,) = gen.sync_parts()
    assert parts["version"] == 1 and parts["swap_wait_s"] > 0 and parts["reset_s"] == 0


def test_staged_weights_under_inflight_swap_in_before_the_next_step():
    gen, llm = make_gen(max_new_tokens=30, weight_update="inflight")
    gen.submit([req(1, n=1)])
    step_until_running(gen, llm, steps=3)
    gen.stage_weights({"scale": torch.tensor(2.0)}, 1)
    assert llm.scale == 1.0
    (g,) = gen.poll()
    assert g.logprobs[0][:3] == [-1.0] * 3 and all(lp == -2.0 for lp in g.logprobs[0][3:])
    assert (g.gen_start_version, g.gen_end_version) == (0, 1)


@pytest.mark.parametrize("background", [False, True])
def test_staged_weights_count_at_once_load_before_new_groups_and_a_newer_set_replaces_an_older_one(background):
    """The receive returns without loading (the trainer's sync does not wait for the engine); ``version`` says the
    staged one at once, and no group starts before it is loaded."""
    gen, llm = make_gen(background=background, max_new_tokens=30)
    try:
        gen.stage_weights({"scale": torch.tensor(2.0)}, 1)
        assert gen.version == 1  # a synchronous run sees the version move before its sync returns
        gen.submit([req(1)])
        (g,) = gen.poll(timeout=5) or gen.poll(timeout=5)
        assert g.gen_start_version == 1 and llm.scale == 2.0 and llm.log == ["reload_weights"]
        gen.stage_weights({"scale": torch.tensor(3.0)}, 2)
        gen.stage_weights({"scale": torch.tensor(4.0)}, 3)
        assert gen.version == 3
        gen.submit([req(2)])
        (g,) = gen.poll(timeout=5) or gen.poll(timeout=5)
        assert g.gen_start_version == 3 and llm.scale == 4.0
        loaded = [p["version"] for p in gen.sync_parts()]
        if background:  # the engine's own thread swaps a staged set in as soon as it is idle: 2 may have loaded
            assert loaded in ([1, 3], [1, 2, 3])
        else:  # nothing swapped between the two receives: 3 replaced 2 unloaded
            assert loaded == [1, 3]
    finally:
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


def test_loads_keep_vllms_per_load_log_lines_quiet_but_errors_show():
    import logging

    gen, llm = make_gen()
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append((record.levelno, record.getMessage()))

    vllm_log = logging.getLogger("vllm")
    handler, level = Catch(), vllm_log.level
    vllm_log.addHandler(handler)
    vllm_log.setLevel(logging.INFO)
    child = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    real = llm.collective_rpc

    def noisy(method, **kw):
        child.warning("%s: Failed to load weights", "RotaryEmbedding")
        child.info("reloaded")
        child.error("a real error")
        return real(method, **kw)

    llm.collective_rpc = noisy
    try:
        gen.load_weights({"scale": torch.tensor(2.0)}, 1)
        child.info("after the load")
    finally:
        vllm_log.removeHandler(handler)
        vllm_log.setLevel(level)
    assert seen == [(logging.ERROR, "a real error"), (logging.INFO, "after the load")]


def test_long_tailed_completion_limits_are_per_group_and_seeded():
    gen, llm = make_gen(max_new_tokens=200, min_new_tokens_tail=8, length_sigma=1.0)
    limits = [gen._params(req(gid, n=1)).max_tokens for gid in range(400)]
    assert all(8 <= m <= 200 for m in limits)
    median = sorted(limits)[len(limits) // 2]
    assert median < 20 and max(limits) > 5 * median  # a long tail, not a spread around the mean
    again, _ = make_gen(max_new_tokens=200, min_new_tokens_tail=8, length_sigma=1.0)
    assert [again._params(req(gid, n=1)).max_tokens for gid in reversed(range(400))][::-1] == limits
    fixed, _ = make_gen(max_new_tokens=7)
    assert fixed._params(req(1)).max_tokens == 7
    with pytest.raises(ValueError, match="min_new_tokens_tail 300 exceeds max_new_tokens 200"):
        VLLMGenerationConfig(max_new_tokens=200, min_new_tokens_tail=300)


def test_kv_pool_bytes_follow_the_token_budget():
    from asyncrl.backends.vllm_build import kv_cache_bytes

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
    assert [rid for rid, _ in llm.llm_engine.added] == ["group-1"]
    assert gen.abort([1]) == []  # finished and returned: nothing to cancel


def test_abort_frees_a_running_group_in_the_engine():
    gen, llm = make_gen(max_new_tokens=30)
    engine = llm.llm_engine
    gen.submit([req(1), req(2)])
    step_until_running(gen, llm)
    assert gen.num_inflight() == 2
    assert gen.abort([2]) == [2]
    assert engine.aborted == ["group-2"] and "group-2" not in engine.requests  # its KV blocks are freed now
    assert gen.abort([2]) == []  # already cancelled
    assert gen.num_inflight() == 1
    assert [g.group_id for g in gen.poll()] == [1]
    assert gen.num_inflight() == 0


def test_finished_groups_waiting_for_poll_are_not_cancelled():
    gen, llm = make_gen(background=True)
    try:
        gen.submit([req(4)])
        wait_until(lambda: gen._done != [])
        assert gen.abort([4]) == [] and gen.num_inflight() == 1
        assert [g.group_id for g in gen.poll(timeout=1)] == [4]
    finally:
        gen.close()


# ---- failures, background thread, greedy ---------------------------------------------------------------------------


def test_a_failing_engine_step_surfaces_in_poll_and_leaves_no_group_in_flight():
    gen, llm = make_gen(max_new_tokens=30)
    engine = llm.llm_engine
    gen.submit([req(1), req(2)])
    step_until_running(gen, llm)
    engine.fail_step = True
    with pytest.raises(RuntimeError, match="engine step failed: engine died"):
        gen.poll(timeout=5)
    assert gen.num_inflight() == 0 and not engine.requests  # aborted in the engine; the caller re-sends them
    gen.submit([req(1)])  # the same group again: a fresh request
    assert [g.group_id for g in gen.poll()] == [1]


def test_background_mode_steps_the_engine_in_its_own_thread():
    gen, llm = make_gen(background=True, max_new_tokens=30)
    gate = threading.Event()
    llm.llm_engine.on_step = lambda engine: gate.wait(10)
    try:
        assert gen.poll(timeout=None) == []  # nothing in flight: returns at once
        gen.submit([req(1), req(2)])
        wait_until(lambda: llm.llm_engine.steps > 0)
        t0 = time.monotonic()
        assert gen.poll(timeout=0.1) == []  # still generating: waits at most the timeout
        assert time.monotonic() - t0 < 2
        gate.set()
        got = []
        while len(got) < 2:
            got += gen.poll(timeout=5)
        assert sorted(g.group_id for g in got) == [1, 2]
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
        llm.llm_engine.fail_step = True
        gen.submit([req(1)])
        with pytest.raises(RuntimeError, match="background") as info:
            gen.poll(timeout=5)
        assert "engine died" in str(info.value.__cause__)
        assert gen.num_inflight() == 0
    finally:
        gen.close()


def test_a_weight_load_in_another_thread_gets_its_turn_between_steps_of_the_background_engine():
    gen, llm = make_gen(background=True, max_new_tokens=30, weight_update="inflight")
    # From its third step on, the engine steps only once the load waits for its turn (or is done): on a loaded
    # machine a fixed pace let the group finish before the loading thread was scheduled at all.
    turn = lambda: gen._wanted > 0 or gen.version == 1  # noqa: E731
    llm.llm_engine.on_step = lambda engine: engine.steps < 2 or wait_until(turn)
    try:
        gen.submit([req(1, n=1)])
        wait_until(lambda: llm.llm_engine.steps >= 2)
        gen.load_weights({"scale": torch.tensor(2.0)}, 1)  # returns while the group still runs
        assert gen.version == 1
        got = []
        while not got:
            got = gen.poll(timeout=5)
        (g,) = got
        assert g.gen_end_version == 1 and g.logprobs[0][0] == -1.0 and g.logprobs[0][-1] == -2.0
    finally:
        gen.close()


def test_sampled_evaluation_is_seeded_by_prompt_and_runs_beside_the_groups():
    """``Controller.evaluate(temperature > 0)`` on vLLM: ``n`` completions a prompt, rows in prompt order, the same
    for the same seed whatever else runs, another seed samples otherwise; the running group is not disturbed."""
    from asyncrl.backends.base import capabilities

    assert capabilities(VLLMGenerator).sampled_evaluation
    gen, llm = make_gen(max_new_tokens=30)
    gen.submit([req(1)])
    step_until_running(gen, llm)
    prompts = [[257, 50], [257, 51], [257, 52]]
    out = gen.generate_sampled(prompts, 4, 0.7, seed=11, max_new_tokens=5)
    assert len(out) == 12 and all(1 <= len(c) <= 5 for c in out)
    added = [r for r, _ in llm.llm_engine.added if r.startswith("eval-")]
    params = [llm.llm_engine.requests.get(r) for r in added]
    assert len(added) == 3 and params == [None] * 3  # one request a prompt, all finished
    assert gen.generate_sampled(prompts[1:], 4, 0.7, seed=12, max_new_tokens=5) == out[4:]  # seed + index
    assert gen.generate_sampled(prompts, 4, 0.7, seed=11, max_new_tokens=5) == out
    assert gen.generate_sampled(prompts, 4, 0.7, seed=99, max_new_tokens=5) != out
    assert gen.generate_sampled([], 4, 0.7, seed=11) == []
    assert [g.group_id for g in gen.poll()] == [1]


def test_generate_greedy_runs_beside_the_groups_and_loses_none_of_them():
    gen, llm = make_gen(max_new_tokens=30)
    gen.submit([req(1)])
    step_until_running(gen, llm)
    out = gen.generate_greedy([[257, 50], [257, 51]], max_new_tokens=3)
    assert len(out) == 2 and all(1 <= len(c) <= 3 for c in out)
    assert gen.generate_greedy([[257, 50], [257, 51]], max_new_tokens=3) == out
    assert [g.group_id for g in gen.poll()] == [1]  # the running group went on and is returned as usual
    gen.load_weights({"scale": torch.tensor(1.0)}, 4)
    state = gen.state_dict()
    other, _ = make_gen()
    other.load_state_dict(state)
    assert other.version == 4


# ---- through the controller (CPU: a torch policy, the generator around the fake engine) ---------------------------


def make_controller(sampler, weight_update="drain", step_s=0.0, **over):
    from asyncrl import Controller, load_config
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends.torch import TorchPolicy
    from asyncrl.tasks import build_task

    cfg = load_config("quickstart", sampler=sampler, eval_every=None, groups_per_step=4, group_size=4,
                      generation={"backend": "vllm", "max_new_tokens": 6, "weight_update": weight_update}, **over)
    tok = make_tokenizer()
    torch.manual_seed(cfg.seed)
    policy = TorchPolicy(cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok)
    llm = FakeLLM()
    if step_s:
        llm.llm_engine.on_step = lambda engine: time.sleep(step_s)
    gen = VLLMGenerator(cfg.model, cfg.generation, cfg.seed, tok, llm=llm, sampling_params_cls=FakeSamplingParams)
    return Controller(cfg, build_task(cfg.task), policy, gen, tok), llm


def schedule(ctrl) -> list[tuple]:
    """Which groups each step trained, at which stamp, generated by which weights (the commit rows' words)."""
    trace = ctrl.trace
    spans = {int(r.group_id): r.reason.split("weights ")[1] for r in trace[trace.event == "commit"].itertuples()}
    picked = trace[trace.event == "select"]
    return [(int(r.trainer_version), int(r.group_id), int(r.weight_version), spans[int(r.group_id)])
            for r in picked.itertuples()]


@pytest.mark.parametrize("sampler", [{"name": "weight_fifo", "max_staleness_versions": 1},
                                     {"name": "in_order", "max_lookahead_versions": 1}])
def test_drain_keeps_a_threaded_runs_schedule_independent_of_timing(sampler):
    """Two threaded runs of one seed, the engine's steps paced differently: the same groups trained at the same
    steps, each generated wholly by the version it was stamped with."""
    runs = []
    for step_s in (0.0, 0.002):
        ctrl, _ = make_controller(sampler, "drain", step_s=step_s)
        ctrl.run(5, progress=False)
        runs.append(schedule(ctrl))
    assert runs[0] == runs[1] and len(runs[0]) == 5 * 4
    assert all(span == f"{w}..{w}" for _, _, w, span in runs[0])


def test_inflight_runs_and_never_judges_a_group_newer_than_its_oldest_tokens():
    ctrl, _ = make_controller({"name": "weight_fifo", "max_staleness_versions": 1}, "inflight", step_s=0.002)
    m = ctrl.run(5, progress=False)
    assert len(m) == 5
    for _, _, w, span in schedule(ctrl):
        start, end = map(int, span.split(".."))
        assert w <= start <= end  # lag T - w counts from no later than the oldest weights a group contains


def test_a_failing_engine_step_is_a_fault_and_its_groups_are_sent_again():
    ctrl, llm = make_controller({"name": "in_order", "max_lookahead_versions": 0})
    engine = llm.llm_engine

    def fail_once(engine, state={"n": 0}):
        state["n"] += 1
        engine.fail_step = state["n"] == 3

    engine.on_step = fail_once
    for _ in range(6):
        ctrl.tick()
    trace = ctrl.trace
    faults = trace[trace.event == "fault"]
    assert faults.detail.str.contains("engine step failed: engine died").any()
    assert faults.reason.str.contains("re-dispatched").any()  # nothing lost: the groups go again
    assert ctrl.trainer_version >= 2 and not (trace.event == "skip").any()


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
def test_real_vllm_streams_groups_and_abort_frees_a_running_one(real):
    gen, tok = real.gen, real.tok
    long = gen.gen_cfg
    gen.gen_cfg = long.model_copy(update={"max_new_tokens": 100})  # per-request settings: read at every submit
    try:
        gen.submit([GenerationRequest(30, tok.encode("ab"), 2), GenerationRequest(31, tok.encode("cd"), 2)])
        while not gen._running:
            assert gen.poll(timeout=1e-6) == []
        assert gen.engine.get_num_unfinished_requests() == 4  # two groups of two sequences, running
        assert gen.abort([31]) == [31]
        assert gen.engine.get_num_unfinished_requests() == 2  # the aborted group's sequences are gone at once
        (g,) = gen.poll()
        assert g.group_id == 30 and gen.engine.get_num_unfinished_requests() == 0
    finally:
        gen.gen_cfg = long


@pytest.mark.gpu
def test_real_vllm_inflight_load_between_steps_keeps_each_tokens_logprob(real):
    gen, tok = real.gen, real.tok
    original = {k: v.detach().clone() for k, v in real.hf.state_dict().items()}
    uniform = {k: (torch.zeros_like(v) if k in ("lm_head.weight", "model.embed_tokens.weight") else v)
               for k, v in original.items()}
    long = gen.gen_cfg
    gen.gen_cfg = long.model_copy(update={"max_new_tokens": 64, "weight_update": "inflight"})  # read at every load
    try:
        base = gen.version
        gen.submit([GenerationRequest(40, tok.encode("7="), 1)])
        while not gen._running:
            assert gen.poll(timeout=1e-6) == []
        gen.poll(timeout=0.002)
        gen.load_weights(uniform, version=base + 1)  # between two steps; the group goes on
        (g,) = gen.poll()
        assert (g.gen_start_version, g.gen_end_version) == (base, base + 1)
        lps = torch.tensor(g.logprobs[0])
        uniform_lp = -math.log(259)
        after = (lps - uniform_lp).abs() < 1e-4  # sampled under the zero output layer
        assert after.any() and not after.all()
        first_after = int(after.nonzero()[0])
        assert after[first_after:].all()  # every token after the load, none before
    finally:
        gen.gen_cfg = long
        gen.load_weights(original, version=gen.version + 1)


@pytest.mark.gpu
def test_real_vllm_abort_and_greedy(real):
    gen, tok = real.gen, real.tok
    gen.submit([GenerationRequest(20, tok.encode("ab"), 2), GenerationRequest(21, tok.encode("cd"), 2)])
    assert gen.abort([21]) == [21]
    assert [g.group_id for g in gen.poll()] == [20]
    prompts = [tok.encode("7="), tok.encode("xyz")]
    a, b = gen.generate_greedy(prompts, 6), gen.generate_greedy(prompts, 6)
    assert a == b and all(1 <= len(c) <= 6 for c in a)


@pytest.mark.gpu
def test_real_vllm_sampled_evaluation(real):
    """``generate_sampled``: n completions a prompt from the real engine, reproducible by seed, varied across
    samples at temperature 1 (a random model), greedy unaffected."""
    gen, tok = real.gen, real.tok
    prompts = [tok.encode("7="), tok.encode("xyz")]
    a = gen.generate_sampled(prompts, 4, 1.0, seed=5, max_new_tokens=8)
    assert len(a) == 8 and all(1 <= len(c) <= 8 for c in a)
    assert gen.generate_sampled(prompts, 4, 1.0, seed=5, max_new_tokens=8) == a
    assert len({tuple(c) for c in a[:4]}) > 1  # four samples of one prompt, not one greedy answer four times
    assert gen.generate_greedy(prompts, 6) == gen.generate_greedy(prompts, 6)


@pytest.mark.gpu
def test_real_vllm_loads_an_exported_policy_and_samples_its_logprobs(tmp_path):
    """``save_pretrained``'s directory as ``model.hf_path``: vLLM loads it and samples the exported weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends.hf import export_pretrained
    from asyncrl.backends.torch import TorchPolicy
    from asyncrl.config import TorchTrainerConfig

    tok = make_tokenizer()
    model_cfg = ModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=128)
    policy = TorchPolicy(model_cfg, TorchTrainerConfig(), GRPOLoss(), 5, tok)
    with torch.no_grad():  # weights no seed gives: the directory, not a fresh init, is what vLLM must serve
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = export_pretrained(policy, model_cfg, tok, tmp_path / "hf")
    gen = VLLMGenerator(ModelConfig(hf_path=str(path)), VLLMGenerationConfig(max_new_tokens=8,
                                                                             gpu_memory_utilization=0.2), 0, tok)
    try:
        gen.submit([GenerationRequest(0, tok.encode("7="), 4)])
        got, ref = _hf_sampled_logprobs(policy.model.cuda(), gen.poll())
        assert (got - ref).abs().mean() < 1e-2
    finally:
        gen.close()


def test_close_aborts_what_the_engine_runs_shuts_its_core_down_and_drops_what_it_held():
    """The engine shares the process: its memory comes back only once its requests are gone, its core is shut down
    and nothing of it stays referenced (tests/gpu/conftest.py checks the memory on a GPU)."""
    gen, llm = make_gen(max_new_tokens=30)
    engine = llm.llm_engine
    calls = []
    engine.engine_core = SimpleNamespace(shutdown=lambda: calls.append(sorted(engine.requests)))
    gen.submit([req(1), req(2)])
    step_until_running(gen, llm)
    gen.stage_weights({"scale": torch.tensor(2.0)}, 1)  # received, not yet swapped in
    gen.close()
    assert sorted(engine.aborted) == ["group-1", "group-2"] and calls == [[]]  # aborted before the shutdown
    assert gen.llm is None and gen.engine is None and gen._staged is None and gen._running == {}
    gen.close()  # twice is once
    assert calls == [[]]


def test_a_failed_engine_shutdown_is_a_warning_naming_it_and_the_generator_is_closed():
    gen, llm = make_gen()

    def broken():
        raise RuntimeError("core gone")

    llm.llm_engine.engine_core = SimpleNamespace(shutdown=broken)
    with pytest.warns(RuntimeWarning, match="vLLM engine shutdown failed .*core gone.*GPU memory"):
        gen.close()
    with pytest.raises(RuntimeError, match="closed"):
        gen.submit([req(1)])
