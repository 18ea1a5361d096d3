"""What the generation engines share about a group's sampling: its seed and its completion token limit, both
drawn from the run's seed and the group id only, so a group samples the same whichever batch or wave carries it
(``asyncrl/backends/vllm.py`` and ``asyncrl/backends/torch.py`` use them; neither imports the other).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch


def group_seed(seed: int, group_id: int) -> int:
    """A 31-bit sampling seed for one group (vLLM gives sample ``i`` of the group ``seed + i``)."""
    digest = hashlib.blake2b(f"{seed}:{group_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x3FFFFFFF


def group_max_tokens(gen_cfg: Any, seed: int, group_id: int) -> int:
    """A group's completion token limit: ``max_new_tokens``, or with ``min_new_tokens_tail`` a long-tailed draw
    ``min(max_new_tokens, round(min_new_tokens_tail * exp(length_sigma * |z|)))``, z standard normal from a
    generator seeded by (seed, group id): the same group gets the same limit whichever wave it is in."""
    lo = gen_cfg.min_new_tokens_tail
    if lo is None:
        return gen_cfg.max_new_tokens
    rng = torch.Generator().manual_seed(group_seed(seed, group_id) ^ 0x5EED)
    z = abs(float(torch.randn((), generator=rng)))
    return int(min(gen_cfg.max_new_tokens, max(lo, round(lo * math.exp(gen_cfg.length_sigma * z)))))
