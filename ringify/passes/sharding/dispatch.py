"""Token dispatch by sorting, placed: each rank sorts, runs and puts back its own routed slots.

In a token dispatch region (``graph/token_dispatch.py``: the routed slots sorted by expert,
grouped GEMMs, the rows put back at their tokens) a slot's result reads its own token
alone, so each rank sorts its own slots: the experts' work falls as 1/P and no token leaves
its rank. Rows in a rank's own sorted order are sharded, but not by position: their
placement is a ``Seq`` whose ``order`` is the sort. The rules here place the sort, the picks
by its indices (this rank's rows), ``grouped_mm`` (its offsets become this rank's cumulated
counts of its own slots' ids, padding included as its sorted rows include it), a split by
the experts' counts (its sizes become this rank's counts, read to the host once per
dispatch, as the model reads its own), the inverse permutation (its values this rank's row
numbers) and the put-backs (positional again; a fresh base made at this rank's size).
``failed`` checks after inference that every node of a region got the placement it needs
and that no replicated tensor lines up with its rows; a sort whose region did not hold is
inferred again as an op with no rule: gathered, exact.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from ringify.passes.graph.crossings import PassState, Rule, fit_broadcast, fit_whole
from ringify.passes.graph.nodes import argument, call, norm_dim, shape, val
from ringify.passes.graph.placement import Fallback, Placements, Seq
from ringify.passes.graph.report import GatherReason
from ringify.passes.graph.token_dispatch import (
    INVERSE,
    ROWS,
    SLOTS,
    SPLIT,
    TOKENS,
    Dispatch,
    offsets,
)
from ringify.passes.graph.vocabulary import GROUPED_MM, INDEX_PUTS, SORTS, TITAN_SCATTER_ADD
from ringify.passes.sharding.indexing import infer_indexing

aten = torch.ops.aten


def failed(dispatches: dict[fx.Node, Dispatch], place: Placements, decisions: dict) -> set:
    """The sorts whose regions the inference did not place as a dispatch needs: a row not in
    the sort's order, a combine not positional, a fallback, a replicated tensor met."""
    bad = set()
    for sort, d in dispatches.items():
        if not place.sharded(sort.args[0]):
            continue  # computed whole on every rank, as the model does
        for node, kind in d.kinds.items():
            p = place[node]
            order = None if kind == INVERSE else sort
            if isinstance(decisions.get(node), Fallback) or not all(
                isinstance(q, Seq) and q.order is order for q in (p if isinstance(p, list) else [p])
            ):
                bad.add(sort)
        for node in d.combines:
            p = place[node]
            if not isinstance(p, Seq) or p.order is not None:
                bad.add(sort)
    for _, seq in place.meetings:
        if seq.order is not None:
            bad.add(seq.order)
    return bad


def sorted_rows(node: fx.Node, place: Placements):
    """A kept dispatch's sort: its rows (and permutation) in this rank's own order."""
    rows = dataclasses.replace(place[node.args[0]], order=node)
    return [rows, rows] if node.target in SORTS else rows


