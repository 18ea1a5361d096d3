"""Hugging Face helpers shared by every engine (torch, Megatron-core, vLLM): the tokenizer, the model's HF
config, its one seeded initialisation, and checkpoint loading.

Every engine starts from the same weights for a seed because they all come from ``init_hf_model``: the HF model
class built under ``torch.manual_seed(seed)`` on the CPU, leaving the caller's RNG untouched. The torch engine
trains that model itself, Megatron copies it through its weight map, vLLM loads it from a directory
``write_model_dir`` (in ``vllm_build.py``) saved. ``transformers`` is imported inside the functions.

Bad models are refused before any engine is built, in one line naming the path or the knob (``load_tokenizer``
and ``check_model``, which ``build_backends`` runs first): a ``model.hf_path`` that is not a directory or lacks
``config.json``, weights or tokenizer files (transformers would otherwise load an empty tokenizer and fail at the
first evaluation), a tokenizer with ids past the model's ``vocab_size``, a config transformers cannot read, and a
built-in architecture transformers refuses (``model.hidden_size`` not a multiple of heads, ...).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from asyncrl.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# What a model directory must hold: any one of these tokenizer files (fast, sentencepiece, BPE, WordPiece), weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
ARCHITECTURE_KNOBS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "max_position_embeddings", "rope_theta", "tie_word_embeddings")


def _one_line(exc: BaseException) -> str:
    """The innermost cause of ``exc`` (transformers wraps its validators' errors), one line, its first sentence
    (transformers goes on with advice about upgrading)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = re.sub(r"\s+", " ", str(exc)).strip() or type(exc).__name__
    return re.split(r"(?<=[.!?]) ", text, maxsplit=1)[0]


def check_model_dir(path: str) -> None:
    """A ``ValueError`` naming ``path`` unless it is a directory with ``config.json``, weights and a tokenizer."""
    root, where = Path(path), f"model.hf_path {path!r}"
    if not root.is_dir():
        raise ValueError(f"{where} is not a directory (a local Hugging Face model directory: config.json, "
                         "*.safetensors and the tokenizer files)")
    if not (root / "config.json").is_file():
        raise ValueError(f"{where} has no config.json (the model's Hugging Face config)")
    if not any(next(root.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ValueError(f"{where} has no weights ({' or '.join(WEIGHT_FILES)})")
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save one into it "
                         "with tokenizer.save_pretrained(DIR)")


def load_tokenizer(model_cfg: Any):
    """The embedded byte tokenizer, or the one in ``model_cfg.hf_path`` (a local directory, no downloads; checked
    by ``check_model_dir`` first)."""
    if model_cfg.hf_path is None:
        from asyncrl.tokenizer import build_tokenizer

        return build_tokenizer(getattr(model_cfg, "vocab_size", None))
    from transformers import AutoTokenizer

    check_model_dir(model_cfg.hf_path)
    build_hf_config(model_cfg)  # a config.json transformers cannot read is named before the tokenizer trips on it
    try:
        return AutoTokenizer.from_pretrained(model_cfg.hf_path)
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizer files hold, the user needs the path
        raise ValueError(f"model.hf_path {model_cfg.hf_path!r}: its tokenizer does not load: {_one_line(exc)}") from exc


def check_model(model_cfg: Any, tokenizer: Any) -> Any:
    """The model's HF config, after checking what every engine would otherwise fail on later (module docstring):
    a ``ValueError`` naming the path or the knob."""
    hf_config = build_hf_config(model_cfg, tokenizer)
    if model_cfg.hf_path:
        vocab, where = int(hf_config.vocab_size), f"model.hf_path {model_cfg.hf_path!r}"
        if len(tokenizer) > vocab:
            raise ValueError(f"{where}: its tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                             f"{vocab} (config.json): every token id needs a row of the embedding")
        return hf_config
    from transformers import AutoModelForCausalLM

    try:  # the layers' own checks (shapes of the projections), on the meta device: nothing is allocated
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # noqa: BLE001
        raise _architecture_error(model_cfg, exc) from exc
    return hf_config


def _architecture_error(model_cfg: Any, exc: BaseException) -> ValueError:
    """One line naming the architecture knobs (those set, else all) and what transformers said."""
    named = [k for k in ARCHITECTURE_KNOBS if k in model_cfg.model_fields_set] or list(ARCHITECTURE_KNOBS)
    knobs = ", ".join(f"model.{k}={getattr(model_cfg, k)!r}" for k in named)
    return ValueError(f"transformers refuses the model architecture ({knobs}): {_one_line(exc)}")


def special_ids(tokenizer: Any) -> tuple[int, int, int, int]:
    """(pad, bos, eos, vocab size) of ``tokenizer``, or the embedded tokenizer's when it is ``None``."""
    if tokenizer is None:
        return PAD_ID, BOS_ID, EOS_ID, VOCAB_SIZE
    pick = lambda name, default: default if getattr(tokenizer, name, None) is None else getattr(tokenizer, name)  # noqa: E731
    return pick("pad_token_id", PAD_ID), pick("bos_token_id", BOS_ID), pick("eos_token_id", EOS_ID), len(tokenizer)


def build_hf_config(model_cfg: Any, tokenizer: Any = None) -> Any:
    """The Hugging Face config of ``model_cfg``: read from ``hf_path`` when set, else a ``LlamaConfig`` built from
    the ``ModelConfig`` fields and the tokenizer (vocabulary size and special token ids)."""
    from transformers import AutoConfig

    if model_cfg.hf_path:
        try:
            return AutoConfig.from_pretrained(model_cfg.hf_path)
        except Exception as exc:  # noqa: BLE001 - an unknown model_type, a damaged file: the user needs the path
            raise ValueError(f"model.hf_path {model_cfg.hf_path!r}: its config.json does not load: "
                             f"{_one_line(exc)}") from exc
    if tokenizer is None:
        raise ValueError("a model built from ModelConfig (no hf_path) needs the tokenizer for its vocabulary")
    return _llama_config(model_cfg, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                         tokenizer.eos_token_id)


def _llama_config(model_cfg: Any, vocab_size: int, pad: int, bos: int, eos: int) -> Any:
    try:
        return model_cfg.llama_config(vocab_size, pad, bos, eos)
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise their own error types
        raise _architecture_error(model_cfg, exc) from exc


def init_hf_model(hf_config: Any, seed: int) -> Any:
    """A freshly initialised fp32 HF causal LM on the CPU: ``torch.manual_seed(seed)`` then the model's own
    initialisation, without touching the caller's RNG state. Deterministic in ``seed`` on any machine."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if getattr(hf_config, "model_type", "llama") == "llama":
            model = LlamaForCausalLM(hf_config)
        else:
            model = AutoModelForCausalLM.from_config(hf_config)
    return model.float().eval()


def init_hf_state_dict(hf_config: Any, seed: int) -> dict[str, torch.Tensor]:
    """``init_hf_model(hf_config, seed).state_dict()``: the HF-named initial weights."""
    return dict(init_hf_model(hf_config, seed).state_dict())


def load_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files (or ``pytorch_model*.bin``) in a HF checkpoint directory."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(root.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    for f in bins:
        out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return out


def build_model(
    model_cfg: Any,
    vocab_size: int,
    seed: int,
    device: str | torch.device = "cpu",
    pad_token_id: int = PAD_ID,
    bos_token_id: int = BOS_ID,
    eos_token_id: int = EOS_ID,
):
    """A ``transformers`` causal LM for the torch engine: ``init_hf_model`` of ``model_cfg.llama_config(...)`` (no
    KV cache by default, SDPA attention), in ``model_cfg.dtype`` on ``device``. With ``model_cfg.hf_path`` the
    weights come from that local checkpoint instead (no downloads)."""
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[model_cfg.dtype]
    if model_cfg.hf_path is not None:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.hf_path, local_files_only=True, dtype=dtype)
        return model.to(device)
    config = _llama_config(model_cfg, vocab_size, pad_token_id, bos_token_id, eos_token_id)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return init_hf_model(config, seed).to(device=device, dtype=dtype)


# --- the trained model out: a Hugging Face directory ----------------------------------------------------------------


def save_pretrained(path: str | Path, weights: dict[str, torch.Tensor], hf_config: Any, tokenizer: Any,
                    chat_template: str | None = None) -> Path:
    """Write a Hugging Face model directory at ``path`` that ``AutoModelForCausalLM.from_pretrained`` and vLLM
    load: ``config.json`` (with the weights' dtype and the model class), ``generation_config.json``, the weights as
    safetensors (sharded past 5 GB, with an index), the tokenizer and its chat template (``chat_template``
    replaces the tokenizer's). The weights are written exactly as given; a tied ``lm_head.weight`` is left out,
    as transformers does. Atomic: written into a hidden directory beside ``path``, then renamed; ``path`` must not
    exist or be empty (a ``ValueError`` naming it, nothing written)."""
    import copy
    import shutil
    import tempfile

    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{str(path)!r} exists and is not an empty directory: a Hugging Face export writes a new one")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    config = copy.deepcopy(hf_config)
    config.dtype = tensors["model.embed_tokens.weight"].dtype
    config.use_cache = True  # what a reader of the directory wants for generation
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "LlamaForCausalLM")]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        save_torch_state_dict(tensors, tmp, metadata={"format": "pt"})
        if chat_template is not None:
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(str(tmp))
        if path.exists():
            path.rmdir()  # empty (checked above)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def export_pretrained(policy: Any, model_cfg: Any, tokenizer: Any, path: str | Path) -> Path | None:
    """``save_pretrained`` of ``policy.export_weights()`` (tensor-parallel shards gathered into full HF tensors)
    with the model's HF config. ``export_weights`` is collective on a multi-rank trainer, so every rank of a
    ``torch.distributed`` world calls this; only global rank 0 writes (the others return ``None``)."""
    import torch.distributed as dist

    hf_config = build_hf_config(model_cfg, tokenizer)
    weights = policy.export_weights()
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    return save_pretrained(path, weights, hf_config, tokenizer, getattr(model_cfg, "chat_template", None))
