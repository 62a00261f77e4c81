"""How models spell ops: the parts of attention written by hand, and ops with two spellings.

Small matchers answer whether a node is a part of hand-written attention (``handwritten.py``
reads attention with them): products of q and k (``matmul``, ``bmm``, ``einsum``), constant
scales, casts, soft caps, the row maximum a softmax is guarded by, and views of the scores
between (B * H, S, S) and (B, H, S, S).

``fold_synonyms`` rewrites ops a model may spell another way as the one spelling the rules
and folds read:

- ``concat`` and ``concatenate`` (Zamba joins its hidden states with ``torch.concatenate``)
  are ``cat``.
- Transposes spelled as their own ops (``k.mT``, ``mH`` and ``adjoint`` of a real tensor,
  ``swapaxes``, ``swapdims``, ``.T``, ``movedim``) are ``transpose`` or ``permute``: hand-
  written attention reads ``q @ k.mT`` as it reads ``q @ k.transpose(-2, -1)``, and the
  rules move the sequence through one op where it would otherwise have none.
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
from dataclasses import dataclass

import torch
from torch import fx

from ringify.passes.graph.nodes import shape, val
from ringify.passes.graph.vocabulary import (
    ANY_CAST,
    BATCHED_MATMULS,
    CAT_SYNONYMS,
    LAST_TWO_SWAPS,
    MOVEDIMS,
    SCALINGS,
    SWAPS,
    VALUE_PASSING,
    WHERES,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class Einsum:
    """A two-operand einsum that is a batched product: ``a`` (batch, ``i``, ``c``) times ``b``
    (batch, ``c``, ``j``) into (batch, ``i``, ``j``), each term's letters in any order; the
    batch (one or two letters) in the output's order."""

    a: str
    b: str
    out: str
    batch: str
    i: str
    c: str
    j: str

    @property
    def scores(self) -> bool:
        """The output is (batch, i, j) as SDPA's scores are: q's rows by k's."""
        return self.out == self.batch + self.i + self.j

    def order(self, term: str, letters: str) -> list[int] | None:
        """The permutation that lays ``term``'s dims out as ``letters`` (None: as they are)."""
        order = [term.index(x) for x in letters]
        return None if order == sorted(order) else order


def einsum(node: fx.Node) -> Einsum | None:
    """``node`` as a batched product (``Einsum``), else None. q times k is the ``scores``
    form (k's letters (batch, j, c) or (batch, c, j): k or its transpose); probabilities
    times v take p as (batch, i, c), v and the output in any order."""
    if node.target is not aten.einsum.default or len(node.args[1]) != 2:
        return None
    equation = node.args[0].replace(" ", "")
    if "." in equation or equation.count("->") != 1 or equation.count(",") != 1:
        return None
    inputs, out = equation.split("->")
    a, b = inputs.split(",")
    if any(len(set(t)) != len(t) for t in (a, b, out)):
        return None  # a diagonal
    batch = "".join(x for x in out if x in a and x in b)
    i, j = set(a) & set(out) - set(b), set(b) & set(out) - set(a)
    c = set(a) & set(b) - set(out)
    if len(batch) not in (1, 2) or not (len(i) == len(j) == len(c) == 1):
        return None
    if len(a) != len(batch) + 2 or len(b) != len(batch) + 2 or len(out) != len(batch) + 2:
        return None  # a letter summed over in one operand alone
    return Einsum(a, b, out, batch, i.pop(), c.pop(), j.pop())


def _scores_einsum(x: fx.Node) -> bool:
    e = einsum(x)
    return e is not None and e.scores


def skip_casts(x: fx.Node) -> fx.Node:
    while isinstance(x, fx.Node) and x.target in ANY_CAST:
        x = x.args[0]
    return x


def scales(x: fx.Node) -> bool:
    return x.target in SCALINGS and constant(x.args[1]) is not None


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
        if x.target in BATCHED_MATMULS or x.target is aten.baddbmm.default or _scores_einsum(x):
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
    m = m.args[0] if m.target in VALUE_PASSING else m
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
_AS = {
    aten.expand_as.default: aten.expand.default,
    aten.view_as.default: aten.reshape.default,
    aten.reshape_as.default: aten.reshape.default,
}


def _as_transpose(node: fx.Node) -> tuple | None:
    """``(target, args)`` of ``transpose``/``permute`` for a transpose spelled otherwise (a
    conjugating one of a real tensor only), else None."""
    x = node.args[0] if node.args else None
    if not isinstance(x, fx.Node) or not isinstance(val(x), torch.Tensor):
        return None
    ndim, real = val(x).dim(), not val(x).is_complex()
    if node.target in LAST_TWO_SWAPS and ndim >= 2 and (real or node.target is aten.mT.default):
        return aten.transpose.int, (x, ndim - 2, ndim - 1)
    if node.target is aten.matrix_H.default and real:
        return aten.transpose.int, (x, 0, 1)
    if node.target in SWAPS:
        return aten.transpose.int, (x, *node.args[1:3])
    if node.target is aten.numpy_T.default:
        return aten.permute.default, (x, list(reversed(range(ndim))))
    if node.target in MOVEDIMS:
        sources, targets = node.args[1:3]
        sources = [sources] if isinstance(sources, int) else sources
        targets = [targets] if isinstance(targets, int) else targets
        order = [None] * ndim
        for s, t in zip(sources, targets, strict=True):
            order[t % ndim] = s % ndim
        rest = iter(d for d in range(ndim) if d not in {s % ndim for s in sources})
        return aten.permute.default, (x, [d if d is not None else next(rest) for d in order])
    return None


def fold_synonyms(gm: fx.GraphModule) -> int:
    """Rewrite each op above in its one spelling, in place; how many."""
    folded = 0
    for node in gm.graph.nodes:
        if node.target in CAT_SYNONYMS:
            node.target, folded = aten.cat.default, folded + 1
        elif node.target in _AS:
            x, other = node.args[:2]
            node.target, node.args = _AS[node.target], (x, shape(other))
            folded += 1
        elif (spelled := _as_transpose(node)) is not None:
            (node.target, node.args), node.kwargs = spelled, {}
            folded += 1
