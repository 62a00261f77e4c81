"""Crossings between replicated and sharded tensors, and the state the rewrite shares.

- ``slice``: this rank's part of a replicated tensor that meets the sequence
  (``take_shard``, whose backward gathers its gradient); padded if the ring needs it.
- ``gather``: the full tensor from every rank's part, for an op with no local rule.
- ``copy_to_ring``: a replicated tensor a sharded computation uses whole (a weight,
  a broadcast operand); identity forward, its partial gradients summed backward.
- ``to_dim`` / ``from_dim``: between the sequence and a share of another dim, for a region
  that needs the whole sequence (``resharded.py``); ``share`` and ``gather_dim`` within it.

Each crossing is inserted once per (tensor, kind) and reused. Inserted nodes carry
the *global* value of the tensor they stand for, like every node of the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from ringify.config import Auto
from ringify.passes.graph.nodes import is_tensor, shape, val
from ringify.passes.graph.placement import Fallback, Placement, Placements, Seq, SequenceGeometry
from ringify.passes.graph.report import InsertedGather, ReportedAttention, ReshardedRegion
from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.collectives.heads import Transport
from ringify.runtime.collectives.reduce import copy_to_ring
from ringify.runtime.collectives.reshard import from_dim_op, to_dim_op

ringify_ops = torch.ops.ringify


class PassState:
    """One run of the rewrite: the graph, its sequence, the ring, every node's placement, and
    the report's rows as they are filled."""

    def __init__(
        self,
        graph: fx.Graph,
        geometry: SequenceGeometry,
        group_name: str,
        place: dict[fx.Node, Placement],
        dilation: Dilation | None = None,
        strategy: Transport | Auto | None = None,
    ):
        self.graph, self.geo, self.group_name, self.place = graph, geometry, group_name, place
        self.dilation = dilation  # every attention becomes dilated attention
        self.strategy = strategy  # ``Config.transports`` (None: the ring)
        self.attentions: list[ReportedAttention] = []
        self.gathers: list[InsertedGather] = []
        self.resharded: list[ReshardedRegion] = []
        # a region's value gathered on its dim -> (the value, the dim): read back into the
        # sequence by one all-to-all instead of the gather
        self.on_dim: dict[fx.Node, tuple[fx.Node, int]] = {}
        # inserted nodes (and a program's whole inputs) by what made them
        self._cache: dict[tuple, object] = {}

    def sharded(self, node) -> bool:
        return isinstance(self.place.get(node), Seq)

    def after(self, node: fx.Node) -> fx.Node:
        """Where nodes computed from ``node`` go: right after it (after all the inputs)."""
        if node.op == "placeholder":
            return [n for n in self.graph.nodes if n.op == "placeholder"][-1].next
        return node.next

    def local_shape(self, node: fx.Node, seq: Seq) -> list[int]:
        return self.geo.local_shape(shape(node), seq)

    def slice(self, x: fx.Node, seq: Seq, pad_value) -> fx.Node:
        """This rank's part of replicated ``x`` (sequence at ``seq``), padded if the ring needs it."""
        key = ("slice", x, seq, pad_value)
        if key in self._cache:
            return self._cache[key]
        if x in self.on_dim and self.geo.alone(shape(x)[seq.dim], seq):
            self._cache[key] = y = self.from_dim(*self.on_dim[x], seq, pad_value)
            return y
        g, geo, units = self.graph, self.geo, self.geo.in_units(seq)
        fill = _filled_with(x)
        if fill is not None and (fill == pad_value or not geo.pads):
            # a fresh tensor (an MoE's ``zeros`` base): made at this rank's size, never whole
            with g.inserting_before(self.after(x)):
                y = g.call_function(x.target, (self.local_shape(x, seq), *x.args[1:]), x.kwargs)
            y.meta["val"] = val(x)
            self.place[y] = seq
            self._cache[key] = y
            return y
        with g.inserting_before(self.after(x)):
            factored = geo.factored_shape(shape(x), seq, units.length)
            y = g.call_function(torch.ops.aten.reshape.default, (x, factored))
            pad = units.padded - units.length
            if geo.pads:
                spec = [0, 0] * (len(factored) - seq.dim - 2) + [0, pad]
                y = g.call_function(torch.ops.aten.constant_pad_nd.default, (y, spec, pad_value))
            y = g.call_function(
                ringify_ops.take_shard.default, (y, seq.dim + 1, self.group_name, geo.layout)
            )
            y = g.call_function(torch.ops.aten.reshape.default, (y, self.local_shape(x, seq)))
        y.meta["val"] = val(x)
        self.place[y] = seq
        self._cache[key] = y
        return y

    def gather(self, x: fx.Node) -> fx.Node:
        """The full (replicated) tensor from every rank's part of sharded ``x``."""
        key = ("gather", x)
        if key in self._cache:
            return self._cache[key]
        g, geo, seq = self.graph, self.geo, self.place[x]
        units = geo.in_units(seq)
        # the sequence as a dim of its own: already one where nothing shares its dim (no
        # reshapes, whose view-or-copy would depend on the length under a dynamic length)
        alone = geo.split(shape(x)[seq.dim], seq) == (1, 1)
        dim = seq.dim if alone else seq.dim + 1
        with g.inserting_before(self.after(x)):
            y = x
            if not alone:
                factored = geo.factored_shape(shape(x), seq, units.local)
                y = g.call_function(torch.ops.aten.reshape.default, (x, factored))
            trimmed = units.length if geo.pads else -1  # the padding cut off by the op itself
            args = (y, dim, self.group_name, geo.layout, trimmed)
            y = g.call_function(ringify_ops.gather.default, args)
            if not alone:
                y = g.call_function(torch.ops.aten.reshape.default, (y, shape(x)))
            y = self._in_memory_order_of(x, y)
        y.meta["val"] = val(x)
        self.place[y] = None
        self._cache[key] = y
        return y

    def to_dim(self, x: fx.Node, dim: int) -> fx.Node:
        """Every position of this rank's share of ``dim``, from sharded ``x`` (all-to-all)."""
        key = ("to_dim", x, dim)
        if key not in self._cache:
            args = (x, self.place[x].dim, dim, self.group_name, self.geo.layout, self.geo.length)
            self._cache[key] = self._inserted(x, to_dim_op._opoverload, args, x)
        return self._cache[key]

    def from_dim(self, x: fx.Node, dim: int, seq: Seq, pad_value=0) -> fx.Node:
        """This rank's positions of all of ``dim``, from its share ``x`` (all-to-all)."""
        geo = self.geo
        args = (x, seq.dim, dim, self.group_name, geo.layout, geo.padded, float(pad_value))
        y = self._inserted(x, from_dim_op._opoverload, args, x)
        self.place[y] = seq
        return y

    def share(self, x: fx.Node, dim: int) -> fx.Node:
        """This rank's share of ``dim`` of whole ``x`` (a per-head weight, say)."""
        key = ("share", x, dim)
        if key not in self._cache:
            args = (x, dim, self.group_name, "contiguous")
            self._cache[key] = self._inserted(x, ringify_ops.take_shard.default, args, x)
        return self._cache[key]

    def gather_dim(self, x: fx.Node, dim: int) -> fx.Node:
        """Whole ``x`` from every rank's share of ``dim``; read back into the sequence by
        ``slice``, as the all-to-all."""
        key = ("gather_dim", x, dim)
        if key not in self._cache:
            args = (x, dim, self.group_name, "contiguous", -1)
            self._cache[key] = y = self._inserted(x, ringify_ops.gather.default, args, x)
            self.place[y] = None
            self.on_dim[y] = (x, dim)
        return self._cache[key]

    def _inserted(self, after: fx.Node, target, args: tuple, like: fx.Node) -> fx.Node:
        """``target(*args)`` right after ``after``, standing for ``like``'s global value."""
        with self.graph.inserting_before(self.after(after)):
            y = self.graph.call_function(target, args)
        y.meta["val"] = val(like)
        return y

    def _in_memory_order_of(self, x: fx.Node, y: fx.Node) -> fx.Node:
        """``y`` (contiguous) laid out in memory as ``x`` was traced: a later ``view`` of it
        was traced on ``x``'s strides (an SDPA kernel's output keeps its q's dim order)."""
        traced = val(x)
        if not isinstance(traced, torch.Tensor) or traced.is_contiguous():
            return y
        strides = traced.stride()
        order = sorted(range(traced.dim()), key=lambda d: -strides[d])  # outermost first
        back = [order.index(d) for d in range(traced.dim())]
        g = self.graph
        y = g.call_function(torch.ops.aten.permute.default, (y, order))
        y.meta["val"] = traced.permute(order)  # global values, as every inserted node's
        y = g.call_function(
            torch.ops.aten.clone.default, (y,), {"memory_format": torch.contiguous_format}
        )
        y.meta["val"] = traced.permute(order).contiguous()
        return g.call_function(torch.ops.aten.permute.default, (y, back))

    def copy_to_ring(self, x: fx.Node) -> fx.Node:
        key = ("copy", x)
        if key not in self._cache:
            with self.graph.inserting_before(self.after(x)):
                y = self.graph.call_function(copy_to_ring, (x, self.group_name))
            y.meta["val"] = val(x)
            self.place[y] = None
            self._cache[key] = y
        return self._cache[key]

    def fit_replicated_inputs(self, node: fx.Node, seq: Seq | None, aligned=None) -> None:
        """Slice replicated inputs that broadcast against the sequence of ``node``'s output
        (all of them, or those in ``aligned``); route the rest through ``copy_to_ring``
        (their gradient from this rank is partial)."""
        out = val(node)
        out_ndim = out.dim() if isinstance(out, torch.Tensor) else None
        for a in list(node.all_input_nodes):
            if self.sharded(a) or not is_tensor(a):
                continue
            k = None
            if seq is not None and out_ndim is not None and (aligned is None or a in aligned):
                k = seq.dim - (out_ndim - len(shape(a)))
            if k is not None and k >= 0 and shape(a)[k] == out.shape[seq.dim] > 1:
                node.replace_input_with(a, self.slice(a, seq.at(k), 0))
            elif val(a).is_floating_point():
                node.replace_input_with(a, self.copy_to_ring(a))

    def replace(self, node: fx.Node, result: fx.Node, out: Placement) -> None:
        """``result`` in place of ``node``, with its value and placement, so that the rules of
        its users see it as they saw ``node`` (a replicated maximum meeting the sequence is
        copied to the ring, and its gradient summed)."""
        result.meta["val"] = val(node)
        self.place[result] = out
        node.replace_all_uses_with(result)
        self.graph.erase_node(node)

    def fall_back(self, node: fx.Node, fallback: Fallback) -> None:
        """Gather ``node``'s sharded inputs: it runs replicated. Reported."""
        for a in list(node.all_input_nodes):
            if self.sharded(a):
                node.replace_input_with(a, self.gather(a))
        out = val(node)
        self.place[node] = [None] * len(out) if isinstance(out, (list, tuple)) else None
        self.report_gather(node, fallback)

    def report_gather(self, node: fx.Node, fallback: Fallback) -> None:
        self.gathers.append(
            InsertedGather(node.name, str(node.target), fallback.reason, fallback.detail)
        )


