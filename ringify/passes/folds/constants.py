"""Tensor constants of an exported graph that it computes the same without.

HF's caches start each layer's keys and values as ``torch.tensor([])`` on the device they
were traced on, and concatenate the new ones onto them. Export lifts those empty tensors
into the graph as constants (read through ``lift_fresh_copy`` and ``detach_``): the only
tensors in it that are neither the model's state nor its inputs, so the only ones tied to
a device by the trace. ``torch.cat`` skips a 1-D empty tensor (its legacy rule), so a cat
without it computes exactly the same.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ringify.passes.graph.vocabulary import VALUE_PASSING

aten = torch.ops.aten


def drop_empty_concatenated(gm: fx.GraphModule) -> int:
    """Leave out of every ``cat`` the 1-D empty tensor constants of its output's dtype, where
    its other tensors have that dtype too (a start that promotes them stays); erase what
    only they used; how many cats. Every node it inserts carries the ``meta`` of the cat it
    replaces."""
    folded = 0
    for node in [n for n in gm.graph.nodes if n.target is aten.cat.default]:
        tensors = node.args[0]
        dtype = node.meta["val"].dtype if "val" in node.meta else None
        dropped = [t for t in tensors if _empty_constant(gm, t, dtype)]
        kept = [t for t in tensors if t not in dropped]
        if not dropped or not kept or not all(_dtype(t) == dtype for t in kept):
            continue  # (a start that promotes the others' dtype stays)
        if len(kept) > 1:
            node.args = (kept, *node.args[1:])
        else:  # a cat of one tensor: its contiguous copy (a clone the pass's rules know)
            with gm.graph.inserting_before(node):
                copy = gm.graph.call_function(
                    aten.clone.default, (kept[0],), {"memory_format": torch.contiguous_format}
                )
            copy.meta = dict(node.meta)
            node.replace_all_uses_with(copy)
            gm.graph.erase_node(node)
        for source in dropped:
            _erase_unused(gm.graph, source)
        folded += 1
    return folded


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _empty_constant(gm: fx.GraphModule, node, dtype) -> bool:
    while isinstance(node, fx.Node) and node.target in VALUE_PASSING:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    value = operator.attrgetter(node.target)(gm)
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, torch.nn.Parameter)
        and value.shape == (0,)
        and value.dtype == dtype
    )


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and the chain of constant reads behind it, as far as nothing else uses
    them (an in-place ``detach_`` of the chain counts as a use of its input only)."""
    chain = [node]
    while chain[-1].target in VALUE_PASSING:
        chain.append(chain[-1].args[0])
    for step in chain:  # the detach_ export puts on a copy goes first, if nothing reads it
        for user in [u for u in step.users if u.target is aten.detach_.default and not u.users]:
            graph.erase_node(user)
        if step.users:
            return
        graph.erase_node(step)
