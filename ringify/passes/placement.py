"""Where the sequence lives in a tensor of the graph, and every node's placement as inferred.

A tensor is either replicated (``None``: full and identical on every rank) or
``Seq(dim, inner)``: sharded along ``dim``, which holds the sequence factor,
possibly merged with other dims by a view. Element ``i`` of ``dim`` is
``(outer * length + position) * inner + j``: ``inner`` counts the elements of
dims merged *after* the sequence (e.g. heads by a ``view(B, S*H, D)``), ``outer``
those merged before it (e.g. batch by the ``view(-1, vocab)`` before a loss).
Every rank holds the same ``outer`` and ``inner`` and its own positions, so two
tensors with the same ``Seq`` line up element by element. A node with several
outputs has a list of placements.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from ringify.passes.nodes import is_tensor, shape, val
from ringify.passes.report import GatherReason


@dataclass(frozen=True)
class Seq:
    dim: int
    inner: int = 1


Placement = Seq | list | None


@dataclass(frozen=True)
class Fallback:
    """A rule's answer when the op cannot run on shards: gather its inputs, for this reason."""

    reason: GatherReason
    detail: str = ""


@dataclass(frozen=True)
class Geometry:
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

    def split(self, size: int, seq: Seq) -> tuple[int, int]:
        """``(outer, inner)`` of a dim of global ``size`` holding the sequence as ``seq``."""
        return size // (self.length * seq.inner), seq.inner

    def local_shape(self, shape, seq: Seq) -> list[int]:
        outer, inner = self.split(shape[seq.dim], seq)
        local = list(shape)
        local[seq.dim] = outer * self.local * inner
        return local

    def factored_shape(self, shape, seq: Seq, length: int) -> list[int]:
        """``shape`` with ``seq.dim`` split into (outer, ``length``, inner)."""
        outer, inner = self.split(shape[seq.dim], seq)
        return [*shape[: seq.dim], outer, length, inner, *shape[seq.dim + 1 :]]


def view_placement(in_shape, seq: Seq, out_shape, length: int) -> Seq | None:
    """Where the sequence factor lands after a view from ``in_shape`` to ``out_shape``.

    ``None`` if the view splits the sequence factor across dims (the positions
    would no longer be one block per rank).
    """
    stride = seq.inner * math.prod(in_shape[seq.dim + 1 :])  # elements per position
    for e in range(len(out_shape)):
        inner_e = math.prod(out_shape[e + 1 :])
        span = inner_e * out_shape[e]
        if stride % inner_e == 0 and span % (stride * length) == 0 and length > 1:
            return Seq(e, stride // inner_e)
    return None


@dataclass
class Placements:
    """Every node's placement, as the rules infer them, and where replicated tensors meet the
    sequence (``meetings``: how inputs that never reach attention, such as labels, are found)."""

    geometry: Geometry
    of: dict[fx.Node, Placement] = field(default_factory=dict)
    meetings: list[tuple[fx.Node, Seq]] = field(default_factory=list)

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
                self.meetings.append((a, Seq(k, seq.inner)))
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
