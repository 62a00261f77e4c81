"""How models spell ops: the parts of attention written by hand, and ops with two spellings.

Small matchers answer whether a node is a part of hand-written attention (``handwritten.py``
reads attention with them): products of q and k (``matmul``, ``bmm``, ``einsum``), constant
scales, casts, soft caps, the row maximum a softmax is guarded by, and views of the scores
between (B * H, S, S) and (B, H, S, S).

``fold_synonyms`` rewrites ops a model may spell another way as the one spelling the rules
and folds read:

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

import math
import operator

import torch
from torch import fx

from ringify.passes.graph.nodes import shape, val

aten = torch.ops.aten
PRODUCTS = frozenset({aten.matmul.default, aten.bmm.default})
CASTS = frozenset({aten.to.dtype, aten._to_copy.default, aten.type_as.default})
# casts to another tensor's dtype (and device): that tensor is read for them alone
WHERES = frozenset({aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf})


def einsum(node: fx.Node) -> str | None:
    """ "qk" for an einsum of q (..., i, d) and k (..., j, d) into (..., i, j); "pv" for one
    of p (..., i, j) and v (..., j, d) into (..., i, d); the batch letters the same, in the
    same order, one or two of them. Else None."""
    if node.target is not aten.einsum.default or len(node.args[1]) != 2:
        return None
    equation = node.args[0].replace(" ", "")
    if "." in equation or equation.count("->") != 1 or equation.count(",") != 1:
        return None
    inputs, out = equation.split("->")
    a, b = inputs.split(",")
    batch = out[:-2]
    if len(batch) not in (1, 2) or not (a[:-2] == b[:-2] == batch) or len(a) != len(out):
        return None
    (a1, a2), (b1, b2), (o1, o2) = a[-2:], b[-2:], out[-2:]
    if len({*batch, a1, a2, b1, b2, o1, o2}) != len(batch) + 3:
        return None  # three distinct letters besides the batch's
    if a2 == b2 and (o1, o2) == (a1, b1):
        return "qk"
    if a2 == b1 and (o1, o2) == (a1, b2):
        return "pv"
    return None


def skip_casts(x: fx.Node) -> fx.Node:
    while isinstance(x, fx.Node) and x.target in CASTS:
        x = x.args[0]
    return x


def scales(x: fx.Node) -> bool:
    return x.target in (aten.mul.Tensor, aten.div.Tensor) and constant(x.args[1]) is not None


def factor(x: fx.Node) -> float:
    c = constant(x.args[1])
    return c if x.target is aten.mul.Tensor else 1.0 / c


def constant(arg) -> float | None:
    """A Python number, or a node filled with one (``scalar_tensor``, ``full``)."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if isinstance(arg, fx.Node) and arg.target is aten.scalar_tensor.default:
        return float(arg.args[0])
    if isinstance(arg, fx.Node) and arg.target is aten.full.default and not arg.args[0]:
        return float(arg.args[1])
    return None


def reaches_product(x, depth: int = 8) -> bool:
    """Whether ``x`` is computed from a product of q and k (the scores' side of an add)."""
    for _ in range(depth):
        if not isinstance(x, fx.Node) or x.op != "call_function":
            return False
        if x.target in PRODUCTS or x.target is aten.baddbmm.default or einsum(x) == "qk":
            return True
        x = x.args[1] if x.target in WHERES else x.args[0]
    return False


def untransposed(x: fx.Node) -> fx.Node | None:
    """``k`` if ``x`` is ``k`` with its last two dims swapped, else None."""
    ndim = val(x).dim()
    last = {ndim - 2, ndim - 1}
    if x.target is aten.transpose.int and {a % ndim for a in x.args[1:3]} == last:
        return x.args[0]
    if x.target is aten.permute.default:
        dims = [d % ndim for d in x.args[1]]
        if dims == [*range(ndim - 2), ndim - 1, ndim - 2]:
            return x.args[0]
    return None


def row_max_subtracted(x: fx.Node) -> bool:
    """``x`` is ``a - max(a, -1, keepdim=True)`` (gpt-oss guards its softmax so)."""
    if x.target is not aten.sub.Tensor or not isinstance(x.args[1], fx.Node):
        return False
    a, m = x.args[:2]
    m = m.args[0] if m.target in (aten.detach.default, aten.alias.default) else m
    if m.target is operator.getitem and m.args[1] == 0:
        m = m.args[0]
        return m.target is aten.max.dim and m.args[0] is a and last_keepdim(m, a, 1)
    return m.target is aten.amax.default and m.args[0] is a and last_keepdim(m, a, 1)


def last_keepdim(node: fx.Node, a: fx.Node, dim_at: int) -> bool:
    dims = node.args[dim_at] if len(node.args) > dim_at else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    keepdim = node.args[dim_at + 1] if len(node.args) > dim_at + 1 else node.kwargs.get("keepdim")
    ndim = len(shape(a))
    return [d % ndim for d in dims] == [ndim - 1] and bool(keepdim)


def capped(x: fx.Node) -> tuple[float, fx.Node] | None:
    """``(cap, s)`` if ``x`` is ``tanh(s / cap) * cap`` (or ``s * (1 / cap)`` inside)."""
    if x.target is not aten.mul.Tensor or constant(x.args[1]) is None:
        return None
    cap, tanh = constant(x.args[1]), x.args[0]
    if not isinstance(tanh, fx.Node) or tanh.target is not aten.tanh.default:
        return None
    inner = tanh.args[0]
    if not isinstance(inner, fx.Node) or not scales(inner) or cap <= 0:
        return None
    return (cap, inner.args[0]) if math.isclose(factor(inner), 1.0 / cap) else None


def splits_heads(x: fx.Node) -> bool:
    """``x`` views (B * H, S, T) scores as (B, H, S, T)."""
    before, after = shape(x.args[0]), shape(x)
    return (
        len(before) == 3
        and len(after) == 4
        and after[0] * after[1] == before[0]
        and (after[2:] == before[1:])
    )


aten = torch.ops.aten
_CATS = (aten.concat.default, aten.concatenate.default)
_AS = {
    aten.expand_as.default: aten.expand.default,
    aten.view_as.default: aten.reshape.default,
    aten.reshape_as.default: aten.reshape.default,
}


def fold_synonyms(gm: fx.GraphModule) -> int:
    """Rewrite each op above in its one spelling, in place; how many."""
    folded = 0
    for node in gm.graph.nodes:
        if node.target in _CATS:
            node.target, folded = aten.cat.default, folded + 1
        elif node.target in _AS:
            x, other = node.args[:2]
            node.target, node.args = _AS[node.target], (x, shape(other))
            folded += 1
