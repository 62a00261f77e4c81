"""Attention of replicated queries to a sharded memory: ``ringify::memory_attention``.

A short sequence (a decoder's, learned latents) attending to a long one that the
ring splits (an encoder output): every rank holds all the queries and its shard of
the keys and values. Each rank attends to its keys with a fused kernel, and the
partial results are merged over the ring by their log-sum-exp, in two all-reduces
(the maximum lse, then the weighted sums). No K/V travel. Backward: each rank's
block gradient with the merged ``out`` and ``lse``; dq is summed over the ring,
dk and dv stay on the rank that holds those keys; a learned mask's gradient is
this rank's columns.

``torch.ops.ringify.memory_attention(q, k, v, attn_mask, [], key_len, spec) -> (out, lse)``
follows the attention ops' protocol (``protocol.py``); it takes no program, plan or sinks.
``key_len``: keys at global positions >= key_len are padding. ``attn_mask`` holds
this rank's key columns (padding columns masked).

A decode step is the same merge: ``ringify::decode_attention`` (below), one new token's
query over a KV cache split across the ring.
"""

from __future__ import annotations

import torch

from ringify.runtime.attention.blocks import (
    bias_backward,
    block_backward,
    block_forward,
    math_forward,
)
from ringify.runtime.attention.protocol import (
    accumulation_dtype,
    attention_ops,
    empty_attention_outputs,
    gradients_of,
    merge_block,
)
from ringify.runtime.attention.sinks import with_sinks
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.collectives.layout import shard_for_rank
from ringify.runtime.collectives.reduce import all_reduce, max_over_ring
from ringify.runtime.collectives.ring import LOCAL, ring_by_name
from ringify.runtime.masks.program import additive_mask, sum_to


def _bias(q, k, attn_mask, key_len: int, spec: AttentionSpec):
    """The additive mask of this rank's keys: ``attn_mask``'s, and -inf at padding."""
    bias = None if attn_mask is None else additive_mask(attn_mask, q.dtype)
    ring = ring_by_name(spec.group_name)
    padded = k.shape[2] * ring.size
    if padded == key_len:
        return bias
    positions = shard_for_rank(
        torch.arange(padded, device=q.device), 0, ring.rank, ring.size, spec.layout
    )
    padding = torch.zeros(1, 1, 1, k.shape[2], dtype=q.dtype, device=q.device)
    padding = padding.masked_fill(positions >= key_len, float("-inf"))
    return padding if bias is None else bias + padding


def _forward(
    q, k, v, attn_mask, mask_inputs, key_len, spec: AttentionSpec, plan=None, sinks=None,
    step_masks=None,
):  # fmt: skip
    if mask_inputs or spec.mask_program or spec.is_causal or spec.softcap:
        raise ValueError("memory_attention takes a mask tensor only: no program, causality or cap")
    if plan is not None or sinks is not None:
        raise ValueError("memory_attention takes no plan and no sinks")
    bias = _bias(q, k, attn_mask, key_len, spec)
    return merged_attention(q, k, v, bias, spec.scale, spec.group_name)


def merged_attention(q, k, v, bias, scale: float, group_name: str):
    """``(out, lse)`` of replicated ``q`` over every rank's ``k``/``v`` (additive ``bias``
    on this rank's keys): each rank's block, merged over the ring (``merge_over_ring``)."""
    out, lse = block_forward(q, k, v, is_causal=False, scale=scale, bias=bias)
    return merge_over_ring(q, out, lse, group_name)


def merge_over_ring(q, out, lse, group_name: str):
    """Every rank's ``(out, lse)`` of the same queries merged by log-sum-exp, in two
    all-reduces. A rank whose keys are all hidden from a row adds nothing to it."""
    if group_name == LOCAL:
        return out, lse
    acc = accumulation_dtype(q.dtype)
    lse = lse.to(acc)
    top = max_over_ring(lse, group_name)
    top = top.masked_fill(top == float("-inf"), 0.0)  # rows no rank's keys are visible to
    weight = torch.exp(lse - top)
    total = all_reduce(
        torch.cat([weight.unsqueeze(-1), weight.unsqueeze(-1) * out.to(acc)], -1), group_name
    )
    seen = total[..., 0] > 0
    merged = torch.where(seen.unsqueeze(-1), total[..., 1:] / total[..., :1], 0.0)
    lse = torch.where(seen, top + total[..., 0].log(), float("-inf"))
    target, _ = empty_attention_outputs(q, out.shape[-1])
    return target.copy_(merged), lse


