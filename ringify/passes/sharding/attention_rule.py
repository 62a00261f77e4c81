"""Attention's sharding rule: each ``Attention`` (``graph/attention_nodes.py``) rewritten
into the ring op.

The rewrite: a mask read as a program (``mask_programs.py``) goes to the ring op as
its text and O(S) inputs; any other mask is kept, its rows sliced with the queries
(the op cuts the columns per tile pair); with a ``Dilation`` the attention becomes the dilated ring op. An attention
whose k and v are replicated (cross-attention to a text prompt, an encoder output
that is not sharded) needs no ring: it stays as it is, on this rank's queries and
mask rows and the whole memory. Replicated queries attending to a sharded memory
(a short decoder's cross-attention to a long encoder) become ``memory_attention``.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch import fx

from ringify.passes.folds.handwritten import FORM_NOTE
from ringify.passes.folds.mask_programs import (
    MASK_NOTE,
    program_inputs,
    step_masks_of,
    step_plan,
)
from ringify.passes.graph.attention_nodes import ATTENTION_OPS, Attention, read_attention
from ringify.passes.graph.crossings import PassState, Rule
from ringify.passes.graph.nodes import call, shape, val
from ringify.passes.graph.placement import Fallback, Placement, Placements, Seq
from ringify.passes.graph.report import AttentionRun, GatherReason, MaskKind, ReportedAttention
from ringify.passes.sharding.strategy import choose_transport, step_bytes
from ringify.runtime.attention.memory_attention import memory_attention_op
from ringify.runtime.attention.spec import AttentionSpec, sdpa_scale
from ringify.runtime.masks.program import program_mask

aten = torch.ops.aten
ringify_ops = torch.ops.ringify


def infer_attention(node: fx.Node, place: Placements) -> Placement | Fallback:
    att = read_attention(node)
    out = [Seq(2), Seq(2)] + [None] * (len(val(node)) - 2) if att.returns_tuple else Seq(2)
    if len(shape(att.q)) != 4:
        return Fallback(GatherReason.QKV_NOT_SHARDED)
    if place[att.q] is None and place[att.k] == place[att.v] == Seq(2):
        return _infer_memory(att, place)
    if place[att.q] != Seq(2):
        return Fallback(GatherReason.QKV_NOT_SHARDED)
    if place[att.k] is None and place[att.v] is None:
        if att.is_causal:  # its diagonal is at the top left of the whole (q, k) square
            return Fallback(GatherReason.CAUSAL_MEMORY)
        mask = att.mask
        if mask is not None and place.sharded(mask) and place[mask] != Seq(len(shape(mask)) - 2):
            return Fallback(GatherReason.MIXED_DIMS, f"(mask {mask.name})")
        return out  # local: this rank's queries against the whole memory
    if place[att.k] != Seq(2) or place[att.v] != Seq(2):
        return Fallback(GatherReason.QKV_NOT_SHARDED)
    if shape(att.q)[2] != shape(att.k)[2]:
        return Fallback(GatherReason.CROSS_ATTENTION)
    return out  # a learned mask gets its gradient from the ring op, tile by tile


def _infer_memory(att: Attention, place: Placements) -> Placement | Fallback:
    """Replicated queries, a sharded memory: replicated output (``memory_attention``)."""
    if att.is_causal:
        return Fallback(GatherReason.CAUSAL_MEMORY)
    mask = att.mask
    if mask is not None and place.sharded(mask) and place[mask] != Seq(len(shape(mask)) - 1):
        return Fallback(GatherReason.MIXED_DIMS, f"(mask {mask.name})")
    return [None] * len(val(att.node)) if att.returns_tuple else None


def rewrite_attention(node: fx.Node, out: Placement, state: PassState) -> None:
    """Replace ``node`` by the ring (or, with ``state.dilation``, the dilated ring) op; or,
    with a replicated memory, run it on this rank's queries; with replicated queries and a
    sharded memory, merge each rank's part of the attention over the ring."""
    att = read_attention(node)
    dilation = state.dilation
    if att.dropout_p > 0:
        raise ValueError(
            f"attention {node.name} uses dropout_p={att.dropout_p}: ring attention cannot "
            "reproduce dropout; put the model in eval mode or set its attention dropout to 0"
        )
    if not state.sharded(att.k):
        _rewrite_local(att, state)
        return
    if not state.sharded(att.q):
        _rewrite_memory(att, state)
        return
    geo, g = state.geo, state.graph
    q_shape = shape(att.q)
    causal, mask, program, inputs, plan, given = att.is_causal, None, "", [], None, None
    kind = MaskKind.CAUSAL if att.is_causal else MaskKind.NONE
    transport, note = choose_transport(att, state)
    if att.mask is not None and att.mask.target is program_mask:
        program, inputs, plan = program_inputs(att.mask, state, att.is_causal, transport)
        kind = MaskKind.PROGRAM
    elif att.mask is not None:  # a mask tensor: its plan is the call's own
        mask, kind = local_mask(att.mask, state), MaskKind.KEPT
    elif dilation is None:
        plan = step_plan(state, "", [], att.is_causal, att.q, transport)
    scale = sdpa_scale(att.scale, q_shape[-1])
    with g.inserting_before(node):
        q, k, v = _equal_head_dims(att, state)
        if dilation is None:
            spec = AttentionSpec(state.group_name, scale, causal, geo.layout, att.softcap, program)
            if program:  # the step's masks, made once beside the plan
                given = step_masks_of(state, plan, inputs, q, att.softcap)
            args = (q, k, v, mask, inputs, geo.length, spec, plan, _sinks(att, state), given)
            ring = call(g, ringify_ops.ring_attention.default, args)
        else:
            _refuse_extras(att, "dilated attention")
            spec = AttentionSpec.dilated(state.group_name, scale, causal, dilation)
            ring = _dilated(att, q, k, v, mask or att.mask, spec, state)
        ring_out = _value_columns(call(g, operator.getitem, (ring, 0)), att, state, Seq(2))
        lse = call(g, operator.getitem, (ring, 1))
    state.place.update({ring: [Seq(2), Seq(2)], ring_out: Seq(2), lse: Seq(2)})
    _replace_outputs(att, ring_out, lse, state)
    kv = [geo.local_shape(shape(x), Seq(2)) for x in (k, v)]
    size = val(att.k).element_size()
    bytes_per_step = sum(math.prod(s) for s in kv) * size
    run = AttentionRun.RING if transport.is_ring else AttentionRun.ALL_TO_ALL
    row = reported(att, run, state, kind, dilation=dilation, bytes=bytes_per_step)
    ring_bytes, all_to_all_bytes = step_bytes(att, state)
    state.attentions.append(
        dataclasses.replace(
            row,
            transport=transport,
            ring_bytes=ring_bytes,
            all_to_all_bytes=all_to_all_bytes,
            strategy_note=note,
        )
    )


