"""Advanced indexing at every position in order, folded into the view it is.

HF builds its masks by evaluating a mask function at broadcast index vectors, and a
function that reads per-position data looks it up at those vectors (packed documents:
``position_ids[batch_idx, q_idx]`` with ``batch_idx = arange(B)[:, None, None, None]``
and ``q_idx = arange(S)[None, None, :, None]``). Each index is an ``arange`` over the
whole dim it indexes, laid on its own dim of the result: the lookup is ``x`` itself,
its dims spread apart by size-1 dims. As a lookup along the sequence, the rules could
only gather it; as the view it is (``unsqueeze``), it keeps the sequence sharded, and a
mask program reads it as an O(S) input. ``fold_identity_indexing`` rewrites it so,
before the plan; any other index is left as it is.
"""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.graph.nodes import call, shape, val
from ringify.passes.graph.vocabulary import ADDS_AND_SUBS, ARANGES, INDEX_PASSING

aten = torch.ops.aten


def fold_identity_indexing(gm: fx.GraphModule) -> int:
    """Replace every ``aten.index`` whose indices are each the whole ``arange`` of the dim
    they index, on increasing dims of their broadcast shape, by ``unsqueeze``s of the
    indexed tensor; how many."""
    graph = gm.graph
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.index.Tensor:
            continue
        found = _spread_dims(node)
        if found is None:
            continue
        dropped, spread = found
        with graph.inserting_before(node):
            y = node.args[0]
            if dropped:
                y = call(graph, aten.squeeze.dims, (y, dropped))
            for position in spread:
                y = call(graph, aten.unsqueeze.default, (y, position))
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        folded += 1
    return folded


def _spread_dims(node: fx.Node) -> tuple[list[int], list[int]] | None:
    """For ``index(x, indices)`` that is such a lookup: the dims of ``x`` of size 1 it drops
    (an index into one position lies on no dim of its own), and the positions, in
    increasing order, of the size-1 dims it then adds between ``x``'s dims; else ``None``."""
    x, indices = node.args[:2]
    picked = [i for i, t in enumerate(indices) if t is not None]
    if not picked or picked != list(range(picked[0], picked[-1] + 1)):
        return None  # indices apart put their dims first: not a view of x in order
    width = max(len(shape(indices[i])) for i in picked)  # dims of the broadcast indices
    placed, dropped = [], []
    for d in picked:
        along = _arange_dim(indices[d], shape(x)[d], width)
        if along is False:
            return None
        if along is None:
            dropped.append(d)
        else:
            placed.append(along)
    if placed != sorted(set(placed)):
        return None
    if len(val(node).shape) != len(shape(x)) - len(picked) + width:
        return None
    return dropped, [picked[0] + p for p in range(width) if p not in placed]


def _arange_dim(index: fx.Node, length, width: int) -> int | bool | None:
    """The dim of a ``width``-dim broadcast that ``index`` runs along as ``0 .. length - 1``
    (its only dim longer than 1); ``None`` where ``length`` is 1 (it lies on no dim);
    ``False`` if it is not such an ``arange``."""
    if not isinstance(val(index), torch.Tensor) or val(index).is_floating_point():
        return False
    sizes = [1] * (width - len(shape(index))) + shape(index)
    if not all(isinstance(n, int) for n in (*sizes, length)):
        return False  # a size the data decides (a row's count of valid tokens, say)
    long = [d for d, size in enumerate(sizes) if size != 1]
    if long and (len(long) > 1 or sizes[long[0]] != length):
        return False
    if not long and length != 1:
        return False
    source = index
    while source.op == "call_function" and (source.target in INDEX_PASSING or _adds_zero(source)):
        source = source.args[0]
    if source.op != "call_function" or source.target not in ARANGES:
        return False
    if list(val(source).shape) != [length] or not _starts_at_zero(source):
        return False
    return long[0] if long else None


def _adds_zero(node: fx.Node) -> bool:
    """``x + 0`` or ``x - 0`` (HF offsets its positions by the cache's, 0 without one)."""
    if node.target not in ADDS_AND_SUBS:
        return False
    other = node.args[1] if len(node.args) > 1 else None
    alpha = node.kwargs.get("alpha", 1)
    return isinstance(other, (int, bool)) and other == 0 and alpha == 1


def _starts_at_zero(arange: fx.Node) -> bool:
    args = arange.args
    if arange.target is aten.arange.default:
        return True
    start = args[0]
    step = args[2] if arange.target is aten.arange.start_step else 1
    return start == 0 and step == 1
