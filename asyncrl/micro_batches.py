"""Micro-batches: how a policy engine cuts one chunk (a padded ``TrainBatch``) into forward/backward passes.

Three plans (``trainer.micro_batching``), all computed on the CPU from the chunk's sequence lengths, once a chunk:

- ``rows``: ``micro_batch_size`` rows at a time in the chunk's order (None: the whole chunk), each padded to the
  chunk's longest sequence. The old path, and the torch engine's default (its CPU runs stay bit for bit what they
  were, and ``examples/plain_grpo.py`` runs the same engine).
- ``sorted``: sequences sorted by length (longest first, ties by position); a micro-batch takes the next ones while
  ``rows x its longest <= micro_batch_tokens`` (at least one), and is trimmed to its own longest.
- ``packed`` (Megatron's default): sequences packed into rows as wide as the chunk's longest sequence (best-fit
  decreasing), each attending only to itself through a block-diagonal causal mask; a micro-batch is
  ``max(1, micro_batch_tokens // width)`` rows. Rows are never wider than a padded row would be, so attention's
  ``[rows, heads, width, width]`` scores need no more memory per row than padding did, and far fewer rows are needed
  (``benchmarks/bench_padding.py`` counts positions per real token on the gen-heavy preset's long-tailed lengths).

Invariants (``tests/test_micro_batches.py`` checks them):
- Every sequence of the chunk is in exactly one micro-batch. The loss sees a micro-batch as ``[n, width]``
  per-sequence tensors (``take``; a packed forward's outputs are unpacked by ``unpack`` first), so advantages,
  token- and sequence-level normalisation and sequence-level importance weights are those of the unsplit chunk; the
  engine sums the loss sums and divides once per step. Gradients equal the whole chunk's up to float reassociation,
  independent of the budget and the order.
- Trimming drops only columns that are padding in every row of a micro-batch: right padding cannot influence an
  earlier position under causal attention.
- Packing is exact in real arithmetic: the mask keeps each sequence to itself (a masked score is -10000 before an
  fp32 softmax: its weight underflows to exactly 0), and rotary embeddings are relative, so a sequence at offset
  ``o`` of a row computes what it computes at offset 0, up to the rounding of the rotation angles. A sequence's first
  position is a prompt token (loss mask 0), so the logprob read across a boundary from the previous sequence is never
  used (``plan`` refuses a chunk where it would be).
- A plan depends only on the lengths: the same chunk gets the same micro-batches (``TorchPolicy.logprobs`` and its
  training forward must compute the same numbers).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Literal

import torch

from asyncrl.data import TrainBatch

MicroBatching = Literal["rows", "sorted", "packed"]


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward pass of a chunk.

    ``rows``: the chunk's sequences in it (a slice for ``rows`` plans, else an index tensor); ``width``: its longest
    sequence (tensors are trimmed to it). Packed: ``packed`` [R, W] is, for each position of the packed rows, its
    flat index into the chunk's ``[B, S]`` tensors (padding points at index 0, any real token would do);
    ``segments`` [R, W] which of the micro-batch's sequences a position belongs to (-1: padding); ``unpack``
    [n, width] each sequence position's flat index into the packed ``[R * W]`` outputs."""

    rows: slice | torch.Tensor
    width: int
    real_tokens: int
    positions: int  # positions the forward computes: rows x width, padding included
    packed: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    unpack: torch.Tensor | None = None

    def to(self, device: torch.device) -> MicroBatch:
        move = lambda t: t if not isinstance(t, torch.Tensor) else t.to(device, non_blocking=True)  # noqa: E731
        return replace(self, rows=move(self.rows), packed=move(self.packed), segments=move(self.segments),
                       unpack=move(self.unpack))


