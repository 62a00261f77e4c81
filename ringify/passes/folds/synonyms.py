"""Ops a model may spell another way, rewritten as the one spelling the rules and folds read.

- ``concat`` and ``concatenate`` (Zamba joins its hidden states with ``torch.concatenate``)
  are ``cat``.
- Ops that take their sizes from another tensor (``expand_as``, ``view_as``, ``reshape_as``)
  become the ops that name them (``expand``, ``reshape``). The other tensor is read for its
  shape alone; as an argument it would tie the result's placement to it. With the sizes
  written out, the rules treat the op as any expand or view: a replicated
  ``arange(n).expand_as(ids)`` stays whole, to be cut where it meets the sequence, and a
  sharded input gets its local sizes.
"""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.graph.nodes import shape

aten = torch.ops.aten
_CATS = (aten.concat.default, aten.concatenate.default)
_AS = {
    aten.expand_as.default: aten.expand.default,
    aten.view_as.default: aten.reshape.default,
    aten.reshape_as.default: aten.reshape.default,
}


def fold_synonyms(graph: fx.Graph) -> None:
    """Rewrite each op above in its one spelling, in place."""
    for node in graph.nodes:
        if node.target in _CATS:
            node.target = aten.cat.default
        elif node.target in _AS:
            x, other = node.args[:2]
            node.target, node.args = _AS[node.target], (x, shape(other))
