"""The embedded torch backend: tokenizer, model building, sampling with logprobs, weight sync, abort, threads,
exact save/restore."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from asyncrl.algorithms import GRPOLoss, LossConfig, make_train_batch
from asyncrl.backends.base import GenerationBackend, PolicyBackend, capabilities
from asyncrl.backends.hf import build_model
from asyncrl.backends.torch import TorchGenerator, TorchPolicy
from asyncrl.config import ModelConfig, TorchGenerationConfig, TorchTrainerConfig
from asyncrl.data import GenerationRequest
from asyncrl.tasks import build_task, evaluate
from asyncrl.tokenizer import build_tokenizer

SMALL = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def make(tok, seed=0, gen=None, loss=None, trainer=None, model=SMALL):
    policy = TorchPolicy(model, trainer or TorchTrainerConfig(lr=1e-2), GRPOLoss(loss), seed, tok)
    generator = TorchGenerator(model, gen or TorchGenerationConfig(max_new_tokens=4), seed, tok)
    return policy, generator


def requests(tok, texts, n=4, start=0):
    return [GenerationRequest(start + i, tok.encode(t), n) for i, t in enumerate(texts)]


def scored(groups, value=0.0):
    for g in groups:
        g.rewards = [value + 0.1 * i for i in range(len(g.completion_ids))]
    return groups


# ------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_is_bytes_plus_three_specials(tok):
    assert len(tok) == 259
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    ids = tok.encode("7= é")
    assert ids == [257, ord("7"), ord("="), ord(" "), 0xC3, 0xA9]
    assert tok.decode(ids + [258], skip_special_tokens=True) == "7= é"
    assert tok.batch_decode([[ord("a"), 258], [256, ord("b")]], skip_special_tokens=True) == ["a", "b"]


# --------------------------------------------------------------------------------------------- model
def test_build_model_is_deterministic_in_the_seed_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = build_model(SMALL, 259, 1), build_model(SMALL, 259, 1), build_model(SMALL, 259, 2)
    assert torch.equal(torch.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
    assert a.config.vocab_size == 259 and a.config.attention_dropout == 0.0
    default = build_model(ModelConfig(), 259, 0)
    assert 0.35e6 < sum(p.numel() for p in default.parameters()) < 0.45e6  # the 0.4M model of FACTS.md


def test_backends_satisfy_the_protocols(tok):
    policy, generator = make(tok)
    assert isinstance(policy, PolicyBackend) and isinstance(generator, GenerationBackend)
    assert generator.version == 0


# ---------------------------------------------------------------------------------------- generation
def test_poll_returns_groups_in_submission_order_with_shapes_and_logprobs(tok):
    _, gen = make(tok)
    gen.submit(requests(tok, ["abc=", "xyz="], n=3, start=10))
    assert gen.num_inflight() == 2
    groups = gen.poll()
    assert gen.num_inflight() == 0 and gen.poll() == []
    assert [g.group_id for g in groups] == [10, 11]
    for g in groups:
        assert len(g.completion_ids) == len(g.logprobs) == len(g.finish_reasons) == 3
        assert g.gen_start_version == g.gen_end_version == 0
        for ids, lps, reason in zip(g.completion_ids, g.logprobs, g.finish_reasons):
            assert 1 <= len(ids) <= 4 and len(lps) == len(ids)
            assert all(lp <= 0 for lp in lps)
            assert (reason == "stop") == (ids[-1] == 258) and 258 not in ids[:-1]
            assert reason == "stop" or len(ids) == 4


@pytest.mark.parametrize("gen_cfg", [
    TorchGenerationConfig(max_new_tokens=5),
    TorchGenerationConfig(max_new_tokens=3, temperature=0.7, top_p=0.9),
], ids=["t1", "t0.7-p0.9"])
def test_generator_logprobs_match_a_full_forward_of_the_policy(tok, gen_cfg):
    """Same seed, same weights: the generator's KV-cached logprobs are the policy's temperature-1 logprobs,
    also for prompts of different lengths (left padding in the generator, right padding in the policy)."""
    policy, gen = make(tok, gen=gen_cfg)
    gen.submit(requests(tok, ["abc=", "a=", "hello world="], n=4))
    batch = make_train_batch(scored(gen.poll()), LossConfig(), tok.pad_token_id)
    full = policy.logprobs(batch)
    assert torch.allclose(full, batch.gen_logprobs, atol=1e-5)
    assert (full * (1 - batch.loss_mask)).abs().sum() == 0


def test_top_p_keeps_samples_inside_the_nucleus(tok):
    # a nearly-greedy nucleus: every sample is the argmax token
    _, gen = make(tok, gen=TorchGenerationConfig(max_new_tokens=1, top_p=1e-6))
    greedy = gen.generate_greedy([tok.encode("q=")], 1)[0]
    gen.submit(requests(tok, ["q="], n=16))
    assert all(c == greedy for c in gen.poll()[0].completion_ids)


def test_top_k_samples_only_among_the_k_most_likely_tokens(tok):
    from asyncrl.backends.torch import sequence_logits

    policy, gen = make(tok, gen=TorchGenerationConfig(max_new_tokens=1, top_k=3, temperature=3.0))
    prompt = tok.encode("q=")
    gen.submit(requests(tok, ["q="], n=64))
    drawn = {c[0] for c in gen.poll()[0].completion_ids}
    with torch.no_grad():
        top3 = set(sequence_logits(policy.model, torch.tensor([prompt]))[0, -1].topk(3).indices.tolist())
    assert drawn <= top3 and len(drawn) > 1  # a hot temperature spreads the draws, top_k keeps them in three
    _, one = make(tok, gen=TorchGenerationConfig(max_new_tokens=4, top_k=1))
    one.submit(requests(tok, ["q=", "abc="], n=4))
    greedy = one.generate_greedy([tok.encode("q="), tok.encode("abc=")], 4)
    assert [g.completion_ids for g in one.poll()] == [[greedy[0]] * 4, [greedy[1]] * 4]


def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it(tok):
    """Without the stop, the same draws (the stop never changes the sampling stream); with it, each completion is
    cut right after the token whose decoded text first contains the string, finish reason 'stop'."""
    cfg = dict(max_new_tokens=24, temperature=2.0)
    _, free = make(tok, gen=TorchGenerationConfig(**cfg))
    free.submit(requests(tok, ["abc=", "q="], n=6))
    before = free.poll()
    rows = [c for g in before for c in g.completion_ids]
    # an ASCII character some completion reaches after its first token
    long = next(c for c in rows if any(32 <= t < 127 and t not in c[:j] for j, t in enumerate(c) if j >= 1))
    j = next(j for j, t in enumerate(long) if j >= 1 and 32 <= t < 127 and t not in long[:j])
    stop = chr(long[j])
    _, gen = make(tok, gen=TorchGenerationConfig(**cfg, stop=[stop]))
    gen.submit(requests(tok, ["abc=", "q="], n=6))
    after = gen.poll()
    cut_any = False
    for g0, g1 in zip(before, after):
        for c0, c1, r0, r1, l0, l1 in zip(g0.completion_ids, g1.completion_ids, g0.finish_reasons, g1.finish_reasons,
                                          g0.logprobs, g1.logprobs):
            assert c0[:len(c1)] == c1 and l0[:len(l1)] == l1  # same draws, same logprobs, cut short
            text = tok.decode(c1, skip_special_tokens=True)
            if stop in text:
                assert r1 == "stop" and stop not in tok.decode(c1[:-1], skip_special_tokens=True)
                cut_any |= len(c1) < len(c0)
            else:
                assert (c1, r1) == (c0, r0)
    assert cut_any
    assert [c for g in after for c in g.completion_ids][rows.index(long)] == long[:j + 1]
    prompts = [tok.encode(p) for p in ("abc=", "q=", "hello", "xyz>")]  # evaluation stops where sampling does
    for g0, g1 in zip(free.generate_greedy(prompts, 24), gen.generate_greedy(prompts, 24)):
        assert g0[:len(g1)] == g1
        assert g1 == g0 if stop not in tok.decode(g0, skip_special_tokens=True) else (
            stop in tok.decode(g1, skip_special_tokens=True) and stop not in tok.decode(g1[:-1], skip_special_tokens=True))


def test_sampling_is_deterministic_for_a_seed_and_differs_across_seeds(tok):
    def run(seed):
        _, gen = make(tok, seed=seed)
        out = []
        for step in range(3):
            gen.submit(requests(tok, ["abc=", "bca="], n=4, start=2 * step))
            out.append([(g.completion_ids, g.logprobs) for g in gen.poll()])
        return out

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_greedy_evaluation_draws_no_randomness(tok):
    _, a = make(tok)
    _, b = make(tok)
    a.generate_greedy([tok.encode("abc=")] * 3, 4)
    a.submit(requests(tok, ["abc="])), b.submit(requests(tok, ["abc="]))
    assert a.poll()[0].completion_ids == b.poll()[0].completion_ids
    assert a.generate_greedy([tok.encode("abc=")], 4) == b.generate_greedy([tok.encode("abc=")], 4)


def test_abort_removes_queued_groups_only(tok):
    _, gen = make(tok)
    gen.submit(requests(tok, ["a=", "b=", "c="]))
    assert gen.abort([1, 99]) == [1]
    assert gen.num_inflight() == 2
    assert [g.group_id for g in gen.poll()] == [0, 2]
    assert gen.abort([0, 2]) == []  # finished groups are not cancelled
    gen.submit(requests(tok, ["d="]))
    gen.close()
    assert gen.num_inflight() == 0 and gen.poll() == []


# --------------------------------------------------------------------------------------- weight sync
def _train_one_step(policy, tok, gen):
    gen.submit(requests(tok, ["abc=", "cab="], n=4))
    batch = make_train_batch(scored(gen.poll()), policy.loss.cfg, tok.pad_token_id)
    batch = replace(batch, prev_logprobs=policy.logprobs(batch))
    policy.begin_train_step()
    policy.train_microbatches(batch)
    return policy.finish_train_step()


def test_weight_sync_is_a_real_copy(tok):
    policy, gen = make(tok)
    _train_one_step(policy, tok, gen)
    exported = policy.export_weights()
    assert "lm_head.weight" in exported and "model.embed_tokens.weight" in exported
    gen.load_weights(exported, 1)
    assert gen.version == 1
    gen_state = gen.model.state_dict()
    assert all(torch.equal(gen_state[k], exported[k]) for k in exported)
    snapshot = {k: v.clone() for k, v in gen_state.items()}
    # mutate the policy and the exported dict: the generator must not move
    _train_one_step(policy, tok, gen)
    with torch.no_grad():
        for v in exported.values():
            v.add_(1.0)
    assert all(torch.equal(gen.model.state_dict()[k], snapshot[k]) for k in snapshot)
    assert not torch.equal(policy.model.state_dict()["model.norm.weight"], snapshot["model.norm.weight"])
    # and no storage is shared
    gen_ptrs = {p.data_ptr() for p in gen.model.parameters()}
    assert not gen_ptrs & {p.data_ptr() for p in policy.model.parameters()}


def test_load_weights_requires_every_weight(tok):
    policy, gen = make(tok)
    weights = policy.export_weights()
    del weights["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        gen.load_weights(weights, 1)


def test_weight_loads_never_interleave_a_generation(tok):
    """A loader thread flips between two very different weight sets while another thread generates: every group's
    logprobs must be exactly those of the single version it reports."""
    policy, gen = make(tok, gen=TorchGenerationConfig(max_new_tokens=4))
    w_even = policy.export_weights()
    w_odd = {k: v * 3.0 for k, v in w_even.items()}
    stop = threading.Event()
    errors = []

    def loader():
        version = 0
        while not stop.is_set():
            version += 1
            gen.load_weights(w_odd if version % 2 else w_even, version)

    results = []
    thread = threading.Thread(target=loader)
    thread.start()
    try:
        for i in range(25):
            gen.submit(requests(tok, ["abc=", "zz="], n=2, start=2 * i))
            results.extend(gen.poll())
    except Exception as err:  # pragma: no cover - reported below
        errors.append(err)
    finally:
        stop.set()
        thread.join()
    assert not errors and len(results) == 50
    check = {0: TorchPolicy(SMALL, TorchTrainerConfig(), GRPOLoss(), 0, tok),
             1: TorchPolicy(SMALL, TorchTrainerConfig(), GRPOLoss(), 0, tok)}
    check[1].model.load_state_dict(w_odd)
    versions = set()
    for g in results:
        assert g.gen_start_version == g.gen_end_version
        versions.add(g.gen_start_version % 2)
        batch = make_train_batch(scored([g]), LossConfig(), tok.pad_token_id)
        assert torch.allclose(check[g.gen_start_version % 2].logprobs(batch), batch.gen_logprobs, atol=1e-4)
    assert len({g.gen_start_version for g in results}) > 1


# ------------------------------------------------------------------------------------- training state
def test_policy_metrics_and_a_real_update(tok):
    policy, gen = make(tok)
    before = policy.export_weights()
    m = _train_one_step(policy, tok, gen)
    for key in ("loss", "grad_norm", "tokens", "is_weight_mean", "is_weight_max", "is_weight_min",
                "is_truncated_frac", "clip_frac", "kl", "entropy"):
        assert key in m
    assert m["tokens"] > 0 and m["grad_norm"] > 0 and m["entropy"] > 0
    assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy: generator == policy weights
    after = policy.export_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("loss", [
    LossConfig(),
    LossConfig(kl="k3", kl_coef=0.1, entropy_coef=0.03, normalisation="sequence", importance_correction="sequence",
               truncation="seq-mask-tis"),
], ids=["token-tis", "kl-entropy-sequence"])
def test_prev_logprobs_from_the_forward_train_exactly_as_a_separate_pass(tok, loss):
    """The policy takes ``prev_logprobs`` from its training forward when a batch has none (the controller then
    skips the no-grad pass): over steps of two chunks in micro-batches of 3, with generator logprobs off the
    policy's (importance weights away from 1), the weights and every step metric equal those of a policy given
    the separate pass's logprobs, bit for bit."""
    trainer = TorchTrainerConfig(lr=1e-2, micro_batch_size=3)
    (given, gen), (forward, _) = make(tok, loss=loss, trainer=trainer), make(tok, loss=loss, trainer=trainer)
    assert capabilities(forward).prev_logprobs_from_forward  # what tells the controller to skip its pass
    for step in range(3):
        chunks = []
        for c in range(2):
            gen.submit(requests(tok, ["abc=", "cab=", "b="], n=4, start=10 * step + 3 * c))
            batch = make_train_batch(scored(gen.poll(), value=c), loss, tok.pad_token_id)
            chunks.append(replace(batch, gen_logprobs=(batch.gen_logprobs - 0.05 * (c + 1)) * batch.loss_mask))
        given.begin_train_step(), forward.begin_train_step()
        for batch in chunks:
            given.train_microbatches(replace(batch, prev_logprobs=given.logprobs(batch)))
            forward.train_microbatches(batch)
        a, b = given.finish_train_step(), forward.finish_train_step()
        assert a == b
        assert b["is_weight_mean"] != 1.0 and b["clip_frac"] == 0.0  # ratio exactly 1: one update per batch
        gen.load_weights(given.export_weights(), step + 1)
    wa, wb = given.export_weights(), forward.export_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_train_before_begin_is_an_error(tok):
    policy, _ = make(tok)
    with pytest.raises(RuntimeError):
        policy.finish_train_step()


