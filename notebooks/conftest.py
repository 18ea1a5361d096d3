"""Notebook collection (nbval). ``gpu_quickstart.ipynb`` needs a CUDA GPU with vLLM and Megatron-core: without
them it is left out of collection (CI has no GPU), rather than failing in its first cell. It was executed on the
H200 by hand (benchmarks/README.md, "Through the controller on one H200")."""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []


def _gpu_stack() -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        return all(importlib.util.find_spec(name) is not None for name in ("vllm", "megatron.core"))
    except (ImportError, ValueError):
        return False


if not _gpu_stack():
    collect_ignore.append("gpu_quickstart.ipynb")
