"""``ringify::topk``: a router's top-k, its backward one opaque kernel.

Inductor (torch 2.13, CPU) can fuse the backward of ``topk`` (a scatter of the values'
gradient into zeros) with what adds to that gradient, and read the zeros before the scatter
writes them: the gate's gradient is dropped, with no error (``docs/inductor_scatter.md``, a
plain-PyTorch reproduction; JetMoE returning its router logits hit it). As an op of its own
with a custom-op backward, the scatter is a kernel Inductor calls and cannot reorder. The
pass runs every top-k whose values carry a gradient through it (``passes/pipeline.py``).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten


@torch.library.custom_op("ringify::topk", mutates_args=())
def topk(
    x: torch.Tensor, k: int, dim: int, largest: bool, ordered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim, largest, sorted=ordered)``, fresh tensors."""
    values, indices = torch.topk(x, k, dim, largest, ordered)
    return values.clone(), indices.clone()


@topk.register_fake
def _(x, k, dim, largest, ordered):
    shape = list(x.shape)
    shape[dim] = k
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("ringify::topk_backward", mutates_args=())
def topk_backward(
    grad: torch.Tensor, indices: torch.Tensor, shape: list[int], dim: int
) -> torch.Tensor:
    """The gradient of ``topk``'s input: ``grad`` scattered to ``indices`` along ``dim``."""
    return grad.new_zeros(shape).scatter(dim, indices, grad)


@topk_backward.register_fake
def _(grad, indices, shape, dim):
    return grad.new_empty(shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.shape, ctx.dim = list(inputs[0].shape), inputs[2]


def _backward(ctx, grad, _):
    (indices,) = ctx.saved_tensors
    return topk_backward(grad.contiguous(), indices, ctx.shape, ctx.dim), None, None, None, None


topk.register_autograd(_backward, setup_context=_setup)


def opaque_topks(gm: fx.GraphModule) -> int:
    """Every ``aten.topk`` of a floating tensor whose values are read, as ``ringify::topk``
    (the same outputs, its backward opaque to Inductor); how many."""
    count = 0
    for node in gm.graph.nodes:
        if node.target is not aten.topk.default or not node.args[0].meta["val"].is_floating_point():
            continue
        values_read = any(u.args[1] == 0 and u.users for u in node.users)
        x, k, dim, largest, ordered = [*node.args, *[-1, True, True][len(node.args) - 2 :]]
        if not values_read or not isinstance(k, int) or node.kwargs:
            continue
        ndim = node.args[0].meta["val"].dim()
        node.target, node.args = (
            torch.ops.ringify.topk.default,
            (x, k, dim % ndim, largest, ordered),
        )
        count += 1
    if count:
        gm.recompile()
    return count
