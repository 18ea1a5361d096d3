"""``trainer.compile`` (issue 48): the knob is validated in one line, reaches ``nn.Module.compile`` of every
transformer layer (or of each layer's norms, attention and MLP) in place, and a compiled policy computes what the
eager one does. On the CPU dynamo traces the layers with its ``eager`` backend (inductor's C++ code generation would
take minutes on a small box): the trace, its graph breaks and the compiled call path are what run here; the CUDA
kernels themselves are measured by benchmarks/bench_mfu_gpu.py on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'asyncrl[megatron]')")

from asyncrl import load_config  # noqa: E402
from asyncrl.algorithms import GRPOLoss  # noqa: E402
from asyncrl.backends.megatron import MegatronPolicy  # noqa: E402
from asyncrl.backends.megatron_forward import MODULES, compile_layers  # noqa: E402
from asyncrl.config import MegatronTrainerConfig, ModelConfig  # noqa: E402
from tests.test_megatron_backend import long_tailed_batch, make_tokenizer, megatron_cpu  # noqa: E402,F401


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
def eager_compile(monkeypatch):
    """``torch.compile`` with dynamo's ``eager`` backend (the trace without code generation); records each call."""
    real, calls = torch.compile, []

    def compile_eagerly(fn=None, **kwargs):
        calls.append(kwargs)
        return real(fn, **{**kwargs, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    yield calls
    torch._dynamo.reset()


def _policy(tok, how: str) -> MegatronPolicy:
    cfg = MegatronTrainerConfig(device="cpu", grad_clip=None, optimizer="torch", micro_batch_tokens=64, compile=how)
    return MegatronPolicy(ModelConfig(), cfg, GRPOLoss(None), 3, tok)


def test_a_bad_compile_value_is_one_error_naming_it_and_the_choices():
    with pytest.raises(ValueError) as err:
        load_config("gpu_real_shape", trainer={"backend": "megatron", "compile": "everything"})
    assert "compile" in str(err.value) and "'layers'" in str(err.value) and "'modules'" in str(err.value)
    with pytest.raises(ValueError, match=r"trainer.compile 'all': allowed 'none', 'layers', 'modules'"):
        compile_layers(torch.nn.Module(), "all", "flex", torch.device("cpu"))
    assert MegatronTrainerConfig().compile == "none"  # off by default: compiling costs every first step
    # the throughput preset compiles its layers: 1.145x the eager step on one H100 (benchmarks/README.md)
    assert load_config("gpu_real_shape").trainer.compile == "layers"


@pytest.mark.parametrize("how", ["layers", "modules"])
def test_compiled_layers_compute_what_the_eager_ones_do(megatron_cpu, tok, eager_compile, monkeypatch, how):  # noqa: F811
    eager = _policy(tok, "none")
    assert eager.compiled == [] and not eager_compile
    compiled = _policy(tok, how)
    layers = list(compiled.model.decoder.layers)
    want = [f"decoder.layers.{i}" + ("" if how == "layers" else f".{n}")
            for i in range(len(layers)) for n in ([""] if how == "layers" else MODULES)]
    assert compiled.compiled == want
    assert all(call.get("dynamic") is True for call in eager_compile) and len(eager_compile) == len(want)
    for layer in layers:  # in place: the same module tree and parameter names, each part's call compiled
        parts = [layer] if how == "layers" else [getattr(layer, n) for n in MODULES]
        assert all(part._compiled_call_impl is not None for part in parts)
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]

    batch = long_tailed_batch([3, 9, 5, 12, 7, 4])
    from torch._dynamo.utils import counters

    # Megatron's CPU workaround answers torch.cuda.current_device() with "cpu" from a lambda, which dynamo cannot
    # fold as it folds CUDA's int: folded here too, so a graph break left is one a GPU would see as well
    monkeypatch.setattr(torch.cuda, "current_device", torch._dynamo.assume_constant_result(lambda: "cpu"))
    counters.clear()
    torch.testing.assert_close(compiled.logprobs(batch), eager.logprobs(batch), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] > 0  # dynamo traced the compiled parts (not a silent eager call)
    # one graph a layer (every layer shares it), not split at megatron-core's deprecation warning (_quiet_default_group)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for p in (eager, compiled):
        p.begin_train_step()
        p.train_microbatches(batch)
    grads = [{n: q.grad.clone() for n, q in p.model.named_parameters()} for p in (eager, compiled)]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
    for p in (eager, compiled):
        p.finish_train_step()
        p.close()
