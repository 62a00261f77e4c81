"""The sequence-sharding rules: one table, op -> how its placement is inferred and how it is rewritten.

Each family of ops keeps its rules beside it, in its module's ``RULES`` (a ``Rule`` holds
the two halves, ``crossings.py``): ``dims.py`` (views, transposes, ``cat``), ``indexing.py``,
``products.py``, ``reductions.py``, ``routing.py`` (mixture-of-experts routing),
``along.py`` (shifts, convolutions, scans), ``attention_rule.py`` and ``joint_attention.py``.
``RULES`` below joins them with the rules of the ops every model has (pointwise ops,
copies and casts, linear layers and norms, embeddings, dropout, tensor parallelism's
collectives). What an op does with its dims is ``graph/op_dims.py``'s, read here too.

Ops with no entry whose overload is tagged pointwise get the pointwise rule (as do the few
elementwise ops torch leaves untagged); any other op with a sharded input falls back (its
inputs are gathered). ``infer_placements`` runs the inference half over a whole graph.
Dropout on a sharded tensor draws per rank (``runtime/dropout.py``), not the same mask on
every rank's part.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ringify.passes.graph.crossings import PassState, Rule, as_it_is, fit_broadcast, fit_whole
from ringify.passes.graph.nodes import shape, val
from ringify.passes.graph.placement import Fallback, Placement, Placements, Seq, SequenceGeometry
from ringify.passes.graph.report import GatherReason, strict
from ringify.passes.graph.token_dispatch import find as find_dispatches
from ringify.passes.graph.vocabulary import (
    CASTS_LIKE,
    NEW_TENSORS,
    PER_POSITION,
    SAME_SHAPE,
    UNTAGGED_POINTWISE,
)
from ringify.passes.sharding import (
    along,
    attention_rule,
    dims,
    dispatch,
    indexing,
    joint_attention,
    products,
    reductions,
    routing,
)
from ringify.passes.sharding.indexing import infer_index
from ringify.passes.sharding.routing import infer_table_rows, is_table_lookup, rewrite_table_rows
from ringify.runtime.collectives.tp_ops import TP_FEATURE_OPS, TP_VOCAB_EMBEDDING
from ringify.runtime.dropout import sequence_dropout

aten = torch.ops.aten


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
    """Indexing a sharded tensor, or a replicated table by sharded ids (MoE's experts), or
    picking rows in a token dispatch's order."""
    if is_table_lookup(node, place):
        return infer_table_rows(node, place)
    first = node.args[1][0] if node.args[1] else None
    if place.sharded(first) and (place[first].order or place[node.args[0]].order):
        return dispatch.infer_pick(node, place)
    return infer_index(node, place)


def _rewrite_index(node, out, state: PassState) -> None:
    if not state.sharded(node.args[0]):
        rewrite_table_rows(node, out, state)
    elif out is None:  # positions picked along the sequence
        indexing.rewrite_picked_positions(node, out, state)
    else:
        fit_whole(node, out, state)


def rewrite_dropout(node: fx.Node, out: Placement, state: PassState) -> None:
    """``aten.dropout(x, p, train)`` in training with ``p > 0`` -> ``sequence_dropout``."""
    x, p, train = node.args
    if not train or p <= 0:
        return
    with state.graph.inserting_before(node):
        pair = state.graph.call_function(sequence_dropout._opoverload, (x, p, state.group_name))
        pair.meta = dict(node.meta)
        pair.meta["val"] = (node.meta["val"], None)
        dropped = state.graph.call_function(operator.getitem, (pair, 0))
    dropped.meta = dict(node.meta)
    state.place[dropped] = out
    node.replace_all_uses_with(dropped)
    state.graph.erase_node(node)


POINTWISE = Rule(_infer_broadcast, fit_broadcast)
RULES: dict[object, Rule] = {
    **dict.fromkeys(SAME_SHAPE | UNTAGGED_POINTWISE, POINTWISE),
    **dict.fromkeys(CASTS_LIKE, Rule(lambda node, place: place[node.args[0]], as_it_is)),
    aten.dropout.default: Rule(_infer_broadcast, rewrite_dropout),
    aten._assert_tensor_metadata.default: Rule(
        lambda node, place: None, lambda node, out, state: state.graph.erase_node(node)
    ),
    **dict.fromkeys(NEW_TENSORS, Rule(lambda node, place: None, as_it_is)),
    **dict.fromkeys(
        PER_POSITION,
        Rule(_infer_per_position, fit_whole),
    ),
    aten.embedding.default: Rule(_infer_embedding, fit_whole),
    TP_VOCAB_EMBEDDING: Rule(_infer_embedding, fit_whole),
    **dict.fromkeys(TP_FEATURE_OPS, Rule(_infer_features, as_it_is)),
    aten.index.Tensor: Rule(_infer_index, _rewrite_index),
    **dims.RULES,
    **indexing.RULES,
    **products.RULES,
    **reductions.RULES,
    **routing.RULES,
    **dispatch.RULES,
    **along.RULES,
    **attention_rule.RULES,
    **joint_attention.RULES,
}


def rule_for(target) -> Rule | None:
    if target in RULES:
        return RULES[target]
    if str(target) in dispatch.NAMED:  # ops of libraries ringify does not import
        return dispatch.NAMED[str(target)]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return POINTWISE
    return None


def infer(node: fx.Node, place: Placements) -> Placement | Fallback:
    """The placement of ``node``'s output(s) given its inputs', or why it must fall back. A
    rule that raises is ringify's defect: gathered (exact) and reported as one, or raised
    in strict mode (``report.strict``), so that the suite fails on it."""
    rule = rule_for(node.target)
    if rule is None:
        return Fallback(GatherReason.NO_RULE, str(node.target))
    try:
        return rule.infer(node, place)
    except (IndexError, KeyError, TypeError, ValueError) as e:
        if strict():
            raise RuntimeError(f"ringify's rule for {node.target} ({node.name}) raised") from e
        return Fallback(GatherReason.RULE_FAILED, f"{node.target}: {type(e).__name__}: {e}")
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
    sequence is born; the other inputs are replicated). A token dispatch whose region the
    inference does not place whole is inferred again without it (``dispatch.py``)."""
    dispatches = find_dispatches(graph)
    while True:
        inference = _inferred(graph, geometry, seeds, dispatches)
        failed = dispatch.failed(dispatches, inference.place, inference.decisions)
        if not failed:
            return inference
        dispatches = {s: d for s, d in dispatches.items() if s not in failed}


def _inferred(graph: fx.Graph, geometry: SequenceGeometry, seeds: dict, dispatches: dict):
    place = Placements(geometry, dispatches=dispatches)
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
