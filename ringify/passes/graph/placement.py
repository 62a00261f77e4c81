"""Where the sequence lives in a tensor of the graph, and every node's placement as inferred.

A tensor is either replicated (``None``: full and identical on every rank) or
``Seq(dim, inner, unit)``: sharded along ``dim``, which holds the sequence factor,
possibly merged with other dims by a view. Element ``i`` of ``dim`` is
``(outer * length / unit + position // unit) * inner + j``: ``inner`` counts the
elements of dims merged *after* the sequence (e.g. heads by a ``view(B, S*H, D)``),
``outer`` those merged before it (e.g. batch by the ``view(-1, vocab)`` before a
loss), and ``unit`` the positions an element stands for: 1, or a grid's row after a
view splits the sequence into (rows, columns), as an unpatchify does, where every
rank's shard is whole rows. Every rank holds the same ``outer`` and ``inner`` and its
own positions, so two tensors with the same ``Seq`` line up element by element. A
node with several outputs has a list of placements. ``order``: a sort whose order this
rank's elements are in instead of by position (an MoE's token dispatch, ``dispatch.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from ringify.passes.graph.nodes import is_tensor, shape, val
from ringify.passes.graph.report import GatherReason
from ringify.runtime.collectives.layout import split_multiple


@dataclass(frozen=True)
class Seq:
    dim: int
    inner: int = 1
    unit: int = 1
    order: fx.Node | None = None

    def at(self, dim: int) -> Seq:
        """The same sequence factor, moved to ``dim`` (by a transpose, a squeeze, ...)."""
        return dataclasses.replace(self, dim=dim)


Placement = Seq | list | None


@dataclass(frozen=True)
class Fallback:
    """A rule's answer when the op cannot run on shards: gather its inputs, for this reason."""

    reason: GatherReason
    detail: str = ""


@dataclass(frozen=True)
class SequenceGeometry:
    """The sequence of one traced graph: true length, padded length, the ring; ``general``:
    the padding steps are inserted whatever the length (a graph for many lengths)."""

    length: int
    padded: int
    ring_size: int
    layout: str
    general: bool = False

    @property
    def pads(self) -> bool:
        """Whether the graph pads the sequence (and masks, cuts and ignores the padding)."""
        return self.general or self.padded != self.length

    @property
    def local(self) -> int:
        return self.padded // self.ring_size

    def in_units(self, seq: Seq) -> SequenceGeometry:
        """The sequence counted in ``seq``'s units (grid rows): lengths divided by the unit."""
        if seq.unit == 1:
            return self
        u = seq.unit
        return dataclasses.replace(self, length=self.length // u, padded=self.padded // u)

    def holds_units(self, unit: int) -> bool:
        """Whether every chunk of the layout is whole units of ``unit`` positions (a grid's
        rows), so that a view into (rows, columns) keeps each rank's positions in its rows."""
        chunk = split_multiple(self.ring_size, self.layout) * unit
        return not self.general and self.length % unit == 0 and self.padded % chunk == 0

    def split(self, size: int, seq: Seq) -> tuple[int, int]:
        """``(outer, inner)`` of a dim of global ``size`` holding the sequence as ``seq``."""
        return size // (self.in_units(seq).length * seq.inner), seq.inner

    def alone(self, size: int, seq: Seq) -> bool:
        """Whether a dim of global ``size`` holds the sequence's positions and nothing else."""
        return seq.unit == 1 and self.split(size, seq) == (1, 1)

    def local_shape(self, shape, seq: Seq) -> list[int]:
        outer, inner = self.split(shape[seq.dim], seq)
        local = list(shape)
        local[seq.dim] = outer * self.in_units(seq).local * inner
        return local

    def factored_shape(self, shape, seq: Seq, length: int) -> list[int]:
        """``shape`` with ``seq.dim`` split into (outer, ``length``, inner); ``length`` counts
        ``seq``'s units."""
        outer, inner = self.split(shape[seq.dim], seq)
        return [*shape[: seq.dim], outer, length, inner, *shape[seq.dim + 1 :]]


def view_placement(in_shape, seq: Seq, out_shape, geometry: SequenceGeometry) -> Seq | Fallback:
    """Where the sequence factor lands after a view from ``in_shape`` to ``out_shape``.

    A view that splits the sequence into (rows, columns), an unpatchify, keeps it on the
    rows where every rank's shard is whole rows (``SequenceGeometry.holds_units``). Otherwise the
    positions would no longer be one block per rank along one dim: a ``Fallback``.
    """
    units = geometry.in_units(seq).length
    stride = seq.inner * math.prod(in_shape[seq.dim + 1 :])  # elements per unit
    grid = None  # a grid whose rows the chunks would cut
    for e in range(len(out_shape)):
        inner_e = math.prod(out_shape[e + 1 :])
        if units < 2 or (inner_e * out_shape[e]) % (stride * units):
            continue  # the sequence does not lie within dims e...
        if stride % inner_e == 0:
            return dataclasses.replace(seq, dim=e, inner=stride // inner_e)
        rows = inner_e // stride  # units per element of e: a row of a grid
        if inner_e % stride == 0 and rows < units and units % rows == 0:
            if geometry.holds_units(seq.unit * rows) and seq.order is None:
                return Seq(e, 1, seq.unit * rows)
            grid = grid or seq.unit * rows
    if grid is None:
        return Fallback(GatherReason.VIEW_SPLITS)
    chunk = geometry.padded // split_multiple(geometry.ring_size, geometry.layout)
    return Fallback(
        GatherReason.VIEW_SPLITS,
        f"(into rows of {grid} positions: the layout's chunks of {chunk} are not whole rows)",
    )


@dataclass
class Placements:
    """Every node's placement, as the rules infer them, and where replicated tensors meet the
    sequence (``meetings``: how inputs that never reach attention, such as labels, are found)."""

    geometry: SequenceGeometry
    of: dict[fx.Node, Placement] = field(default_factory=dict)
    meetings: list[tuple[fx.Node, Seq]] = field(default_factory=list)
    dispatches: dict = field(default_factory=dict)  # sort -> its kept ``dispatch.Dispatch``

    def __getitem__(self, node) -> Placement:
        return self.of.get(node)

    def sharded(self, node) -> bool:
        return isinstance(self.of.get(node), Seq)

    def only_sharded(self, node: fx.Node, x) -> bool:
        """``x`` is sharded and no other input of ``node`` is."""
        return self.sharded(x) and not any(
            self.sharded(a) for a in node.all_input_nodes if a is not x
        )

    def line_up(self, node: fx.Node, tensors, seq: Seq) -> Seq | Fallback:
        """``seq``, if every replicated input of ``tensors`` broadcasts along it (size 1) or
        lines up with it (the sequence's full size: recorded as a meeting)."""
        out_shape = list(val(node).shape)
        for a in tensors:
            if not is_tensor(a) or self.sharded(a):
                continue
            k = seq.dim - (len(out_shape) - len(shape(a)))
            if k >= 0 and shape(a)[k] not in (1, out_shape[seq.dim]):
                return Fallback(GatherReason.MISALIGNED)
            if k >= 0 and shape(a)[k] > 1:
                self.meetings.append((a, seq.at(k)))
        return seq


def sharded_first(infer: Callable) -> Callable:
    """An inference rule for ops whose first input carries the sequence: ``infer`` also gets
    that input's placement and rank; a replicated first input falls back."""

    @functools.wraps(infer)
    def wrapped(node, place):
        if not place.sharded(node.args[0]):
            return Fallback(GatherReason.REPLICATED_FIRST)
        return infer(node, place, place[node.args[0]], len(shape(node.args[0])))

    return wrapped
