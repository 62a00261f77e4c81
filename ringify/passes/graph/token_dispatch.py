"""Token dispatch regions: an MoE layer that sorts its routed slots by expert, read off a graph.

An MoE layer that runs its experts as grouped GEMMs (torchtitan's ``GroupedExperts``, HF's
default ``grouped_mm`` implementation) sorts the routed (token, expert) slots by expert
(``argsort``/``sort`` of the flattened top-k ids), picks the tokens in that order
(``x[perm // top_k]``), runs ``grouped_mm`` with the experts' cumulated counts as offsets,
and puts each slot's result back on its token (a ``scatter_add``/``index_add`` at
``perm // top_k``, or the rows indexed by the inverse permutation). An MoE that runs its
experts one by one (JetMoE's ``ParallelExperts``) instead splits the sorted rows by the
experts' counts (``split(rows, counts.tolist())``), multiplies each piece by its expert and
puts the pieces back together in order (``cat``); it may put rows back at their slots
(``index_add`` at ``perm``). ``find`` reads each such region: from the sort, every value
must be
- an index: the permutation (``SLOTS``), ``// top_k`` of it (``TOKENS``), views of them,
  used only to pick rows of a tensor outside the region or as a put-back's index; or the
  inverse permutation (``INVERSE``), used only to put rows back;
- rows in the sort's order (``ROWS``): what those indices picked, the sorted ids, and
  pointwise work, casts, views, ``linear`` and ``grouped_mm`` on them, ops along their other
  dims, an expert table indexed by them; a count of them feeding the offsets alone; a
  split of them along the rows by the experts' counts, and the pieces' ``cat`` in order;
and the region ends where rows go back, positional again. ``grouped_mm``'s offsets, and a
split's sizes, must be the (cumulated) count of the same ``topk``'s ids (a histogram, a
``bincount``, or a one-hot mark summed over the tokens). Anything else: no region
(``sharding/dispatch.py`` then gathers the sort, exactly).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ringify.passes.graph.nodes import argument, shape
from ringify.passes.graph.op_dims import INDEXING
from ringify.passes.graph.vocabulary import (
    ARGSORTS,
    ASSERTS,
    BLANK_LIKE,
    CASTS_LIKE,
    COUNTS,
    GROUPED_MM,
    INDEX_PUTS,
    ITEMS,
    ROW_PRODUCTS,
    ROWS_CARRIED,
    SCATTER_BACK,
    SLOT_MARKS,
    SORTS,
    TITAN_SCATTER_ADD,
)

aten = torch.ops.aten
SPLIT = aten.split_with_sizes.default
# ops that act on each row alone, given a dim other than the rows' (the op -> its dim argument)
ALONG_ROWS = {**INDEXING, aten.sum.dim_IntList: 1, aten.mean.dim: 1, aten._softmax.default: 1,
              aten.softmax.int: 1, aten.cat.default: 1}  # fmt: skip
SLOTS, TOKENS, ROWS, INVERSE = "slots", "tokens", "rows", "inverse"


@dataclass(frozen=True)
class Dispatch:
    """One sort's region: its nodes by kind (``SLOTS``/``TOKENS`` indices, ``ROWS``), the
    combines that end it, and the grouped matmuls whose offsets become this rank's."""

    sort: fx.Node
    top_k: int
    kinds: dict
    combines: frozenset
    grouped: frozenset


def find(graph: fx.Graph) -> dict[fx.Node, Dispatch]:
    """Every sort of flattened top-k ids whose region is a token dispatch, by sort node."""
    found = {}
    for node in graph.nodes:
        if node.target in ARGSORTS | SORTS and (region := _region(node)) is not None:
            found[node] = region
    return found


