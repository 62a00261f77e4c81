"""Reading a ringified model's rewritten graph in tests: what it would allocate."""

from __future__ import annotations

import torch


def quadratic_nodes(ringified, length: int) -> list[str]:
    """Nodes of the last call's rewritten graph whose value has two dims of the sequence's
    global ``length`` (an S x S tensor or a slice of one), by ``meta["val"]``."""
    found = []
    for node in ringified._last().module.graph.nodes:
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor) and list(v.shape).count(length) >= 2:
                found.append(node.name)
    return found
