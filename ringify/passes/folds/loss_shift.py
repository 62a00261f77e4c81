"""The loss shift by slicing, folded into a shift of the labels: the logits stay whole.

nanoGPT-style training code shifts by slicing both sides of the loss::

    cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))

Two slices of S - 1 positions: the pass could only gather them, the (B, S, V) logits
included. The same loss is ``cross_entropy(logits.reshape(-1, V), t.reshape(-1))`` with
``t[p] = labels[p + 1]`` and ``ignore_index`` at the last position: the last logits
row pairs with a target that counts nowhere (in a mean's count neither), and every
other row with the target it had. ``fold_sliced_loss`` rewrites the graph so, before
the plan: the labels' shift is ``shifted`` (a halo exchange on the ring, as HF's label
shift), and the logits are not sliced. Only for a summed or averaged loss (``"none"``
would return S positions, not S - 1), and only through reshapes that infer their
flattened size (``-1``), so that no size argument changes.
"""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.graph.losses import LOSSES, MEAN, NONE, loss_arg
from ringify.passes.graph.nodes import call, evaluate, norm_dim, shape, slice_bounds
from ringify.passes.graph.vocabulary import COPIES, SIZED_VIEWS
from ringify.runtime.collectives.neighbours import shifted

aten = torch.ops.aten


def fold_sliced_loss(gm: fx.GraphModule) -> int:
    """Rewrite every loss of sliced logits and labels as above; how many."""
    graph = gm.graph
    folded = 0
    for loss in [n for n in graph.nodes if n.op == "call_function" and n.target in LOSSES]:
        if loss_arg(loss, 0, MEAN) == NONE:
            continue
        x_path, t_path = _path(loss.args[0]), _path(loss.args[1])
        if x_path is None or t_path is None:
            continue
        x_slice, t_slice = x_path[-1], t_path[-1]
        if not _pairs(x_slice, t_slice):
            continue
        labels, dim = t_slice.args[0], norm_dim(t_slice.args[1], len(shape(t_slice)))
        with graph.inserting_before(t_slice):
            targets = call(graph, shifted, (labels, dim, 1, loss_arg(loss, 1, -100)))
        t_slice.replace_all_uses_with(targets)
        x_slice.replace_all_uses_with(x_slice.args[0])
        for node in [*reversed(x_path[:-1]), *reversed(t_path[:-1])]:
            node.meta["val"] = evaluate(node)
        for node in (x_slice, t_slice):
            graph.erase_node(node)
        folded += 1
    return folded


def _path(x: fx.Node) -> list[fx.Node] | None:
    """The reshapes from ``x`` back to a slice along one dim, ending with the slice."""
    path = []
    while isinstance(x, fx.Node) and x.op == "call_function" and len(x.users) == 1:
        path.append(x)
        if x.target is aten.slice.Tensor:
            return path
        if (x.target in SIZED_VIEWS and list(x.args[1]).count(-1) == 1) or x.target in COPIES:
            x = x.args[0]
        else:
            return None
    return None


def _pairs(x_slice: fx.Node, t_slice: fx.Node) -> bool:
    """Whether the logits' slice drops the last position and the labels' the first, along
    dims with the same dims before them (so that flattened, row p meets target p + 1) and
    only the classes after the logits'."""
    x, t = x_slice.args[0], t_slice.args[0]
    xd, td = (norm_dim(s.args[1], len(shape(s))) for s in (x_slice, t_slice))
    length = shape(x)[xd]
    if shape(t)[td] != length or shape(x)[:xd] != shape(t)[:td] or len(shape(t)) != td + 1:
        return False
    if len(shape(x)) != xd + 2:
        return False
    return slice_bounds(x_slice, length) == (0, length - 1, 1) and slice_bounds(
        t_slice, length
    ) == (1, length, 1)
