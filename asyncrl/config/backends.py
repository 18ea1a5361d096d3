"""The engines' sections: ``model:`` (the architecture every engine builds), and the backend registry that
chooses ``generation:`` and ``trainer:`` sections by ``backend`` (the sections themselves:
``asyncrl.config.generation``, ``asyncrl.config.training``; where they run: ``asyncrl.config.placement``).

Invariants:
- ``GENERATION_CONFIGS`` / ``TRAINER_CONFIGS`` are the registry: one entry per backend, whose class names its engine
  (``engine``); ``asyncrl.backends.build_backends`` builds what they name. A new backend is a section class and a
  line here.
- ``ModelConfig`` is a plain strict model (pydantic's own unknown-key error, which the CLI rewords).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from asyncrl.config.generation import SimulatedGenerationConfig, TorchGenerationConfig, VLLMGenerationConfig
from asyncrl.config.training import MegatronTrainerConfig, SimulatedTrainerConfig, TorchTrainerConfig


class LoraConfig(BaseModel):
    """``model.lora``: train a LoRA adapter (``peft``) on the frozen model instead of its weights (the torch engine).
    The generator gets the merged weights each step; a checkpoint holds the adapter and names the base."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, description="the adapter's rank r")
    alpha: float | None = Field(None, gt=0, description="the adapter's scale is alpha / rank (None: 2 x rank)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input while training")
    target_modules: list[str] | None = Field(
        None, description="the linear layers to adapt, by name (q_proj, v_proj, ...); None: every linear layer of "
        "the transformer blocks (peft's 'all-linear': the output layer is not adapted)")

    @model_validator(mode="after")
    def _defaults(self) -> "LoraConfig":
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ValueError("model.lora needs the 'peft' package, which is not installed (pip install "
                             "'asyncrl[lora]'); or leave model.lora unset")
        if self.alpha is None:
            self.alpha = 2.0 * self.rank
        if self.target_modules is not None and not self.target_modules:
            raise ValueError("model.lora.target_modules is empty: name the layers to adapt, or None for every "
                             "linear layer of the blocks")
        return self


class ModelConfig(BaseModel):
    """A Llama-style causal LM built from this config (random init), or loaded from ``hf_path``: then the
    architecture fields are that directory's (read from its config.json, replacing a preset's), so a run's
    config.yaml records the architecture trained."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(128, ge=1, description="the width of the model (Llama's hidden_size)")
    intermediate_size: int = Field(344, ge=1, description="the MLP's inner width")
    num_hidden_layers: int = Field(2, ge=1, description="transformer layers")
    num_attention_heads: int = Field(4, ge=1, description="attention heads")
    num_key_value_heads: int = Field(2, ge=1, description="key/value heads (grouped-query attention)")
    max_position_embeddings: int = Field(
        64, ge=8, description="the context: a prompt (after its chat template) plus max_new_tokens must fit it")
    rope_theta: float = Field(10000.0, description="the rotary embedding's base")
    tie_word_embeddings: bool = Field(True, description="the output layer shares the embedding's weights")
    hf_path: str | None = Field(
        None, description="a local Hugging Face model directory (config, safetensors, tokenizer) to load instead of "
        "a model built from these fields")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="the weights' dtype")
    chat_template: str | None = Field(
        None, description="the chat template conversational prompts are rendered with (a Jinja template, or the "
        "path of a file holding one); None: the tokenizer's own (asyncrl/chat.py)")
    lora: LoraConfig | None = Field(
        None, description="train a LoRA adapter instead of the weights (rank, alpha, dropout, target_modules; the "
        "torch engine; needs peft): None, the whole model trains")
    vocab_size: int | None = Field(
        None, ge=259, description="the embedded byte tokenizer padded with unused tokens to this vocabulary (a real "
        "model's output layer, e.g. 151936: asyncrl/tokenizer.py); None: 259. With hf_path, like the other "
        "architecture fields, unused: the directory's tokenizer and config decide")

    def shape_dump(self) -> dict:
        """The fields that make the weights (what a checkpoint keeps as its model and a restore must match): all
        but ``chat_template``, which changes how prompts are rendered, not the model (and ``vocab_size`` when
        unset, so checkpoints from before it stay as they were)."""
        unset = {name for name in ("vocab_size", "lora") if getattr(self, name) is None}  # older checkpoints'
        return self.model_dump(mode="json", exclude={"chat_template"} | unset)

    @model_validator(mode="after")
    def _architecture_of_hf_path(self) -> "ModelConfig":
        if self.hf_path is None:
            return self
        try:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(self.hf_path)
        except Exception:  # noqa: BLE001 - a bad directory is refused in one line when the backends are built
            return self
        rope = getattr(hf, "rope_parameters", None) or {}
        found = {"rope_theta": getattr(hf, "rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict)
                                                                   else None),
                 "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads}
        for name in ARCHITECTURE_FIELDS:
            value = found.get(name, getattr(hf, name, None))
            if value is None:
                continue
            setattr(self, name, type(getattr(self, name))(value))
        return self

    def llama_config(self, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int):
        """The ``transformers.LlamaConfig`` every backend builds this model from (when there is no ``hf_path``),
        so the torch, Megatron and vLLM engines start from the same architecture and the same init."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings, attention_dropout=0.0,
            pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        )


ARCHITECTURE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "max_position_embeddings", "rope_theta", "tie_word_embeddings")


def _backend_tag(default: str):
    def tag(value: Any) -> str:
        backend = value.get("backend", default) if isinstance(value, Mapping) else getattr(value, "backend", None)
        return backend if isinstance(backend, str) else repr(backend)

    return tag


# The backend registry, one line per backend: its config section class, which names its engine (``engine``).
GENERATION_CONFIGS = {c.model_fields["backend"].default: c for c in (
    TorchGenerationConfig, VLLMGenerationConfig, SimulatedGenerationConfig)}
TRAINER_CONFIGS = {c.model_fields["backend"].default: c for c in (
    TorchTrainerConfig, MegatronTrainerConfig, SimulatedTrainerConfig)}
GenerationConfig = Annotated[
    Union[tuple(Annotated[c, Tag(name)] for name, c in GENERATION_CONFIGS.items())],
    Discriminator(_backend_tag("torch"), custom_error_type="unknown_backend",
                  custom_error_message=f"generation.backend must be one of {list(GENERATION_CONFIGS)}"),
]
"""``generation:`` — one of ``GENERATION_CONFIGS``, chosen by ``backend`` (default ``torch``)."""
TrainerConfig = Annotated[
    Union[tuple(Annotated[c, Tag(name)] for name, c in TRAINER_CONFIGS.items())],
    Discriminator(_backend_tag("torch"), custom_error_type="unknown_backend",
                  custom_error_message=f"trainer.backend must be one of {list(TRAINER_CONFIGS)}"),
]
"""``trainer:`` — one of ``TRAINER_CONFIGS``, chosen by ``backend`` (default ``torch``)."""
