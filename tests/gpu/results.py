"""What a GPU test file measured: each number printed as a ``RESULT key = json`` line and, when
``ASYNCRL_GPU_RESULTS`` names a folder, the file's numbers so far written to ``<name>.json`` there (what
benchmarks/data/gpu_checks keeps)."""

from __future__ import annotations

import json
import os
import time

import torch


class Results(dict):
    """A test file's numbers, with the machine and date they were taken on."""

    def __init__(self, name: str, **fields):
        super().__init__(machine=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                         date=time.strftime("%Y-%m-%d"), **fields)
        self.name = name

    def record(self, key: str, value) -> None:
        self[key] = value
        print(f"RESULT {key} = {json.dumps(value)}", flush=True)
        self.write()

    def write(self) -> None:
        out = os.environ.get("ASYNCRL_GPU_RESULTS")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"{self.name}.json"), "w") as f:
                json.dump(self, f, indent=1)
