"""Losses in an ATen graph: which ops they are and how to read their reduction and ignored index."""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

LOSSES = {aten.cross_entropy_loss.default: (3, 4), aten.nll_loss.default: (3, 4)}
MEAN, SUM, NONE = 1, 2, 0


def loss_arg(node: fx.Node, which: int, default):
    pos = LOSSES[node.target][which]
    name = ("reduction", "ignore_index")[which]
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)
