"""Regions export wraps in a submodule, inlined: under ``torch.autocast`` and under ``torch.no_grad``.

``torch.export`` keeps a region under ``torch.autocast(...)`` as a ``wrap_with_autocast``
node over a submodule (HF's rotary embeddings switch autocast off so, under a user's mixed
precision), and one under ``torch.no_grad()`` as ``wrap_with_set_grad_enabled`` (a router's
masks, PhiMoE's). The pass does not enter submodules: such a region would be gathered.
Inlined, its ops are the graph's own, sharded like any other, and still run as the model
asked:

- an autocast region between ``_enter_autocast`` and ``_exit_autocast`` calls, which set
  the same autocast state when the graph runs (as Dynamo writes them);
- a no-grad region on its inputs detached: its ops record nothing for autograd and its
  outputs need no gradient, as under ``torch.no_grad()``.

A region that reads attributes of its own is left as it is.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled
from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

from ringify.passes.graph.nodes import call, is_tensor, val


def inline_autocast_regions(gm: fx.GraphModule) -> int:
    """Inline every ``wrap_with_autocast`` region of ``gm`` as above; how many."""
    inlined = 0
    for node in [n for n in gm.graph.nodes if n.target is wrap_with_autocast]:
        state, body, inputs = node.args[:4], node.args[4], node.args[5:]
        if _reads_attributes(gm, body):
            continue

        def around(graph: fx.Graph, copy, state=state):
            context = graph.call_function(_enter_autocast, tuple(state))
            context.meta["val"] = None
            outputs = copy()
            graph.call_function(_exit_autocast, (context,)).meta["val"] = None
            return outputs

        _inline(gm, node, body, inputs, around)
        inlined += 1
    return inlined


def inline_no_grad_regions(gm: fx.GraphModule) -> int:
    """Inline every ``wrap_with_set_grad_enabled(False, ...)`` region of ``gm``, its inputs
    that need a gradient read detached; how many."""
    inlined = 0
    for node in [n for n in gm.graph.nodes if n.target is wrap_with_set_grad_enabled]:
        enabled, body, *inputs = node.args
        if enabled or _reads_attributes(gm, body):
            continue  # enabled: gradients switched back on inside a no-grad caller
        with gm.graph.inserting_before(node):
            inputs = [
                call(gm.graph, torch.ops.aten.detach.default, (x,))
                if is_tensor(x) and val(x).requires_grad else x
                for x in inputs
            ]  # fmt: skip
        _inline(gm, node, body, inputs, lambda graph, copy: copy())
        inlined += 1
    return inlined


def _reads_attributes(gm: fx.GraphModule, body: fx.Node) -> bool:
    return any(n.op in ("get_attr", "call_module") for n in getattr(gm, body.target).graph.nodes)


def _inline(gm: fx.GraphModule, node: fx.Node, body: fx.Node, inputs, around) -> None:
    """``node``'s region copied in its place (``around`` makes the copy, with what it sets
    up around it), its outputs read where ``node``'s were."""
    graph, sub = gm.graph, getattr(gm, body.target)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(node):
        values = dict(zip(placeholders, inputs, strict=True))
        outputs = around(graph, lambda: graph.graph_copy(sub.graph, values))
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(node.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    if node.users:  # the region's one output read whole
        node.replace_all_uses_with(outputs[0])
    graph.erase_node(node)
    if not body.users:
        graph.erase_node(body)
        delattr(gm, body.target)
