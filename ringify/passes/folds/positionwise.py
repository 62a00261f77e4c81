"""Ops that treat each position of a dim alone, run on the parts of a joint value.

A ``Joint`` is a value equal to ``cat(parts, dim)`` (``joints.py``). An op whose result at
a position of that dim reads only that position of its inputs gives the ``cat`` of its
results on the parts: ``distributed`` makes those results, or says ``None`` where the op
is not such an op (or its inputs are not joint alike), so that the caller puts the value
back together. The op's own kernel runs on each part, with its shape arguments (a view's
sizes) made the part's.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from ringify.passes.folds.spellings import CASTS_LIKE
from ringify.passes.graph.nodes import argument, call, is_tensor, norm_dim, norm_dims, shape

aten = torch.ops.aten


@dataclass(frozen=True)
class Joint:
    """A value equal to ``cat(parts, dim)``, carried as its parts; ``seeds``: the ``cat``s
    it comes from."""

    dim: int
    parts: tuple[fx.Node, ...]
    seeds: frozenset = field(default=frozenset())

    def bounds(self) -> list[int]:
        ends = [0]
        for p in self.parts:
            ends.append(ends[-1] + shape(p)[self.dim])
        return ends


@dataclass(frozen=True)
class Items:
    """A multi-output op's results (a split): per item, a node or a ``Joint``."""

    items: tuple
    seeds: frozenset = field(default=frozenset())


# ops of one tensor whose result has its input's shape (casts, copies, dropout)
_SAME = frozenset({
    aten._to_copy.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.dropout.default, aten.lift_fresh_copy.default, aten.type_as.default,
})  # fmt: skip
_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
# views whose arguments name dims, not sizes: the same arguments for every part
_DIM_VIEWS = frozenset({aten.flatten.using_ints, aten.unflatten.int})
_REDUCTIONS = frozenset({
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.var.correction, aten.std.correction, aten.var.dim, aten.std.dim, aten.logsumexp.default,
    aten.any.dim, aten.all.dim,
})  # fmt: skip
_ALONG = frozenset({
    aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
    aten.cumsum.default,
})  # fmt: skip
_NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})
_MULTI = frozenset({aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default})


def distributed(graph: fx.Graph, node: fx.Node, joints: dict):
    """``node`` on the parts of its joint inputs: a ``Joint`` (``Items`` for a split), or
    ``None``."""
    like = node.args[1] if node.target in CASTS_LIKE else None
    if isinstance(joints.get(like), Joint):  # read for its dtype and device alone: any part
        node.args = (node.args[0], joints[like].parts[0], *node.args[2:])
    found = {a: joints[a] for a in node.all_input_nodes if a in joints}
    if any(not isinstance(j, Joint) for j in found.values()) or not found:
        return None
    first = next(iter(found.values()))
    bounds = first.bounds()
    if any(j.bounds() != bounds for j in found.values()):
        return None
    seeds = frozenset().union(*(j.seeds for j in found.values()))
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _broadcast(graph, node, found, bounds, seeds)
    if target in (aten.cat.default, aten.stack.default):
        return _joined(graph, node, found, bounds, seeds)
    x = node.args[0]
    if x not in found or len(found) > 1:
        return None
    d, nd = found[x].dim, len(shape(x))
    out = _result_dim(node, d, nd)
    if out is None:
        return None
    if target in _MULTI:
        return _items(graph, node, found[x], out, seeds)
    parts = []
    for i, part in enumerate(found[x].parts):
        args = (part, *_part_sizes(node, out, bounds[i + 1] - bounds[i]))
        parts.append(call(graph, target, args, node.kwargs))
    return Joint(out, tuple(parts), seeds)


