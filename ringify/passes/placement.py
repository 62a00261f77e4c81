"""Where the sequence lives in a tensor of the graph, and what that tensor's local shape is.

A tensor is either replicated (``None``: full and identical on every rank) or
``Seq(dim, inner)``: sharded along ``dim``, which holds the sequence factor,
possibly merged with other dims by a view. Element ``i`` of ``dim`` is
``(outer * length + position) * inner + j``: ``inner`` counts the elements of
dims merged *after* the sequence (e.g. heads by a ``view(B, S*H, D)``), ``outer``
those merged before it (e.g. batch by the ``view(-1, vocab)`` before a loss).
Every rank holds the same ``outer`` and ``inner`` and its own positions, so two
tensors with the same ``Seq`` line up element by element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Seq:
    dim: int
    inner: int = 1


@dataclass(frozen=True)
class Geometry:
    """The sequence of one traced graph: true length, padded length, the ring."""

    length: int
    padded: int
    ring_size: int
    layout: str

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
