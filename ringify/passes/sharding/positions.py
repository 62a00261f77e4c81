"""Where a region's values hold the sequence's positions, followed through its ops.

A region cut before an op that needs a dim whole hands its values back to the sequence;
each must say on which dim it holds the positions. That dim comes from the graph: from the
dims the region's inputs hold the sequence on, through what each op does with its dims
(``op_dims``), a ``cat`` or a pad that moves the positions along, a slice that cuts them,
a matmul that keeps them or contracts them away. Never from a size: a feature dim as long
as the sequence is not the sequence.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch
from torch import fx

from ringify.passes.graph.nodes import argument, is_tensor, shape, slice_bounds, val
from ringify.passes.graph.op_dims import DROPPED, kept_dim
from ringify.passes.graph.placement import Seq
from ringify.passes.graph.vocabulary import LIKE, MATMULS, NEW_TENSORS, SLICE_SCATTERS
from ringify.passes.sharding.rules import POINTWISE, rule_for

aten = torch.ops.aten

FREE = frozenset()  # a value that holds no position: reduced, selected or contracted away
# tensors made like another, none of its values read
_FRESH = LIKE | NEW_TENSORS


@dataclass(frozen=True)
class At:
    """Positions ``first`` to ``stop`` of the sequence on ``dim``, position p at index
    ``origin + p`` (every other index holds something else: a class token, padding)."""

    dim: int
    origin: int
    first: int
    stop: int

    def within(self, size: int, origin: int | None = None, dim: int | None = None) -> At | None:
        """Moved to ``origin`` and ``dim``, its positions clipped to the ``size`` indices the
        value has there; None where none is left."""
        origin = self.origin if origin is None else origin
        first, stop = max(self.first, -origin), min(self.stop, size - origin)
        return At(self.dim if dim is None else dim, origin, first, stop) if first < stop else None


def whole_sequence(at: At, sizes: list[int], length: int) -> bool:
    """Whether a value holds the whole sequence on ``at.dim``, position p at index p."""
    return sizes[at.dim] == length and (at.origin, at.first, at.stop) == (0, 0, length)


def positions_held(nodes: list[fx.Node], place) -> dict:
    """For each of ``nodes`` (a region, in graph order): the ``At`` of every dim it holds
    positions on (``FREE`` for none), a list of them for a tuple of values, or None where
    its ops cannot tell (a view that splits the dim, two values that disagree)."""
    held: dict = {}

    def of(a):
        if a in held:
            return held[a]
        if not isinstance(place.get(a), Seq):
            return FREE
        d = place.get(a).dim
        return frozenset({At(d, 0, 0, shape(a)[d])})

    for n in nodes:
        if n.target is operator.getitem:
            ats = of(n.args[0])
            held[n] = ats[n.args[1]] if isinstance(ats, list) else ats
            continue
        carried = [a for a in n.all_input_nodes if is_tensor(a) and of(a) != FREE]
        if any(of(a) is None or isinstance(of(a), list) for a in carried):
            ats = None
        elif not carried or n.target in _FRESH:
            ats = FREE
        elif n.target is aten.cat.default:
            ats = _joined(n, carried, of)
        elif n.target in SLICE_SCATTERS:
            ats = _scattered(n, of(n.args[0]), of(n.args[1]))
        elif n.target in MATMULS and len(n.args) == 2:
            ats = _multiplied(n, of(n.args[0]), of(n.args[1]))
        elif rule_for(n.target) is POINTWISE:
            ats = _merged([_aligned(n, a, of(a)) for a in carried])
        elif carried == [n.args[0]]:
            ats = _moved(n, of(n.args[0]))
        else:
            ats = None
        held[n] = [ats] * len(val(n)) if isinstance(val(n), (list, tuple)) else ats
    return held


def _merged(parts: list) -> frozenset | None:
    """The positions of a value computed from ``parts``: each dim's the same in all that
    hold positions on it."""
    if None in parts:
        return None
    ats = frozenset().union(*parts)
    return ats if len({at.dim for at in ats}) == len(ats) else None


def _aligned(n: fx.Node, a: fx.Node, ats: frozenset) -> frozenset | None:
    """A pointwise operand's positions on the result's right-aligned dims; None where it
    broadcasts along them."""
    shift = val(n).dim() - val(a).dim()
    if any(shape(a)[at.dim] != shape(n)[at.dim + shift] for at in ats):
        return None
    return frozenset(At(at.dim + shift, at.origin, at.first, at.stop) for at in ats)


def _moved(n: fx.Node, ats: frozenset) -> frozenset | None:
    """An op of its first input: a pad or slice moves positions along their dim, any other
    op keeps, moves or drops each dim as ``op_dims`` says."""
    out = val(n)[0] if isinstance(val(n), (list, tuple)) else val(n)  # cummax: (values, indices)
    moved = []
    for at in ats:
        if n.target in _ALONG_DIM:
            moved.append(_ALONG_DIM[n.target](n, at))
            continue
        d = kept_dim(n, at.dim, len(shape(n.args[0])))
        if d is None:
            return None
        if d is not DROPPED:
            moved.append(at.within(out.shape[d], dim=d))
    return None if None in moved else frozenset(moved)


def _multiplied(n: fx.Node, left: frozenset, right: frozenset) -> frozenset | None:
    """``left @ right``: the positions on the left's rows and the right's columns (and on the
    batch dims) stay; those on the contracted dim are summed away."""
    nd, sides = val(n).dim(), []
    for ats, a, kept_last in ((left, n.args[0], False), (right, n.args[1], True)):
        k = len(shape(a))
        if k < 2 and ats:
            return None
        contracted = k - (2 if kept_last else 1)
        sides.append(
            frozenset(
                At(at.dim + nd - k, at.origin, at.first, at.stop)
                for at in ats
                if at.dim != contracted
            )
        )
    return _merged(sides)


def _scattered(n: fx.Node, base: frozenset, src: frozenset) -> frozenset | None:
    """``select_scatter``/``slice_scatter``: the base's dims, each index where it was; what is
    written in must hold the same positions where they meet (a slice's moved by its start).
    Into a base that holds none (a buffer made like another), what is written says."""
    dim = argument(n, "dim") % val(n).dim()
    if n.target is aten.select_scatter.default:
        written = {At(at.dim + (at.dim >= dim), at.origin, at.first, at.stop) for at in src}
    else:
        given = list(n.args[3:6])
        start, _, step = slice(*given, *[None, None, 1][len(given) :]).indices(shape(n)[dim])
        if step != 1:
            return None
        written = {At(at.dim, at.origin + start * (at.dim == dim), at.first, at.stop) for at in src}
    if base == FREE:
        return _merged([frozenset(written)])
    into = {at.dim: at for at in base}
    for at in written:
        home = into.get(at.dim)
        if (
            home is None
            or home.origin != at.origin
            or not home.first <= at.first < at.stop <= home.stop
        ):
            return None
    return base


def _joined(cat: fx.Node, carried: list, of) -> frozenset | None:
    """A ``cat``: along its dim, the pieces that hold positions there must map them to
    indices alike and hold positions that follow on; every other dim alike in each piece."""
    dim = cat.args[1] % val(cat).dim() if len(cat.args) > 1 else 0
    others = {frozenset(at for at in of(a) if at.dim != dim) for a in carried}
    if len(others) != 1:
        return None
    pieces, offset = [], 0
    for a in cat.args[0]:
        along = [at for at in of(a) if at.dim == dim] if a in carried else []
        pieces += [at.within(shape(cat)[dim], origin=at.origin + offset) for at in along]
        offset += shape(a)[dim]
    if not pieces:
        return others.pop()
    if None in pieces or len({p.origin for p in pieces}) != 1:
        return None
    if any(a.stop != b.first for a, b in itertools.pairwise(pieces)):
        return None
    return others.pop() | {At(dim, pieces[0].origin, pieces[0].first, pieces[-1].stop)}


def _padded(node: fx.Node, at: At) -> At | None:
    """``pad``/``constant_pad_nd``: the padding in front of a dim moves its positions on (a
    negative one crops them)."""
    pads, nd = node.args[1], len(shape(node.args[0]))
    k = nd - 1 - at.dim  # pairs run from the last dim
    front = pads[2 * k] if 2 * k < len(pads) else 0
    return at.within(shape(node)[at.dim], origin=at.origin + front)


def _sliced(node: fx.Node, at: At) -> At | None:
    """A slice along a dim moves its positions back by its start and keeps those it covers
    (steps of 1 only)."""
    if argument(node, "dim") % len(shape(node.args[0])) != at.dim:
        return at
    start, _, step = slice_bounds(node, shape(node.args[0])[at.dim])
    return at.within(shape(node)[at.dim], origin=at.origin - start) if step == 1 else None


def _permuted(node: fx.Node, at: At) -> At | None:
    """``flip``/``roll`` along a dim: its indices permuted, which keeps it the sequence's dim
    where it holds every position (an exit is the sequence by index, as every op after it
    reads it); a part of the positions permuted has none of them in known places."""
    nd = len(shape(node.args[0]))
    dims = node.args[1] if node.target is aten.flip.default else argument(node, "dims")
    if at.dim not in [d % nd for d in dims] and dims:
        return at
    size = shape(node)[at.dim] if dims else None
    return at if (at.origin, at.first, at.stop) == (0, 0, size) else None


_ALONG_DIM = {
    aten.constant_pad_nd.default: _padded,
    aten.pad.default: _padded,
    aten.slice.Tensor: _sliced,
    aten.flip.default: _permuted,
    aten.roll.default: _permuted,
}
