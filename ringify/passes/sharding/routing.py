"""Rules of the ops that route tokens to experts (mixture-of-experts layers): token-wise work.

An MoE layer computes each token's output from that token alone: its router scores the
experts (``topk`` over the experts' dim), the token is repeated once per chosen expert
(``repeat_interleave`` along the tokens), each copy meets its expert's weights (the expert
tables indexed by the chosen ids), and the copies are summed back. Every rank can route and
compute its own tokens only, so the rules keep the tokens sharded through all of it:

- ``topk``/``sort``/``argsort`` along another dim than the sequence: local, both outputs
  sharded alike; along it, the sort of a token dispatch (``dispatch.py``);
- ``repeat_interleave`` of an int count along the sequence: each position's elements
  repeated, a placement whose ``inner`` is multiplied by the count;
- ``one_hot``: a new last dim; ``zeros_like`` and its kin: placed as their model; random
  draws shaped so (``rand_like``, ``exponential``): drawn whole, this rank's share kept;
- ``scatter`` off the sequence (a mask of the chosen expert groups): local;
- a replicated table indexed by sharded ids (``gate_up_proj[expert_ids]``): the ids' rows;
- the router's load-balancing statistics are sums over the tokens: ``histc``, ``bincount``
  and a ``scatter_add`` of token counts into a replicated per-expert tensor count this rank's
  tokens (padding left out) and add the ring's counts up.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from ringify.passes.graph.crossings import PassState, Rule, as_it_is, fit_broadcast
from ringify.passes.graph.nodes import argument, call, norm_dim, shape, val
from ringify.passes.graph.placement import Fallback, Placements, Seq, sharded_first
from ringify.passes.graph.report import GatherReason
from ringify.passes.graph.vocabulary import ARGSORTS, DRAWS, LIKE, SCATTERS, SORTS
from ringify.passes.sharding import dispatch
from ringify.passes.sharding.reductions import masked_padding
from ringify.runtime.collectives.reduce import reduce_from_ring

aten = torch.ops.aten
SELECTIONS = frozenset({aten.topk.default, *SORTS, *ARGSORTS})


@sharded_first
def infer_selection(node, place, p: Seq, ndim: int):
    """``topk``/``sort``/``argsort`` along ``dim``: local off the sequence (values and indices
    alike); along it, a token dispatch's sort (``dispatch.py``) or a fallback."""
    if node in place.dispatches:
        return dispatch.sorted_rows(node, place)
    if norm_dim(argument(node, "dim"), ndim) == p.dim:
        return Fallback(GatherReason.ALONG_SEQUENCE)
    return p if node.target in ARGSORTS else [p, p]


@sharded_first
def infer_repeat_interleave(node, place, p: Seq, ndim: int):
    """``repeat_interleave(x, n, dim)``: along the sequence, each position's elements n times
    in a row (a placement ``n`` times as wide per position); along another dim, local."""
    repeats = node.args[1]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if not isinstance(repeats, int) or dim is None:
        return Fallback(GatherReason.ALONG_SEQUENCE, "(repeats of a tensor, or flattened)")
    if norm_dim(dim, ndim) != p.dim:
        return p
    return dataclasses.replace(p, inner=p.inner * repeats)


def rewrite_repeat_interleave(node: fx.Node, out: Seq, state: PassState) -> None:
    """Along the sequence, its ``output_size``, where given, becomes this rank's."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    along = norm_dim(dim, len(shape(node))) == out.dim
    if along and node.kwargs.get("output_size") is not None:
        node.update_kwarg("output_size", state.local_shape(node, out)[out.dim])


@sharded_first
def infer_one_hot(node, place, p: Seq, ndim: int):
    return p  # a new last dim after the ids' dims


def infer_table_rows(node, place: Placements):
    """``table[ids]`` with a replicated table and sharded ids: the ids' rows (the indexed dims
    give way to the ids' broadcast dims, in place where the ids are adjacent)."""
    indices = node.args[1]
    picked = [i for i, t in enumerate(indices) if t is not None]
    width = max(len(shape(indices[i])) for i in picked)  # dims of the broadcast ids
    aligned = {
        place[ids].at(place[ids].dim + width - len(shape(ids)))
        for ids in (indices[i] for i in picked)
        if place.sharded(ids)
    }
    if len(aligned) != 1:
        return Fallback(GatherReason.MIXED_DIMS)
    seq = aligned.pop()
    first = picked[0] if picked == list(range(picked[0], picked[-1] + 1)) else 0
    return seq.at(first + seq.dim)


