"""What an op does with its first input's dims: one table, ``DIM_MAPS``, for every walk.

``result_dim(node, d, nd)`` is where dim ``d`` of the op's first input (of ``nd`` dims)
lands in its result, or None where the op reads across that dim (a reduction over it, a
softmax along it, a view that splits it) or drops it. Three readers share it: the sharding
rules of the ops that move dims (``sharding/dims.py``: the sequence goes where its dim
goes), the joint walk (``folds/positionwise.py``: an op runs on each part of a joint dim
it keeps) and the walk from a value back to the input it came from
(``sharding/sequence_plan.py``: labels). The op sets the rules' table also reads (``SAME_SHAPE``,
``CASTS_LIKE``, ``VIEWS``) live here for the same reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import fx

from ringify.passes.graph.nodes import argument, norm_dim, norm_dims, shape
from ringify.runtime.collectives.neighbours import shifted

aten = torch.ops.aten

DimMap = Callable[[fx.Node, int, int], "int | None"]

# ops of one tensor whose result has its input's shape (copies, casts, dropout)
SAME_SHAPE = frozenset({
    aten.dropout.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
    aten.detach.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
    aten.to.device, aten.lift_fresh_copy.default,
})  # fmt: skip
# casts to another tensor's dtype and device: the second tensor is read for those alone
CASTS_LIKE = frozenset({aten.type_as.default, aten.to.other})
# views by sizes; and those whose arguments name dims, the same for any length
SIZED_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
VIEWS = SIZED_VIEWS | {aten.flatten.using_ints, aten.unflatten.int}
# ops that keep a dim's positions in order, some cut or padded at its ends
KEEPS_POSITIONS = frozenset({
    aten.slice.Tensor, aten.constant_pad_nd.default, aten.pad.default, shifted,
})  # fmt: skip
SPLITS = frozenset({aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default})
# ops that select, slice or split along one dim: op -> position of its dim argument
INDEXING = {
    aten.select.int: 1, aten.slice.Tensor: 1, aten.unbind.int: 1,
    aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.chunk.default: 2,
}  # fmt: skip
SQUEEZES = frozenset({aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})
_REDUCTIONS = frozenset({
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.var.correction, aten.std.correction, aten.var.dim, aten.std.dim, aten.logsumexp.default,
    aten.any.dim, aten.all.dim,
})  # fmt: skip
_ALONG = frozenset({
    aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
    aten.cumsum.default,
})  # fmt: skip
# ops that read across a dim but keep every index of every dim where it was (scans, masks)
_IN_PLACE = _ALONG | {
    aten.cumprod.default, aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default,
    aten.tril.default, aten.triu.default,
}  # fmt: skip
_TOTALS = frozenset({aten.sum.default, aten.mean.default, aten.max.default, aten.min.default})
DROPPED = "dropped"  # ``kept_dim``: the op reduces the dim or selects along it


def result_dim(node: fx.Node, d: int, nd: int) -> int | None:
    """Where dim ``d`` of ``node``'s first input (of ``nd`` dims) lands in its result, or
    None (the op reads across it, drops it, or is not in the table)."""
    dim_map = DIM_MAPS.get(node.target)
    return None if dim_map is None else dim_map(node, d, nd)


def kept_dim(node: fx.Node, d: int, nd: int) -> int | str | None:
    """Where dim ``d`` of ``node``'s first input lies in its result, whether or not the op
    reads across it (a softmax along it keeps it in place, where ``result_dim`` says None);
    ``DROPPED`` where the op reduces it or selects one element of it; None where the table
    cannot tell (a view that splits it, a slice, an op it lacks)."""
    landed = result_dim(node, d, nd)
    if landed is not None:
        return landed
    if node.target in _IN_PLACE:
        return d
    if node.target in _REDUCTIONS | _TOTALS or node.target is aten.select.int:
        return DROPPED
    return None


def view_dim(before: list, after: list, d: int) -> int | None:
    """Where dim ``d`` of ``before`` is a dim of ``after``: the same elements before it and
    its own size; else ``None`` (the view splits or merges it)."""
    if not all(isinstance(s, int) for s in (*before, *after)):
        return None
    leading = math.prod(before[:d])
    for e in range(len(after)):
        if math.prod(after[:e]) == leading and after[e] == before[d]:
            return e
    return None


def _transpose(node, d, nd):
    a, b = norm_dims(node.args[1:3], nd)
    return b if d == a else a if d == b else d


def _squeeze(node, d, nd):
    named = range(nd) if node.target is aten.squeeze.default else norm_dims(node.args[1], nd)
    dropped = [k for k in named if shape(node.args[0])[k] == 1]
    return None if d in dropped else d - sum(k < d for k in dropped)


def _select(node, d, nd):
    k = norm_dim(node.args[1], nd)
    return None if k == d else d - (k < d)


def _reduction(node, d, nd):
    dims = argument(node, "dim")
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):  # every dim
        return None
    dims = norm_dims(dims, nd)
    keep = argument(node, "keepdim")
    return None if d in dims else d if keep else d - sum(k < d for k in dims)


def _split(node, d, nd):
    k = norm_dim(argument(node, "dim"), nd)
    if k == d:
        return None
    return d - (k < d) if node.target is aten.unbind.int else d


def _same(node, d, nd):
    return d


DIM_MAPS: dict[object, DimMap] = {
    **dict.fromkeys(SAME_SHAPE | CASTS_LIKE, _same),
    **dict.fromkeys(VIEWS, lambda node, d, nd: view_dim(shape(node.args[0]), shape(node), d)),
    **dict.fromkeys(
        (aten.expand.default, aten.broadcast_to.default),
        lambda node, d, nd: d + len(node.args[1]) - nd,
    ),
    aten.transpose.int: _transpose,
    aten.permute.default: lambda node, d, nd: norm_dims(node.args[1], nd).index(d),
    aten.t.default: lambda node, d, nd: nd - 1 - d,
    aten.unsqueeze.default: lambda node, d, nd: d + (norm_dim(node.args[1], nd + 1) <= d),
    **dict.fromkeys(SQUEEZES, _squeeze),
    aten.select.int: _select,
    aten.slice.Tensor: lambda node, d, nd: None if norm_dim(argument(node, "dim"), nd) == d else d,
    **dict.fromkeys(_REDUCTIONS, _reduction),
    **dict.fromkeys(_ALONG, lambda node, d, nd: None if norm_dim(node.args[1], nd) == d else d),
    **dict.fromkeys(
        (aten.layer_norm.default, aten.rms_norm.default),
        lambda node, d, nd: d if d < nd - len(node.args[1]) else None,
    ),
    aten.outer.default: _same,
    aten.repeat_interleave.self_int: lambda node, d, nd: (
        None if (k := argument(node, "dim")) is None or norm_dim(k, nd) == d else d
    ),
    **dict.fromkeys(
        (aten.linear.default, aten.matmul.default, aten.mm.default),
        lambda node, d, nd: d if d < nd - 1 and len(shape(node.args[1])) <= 2 else None,
    ),
    **dict.fromkeys(SPLITS, _split),
}
