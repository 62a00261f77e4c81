"""Writes into a tensor the graph made, rewritten as the functional ops they are.

DeepSeek-V3 builds its keys in place::

    k = k_nope.new_empty(B, H, S, D_nope + D_rope)
    k[..., :D_nope] = k_nope
    k[..., D_nope:] = k_pe

which the exported graph keeps as ``copy_`` into slices of ``new_empty``. The pass reasons
about values through the graph's edges, and a write through a view changes a tensor with no
edge to it: the plan would see an uninitialised tensor feed the attention, and an op put in
the view's place (a shard, a gather) would take the write with it. ``functionalize_writes``
rewrites each write into a tensor made in the graph (not an input, parameter or buffer) as a
new value: ``slice_scatter``/``select_scatter`` of the written view back into its base (and
the functional op for ``add_``, ``masked_fill_``, ``index_put_``, ...), and every later
read of the base, or of any view of it (Qwen3.5's rotary embedding writes into
``freqs[0][..., idx]`` and reads ``freqs[0]`` again), reads that value or the same view of
it. A write it cannot rewrite so (through a view it cannot scatter) into a tensor read
afterwards raises, naming the op: never a write silently lost.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ringify.passes.graph.nodes import call, shape, uses, val
from ringify.passes.graph.vocabulary import SELECTING_VIEWS

aten = torch.ops.aten


def functionalize_writes(gm: fx.GraphModule) -> int:
    """Rewrite the writes described above; how many."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if not _writes(node) or _vmapped(node):
            continue
        path, base = _view_path(node.args[0])
        if not _made_here(base):
            if _read_after(node):
                raise ValueError(
                    f"the model writes in place into {node.args[0].name} ({node.target}), a "
                    "tensor it reads again, through a view ringify cannot follow: write the "
                    "tensor with torch.cat or a functional op instead"
                )
            continue
        with graph.inserting_before(node):
            value, written = _rewritten(graph, node, path, base)
            _read_from(graph, node, base, value)
        node.replace_all_uses_with(written)  # a write returns the view it wrote
        graph.erase_node(node)
        for view in reversed(path):
            if not view.users:
                graph.erase_node(view)
        rewritten += 1
    return rewritten


def _read_from(graph: fx.Graph, node: fx.Node, base: fx.Node, value: fx.Node) -> None:
    """Point every read of ``base`` after the write at ``value``: a read of the base itself,
    and a read of any view of it (made before the write or after, the written view's own
    path included), through that view taken anew from ``value``."""
    parents = _views_of(base)
    later = {v: [u for u in v.users if u > node] for v in parents}  # before any is moved
    anew = {base: value}

    def taken(view: fx.Node) -> fx.Node:
        if view not in anew:
            parent = taken(parents[view])
            anew[view] = call(graph, view.target, (parent, *view.args[1:]), view.kwargs)
        return anew[view]

    for view, users in later.items():
        for user in users:
            user.replace_input_with(view, taken(view))


def _views_of(base: fx.Node) -> dict[fx.Node, fx.Node | None]:
    """``base`` and every view of it, views of views included, each with the tensor it
    views (parents first)."""
    parents, stack = {base: None}, [base]
    while stack:
        parent = stack.pop()
        for user in parent.users:
            if _is_view(user) and user.args[0] is parent and user not in parents:
                parents[user] = parent
                stack.append(user)
    return parents


def _is_view(node: fx.Node) -> bool:
    """An op whose result aliases its first argument (``select``, ``view``, ``transpose``...),
    read, not written."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or _writes(node):
        return False
    return any(r.alias_info is not None for r in schema.returns)


def _writes(node: fx.Node) -> bool:
    """An op that writes its first argument (``copy_``, ``add_``, ``index_put_``...)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write and isinstance(node.args[0], fx.Node)


def _vmapped(node: fx.Node) -> bool:
    """A write inside a vmapped function (a ``BlockMask`` built in the graph: dropped with the
    FlexAttention it serves), whose values are batched: left to that function."""
    return any(
        isinstance(val(a), torch.Tensor) and torch._C._functorch.is_batchedtensor(val(a))
        for a in node.all_input_nodes
    )


def _view_path(x: fx.Node) -> tuple[list[fx.Node], fx.Node]:
    """The slices and selects from a base to ``x`` (outermost first), and that base: the
    first tensor on the way that is not one (another view, as a ``permute``, is the base,
    which ``_made_here`` then judges)."""
    path = []
    while x.op == "call_function" and x.target in SELECTING_VIEWS:
        path.append(x)
        x = x.args[0]
    return list(reversed(path)), x


def _made_here(base: fx.Node) -> bool:
    """A fresh tensor the graph computed (not an input, parameter or buffer, nor an item of
    an op that returns views, as ``split``), or the one view of such a tensor (a ``squeeze``
    of a product that nothing else reads): writing it changes nothing else."""
    if base.op != "call_function":
        return False
    if base.target is operator.getitem:
        schema = getattr(base.args[0].target, "_schema", None)
        return schema is not None and all(r.alias_info is None for r in schema.returns)
    schema = getattr(base.target, "_schema", None)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        source = base.args[0]
        return isinstance(source, fx.Node) and set(uses(source)) == {base} and _made_here(source)
    return True


def _read_after(node: fx.Node) -> bool:
    """Whether the written tensor, or any view of it, is read after the write (else the
    write changes nothing)."""
    written = node.args[0]
    while _is_view(written):
        written = written.args[0]
    if written.op != "call_function":
        return False  # an input, parameter or buffer: the model's own state
    return any(u > node for v in _views_of(written) for u in v.users) or bool(node.users)


def _rewritten(graph: fx.Graph, node: fx.Node, path: list[fx.Node], base: fx.Node) -> tuple:
    """The base's value after the write and the written view's, as functional ops."""
    views = [base]
    for view in path:  # the written view, from the base as it is now
        views.append(call(graph, view.target, (views[-1], *view.args[1:]), view.kwargs))
    written = value = _functional(graph, node, views[-1])
    for view, parent in zip(reversed(path), reversed(views[:-1]), strict=True):
        value = _scattered(graph, view, parent, value)
    return value, written


def _functional(graph: fx.Graph, node: fx.Node, current: fx.Node) -> fx.Node:
    """What ``node`` writes into ``current``, computed out of place."""
    if node.target is aten.copy_.default:
        src = node.args[1]
        if val(src).dtype != val(current).dtype:
            src = call(graph, aten.to.dtype, (src, val(current).dtype))
        if shape(src) != shape(current):
            src = call(graph, aten.expand.default, (src, shape(current)))
        return call(graph, aten.clone.default, (src,))
    packet = node.target.overloadpacket.__name__
    functional = getattr(getattr(aten, packet.removesuffix("_")), node.target._overloadname)
    return call(graph, functional, (current, *node.args[1:]), node.kwargs)


def _scattered(graph: fx.Graph, view: fx.Node, parent: fx.Node, value: fx.Node) -> fx.Node:
    """``parent`` with ``value`` written where ``view`` reads it."""
    if view.target is aten.alias.default:
        return value
    if view.target is aten.select.int:
        return call(graph, aten.select_scatter.default, (parent, value, *view.args[1:3]))
    return call(graph, aten.slice_scatter.default, (parent, value, *view.args[1:]))
