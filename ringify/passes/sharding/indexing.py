"""Indexing rules: select, slice, split, chunk, unbind, advanced indexing, index_select, gather.

Off the sequence dim each is local to the rank (replicated indices are used
whole, or sliced where they line up with the sequence). Along it, a select (a cls
token), or a slice or index_select of no more positions than a rank holds (the
last token), is taken from the ranks that hold those positions (``ring_take``):
the result is replicated. Longer picks fall back (a gather), and so do picks that take more
positions of one tensor in all than a rank holds (a recurrence unrolled over positions).
"""

from __future__ import annotations

import math

import torch

from ringify.passes.graph.crossings import PassState, Rule, fit_broadcast, fit_whole
from ringify.passes.graph.nodes import norm_dim, shape, slice_bounds, val
from ringify.passes.graph.op_dims import INDEXING
from ringify.passes.graph.placement import Fallback, Placement, Seq, sharded_first
from ringify.passes.graph.report import GatherReason
from ringify.passes.graph.vocabulary import SELECTS_AND_SLICES, SLICE_SCATTERS
from ringify.runtime.collectives.reduce import ring_take

aten = torch.ops.aten


@sharded_first
def infer_indexing(node, place, p: Seq, ndim: int):
    """select / slice / unbind / split / chunk: local unless along the sequence."""
    t, pos = node.target, INDEXING[node.target]
    k = norm_dim(node.args[pos] if len(node.args) > pos else 0, ndim)
    out = val(node)
    if k == p.dim:
        if t is aten.slice.Tensor and list(out.shape) == shape(node.args[0]):
            return p  # the whole sequence: the end index clamps to the local length
        if t in SELECTS_AND_SLICES:
            return _taken(node, place, p, k)
        return Fallback(GatherReason.ALONG_SEQUENCE)
    if t is aten.select.int or t is aten.unbind.int:
        seq = p.at(p.dim - (k < p.dim))
        return seq if t is aten.select.int else [seq] * len(out)
    return p if t is aten.slice.Tensor else [p] * len(out)


@sharded_first
def infer_index(node, place, p: Seq, ndim: int):
    """``x[..., idx, ...]`` with replicated index tensors: local on dims other than the
    sequence; along it, a few positions (CLIP's pooled token per row) taken from the ranks
    that hold them (replicated), as ``_taken`` takes a slice."""
    indices = node.args[1]
    picked = [i for i, t in enumerate(indices) if t is not None]
    if any(place.sharded(t) for t in indices if t is not None):
        return Fallback(GatherReason.MIXED_DIMS)
    if p.dim in picked:
        count = math.prod(shape(indices[p.dim]))
        if count > place.geometry.local or not place.geometry.alone(shape(node.args[0])[p.dim], p):
            return Fallback(GatherReason.ALONG_SEQUENCE, f"({count} positions)")
        return None
    index_ndim = len(torch.broadcast_shapes(*(tuple(shape(indices[i])) for i in picked)))
    before = sum(i < p.dim for i in picked)
    if picked == list(range(picked[0], picked[-1] + 1)):  # adjacent: results stay in place
        return p.at(p.dim if p.dim < picked[0] else p.dim - len(picked) + index_ndim)
    return p.at(index_ndim + p.dim - before)  # apart: the indexed dims go first


def rewrite_picked_positions(node, out, state: PassState) -> None:
    """``x[..., idx, ...]`` along the sequence: the positions of ``idx`` taken from their ranks
    (``ring_take``, every rank alike), then indexed in place of the sequence."""
    x, indices = node.args[:2]
    dim = state.place[x].dim
    g, geo = state.graph, state.geo
    positions = indices[dim]
    count = math.prod(shape(positions))
    with g.inserting_before(node):
        flat = g.call_function(aten.reshape.default, (positions, [-1]))
        taken = g.call_function(ring_take, (x, dim, flat, geo.padded, state.group_name, geo.layout))
        device = val(positions).device
        order = g.call_function(
            aten.arange.default, (count,), {"dtype": torch.int64, "device": device}
        )
        order = g.call_function(aten.reshape.default, (order, shape(positions)))
        picked = g.call_function(
            aten.index.Tensor, (taken, [*indices[:dim], order, *indices[dim + 1 :]])
        )
    state.replace(node, picked, None)


@sharded_first
def infer_index_select(node, place, p: Seq, ndim: int):
    dim, index = node.args[1:3]
    if place.sharded(index):
        return Fallback(GatherReason.MIXED_DIMS)
    return _taken(node, place, p, dim) if norm_dim(dim, ndim) == p.dim else p


