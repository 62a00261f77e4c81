"""Shifts along a dim, as models write them, folded into one node (its rule: ``sharding/along.py``).

A model shifts a sequence by padding it and slicing the padding's length off the
other end (HF's causal-LM loss: ``pad(labels, (0, 1), value=-100)[..., 1:]``), or
by putting a start token in front of all but its last positions (a decoder's input:
``cat([start, ids[:, :-1]], 1)``). ``fold_shifts`` rewrites each such pair of
nodes into one call of ``shifted`` (``ringify/runtime/collectives/neighbours.py``), before the
plan reads the graph. Off the sequence it stays local; along it, it becomes
``ring_shift``: a halo exchange of ``|shift|`` positions per chunk, not a gather.

A first difference that keeps the length, ``diff(x, prepend=p)`` with ``p`` one position
long (HF's packed documents: ``diff(position_ids, prepend=position_ids[:, :1] - 1)``),
is ``x - shifted(x, dim, -1, p)``: a one-position halo (``append=a``: ``shifted(x, dim,
1, a) - x``).
"""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.graph.nodes import call, norm_dim, replace_by_call, shape, slice_bounds, val
from ringify.passes.graph.vocabulary import PADS
from ringify.runtime.collectives.neighbours import shifted

aten = torch.ops.aten


def fold_shifts(gm: fx.GraphModule) -> int:
    """Replace every pad-then-slice and start-token cat that shifts a tensor by ``shifted``,
    and every length-keeping ``diff`` by a difference with ``shifted``; how many."""
    graph, folded = gm.graph, 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.diff.default:
            _fold_diff(graph, node)
            folded += 1
            continue
        found = _shift_of(node)
        if found is None:
            continue
        replace_by_call(graph, node, shifted, found)
        graph.erase_node(node)
        folded += 1
    graph.eliminate_dead_code()
    return folded


def _fold_diff(graph: fx.Graph, node: fx.Node) -> None:
    """``diff(x, 1, dim, prepend, append)`` with one position prepended or appended (not
    both): the difference of ``x`` and its shift by one, which keeps the length."""
    x, n, dim, prepend, append = [*node.args, *[None] * 5][:5]
    n = 1 if n is None else n
    dim = norm_dim(-1 if dim is None else dim, len(shape(x)))
    edge = prepend if append is None else append if prepend is None else None
    if n != 1 or edge is None or shape(edge)[dim] != 1 or len(shape(edge)) != len(shape(x)):
        return
    shift = -1 if edge is prepend else 1
    # bool: diff is exclusive or, which is ``ne``
    subtract = aten.ne.Tensor if val(x).dtype == torch.bool else aten.sub.Tensor
    with graph.inserting_before(node):
        moved = call(graph, shifted, (x, dim, shift, edge))
        pair = (x, moved) if shift < 0 else (moved, x)
        result = call(graph, subtract, pair)
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def _shift_of(node: fx.Node) -> tuple | None:
    """``(x, dim, shift, fill)`` if ``node`` ends a shift of ``x``, else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.slice.Tensor and node.args[0].target in PADS:
        return _pad_then_slice(node, node.args[0])
    if node.target is aten.cat.default:
        return _start_then_slice(node)
    return None


def _pad_then_slice(node: fx.Node, pad: fx.Node) -> tuple | None:
    x, spec = pad.args[:2]
    if pad.target is aten.pad.default:
        mode = pad.args[2] if len(pad.args) > 2 else "constant"
        value = pad.args[3] if len(pad.args) > 3 else None
        if mode != "constant":
            return None
    else:
        value = pad.args[2] if len(pad.args) > 2 else 0
    ndim = len(shape(x))
    dim = norm_dim(node.args[1], ndim)
    padded = [i for i, amount in enumerate(spec) if amount]
    if len(padded) != 1 or ndim - 1 - padded[0] // 2 != dim or len(pad.users) != 1:
        return None
    k, length = spec[padded[0]], shape(x)[dim]
    start, end, step = slice_bounds(node, length + k)
    if step != 1 or end - start != length or k >= length:
        return None
    fill = 0 if value is None else value
    if padded[0] % 2 == 1 and (start, end) == (k, length + k):  # padded after: to the left
        return (x, dim, k, fill)
    if padded[0] % 2 == 0 and (start, end) == (0, length):  # padded before: to the right
        return (x, dim, -k, fill)
    return None


def _start_then_slice(node: fx.Node) -> tuple | None:
    tensors = node.args[0]
    if len(tensors) != 2:
        return None
    start, rest = tensors
    ndim = len(shape(node))
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim)
    if rest.op != "call_function" or rest.target is not aten.slice.Tensor:
        return None
    x = rest.args[0]
    if len(shape(x)) != ndim or norm_dim(rest.args[1], ndim) != dim:
        return None
    length, k = shape(x)[dim], shape(start)[dim]
    if slice_bounds(rest, length) != (0, length - k, 1) or not 0 < k < length:
        return None
    if shape(start)[:dim] + shape(start)[dim + 1 :] != shape(x)[:dim] + shape(x)[dim + 1 :]:
        return None  # a start token that broadcasts: not a plain shift
    return (x, dim, -k, start)
