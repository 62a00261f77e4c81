"""Dropout on a sharded tensor draws per rank (``ringify.runtime.dropout``), not the same
mask on every rank's part."""

from __future__ import annotations

import operator

import torch
from torch import fx

import ringify.runtime.dropout  # noqa: F401  (registers ringify::sequence_dropout)
from ringify.passes.graph.crossings import PassState
from ringify.passes.graph.placement import Placement


def rewrite_dropout(node: fx.Node, out: Placement, state: PassState) -> None:
    """``aten.dropout(x, p, train)`` in training with ``p > 0`` -> ``sequence_dropout``."""
    x, p, train = node.args
    if not train or p <= 0:
        return
    with state.graph.inserting_before(node):
        pair = state.graph.call_function(
            torch.ops.ringify.sequence_dropout.default, (x, p, state.group_name)
        )
        pair.meta = dict(node.meta)
        pair.meta["val"] = (node.meta["val"], None)
        dropped = state.graph.call_function(operator.getitem, (pair, 0))
    dropped.meta = dict(node.meta)
    state.place[dropped] = out
    node.replace_all_uses_with(dropped)
    state.graph.erase_node(node)
