"""Is an attention mask the causal mask, built from positions alone?

Models (HF transformers among them) often build the causal mask as a tensor
from ``arange`` comparisons instead of passing ``is_causal=True``. If the mask's
subgraph reads no input and no parameter, it is a function of the shapes only:
the pass evaluates it once and, if it is exactly lower-triangular for every batch
and head, the ring op runs with ``is_causal=True`` and no mask tensor at all.
Anything else is kept as a mask; a mask is never replaced by a weaker one.
"""

from __future__ import annotations

import torch
from torch import fx


def positions_only(mask: fx.Node) -> bool:
    """True if ``mask`` depends on no graph input, parameter or buffer."""
    seen, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op in ("placeholder", "get_attr") or node.op != "call_function":
            return False
        stack.extend(node.all_input_nodes)
    return True


def evaluate(mask: fx.Node) -> torch.Tensor:
    """Run the subgraph that computes ``mask`` (only valid if ``positions_only``)."""
    values: dict[fx.Node, object] = {}

    def value(node: fx.Node):
        if node not in values:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
            values[node] = node.target(*args, **kwargs)
        return values[node]

    return value(mask)


def is_causal_mask(mask: fx.Node) -> bool:
    if not positions_only(mask):
        return False
    m = evaluate(mask)
    s, t = m.shape[-2:]
    if s != t:
        return False
    tril = torch.ones(s, t, dtype=torch.bool, device=m.device).tril()
    if m.dtype == torch.bool:
        allowed, blocked = m, ~m
    else:  # additive: 0 attends; -inf (or the dtype's lowest value) masks
        allowed = m == 0
        blocked = m <= torch.finfo(m.dtype).min
    return bool((allowed == tril).all() and (blocked == ~tril).all())
