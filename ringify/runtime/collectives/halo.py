"""A convolution along the sequence: a halo exchange of kernel-width rows, then local.

``same_conv1d(x, weight, bias, left, right, groups)`` is the definition on a full
(B, C, S) tensor: a stride-1 ``conv1d`` of ``x`` zero-padded by ``left`` positions before
and ``right`` after, with ``left + right = kernel - 1``, so that the output keeps the
sequence's length. It is what a model's "same" convolution computes (Wav2Vec2's
positional convolution with its last position cut off, a Conformer's or Mamba's
depthwise convolution).

``ring_conv1d`` is the same on a sequence sharded over a ring. Each chunk needs the last
``left`` positions of the chunk before it and the first ``right`` of the chunk after it:
those edges of every chunk are all-gathered (kernel-width rows per chunk, not the
sequence), moved one chunk along (or as many as a halo wider than a chunk spans), and each
rank takes those of its own chunks, as ``ring_shift`` does for one side; then each chunk is
convolved with its halo and no padding. Positions the ring padded count as zeros, as beyond the sequence's end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringify.runtime.collectives.layout import chunks_per_rank
from ringify.runtime.collectives.sharding import gather_op, take_shard_op
from ringify.runtime.collectives.shift import shifted


def same_conv1d(x, weight, bias, left: int, right: int, groups: int) -> torch.Tensor:
    """``conv1d`` of ``x`` (B, C, S) zero-padded by ``left`` and ``right`` positions."""
    return F.conv1d(F.pad(x, (left, right)), weight, bias, groups=groups)


def ring_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    left: int,
    right: int,
    groups: int,
    padded: int,
    length: int,
    group_name: str,
    layout: str,
) -> torch.Tensor:
    """``same_conv1d`` of the full (padded) sequence of ``length`` positions, of which ``x``'s
    last dim holds this rank's; ``left`` and ``right`` are at most a chunk each."""
    if padded != length:  # the ring's padding is beyond the sequence: zeros, as conv1d pads
        positions = take_shard_op(torch.arange(padded, device=x.device), 0, group_name, layout)
        x = torch.where(positions < length, x, torch.zeros((), dtype=x.dtype, device=x.device))
    chunks = x.chunk(chunks_per_rank(layout), -1)
    before = _halo(chunks, -left, group_name, layout)
    after = _halo(chunks, right, group_name, layout)
    parts = [
        F.conv1d(torch.cat([b, c, a], -1), weight, bias, groups=groups)
        for b, c, a in zip(before, chunks, after, strict=True)
    ]
    return torch.cat(parts, -1)


def _halo(chunks: tuple, side: int, group_name: str, layout: str) -> list:
    """For each of this rank's chunks, the ``|side|`` positions of the sequence just before
    it (``side`` < 0) or just after it (> 0), zeros beyond the ends. Every chunk's edge
    (``|side|`` rows, or the whole chunk if it is shorter) is all-gathered once, in global
    order; a halo wider than a chunk is read from as many chunks as it spans."""
    k = abs(side)
    if k == 0:
        return [c.narrow(-1, 0, 0) for c in chunks]
    size = chunks[0].shape[-1]
    width = min(k, size)
    edges = [
        c.narrow(-1, size - width, width) if side < 0 else c.narrow(-1, 0, width) for c in chunks
    ]
    dim = chunks[0].dim() - 1
    every = gather_op(torch.cat(edges, dim).contiguous(), dim, group_name, layout)
    spans = range(-(-k // width), 0, -1) if side < 0 else range(1, -(-k // width) + 1)
    pieces = [  # for each chunk g, the edges of chunks g - j (before) or g + j (after)
        take_shard_op(
            shifted(every, dim, j * width if side > 0 else -j * width, 0), dim, group_name, layout
        ).chunk(len(chunks), dim)
        for j in spans
    ]
    halos = [torch.cat([p[i] for p in pieces], dim) for i in range(len(chunks))]
    return [h.narrow(dim, h.shape[dim] - k, k) if side < 0 else h.narrow(dim, 0, k) for h in halos]
