"""Reductions over the sequence: sums, means and losses reduce locally, then sum over the ring.

A sum or mean over the sequence dim sums this rank's positions and all-reduces
(``reduce_from_ring``); a mean divides by the global count. Cross-entropy and
NLL over (N, C) inputs sharded along N run with ``reduction="sum"`` locally; a
mean divides by the global count of non-ignored targets. Replicated targets are
sliced with the input, padded with ``ignore_index``. Padding positions are masked
out of sums (``masked_padding``).
"""

from __future__ import annotations

import math

import torch
from torch import fx

from ringify.passes.graph.crossings import PassState, Rule, fit_broadcast
from ringify.passes.graph.losses import LOSSES, MEAN, NONE, SUM, loss_arg
from ringify.passes.graph.nodes import norm_dim, norm_dims, shape, val
from ringify.passes.graph.placement import Fallback, Placement, Placements, Seq, sharded_first
from ringify.passes.graph.report import GatherReason
from ringify.passes.graph.vocabulary import (
    LOCAL_REDUCTIONS,
    MEANS,
    SOFTMAX_INTS,
    SUMS_AND_MEANS,
    TOTALS,
)
from ringify.runtime.collectives.reduce import (
    copy_to_ring,
    reduce_from_ring,
    ring_amax,
    ring_argmax,
)

aten = torch.ops.aten
ringify_ops = torch.ops.ringify

# max-like reduction -> +1 for a maximum, -1 for a minimum (min(x) = -max(-x))
EXTREMA = {aten.amax.default: 1, aten.max.default: 1, aten.amin.default: -1, aten.min.default: -1}
# loss op -> positions of (reduction, ignore_index) in its arguments


def _reduced_dims(node: fx.Node, ndim: int) -> list[int]:
    if len(node.args) < 2 or node.target in TOTALS or not node.args[1]:
        return list(range(ndim))
    return norm_dims(node.args[1], ndim)


def infer_reduction(node: fx.Node, place: Placements) -> Placement:
    """Over the sequence: replicated (the sum over the ring); else the sequence stays."""
    p, ndim = place[node.args[0]], len(shape(node.args[0]))
    dims = _reduced_dims(node, ndim)
    if p.dim in dims:
        return None
    keep = _keepdim(node)
    return p.at(p.dim if keep else p.dim - sum(d < p.dim for d in dims))


@sharded_first
def infer_local_reduction(node: fx.Node, place: Placements, p: Seq, ndim: int):
    """A reduction with no ring form (``LOCAL_REDUCTIONS``): local over other dims, as a
    router's logsumexp or best expert (``max.dim``: values and indices alike) over its
    experts; over the sequence, its input is gathered."""
    out = infer_reduction(node, place)
    if out is None:
        return Fallback(GatherReason.REDUCED_SEQUENCE)
    return [out, out] if isinstance(val(node), (tuple, list)) else out


def rewrite_reduction(node: fx.Node, out: Placement, state: PassState) -> None:
    if out is not None:  # over other dims: local, as a pointwise op
        state.fit_replicated_inputs(node, out)
        return
    x = node.args[0]
    dims = _reduced_dims(node, len(shape(x)))
    keep = _keepdim(node)
    dtype = node.kwargs.get("dtype")
    g = state.graph
    with g.inserting_before(node):
        local = masked_padding(x, 0, state)
        partial = g.call_function(
            aten.sum.dim_IntList, (local, dims, keep), {"dtype": dtype} if dtype else {}
        )
        total = g.call_function(reduce_from_ring, (partial, state.group_name))
        if node.target in MEANS:
            count = math.prod(shape(x)[d] for d in dims)
            total = g.call_function(aten.div.Tensor, (total, count))
    state.replace(node, total, None)