def _token_rows(sort: fx.Node, place: Placements) -> Seq:
    """The placement of a positional tensor of the dispatch's tokens (its slots' / top_k)."""
    slots = place[sort.args[0]]
    return dataclasses.replace(slots, inner=slots.inner // place.dispatches[sort].top_k)


def infer_pick(node: fx.Node, place: Placements):
    """``x[perm]`` or ``x[perm // top_k]`` of positional ``x``: this rank's rows of ``x`` in
    the sort's order (each index picks within this rank's own slots or tokens); ``rows[inv]``
    by the inverse permutation: the rows in positional order again."""
    base, index = node.args[0], node.args[1][0]
    p = place[index]
    if p.order is None:  # rows[inv]
        d = place.dispatches.get(place[base].order)
        if (
            d is None
            or d.kinds.get(index) != INVERSE
            or place[base] != dataclasses.replace(p, order=d.sort)
        ):
            return Fallback(GatherReason.ALONG_SEQUENCE, "(rows put back by another order)")
        return p
    d = place.dispatches.get(p.order)
    if d is None or d.kinds.get(index) not in (SLOTS, TOKENS):
        return Fallback(GatherReason.ALONG_SEQUENCE, "(picked in another sort's order)")
    want = place[d.sort.args[0]] if d.kinds[index] == SLOTS else _token_rows(d.sort, place)
    if place[base] != want or (d.kinds[index] == TOKENS and want.inner * d.top_k != p.inner):
        return Fallback(GatherReason.MIXED_DIMS, "(rows that are not the dispatch's tokens)")
    return p


def infer_grouped_mm(node: fx.Node, place: Placements):
    """``grouped_mm`` of rows in a dispatch's order by replicated expert weights."""
    a, b = node.args[:2]
    p = place[a]
    if (
        not isinstance(p, Seq)
        or p.order is None
        or place.sharded(b)
        or place.sharded(offsets(node))
    ):
        return Fallback(GatherReason.ALONG_SEQUENCE, "(rows grouped by offsets over the sequence)")
    return p


def rewrite_grouped_mm(node: fx.Node, out: Seq, state: PassState) -> None:
    """The weights used whole; the offsets this rank's: its slots' ids counted per expert
    (the ring's counts are the model's), padding included as its sorted rows include it."""
    offs = offsets(node)
    key = ("offsets", out.order, val(offs).dtype)
    if key not in state._cache:
        counts = _local_counts(out.order, shape(offs)[0], state)
        with state.graph.inserting_before(out.order):
            state._cache[key] = call(
                state.graph, aten.cumsum.default, (counts, 0), {"dtype": val(offs).dtype}
            )
    local = state._cache[key]
    if "offs" in node.kwargs:
        node.update_kwarg("offs", local)
    else:
        node.update_arg(2, local)
    fit_whole(node, out, state)


def _local_counts(sort: fx.Node, experts: int, state: PassState) -> fx.Node:
    """This rank's count of its own slots per expert (int64), computed before ``sort``."""
    key = ("counts", sort)
    if key not in state._cache:
        ids, g = sort.args[0], state.graph
        with g.inserting_before(sort):
            long = call(g, aten._to_copy.default, (ids,), {"dtype": torch.int64})
            ones = call(g, aten.ones_like.default, (long,))
            zeros = call(g, aten.zeros.default, ([experts],),
                         {"dtype": torch.int64, "device": val(ids).device}, like=ids)  # fmt: skip
            state._cache[key] = call(g, aten.scatter_add.default, (zeros, 0, long, ones))
        state.place.update({long: state.place[ids], ones: state.place[ids]})
    return state._cache[key]


def _splits_rows(node: fx.Node, p) -> bool:
    """Whether a split of a value placed ``p`` cuts a dispatch's rows: along them, in a
    sort's order (any other split is an indexing op)."""
    dim = norm_dim(argument(node, "dim"), len(shape(node.args[0])))
    return isinstance(p, Seq) and p.order is not None and dim == p.dim


def infer_split(node: fx.Node, place: Placements):
    """A split along a dispatch's rows by its experts' counts (``token_dispatch``): each
    piece in the sort's order. Any other split: an indexing op."""
    p = place[node.args[0]]
    if not _splits_rows(node, p):
        return infer_indexing(node, place)
    d = place.dispatches.get(p.order)
    if d is None or d.kinds.get(node) != ROWS:
        return Fallback(GatherReason.ALONG_SEQUENCE, "(rows split by another sort's counts)")
    return [p] * len(val(node))


def rewrite_split(node: fx.Node, out, state: PassState) -> None:
    """The sizes become this rank's counts, read to the host once per dispatch (the model's
    ``tolist``); the export's checks of the ring's counts are dropped."""
    p = state.place[node.args[0]]
    if not _splits_rows(node, p):
        return fit_whole(node, out, state)
    sizes, key = node.args[1], ("sizes", p.order)
    if key not in state._cache:
        counts, g = _local_counts(p.order, len(sizes), state), state.graph
        with g.inserting_before(p.order):
            host = call(g, aten._to_copy.default, (counts,), {"device": torch.device("cpu")})
            numbers = []
            for e, size in enumerate(sizes):
                count = call(g, aten.select.int, (host, 0, e))
                numbers.append(g.call_function(aten.item.default, (count,)))
                numbers[-1].meta["val"] = val(size)  # the model's count, as every value global
        state._cache[key] = numbers
    node.update_arg(1, state._cache[key])
    for size in sizes:
        _drop_checks(size, state.graph)


def _drop_checks(count: fx.Node, graph: fx.Graph) -> None:
    """Erase export's runtime checks of the ring's ``count`` (``u0 >= 0``, ``Eq(u0 + ... +
    u3, slots)``: true of the model's counts, never of a rank's) once nothing else reads it:
    ``split`` checks a rank's own sizes."""
    chain, pending = [], [count]
    while pending:
        for user in pending.pop().users:
            if user.target is not aten._assert_scalar.default and not _on_numbers(user):
                return  # read by a computation: left as it is
            if user not in chain:
                chain.append(user)
                pending.append(user)
    while chain:
        for node in [n for n in chain if not n.users]:
            graph.erase_node(node)
            chain.remove(node)


def _on_numbers(node: fx.Node) -> bool:
    """Arithmetic on Python numbers (``operator.add``, ``operator.ge``, ``torch.sym_sum``)."""
    module = getattr(node.target, "__module__", None)
    name = getattr(node.target, "__name__", "")
    return module == "_operator" or (module == "torch" and name.startswith("sym_"))


def infer_combine(node: fx.Node, place: Placements):
    """A dispatch's scatter back at its tokens (or slots): positional again, as the base; a
    replicated base (``zeros``) that lines up with them is sliced, made at a rank's size."""
    named = str(node.target) == TITAN_SCATTER_ADD
    base, index, src = node.args[:3] if named else (node.args[0], *node.args[2:4])
    p = place[index]
    d = place.dispatches.get(getattr(p, "order", None))
    if d is None or place[src] != p:
        return Fallback(GatherReason.ALONG_SEQUENCE, "(a scatter along the sequence)")
    tokens = d.kinds.get(index) == TOKENS
    want = _token_rows(d.sort, place) if tokens else place[d.sort.args[0]]
    if place[base] == want:
        return want
    if not place.sharded(base) and shape(base)[0] == shape(index)[0] // (d.top_k if tokens else 1):
        place.meetings.append((base, want))  # a fresh base, made at this rank's size
        return want
    return Fallback(GatherReason.ALONG_SEQUENCE, "(a scatter along the sequence)")


def infer_inverse(node: fx.Node, place: Placements):
    """``inv[perm] = arange(slots)`` of a dispatch's permutation: positional, its values this
    rank's rows."""
    index = node.args[1][0]
    p = place[index] if index is not None else None
    d = place.dispatches.get(getattr(p, "order", None))
    if d is None or d.kinds.get(node) != INVERSE:
        return Fallback(GatherReason.NO_RULE, str(node.target))
    return dataclasses.replace(p, order=None)


def rewrite_inverse(node: fx.Node, out: Seq, state: PassState) -> None:
    """The values become this rank's row numbers, 0 to its slots (its own ``arange``)."""
    perm, g = node.args[1][0], state.graph
    with g.inserting_before(node):
        ones = call(g, aten.ones_like.default, (perm,))
        count = call(g, aten.cumsum.default, (ones, 0))
        rows = call(g, aten.sub.Tensor, (count, 1))
    state.place.update(dict.fromkeys((ones, count, rows), out))
    node.update_arg(2, rows)


NAMED = {
    **dict.fromkeys(GROUPED_MM, Rule(infer_grouped_mm, rewrite_grouped_mm)),
    TITAN_SCATTER_ADD: Rule(infer_combine, fit_broadcast),
}
RULES = {
    aten.index_add.default: Rule(infer_combine, fit_broadcast),
    SPLIT: Rule(infer_split, rewrite_split),
    **dict.fromkeys(INDEX_PUTS, Rule(infer_inverse, rewrite_inverse)),
}