def _result_dim(node: fx.Node, d: int, nd: int) -> int | None:
    """The dim of ``node``'s result where its input's joint dim ``d`` lands, or ``None``."""
    target, args = node.target, node.args
    if target in _SAME:
        return d
    if target in _VIEWS or target in _DIM_VIEWS:
        return _view_dim(shape(args[0]), shape(node), d)
    if target is aten.expand.default:
        return d + len(args[1]) - nd
    if target is aten.transpose.int:
        a, b = norm_dims(args[1:3], nd)
        return b if d == a else a if d == b else d
    if target is aten.permute.default:
        return norm_dims(args[1], nd).index(d)
    if target is aten.t.default:
        return 1 - d
    if target is aten.unsqueeze.default:
        return d + (norm_dim(args[1], nd + 1) <= d)
    if target in (aten.squeeze.dim, aten.squeeze.dims):
        dims = norm_dims(args[1], nd)
        return None if d in dims else d - sum(k < d for k in dims)
    if target is aten.select.int:
        k = norm_dim(args[1], nd)
        return None if k == d else d - (k < d)
    if target is aten.slice.Tensor:
        return None if norm_dim(argument(node, "dim"), nd) == d else d
    if target in _REDUCTIONS:
        dims = argument(node, "dim")
        if dims is None or (not isinstance(dims, int) and len(dims) == 0):  # every dim
            return None
        dims = norm_dims(dims, nd)
        keep = argument(node, "keepdim")
        return None if d in dims else d if keep else d - sum(k < d for k in dims)
    if target in _ALONG:
        return None if norm_dim(args[1], nd) == d else d
    if target in _NORMS:
        return d if d < nd - len(args[1]) else None
    if target is aten.outer.default:
        return d
    if target is aten.repeat_interleave.self_int:
        dim = argument(node, "dim")
        return None if dim is None or norm_dim(dim, nd) == d else d
    if target in (aten.linear.default, aten.matmul.default, aten.mm.default):
        return d if d < nd - 1 and len(shape(args[1])) <= 2 else None
    if target in _MULTI:
        k = norm_dim(argument(node, "dim"), nd)
        if k == d:
            return None
        return d - (k < d) if target is aten.unbind.int else d
    return None


def _view_dim(before: list, after: list, d: int) -> int | None:
    """Where dim ``d`` of ``before`` is a dim of ``after``: the same elements before it and
    its own size; else ``None`` (the view splits or merges it)."""
    if not all(isinstance(s, int) for s in (*before, *after)):
        return None
    leading = math.prod(before[:d])
    for e in range(len(after)):
        if math.prod(after[:e]) == leading and after[e] == before[d]:
            return e
    return None


def _part_sizes(node: fx.Node, out: int, length: int) -> tuple:
    """``node``'s arguments after its input, its sizes made a part's (``length`` at ``out``)."""
    rest = node.args[1:]
    if node.target in _VIEWS:
        sizes = list(shape(node))
        sizes[out] = length
        return (sizes, *rest[1:])
    if node.target is aten.expand.default:
        sizes = list(rest[0])
        sizes[out] = length
        return (sizes, *rest[1:])
    return rest


def _broadcast(graph: fx.Graph, node: fx.Node, found: dict, bounds: list, seeds) -> Joint | None:
    """A pointwise op: joint inputs by part; a broadcast one whole; a full one sliced."""
    nd = len(shape(node))
    dims = {j.dim + nd - len(shape(a)) for a, j in found.items()}
    if len(dims) != 1:
        return None
    out = dims.pop()
    if shape(node)[out] != bounds[-1]:
        return None
    whole = {}
    for a in node.all_input_nodes:
        if a in found or not is_tensor(a):
            continue
        d = out - (nd - len(shape(a)))
        if d < 0 or shape(a)[d] == 1:
            continue
        if shape(a)[d] != bounds[-1]:
            return None
        whole[a] = d
    parts = []
    for i in range(len(bounds) - 1):

        def piece(a, i=i):
            if a in found:
                return found[a].parts[i]
            if a in whole:
                return call(graph, aten.slice.Tensor, (a, whole[a], bounds[i], bounds[i + 1]))
            return a

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), piece)
        parts.append(call(graph, node.target, args, kwargs))
    return Joint(out, tuple(parts), seeds)


def _joined(graph: fx.Graph, node: fx.Node, found: dict, bounds: list, seeds) -> Joint | None:
    """``cat`` along another dim, or ``stack``, of tensors all joint alike: part by part."""
    tensors = node.args[0]
    if any(t not in found for t in tensors) or len({found[t].dim for t in tensors}) != 1:
        return None
    d, nd = found[tensors[0]].dim, len(shape(tensors[0]))
    dim = node.args[1] if len(node.args) > 1 else 0
    if node.target is aten.stack.default:
        dim = norm_dim(dim, nd + 1)
        out = d + (dim <= d)
    else:
        dim = norm_dim(dim, nd)
        out = d
        if dim == d:
            return None
    parts = [
        call(graph, node.target, ([found[t].parts[i] for t in tensors], dim))
        for i in range(len(bounds) - 1)
    ]
    return Joint(out, tuple(parts), seeds)


def _items(graph: fx.Graph, node: fx.Node, joint: Joint, out: int, seeds) -> Items:
    """A split along another dim: per part, the split; per item, the joint of its parts."""
    splits = [call(graph, node.target, (p, *node.args[1:]), node.kwargs) for p in joint.parts]
    count = len(node.meta["val"])
    items = tuple(
        Joint(out, tuple(call(graph, operator.getitem, (s, i)) for s in splits), seeds)
        for i in range(count)
    )
    return Items(items, seeds)
