"""Rules of the ops along the sequence that read their neighbours: shifts, convolutions that
keep the length, running sums and Mamba-1's selective scan (each folded into one node by
``folds/``: ``shifts.py``, ``convs.py``, ``scans.py``). Along the sharded sequence each
exchanges a halo or a carry with the ranks beside it (``ring_shift``, ``ring_conv1d``,
``ring_cumsum``, ``ring_selective_scan``), never a gather; along another dim it is local."""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.graph.crossings import PassState, Rule
from ringify.passes.graph.nodes import norm_dim, shape
from ringify.passes.graph.placement import Fallback, Seq, sharded_first
from ringify.passes.graph.report import GatherReason
from ringify.runtime.collectives.layout import chunks_per_rank
from ringify.runtime.collectives.neighbours import (
    ring_conv1d,
    ring_cumsum,
    ring_shift,
    same_conv1d,
    shifted,
)
from ringify.runtime.selective_scan import ring_selective_scan, selective_scan

aten = torch.ops.aten


@sharded_first
def infer_shift(node, place, p: Seq, ndim: int):
    x, dim, shift, fill = node.args
    sharded_fill = isinstance(fill, fx.Node) and place.sharded(fill)
    if norm_dim(dim, ndim) != p.dim:  # along another dim (e.g. rotate_half): local
        return Fallback(GatherReason.MIXED_DIMS) if sharded_fill and place[fill] != p else p
    if sharded_fill:  # a start token that is itself sharded along the sequence
        return Fallback(GatherReason.MIXED_DIMS)
    geometry = place.geometry
    if not geometry.alone(shape(x)[p.dim], p):
        return Fallback(GatherReason.ALONG_SEQUENCE, "(the sequence dim also holds other dims)")
    if abs(shift) > geometry.local // chunks_per_rank(geometry.layout):
        return Fallback(GatherReason.ALONG_SEQUENCE, f"(a shift by {shift}: more than a chunk)")
    return p


def rewrite_shift(node: fx.Node, out: Seq, state: PassState) -> None:
    """Along the sequence: the halo exchange; along another dim: local as it is."""
    x, dim, shift, fill = node.args
    if norm_dim(dim, len(shape(x))) != out.dim:
        state.fit_replicated_inputs(node, out)
        return
    geo = state.geo
    node.target = ring_shift
    node.args = (x, dim, shift, fill, geo.padded, geo.length, state.group_name, geo.layout)


@sharded_first
def infer_conv(node, place, p: Seq, ndim: int):
    """Along the sequence: a halo each side; along the batch: local."""
    x, weight, bias = node.args[:3]
    if any(place.sharded(w) for w in (weight, bias)):
        return Fallback(GatherReason.PRODUCT, "(a sharded kernel)")
    if p.dim == 0:
        return p
    geometry = place.geometry
    if p.dim != ndim - 1 or not geometry.alone(shape(x)[p.dim], p):
        return Fallback(GatherReason.FEATURE_DIM)
    return p


def rewrite_conv(node: fx.Node, out: Seq, state: PassState) -> None:
    """Along the sequence: the halo exchange; the kernel used whole on every rank."""
    state.fit_replicated_inputs(node, None)
    if out.dim == 0:
        return
    geo = state.geo
    node.target = ring_conv1d
    node.args = (*node.args, geo.padded, geo.length, state.group_name, geo.layout)


@sharded_first
def infer_cumsum(node, place, p: Seq, ndim: int):
    """A running sum: local off the sequence, a scan over the ring along it."""
    if norm_dim(node.args[1], ndim) != p.dim:
        return p
    if not place.geometry.alone(shape(node.args[0])[p.dim], p):
        return Fallback(GatherReason.ALONG_SEQUENCE, "(the sequence dim also holds other dims)")
    return p


def rewrite_cumsum(node, out: Seq, state: PassState) -> None:
    x, dim = node.args[:2]
    if norm_dim(dim, len(shape(x))) == out.dim:
        node.target = ring_cumsum
        node.args = (x, dim, state.group_name, state.geo.layout)


@sharded_first
def infer_selective_scan(node, place, p: Seq, ndim: int):
    """Along the sequence (a and b on dim 2, c on dim 1): state passing over the ring."""
    a, b, c = node.args[:3]
    if (place[a], place[b], place[c]) != (Seq(2), Seq(2), Seq(1)):
        return Fallback(GatherReason.ALONG_SEQUENCE, "(a scan's inputs sharded off its sequence)")
    if not place.geometry.alone(shape(a)[2], p):
        return Fallback(GatherReason.ALONG_SEQUENCE, "(the sequence dim also holds other dims)")
    return Seq(2)


def rewrite_selective_scan(node: fx.Node, out: Seq, state: PassState) -> None:
    geo = state.geo
    node.target = ring_selective_scan
    node.args = (*node.args, geo.padded, geo.length, state.group_name, geo.layout)


RULES = {
    shifted: Rule(infer_shift, rewrite_shift),
    same_conv1d: Rule(infer_conv, rewrite_conv),
    aten.cumsum.default: Rule(infer_cumsum, rewrite_cumsum),
    selective_scan: Rule(infer_selective_scan, rewrite_selective_scan),
}