def _keepdim(node: fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def rewrite_extremum(node: fx.Node, out: Placement, state: PassState) -> None:
    """amax / amin / max / min over the sequence: ``ring_amax`` of the local positions
    (padding masked to the lowest value; a minimum is minus the maximum of minus x)."""
    if out is not None:  # over other dims: local
        state.fit_replicated_inputs(node, out)
        return
    x = node.args[0]
    sign = EXTREMA[node.target]
    dims = _reduced_dims(node, len(shape(x)))
    g = state.graph
    with g.inserting_before(node):
        local = masked_padding(x, _bottom(val(x).dtype, sign), state)
        if sign < 0:
            local = g.call_function(aten.neg.default, (local,))
        result = g.call_function(ring_amax, (local, dims, state.group_name))
        if not _keepdim(node):
            result = g.call_function(aten.squeeze.dims, (result, dims))
        if sign < 0:
            result = g.call_function(aten.neg.default, (result,))
    state.replace(node, result, None)


def infer_argmax(node: fx.Node, place: Placements) -> Placement | Fallback:
    """argmax along one dim: local off the sequence; along it, the ring's first maximum."""
    x = node.args[0]
    p, ndim = place[x], len(shape(x))
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim is None or not place.geometry.alone(shape(x)[p.dim], p):
        return Fallback(GatherReason.ALONG_SEQUENCE, "(argmax over several dims)")
    dim = norm_dim(dim, ndim)
    if dim == p.dim:
        return None
    return p.at(p.dim if _keepdim(node) else p.dim - (dim < p.dim))


def rewrite_argmax(node: fx.Node, out: Placement, state: PassState) -> None:
    if out is not None:  # along another dim: local
        return
    x = node.args[0]
    dim = norm_dim(node.args[1], len(shape(x)))
    g, geo = state.graph, state.geo
    with g.inserting_before(node):
        local = masked_padding(x, _bottom(val(x).dtype, 1), state)
        args = (local, dim, geo.padded, state.group_name, geo.layout)
        result = g.call_function(ring_argmax, args)
        if not _keepdim(node):
            result = g.call_function(aten.squeeze.dims, (result, [dim]))
    state.replace(node, result, None)


def rewrite_softmax(node: fx.Node, out: Placement, state: PassState) -> None:
    """Along the sequence: ``exp(x - M) / sum``, with ``M`` the ring's maximum (a constant
    shift: no gradient needed) and the sum over the ring; padding at -inf adds nothing."""
    x, dim = node.args[:2]
    ndim = len(shape(x))
    if norm_dim(dim, ndim) != out.dim:
        return
    dtype = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    g, group = state.graph, state.group_name
    with g.inserting_before(node):
        local = masked_padding(x, float("-inf"), state)
        if dtype is not None:
            local = g.call_function(aten._to_copy.default, (local,), {"dtype": dtype})
        fixed = g.call_function(aten.detach.default, (local,))
        top = g.call_function(ring_amax, (fixed, [out.dim], group))
        shifted = g.call_function(aten.sub.Tensor, (local, top))
        exp = g.call_function(aten.exp.default, (shifted,))
        total = g.call_function(aten.sum.dim_IntList, (exp, [out.dim], True))
        total = g.call_function(reduce_from_ring, (total, group))
        # the total is replicated and every rank's positions divide by it: their gradients
        # of it are partial, summed over the ring
        total = g.call_function(copy_to_ring, (total, group))
        if node.target is aten.softmax.int:
            result = g.call_function(aten.div.Tensor, (exp, total))
        else:
            log_total = g.call_function(aten.log.default, (total,))
            result = g.call_function(aten.sub.Tensor, (shifted, log_total))
    state.replace(node, result, out)


def _bottom(dtype: torch.dtype, sign: int):
    """The value padding takes so that it never wins a maximum (``sign`` 1) or minimum (-1)."""
    if dtype.is_floating_point:
        return float("-inf") * sign
    return torch.iinfo(dtype).min if sign > 0 else torch.iinfo(dtype).max


def masked_padding(x: fx.Node, fill, state: PassState) -> fx.Node:
    """``x`` with its padded positions set to ``fill`` (``x`` itself without padding)."""
    geo, g = state.geo, state.graph
    if not geo.pads:
        return x
    seq = state.place[x]
    x_shape = shape(x)
    outer, inner = geo.split(x_shape[seq.dim], seq)
    units = geo.in_units(seq)  # padding is whole units
    positions = g.call_function(aten.arange.default, (units.padded,), {"device": val(x).device})
    valid = g.call_function(aten.lt.Scalar, (positions, units.length))
    valid = g.call_function(
        ringify_ops.take_shard.default, (valid, 0, state.group_name, geo.layout)
    )
    valid = g.call_function(aten.view.default, (valid, [1, units.local, 1]))
    valid = g.call_function(aten.expand.default, (valid, [outer, units.local, inner]))
    view = [1] * len(x_shape)
    view[seq.dim] = outer * units.local * inner
    valid = g.call_function(aten.reshape.default, (valid, view))
    return g.call_function(aten.where.ScalarOther, (valid, x, fill))


def _weight(node: fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")


def infer_loss(node: fx.Node, place: Placements) -> Placement | Fallback:
    x, target = node.args[:2]
    p = place[x]
    if not isinstance(p, Seq) or p.dim != 0 or len(shape(x)) != 2 or len(shape(target)) != 1:
        return Fallback(GatherReason.LOSS_LAYOUT)
    if place.sharded(target) and place[target] != p:
        return Fallback(GatherReason.LOSS_TARGET)
    if not place.sharded(target):
        place.meetings.append((target, p))
    reduction = loss_arg(node, 0, MEAN)
    if _weight(node) is not None and reduction == MEAN:
        return Fallback(GatherReason.WEIGHTED_MEAN)
    return p if reduction == NONE else None


def rewrite_loss(node: fx.Node, out: Placement, state: PassState) -> None:
    x, target = node.args[:2]
    reduction = loss_arg(node, 0, MEAN)
    ignore = loss_arg(node, 1, -100)
    g = state.graph
    if not state.sharded(target):
        target = state.slice(target, state.place[x], ignore)
    weight = _weight(node)
    if weight is not None and val(weight).is_floating_point():
        weight = state.copy_to_ring(weight)
    rest = list(node.args[2:])
    kwargs = dict(node.kwargs)
    if rest:
        rest[0] = weight
    elif "weight" in kwargs:
        kwargs["weight"] = weight
    if reduction == NONE:
        node.args = (x, target, *rest)
        node.kwargs = kwargs
        return
    pos = LOSSES[node.target][0]
    args = [x, target, *rest]
    args += [None] * (pos + 1 - len(args))
    args[pos] = SUM
    kwargs.pop("reduction", None)
    with g.inserting_before(node):
        partial = g.call_function(node.target, tuple(args), kwargs)
        total = g.call_function(reduce_from_ring, (partial, state.group_name))
        if reduction == MEAN:
            counted = g.call_function(aten.ne.Scalar, (target, ignore))
            count = g.call_function(aten.sum.dim_IntList, (counted, [0]), {"dtype": val(x).dtype})
            count = g.call_function(reduce_from_ring, (count, state.group_name))
            total = g.call_function(aten.div.Tensor, (total, count))
    state.replace(node, total, None)


@sharded_first
def _infer_softmax(node, place, p: Seq, ndim: int):
    """softmax / log_softmax keep the placement (along the sequence: normalised over the ring)."""
    return p


def _first_sharded(infer):
    """``infer``, for an op whose first input must carry the sequence (else it falls back)."""
    return sharded_first(lambda node, place, p, ndim: infer(node, place))


RULES = {
    **dict.fromkeys(SUMS_AND_MEANS, Rule(_first_sharded(infer_reduction), rewrite_reduction)),
    **dict.fromkeys(LOCAL_REDUCTIONS, Rule(infer_local_reduction, fit_broadcast)),
    **dict.fromkeys(EXTREMA, Rule(_first_sharded(infer_reduction), rewrite_extremum)),
    **dict.fromkeys(SOFTMAX_INTS, Rule(_infer_softmax, rewrite_softmax)),
    aten.argmax.default: Rule(_first_sharded(infer_argmax), rewrite_argmax),
    **dict.fromkeys(LOSSES, Rule(_first_sharded(infer_loss), rewrite_loss)),
}
