"""Between a full tensor and every rank's sequence shard: ``shard``, ``gather`` and their ops.

``shard(x, dim)`` is this rank's part of a full tensor (a differentiable slice);
``gather(x, dim)`` the full tensor from every rank's part. The graph pass uses the
custom ops ``ringify::gather`` and ``ringify::take_shard``: compile-friendly, and
each is the other's backward. A full
(replicated) tensor is computed identically on every rank, so its gradient is
too: the backward of ``gather`` is each rank's slice of the incoming gradient
(not a reduce-scatter), and the backward of ``take_shard`` gathers the slices.

The slice is itself a custom op (``ringify::take_shard``) that looks the rank
up when it runs. Reading the rank while tracing would bake it into the compiled
backward, and the compile caches, shared by every rank of a machine and keyed
by the forward graph, would then hand one rank another's backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringify.runtime.collectives.layout import (
    check_layout,
    check_splittable,
    shard_for_rank,
    unshard,
)
from ringify.runtime.collectives.ring import check_backend_serves, resolve_ring, ring_by_name


@torch.library.custom_op("ringify::gather", mutates_args=())
def gather_op(
    x: torch.Tensor, dim: int, group_name: str, layout: str, length: int = -1
) -> torch.Tensor:
    """The full tensor from every rank's part ``x``; with ``length`` >= 0 its first ``length``
    positions along ``dim`` (the padding cut off inside the op: a fresh dense tensor, so that
    nothing downstream asks whether a cut view is contiguous, which depends on the length)."""
    ring = ring_by_name(group_name)
    if ring.size == 1:
        full = x
    else:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(ring.size)]
        dist.all_gather(parts, x, group=ring.group)
        full = unshard(parts, dim, layout)
    if length >= 0:
        full = full.narrow(dim, 0, length)
    return full.clone(memory_format=torch.contiguous_format) if full is x or length >= 0 else full


@gather_op.register_fake
def _(x, dim, group_name, layout, length=-1):
    shape = list(x.shape)
    shape[dim] = length if length >= 0 else shape[dim] * ring_by_name(group_name).size
    return x.new_empty(shape)


@torch.library.custom_op("ringify::take_shard", mutates_args=())
def take_shard_op(x: torch.Tensor, dim: int, group_name: str, layout: str) -> torch.Tensor:
    """This rank's part of the full tensor ``x`` (a fresh tensor: op outputs never alias inputs)."""
    ring = ring_by_name(group_name)
    part = shard_for_rank(x, dim, ring.rank, ring.size, layout)
    return part.clone(memory_format=torch.contiguous_format)


@take_shard_op.register_fake
def _(x, dim, group_name, layout):
    shape = list(x.shape)
    shape[dim] //= ring_by_name(group_name).size
    return x.new_empty(shape)


def _setup_context(ctx, inputs, output):
    _, ctx.dim, ctx.group_name, ctx.layout = inputs


def _setup_gather(ctx, inputs, output):
    x, ctx.dim, ctx.group_name, ctx.layout, ctx.length = inputs
    ctx.full = x.shape[ctx.dim] * ring_by_name(ctx.group_name).size


def _gather_backward(ctx, grad):
    if ctx.length >= 0:  # the cut padding had no gradient
        pad = [0, 0] * (grad.dim() - ctx.dim - 1) + [0, ctx.full - ctx.length]
        grad = torch.nn.functional.pad(grad, pad)
    shard = take_shard_op(grad.contiguous(), ctx.dim, ctx.group_name, ctx.layout)
    return shard, None, None, None, None


def _take_shard_backward(ctx, grad):
    return gather_op(grad.contiguous(), ctx.dim, ctx.group_name, ctx.layout), None, None, None


gather_op.register_autograd(_gather_backward, setup_context=_setup_gather)
take_shard_op.register_autograd(_take_shard_backward, setup_context=_setup_context)


def gather(
    x: torch.Tensor,
    dim: int,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
) -> torch.Tensor:
    """The full tensor from every rank's part ``x`` along ``dim``, in global order.

    Differentiable: the backward hands each rank its own slice of the incoming
    gradient (every rank is assumed to compute the same thing downstream).
    """
    ring = resolve_ring(group)
    check_layout(layout)
    dim = dim % x.dim()
    if layout == "zigzag":
        check_splittable(x.shape[dim] * ring.size, ring.size, layout, what="gathered")
    check_backend_serves(ring, x.device)
    return gather_op(x, dim, ring.name, layout)


def shard(
    x: torch.Tensor,
    dim: int,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
) -> torch.Tensor:
    """This rank's part of the full tensor ``x`` along ``dim`` under ``layout``.

    Differentiable (a slice): its gradient is the incoming gradient placed at
    this rank's positions, zero elsewhere.
    """
    ring = resolve_ring(group)
    return shard_for_rank(x, dim, ring.rank, ring.size, layout)