def _filled_with(x: fx.Node):
    """The value a factory of a fresh tensor fills it with (``zeros``, ``ones``, ``full``);
    ``None``: not one."""
    fills = {torch.ops.aten.zeros.default: 0, torch.ops.aten.ones.default: 1}
    if x.target in fills:
        return fills[x.target]
    return x.args[1] if x.target is torch.ops.aten.full.default else None


Infer = Callable[[fx.Node, Placements], "Placement | Fallback"]
Rewrite = Callable[[fx.Node, Placement, PassState], None]


@dataclass(frozen=True)
class Rule:
    """An op's sequence-sharding rule, its two halves side by side (as torch's
    context-parallel rules and DTensor's op strategies hold them): ``infer`` gives the
    placement of the op's output(s) from its inputs' (``placement.py``), or a ``Fallback``
    with the reason it cannot run on shards; ``rewrite`` makes each rank compute exactly
    its part. Each family of ops keeps its rules beside it, in a ``RULES`` table
    (``sharding/rules.py`` joins them)."""

    infer: Infer
    rewrite: Rewrite


def fit_broadcast(node, out, state: PassState) -> None:
    """Replicated operands that line up with the sequence are sliced, the rest copied."""
    state.fit_replicated_inputs(node, out if isinstance(out, Seq) else None)


def fit_whole(node, out, state: PassState) -> None:
    """Replicated operands (weights, tables) are used whole by every position."""
    state.fit_replicated_inputs(node, None)


def as_it_is(node, out, state: PassState) -> None:
    """Nothing to rewrite: the op computes this rank's part from its inputs' parts."""
