"""A shift along the sequence: each position takes the value ``shift`` positions on.

``shifted(x, dim, shift, fill)`` is the definition on a full tensor: ``out[p] =
x[p + shift]``, and ``fill`` where ``p + shift`` falls outside the sequence (a
scalar, or a tensor of ``|shift|`` positions: a start token, or the value ``diff``
prepends or appends). It is what a model's "pad, then slice" (HF's label shift) or "a
start token, then all but the last" (a decoder's input) computes.

``ring_shift`` is the same on a sequence sharded over a ring: a halo exchange.
Every rank's chunks need ``|shift|`` positions of the next (or previous) chunk;
those edges of every chunk are all-gathered (``|shift|`` positions per chunk,
not the sequence), laid in global order, moved one chunk along, and each rank
takes those of its own chunks (``take_shard``, which looks the rank up when it
runs).
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.layout import chunks_per_rank
from ringify.runtime.collectives.sharding import gather_op, take_shard_op


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
