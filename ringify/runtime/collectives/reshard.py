"""Between a sequence shard and a shard of another dim: ``ringify::to_dim`` and ``from_dim``.

A region that needs the whole sequence but keeps another dim independent (an SSM scan's
heads, a convolution's channels) runs on every position of a share of that dim instead of
gathering it (``passes/sharding/resharded.py`` finds such regions):

- ``to_dim(x, seq_dim, dim, ...)``: this rank's positions of every channel -> every position,
  in global order and cut to ``length``, of this rank's ``1/P`` of ``dim`` (rank r keeps
  the r-th contiguous share);
- ``from_dim(y, ...)``: the inverse, the positions padded back to the ring's ``padded`` with
  ``pad_value`` and this rank's part taken under the layout.

Each is one ``all_to_all_single`` moving (P-1)/P of the tensor, and each is the other's
backward (the cut padding has no gradient).
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.heads import exchanged
from ringify.runtime.collectives.layout import shard_for_rank, unshard
from ringify.runtime.collectives.ring import ring_by_name


@torch.library.custom_op("ringify::to_dim", mutates_args=())
def to_dim_op(
    x: torch.Tensor, seq_dim: int, dim: int, group_name: str, layout: str, length: int
) -> torch.Tensor:
    """Every position (the first ``length`` of them, in global order) of this rank's share of
    ``dim``, from every rank's positions ``x`` of all of it."""
    ring = ring_by_name(group_name)
    if ring.size == 1:
        return x.narrow(seq_dim, 0, length).clone(memory_format=torch.contiguous_format)
    share = x.shape[dim] // ring.size
    parts = torch.stack([x.narrow(dim, g * share, share) for g in range(ring.size)])
    received = exchanged(parts.contiguous(), ring)  # [g]: rank g's positions of my share
    full = unshard(list(received.unbind(0)), seq_dim, layout)
    return full.narrow(seq_dim, 0, length).contiguous()


@to_dim_op.register_fake
def _(x, seq_dim, dim, group_name, layout, length):
    shape = list(x.shape)
    shape[seq_dim], shape[dim] = length, shape[dim] // ring_by_name(group_name).size
    return x.new_empty(shape)


@torch.library.custom_op("ringify::from_dim", mutates_args=())
def from_dim_op(
    y: torch.Tensor, seq_dim: int, dim: int, group_name: str, layout: str, padded: int,
    pad_value: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """This rank's positions (under ``layout``, of the sequence padded to ``padded`` with
    ``pad_value``) of all of ``dim``, from every rank's share ``y`` of it at every position."""
    ring = ring_by_name(group_name)
    pad = padded - y.shape[seq_dim]
    if pad:
        spec = [0, 0] * (y.dim() - seq_dim - 1) + [0, pad]
        y = torch.nn.functional.pad(y, spec, value=pad_value)
    if ring.size == 1:
        return y.clone(memory_format=torch.contiguous_format)
    parts = torch.stack(
        [shard_for_rank(y, seq_dim, g, ring.size, layout) for g in range(ring.size)]
    )
    received = exchanged(parts.contiguous(), ring)  # [g]: my positions of rank g's share
    return torch.cat(list(received.unbind(0)), dim)


@from_dim_op.register_fake
def _(y, seq_dim, dim, group_name, layout, padded, pad_value=0.0):
    size = ring_by_name(group_name).size
    shape = list(y.shape)
    shape[seq_dim], shape[dim] = padded // size, shape[dim] * size
    return y.new_empty(shape)


def _setup_to_dim(ctx, inputs, output):
    x, ctx.seq_dim, ctx.dim, ctx.group_name, ctx.layout, _ = inputs
    ctx.padded = x.shape[ctx.seq_dim] * ring_by_name(ctx.group_name).size


def _to_dim_backward(ctx, grad):
    args = (ctx.seq_dim, ctx.dim, ctx.group_name, ctx.layout, ctx.padded)
    return from_dim_op(grad.contiguous(), *args), None, None, None, None, None


def _setup_from_dim(ctx, inputs, output):
    y, ctx.seq_dim, ctx.dim, ctx.group_name, ctx.layout, _, _ = inputs
    ctx.length = y.shape[ctx.seq_dim]


def _from_dim_backward(ctx, grad):
    args = (ctx.seq_dim, ctx.dim, ctx.group_name, ctx.layout, ctx.length)
    return to_dim_op(grad.contiguous(), *args), None, None, None, None, None, None


to_dim_op.register_autograd(_to_dim_backward, setup_context=_setup_to_dim)
from_dim_op.register_autograd(_from_dim_backward, setup_context=_setup_from_dim)
