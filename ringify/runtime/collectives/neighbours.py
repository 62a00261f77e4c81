"""Ops along the sequence that read their neighbours: a shift, a "same" convolution, a running sum.

Each has its definition on a full tensor and its form on a sequence sharded over a ring,
which exchanges only what crosses a chunk's edge (never the sequence):

- ``shifted(x, dim, shift, fill)``: ``out[p] = x[p + shift]``, and ``fill`` where
  ``p + shift`` falls outside the sequence (a scalar, or a tensor of ``|shift|``
  positions: a start token, or what ``diff`` prepends). It is what a model's "pad, then
  slice" (HF's label shift) or "a start token, then all but the last" computes.
  ``ring_shift``: every chunk's ``|shift|`` edge positions are all-gathered, laid in global
  order, moved one chunk along, and each rank takes those of its own chunks
  (``take_shard``, which looks the rank up when it runs).
- ``same_conv1d(x, weight, bias, left, right, groups)``: a stride-1 ``conv1d`` zero-padded
  by ``left`` before and ``right`` after (``left + right = kernel - 1``), keeping the
  length: Wav2Vec2's positional convolution, a Conformer's or Mamba's depthwise one.
  ``ring_conv1d``: each chunk's ``left`` and ``right`` edge rows are all-gathered and moved
  one chunk along (or as many as a halo wider than a chunk spans), as ``ring_shift`` does
  for one side; each chunk is then convolved with its halo and no padding. Positions the
  ring padded count as zeros, as beyond the sequence's end.
- ``cumsum``: ``ring_cumsum`` sums each chunk locally, gathers the chunk totals (by
  ``ringify::gather``, whose backward takes each rank's slice of the replicated gradient)
  and adds to each chunk the total of every chunk before it in global order: an
  exclusive scan. Padding sits at the end of the sequence, so it never enters a real
  position's prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringify.runtime.collectives.layout import chunks_per_rank
from ringify.runtime.collectives.ring import LOCAL
from ringify.runtime.collectives.sharding import gather_op, take_shard_op


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


def shifted(x: torch.Tensor, dim: int, shift: int, fill) -> torch.Tensor:
    """``out[p] = x[p + shift]`` along ``dim``; ``fill`` beyond the ends."""
    k, length = abs(shift), x.shape[dim]
    block = _fill_block(x, dim, k, fill)
    if shift > 0:
        return torch.cat([x.narrow(dim, k, length - k), block], dim)
    return torch.cat([block, x.narrow(dim, 0, length - k)], dim)


def ring_shift(
    x: torch.Tensor,
    dim: int,
    shift: int,
    fill,
    padded: int,
    length: int,
    group_name: str,
    layout: str,
) -> torch.Tensor:
    """``shifted`` of the full (padded) sequence of ``length`` positions, of which ``dim``
    holds this rank's; ``|shift|`` is at most a chunk."""
    k = abs(shift)
    chunks = x.chunk(chunks_per_rank(layout), dim)
    size = chunks[0].shape[dim]
    edges = [c.narrow(dim, 0, k) if shift > 0 else c.narrow(dim, size - k, k) for c in chunks]
    every = gather_op(torch.cat(edges, dim).contiguous(), dim, group_name, layout)
    # every chunk's edges, one chunk along: chunk g gets chunk g + 1's (or g - 1's)
    neighbours = shifted(every, dim, shift, fill)
    mine = take_shard_op(neighbours.contiguous(), dim, group_name, layout).chunk(len(chunks), dim)
    parts = [
        torch.cat(
            [c.narrow(dim, k, size - k), m] if shift > 0 else [m, c.narrow(dim, 0, size - k)], dim
        )
        for c, m in zip(chunks, mine, strict=True)
    ]
    out = torch.cat(parts, dim)
    if shift > 0 and padded != length:  # the last real positions take the fill, not padding
        positions = take_shard_op(torch.arange(padded, device=x.device), 0, group_name, layout)
        beyond = (positions + k >= length).view([-1] + [1] * (x.dim() - dim - 1))
        out = torch.where(beyond, _fill_value(x, fill), out)
    return out


def _fill_value(x: torch.Tensor, fill) -> torch.Tensor:
    """``fill`` as a 0-d tensor of x's dtype on x's device; a number is filled in there (a
    kernel), not copied from the host (a copy per call, which a CUDA graph cannot record)."""
    if isinstance(fill, torch.Tensor):
        return fill.to(device=x.device, dtype=x.dtype)
    return torch.full((), fill, dtype=x.dtype, device=x.device)


def _fill_block(x: torch.Tensor, dim: int, k: int, fill) -> torch.Tensor:
    if isinstance(fill, torch.Tensor):
        return fill
    shape = list(x.shape)
    shape[dim] = k
    return torch.full(shape, fill, dtype=x.dtype, device=x.device)


def ring_cumsum(
    x: torch.Tensor, dim: int, group_name: str, layout: str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``cumsum`` along ``dim`` of the full sequence, this rank's positions of it."""
    x = x if dtype is None else x.to(dtype)
    if group_name == LOCAL:
        return x.cumsum(dim)
    dim = dim % x.dim()
    per_rank = chunks_per_rank(layout)
    shape = list(x.shape)
    chunked = x.unflatten(dim, (per_rank, shape[dim] // per_rank))  # (..., c, chunk, ...)
    running = chunked.cumsum(dim + 1)
    totals = running.narrow(dim + 1, -1, 1)  # (..., c, 1, ...): a chunk's total each
    # every chunk's total in global chunk order: the totals are laid out like the sequence
    # (a rank's c chunks), so gathering them under the layout orders them
    in_order = gather_op(totals, dim, group_name, layout)
    before = in_order.cumsum(dim) - in_order  # exclusive: the total of all earlier chunks
    mine = take_shard_op(before, dim, group_name, layout)  # (..., c, 1, ...)
    return (running + mine).flatten(dim, dim + 1)
