"""The sequence-sharding rules: one table, op -> how its placement is inferred and how it is rewritten.

Each rule holds its two halves side by side (as torch's context-parallel
sharding rules and DTensor's op strategies do):

- ``infer(node, place)``: the placement of the op's output(s) given its inputs'
  (``placement.py``), or a ``Fallback`` with the reason it cannot run on shards;
- ``rewrite(node, out, state)``: the edit that makes each rank compute exactly
  its part: local sizes for views and expands, replicated operands sliced or
  routed through ``copy_to_ring`` (``crossings.py``), reductions and attention
  replaced (``reductions.py``, ``attention.py``).

Ops with no entry whose overload is tagged pointwise get the pointwise rule (as do the few
elementwise ops torch leaves untagged); any other op with a sharded input falls back (its
inputs are gathered).
``infer_placements`` runs the inference half over a whole graph.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ringify.passes.folds.convs import infer_conv, rewrite_conv
from ringify.passes.folds.mask_programs import rewrite_program_mask
from ringify.passes.folds.scans import (
    infer_cumsum,
    infer_selective_scan,
    rewrite_cumsum,
    rewrite_selective_scan,
)
from ringify.passes.folds.shifts import infer_shift, rewrite_shift
from ringify.passes.folds.spellings import CASTS_LIKE
from ringify.passes.graph.attention_nodes import ATTENTION_OPS
from ringify.passes.graph.crossings import PassState
from ringify.passes.graph.nodes import shape, val
from ringify.passes.graph.placement import (
    Fallback,
    Placement,
    Placements,
    Seq,
    SequenceGeometry,
    sharded_first,
)
from ringify.passes.graph.report import GatherReason
from ringify.passes.sharding.attention import infer_attention, rewrite_attention
from ringify.passes.sharding.dims import (
    VIEWS,
    infer_cat,
    infer_complex_view,
    infer_expand,
    infer_permute,
    infer_repeat,
    infer_squeeze,
    infer_stack,
    infer_t,
    infer_transpose,
    infer_unsqueeze,
    infer_view,
    rewrite_local_size,
)
from ringify.passes.sharding.dropout import rewrite_dropout
from ringify.passes.sharding.indexing import (
    INDEXING,
    infer_gather,
    infer_index,
    infer_index_select,
    infer_indexing,
    infer_scatter,
    rewrite_indexing,
    rewrite_picked_positions,
    rewrite_scatter,
)
from ringify.passes.sharding.joint_attention import (
    infer_joint_attention,
    infer_with_zero_grads,
    rewrite_joint_attention,
)
from ringify.passes.sharding.products import (
    infer_addmm,
    infer_baddbmm,
    infer_einsum,
    infer_matmul,
    rewrite_product,
)
from ringify.passes.sharding.reductions import (
    EXTREMA,
    LOCAL_REDUCTIONS,
    LOSSES,
    REDUCTIONS,
    SOFTMAXES,
    infer_argmax,
    infer_local_reduction,
    infer_loss,
    infer_reduction,
    rewrite_argmax,
    rewrite_extremum,
    rewrite_loss,
    rewrite_reduction,
    rewrite_softmax,
)
from ringify.passes.sharding.routing import (
    LIKE,
    SCATTERS,
    SELECTIONS,
    infer_bincount,
    infer_histc,
    infer_like,
    infer_one_hot,
    infer_repeat_interleave,
    infer_scatter_add,
    infer_scatter_off_sequence,
    infer_selection,
    infer_table_rows,
    is_table_lookup,
    rewrite_bincount,
    rewrite_histc,
    rewrite_repeat_interleave,
    rewrite_scatter_add,
    rewrite_table_rows,
)
from ringify.runtime.attention.reference import joint_attention
from ringify.runtime.collectives.halo import same_conv1d
from ringify.runtime.collectives.shift import shifted
from ringify.runtime.collectives.tensor_parallel import TP_FEATURE_OPS, TP_VOCAB_EMBEDDING
from ringify.runtime.masks.program import program_mask
from ringify.runtime.selective_scan import selective_scan
from ringify.runtime.zero_grads import with_zero_grads

aten = torch.ops.aten

Infer = Callable[[fx.Node, Placements], "Placement | Fallback"]
Rewrite = Callable[[fx.Node, Placement, PassState], None]


@dataclass(frozen=True)
class Rule:
    infer: Infer
    rewrite: Rewrite


SAME_SHAPE = frozenset({
    aten.dropout.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
    aten.detach.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
    aten.to.device, aten.lift_fresh_copy.default,
})  # fmt: skip
# elementwise with broadcasting, as the pointwise tag's ops, but their overloads are untagged
UNTAGGED_POINTWISE = frozenset({
    aten.log_sigmoid.default, aten.hardswish.default, aten.rsub.Tensor, aten.masked_fill.Tensor,
    aten.where.Scalar, aten.where.ScalarOther, aten.where.ScalarSelf,
})  # fmt: skip
# new tensors that take only their input's dtype and device: replicated
NEW_TENSORS = frozenset({
    aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
})  # fmt: skip


# ---- rewrites shared by several rules ---------------------------------------------------


def _fit_broadcast(node, out, state: PassState) -> None:
    """Replicated operands that line up with the sequence are sliced, the rest copied."""
    state.fit_replicated_inputs(node, out if isinstance(out, Seq) else None)


def _fit_whole(node, out, state: PassState) -> None:
    """Replicated operands (weights, tables) are used whole by every position."""
    state.fit_replicated_inputs(node, None)


def _erase(node, out, state: PassState) -> None:
    state.graph.erase_node(node)


def _as_it_is(node, out, state: PassState) -> None:
    """Nothing to rewrite: the op computes this rank's part from its inputs' parts."""


# ---- inference ----------------------------------------------------------------------------


def _infer_broadcast(node, place: Placements):
    """Pointwise with broadcasting: the sharded inputs must agree on the (right-aligned) dim."""
    tensors = [a for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)]
    out_ndim = val(node).dim()
    aligned = {
        place[a].at(place[a].dim + out_ndim - len(shape(a))) for a in tensors if place.sharded(a)
    }
    if len(aligned) != 1:
        return Fallback(GatherReason.MIXED_DIMS)
    return place.line_up(node, tensors, aligned.pop())


def _infer_per_position(node, place: Placements):
    """linear / layer_norm / rms_norm: act on the last (feature) dims."""
    x = node.args[0]
    features = 1 if node.target is aten.linear.default else len(node.args[1])
    if place.only_sharded(node, x) and place[x].dim < len(shape(x)) - features:
        return place[x]
    return Fallback(GatherReason.FEATURE_DIM)


def _infer_features(node, place: Placements):
    """Tensor parallelism's collectives: over another group, on the last (feature) dim."""
    x = node.args[0]
    if place.only_sharded(node, x) and place[x].dim < len(shape(x)) - 1:
        return place[x]
    return Fallback(GatherReason.FEATURE_DIM)


