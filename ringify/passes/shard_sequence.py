"""The pass: shard the sequence dimension of a whole ATen graph over a ring.

Every tensor of the graph is replicated or sequence-sharded (``placement.py``).
Walking the graph in order, each node gets a placement from its inputs' and is
rewritten so that each rank computes exactly its part:

- per-position ops (pointwise, linear/matmul on other dims, norms over features,
  embeddings, views that keep the sequence whole, transposes) stay local, with
  their size arguments rewritten to local sizes;
- a replicated tensor that meets a sharded one along the sequence is sliced
  (``take_shard``, whose backward gathers its gradient); one it is broadcast
  against, or a weight, goes through ``copy_to_ring``, whose backward sums the
  ranks' partial gradients;
- attention becomes ``ringify::ring_attention``; a positions-only causal mask
  becomes ``is_causal=True``, any other mask is kept, its rows sliced;
- reductions over the sequence (sums, means, cross-entropy) reduce locally and
  sum over the ring (``reduce_from_ring``);
- any other op with a sharded input has those inputs gathered and runs
  replicated: always exact, and reported (``Rewrite.gathers``).

A sequence the ring cannot split evenly is padded at the end: causal attention
never looks at the padding, otherwise the op cuts the padded keys off
(``key_len``); reductions mask it out, cross-entropy targets are padded with
``ignore_index``, and gathers drop it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from ringify.passes.attention import ATTENTION_OPS, read_attention
from ringify.passes.causal_mask import is_causal_mask
from ringify.passes.placement import Geometry, Seq, view_placement
from ringify.runtime.block_attention import accumulation_dtype
from ringify.runtime.dilated_ring_attention import check_dilation
from ringify.runtime.dilation import Dilation
from ringify.runtime.ring_reduce import copy_to_ring, reduce_from_ring
from ringify.runtime.tiles import tiles_per_chunk

aten = torch.ops.aten
ringify_ops = torch.ops.ringify

_SAME_SHAPE = {
    aten.dropout.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten.to.other,
    aten.type_as.default,
    aten.lift_fresh_copy.default,
}
_VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unflatten.int,
    aten.flatten.using_ints,
}
# ops that keep every dim where it is, as far as finding an input's sequence dim goes
_SEQUENCE_PRESERVING = {aten.slice.Tensor, aten.constant_pad_nd.default, aten.pad.default}
_REDUCTIONS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}
# loss op -> positions of (reduction, ignore_index) in its arguments, and their defaults
_LOSSES = {aten.cross_entropy_loss.default: (3, 4), aten.nll_loss.default: (3, 4)}
_MEAN, _SUM, _NONE = 1, 2, 0


@dataclass(frozen=True)
class Fallback:
    reason: str


@dataclass
class RewrittenAttention:
    node: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    mask: str
    layout: str
    bytes_per_step: int


@dataclass
class InsertedGather:
    node: str
    op: str
    reason: str


@dataclass
class Rewrite:
    attentions: list[RewrittenAttention] = field(default_factory=list)
    gathers: list[InsertedGather] = field(default_factory=list)


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_tensor(node) -> bool:
    return isinstance(_val(node), torch.Tensor)


def _shape(node) -> list[int]:
    return list(_val(node).shape)


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


class ShardSequence:
    """One run of the pass over ``graph`` (``probe=True``: placements only, no rewrite)."""

    def __init__(
        self,
        graph: fx.Graph,
        geometry: Geometry,
        group_name: str,
        seeds: dict[fx.Node, Seq],
        *,
        inputs_full: bool = True,
        outputs_full: bool = True,
        probe: bool = False,
        dilation: Dilation | None = None,
    ):
        self.graph, self.geo, self.group = graph, geometry, group_name
        self.dilation = dilation
        self.seeds, self.inputs_full, self.outputs_full = seeds, inputs_full, outputs_full
        self.probe = probe
        self.place: dict[fx.Node, object] = {}
        # (replicated node, where the sequence would sit in it) wherever one meets the
        # sharded sequence: how inputs that never reach attention (labels) are found
        self.meetings: list[tuple[fx.Node, Seq]] = []
        self.result = Rewrite()
        self._cache: dict[tuple, fx.Node] = {}

    # ---- driver -------------------------------------------------------------------------

    def run(self) -> Rewrite:
        for node in list(self.graph.nodes):
            if getattr(node, "_erased", False):  # an attention kernel's outputs, already replaced
                continue
            if node.op == "placeholder":
                self._enter(node)
            elif node.op == "call_function":
                self._visit(node)
            elif node.op == "output" and not self.probe:
                self._exit(node)
        if not self.probe:
            self.graph.eliminate_dead_code()
            self.graph.lint()
        return self.result

    def _sharded(self, node) -> bool:
        return isinstance(self.place.get(node), Seq)

    def _enter(self, node: fx.Node) -> None:
        seq = self.seeds.get(node)
        self.place[node] = seq
        if seq is None or self.probe or not self.inputs_full:
            return
        users = list(node.users)
        local = self._slice(node, seq, 0)
        for user in users:
            user.replace_input_with(node, local)

    def _exit(self, node: fx.Node) -> None:
        def full(arg):
            if self._sharded(arg) and self.outputs_full:
                return self._gather(arg)
            return arg

        node.args = fx.node.map_arg(node.args, full)

    def _visit(self, node: fx.Node) -> None:
        def carries_sequence(a):
            p = self.place.get(a)
            return isinstance(p, Seq) or (isinstance(p, list) and any(p))

        if not any(carries_sequence(a) for a in node.all_input_nodes):
            self.place[node] = None
            return
        if node.target is operator.getitem:
            outs = self.place[node.args[0]]
            self.place[node] = outs[node.args[1]] if isinstance(outs, list) else None
            return
        try:
            decision = self._infer(node)
        except (IndexError, KeyError, TypeError, ValueError) as e:
            decision = Fallback(f"could not read its arguments ({e})")
        if self.probe:
            self.place[node] = None if isinstance(decision, Fallback) else decision
            return
        if isinstance(decision, Fallback):
            self._fall_back(node, decision.reason)
            return
        self.place[node] = decision
        self._rewrite(node, decision)

    # ---- placements ---------------------------------------------------------------------

    def _infer(self, node: fx.Node):
        """The placement of ``node``'s output(s), or a ``Fallback`` with the reason."""
        t, args = node.target, node.args
        out = _val(node)
        if t in ATTENTION_OPS:
            return self._infer_attention(node)
        if t is aten._assert_tensor_metadata.default:
            return None
        if t in _SAME_SHAPE or (
            isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
        ):
            return self._broadcast(node)
        x = args[0] if args else None
        p = self.place.get(x)
        if t in (aten.linear.default, aten.layer_norm.default, aten.rms_norm.default):
            features = 1 if t is aten.linear.default else len(args[1])
            if self._only_sharded(node, x) and p.dim < len(_shape(x)) - features:
                return p
            return Fallback("the sequence is a feature dim")
        if t in (aten.mm.default, aten.matmul.default, aten.bmm.default):
            if self._only_sharded(node, x) and p.dim < len(_shape(x)) - 1:
                return Seq(p.dim + out.dim() - len(_shape(x)), p.inner)
            return Fallback("a product over the sequence")
        if t is aten.addmm.default:
            if (
                self._sharded(args[1])
                and not self._sharded(args[2])
                and self.place[args[1]].dim == 0
            ):
                return self._check_broadcast(node, [args[0]], self.place[args[1]])
            return Fallback("a product over the sequence")
        if t is aten.cat.default:
            return self._infer_cat(node)
        if t is aten.embedding.default:
            idx = self.place.get(args[1])
            return (
                idx
                if idx is not None and not self._sharded(args[0])
                else Fallback("the embedding table is sharded")
            )
        if not isinstance(p, Seq):
            return Fallback("its first input is replicated but another is sharded")
        ndim = len(_shape(x))
        if t in _VIEWS:
            seq = view_placement(_shape(x), p, list(out.shape), self.geo.length)
            return seq or Fallback("the view splits the sequence across dims")
        if t is aten.transpose.int:
            a, b = (_norm(d, ndim) for d in args[1:3])
            return Seq({a: b, b: a}.get(p.dim, p.dim), p.inner)
        if t is aten.t.default:
            return Seq(ndim - 1 - p.dim, p.inner)
        if t is aten.permute.default:
            return Seq([_norm(d, ndim) for d in args[1]].index(p.dim), p.inner)
        if t is aten.unsqueeze.default:
            k = _norm(args[1], ndim + 1)
            return Seq(p.dim + (k <= p.dim), p.inner)
        if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            named = range(ndim) if t is aten.squeeze.default else self._dims(args[1], ndim)
            dropped = [d for d in named if _shape(x)[d] == 1]
            return Seq(p.dim - sum(d < p.dim for d in dropped), p.inner)
        if t is aten.expand.default:
            return Seq(p.dim + out.dim() - ndim, p.inner)
        if t in (aten.select.int, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
                 aten.chunk.default, aten.unbind.int):  # fmt: skip
            k = _norm(args[1] if len(args) > 1 else 0, ndim)
            if (
                t is aten.split.Tensor
                or t is aten.split_with_sizes.default
                or t is aten.chunk.default
            ):
                k = _norm(args[2] if len(args) > 2 else 0, ndim)
            if k == p.dim:
                if t is aten.slice.Tensor and list(out.shape) == _shape(x):
                    return p  # the whole sequence: the end index clamps to the local length
                return Fallback("it indexes or splits along the sequence")
            if t is aten.select.int or t is aten.unbind.int:
                seq = Seq(p.dim - (k < p.dim), p.inner)
                return seq if t is aten.select.int else [seq] * len(out)
            return p if t is aten.slice.Tensor else [p] * len(out)
        if t in _REDUCTIONS:
            dims = self._reduced_dims(node, ndim)
            if p.dim in dims:
                return None
            keep = len(args) > 2 and args[2]
            return Seq(p.dim if keep else p.dim - sum(d < p.dim for d in dims), p.inner)
        if t in _LOSSES:
            return self._infer_loss(node)
        return Fallback(f"no sequence-sharding rule for {t}")

    def _infer_cat(self, node: fx.Node):
        tensors = node.args[0]
        placements = {self.place[a] for a in tensors if self._sharded(a)}
        if len(placements) != 1:
            return Fallback("its inputs are sharded along different dims")
        seq = placements.pop()
        ndim = len(_shape(tensors[0]))
        if _norm(node.args[1] if len(node.args) > 1 else 0, ndim) == seq.dim:
            return Fallback("it concatenates along the sequence")
        return self._check_broadcast(node, tensors, seq)

    def _dims(self, dims, ndim: int) -> list[int]:
        dims = [dims] if isinstance(dims, int) else list(dims)
        return [_norm(d, ndim) for d in dims]

    def _reduced_dims(self, node, ndim: int) -> list[int]:
        if node.target in (aten.sum.default, aten.mean.default) or not node.args[1]:
            return list(range(ndim))
        return self._dims(node.args[1], ndim)

    def _only_sharded(self, node, x) -> bool:
        return self._sharded(x) and not any(
            self._sharded(a) for a in node.all_input_nodes if a is not x
        )

    def _broadcast(self, node: fx.Node):
        tensors = [a for a in node.all_input_nodes if _is_tensor(a)]
        out_ndim = _val(node).dim()
        aligned = {
            Seq(self.place[a].dim + out_ndim - len(_shape(a)), self.place[a].inner)
            for a in tensors
            if self._sharded(a)
        }
        if len(aligned) != 1:
            return Fallback("its inputs are sharded along different dims")
        return self._check_broadcast(node, tensors, aligned.pop())

    def _check_broadcast(self, node, tensors, seq: Seq):
        out_shape = list(_val(node).shape)
        for a in tensors:
            if not _is_tensor(a) or self._sharded(a):
                continue
            k = seq.dim - (len(out_shape) - len(_shape(a)))
            if k >= 0 and _shape(a)[k] not in (1, out_shape[seq.dim]):
                return Fallback("a replicated input does not line up with the sequence")
            if k >= 0 and _shape(a)[k] > 1:
                self.meetings.append((a, Seq(k, seq.inner)))
        return seq

    def _infer_attention(self, node):
        att = read_attention(node)
        for x in (att.q, att.k, att.v):
            if self.place.get(x) != Seq(2) or len(_shape(x)) != 4:
                return Fallback("q, k and v are not all sharded along their sequence dim (-2)")
        if _shape(att.q)[2] != _shape(att.k)[2]:
            return Fallback("cross-attention (q and k of different lengths) is not supported")
        return [Seq(2), Seq(2)] + [None] * (len(_val(node)) - 2) if att.returns_tuple else Seq(2)

    def _infer_loss(self, node):
        x, target = node.args[:2]
        p = self.place.get(x)
        if not isinstance(p, Seq) or p.dim != 0 or len(_shape(x)) != 2 or len(_shape(target)) != 1:
            return Fallback("only (N, C) inputs sharded along N are reduced locally")
        if self._sharded(target) and self.place[target] != p:
            return Fallback("its input and target are sharded differently")
        if not self._sharded(target):
            self.meetings.append((target, p))
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        reduction = self._loss_arg(node, 0, _MEAN)
        if weight is not None and reduction == _MEAN:
            return Fallback("a class-weighted mean")
        return p if reduction == _NONE else None

    def _loss_arg(self, node, which: int, default):
        pos = _LOSSES[node.target][which]
        name = ("reduction", "ignore_index")[which]
        return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)

    # ---- rewrites -----------------------------------------------------------------------

    def _rewrite(self, node: fx.Node, seq) -> None:
        t = node.target
        if t in ATTENTION_OPS:
            self._rewrite_attention(node)
        elif t is aten._assert_tensor_metadata.default:
            self.graph.erase_node(node)
        elif t in _REDUCTIONS and seq is None:
            self._rewrite_reduction(node)
        elif t in _LOSSES:
            self._rewrite_loss(node)
        elif t in _VIEWS:
            # reshape, not view: the ring ops' outputs need not have the strides the
            # traced kernels had (a .contiguous() the trace dropped as a no-op).
            node.target = aten.reshape.default
            node.args, node.kwargs = (node.args[0], self._local_shape(node, seq)), {}
        elif t is aten.expand.default:
            node.args = (node.args[0], self._local_shape(node, seq), *node.args[2:])
        elif t in _SAME_SHAPE or t is aten.cat.default or torch.Tag.pointwise in t.tags:
            self._fit_replicated_inputs(node, seq if isinstance(seq, Seq) else None)
        elif t is aten.addmm.default:  # its bias broadcasts against the output
            self._fit_replicated_inputs(node, seq, aligned=[node.args[0]])
        else:  # weights and tables: every position uses all of them
            self._fit_replicated_inputs(node, None)

    def _local_shape(self, node, seq: Seq) -> list[int]:
        return self.geo.local_shape(list(_val(node).shape), seq)

    def _fit_replicated_inputs(self, node: fx.Node, seq: Seq | None, aligned=None) -> None:
        """Slice replicated inputs that broadcast against the sequence of ``node``'s output
        (all of them, or those in ``aligned``); route the rest through ``copy_to_ring``
        (their gradient from this rank is partial)."""
        out_ndim = _val(node).dim() if isinstance(_val(node), torch.Tensor) else None
        for a in list(node.all_input_nodes):
            if self._sharded(a) or not _is_tensor(a):
                continue
            k = None
            if seq is not None and out_ndim is not None and (aligned is None or a in aligned):
                k = seq.dim - (out_ndim - len(_shape(a)))
            if k is not None and k >= 0 and _shape(a)[k] == _val(node).shape[seq.dim] > 1:
                node.replace_input_with(a, self._slice(a, Seq(k, seq.inner), 0))
            elif _val(a).is_floating_point():
                node.replace_input_with(a, self._copy_to_ring(a))

    def _rewrite_attention(self, node: fx.Node) -> None:
        att = read_attention(node)
        if att.dropout_p > 0:
            raise ValueError(
                f"attention {node.name} uses dropout_p={att.dropout_p}: ring attention cannot "
                "reproduce dropout; put the model in eval mode or set its attention dropout to 0"
            )
        q_shape = _shape(att.q)
        causal, mask, kind = att.is_causal, None, "causal" if att.is_causal else "none"
        if att.mask is not None:
            if is_causal_mask(att.mask):
                causal, kind = True, "causal (positions-only mask -> is_causal)"
            else:
                mask = self._local_mask(att.mask)
                kind = f"mask kept {tuple(_shape(att.mask))} {_val(att.mask).dtype}"
        geo = self.geo
        positional = causal or mask is not None or geo.padded != geo.length
        tiles = tiles_per_chunk(geo.local, geo.layout if positional else "contiguous")
        scale = att.scale if att.scale is not None else 1.0 / math.sqrt(q_shape[-1])
        with self.graph.inserting_before(node):
            if self.dilation is None:
                ring = self.graph.call_function(
                    ringify_ops.ring_attention.default,
                    (att.q, att.k, att.v, mask, causal, float(scale), self.group, geo.layout,
                     tiles, geo.length),
                )  # fmt: skip
            else:
                ring = self._dilated(att, mask, causal, float(scale))
                kind = f"{kind}; dilated {self.dilation.segment_lengths} x {self.dilation.dilation_rates}"
            out = self.graph.call_function(operator.getitem, (ring, 0))
            lse = self.graph.call_function(operator.getitem, (ring, 1))
        q_val = _val(att.q)
        out.meta["val"] = q_val.new_empty(q_shape)
        lse.meta["val"] = q_val.new_empty(q_shape[:3], dtype=accumulation_dtype(q_val.dtype))
        self.place.update({ring: [Seq(2), Seq(2)], out: Seq(2), lse: Seq(2)})
        if att.returns_tuple:
            for user in list(node.users):
                if user.args[1] not in (0, 1):
                    raise ValueError(
                        f"{node.name}: output {user.args[1]} of {node.target} (beyond out and "
                        "lse) has no ring-attention equivalent"
                    )
                user.replace_all_uses_with(out if user.args[1] == 0 else lse)
                self.graph.erase_node(user)
        else:
            node.replace_all_uses_with(out)
        self.graph.erase_node(node)
        kv = [self.geo.local_shape(_shape(x), Seq(2)) for x in (att.k, att.v)]
        self.result.attentions.append(
            RewrittenAttention(
                node=node.name,
                global_shape=tuple(q_shape),
                local_shape=tuple(self.geo.local_shape(q_shape, Seq(2))),
                mask=kind,
                layout=geo.layout,
                bytes_per_step=sum(math.prod(s) for s in kv) * _val(att.k).element_size(),
            )
        )

    def _dilated(self, att, mask, causal: bool, scale: float) -> fx.Node:
        """The dilated ring op in place of attention (k/v heads repeated for GQA)."""
        if mask is not None:
            raise ValueError(
                "dilated attention replaces the model's attention, but this one has a mask "
                "that is not causal; dilation supports no masks besides causal"
            )
        check_dilation(self.dilation, self.geo.local, self.geo.ring_size, self.geo.layout)
        heads = _shape(att.q)[1]
        k, v = att.k, att.v
        if _shape(k)[1] != heads:
            k, v = (
                self.graph.call_function(
                    aten.repeat_interleave.self_int, (x, heads // _shape(x)[1], 1)
                )
                for x in (k, v)
            )
        return self.graph.call_function(
            ringify_ops.dilated_attention.default,
            (att.q, k, v, causal, scale, self.group, list(self.dilation.segment_lengths),
             list(self.dilation.dilation_rates)),
        )  # fmt: skip

    def _local_mask(self, mask: fx.Node) -> fx.Node:
        """This rank's query rows of a kept mask, over all (padded) key columns."""
        if self._sharded(mask):
            mask = self._gather(mask)
        shape = _shape(mask)
        pad = self.geo.padded - self.geo.length
        with self.graph.inserting_before(self._after(mask)):
            if pad and shape[-1] > 1:
                unpadded = _val(mask)
                mask = self.graph.call_function(aten.constant_pad_nd.default, (mask, [0, pad], 0))
                mask.meta["val"] = unpadded.new_empty([*shape[:-1], shape[-1] + pad])
        if len(shape) >= 2 and shape[-2] > 1:
            return self._slice(mask, Seq(len(shape) - 2), 0)
        return mask

    def _after(self, node: fx.Node) -> fx.Node:
        """Where nodes computed from ``node`` go: right after it (after all the inputs)."""
        if node.op == "placeholder":
            return [n for n in self.graph.nodes if n.op == "placeholder"][-1].next
        return node.next

    def _rewrite_reduction(self, node: fx.Node) -> None:
        x = node.args[0]
        ndim = len(_shape(x))
        dims = self._reduced_dims(node, ndim)
        keep = len(node.args) > 2 and node.args[2]
        dtype = node.kwargs.get("dtype")
        g = self.graph
        with g.inserting_before(node):
            local = self._masked_padding(x, 0)
            partial = g.call_function(
                aten.sum.dim_IntList, (local, dims, keep), {"dtype": dtype} if dtype else {}
            )
            total = g.call_function(reduce_from_ring, (partial, self.group))
            if node.target in (aten.mean.default, aten.mean.dim):
                count = math.prod(_shape(x)[d] for d in dims)
                total = g.call_function(aten.div.Tensor, (total, count))
        node.replace_all_uses_with(total)
        g.erase_node(node)

    def _masked_padding(self, x: fx.Node, fill) -> fx.Node:
        """``x`` with its padded positions set to ``fill`` (``x`` itself without padding)."""
        if self.geo.padded == self.geo.length:
            return x
        seq = self.place[x]
        shape = _shape(x)
        g = self.graph
        outer, inner = self.geo.split(shape[seq.dim], seq)
        positions = g.call_function(
            aten.arange.default, (self.geo.padded,), {"device": _val(x).device}
        )
        valid = g.call_function(aten.lt.Scalar, (positions, self.geo.length))
        valid = g.call_function(
            ringify_ops.take_shard.default, (valid, 0, self.group, self.geo.layout)
        )
        valid = g.call_function(aten.view.default, (valid, [1, self.geo.local, 1]))
        valid = g.call_function(aten.expand.default, (valid, [outer, self.geo.local, inner]))
        view = [1] * len(shape)
        view[seq.dim] = outer * self.geo.local * inner
        valid = g.call_function(aten.reshape.default, (valid, view))
        return g.call_function(aten.where.ScalarOther, (valid, x, fill))

    def _rewrite_loss(self, node: fx.Node) -> None:
        x, target = node.args[:2]
        reduction = self._loss_arg(node, 0, _MEAN)
        ignore = self._loss_arg(node, 1, -100)
        g = self.graph
        if not self._sharded(target):
            target = self._slice(target, self.place[x], ignore)
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        if weight is not None and _val(weight).is_floating_point():
            weight = self._copy_to_ring(weight)
        rest = list(node.args[2:])
        kwargs = dict(node.kwargs)
        if rest:
            rest[0] = weight
        elif "weight" in kwargs:
            kwargs["weight"] = weight
        if reduction == _NONE:
            node.args = (x, target, *rest)
            node.kwargs = kwargs
            return
        pos = _LOSSES[node.target][0]
        args = [x, target, *rest]
        args += [None] * (pos + 1 - len(args))
        args[pos] = _SUM
        kwargs.pop("reduction", None)
        with g.inserting_before(node):
            partial = g.call_function(node.target, tuple(args), kwargs)
            total = g.call_function(reduce_from_ring, (partial, self.group))
            if reduction == _MEAN:
                counted = g.call_function(aten.ne.Scalar, (target, ignore))
                count = g.call_function(
                    aten.sum.dim_IntList, (counted, [0]), {"dtype": _val(x).dtype}
                )
                count = g.call_function(reduce_from_ring, (count, self.group))
                total = g.call_function(aten.div.Tensor, (total, count))
        node.replace_all_uses_with(total)
        g.erase_node(node)

    def _fall_back(self, node: fx.Node, reason: str) -> None:
        for a in list(node.all_input_nodes):
            if self._sharded(a):
                node.replace_input_with(a, self._gather(a))
        self.place[node] = (
            [None] * len(_val(node)) if isinstance(_val(node), (list, tuple)) else None
        )
        self.result.gathers.append(InsertedGather(node.name, str(node.target), reason))

    # ---- crossings between replicated and sharded ------------------------------------------

    def _slice(self, x: fx.Node, seq: Seq, pad_value) -> fx.Node:
        """This rank's part of replicated ``x`` (sequence at ``seq``), padded if the ring needs it."""
        key = ("slice", x, seq, pad_value)
        if key in self._cache:
            return self._cache[key]
        g, geo = self.graph, self.geo
        shape = _shape(x)
        with g.inserting_before(self._after(x)):
            factored = geo.factored_shape(shape, seq, geo.length)
            y = g.call_function(aten.reshape.default, (x, factored))
            pad = geo.padded - geo.length
            if pad:
                spec = [0, 0] * (len(factored) - seq.dim - 2) + [0, pad]
                y = g.call_function(aten.constant_pad_nd.default, (y, spec, pad_value))
            y = g.call_function(
                ringify_ops.take_shard.default, (y, seq.dim + 1, self.group, geo.layout)
            )
            y = g.call_function(aten.reshape.default, (y, geo.local_shape(shape, seq)))
        y.meta["val"] = _val(x)  # global metadata, as every node of the graph
        self.place[y] = seq
        self._cache[key] = y
        return y

    def _gather(self, x: fx.Node) -> fx.Node:
        """The full (replicated) tensor from every rank's part of sharded ``x``."""
        key = ("gather", x)
        if key in self._cache:
            return self._cache[key]
        g, geo, seq = self.graph, self.geo, self.place[x]
        shape = _shape(x)
        with g.inserting_before(self._after(x)):
            y = g.call_function(
                aten.reshape.default, (x, geo.factored_shape(shape, seq, geo.local))
            )
            y = g.call_function(
                ringify_ops.gather.default, (y, seq.dim + 1, self.group, geo.layout)
            )
            if geo.padded != geo.length:
                y = g.call_function(aten.narrow.default, (y, seq.dim + 1, 0, geo.length))
            y = g.call_function(aten.reshape.default, (y, shape))
        y.meta["val"] = _val(x)
        self.place[y] = None
        self._cache[key] = y
        return y

    def _copy_to_ring(self, x: fx.Node) -> fx.Node:
        key = ("copy", x)
        if key not in self._cache:
            with self.graph.inserting_before(self._after(x)):
                y = self.graph.call_function(copy_to_ring, (x, self.group))
            y.meta["val"] = _val(x)
            self.place[y] = None
            self._cache[key] = y
        return self._cache[key]


def find_sequence_inputs(graph: fx.Graph, ring_size: int, layout: str) -> dict[fx.Node, Seq]:
    """The inputs whose sequence dim reaches attention, found structurally.

    Each dim of each input is tried alone: it is a sequence dim if, sharded, the
    graph's own rules carry it to the sequence dim of some attention's q, or of the
    k or v of a self-attention (k as long as q; a cross-attention's memory stays
    replicated). Sizes are never matched to find a dim.
    """
    attentions = [read_attention(n) for n in graph.nodes if n.target in ATTENTION_OPS]
    self_attention = [a for a in attentions if _shape(a.q)[-2:-1] == _shape(a.k)[-2:-1]]
    reached = [a.q for a in attentions] + [x for a in self_attention for x in (a.k, a.v)]
    seeds: dict[fx.Node, Seq] = {}
    for node in graph.nodes:
        if node.op != "placeholder" or not _is_tensor(node):
            continue
        for dim, size in enumerate(_shape(node)):
            if size < 2:
                continue
            geo = Geometry(size, size, ring_size, layout)
            probe = ShardSequence(graph, geo, "", {node: Seq(dim)}, probe=True)
            probe.run()
            if any(probe.place.get(x) == Seq(2) for x in reached):
                seeds[node] = Seq(dim)
                break
    return seeds


def find_companion_inputs(
    graph: fx.Graph, seeds: dict[fx.Node, Seq], geometry: Geometry
) -> dict[fx.Node, Seq]:
    """Inputs that never reach attention but meet the sharded sequence (labels, say).

    Found by following each replicated tensor that lines up with the sequence back
    through views, pads, slices and copies to an input.
    """
    probe = ShardSequence(graph, geometry, "", seeds, probe=True)
    probe.run()
    found: dict[fx.Node, Seq] = {}
    for node, seq in probe.meetings:
        while node.op == "call_function" and seq is not None:
            x = node.args[0] if node.args else None
            if not _is_tensor(x):
                break
            if node.target in _VIEWS:
                seq = view_placement(list(_val(node).shape), seq, _shape(x), geometry.length)
            elif node.target not in _SAME_SHAPE | _SEQUENCE_PRESERVING:
                break
            node = x
        if node.op == "placeholder" and seq is not None and node not in seeds:
            found.setdefault(node, seq)
    return found
