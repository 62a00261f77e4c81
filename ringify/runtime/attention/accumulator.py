"""A ring call's running result: the blocks' ``(out, lse)`` merged by log-sum-exp.

Merging a block into an empty accumulator (lse = -inf) takes the block exactly
(``blocks.merge_block``). So the first block that covers every row is taken as the
accumulator instead of being merged into a zeroed one: no zero-filled buffers and no
merge to launch (on a GPU, about a dozen launches per call). Its rows that see no key
already hold out = 0 and lse = -inf (``block_forward``'s contract), as a merge leaves them.
"""

from __future__ import annotations

import torch

from ringify.runtime.attention.blocks import merge_block
from ringify.runtime.attention.outputs import empty_in_dim_order_of, in_dim_order_of
from ringify.runtime.tiling.moves import ShardRows


class Accumulator:
    """The merged ``(out, lse)`` of a call's query rows ``q`` (rows on dim 2), in ``dtype``:
    ``out`` in q's dim order, ``lse`` (B, H, S) dense, as the ring op returns them."""

    def __init__(self, q: torch.Tensor, dtype: torch.dtype):
        self._q, self._dtype = q, dtype
        self._out: ShardRows | None = None
        self._lse: ShardRows | None = None

    def merge(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold the block of query rows ``rows`` in."""
        if self._out is None and rows.start == 0 and rows.stop == self._q.shape[2]:
            out = in_dim_order_of(self._q, out, self._dtype)  # itself where it already is
            self._out, self._lse = ShardRows(out), ShardRows(dense(lse, self._dtype))
            return
        if self._out is None:
            self._start_empty()
        merge_block(self._out[rows], self._lse[rows], out, lse)

    def results(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` in the accumulation dtype (empty rows: 0 and -inf)."""
        if self._out is None:  # no block had work: every row saw nothing
            self._start_empty()
        return self._out.tensor, self._lse.tensor

    def _start_empty(self) -> None:
        q = self._q
        out = empty_in_dim_order_of(q, self._dtype).zero_()
        lse = torch.full(q.shape[:3], float("-inf"), dtype=self._dtype, device=q.device)
        self._out, self._lse = ShardRows(out), ShardRows(lse)


class RowSum:
    """A sum of blocks of rows (dim 2) of a tensor shaped ``shape``, in ``dtype``, dense: a
    call's dQ, a slot's dK/dV on its way round the ring (``start``: the total arriving, added
    to in place), or its dK/dV arriving home. With no ``start``, the first block that covers
    every row is taken as the sum (0 + x is x), so that no zeroed buffer is filled and
    added to. ``like``: the sum lies in that tensor's dim order (a call's dQ in q's, which the
    kernels' dQ blocks have), else dense."""

    def __init__(
        self, shape, dtype: torch.dtype, device: torch.device, start: torch.Tensor | None = None,
        like: torch.Tensor | None = None,
    ):  # fmt: skip
        self._shape, self._dtype, self._device, self._like = shape, dtype, device, like
        self._sum = None if start is None else ShardRows(start)

    def add(self, rows: slice, grad: torch.Tensor) -> None:
        """Add ``grad`` into rows ``rows``."""
        if self._sum is None and rows.start == 0 and rows.stop == self._shape[2]:
            like = self._like
            taken = (
                dense(grad, self._dtype)
                if like is None
                else in_dim_order_of(like, grad, self._dtype)
            )
            self._sum = ShardRows(taken)
            return
        if self._sum is None:
            self._sum = ShardRows(self._zeros())
        self._sum[rows].add_(grad)

    def result(self) -> torch.Tensor:
        """The sum (zero where nothing was added)."""
        return self._zeros() if self._sum is None else self._sum.tensor

    def _zeros(self) -> torch.Tensor:
        if self._like is None:
            return torch.zeros(self._shape, dtype=self._dtype, device=self._device)
        return empty_in_dim_order_of(self._like, self._dtype).zero_()


def dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` contiguous in ``dtype``: itself where it already is, else one copy. (``Tensor.to``
    with ``memory_format=torch.contiguous_format`` returns a tensor of the same dtype as it is,
    strided or not.)"""
    if x.dtype != dtype:
        return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)
    return x if x.is_contiguous() else x.contiguous()