def check_knobs(mode: str, micro_batch_size: int | None, micro_batch_tokens: int | None) -> None:
    """A ValueError naming the value and what is allowed, before anything runs."""
    if mode not in ("rows", "sorted", "packed"):
        raise ValueError(f"micro_batching {mode!r}: allowed 'rows', 'sorted', 'packed'")
    if mode == "rows" and micro_batch_tokens is not None:
        raise ValueError(f"micro_batch_tokens {micro_batch_tokens} applies to micro_batching 'sorted' or 'packed'; "
                         "'rows' cuts micro_batch_size sequences at a time")
    if mode != "rows" and micro_batch_size is not None:
        raise ValueError(f"micro_batch_size {micro_batch_size} applies to micro_batching 'rows'; {mode!r} cuts by "
                         "micro_batch_tokens")
    for name, value in (("micro_batch_size", micro_batch_size), ("micro_batch_tokens", micro_batch_tokens)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} {value!r}: must be a positive integer or None")


def plan(batch: TrainBatch, mode: MicroBatching = "rows", micro_batch_size: int | None = None,
         micro_batch_tokens: int | None = None) -> list[MicroBatch]:
    """The micro-batches of ``batch`` (on the CPU; ``MicroBatch.to`` moves the index tensors)."""
    check_knobs(mode, micro_batch_size, micro_batch_tokens)
    B, S = batch.input_ids.shape
    if B == 0:
        return []
    lengths = batch.attention_mask.sum(-1).tolist()  # right padded: a row's real length
    if mode == "rows":
        step = micro_batch_size or B
        return [MicroBatch(slice(a, min(a + step, B)), S, int(sum(lengths[a:a + step])), min(step, B - a) * S)
                for a in range(0, B, step)]
    budget = micro_batch_tokens or 16384
    order = sorted(range(B), key=lambda i: (-lengths[i], i))
    if mode == "sorted":
        out, i = [], 0
        while i < B:
            width = lengths[order[i]]
            n = max(1, min(B - i, budget // max(1, width)))
            rows = order[i:i + n]
            out.append(MicroBatch(torch.tensor(rows), width, int(sum(lengths[r] for r in rows)), n * width))
            i += n
        return out
    if bool(batch.loss_mask[:, 0].any()):
        raise ValueError("packing needs every sequence to start with a prompt token (loss mask 0 at position 0): "
                         "its first logprob would be read across the previous sequence's end")
    return _packed(lengths, order, S, budget)


def _packed(lengths: list[int], order: list[int], S: int, budget: int) -> list[MicroBatch]:
    W = lengths[order[0]]
    free: list[tuple[int, int]] = []  # (room left, row) of rows that still have room, sorted
    rows: list[list[tuple[int, int]]] = []  # per packed row: (sequence, offset)
    for i in order:  # best fit: the row with the least room that still holds sequence i
        j = bisect.bisect_left(free, (lengths[i], -1))
        if j < len(free):
            room, r = free.pop(j)
        else:
            room, r = W, len(rows)
            rows.append([])
        rows[r].append((i, W - room))
        if room - lengths[i] > 0:
            bisect.insort(free, (room - lengths[i], r))
    per = max(1, budget // max(1, W))
    out = []
    for first in range(0, len(rows), per):
        chunk = rows[first:first + per]
        seqs = [(i, r, off) for r, row in enumerate(chunk) for i, off in row]
        seq = torch.tensor([i for i, _, _ in seqs])
        row = torch.tensor([r for _, r, _ in seqs])
        off = torch.tensor([o for _, _, o in seqs])
        lens = torch.tensor([lengths[i] for i, _, _ in seqs])
        n, R, width = len(seqs), len(chunk), int(lens.max())
        which = torch.repeat_interleave(torch.arange(n), lens)  # for every real token: its sequence ...
        within = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)  # ... position
        at = row[which] * W + off[which] + within  # its place in the packed [R * W]
        packed = torch.zeros(R * W, dtype=torch.long)
        packed[at] = seq[which] * S + within
        segments = torch.full((R * W,), -1, dtype=torch.long)
        segments[at] = which
        unpack = (row * W + off).unsqueeze(1).repeat(1, width)  # past a sequence's end: its first (masked anyway)
        unpack[which, within] = at
        out.append(MicroBatch(seq, width, int(lens.sum()), R * W, packed.view(R, W), segments.view(R, W), unpack))
    return out


def take(batch: TrainBatch, mb: MicroBatch) -> TrainBatch:
    """The micro-batch's sequences as ``[n, width]`` tensors (what the loss sees), from a batch on ``mb``'s device."""
    cut = lambda t: None if t is None else t[mb.rows][:, :mb.width]  # noqa: E731
    return TrainBatch(cut(batch.input_ids), cut(batch.attention_mask), cut(batch.loss_mask), cut(batch.gen_logprobs),
                      batch.advantages[mb.rows], [], cut(batch.prev_logprobs), cut(batch.ref_logprobs),
                      cut(batch.stale_mask), cut(batch.version_logprobs))


def packed_ids(batch: TrainBatch, mb: MicroBatch) -> torch.Tensor:
    """[R, W] token ids of a packed micro-batch."""
    return batch.input_ids.reshape(-1)[mb.packed]


def block_causal_mask(mb: MicroBatch) -> torch.Tensor:
    """[R, 1, W, W] bool, True where attention is *masked* (Megatron's convention): each position sees the earlier
    positions of its own sequence only (padding sees padding)."""
    seg = mb.segments
    W = seg.shape[1]
    causal = torch.ones(W, W, dtype=torch.bool, device=seg.device).tril()
    return ~((seg.unsqueeze(2) == seg.unsqueeze(1)) & causal).unsqueeze(1)


def unpack(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """[R, W] per-position values of a packed forward -> [n, width] per sequence (aligned with ``take``)."""
    return values.reshape(-1)[mb.unpack]


def predicting_positions(mb: MicroBatch, seqs: TrainBatch, rows: int, width: int, seq_first: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The positions whose next-token logprob a loss reads, for a micro-batch whose forward ran on ``[rows,
    width]`` ids (its packed rows, or its ``[n, width]`` sequences ``seqs``): ``(src, dst, targets)`` for every
    token under the loss mask past a sequence's first position. ``src``: the index of the position that predicts it
    (the one before it, in its own sequence) into the forward's outputs flattened row-major, or sequence-first
    (``[width, rows]``, Megatron's layout) with ``seq_first``; ``dst``: the token's flat index into the
    ``[n, seq width]`` per-sequence tensors; ``targets``: its id. Position 0 never predicts (``token_logprobs``
    gives it 0)."""
    mask = seqs.loss_mask > 0
    mask[:, 0] = False
    i, j = mask.nonzero(as_tuple=True)
    if mb.packed is None:
        r, c = i, j - 1
    else:
        flat = mb.unpack[i, j] - 1  # the packed position before it: the same sequence's previous token
        r, c = flat // width, flat % width
    src = c * rows + r if seq_first else r * width + c
    return src, i * seqs.loss_mask.shape[1] + j, seqs.input_ids[i, j]


def scatter_positions(values: torch.Tensor, dst: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``values`` at ``predicting_positions``' ``dst`` of a zero ``shape`` tensor (differentiable in ``values``)."""
    return values.new_zeros(shape[0] * shape[1]).scatter(0, dst, values).view(shape)


def add_all(acc, parts: list[dict]) -> dict[str, float]:
    """Add every micro-batch's contributions (floats or 0-dim tensors on one device) to the accumulator ``acc`` in
    order, with one device-to-host transfer for the lot instead of a sync per value; returns their sums by name."""
    where = [(i, k) for i, part in enumerate(parts) for k, v in part.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([parts[i][k].detach().double().reshape(()) for i, k in where]).tolist() if where else []
    parts = [dict(part) for part in parts]
    for (i, k), v in zip(where, values):
        parts[i][k] = v
    totals: dict[str, float] = {}
    for part in parts:
        acc.add(part)
        for k, v in part.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return totals