def _infer_embedding(node, place: Placements):
    table, idx = node.args[:2]
    if place[idx] is not None and not place.sharded(table):
        return place[idx]
    return Fallback(GatherReason.SHARDED_TABLE)


def _infer_index(node, place: Placements):
    """Indexing a sharded tensor, or a replicated table by sharded ids (MoE's experts)."""
    if is_table_lookup(node, place):
        return infer_table_rows(node, place)
    return infer_index(node, place)


def _rewrite_index(node, out, state: PassState) -> None:
    if not state.sharded(node.args[0]):
        rewrite_table_rows(node, out, state)
    elif out is None:  # positions picked along the sequence
        rewrite_picked_positions(node, out, state)
    else:
        _fit_whole(node, out, state)


@sharded_first
def _infer_softmax(node, place, p: Seq, ndim: int):
    """softmax / log_softmax keep the placement (along the sequence: normalised over the ring)."""
    return p


@sharded_first
def _infer_argmax(node, place, p: Seq, ndim: int):
    return infer_argmax(node, place)


@sharded_first
def _infer_reduction(node, place, p: Seq, ndim: int):
    return infer_reduction(node, place)


@sharded_first
def _infer_loss(node, place, p: Seq, ndim: int):
    return infer_loss(node, place)


# ---- the table ----------------------------------------------------------------------------