def test_kl_uses_a_frozen_reference_of_the_initial_weights(tok):
    policy, gen = make(tok, loss=LossConfig(kl="k3", kl_coef=0.1))
    first = _train_one_step(policy, tok, gen)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    gen.load_weights(policy.export_weights(), 1)
    second = _train_one_step(policy, tok, gen)
    assert second["kl"] > 0
    ref = policy.ref_model.state_dict()
    init = build_model(SMALL, 259, 0).state_dict()
    assert all(torch.equal(ref[k], init[k]) for k in init)


def test_policy_and_generator_state_resume_exactly(tok):
    def fresh():
        return make(tok, seed=4)

    policy, gen = fresh()
    for step in range(2):
        _train_one_step(policy, tok, gen)
        gen.load_weights(policy.export_weights(), step + 1)
    saved_policy, saved_gen = policy.state_dict(), gen.state_dict()
    _train_one_step(policy, tok, gen)
    expected = policy.export_weights()

    policy2, gen2 = fresh()
    policy2.load_state_dict(saved_policy)
    gen2.load_state_dict(saved_gen)
    assert gen2.version == 2
    _train_one_step(policy2, tok, gen2)
    got = policy2.export_weights()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_evaluate_returns_reward_and_accuracy(tok):
    policy, gen = make(tok)
    task = build_task({"name": "copy_digit"})
    for backend in (policy, gen):
        ev = evaluate(backend, task, tok, max_new_tokens=2)
        assert set(ev) >= {"reward_mean", "accuracy"} and 0 <= ev["accuracy"] <= 1 and ev["n"] == 10


