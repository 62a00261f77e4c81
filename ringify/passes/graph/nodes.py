"""Reading the nodes of an ATen graph: their values, shapes and dims, and new nodes with values.

While the pass runs, every node it reads carries ``meta["val"]``: a fake tensor at
the *global* shapes (the pass rewrites sizes, never the metadata). ``call`` inserts a
node and fills its value by running the op on the fake values of its arguments, so
that a new node's shape and dtype are decided by the op itself (its fake kernel), once.
Once the rewrite is done, ``values.py`` records every node's value on a rank: the
rewritten graph's convention is local.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from ringify.passes.graph.vocabulary import ASSERTS


def val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_tensor(node) -> bool:
    return isinstance(val(node), torch.Tensor)


def shape(node) -> list[int]:
    return list(val(node).shape)


def norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def norm_dims(dims, ndim: int) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [norm_dim(d, ndim) for d in dims]


def argument(node: fx.Node, name: str):
    """An ATen call's argument ``name``, given by position or keyword or else its schema's
    default: the graph leaves out trailing arguments equal to their default (``unbind(x)``
    for ``unbind(x, 0)``), so an optional argument is never read by position."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            if i < len(node.args) and not arg.kwarg_only:
                return node.args[i]
            return node.kwargs.get(name, arg.default_value)
    raise KeyError(f"{node.target} has no argument {name!r}")


def slice_bounds(node: fx.Node, length: int) -> tuple[int, int, int]:
    """``(start, end, step)`` of an ``aten.slice.Tensor`` node over a dim of ``length``,
    clamped as torch clamps them."""
    given = list(node.args[2:5])
    return slice(*given, *[None, None, 1][len(given) :]).indices(length)


def call(
    graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, like: fx.Node | None = None
) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point, with its ``meta["val"]``
    (``like``: a node whose fake mode makes it, for an op with no tensor argument)."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = evaluate(node, like)
    return node


def replace_by_call(graph: fx.Graph, node: fx.Node, target, args: tuple) -> fx.Node:
    """``target(*args)`` in ``node``'s place: inserted before it, with its value, and read by
    its readers (``node`` is left unread, for the caller to erase)."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta["val"] = val(node)
    node.replace_all_uses_with(new)
    return new


def evaluate(node: fx.Node, like: fx.Node | None = None):
    """``node``'s value: its op run on the fake values of its arguments."""
    values = fx.node.map_arg((node.args, node.kwargs), val)
    mode = detect_fake_mode([*pytree.tree_leaves(values), val(like)])
    if mode is None:
        raise RuntimeError(f"no fake value among the arguments of {node.target}")
    with mode:
        return node.target(*values[0], **values[1])


def ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    """``nodes`` and every node they are computed from."""
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def uses(x: fx.Node) -> list[fx.Node]:
    """The nodes that read ``x``, assertions on its metadata left out."""
    return [u for u in x.users if u.target not in ASSERTS]


def erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """``node`` and what only it read, back to what is still used (assertions on them too)."""
    pending = [node]
    while pending:
        x = pending.pop()
        if getattr(x, "_erased", False) or x.op != "call_function" or uses(x):
            continue
        for check in list(x.users):
            graph.erase_node(check)
        inputs = x.all_input_nodes
        graph.erase_node(x)
        pending.extend(inputs)