def _replace_outputs(att: Attention, out: fx.Node, lse: fx.Node, state: PassState) -> None:
    """``out`` and ``lse`` in place of the attention node's outputs; the node erased."""
    node, g = att.node, state.graph
    if att.returns_tuple:
        for user in list(node.users):
            if user.args[1] not in (0, 1):
                raise ValueError(
                    f"{node.name}: output {user.args[1]} of {node.target} (beyond out and "
                    "lse) has no ring-attention equivalent"
                )
            user.replace_all_uses_with(out if user.args[1] == 0 else lse)
            g.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    g.erase_node(node)


def _rewrite_memory(att: Attention, state: PassState) -> None:
    """Replicated queries, a sharded memory: ``memory_attention`` over this rank's keys and
    mask columns (padding columns masked), merged over the ring."""
    _refuse_extras(att, "attention of replicated queries to a sharded memory")
    geo, g, mask = state.geo, state.graph, att.mask
    if mask is not None and not state.sharded(mask) and shape(mask)[-1] > 1:
        fill = False if val(mask).dtype == torch.bool else float("-inf")
        mask = state.slice(mask, Seq(len(shape(mask)) - 1), fill)
    q_shape = shape(att.q)
    scale = sdpa_scale(att.scale, q_shape[-1])
    with g.inserting_before(att.node):
        q, k, v = _equal_head_dims(att, state)
        spec = AttentionSpec(state.group_name, scale, layout=geo.layout)
        merged = call(g, memory_attention_op._opoverload, (q, k, v, mask, [], geo.length, spec))
        out = _value_columns(call(g, operator.getitem, (merged, 0)), att, state, None)
        lse = call(g, operator.getitem, (merged, 1))
    state.place.update({merged: [None, None], out: None, lse: None})
    state.attentions.append(reported(att, AttentionRun.MEMORY, state))
    _replace_outputs(att, out, lse, state)


def _rewrite_local(att: Attention, state: PassState) -> None:
    """Attention to a replicated memory: this rank's queries and mask rows, the whole k and v
    (whose gradients, partial on each rank, are summed over the ring)."""
    node, mask = att.node, att.mask
    for x in (att.k, att.v, att.sinks):
        if x is not None:
            node.replace_input_with(x, state.copy_to_ring(x))
    if mask is not None and not state.sharded(mask) and shape(mask)[-2] > 1:
        # padded query rows see every key, so that no row is all masked (NaN)
        fill = True if val(mask).dtype == torch.bool else 0
        node.replace_input_with(mask, state.slice(mask, Seq(len(shape(mask)) - 2), fill))
    state.attentions.append(reported(att, AttentionRun.LOCAL, state))