POINTWISE = Rule(_infer_broadcast, _fit_broadcast)
RULES: dict[object, Rule] = {
    **dict.fromkeys(ATTENTION_OPS, Rule(infer_attention, rewrite_attention)),
    joint_attention: Rule(infer_joint_attention, rewrite_joint_attention),
    with_zero_grads: Rule(infer_with_zero_grads, _as_it_is),
    aten._assert_tensor_metadata.default: Rule(lambda node, place: None, _erase),
    **dict.fromkeys(SAME_SHAPE | UNTAGGED_POINTWISE, POINTWISE),
    **dict.fromkeys(CASTS_LIKE, Rule(lambda node, place: place[node.args[0]], _as_it_is)),
    aten.dropout.default: Rule(_infer_broadcast, rewrite_dropout),
    aten.cat.default: Rule(infer_cat, _fit_broadcast),
    aten.repeat.default: Rule(infer_repeat, _as_it_is),
    aten.stack.default: Rule(infer_stack, _as_it_is),
    **dict.fromkeys(
        (aten.linear.default, aten.layer_norm.default, aten.rms_norm.default),
        Rule(_infer_per_position, _fit_whole),
    ),
    **dict.fromkeys(
        (aten.mm.default, aten.matmul.default, aten.bmm.default),
        Rule(infer_matmul, rewrite_product),
    ),
    # addmm's bias broadcasts against the output
    aten.addmm.default: Rule(
        infer_addmm, lambda n, out, s: s.fit_replicated_inputs(n, out, aligned=[n.args[0]])
    ),
    aten.baddbmm.default: Rule(infer_baddbmm, rewrite_product),
    aten.einsum.default: Rule(infer_einsum, lambda n, out, s: s.fit_replicated_inputs(n, None)),
    aten.embedding.default: Rule(_infer_embedding, _fit_whole),
    TP_VOCAB_EMBEDDING: Rule(_infer_embedding, _fit_whole),
    **dict.fromkeys(TP_FEATURE_OPS, Rule(_infer_features, _as_it_is)),
    **dict.fromkeys(VIEWS, Rule(infer_view, rewrite_local_size)),
    **dict.fromkeys(
        (aten.expand.default, aten.broadcast_to.default), Rule(infer_expand, rewrite_local_size)
    ),
    **dict.fromkeys(
        (aten.view_as_complex.default, aten.view_as_real.default),
        Rule(infer_complex_view, _as_it_is),
    ),
    aten.transpose.int: Rule(infer_transpose, _fit_whole),
    aten.t.default: Rule(infer_t, _fit_whole),
    aten.permute.default: Rule(infer_permute, _fit_whole),
    aten.unsqueeze.default: Rule(infer_unsqueeze, _fit_whole),
    **dict.fromkeys(
        (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default),
        Rule(infer_squeeze, _fit_whole),
    ),
    **dict.fromkeys((aten.select.int, aten.slice.Tensor), Rule(infer_indexing, rewrite_indexing)),
    **dict.fromkeys(
        INDEXING.keys() - {aten.select.int, aten.slice.Tensor}, Rule(infer_indexing, _fit_whole)
    ),
    aten.index.Tensor: Rule(_infer_index, _rewrite_index),
    aten.index_select.default: Rule(infer_index_select, rewrite_indexing),
    aten.gather.default: Rule(infer_gather, _fit_broadcast),
    **dict.fromkeys(
        (aten.slice_scatter.default, aten.select_scatter.default),
        Rule(infer_scatter, rewrite_scatter),
    ),
    aten.cumsum.default: Rule(infer_cumsum, rewrite_cumsum),
    **dict.fromkeys(SELECTIONS, Rule(infer_selection, _as_it_is)),
    aten.repeat_interleave.self_int: Rule(infer_repeat_interleave, rewrite_repeat_interleave),
    aten.one_hot.default: Rule(infer_one_hot, _as_it_is),
    aten.histc.default: Rule(infer_histc, rewrite_histc),
    aten.bincount.default: Rule(infer_bincount, rewrite_bincount),
    aten.scatter_add.default: Rule(infer_scatter_add, rewrite_scatter_add),
    **dict.fromkeys(SCATTERS, Rule(infer_scatter_off_sequence, _as_it_is)),
    **dict.fromkeys(LIKE, Rule(infer_like, _as_it_is)),
    shifted: Rule(infer_shift, rewrite_shift),
    same_conv1d: Rule(infer_conv, rewrite_conv),
    selective_scan: Rule(infer_selective_scan, rewrite_selective_scan),
    program_mask: Rule(lambda node, place: None, rewrite_program_mask),
    **dict.fromkeys(NEW_TENSORS, Rule(lambda node, place: None, _as_it_is)),
    **dict.fromkeys(REDUCTIONS, Rule(_infer_reduction, rewrite_reduction)),
    **dict.fromkeys(LOCAL_REDUCTIONS, Rule(infer_local_reduction, _fit_broadcast)),
    **dict.fromkeys(EXTREMA, Rule(_infer_reduction, rewrite_extremum)),
    **dict.fromkeys(SOFTMAXES, Rule(_infer_softmax, rewrite_softmax)),
    aten.argmax.default: Rule(
        sharded_first(lambda n, place, p, ndim: infer_argmax(n, place)), rewrite_argmax
    ),
    **dict.fromkeys(LOSSES, Rule(_infer_loss, rewrite_loss)),
}


