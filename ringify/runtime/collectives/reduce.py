"""Where a full (replicated) tensor meets the sharded sequence, and where it leaves it.

Every rank computes replicated tensors identically, so their gradients are kept
identical too; a sharded computation only sees this rank's positions, so what it
contributes is partial. Two autograd functions keep that bookkeeping exact (the
pair Megatron calls f and g):

- ``copy_to_ring``: a replicated tensor used by a sharded computation (a weight,
  a bias, a broadcast operand). Identity forward; the backward sums the partial
  gradients of all ranks.
- ``copy_averaged_outside``: ``copy_to_ring`` for a weight whose gradient an outer
  data-parallel reduction over a group that holds the whole ring reduces anyway.
- ``reduce_from_ring``: a reduction over the sequence (a loss, a sum). Each rank
  reduces its positions, the forward sums over the ring; the backward hands every
  rank the (identical) incoming gradient.

``ring_amax`` is ``torch.amax`` over dims that include the sequence: the largest
of every rank's partial maxima (NaN wins), whose gradient, as torch's, is shared
evenly by the positions equal to the maximum, on whichever ranks they are (the
custom op ``ringify::ring_amax`` computes those shares once, in the forward).
``ring_argmax`` is the global position of the ring's first maximum.
``ring_take`` picks given global positions of the sequence (a cls token, a last
token): each rank contributes the rows it holds, zeros elsewhere, summed.

Every collective here is a functional collective (``_c10d_functional``), which AOTAutograd
and Inductor trace as graph nodes.
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.ring import LOCAL
from ringify.runtime.collectives.sharding import take_shard_op

_c10d = torch.ops._c10d_functional


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    # The functional op and an explicit wait: a graph node under compile, a finished
    # sum in eager (no AsyncCollectiveTensor left unwaited).
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group_name))


class _CopyToRing(torch.autograd.Function):
    """Identity; the backward sums the ring's partial gradients (``group_name``), or scales
    them by ``averaged_outside`` for an outer reduction to sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str, averaged_outside: int | None):
        ctx.group_name, ctx.averaged_outside = group_name, averaged_outside
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.averaged_outside is not None:
            return grad * ctx.averaged_outside, None, None
        return all_reduce(grad, ctx.group_name), None, None


class _ReduceFromRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def max_over_ring(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The elementwise maximum over the ring of every rank's ``x`` (NaN if any rank's is)."""
    if not x.is_floating_point():
        return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "max", group_name))
    nan = torch.isnan(x)
    packed = torch.stack([x.masked_fill(nan, float("-inf")), nan.to(x.dtype)])
    out = _c10d.wait_tensor(_c10d.all_reduce(packed, "max", group_name))
    return out[0].masked_fill(out[1] > 0, float("nan"))


@torch.library.custom_op("ringify::ring_amax", mutates_args=())
def ring_amax_op(
    x: torch.Tensor, dims: list[int], group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the maximum over ``dims`` and the ring, each position's share of its gradient).

    An opaque op, so that a compiler cannot recompute ``x == max`` in the backward
    from a bitwise different ``x``: the shares are computed once, here.
    """
    top = max_over_ring(x.amax(dims, keepdim=True), group_name)
    hit = x == top
    count = all_reduce(hit.sum(dims, keepdim=True, dtype=x.dtype), group_name)
    return top, hit / count


@ring_amax_op.register_fake
def _(x, dims, group_name):
    return x.amax(dims, keepdim=True), torch.empty_like(x)


def _save_shares(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _amax_backward(ctx, grad_top, _grad_shares):
    (shares,) = ctx.saved_tensors
    return grad_top * shares, None, None


ring_amax_op.register_autograd(_amax_backward, setup_context=_save_shares)


def ring_amax(x: torch.Tensor, dims: list[int], group_name: str) -> torch.Tensor:
    """``x.amax(dims, keepdim=True)`` over the ring: ``dims`` hold this rank's part of the
    sequence (padding already at the lowest value)."""
    if group_name == LOCAL:
        return x.amax(dims, keepdim=True)
    if not x.is_floating_point():
        return max_over_ring(x.amax(dims, keepdim=True), group_name)
    return ring_amax_op(x, dims, group_name)[0]


def ring_argmax(x: torch.Tensor, dim: int, padded: int, group_name: str, layout: str):
    """``x.argmax(dim, keepdim=True)`` of the full sequence: the global position of the first
    maximum (NaN counts as the maximum, as in torch); ``dim`` holds this rank's positions of
    a (padded) sequence of ``padded``, the padding already at the lowest value."""
    if group_name == LOCAL:
        return x.argmax(dim, keepdim=True)
    local = x.argmax(dim, keepdim=True)
    best = x.gather(dim, local)
    positions = take_shard_op(torch.arange(padded, device=x.device), 0, group_name, layout)
    found = positions[local]  # the global position of this rank's first maximum
    top = max_over_ring(best, group_name)
    mine = (best == top) | (best.isnan() & top.isnan()) if x.is_floating_point() else best == top
    # the first occurrence over the ring: the smallest position among the ranks holding top
    candidate = torch.where(mine, -found, torch.iinfo(torch.int64).min)
    return -max_over_ring(candidate, group_name)


def ring_take(
    x: torch.Tensor, dim: int, index: torch.Tensor, padded: int, group_name: str, layout: str
) -> torch.Tensor:
    """``x.index_select(dim, index)`` of the full sequence, the same on every rank: ``dim``
    holds this rank's positions of a (padded) sequence of ``padded``; ``index`` holds global
    positions. The gradient reaches only the rank that holds each position."""
    if group_name == LOCAL:
        return x.index_select(dim, index)
    held = take_shard_op(torch.arange(padded, device=x.device), 0, group_name, layout)
    local_of = torch.full((padded,), -1, dtype=torch.int64, device=x.device)
    local_of[held] = torch.arange(held.numel(), device=x.device)
    local = local_of[index]  # this rank's row of each position, -1 where another rank's
    rows = x.index_select(dim, local.clamp(min=0))
    shape = [1] * x.dim()
    shape[dim] = index.numel()
    mine = (local >= 0).view(shape)
    if x.dtype == torch.bool:  # sum over the ring as integers
        return reduce_from_ring((rows & mine).to(torch.uint8), group_name).bool()
    # where, not a product: another rank's NaN or inf must not reach this one's rows
    return reduce_from_ring(torch.where(mine, rows, torch.zeros_like(rows)), group_name)


def copy_to_ring(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``x`` itself; its gradient is summed over the ring (each rank's is partial)."""
    return x if group_name == LOCAL else _CopyToRing.apply(x, group_name, None)


def copy_averaged_outside(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``x`` itself; its gradient is this rank's partial gradient times ``scale``. For a
    weight whose gradients an outer data-parallel reduction spans every rank of the ring
    (FSDP over dp x cp): that reduction then sums the ring's partials, in the one
    reduction the gradient needs (``scale``: the ring's size under FSDP's default average,
    which divides by the ring's ranks too; 1 under an explicit divide factor)."""
    return _CopyToRing.apply(x, LOCAL, scale)


def reduce_from_ring(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over the ring of every rank's partial ``x``; the gradient passes through."""
    return x if group_name == LOCAL else _ReduceFromRing.apply(x, group_name)
