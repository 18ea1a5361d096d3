"""Typed backend configs: ``generation`` and ``trainer`` are chosen by ``backend``, every knob is documented, and
an unknown key is an error that lists the allowed ones."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.config import (
    GENERATION_CONFIGS,
    TRAINER_CONFIGS,
    Config,
    MegatronTrainerConfig,
    SimulatedGenerationConfig,
    TorchGenerationConfig,
    VLLMGenerationConfig,
    load_config,
)


@pytest.mark.parametrize("model", [*GENERATION_CONFIGS.values(), *TRAINER_CONFIGS.values()],
                         ids=lambda m: m.__name__)
def test_every_backend_knob_is_documented(model):
    undocumented = [name for name, field in model.model_fields.items()
                    if name != "backend" and not field.description]
    assert not undocumented, f"{model.__name__}: {undocumented}"


def test_the_backend_picks_the_section_and_torch_is_the_default():
    cfg = Config.model_validate({"generation": {"max_new_tokens": 2}, "trainer": {"lr": 1e-3}})
    assert type(cfg.generation) is TorchGenerationConfig and cfg.generation.max_new_tokens == 2
    cfg = load_config("quickstart", generation={"backend": "vllm", "background": True},
                      trainer={"backend": "megatron", "optimizer": "torch"})
    assert type(cfg.generation) is VLLMGenerationConfig and cfg.generation.background is True
    assert type(cfg.trainer) is MegatronTrainerConfig and cfg.trainer.optimizer == "torch"
    assert cfg.generation.max_new_tokens == 1  # the preset's shared knobs survive a backend change


@pytest.mark.parametrize("section, override, allowed", [
    ("generation", {"backend": "vllm", "backgrund": True}, "background"),
    ("generation", {"prefill_s": 0.1}, "max_new_tokens"),  # a simulated knob on the torch generator
    ("trainer", {"backend": "megatron", "options": {"optimizer": "torch"}}, "optimizer"),  # no options dict
    ("trainer", {"backend": "megatron", "adam_epsilon": 1e-6}, "adam_eps"),
])
def test_unknown_keys_are_rejected_with_the_allowed_ones_listed(section, override, allowed):
    with pytest.raises(ValidationError, match="unknown key") as err:
        load_config("quickstart", **{section: override})
    assert allowed in str(err.value)


def test_an_unknown_backend_names_the_backends():
    with pytest.raises(ValidationError, match=r"one of \['torch', 'vllm', 'simulated'\]"):
        load_config("quickstart", generation={"backend": "sglang"})


def test_switching_backend_drops_the_old_backends_knobs_only():
    cfg = load_config("gpu_quickstart", generation={"backend": "simulated", "prefill_s": 0.01})
    assert type(cfg.generation) is SimulatedGenerationConfig
    assert (cfg.generation.device, cfg.generation.max_new_tokens, cfg.generation.prefill_s) == ("cuda", 1, 0.01)
    assert "gpu_memory_utilization" not in cfg.generation.model_dump()


def test_a_config_round_trips_through_its_dump():
    cfg = load_config("gpu_quickstart")
    assert Config.model_validate(cfg.model_dump(mode="json")) == cfg



def test_trainer_ranks_are_a_typed_property_of_every_trainer_section():
    assert load_config("quickstart", trainer={"backend": "megatron", "data_parallel": 2, "tensor_parallel": 3}
                       ).trainer.ranks == 6
    assert load_config("quickstart", trainer={"backend": "torch", "data_parallel": 2, "placement": "ray"}
                       ).trainer.ranks == 2
    assert load_config("what_if").trainer.ranks == 1  # the simulated trainer has no ranks