def test_long_tailed_limits_cut_each_group_at_its_own_drawn_length(tok):
    """``min_new_tokens_tail``: each group stops at the limit ``group_max_tokens`` draws from the seed and its id
    (the vLLM generator's function), and a completion is the prefix of the one the same stream gives without
    limits: the knobs change only where sampling stops."""
    from asyncrl.backends.sampling import group_max_tokens

    tail = TorchGenerationConfig(max_new_tokens=24, min_new_tokens_tail=2, length_sigma=1.0)
    _, with_tail = make(tok, gen=tail)
    _, without = make(tok, gen=TorchGenerationConfig(max_new_tokens=24))
    reqs = requests(tok, ["ab=", "cd=", "ef=", "gh=", "ij=", "kl="], n=3)
    for generator in (with_tail, without):
        generator.submit(reqs)
    cut, full = with_tail.poll(), without.poll()
    for a, b in zip(cut, full):
        limit = group_max_tokens(tail, 0, a.group_id)
        for c, lp, reason, c_full, lp_full in zip(a.completion_ids, a.logprobs, a.finish_reasons, b.completion_ids,
                                                  b.logprobs):
            assert len(c) <= limit and (reason == "stop" or len(c) == limit)
            assert c == c_full[:len(c)] and lp == lp_full[:len(c)]
    assert len({group_max_tokens(tail, 0, r.group_id) for r in reqs}) > 1  # the limits really differ
    assert len({len(c) for g in cut for c in g.completion_ids}) > 1
