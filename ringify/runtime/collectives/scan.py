"""A running sum (``cumsum``) along a sequence sharded over the ring.

Each rank sums its chunks locally; the chunk totals of every rank are gathered,
laid out in the sequence's global chunk order (the layout's), and each chunk adds
the total of every chunk before it: an exclusive scan of the totals. The totals
travel by ``ringify::gather``, whose backward takes each rank's slice of the
(replicated) gradient, so a position's gradient reaches the earlier positions on
every rank, as in the full cumsum.

Padding sits at the end of the global sequence, so it never enters a real
position's prefix.
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.layout import chunks_per_rank
from ringify.runtime.collectives.ring import LOCAL
from ringify.runtime.collectives.sharding import gather_op, take_shard_op


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