def reported(
    att: Attention,
    run: AttentionRun,
    state: PassState,
    mask: MaskKind | None = None,
    dilation=None,
    bytes: int = 0,
) -> ReportedAttention:
    """``att``'s row in the report."""
    q_shape = tuple(shape(att.q))
    if mask is None:
        mask = MaskKind.NONE if att.mask is None else MaskKind.KEPT
        mask = MaskKind.CAUSAL if att.is_causal else mask
    # the queries this rank holds (the all-to-all takes them sequence-sharded: its heads move
    # inside the op)
    sharded = run in (AttentionRun.RING, AttentionRun.ALL_TO_ALL, AttentionRun.LOCAL)
    return ReportedAttention(
        node=att.node.name,
        run=run,
        form=att.node.meta.get(FORM_NOTE, att.node.target._opname if att.returns_tuple else "sdpa"),
        global_shape=q_shape,
        local_shape=tuple(state.geo.local_shape(q_shape, Seq(2))) if sharded else q_shape,
        mask=mask,
        mask_shape=tuple(shape(att.mask)) if mask is MaskKind.KEPT else None,
        mask_detail=att.node.meta.get(MASK_NOTE, ""),
        layout=state.geo.layout if sharded else None,
        dilation=dilation,
        bytes_per_step=bytes,
        flops=2 * math.prod(q_shape[:-1]) * shape(att.k)[-2] * (q_shape[-1] + shape(att.v)[-1]),
    )


def _dilated(att: Attention, q, k, v, mask, spec: AttentionSpec, state: PassState):
    """The dilated ring op in place of attention (k/v heads repeated for GQA)."""
    if mask is not None:
        raise ValueError(
            "dilated attention replaces the model's attention, but this one has a mask "
            "that is not causal; dilation supports no masks besides causal"
        )
    geo, g = state.geo, state.graph
    spec.dilation.check_ring(geo.local, geo.ring_size, geo.layout)
    heads = shape(q)[1]
    if shape(k)[1] != heads:
        k, v = (
            call(g, aten.repeat_interleave.self_int, (x, heads // shape(x)[1], 1)) for x in (k, v)
        )
    return call(g, ringify_ops.dilated_attention.default, (q, k, v, None, [], geo.length, spec))


def _sinks(att: Attention, state: PassState) -> fx.Node | None:
    """The ring op's ``sinks``, where the attention has them (replicated: each rank's part of
    their gradient is summed over the ring)."""
    if att.sinks is None:
        return None
    if state.sharded(att.sinks):
        raise ValueError(f"{att.node.name}: sink logits that vary along the sequence")
    return state.copy_to_ring(att.sinks)


def _refuse_extras(att: Attention, what: str) -> None:
    if att.sinks is not None or att.softcap:
        raise ValueError(
            f"{att.node.name} has attention sinks or a soft cap, which ringify runs on the ring "
            f"of self-attention only, not in {what}; run this model without ringify"
        )


def _equal_head_dims(att: Attention, state: PassState) -> tuple:
    """q, k and v with one head dim: where v's differs from q's and k's (MLA: 192 and 128),
    the narrower side padded with zeros, which changes no score and no output column (the
    ring's kernels take one head dim, as FA2 does)."""
    width = max(shape(att.q)[-1], shape(att.v)[-1])
    padded = []
    for x in (att.q, att.k, att.v):
        if shape(x)[-1] < width:
            place = state.place.get(x)  # padding the last dim keeps the sequence where it is
            x = call(state.graph, aten.constant_pad_nd.default, (x, [0, width - shape(x)[-1]], 0.0))
            state.place[x] = place
        padded.append(x)
    return tuple(padded)


def _value_columns(out: fx.Node, att: Attention, state: PassState, seq: Seq | None) -> fx.Node:
    """``out``'s first v-head-dim columns (all of them where no head dim was padded)."""
    dv = shape(att.v)[-1]
    if shape(out)[-1] == dv:
        return out
    state.place[out] = seq
    return call(state.graph, aten.slice.Tensor, (out, -1, 0, dv))


def local_mask(mask: fx.Node, state: PassState) -> fx.Node:
    """This rank's query rows of a kept mask, over all (padded) key columns."""
    if state.sharded(mask):
        mask = state.gather(mask)
    mask_shape = shape(mask)
    pad = state.geo.padded - state.geo.length
    if state.geo.pads and mask_shape[-1] > 1:
        with state.graph.inserting_before(state.after(mask)):
            mask = call(state.graph, aten.constant_pad_nd.default, (mask, [0, pad], 0))
    if len(mask_shape) >= 2 and mask_shape[-2] > 1:
        return state.slice(mask, Seq(len(mask_shape) - 2), 0)
    return mask


def _rewrite_program_mask(node: fx.Node, out, state: PassState) -> None:
    """A mask program computed whole (its attention is not a ring): its O(S) inputs are
    gathered."""
    for a in list(node.all_input_nodes):
        if state.sharded(a):
            node.replace_input_with(a, state.gather(a))


RULES = {
    **dict.fromkeys(ATTENTION_OPS, Rule(infer_attention, rewrite_attention)),
    # a mask program whose attention is not a ring (it is gathered, or local): computed whole
    program_mask: Rule(lambda node, place: None, _rewrite_program_mask),
}
