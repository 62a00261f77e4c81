"""Reading a ringified model's rewritten graph in tests: what it would allocate."""

from __future__ import annotations

import torch
from torch import fx


def quadratic_nodes(ringified, length: int) -> list[str]:
    """Nodes of the last call's rewritten graph (and of the regions it outlined) whose value
    has two dims of the sequence's global ``length`` (an S x S tensor or a slice of one), by
    ``meta["val"]``."""
    found = []
    graphs = [m.graph for m in ringified._last().module.modules() if isinstance(m, fx.GraphModule)]
    for node in (n for graph in graphs for n in graph.nodes):
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor) and list(v.shape).count(length) >= 2:
                found.append(node.name)
    return found