def rewrite_table_rows(node: fx.Node, out: Seq, state: PassState) -> None:
    """The table whole on every rank (its gradient summed over the ring); replicated ids
    that line up with the sharded ones sliced."""
    indices = [i for i in node.args[1] if i is not None]
    state.fit_replicated_inputs(node, out, aligned=indices)


@sharded_first
def infer_histc(node, place, p: Seq, ndim: int):
    """A histogram of every element: the ring's total (replicated). Its range must be given:
    ``min == max`` reads the range from the data, which differs per rank."""
    low, high = (node.args[i] if len(node.args) > i else node.kwargs.get(k, 0)
                 for i, k in ((2, "min"), (3, "max")))  # fmt: skip
    if low == high:
        return Fallback(GatherReason.ALONG_SEQUENCE, "(a histogram whose range is the data's)")
    return None


def rewrite_histc(node: fx.Node, out, state: PassState) -> None:
    """This rank's elements counted (padding set below the range), then the ring's counts."""
    x = node.args[0]
    low = node.args[2] if len(node.args) > 2 else node.kwargs.get("min", 0)
    g = state.graph
    with g.inserting_before(node):
        local = masked_padding(x, low - 1, state)
        counts = g.call_function(node.target, (local, *node.args[1:]), node.kwargs)
        total = g.call_function(reduce_from_ring, (counts, state.group_name))
    state.replace(node, total, None)


def _bincount_args(node: fx.Node) -> tuple:
    """``(ids, weights, minlength)`` of a ``bincount`` node, given by position or name."""
    given = dict(zip(("self", "weights", "minlength"), node.args, strict=False)) | node.kwargs
    return given["self"], given.get("weights"), given.get("minlength", 0)


def infer_bincount(node, place: Placements):
    """``bincount(ids, weights, minlength)`` of sharded ids: the ring's total (replicated).
    Its length must be given (``minlength``): otherwise it is the data's largest id + 1,
    which differs per rank."""
    ids, weights, minlength = _bincount_args(node)
    if not place.sharded(ids) or (weights is not None and place[weights] != place[ids]):
        return Fallback(GatherReason.MIXED_DIMS)
    if not minlength or shape(node)[0] != minlength:
        return Fallback(GatherReason.ALONG_SEQUENCE, "(a count whose length is the data's)")
    return None


def rewrite_bincount(node: fx.Node, out, state: PassState) -> None:
    """This rank's ids counted by a ``scatter_add`` of fixed length (padding adds 0), then
    the ring's counts."""
    ids, weights, _ = _bincount_args(node)
    result = val(node)
    g = state.graph
    with g.inserting_before(node):
        if weights is None:
            weights = call(g, aten.ones_like.default, (ids,), {"dtype": result.dtype})
        else:
            weights = call(g, aten._to_copy.default, (weights,), {"dtype": result.dtype})
        state.place[weights] = state.place[ids]  # (read by the padding's mask)
        weights = masked_padding(weights, 0, state)
        ids = masked_padding(ids, 0, state)
        zeros = g.call_function(
            aten.zeros.default,
            ([shape(node)[0]],),
            {"dtype": result.dtype, "device": result.device},
        )
        counts = g.call_function(aten.scatter_add.default, (zeros, 0, ids, weights))
        total = g.call_function(reduce_from_ring, (counts, state.group_name))
    state.replace(node, total, None)


@sharded_first
def infer_like(node, place, p: Seq, ndim: int):
    """``zeros_like`` and its kin: a new tensor placed as the one it is shaped like."""
    return p


@sharded_first
def infer_draw(node, place, p: Seq, ndim: int):
    """A draw shaped like a sharded tensor: placed as it is, unless its rows are in a sort's
    order (its share by position would not be its rows)."""
    if p.order is not None:
        return Fallback(GatherReason.ALONG_SEQUENCE, "(a draw shaped like sorted rows)")
    return p