def rule_for(target) -> Rule | None:
    if target in RULES:
        return RULES[target]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return POINTWISE
    return None


def infer(node: fx.Node, place: Placements) -> Placement | Fallback:
    """The placement of ``node``'s output(s) given its inputs', or why it must fall back."""
    rule = rule_for(node.target)
    if rule is None:
        return Fallback(GatherReason.NO_RULE, str(node.target))
    try:
        return rule.infer(node, place)
    except (IndexError, KeyError, TypeError, ValueError) as e:
        return Fallback(GatherReason.UNREADABLE, str(e))
    except GuardOnDataDependentSymNode:  # a decision on a size the data decides
        return Fallback(GatherReason.UNREADABLE, "(a size the data decides)")


@dataclass
class Inference:
    """Every node's placement, and the decision of each node whose inputs carry the sequence."""

    place: Placements
    decisions: dict[fx.Node, Placement | Fallback]


def infer_placements(
    graph: fx.Graph, geometry: SequenceGeometry, seeds: dict[fx.Node, Seq]
) -> Inference:
    """Placements of every node from those of the ``seeds`` (inputs, or nodes where the
    sequence is born; the other inputs are replicated)."""
    place = Placements(geometry)
    decisions: dict[fx.Node, Placement | Fallback] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node in seeds:
            place.of[node] = seeds.get(node)
        elif node.op != "call_function":
            continue
        elif not any(_carries_sequence(place[a]) for a in node.all_input_nodes):
            place.of[node] = None
        elif node.target is operator.getitem:
            outs = place[node.args[0]]
            place.of[node] = outs[node.args[1]] if isinstance(outs, list) else None
        else:
            decisions[node] = decided = infer(node, place)
            if isinstance(decided, Fallback):
                out = val(node)
                decided = [None] * len(out) if isinstance(out, (list, tuple)) else None
            place.of[node] = decided
    return Inference(place, decisions)


def _carries_sequence(p: Placement) -> bool:
    return isinstance(p, Seq) or (isinstance(p, list) and any(p))
