"""Ops that treat each position of a dim alone, run on the parts of a joint value.

A ``Joint`` is a value equal to ``cat(parts, dim)`` (``joints.py``). An op whose result at
a position of that dim reads only that position of its inputs gives the ``cat`` of its
results on the parts: ``distributed`` makes those results, or says ``None`` where the op
is not such an op (or its inputs are not joint alike), so that the caller puts the value
back together. The op's own kernel runs on each part, with its shape arguments (a view's
sizes) made the part's; where a joint dim lands is the op table's (``graph/op_dims.py``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from ringify.passes.graph.nodes import call, is_tensor, norm_dim, shape
from ringify.passes.graph.op_dims import result_dim
from ringify.passes.graph.vocabulary import (
    CASTS_LIKE,
    EXPANDS,
    JOINS,
    SIZED_VIEWS,
    SPLITS,
    SQUEEZES,
)

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
    if target in JOINS:
        return _joined(graph, node, found, bounds, seeds)
    x = node.args[0]
    if x not in found or len(found) > 1:
        return None
    d, nd = found[x].dim, len(shape(x))
    out = result_dim(node, d, nd)
    if out is None or (target in SQUEEZES and any(shape(p)[d] == 1 for p in found[x].parts)):
        return None  # (a part one position long would lose the dim the whole keeps)
    if target in SPLITS:
        return _items(graph, node, found[x], out, seeds)
    parts = []
    for i, part in enumerate(found[x].parts):
        args = (part, *_part_sizes(node, out, bounds[i + 1] - bounds[i]))
        parts.append(call(graph, target, args, node.kwargs))
    return Joint(out, tuple(parts), seeds)


def _part_sizes(node: fx.Node, out: int, length: int) -> tuple:
    """``node``'s arguments after its input, its sizes made a part's (``length`` at ``out``)."""
    rest = node.args[1:]
    if node.target in SIZED_VIEWS:
        sizes = list(shape(node))
        sizes[out] = length
        return (sizes, *rest[1:])
    if node.target in EXPANDS:
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
