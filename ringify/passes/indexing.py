"""Indexing rules: select, slice, split, chunk, unbind, advanced indexing, index_select, gather.

Off the sequence dim each is local to the rank (replicated indices are used
whole, or sliced where they line up with the sequence); along it, it falls back.
"""

from __future__ import annotations

import torch

from ringify.passes.nodes import norm_dim, shape, val
from ringify.passes.placement import Fallback, Seq, sharded_first
from ringify.passes.report import GatherReason

aten = torch.ops.aten

# op -> position of its dim argument (and its default)
INDEXING = {
    aten.select.int: 1, aten.slice.Tensor: 1, aten.unbind.int: 1,
    aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.chunk.default: 2,
}  # fmt: skip


@sharded_first
def infer_indexing(node, place, p: Seq, ndim: int):
    """select / slice / unbind / split / chunk: local unless along the sequence."""
    t, pos = node.target, INDEXING[node.target]
    k = norm_dim(node.args[pos] if len(node.args) > pos else 0, ndim)
    out = val(node)
    if k == p.dim:
        if t is aten.slice.Tensor and list(out.shape) == shape(node.args[0]):
            return p  # the whole sequence: the end index clamps to the local length
        return Fallback(GatherReason.ALONG_SEQUENCE)
    if t is aten.select.int or t is aten.unbind.int:
        seq = Seq(p.dim - (k < p.dim), p.inner)
        return seq if t is aten.select.int else [seq] * len(out)
    return p if t is aten.slice.Tensor else [p] * len(out)


@sharded_first
def infer_index(node, place, p: Seq, ndim: int):
    """``x[..., idx, ...]`` with replicated index tensors on dims other than the sequence."""
    indices = node.args[1]
    picked = [i for i, t in enumerate(indices) if t is not None]
    if p.dim in picked:
        return Fallback(GatherReason.ALONG_SEQUENCE)
    if any(place.sharded(t) for t in indices if t is not None):
        return Fallback(GatherReason.MIXED_DIMS)
    index_ndim = len(torch.broadcast_shapes(*(tuple(shape(indices[i])) for i in picked)))
    before = sum(i < p.dim for i in picked)
    if picked == list(range(picked[0], picked[-1] + 1)):  # adjacent: results stay in place
        return Seq(p.dim if p.dim < picked[0] else p.dim - len(picked) + index_ndim, p.inner)
    return Seq(index_ndim + p.dim - before, p.inner)  # apart: the indexed dims go first


@sharded_first
def infer_index_select(node, place, p: Seq, ndim: int):
    dim, index = node.args[1:3]
    if norm_dim(dim, ndim) == p.dim:
        return Fallback(GatherReason.ALONG_SEQUENCE)
    return p if not place.sharded(index) else Fallback(GatherReason.MIXED_DIMS)


@sharded_first
def infer_gather(node, place, p: Seq, ndim: int):
    """``torch.gather`` along another dim: the index has a row per position (sharded alike,
    or replicated at the full length, then sliced)."""
    x, dim, index = node.args[:3]
    if norm_dim(dim, ndim) == p.dim:
        return Fallback(GatherReason.ALONG_SEQUENCE)
    if place.sharded(index):
        return p if place[index] == p else Fallback(GatherReason.MIXED_DIMS)
    return p if shape(index)[p.dim] == shape(x)[p.dim] else Fallback(GatherReason.MISALIGNED)