def _region(sort: fx.Node) -> Dispatch | None:
    ids = sort.args[0]
    if len(shape(ids)) != 1 or _descending(sort):
        return None
    top_k = _top_k(ids)
    if top_k is None:
        return None
    if sort.target in SORTS:
        values, perm = _outputs(sort)
        start = {
            sort: ROWS,
            **({values: ROWS} if values else {}),
            **({perm: SLOTS} if perm else {}),
        }
    else:
        start = {sort: SLOTS}
    kinds, combines, grouped, counts = dict(start), set(), set(), set()
    pending = [n for n in start if n is not sort or sort.target in ARGSORTS]
    while pending:
        node = pending.pop()
        for user in node.users:
            if user.target in ASSERTS or user in kinds or user in combines:
                continue
            kind = _user_kind(user, node, kinds[node], top_k, shape(ids)[0])
            if kind is None:
                return None
            if kind == "like":
                continue
            if kind == "count":
                counts.add(user)
                continue
            if kind == "combine":  # checked once the walk has reached all its inputs
                combines.add(user)
                continue
            if str(user.target) in GROUPED_MM:
                if not _offsets_count(offsets(user), ids, top_k):
                    return None
                grouped.add(user)
            kinds[user] = kind
            pending.append(user)
    for c in combines:  # its index and rows are the region's
        if not _combine_ok(c, kinds):
            return None
    for node in kinds:  # rows split by the experts' counts, and put together in order
        if node.target is SPLIT and _along_rows(node) and not _split_by_counts(node, ids):
            return None
        if node.target is aten.cat.default and _along_rows(node) and not _in_order(node, kinds):
            return None
    if not combines or not all(_feedsoffsets(c, grouped) for c in counts):
        return None
    return Dispatch(sort, top_k, kinds, frozenset(combines), frozenset(grouped))


def _user_kind(user: fx.Node, node: fx.Node, kind: str, top_k: int, slots: int):
    """What ``user`` is in the region, given that it reads ``node`` of ``kind``; ``None``:
    not a dispatch."""
    target, name = user.target, str(user.target)
    if name in SCATTER_BACK:
        return "combine"
    if (target in CASTS_LIKE and user.args[0] is not node) or target in BLANK_LIKE:
        return "like"  # read for its dtype (and shape) alone
    if (target in ROWS_CARRIED and user.args[0] is node) or target is operator.getitem:
        return kind
    if target in INDEX_PUTS:  # the inverse permutation: inv[perm] = arange(slots)
        return INVERSE if kind == SLOTS and _inverse(user, node, slots) else None
    if target is aten.index.Tensor:
        base, indices = user.args[0], user.args[1]
        if (
            kind in (ROWS, INVERSE)
            and indices == [user.args[1][0]]
            and ((base is node) == (kind == ROWS))
        ):
            return "combine"  # rows put back in positional order, by the inverse
        if (
            base is node
            or [i for i in indices if i is not None] != [node]
            or indices[0] is not node
        ):
            return None
        if kind == ROWS:  # an expert table picked by the sorted ids
            return ROWS
        rows = slots if kind == SLOTS else slots // top_k
        return ROWS if shape(base)[0] == rows else None
    if kind == SLOTS and _floor_divided_by(user, node) == top_k:
        return TOKENS
    if kind != ROWS:
        return None
    if target in COUNTS:  # the offsets' counts: checked to feed them alone
        return "count"
    if target in (SPLIT, aten.cat.default) and _along_rows(user):
        return ROWS  # checked once the walk is done: by the counts, in order
    if target in ALONG_ROWS and _off_rows(user):
        return ROWS
    if name in GROUPED_MM and user.args[0] is node:
        return ROWS
    if target in ROW_PRODUCTS and user.args[0] is node and len(shape(user.args[1])) == 2:
        return ROWS  # rows times a weight
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return ROWS
    return None


def _inverse(node: fx.Node, perm: fx.Node, slots: int) -> bool:
    """``index_put(new_like(perm), [perm], arange(slots))``: the permutation's inverse."""
    base, indices, values = node.args[:3]
    return (
        indices == [perm]
        and getattr(base, "target", None) in BLANK_LIKE
        and base.args[0] is perm
        and getattr(values, "target", None) is aten.arange.default
        and list(values.args) == [slots]
    )


