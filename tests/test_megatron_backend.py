"""The Megatron-core policy backend's real code paths on CPU (gloo, world size 1; TP=2 / DP=2 in two processes).

Megatron-core on a CPU needs two workarounds, which ``init_parallel`` (asyncrl/backends/megatron_parallel.py) applies:
``torch.cuda.current_device`` answering ``"cpu"`` and an inference RNG tracker (dropout is 0, so it is never
consulted for randomness). The library itself runs unpatched on GPUs (tests/gpu/).
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'asyncrl[megatron]')")

from asyncrl.algorithms import GRPOLoss, LossConfig  # noqa: E402
from asyncrl.backends.base import PolicyBackend  # noqa: E402
from asyncrl.backends.hf import build_hf_config, init_hf_model  # noqa: E402
from asyncrl.backends.megatron import MegatronPolicy  # noqa: E402
from asyncrl.backends.megatron_weights import (  # noqa: E402
    ArchSpec,
    hf_to_megatron,
    megatron_to_hf,
    shard_for_tp,
    unshard_from_tp,
)
from asyncrl.config import MegatronTrainerConfig, ModelConfig, TorchTrainerConfig  # noqa: E402
from asyncrl.data import TrainBatch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_tokenizer():
    try:
        from asyncrl.tokenizer import build_tokenizer
    except ImportError:  # the project's tokenizer module is not there yet: the same byte-level design, here
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
        for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
            vocab[ch] = len(vocab)
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tk.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    return build_tokenizer()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_workarounds(monkeypatch_like) -> None:
    monkeypatch_like.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture(scope="module")
def megatron_cpu():
    """A world of one (gloo), Megatron's model-parallel groups (1, 1), and the CPU workarounds."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    mp = pytest.MonkeyPatch()
    _cpu_workarounds(mp)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    yield
    parallel_state.destroy_model_parallel()
    if owned:
        dist.destroy_process_group()
    mp.undo()


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def make_policy(tok, seed=0, lr=1e-3, grad_clip=1.0, micro_batch_size=None, loss=None, micro_batch_tokens=None,
                micro_batching=None, **model_kw):
    model_cfg = ModelConfig(**model_kw)
    knobs = {"micro_batching": micro_batching} if micro_batching is not None else {}
    trainer_cfg = MegatronTrainerConfig(device="cpu", lr=lr, grad_clip=grad_clip, micro_batch_size=micro_batch_size,
                                        micro_batch_tokens=micro_batch_tokens, optimizer="torch", **knobs)
    return MegatronPolicy(model_cfg, trainer_cfg, GRPOLoss(loss), seed, tok)


def make_batch(B=8, prompt=4, completion=6, vocab=259, seed=0, ragged=True) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    S = prompt + completion
    ids = torch.randint(3, vocab, (B, S), generator=g)
    attn = torch.ones(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S)
    loss_mask[:, prompt:] = 1
    if ragged:  # right padding: completions of different lengths
        for i in range(B):
            n = completion - (i % 3)
            loss_mask[i, prompt + n:] = 0
            attn[i, prompt + n:] = 0
            ids[i, prompt + n:] = 0
    adv = torch.randn(B, generator=g)
    return TrainBatch(ids, attn, loss_mask, torch.zeros(B, S), adv, [B])


def with_logprobs(batch: TrainBatch, lp: torch.Tensor) -> TrainBatch:
    batch = replace(batch, prev_logprobs=lp.clone())
    batch = replace(batch, gen_logprobs=lp.clone())
    return batch


def hf_logprobs(model, batch: TrainBatch) -> torch.Tensor:
    from asyncrl.algorithms import token_logprobs

    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    return token_logprobs(logits, batch.input_ids) * batch.loss_mask


def weights(policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.model.named_parameters()}


