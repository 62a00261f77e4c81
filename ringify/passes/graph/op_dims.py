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
from ringify.passes.graph.vocabulary import (
    ALONG,
    CASTS_LIKE,
    EXPANDS,
    IN_PLACE,
    NORMS,
    REDUCTIONS,
    ROW_PRODUCTS,
    SAME_SHAPE,
    SPLITS,
    SQUEEZES,
    TOTALS,
    VIEWS,
)

aten = torch.ops.aten

DimMap = Callable[[fx.Node, int, int], "int | None"]

# ops that select, slice or split along one dim: op -> position of its dim argument
INDEXING = {
    aten.select.int: 1, aten.slice.Tensor: 1, aten.unbind.int: 1,
    aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.chunk.default: 2,
}  # fmt: skip
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
    if node.target in IN_PLACE:
        return d
    if node.target in REDUCTIONS | TOTALS or node.target is aten.select.int:
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
        EXPANDS,
        lambda node, d, nd: d + len(node.args[1]) - nd,
    ),
    aten.transpose.int: _transpose,
    aten.permute.default: lambda node, d, nd: norm_dims(node.args[1], nd).index(d),
    aten.t.default: lambda node, d, nd: nd - 1 - d,
    aten.unsqueeze.default: lambda node, d, nd: d + (norm_dim(node.args[1], nd + 1) <= d),
    **dict.fromkeys(SQUEEZES, _squeeze),
    aten.select.int: _select,
    aten.slice.Tensor: lambda node, d, nd: None if norm_dim(argument(node, "dim"), nd) == d else d,
    **dict.fromkeys(REDUCTIONS, _reduction),
    **dict.fromkeys(ALONG, lambda node, d, nd: None if norm_dim(node.args[1], nd) == d else d),
    **dict.fromkeys(
        NORMS,
        lambda node, d, nd: d if d < nd - len(node.args[1]) else None,
    ),
    aten.outer.default: _same,
    aten.repeat_interleave.self_int: lambda node, d, nd: (
        None if (k := argument(node, "dim")) is None or norm_dim(k, nd) == d else d
    ),
    **dict.fromkeys(
        ROW_PRODUCTS,
        lambda node, d, nd: d if d < nd - 1 and len(shape(node.args[1])) <= 2 else None,
    ),
    **dict.fromkeys(SPLITS, _split),
}