def _off_rows(node: fx.Node) -> bool:
    """Whether an ``ALONG_ROWS`` op's dim(s) leave the rows' dim (0) alone."""
    pos = ALONG_ROWS[node.target]
    dims = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0)
    source = node.args[0][0] if node.target is aten.cat.default else node.args[0]
    ndim = len(shape(source))
    return 0 not in {d % ndim for d in (dims if isinstance(dims, (list, tuple)) else [dims])}


def _feedsoffsets(count: fx.Node, grouped: set) -> bool:
    """Whether a count of sorted ids is read only as the offsets of the region's grouped
    products (through casts and its ``cumsum``): its ring total is then never used."""
    readers = [u for u in count.users if u.target not in ASSERTS]
    if count.target is aten.cumsum.default:
        return all(u in grouped and offsets(u) is count for u in readers)
    return bool(readers) and all(
        (u.target in ROWS_CARRIED or u.target is aten.cumsum.default) and _feedsoffsets(u, grouped)
        for u in readers
    )


def _combine_ok(node: fx.Node, kinds: dict) -> bool:
    """A put back at the tokens: a scatter ``(base, [dim 0,] index, src)`` with the index
    the region's token indices and the rows its rows, the base outside it; or the rows
    picked by the inverse permutation."""
    if node.target is aten.index.Tensor:
        return kinds.get(node.args[0]) == ROWS and kinds.get(node.args[1][0]) == INVERSE
    if str(node.target) == TITAN_SCATTER_ADD:
        base, index, src = node.args[:3]
    else:
        base, dim, index, src = node.args[:4]
        if dim != 0:
            return False
    return base not in kinds and kinds.get(index) in (TOKENS, SLOTS) and kinds.get(src) == ROWS


def _along_rows(node: fx.Node) -> bool:
    """A split or cat along dim 0, the rows'."""
    source = node.args[0][0] if node.target is aten.cat.default else node.args[0]
    return argument(node, "dim") % len(shape(source)) == 0


def _split_by_counts(split: fx.Node, ids: fx.Node) -> bool:
    """``split(rows, sizes)`` with ``sizes[e]`` the number (``item``) of the slots of expert
    ``e`` among ``ids``, for every expert in order: ``counts.tolist()``."""
    sizes, topk = split.args[1], _topk(ids)
    if not all(isinstance(s, fx.Node) and s.target in ITEMS for s in sizes):
        return False
    # counts[e]: ``unbind(counts)[e]`` or ``select(counts, 0, e)``
    picked = [s.args[0] for s in sizes]
    if not all(
        (p.target is operator.getitem and p.args[0].target is aten.unbind.int)
        or (p.target is aten.select.int and p.args[1] == 0)
        for p in picked
    ):
        return False
    counts = {p.args[0].args[0] if p.target is operator.getitem else p.args[0] for p in picked}
    if len(counts) != 1 or [p.args[-1] for p in picked] != list(range(len(sizes))):
        return False
    return len(sizes) == shape(topk.args[0])[-1] and _counts_of(counts.pop(), ids, topk)


def _in_order(cat: fx.Node, kinds: dict) -> bool:
    """A ``cat`` along the rows of the pieces of one split by counts, each in its place
    (each piece through row-wise work alone): the rows in the sort's order again."""
    pieces = []
    for x in cat.args[0]:
        while isinstance(x, fx.Node) and kinds.get(x) == ROWS and not _piece(x):
            x = x.args[0]
        pieces.append(_piece(x) if isinstance(x, fx.Node) and kinds.get(x) == ROWS else None)
    split = pieces[0][0] if pieces[0] else None
    return split is not None and pieces == [(split, i) for i in range(len(split.args[1]))]


