"""Randomly initialised Hugging Face model directories the GPU benches and presets load (nothing is downloaded):
config, bf16 safetensors, and the byte tokenizer padded to the model's vocabulary (``asyncrl/tokenizer.py``).

    python benchmarks/model_dirs.py --shape qwen3_8b --out /tmp/asyncrl-qwen3-8b      # gpu_lora_8b's model
    python benchmarks/model_dirs.py --shape qwen2_0_5b --out /tmp/qwen                 # bench_trl_gpu.py's

Shapes (``SHAPES``): ``qwen2_0_5b`` (Qwen2.5-0.5B's: 494M parameters, q/k/v biases, tied embeddings),
``qwen3_8b`` (Qwen3-8B's: 36 layers x 4096, 32 heads / 8 KV heads of 128, SwiGLU 12288, untied output layer;
8.19B parameters, 16.4 GB in bf16), a small Qwen3 for the GPU tests and tiny ones of each family for CPU runs. The model is built where it will
be written from: with ``--device cuda`` on the GPU in its dtype from the start (no fp32 copy of 8B parameters on the
CPU); on the CPU in fp32 then cast, as bench_trl_gpu.py always did (the same 0.5B weights); then ``save_pretrained`` (safetensors, 5 GB shards). On one H100 the 8B directory takes ~1-3 minutes, most of
it writing 16.4 GB. A directory that already holds a ``config.json`` of the same shape is kept (``build_model_dir``
returns at once), so a bench can call it on every run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN2_0_5B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=2048)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6, tie_word_embeddings=False,
                max_position_embeddings=4096)
SHAPES = {  # name -> (transformers config class, its arguments, dtype)
    "qwen2_0_5b": ("Qwen2Config", QWEN2_0_5B, "bfloat16"),
    "qwen3_8b": ("Qwen3Config", QWEN3_8B, "bfloat16"),
    # tests/gpu/test_lora_gpu.py's: Qwen3's layout at a size that builds in seconds (vLLM's kernels take it)
    "small_qwen3": ("Qwen3Config", dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4, head_dim=64, rope_theta=1e6,
                                        tie_word_embeddings=False, max_position_embeddings=1024), "bfloat16"),
    "tiny_qwen2": ("Qwen2Config", dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                                       rope_theta=1e6, max_position_embeddings=128), "float32"),
    "tiny_qwen3": ("Qwen3Config", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                                       tie_word_embeddings=False, max_position_embeddings=128), "float32"),
}


def _same_shape(path: Path, shape: dict) -> bool:
    try:
        have = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return all(have.get(k) == v for k, v in shape.items() if k not in ("rope_theta",))


def build_model_dir(path: str | Path, shape: str, seed: int = 0, device: str = "cpu") -> Path:
    """Write (or keep, when one of this shape is there) a randomly initialised model directory of ``shape``
    (``SHAPES``) at ``path``: the model initialised on ``device`` in its dtype with ``torch.manual_seed(seed)``,
    saved as safetensors, and the byte tokenizer padded to its vocabulary."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from asyncrl.tokenizer import build_tokenizer

    cls_name, args, dtype_name = SHAPES[shape]
    path = Path(path)
    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        if _same_shape(path, args):
            return path
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(args["vocab_size"])
    cfg = getattr(transformers, cls_name)(**args, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                          eos_token_id=tok.eos_token_id)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(seed)
    if device == "cpu":  # fp32 then cast: the same weights as the directories written before this module
        model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    else:
        with torch.device(device):  # built where it is, in its dtype: no fp32 copy of 8B parameters on the CPU
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="where to initialise it (default: cuda if there is one)")
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    path = build_model_dir(args.out, args.shape, args.seed, device)
    print(f"{args.shape} at {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
