"""Notebook collection (nbval). ``gpu_quickstart.ipynb`` needs a CUDA GPU with vLLM and Megatron-core, and
``gpu_two_devices.ipynb`` two such GPUs and Ray: without them they are left out of collection (CI has no GPU),
rather than failing in their first cell. It was executed on the
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


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


if not _gpu_stack():
    collect_ignore.append("gpu_quickstart.ipynb")
if not _gpu_stack() or _gpus() < 2 or importlib.util.find_spec("ray") is None:
    collect_ignore.append("gpu_two_devices.ipynb")