def _piece(node: fx.Node):
    """``(split, i)`` where ``node`` is piece ``i`` of a split along the rows, else ``None``."""
    source = node.args[0] if node.target is operator.getitem else None
    along = getattr(source, "target", None) is SPLIT and _along_rows(source)
    return (source, node.args[1]) if along else None


def _floor_divided_by(user: fx.Node, node: fx.Node):
    if user.args[0] is not node or len(user.args) < 2:
        return None
    if user.target is aten.floor_divide.default or (  # (trunc is floor: slots are >= 0)
        user.target is aten.div.Tensor_mode
        and user.kwargs.get("rounding_mode") in ("floor", "trunc")
    ):
        return user.args[1] if isinstance(user.args[1], int) else None
    return None


def _descending(sort: fx.Node) -> bool:
    return bool(argument(sort, "descending"))


def _outputs(sort: fx.Node) -> tuple:
    got = {u.args[1]: u for u in sort.users if u.target.__name__ == "getitem"}
    return got.get(0), got.get(1)


def _through(node: fx.Node) -> fx.Node:
    """``node`` back through views and casts."""
    while isinstance(node, fx.Node) and node.target in ROWS_CARRIED:
        node = node.args[0]
    return node


def _topk(ids: fx.Node):
    """The ``topk`` whose indices ``ids`` are (back through views and casts), else ``None``."""
    src = _through(ids)
    if not (isinstance(src, fx.Node) and src.target.__name__ == "getitem" and src.args[1] == 1):
        return None
    topk = src.args[0]
    return topk if getattr(topk, "target", None) is aten.topk.default else None


def _top_k(ids: fx.Node):
    """The top-k of the flattened slots: the ``topk``'s k, with its ids the last dim."""
    topk = _topk(ids)
    if topk is None:
        return None
    dim = argument(topk, "dim") % len(shape(topk.args[0]))
    if dim != len(shape(topk.args[0])) - 1:
        return None
    return argument(topk, "k")


def offsets(node: fx.Node):
    return node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)


def _offsets_count(offs, ids: fx.Node, top_k: int) -> bool:
    """Whether ``offs`` is the ``cumsum`` of each expert's count of its slots among ``ids``."""
    topk = _topk(ids)
    cumsum = _through(offs)
    if getattr(cumsum, "target", None) is not aten.cumsum.default or cumsum.args[1] != 0:
        return False
    return _counts_of(cumsum.args[0], ids, topk)


def _counts_of(counts: fx.Node, ids: fx.Node, topk: fx.Node) -> bool:
    """Whether ``counts`` (back through casts) counts each expert's slots among ``ids``:
    a histogram, a ``bincount`` or a sum over the tokens of a one-hot mark of ``topk``'s
    ids, one bin per expert."""
    experts = shape(topk.args[0])[-1]
    counts = _through(counts)
    if shape(counts) != [experts]:
        return False
    if counts.target is aten.histc.default:
        low, high = argument(counts, "min"), argument(counts, "max")
        same = _topk(counts.args[0]) is topk or _sorted_ids(counts.args[0], ids)
        return (
            same
            and argument(counts, "bins") == experts
            and low == 0
            and high in (experts - 1, experts)
        )
    if counts.target is aten.bincount.default:
        return _topk(counts.args[0]) is topk
    if counts.target is aten.sum.dim_IntList:  # a one-hot mark summed over every token dim
        mark = _through(counts.args[0])
        dims = sorted(d % len(shape(mark)) for d in counts.args[1])
        return (
            mark.target in SLOT_MARKS
            and mark.args[1] in (-1, len(shape(mark)) - 1)
            and _topk(mark.args[2]) is topk
            and dims == list(range(len(shape(mark)) - 1))
        )
    return False


def _sorted_ids(node: fx.Node, ids: fx.Node) -> bool:
    """``node`` is the sorted values of a sort of ``ids``."""
    src = _through(node)
    return (
        src.target.__name__ == "getitem"
        and src.args[1] == 0
        and getattr(src.args[0], "target", None) in SORTS
        and src.args[0].args[0] is ids
    )
