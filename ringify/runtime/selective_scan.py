"""Mamba-1's selective scan as one op, and along a sequence sharded over the ring.

The recurrence, for a, b of shape (B, D, S, N) and c of shape (B, S, N)::

    h[:, :, t] = a[:, :, t] * h[:, :, t - 1] + b[:, :, t]      (h before the first: h0, or 0)
    y[:, :, t] = (h[:, :, t] * c[:, None, t]).sum(-1)            y: (B, D, S)

is what the torch path of HF's Mamba-1 mixers (Mamba, FalconMamba, Jamba, Zamba) computes
with a Python loop over positions, which ``torch.export`` unrolls; ``passes/folds/scans.py``
folds the unrolled loop back into ``selective_scan``.

``ringify::selective_scan`` (``runtime/scan_kernel.py``) computes it without a loop per
position, and keeps nothing of the states' size between its forward and backward.

``ring_selective_scan`` is the same over a sharded sequence, by state passing, not a gather:
each chunk's product of ``a`` and its last state from zero are gathered (B x D x N numbers
per chunk), every chunk's carried-in state follows from those in global order, and each
chunk runs the scan from it. The backward flows back through the same gather.
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.layout import chunks_per_rank
from ringify.runtime.collectives.sharding import gather_op, take_shard_op
from ringify.runtime.scan_kernel import selective_scan_op


def selective_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``y`` of the recurrence from a zero state, on a full sequence (the folded graph's node)."""
    return selective_scan_op(a, b, c, None, state_dtype, out_dtype)[0]


def ring_selective_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state_dtype: torch.dtype,
    out_dtype: torch.dtype,
    padded: int,
    length: int,
    group_name: str,
    layout: str,
) -> torch.Tensor:
    """``selective_scan`` of the full (padded) sequence of ``length`` positions, this rank's
    positions of it; a, b and c hold this rank's chunks along dims 2, 2 and 1."""
    if padded != length:  # the padding: a = b = c = 0, so nothing crosses it either way
        positions = take_shard_op(torch.arange(padded, device=a.device), 0, group_name, layout)
        real = (positions < length).view(-1, 1)
        a, b = (
            torch.where(real, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in (a, b)
        )
        c = torch.where(real, c, torch.zeros((), dtype=c.dtype, device=c.device))
    per_rank = chunks_per_rank(layout)
    chunks = list(
        zip(a.chunk(per_rank, 2), b.chunk(per_rank, 2), c.chunk(per_rank, 1), strict=True)
    )
    # each chunk's product of a, and its last state from zero: how it maps a state on entry
    # to its state on exit, gathered in the sequence's global chunk order
    products = torch.stack([ai.to(state_dtype).prod(2) for ai, _, _ in chunks], 2)
    lasts = torch.stack(
        [selective_scan_op(ai, bi, None, None, state_dtype, out_dtype)[1] for ai, bi, _ in chunks],
        2,
    )
    products = gather_op(products, 2, group_name, layout)
    lasts = gather_op(lasts, 2, group_name, layout)
    entering = [torch.zeros_like(lasts[:, :, 0])]
    for k in range(lasts.shape[2] - 1):
        entering.append(products[:, :, k] * entering[-1] + lasts[:, :, k])
    mine = take_shard_op(torch.stack(entering, 2), 2, group_name, layout)
    outs = [
        selective_scan_op(ai, bi, ci, mine[:, :, j], state_dtype, out_dtype)[0]
        for j, (ai, bi, ci) in enumerate(chunks)
    ]
    return torch.cat(outs, 2)
