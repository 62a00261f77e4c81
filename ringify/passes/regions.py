"""Module regions of a flat graph: the nodes one module call produced, outlined into a
submodule that the graph calls in their place.

``torch.export`` flattens module boundaries but tags every node with the modules whose
call made it (``meta["nn_module_stack"]``). A region is the contiguous span from a
module's first node to its last, with whatever the pass inserted in between (the ring
op, slices, copies to the ring): a span of a topologically ordered graph can always be
outlined. What a module's call carries at run time (a checkpoint) then wraps exactly
that span.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from torch import fx, nn


def in_module(node: fx.Node, path: str) -> bool:
    """Whether ``node`` was made inside the call of the module at ``path``."""
    return any(p == path for p, _ in (node.meta.get("nn_module_stack") or {}).values())


def module_span(graph: fx.Graph, path: str) -> list[fx.Node]:
    """The nodes from the first made inside ``path``'s call to the last, in graph order."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    inside = [i for i, n in enumerate(nodes) if in_module(n, path)]
    return nodes[inside[0] : inside[-1] + 1] if inside else []


def outline(
    gm: fx.GraphModule,
    span: list[fx.Node],
    name: str,
    wrap: Callable[[fx.GraphModule, list[fx.Node]], nn.Module],
) -> fx.Node:
    """Move ``span`` into submodule ``name`` (``wrap`` of its graph module and the nodes it
    takes) and call it in its place; the call node. The submodule takes the values the span
    reads from before it and returns, as a tuple, those read after it. The call counts as
    made inside every module all of the span's nodes were made in, so that an enclosing
    module's span still covers it."""
    inside = set(span)
    inputs: dict[fx.Node, None] = {}
    for node in span:
        for arg in node.all_input_nodes:
            if arg not in inside:
                inputs.setdefault(arg)
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    graph, env = fx.Graph(), {}
    for arg in inputs:
        env[arg] = graph.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for node in span:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, wrap(fx.GraphModule(gm, graph, class_name=name), list(inputs)))
    with gm.graph.inserting_before(span[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        call.meta["val"] = tuple(n.meta.get("val") for n in outputs)
        call.meta["nn_module_stack"] = _common_stack(span)
        for i, node in enumerate(outputs):
            got = gm.graph.call_function(operator.getitem, (call, i))
            got.meta = dict(node.meta)
            node.replace_all_uses_with(got, delete_user_cb=lambda user: user not in inside)
    for node in reversed(span):
        gm.graph.erase_node(node)
    return call


def _common_stack(span: list[fx.Node]) -> dict:
    """The ``nn_module_stack`` entries every node of ``span`` that has one shares."""
    stacks = [n.meta["nn_module_stack"] for n in span if n.meta.get("nn_module_stack")]
    if not stacks:
        return {}
    return {k: v for k, v in stacks[0].items() if all(s.get(k) == v for s in stacks[1:])}
