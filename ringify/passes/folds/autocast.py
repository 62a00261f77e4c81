"""Regions a model runs under ``torch.autocast``, inlined between their enter and exit.

``torch.export`` keeps a region under ``torch.autocast(...)`` as a ``wrap_with_autocast``
node over a submodule (HF's rotary embeddings switch autocast off so, under a user's mixed
precision). The pass does not enter submodules: such a region would be gathered. Inlined
between ``_enter_autocast`` and ``_exit_autocast`` calls, which set the same autocast state
when the graph runs (as Dynamo writes them), its ops are the graph's own: sharded like any
other, and still cast (or not) as the model asked.
"""

from __future__ import annotations

import operator

from torch import fx
from torch._higher_order_ops.wrap import wrap_with_autocast
from torch.amp.autocast_mode import _enter_autocast, _exit_autocast


def inline_autocast_regions(gm: fx.GraphModule) -> int:
    """Inline every ``wrap_with_autocast`` region of ``gm`` as above; how many."""
    graph, inlined = gm.graph, 0
    for node in [n for n in gm.graph.nodes if n.target is wrap_with_autocast]:
        state, body, inputs = node.args[:4], node.args[4], node.args[5:]
        sub = getattr(gm, body.target)
        if any(n.op in ("get_attr", "call_module") for n in sub.graph.nodes):
            continue  # a region that reads attributes of its own: left as it is
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        with graph.inserting_before(node):
            context = graph.call_function(_enter_autocast, tuple(state))
            context.meta["val"] = None
            outputs = graph.graph_copy(sub.graph, dict(zip(placeholders, inputs, strict=True)))
            done = graph.call_function(_exit_autocast, (context,))
            done.meta["val"] = None
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
        inlined += 1
    return inlined