def rewrite_draw(node: fx.Node, out: Seq, state: PassState) -> None:
    """A draw shaped like a sharded tensor, drawn whole (the shape the unmodified model
    draws, from the same generator, which every rank holds alike) and this rank's share
    kept: the model's own numbers (PhiMoE's Gumbel sampling). The whole draw is O(S) times
    its width per position for a moment: a router's experts."""
    graph = state.graph
    with graph.inserting_before(node):
        like = {"dtype": val(node).dtype, "device": val(node).device}
        whole = call(graph, aten.empty.memory_format, (list(shape(node)),), like, like=node)
        drawn = call(graph, node.target, (whole, *node.args[1:]), dict(node.kwargs))
    state.replace(node, state.slice(drawn, out, 0), out)


def infer_scatter_off_sequence(node, place: Placements):
    """``scatter(x, dim, ids, value or src)`` off the sequence, all sharded alike: local (the
    group masks of DeepSeek's routing); a replicated ``x`` that lines up (JetMoE's one-hot
    mark of ``zeros``) is sliced."""
    x, dim, ids = node.args[:3]
    src = node.args[3] if len(node.args) > 3 else None
    others = [a for a in (ids, src) if isinstance(a, fx.Node)]
    if not place.sharded(ids) or any(place[a] != place[ids] for a in others):
        return Fallback(GatherReason.MIXED_DIMS)
    p = place[ids]
    if norm_dim(dim, len(shape(x))) == p.dim:
        return Fallback(GatherReason.ALONG_SEQUENCE)
    if place.sharded(x):
        return p if place[x] == p else Fallback(GatherReason.MIXED_DIMS)
    return place.line_up(node, [x], p)


def infer_scatter_add(node, place: Placements):
    """``scatter_add(base, dim, ids, src)``: local where all three are sharded alike off
    ``dim``; a sum over the tokens where ``ids`` and ``src`` are sharded along ``dim`` and
    the base (per expert) is replicated."""
    base, dim, ids, src = node.args[:4]
    dim = norm_dim(dim, len(shape(base)))
    if place[ids] != place[src] or not place.sharded(ids):
        return Fallback(GatherReason.MIXED_DIMS)
    p = place[ids]
    if p.order is not None:  # a token dispatch's combine
        return dispatch.infer_combine(node, place)
    if p.dim != dim:
        return p if place[base] == p else Fallback(GatherReason.MIXED_DIMS)
    return None if not place.sharded(base) else Fallback(GatherReason.ALONG_SEQUENCE)


def rewrite_scatter_add(node: fx.Node, out, state: PassState) -> None:
    """Off the sequence: local. Along it: this rank's tokens (padding adding 0) scattered
    into zeros, the ring's sums added to the base."""
    if out is not None:
        return fit_broadcast(node, out, state)  # (a dispatch's fresh base, sliced)
    base, dim, ids, src = node.args[:4]
    g = state.graph
    with g.inserting_before(node):
        local = masked_padding(src, 0, state)
        zeros = g.call_function(aten.zeros_like.default, (base,))
        partial = g.call_function(node.target, (zeros, dim, ids, local))
        total = g.call_function(reduce_from_ring, (partial, state.group_name))
        result = g.call_function(aten.add.Tensor, (base, total))
    state.replace(node, result, None)


def is_table_lookup(node: fx.Node, place: Placements) -> bool:
    """An ``aten.index`` of a replicated tensor by sharded indices."""
    return not place.sharded(node.args[0]) and any(
        i is not None and place.sharded(i) for i in node.args[1]
    )


RULES = {
    **dict.fromkeys(SELECTIONS, Rule(infer_selection, as_it_is)),
    aten.repeat_interleave.self_int: Rule(infer_repeat_interleave, rewrite_repeat_interleave),
    aten.one_hot.default: Rule(infer_one_hot, as_it_is),
    aten.histc.default: Rule(infer_histc, rewrite_histc),
    aten.bincount.default: Rule(infer_bincount, rewrite_bincount),
    aten.scatter_add.default: Rule(infer_scatter_add, rewrite_scatter_add),
    **dict.fromkeys(SCATTERS, Rule(infer_scatter_off_sequence, fit_broadcast)),
    **dict.fromkeys(LIKE, Rule(infer_like, as_it_is)),
    **dict.fromkeys(DRAWS, Rule(infer_draw, rewrite_draw)),
}