def _taken(node, place, p: Seq, dim: int) -> Fallback | None:
    """Along the sequence: replicated, taken from the ranks that hold the positions, if they
    are no more than a rank holds and the dim holds the sequence alone."""
    x = node.args[0]
    out_shape = val(node).shape
    count = out_shape[dim] if len(out_shape) == len(shape(x)) else 1
    if not place.geometry.alone(shape(x)[p.dim], p):
        return Fallback(GatherReason.ALONG_SEQUENCE, "(the sequence dim also holds other dims)")
    if count > place.geometry.local:
        return Fallback(GatherReason.ALONG_SEQUENCE, f"({count} positions: more than a shard)")
    # picked one by one (a recurrence unrolled over the positions): the gather, once
    total = sum(_picked_count(u, p.dim) for u in x.users)
    if total > place.geometry.local:
        return Fallback(
            GatherReason.ALONG_SEQUENCE, f"({total} positions picked: more than a shard)"
        )
    return None


def _picked_count(user, dim: int) -> int:
    """The positions ``user`` picks along ``dim`` of its input (0 if it picks none there)."""
    if user.target not in SELECTS_AND_SLICES | {aten.index_select.default}:
        return 0
    x = user.args[0]
    at = user.args[1] if len(user.args) > 1 else 0
    if norm_dim(at, len(shape(x))) != dim:
        return 0
    out = val(user).shape
    return out[dim] if len(out) == len(shape(x)) else 1


def rewrite_indexing(node, out: Placement, state: PassState) -> None:
    """Along the sequence (``out`` replicated): ``ring_take`` of the picked positions."""
    if out is not None:
        state.fit_replicated_inputs(node, None)
        return
    x, dim = node.args[0], norm_dim(node.args[1], len(shape(node.args[0])))
    g, geo = state.graph, state.geo
    device = val(x).device
    with g.inserting_before(node):
        if node.target is aten.index_select.default:
            index = node.args[2]
        elif node.target is aten.select.int:
            i = node.args[2] % geo.length
            index = g.call_function(
                aten.arange.start, (i, i + 1), {"dtype": torch.int64, "device": device}
            )
        else:  # slice: its bounds clamped to the true length, as torch does
            start, end, step = slice_bounds(node, geo.length)
            index = g.call_function(
                aten.arange.start_step, (start, end, step), {"dtype": torch.int64, "device": device}
            )
        args = (x, dim, index, geo.padded, state.group_name, geo.layout)
        result = g.call_function(ring_take, args)
        if node.target is aten.select.int:
            result = g.call_function(aten.squeeze.dims, (result, [dim]))
    state.replace(node, result, None)


@sharded_first
def infer_gather(node, place, p: Seq, ndim: int):
    """``torch.gather`` along another dim: the index has a row per position (sharded alike,
    or replicated at the full length, then sliced)."""
    x, dim, index = node.args[:3]
    if norm_dim(dim, ndim) == p.dim:
        return Fallback(GatherReason.ALONG_SEQUENCE)
    if place.sharded(index):
        return p if place[index] == p else Fallback(GatherReason.MIXED_DIMS)
    return p if shape(index)[p.dim] == shape(x)[p.dim] else Fallback(GatherReason.MISALIGNED)


def infer_scatter(node, place):
    """``slice_scatter`` / ``select_scatter`` (a write into a view, functionalized): local
    where the sequence lies on another dim than the one written, with a replicated base (a
    fresh tensor) sliced to this rank's positions."""
    x, src = node.args[:2]
    ndim = len(shape(x))
    dim = norm_dim(node.args[2] if len(node.args) > 2 else 0, ndim)
    placements = {place[x]} if place.sharded(x) else set()
    if place.sharded(src):
        p = place[src]
        lifted = p.dim + (p.dim >= dim) if node.target is aten.select_scatter.default else p.dim
        placements.add(p.at(lifted))
    if len(placements) != 1:
        return Fallback(GatherReason.MIXED_DIMS)
    seq = placements.pop()
    if seq.dim == dim:
        return Fallback(GatherReason.ALONG_SEQUENCE)
    if not place.sharded(x) and shape(x)[seq.dim] != val(node).shape[seq.dim]:
        return Fallback(GatherReason.MISALIGNED)
    if not place.sharded(x):
        place.meetings.append((x, seq))
    elif not place.sharded(src):  # a replicated part written into a sharded base
        if (
            node.target is not aten.slice_scatter.default
            or shape(src)[seq.dim] != shape(x)[seq.dim]
        ):
            return Fallback(GatherReason.MISALIGNED)
        place.meetings.append((src, seq))
    return seq


def rewrite_scatter(node, out: Seq, state: PassState) -> None:
    """A replicated base, or a replicated part written into a sharded one, is sliced to this
    rank's positions."""
    state.fit_replicated_inputs(node, out, aligned=list(node.args[:2]))


RULES = {
    **dict.fromkeys(  # (a split by an MoE's counts: ``dispatch.py``)
        INDEXING.keys() - SELECTS_AND_SLICES - {aten.split_with_sizes.default},
        Rule(infer_indexing, fit_whole),
    ),
    **dict.fromkeys(SELECTS_AND_SLICES, Rule(infer_indexing, rewrite_indexing)),
    aten.index_select.default: Rule(infer_index_select, rewrite_indexing),
    aten.gather.default: Rule(infer_gather, fit_broadcast),
    **dict.fromkeys(
        SLICE_SCATTERS,
        Rule(infer_scatter, rewrite_scatter),
    ),
}
