"""Rules of the ops that move, merge or join dims: views, transposes, permutes, squeezes,
expands, ``cat`` and ``stack``. Each keeps the sequence where it lands (``placement.py``'s
``view_placement`` for views) and rewrites only size arguments to a rank's."""

from __future__ import annotations

import torch

from ringify.passes.graph.crossings import PassState, Rule, as_it_is, fit_broadcast, fit_whole
from ringify.passes.graph.nodes import norm_dim, shape, val
from ringify.passes.graph.op_dims import result_dim
from ringify.passes.graph.placement import Fallback, Placements, Seq, sharded_first, view_placement
from ringify.passes.graph.report import GatherReason
from ringify.passes.graph.vocabulary import COMPLEX_VIEWS, EXPANDS, MOVED, VIEWS

aten = torch.ops.aten


def rewrite_local_size(node, out: Seq, state: PassState) -> None:
    """A view or expand: its size argument becomes the local shape."""
    local = state.local_shape(node, out)
    if node.target in VIEWS:
        # reshape, not view: the ring ops' outputs need not have the strides the
        # traced kernels had (a .contiguous() the trace dropped as a no-op).
        node.target = aten.reshape.default
        node.args, node.kwargs = (node.args[0], local), {}
    else:
        node.args = (node.args[0], local, *node.args[2:])


def _one_placement(tensors, place: Placements) -> Seq | Fallback:
    """The one placement of a cat's or stack's sharded inputs (gathered if they differ)."""
    placements = {place[a] for a in tensors if place.sharded(a)}
    return placements.pop() if len(placements) == 1 else Fallback(GatherReason.MIXED_DIMS)


def infer_cat(node, place: Placements):
    tensors = node.args[0]
    seq = _one_placement(tensors, place)
    if isinstance(seq, Fallback):
        return seq
    if norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape(tensors[0]))) == seq.dim:
        if seq.order is not None:  # an MoE's pieces of rows put back together in order
            return _in_sorts_order(node, tensors, seq, place)
        return _cat_of_sequences(tensors, seq, place)
    return place.line_up(node, tensors, seq)


def _cat_of_sequences(tensors, seq: Seq, place: Placements):
    """Whole sequences put end to end (every layer's router logits, for an MoE's aux loss):
    each rank's positions of each, end to end, are its positions of the result."""
    per_position = place.geometry.in_units(seq).length * seq.inner
    if all(place[a] == seq and shape(a)[seq.dim] % per_position == 0 for a in tensors):
        return seq
    return Fallback(GatherReason.CAT_ALONG_SEQUENCE)


def _in_sorts_order(node, tensors, seq: Seq, place: Placements):
    """The pieces of a token dispatch's rows, split by its experts' counts, put together in
    order (``graph/token_dispatch.py`` checked the order): its rows again."""
    d = place.dispatches.get(seq.order)
    if d is not None and d.kinds.get(node) is not None and all(place[a] == seq for a in tensors):
        return seq
    return Fallback(GatherReason.CAT_ALONG_SEQUENCE, "(rows in a sort's order)")


def infer_stack(node, place: Placements):
    """``stack`` of tensors sharded alike: a new dim at ``dim`` (RoPE's interleaved halves)."""
    tensors = node.args[0]
    seq = _one_placement(tensors, place)
    if isinstance(seq, Fallback):
        return seq
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape(tensors[0])) + 1)
    if not all(place[a] == seq for a in tensors):
        return Fallback(GatherReason.MISALIGNED)
    return seq.at(seq.dim + (dim <= seq.dim))


@sharded_first
def infer_view(node, place, p: Seq, ndim: int):
    return view_placement(shape(node.args[0]), p, list(val(node).shape), place.geometry)


@sharded_first
def infer_moved(node, place, p: Seq, ndim: int):
    """Transposes, permutes, ``t``, (un)squeezes and expands: the sequence goes where its dim
    goes (``op_dims.result_dim``)."""
    d = result_dim(node, p.dim, ndim)
    return Fallback(GatherReason.ALONG_SEQUENCE) if d is None else p.at(d)


@sharded_first
def infer_complex_view(node, place, p: Seq, ndim: int):
    """``view_as_complex`` (its last dim, of pairs, becomes the dtype) and ``view_as_real``
    (a last dim of 2 added): the sequence stays on its dim, which is not the last."""
    if node.target is aten.view_as_complex.default and p.dim == ndim - 1:
        return Fallback(GatherReason.FEATURE_DIM)
    return p


@sharded_first
def infer_repeat(node, place, p: Seq, ndim: int):
    """``repeat(x, reps)``: copies along other dims keep each rank's positions; along the
    sequence's dim (Llama 4's tokens once per expert) each copy is a block of all the
    positions, so each rank's copies of its own are the same placement with more ``outer``
    blocks. Not for rows in a sort's order, which a copy would no longer match."""
    reps = node.args[1]
    lead = len(reps) - ndim  # new leading dims
    if reps[p.dim + lead] != 1 and p.order is not None:
        return Fallback(GatherReason.ALONG_SEQUENCE, "(repeated along rows in a sort's order)")
    return p.at(p.dim + lead)


RULES = {
    aten.cat.default: Rule(infer_cat, fit_broadcast),
    aten.repeat.default: Rule(infer_repeat, as_it_is),
    aten.stack.default: Rule(infer_stack, as_it_is),
    **dict.fromkeys(VIEWS, Rule(infer_view, rewrite_local_size)),
    **dict.fromkeys(EXPANDS, Rule(infer_moved, rewrite_local_size)),
    **dict.fromkeys(MOVED, Rule(infer_moved, fit_whole)),
    **dict.fromkeys(
        COMPLEX_VIEWS,
        Rule(infer_complex_view, as_it_is),
    ),
}
