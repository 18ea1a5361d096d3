"""What lets ``pytest tests/gpu`` run every file in one process: each file's engines are given back before the next
file builds its own (a vLLM engine and a Megatron policy per file hold tens of GiB until collected), and Megatron's
process groups are made again when a vLLM shutdown tore the default group down
(``asyncrl/backends/megatron_parallel.py``). Without CUDA every file skips at import."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _give_the_gpu_back_after_each_file():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