# ---- the mapping, as pure tensor code ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_hf_megatron_mapping_round_trips(tok, model_type):
    from transformers import Qwen2Config

    if model_type == "llama":
        cfg = build_hf_config(ModelConfig(hidden_size=64, intermediate_size=96, num_attention_heads=8,
                                          num_key_value_heads=2, tie_word_embeddings=False), tok)
    else:
        cfg = Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    spec = ArchSpec(cfg)
    hf = dict(init_hf_model(cfg, seed=3).state_dict())
    back = megatron_to_hf(hf_to_megatron(hf, spec), spec)
    assert list(back) == list(hf)  # exactly LlamaForCausalLM/Qwen2ForCausalLM.state_dict()'s names, in order
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_interleaving_puts_each_groups_heads_together(tok):
    cfg = build_hf_config(ModelConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1), tok)
    spec = ArchSpec(cfg)
    d = spec.head_dim
    hf = dict(init_hf_model(cfg, seed=0).state_dict())
    qkv = hf_to_megatron(hf, spec)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    # group 0: query heads 0 and 1, key head 0, value head 0; then group 1
    expected = torch.cat([q[0:2 * d], k[0:d], v[0:d], q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert torch.equal(qkv, expected)
    gate_up = hf_to_megatron(hf, spec)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(gate_up, torch.cat([hf["model.layers.0.mlp.gate_proj.weight"],
                                           hf["model.layers.0.mlp.up_proj.weight"]]))


def test_tensor_parallel_sharding_round_trips(tok):
    cfg = build_hf_config(ModelConfig(hidden_size=64, intermediate_size=96, num_attention_heads=8,
                                      num_key_value_heads=4, tie_word_embeddings=False), tok)
    spec = ArchSpec(cfg)
    full = hf_to_megatron(dict(init_hf_model(cfg, 0).state_dict()), spec)
    for name, t in full.items():
        for tp in (1, 2, 4):
            padded = -(-spec.vocab_size // tp) * tp
            pieces = [shard_for_tp(name, t, r, tp, padded) for r in range(tp)]
            joined = unshard_from_tp(name, pieces)
            assert torch.equal(joined[: t.shape[0]], t), (name, tp)
    # SwiGLU: each rank holds [its gate rows; its up rows]
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    piece = shard_for_tp("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2, 260)
    assert torch.equal(piece, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))


# ---- the policy on Megatron-core ----------------------------------------------------------------------------------


def test_satisfies_the_protocol(megatron_cpu, tok):
    assert isinstance(make_policy(tok), PolicyBackend)


@pytest.mark.parametrize("tied", [True, False])
def test_logprobs_match_transformers(megatron_cpu, tok, tied):
    """A transformers LlamaForCausalLM and the Megatron GPTModel with the mapped weights agree (fp32)."""
    policy = make_policy(tok, seed=5, tie_word_embeddings=tied, num_attention_heads=4, num_key_value_heads=2)
    hf = init_hf_model(policy.hf_config, seed=5)  # the same initial weights, built by transformers
    batch = make_batch()
    ours, ref = policy.logprobs(batch), hf_logprobs(hf, batch)
    assert ours.shape == batch.input_ids.shape and ours.dtype == torch.float32
    assert (ours[batch.loss_mask == 0] == 0).all()
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)


def test_loads_a_hugging_face_checkpoint(megatron_cpu, tok, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=259, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64,
                      tie_word_embeddings=False, rope_theta=5000.0, rms_norm_eps=1e-5)
    torch.manual_seed(11)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    policy = make_policy(tok, hf_path=str(tmp_path))
    assert policy.spec.rope_theta == 5000.0 and policy.spec.rms_norm_eps == 1e-5
    batch = make_batch(seed=2)
    torch.testing.assert_close(policy.logprobs(batch), hf_logprobs(hf, batch), atol=2e-5, rtol=0)
    exported = policy.export_weights()
    assert set(exported) == set(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert torch.equal(exported[k], v), k


def test_export_weights_round_trips_to_identical_hf_tensors(megatron_cpu, tok):
    from transformers import LlamaForCausalLM

    policy = make_policy(tok, seed=7)
    hf = init_hf_model(policy.hf_config, seed=7)
    exported = policy.export_weights()
    assert list(exported) == list(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    # tied embeddings: one tensor under both names, as in transformers' own state_dict
    assert exported["lm_head.weight"] is exported["model.embed_tokens.weight"]
    # transformers accepts the export strictly, and it is a copy (training does not change it later)
    fresh = LlamaForCausalLM(policy.hf_config)
    fresh.load_state_dict(exported, strict=True)
    before = {k: v.clone() for k, v in exported.items()}
    batch = make_batch()
    batch = with_logprobs(batch, policy.logprobs(batch))
    policy.begin_train_step()
    policy.train_microbatches(batch)
    policy.finish_train_step()
    assert all(torch.equal(before[k], exported[k]) for k in exported)
    assert not torch.equal(policy.export_weights()["model.layers.0.self_attn.q_proj.weight"],
                           before["model.layers.0.self_attn.q_proj.weight"])


def test_random_init_is_deterministic_in_seed(megatron_cpu, tok):
    a, b, c = make_policy(tok, seed=1), make_policy(tok, seed=1), make_policy(tok, seed=2)
    wa, wb, wc = a.export_weights(), b.export_weights(), c.export_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])


def test_starts_from_the_same_weights_as_the_torch_backend(megatron_cpu, tok):
    """Same config and seed: Megatron, torch and (through the same HF init) vLLM start at identical weights."""
    torch_backend = pytest.importorskip("asyncrl.backends.torch")
    ref = torch_backend.TorchPolicy(ModelConfig(), TorchTrainerConfig(), GRPOLoss(), 4, tok).export_weights()
    ours = make_policy(tok, seed=4).export_weights()
    assert list(ours) == list(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def test_train_steps_change_weights_and_reduce_the_loss(megatron_cpu, tok):
    policy = make_policy(tok, seed=0, lr=1e-4)
    batch = make_batch(B=8, seed=1)
    batch = with_logprobs(batch, policy.logprobs(batch))  # a fixed "old policy": the surrogate must improve on it
    w0 = weights(policy)
    losses = []
    for step in range(4):
        policy.begin_train_step()
        out = policy.train_microbatches(batch)
        assert out["normaliser"] == batch.num_tokens
        metrics = policy.finish_train_step()
        losses.append(metrics["loss"])
        assert metrics["tokens"] == batch.num_tokens
        assert metrics["grad_norm"] > 0 or step > 0
    assert policy.steps == 4
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert all(not torch.equal(w0[k], v) for k, v in weights(policy).items())
    # the advantage-weighted logprob went up: positive-advantage completions became more likely
    delta = ((policy.logprobs(batch) - batch.prev_logprobs) * batch.loss_mask).sum(-1)
    assert float((delta * batch.advantages).sum()) > 0


@pytest.mark.parametrize("normalisation", ["token", "sequence"])
def test_whole_step_normalisation_is_independent_of_chunking(megatron_cpu, tok, normalisation):
    loss_cfg = LossConfig(normalisation=normalisation)
    batch = make_batch(B=8, seed=4)  # ragged: the chunks below hold different token counts
    one = make_policy(tok, seed=3, loss=loss_cfg, grad_clip=None)
    two = make_policy(tok, seed=3, loss=loss_cfg, grad_clip=None, micro_batch_size=2)
    for p in (one, two):
        p.optimizer = torch.optim.SGD(p.model.parameters(), lr=1.0)
    w0 = weights(one)
    batch = with_logprobs(batch, one.logprobs(batch))
    batch = replace(batch, gen_logprobs=batch.gen_logprobs - 0.1 * batch.loss_mask)  # a non-trivial importance weight

    one.begin_train_step()
    one.train_microbatches(batch)
    m1 = one.finish_train_step()

    two.begin_train_step()
    a = two.train_microbatches(batch.slice(0, 3))
    b = two.train_microbatches(batch.slice(3, 8))
    m2 = two.finish_train_step()

    assert batch.slice(0, 3).num_tokens != batch.slice(3, 8).num_tokens * 3 / 5  # really uneven
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["tokens"] == m2["tokens"] and m1["is_weight_mean"] == pytest.approx(m2["is_weight_mean"])
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    # plain SGD with lr 1 (set below): the weight change *is* the normalised gradient, compared element-wise
    # (AdamW's first step, ~lr * sign(grad), would amplify summation-order noise on near-zero gradients)
    w1, w2 = weights(one), weights(two)
    for k in w1:
        torch.testing.assert_close(w1[k] - w0[k], w2[k] - w0[k], atol=1e-6, rtol=1e-4)


def long_tailed_batch(lengths, prompt=2, seed=0, vocab=259) -> TrainBatch:
    """Right-padded rows of ``prompt`` prompt tokens and ``length - prompt`` completion tokens each."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    pos = torch.arange(S)
    real = pos < torch.tensor(lengths).unsqueeze(-1)
    ids = torch.where(real, torch.randint(3, vocab, (B, S), generator=g), torch.zeros((), dtype=torch.long))
    loss_mask = ((pos >= prompt) & real).float()
    return TrainBatch(ids, real.long(), loss_mask, torch.zeros(B, S), torch.randn(B, generator=g), [B])


LONG_TAIL = [3, 30, 5, 5, 14, 3, 9, 25, 4, 6, 12, 3]


def test_logprobs_of_packed_and_sorted_micro_batches_are_those_of_one_padded_batch(megatron_cpu, tok):
    """Packing several sequences into one row (block-diagonal causal mask, rotary positions shifted by the
    sequence's offset) computes what a padded row does, up to float rounding; so does a length-sorted cut."""
    batch = long_tailed_batch(LONG_TAIL)
    padded = make_policy(tok, seed=5, micro_batch_size=len(LONG_TAIL)).logprobs(batch)
    packed_policy = make_policy(tok, seed=5, micro_batch_tokens=64)
    from asyncrl import micro_batches

    plans = micro_batches.plan(batch, "packed", micro_batch_tokens=64)
    assert any((mb.segments.max(-1).values > 0).any() for mb in plans)  # some rows really hold several sequences
    torch.testing.assert_close(packed_policy.logprobs(batch), padded, atol=2e-5, rtol=0)
    sorted_policy = make_policy(tok, seed=5, micro_batching="sorted", micro_batch_tokens=40)
    torch.testing.assert_close(sorted_policy.logprobs(batch), padded, atol=2e-5, rtol=0)


@pytest.mark.parametrize("loss_cfg", [
    LossConfig(),
    LossConfig(normalisation="sequence", importance_correction="sequence", truncation="seq-mask-tis"),
], ids=["token-tis", "sequence-level"])
def test_packed_and_sorted_steps_equal_the_padded_step(megatron_cpu, tok, loss_cfg):
    """One step with plain SGD at lr 1 (the weight change is the normalised gradient): packed (two budgets),
    length-sorted, and the sequences in another order, against the whole chunk padded in one piece."""
    batch = long_tailed_batch(LONG_TAIL, seed=1)
    perm = torch.randperm(len(LONG_TAIL), generator=torch.Generator().manual_seed(2))

    policy = make_policy(tok, seed=3, grad_clip=None, loss=loss_cfg)
    w0 = weights(policy)

    def step(order=None, **knobs):  # one policy, reset to the same weights, cut by each plan (building is slow)
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                p.copy_(w0[name])
        knobs.setdefault("micro_batching", "rows" if "micro_batch_size" in knobs else "packed")
        policy.trainer_cfg = MegatronTrainerConfig(device="cpu", grad_clip=None, optimizer="torch", **knobs)
        policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
        b = batch if order is None else batch.map(lambda t: t[order])
        b = replace(b, gen_logprobs=(policy.logprobs(b) - 0.2 * torch.sin(b.input_ids * 0.7)) * b.loss_mask)
        policy.begin_train_step()
        policy.train_microbatches(b)
        m = policy.finish_train_step()
        return {k: v - w0[k] for k, v in weights(policy).items()}, m

    ref, ref_m = step(micro_batch_size=len(LONG_TAIL))
    assert ref_m["train_padded_tokens"] == len(LONG_TAIL) * max(LONG_TAIL)
    for order, knobs in [(None, {"micro_batch_tokens": 64}), (None, {"micro_batch_tokens": 1}), (perm, {}),
                         (perm, {"micro_batching": "sorted", "micro_batch_tokens": 40})]:
        delta, m = step(order, **knobs)
        for k in ref:
            torch.testing.assert_close(delta[k], ref[k], atol=1e-6, rtol=1e-4, msg=lambda s: f"{knobs} {k}: {s}")
        for key in ("loss", "grad_norm", "tokens", "is_weight_mean", "is_truncated_frac", "normaliser", "entropy"):
            assert m[key] == pytest.approx(ref_m[key], rel=1e-5, abs=1e-7), (knobs, key)
        assert m["train_tokens"] == sum(LONG_TAIL)
    packed = step(micro_batch_tokens=4096)[1]
    assert packed["train_padded_tokens"] <= 1.25 * sum(LONG_TAIL)  # 6 rows of 30 for 119 tokens, not 12


def _policy(tok, seed=3, loss=None, **knobs):
    cfg = MegatronTrainerConfig(device="cpu", grad_clip=None, optimizer="torch", micro_batch_tokens=64, **knobs)
    return MegatronPolicy(ModelConfig(), cfg, GRPOLoss(loss), seed, tok)


def sgd_step(policy, batch) -> tuple[torch.Tensor, dict, dict[str, torch.Tensor]]:
    """One step of plain SGD at lr 1 (the weight change is the gradient) on ``batch`` with behaviour logprobs a
    little off the policy's: its logprobs, metrics and each parameter's change."""
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    w0 = weights(policy)
    lp = policy.logprobs(batch)
    b = replace(batch, gen_logprobs=(lp - 0.1 * torch.cos(batch.input_ids * 0.3)) * batch.loss_mask)
    policy.begin_train_step()
    policy.train_microbatches(b)
    m = policy.finish_train_step()
    return lp, m, {k: v - w0[k] for k, v in weights(policy).items()}


def test_small_logprob_chunks_give_the_whole_pass_step(megatron_cpu, tok):
    """The output layer cut into chunks of 5 positions gives the logprobs, the step's metrics and the weight change
    (the gradient through the chunked backward, entropy bonus included) of one chunk for the whole pass, on packed
    rows holding several sequences."""
    batch = long_tailed_batch(LONG_TAIL, seed=4)
    runs = []
    for chunk in (4096, 5):
        runs.append(sgd_step(_policy(tok, loss=LossConfig(entropy_coef=0.05), logprob_chunk_tokens=chunk), batch))
    (lp_a, m_a, d_a), (lp_b, m_b, d_b) = runs
    torch.testing.assert_close(lp_b, lp_a, atol=2e-6, rtol=0)
    for key in ("loss", "grad_norm", "entropy", "tokens"):
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-5, abs=1e-7), key
    for k in d_a:
        torch.testing.assert_close(d_b[k], d_a[k], atol=1e-6, rtol=1e-4, msg=lambda s: f"{k}: {s}")


def test_flex_attention_computes_what_the_unfused_path_does(megatron_cpu, tok):
    """FlexAttention under the document mask (eager on the CPU, the function the GPU's compiled kernel computes;
    torch has no FlexAttention backward on the CPU, so the gradients are compared on the GPU,
    tests/gpu/test_flex_attention.py) gives the logprobs of Megatron's unfused attention on packed rows holding
    several sequences and on length-sorted ones."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    batch = long_tailed_batch(LONG_TAIL, seed=4)
    for mode in ("packed", "sorted"):
        lp = {kind: _policy(tok, attention=kind, micro_batching=mode).logprobs(batch) for kind in ("unfused", "flex")}
        assert lp["flex"].abs().sum() > 0
        torch.testing.assert_close(lp["flex"], lp["unfused"], atol=2e-5, rtol=0, msg=lambda s: f"{mode}: {s}")
    assert _policy(tok).attention == "unfused"  # auto: flex on CUDA only


def test_the_micro_batch_budget_fits_the_free_memory_or_names_the_knob():
    """On CUDA the budget is set at the first step from the memory then free: the most that fits when the knob is
    null, the knob when it fits, else one ValueError naming ``trainer.micro_batch_tokens`` and what fits."""
    from asyncrl.backends.megatron_forward import activation_bytes, fit_micro_batch_tokens
    from transformers import Qwen2Config

    spec = ArchSpec(Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=1088))
    flex = activation_bytes(spec, torch.bfloat16, "flex", 1088)
    unfused = activation_bytes(spec, torch.bfloat16, "unfused", 1088)
    assert 1.0 < flex / 2**20 < 2.5 and unfused > 2 * flex  # MiB a position: linear vs the scores' heads x W
    gib = 2**30
    assert fit_micro_batch_tokens(None, 140 * gib, flex, 10 * gib, 1088, "cuda:0") == 65536
    assert fit_micro_batch_tokens(32768, 100 * gib, flex, 10 * gib, 1088, "cuda:0") == 32768
    fits = fit_micro_batch_tokens(None, 40 * gib, flex, 10 * gib, 1088, "cuda:0")
    assert 1088 <= fits < 32768
    with pytest.raises(ValueError, match=f"trainer.micro_batch_tokens 32768 does not fit.*<= {fits}"):
        fit_micro_batch_tokens(32768, 40 * gib, flex, 10 * gib, 1088, "cuda:0")
    with pytest.raises(ValueError, match="not even one row of 1088 positions"):
        fit_micro_batch_tokens(None, 10 * gib, unfused, 10 * gib, 1088, "cuda:0")


def test_micro_batch_knobs_cut_a_chunk(megatron_cpu, tok):
    from asyncrl import micro_batches

    batch = make_batch(B=8, prompt=4, completion=6)  # lengths 10, 9, 8, 10, ...
    cut = lambda policy: micro_batches.plan(  # noqa: E731
        batch, policy.trainer_cfg.micro_batching, policy.trainer_cfg.micro_batch_size,
        policy.trainer_cfg.micro_batch_tokens)
    assert [mb.positions for mb in cut(make_policy(tok, micro_batch_size=3))] == [30, 30, 20]  # rows: as before
    assert [mb.width for mb in cut(make_policy(tok, micro_batching="sorted", micro_batch_tokens=25))] == \
        [10, 10, 9, 8]
    assert len(cut(make_policy(tok))) == 1  # the default: packed under a 16k budget, one pass


def test_state_dict_round_trip_resumes_identically(megatron_cpu, tok):
    batch = make_batch(seed=6)
    a = make_policy(tok, seed=2)
    batch = with_logprobs(batch, a.logprobs(batch))
    for _ in range(2):
        a.begin_train_step()
        a.train_microbatches(batch)
        a.finish_train_step()
    b = make_policy(tok, seed=9)
    b.load_state_dict(a.state_dict())
    assert b.steps == 2
    for p in (a, b):
        p.begin_train_step()
        p.train_microbatches(batch)
        p.finish_train_step()
    wa, wb = a.export_weights(), b.export_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_non_finite_loss_or_gradient_skips_the_update_and_keeps_the_weights_and_adamw_state(megatron_cpu, tok):
    """PolicyBackend.finish_train_step's contract: NaN/inf in the step's loss or gradient norm, no update."""
    import copy
    import math

    policy = make_policy(tok, seed=4)
    batch = make_batch(seed=7)
    batch = with_logprobs(batch, policy.logprobs(batch))
    policy.begin_train_step()  # one real step first: AdamW has state to keep
    policy.train_microbatches(batch)
    policy.finish_train_step()
    w0, opt0 = weights(policy), copy.deepcopy(policy.optimizer.state_dict())

    def same() -> bool:
        opt = policy.optimizer.state_dict()
        return (all(torch.equal(w0[k], v) for k, v in weights(policy).items()) and policy.steps == 1
                and all(torch.equal(a[n], b[n]) for a, b in zip(opt0["state"].values(), opt["state"].values())
                        for n in a if torch.is_tensor(a[n])))

    policy.begin_train_step()  # a gradient made infinite after the backward
    policy.train_microbatches(batch)
    next(p for p in policy.model.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
    out = policy.finish_train_step()
    assert out["grad_norm"] == math.inf and math.isfinite(out["loss"]) and same()
    policy.begin_train_step()  # a NaN loss
    policy.train_microbatches(replace(batch, advantages=batch.advantages * math.nan))
    out = policy.finish_train_step()
    assert math.isnan(out["loss"]) and same()
    policy.begin_train_step()  # and the next finite step is taken
    policy.train_microbatches(batch)
    assert math.isfinite(policy.finish_train_step()["grad_norm"]) and policy.steps == 2


def test_the_megatron_optimizer_step_is_megatrons_own_but_skips_a_non_finite_one(monkeypatch):
    """On CUDA the step is ``ChainedOptimizer.step``'s calls, in its order (prepare, norm, clip each part, update),
    with no update where the loss or the norm is NaN/inf or Megatron found an inf (``found_inf``)."""
    import math
    from types import SimpleNamespace

    from megatron.core.optimizer import clip_grads

    from asyncrl.backends.megatron_step import megatron_optimizer_step

    calls = []
    monkeypatch.setattr(clip_grads, "clip_grad_by_total_norm_fp32", lambda params, max_norm, total_norm,
                        use_decoupled_grad=False: calls.append(("clip", params, max_norm, total_norm)))

    class Part:
        def __init__(self, clip, params, stub=False):
            self.config, self.params, self.is_stub_optimizer = SimpleNamespace(clip_grad=clip), params, stub

        def get_parameters(self):
            return self.params

    class Chained:
        def __init__(self, found_inf=False, norm=2.0):
            self.found_inf, self.norm = found_inf, norm
            self.chained_optimizers = [Part(1.0, ["a"]), Part(1.0, ["b"], stub=True), Part(0.0, ["c"]), Part(1.0, [])]

        def prepare_grads(self):
            calls.append("prepare")
            return self.found_inf

        def get_grad_norm(self):
            calls.append("norm")
            return torch.tensor(self.norm)

        def step_with_ready_grads(self):
            calls.append("update")
            return True

    assert megatron_optimizer_step(Chained(), True) == (2.0, True)
    assert calls == ["prepare", "norm", ("clip", ["a"], 1.0, 2.0), "update"]
    for opt, finite_loss, norm in ((Chained(norm=math.inf), True, math.inf), (Chained(), False, 2.0)):
        calls.clear()
        assert megatron_optimizer_step(opt, finite_loss) == (norm, False) and calls == ["prepare", "norm"]
    calls.clear()
    norm, stepped = megatron_optimizer_step(Chained(found_inf=True), True)
    assert math.isnan(norm) and not stepped and calls == ["prepare"]


def test_step_api_misuse_is_an_error(megatron_cpu, tok):
    policy = make_policy(tok)
    with pytest.raises(RuntimeError):
        policy.train_microbatches(make_batch())
    with pytest.raises(RuntimeError):
        policy.finish_train_step()


def test_unsupported_architectures_are_rejected(tok):
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="attention_bias"):
        ArchSpec(LlamaConfig(vocab_size=10, hidden_size=8, num_attention_heads=2, attention_bias=True))
    with pytest.raises(ValueError, match="hidden_act"):
        ArchSpec(LlamaConfig(vocab_size=10, hidden_size=8, num_attention_heads=2, hidden_act="gelu"))


# ---- tensor and data parallelism: two gloo processes on the CPU ---------------------------------------------------


LAYOUTS = [(2, 1), (1, 2)]  # (tensor_parallel, data_parallel) over a world of 2


def _parallel_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Every layout in turn in one world: Megatron's model-parallel groups are torn down and rebuilt between them,
    as Megatron's own tests do, so the two spawned interpreters import torch and Megatron once, not once a layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    _cpu_workarounds(mp)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tok = make_tokenizer()
    for tp, dp in LAYOUTS:
        parallel_state.initialize_model_parallel(tp, 1)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        trainer_cfg = MegatronTrainerConfig(device="cpu", lr=1e-3, tensor_parallel=tp, data_parallel=dp,
                                            optimizer="torch")
        policy = MegatronPolicy(ModelConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
                                trainer_cfg, GRPOLoss(), 0, tok)
        out = _one_step(policy)
        if rank == 0:
            torch.save(out, os.path.join(out_dir, f"tp{tp}-dp{dp}.pt"))
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory) -> dict:
    """Rank 0's results for each layout, from one pair of spawned processes."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("parallel")
    mp.start_processes(_parallel_worker, args=(2, _free_port(), str(out)), nprocs=2, start_method="spawn")
    return {(tp, dp): torch.load(out / f"tp{tp}-dp{dp}.pt", weights_only=False) for tp, dp in LAYOUTS}


def _run_world_one(tok) -> dict:
    policy = MegatronPolicy(ModelConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
                            MegatronTrainerConfig(device="cpu", lr=1e-3, optimizer="torch"),
                            GRPOLoss(), 0, tok)
    return _one_step(policy)


def _one_step(policy) -> dict:
    """Initial export, logprobs, one step with plain SGD (lr 1: the weight change is the normalised gradient)."""
    initial = policy.export_weights()
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    batch = make_batch(seed=8)
    lp = policy.logprobs(batch)
    batch = with_logprobs(batch, lp)
    batch = replace(batch, gen_logprobs=batch.gen_logprobs - 0.1 * batch.loss_mask)
    policy.begin_train_step()
    policy.train_microbatches(batch)
    metrics = policy.finish_train_step()
    after = policy.export_weights()
    return {"initial": initial, "logprobs": lp, "metrics": metrics, "delta": {k: after[k] - initial[k] for k in after}}


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp", LAYOUTS)
def test_tensor_and_data_parallel_match_a_single_process(megatron_cpu, tok, parallel_runs, tp, dp):
    par = parallel_runs[(tp, dp)]
    ref = _run_world_one(tok)
    torch.testing.assert_close(par["logprobs"], ref["logprobs"], atol=2e-5, rtol=0)
    assert par["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], abs=1e-5)
    assert par["metrics"]["tokens"] == ref["metrics"]["tokens"]
    assert par["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-4)
    assert list(par["initial"]) == list(ref["initial"])
    for k, v in ref["initial"].items():
        assert torch.equal(par["initial"][k], v), k  # sharding and gathering move bits, they do not round them
    for k, v in ref["delta"].items():
        torch.testing.assert_close(par["delta"][k], v, atol=1e-6, rtol=1e-4, msg=k)


def test_prev_logprobs_from_the_forward_train_exactly_as_a_separate_pass(megatron_cpu, tok):
    """Megatron takes ``prev_logprobs`` from its training forward when a chunk has none (the controller then skips
    the separate pass, also through a Ray proxy): over steps of two chunks in micro-batches of 3, with generator
    logprobs off the policy's, weights and step metrics equal those of a policy given ``logprobs()``' values."""
    from asyncrl.backends.base import capabilities
    from asyncrl.backends.ray import proxy_class

    loss = LossConfig(entropy_coef=0.03)
    given, forward = (make_policy(tok, lr=1e-2, micro_batch_size=3, loss=loss) for _ in range(2))
    assert capabilities(forward).prev_logprobs_from_forward
    assert capabilities(proxy_class(MegatronPolicy)).prev_logprobs_from_forward  # a proxy too, without a call
    for step in range(3):
        chunks = [make_batch(B=7, seed=10 * step + c) for c in range(2)]
        given.begin_train_step(), forward.begin_train_step()
        for c, batch in enumerate(chunks):
            gen = (given.logprobs(batch) - 0.05 * (c + 1)) * batch.loss_mask
            given.train_microbatches(replace(batch, gen_logprobs=gen, prev_logprobs=given.logprobs(batch)))
            forward.train_microbatches(replace(batch, gen_logprobs=gen))
        a, b = given.finish_train_step(), forward.finish_train_step()
        assert a == b
        assert b["is_weight_mean"] != 1.0
    wa, wb = given.export_weights(), forward.export_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _rebuild_after_teardown(rank: int, out: str) -> None:
    """In a fresh process: a policy, its world destroyed under it (what vLLM's shutdown does to a colocated
    process), then a new policy trains: Megatron's groups are made again on the new world."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tok = make_tokenizer()
    cfg = MegatronTrainerConfig(device="cpu", optimizer="torch")
    first = MegatronPolicy(ModelConfig(), cfg, GRPOLoss(), 0, tok)
    old_group = parallel_state.get_data_parallel_group()
    first.close()
    dist.destroy_process_group()
    second = MegatronPolicy(ModelConfig(), cfg, GRPOLoss(), 0, tok)
    group = parallel_state.get_data_parallel_group()
    ones = torch.ones(2)
    dist.all_reduce(ones, group=group)  # a stale group raises here
    batch = make_batch(seed=3)
    second.begin_train_step()
    second.train_microbatches(with_logprobs(batch, second.logprobs(batch)))
    m = second.finish_train_step()
    torch.save({"fresh_group": group is not old_group, "grad_norm": m["grad_norm"]}, out)


def test_a_policy_after_its_world_was_torn_down_makes_megatron_s_groups_again(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "out.pt")
    mp.start_processes(_rebuild_after_teardown, args=(out,), nprocs=1, start_method="spawn", join=True)
    got = torch.load(out)
    assert got["fresh_group"] and got["grad_norm"] > 0


def test_the_supported_megatron_core_range_is_declared_once_and_checked_at_start():
    import tomllib
    from pathlib import Path

    import megatron.core
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from asyncrl.backends.megatron import MEGATRON_CORE, check_megatron_core

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    (extra,) = pyproject["project"]["optional-dependencies"]["megatron"]
    assert Requirement(extra).specifier == SpecifierSet(MEGATRON_CORE)
    assert check_megatron_core() == megatron.core.__version__  # CI's version is inside the range it declares
    for outside in ("0.15.0", "0.16.0", "0.20.0", "1.0.0", "not-a-version"):
        with pytest.raises(ImportError, match=f"megatron-core {outside} is not supported.*>=0.16.1,<0.20"):
            check_megatron_core(outside)


def test_megatron_s_own_optimizer_off_cuda_is_a_configuration_error():
    """megatron-core's optimizer cannot be built on CPU (it makes its tensors on cuda and takes only cuda
    parameters), so it is covered on GPUs (docs/gpu.md); asking for it on CPU is one clear error, not a crash
    inside Megatron when the policy is built."""
    from pydantic import ValidationError

    from asyncrl import load_config

    with pytest.raises(ValidationError, match="trainer.optimizer 'megatron' needs a CUDA device.*'cpu'"):
        load_config("quickstart", trainer={"backend": "megatron", "device": "cpu", "optimizer": "megatron"})
    assert load_config("gpu_quickstart").trainer.optimizer is None  # the GPU preset: megatron's, chosen on CUDA