def _backward(
    grad_out, q, k, v, out, lse, attn_mask, mask_inputs, key_len, spec: AttentionSpec, plan=None,
    sinks=None, step_masks=None, mask_grad=False, input_grads=None,
):  # fmt: skip
    bias = _bias(q, k, attn_mask, key_len, spec)
    block = (grad_out, q, k, v, out, lse)
    dq, dk, dv = block_backward(*block, is_causal=False, scale=spec.scale, bias=bias)
    group = spec.group_name
    dq = dq if group == LOCAL else all_reduce(dq.contiguous(), group)  # laid out on return
    dmask = q.new_empty(0)
    if mask_grad:
        dbias = bias_backward(*block, is_causal=False, scale=spec.scale, bias=bias)
        dmask = sum_to(dbias, attn_mask.shape).to(attn_mask.dtype)
    return *gradients_of((q, k, v), (dq, dk, dv)), dmask, [], q.new_empty(0)


memory_attention_op, memory_attention_backward_op = attention_ops(
    "memory_attention", _forward, _backward
)


def _decode_forward(
    q, k, v, keep, new, key_len, spec: AttentionSpec, plan=None, sinks=None, step_masks=None
):  # fmt: skip
    """One decode step's attention (``ringify/generation/step.py``): the new token's query
    (computed on every rank: one row) over this rank's part of the layer's cache ``k``/``v``
    and, where this rank stores it (``key_len``, its keys that count, is ``k.shape[2] + 1``),
    the new key and value ``new`` (a block of its own, merged in, so that the cache is never
    copied to append it); merged over the ring as ``memory_attention``'s. ``keep``: the mask
    row at this rank's key columns, cached then new (bool: kept; float: added), or None;
    ``sinks`` join each row's softmax once, after the ring's merge. No K/V travel."""
    if plan is not None or step_masks is not None or spec.mask_program or spec.is_causal:
        raise ValueError("decode_attention takes a mask row only: no plan, program or causality")
    cached = k.shape[2]
    out, lse = _decode_block(q, k, v, None if keep is None else keep[..., :cached], spec)
    acc = accumulation_dtype(q.dtype)
    out, lse = out.to(acc), lse.to(acc)
    if key_len > cached:
        kept = None if keep is None else keep[..., cached:]
        merge_block(out, lse, *_decode_block(q, *new, kept, spec))
    out, lse = merge_over_ring(q, out, lse, spec.group_name)
    if sinks is not None:  # once per row, after the ring's merge
        out, lse = with_sinks(out, lse, sinks)
    return empty_attention_outputs(q, v.shape[-1])[0].copy_(out), lse


def _decode_block(q, k, v, keep, spec: AttentionSpec):
    """One block's ``(out, lse)``. With GQA the query heads sharing a kv head are one head's
    rows (a decode row per query head): the kernel reads the cache with its own K heads,
    never a copy expanded to H heads, whatever kernel the device picks. A value head dim
    other than q's (MLA) runs the math formulation: one row of scores, O(cache)."""
    b, h, s, d = q.shape
    kv, dv = k.shape[1], v.shape[-1]
    if s == 1 and h != kv:
        if keep is not None and keep.dim() == 4 and keep.shape[1] == h:
            keep = keep.reshape(keep.shape[0], kv, h // kv, keep.shape[-1])
        out, lse = _decode_block(q.reshape(b, kv, h // kv, d), k, v, keep, spec)
        return out.reshape(b, h, 1, dv), lse.reshape(b, h, 1)
    bias = None if keep is None else additive_mask(keep, q.dtype)
    if dv != d:
        q, k, v = (x.to(accumulation_dtype(q.dtype)) for x in (q, k, v))
        return math_forward(q, k, v, is_causal=False, scale=spec.scale, bias=bias)
    return block_forward(
        q, k, v, is_causal=False, scale=spec.scale, bias=bias, softcap=spec.softcap
    )


def _decode_backward(*args, **kwargs):
    raise NotImplementedError(
        "ringify's decode step has no backward: generate runs it without gradients; to train, "
        "call the ringified model on whole sequences"
    )


decode_attention_op, _ = attention_ops("decode_attention", _decode_forward, _decode_backward)
