"""Rules of ``joint_attention``: queries over keys and values given in parts (``joints.py``).

In a diffusion transformer's joint attention one key part is the sharded image sequence and
the others are replicated text. Sharded queries (the image's) run the ring over the image
keys and a local block over the text keys; replicated queries (the text's) attend to each
rank's image keys, merged over the ring, and to the text keys locally
(``ringify::joint_attention`` and ``ringify::joint_memory_attention``). With every key part
replicated it runs as it is, on this rank's queries. More than one sharded part is gathered.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ringify.passes.folds.mask_programs import step_plan
from ringify.passes.graph.attention_nodes import read_joint_attention
from ringify.passes.graph.crossings import PassState, Rule, as_it_is
from ringify.passes.graph.nodes import call, shape, val
from ringify.passes.graph.placement import Fallback, Placement, Placements, Seq
from ringify.passes.graph.report import AttentionRun, GatherReason
from ringify.passes.sharding.attention_rule import local_mask, reported
from ringify.runtime.attention.joint import joint_attention_op, joint_memory_attention_op
from ringify.runtime.attention.reference import joint_attention
from ringify.runtime.attention.spec import AttentionSpec, sdpa_scale
from ringify.runtime.zero_grads import with_zero_grads

aten = torch.ops.aten


def infer_joint_attention(node: fx.Node, place: Placements) -> Placement | Fallback:
    q, keys, values, _, masks = _args(node)
    if any(place[m] is not None for m in masks or ()):
        return Fallback(GatherReason.MIXED_DIMS, "(a mask of the keys sharded)")
    key_places, value_places = [place[k] for k in keys], [place[v] for v in values]
    if key_places != value_places or place[q] not in (None, Seq(2)):
        return Fallback(GatherReason.QKV_NOT_SHARDED)
    if any(p not in (None, Seq(2)) for p in key_places) or key_places.count(Seq(2)) > 1:
        return Fallback(GatherReason.QKV_NOT_SHARDED)
    if any(shape(x)[-1] != shape(q)[-1] for x in (*keys, *values)):
        return Fallback(GatherReason.QKV_NOT_SHARDED, "(value head dim unlike the queries')")
    return place[q]


def _args(node: fx.Node) -> tuple:
    """(q, keys, values, scale, masks): ``masks`` each key part's columns of a mask, or None."""
    q, keys, values, scale, *rest = node.args
    return q, keys, values, scale, rest[0] if rest else None


def rewrite_joint_attention(node: fx.Node, out: Placement, state: PassState) -> None:
    """The ring (or memory) op over the sharded part, merged with the replicated ones."""
    q, keys, values, scale, masks = _args(node)
    att = read_joint_attention(node)
    sharded = [i for i, k in enumerate(keys) if state.sharded(k)]
    if not sharded:  # this rank's queries over every key: their gradients summed over the ring
        copies = [[state.copy_to_ring(x) for x in xs] for xs in (keys, values)]
        node.args = (q, *copies, scale, masks)  # the masks' rows broadcast: whole
        state.attentions.append(reported(att, AttentionRun.LOCAL, state))
        return
    (i,) = sharded
    g, geo = state.graph, state.geo
    scale = sdpa_scale(scale, shape(q)[-1])
    queries_sharded = state.sharded(q)
    with g.inserting_before(node):
        extra = []
        for xs in (keys, values):
            rest = [x for j, x in enumerate(xs) if j != i]
            if queries_sharded:  # each rank's rows add their part of the text keys' gradient
                rest = [state.copy_to_ring(x) for x in rest]
            whole = rest[0] if len(rest) == 1 else call(g, aten.cat.default, (rest, 2))
            state.place[whole] = None
            extra.append(whole)
        mask = mask_extra = None
        if masks is not None:
            rest = [m for j, m in enumerate(masks) if j != i]
            mask_extra = rest[0] if len(rest) == 1 else call(g, aten.cat.default, (rest, -1))
            state.place[mask_extra] = None
            mask = _sharded_keys_mask(masks[i], queries_sharded, state)
        spec = AttentionSpec(state.group_name, scale, layout=geo.layout)
        text = extra if mask_extra is None else [*extra, mask_extra]
        # the step's plan, shared by the unmasked ring calls (a mask's plan is the call's own)
        plan = step_plan(state, "", [], False, q) if queries_sharded and mask is None else None
        op = joint_attention_op if queries_sharded else joint_memory_attention_op
        args = (q, keys[i], values[i], mask, text, geo.length, spec, plan)
        joint = call(g, op._opoverload, args)
        result = call(g, operator.getitem, (joint, 0))
    placed = Seq(2) if queries_sharded else None
    state.place.update({joint: [placed, placed], result: placed})
    node.replace_all_uses_with(result)
    g.erase_node(node)
    run = AttentionRun.RING if queries_sharded else AttentionRun.MEMORY
    state.attentions.append(reported(att, run, state))


def _sharded_keys_mask(mask: fx.Node, queries_sharded: bool, state: PassState) -> fx.Node:
    """The mask's columns of the sharded keys: whole (padded) for the ring, which reads the
    columns of each key tile it holds; this rank's for the memory merge. Padding keys are
    hidden either way (the ops also cut them by ``key_len``)."""
    if queries_sharded:
        return local_mask(mask, state)
    fill = False if val(mask).dtype == torch.bool else float("-inf")
    return state.slice(mask, Seq(len(shape(mask)) - 1), fill)


def infer_with_zero_grads(node: fx.Node, place: Placements) -> Placement:
    """``with_zero_grads(x, dropped)``: placed as ``x`` (the dropped inputs as they are)."""
    return place[node.args[0]]


RULES = {
    joint_attention: Rule(infer_joint_attention, rewrite_joint_attention),
    with_zero_grads: Rule(infer_with_zero_grads, as_it_is),
}
