"""The dilated (LongNet) attention custom ops, over a sequence sharded ``contiguous`` across a ring.

``torch.ops.ringify.dilated_attention(q, k, v, None, [], key_len, spec) -> (out, lse)``
follows the attention ops' protocol (``protocol.py``), its pattern ``spec.dilation``; it
takes no mask, plan or sinks. Rank r holds positions [r*c, (r+1)*c).

For each pair (w, rate) and each head offset o (heads o, o+rate, ...), the kept
positions of a segment are every rate-th one from o:
- w <= c: every segment lies inside this rank's chunk: one fused kernel call per
  segment on strided views of q, k, v, and no communication at all;
- w > c: a segment spans g = w / c ranks. Those ranks form a sub-ring (a process
  group of g consecutive ranks) and run ``ring_attention`` on their kept rows only,
  so 1/rate of the dense K/V bytes travel.
Each (pair, offset) result is merged into the output by log-sum-exp, which is
exactly the LongNet combination. The merged output is attention over the union of
every pair's keys, so the backward is each pair's block backward (or sub-ring
backward) given the merged ``out`` and ``lse``, as for ring blocks.
"""

from __future__ import annotations

import torch

from ringify.runtime.attention.blocks import block_backward, block_forward
from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.attention.ops import ring_attention_backward_op, ring_attention_op
from ringify.runtime.attention.protocol import (
    accumulation_dtype,
    attention_ops,
    empty_in_dim_order_of,
    gradients_of,
    in_dim_order_of,
    merge_block,
)
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.collectives.ring import ring_by_name, sub_ring_name


def _pieces(rows: int, heads: int, ring_size: int, dilation: Dilation):
    """Every (w, rate, offset) piece of the pattern, in the same order on every rank."""
    for w, rate in dilation.pairs(rows * ring_size):
        for offset in range(min(rate, heads)):
            yield w, rate, offset


def _kept(x: torch.Tensor, rate: int, offset: int, start: int, stop: int) -> torch.Tensor:
    """The rows of heads ``offset::rate`` that a segment starting at local row ``start`` keeps
    (every rate-th from ``start + offset``, up to ``stop``): a strided view, no copy."""
    return x[:, offset::rate, start + offset : stop : rate]


def _forward(
    q, k, v, attn_mask, mask_inputs, key_len, spec: AttentionSpec, plan=None, sinks=None,
    step_masks=None,
):  # fmt: skip
    _check_plain(attn_mask, mask_inputs, plan, sinks, spec)
    ring = ring_by_name(spec.group_name)
    b, h, c, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    out = empty_in_dim_order_of(q, acc).zero_()
    lse = torch.full((b, h, c), float("-inf"), dtype=acc, device=q.device)
    causal, scale = spec.is_causal, spec.scale
    for w, rate, o in _pieces(c, h, ring.size, spec.dilation):
        if w <= c:  # one kernel call per segment, on views: no copies of q, k, v
            for start in range(0, c, w):
                kept = [_kept(x, rate, o, start, start + w) for x in (q, k, v, out, lse)]
                out_o, lse_o = block_forward(*kept[:3], is_causal=causal, scale=scale)
                merge_block(kept[3], kept[4], out_o, lse_o)
        else:
            qo, ko, vo = (_kept(x, rate, o, 0, c).contiguous() for x in (q, k, v))
            span = w // c  # the segment's ranks: a sub-ring, on the kept rows only
            sub = _sub_ring(spec, ring, span)
            out_o, lse_o = ring_attention_op(qo, ko, vo, None, [], qo.shape[2] * span, sub)
            merge_block(_kept(out, rate, o, 0, c), _kept(lse, rate, o, 0, c), out_o, lse_o)
    return in_dim_order_of(q, out.to(q.dtype)), lse


def _backward(
    grad_out, q, k, v, out, lse, attn_mask, mask_inputs, key_len, spec: AttentionSpec, plan=None,
    sinks=None, step_masks=None, mask_grad=False, input_grads=None,
):  # fmt: skip
    ring = ring_by_name(spec.group_name)
    h, c = q.shape[1:3]
    acc = accumulation_dtype(q.dtype)
    # summed in the inputs' dim orders: a float32 model-layout q's dq is returned as it is
    grads = [empty_in_dim_order_of(x, acc).zero_() for x in (q, k, v)]
    causal, scale = spec.is_causal, spec.scale
    for w, rate, o in _pieces(c, h, ring.size, spec.dilation):
        if w <= c:
            for start in range(0, c, w):
                kept = [_kept(x, rate, o, start, start + w) for x in (grad_out, q, k, v, out, lse)]
                block = block_backward(*kept, is_causal=causal, scale=scale)
                for total, g in zip(grads, block[:3], strict=True):
                    _kept(total, rate, o, start, start + w).add_(g)
        else:
            pieces = [_kept(x, rate, o, 0, c).contiguous() for x in (grad_out, q, k, v, out, lse)]
            span = w // c
            sub = _sub_ring(spec, ring, span)
            block = ring_attention_backward_op(*pieces, None, [], pieces[1].shape[2] * span, sub)
            for total, g in zip(grads, block[:3], strict=True):
                _kept(total, rate, o, 0, c).add_(g)
    return *gradients_of((q, k, v), grads), q.new_empty(0), [], q.new_empty(0)


def _sub_ring(spec: AttentionSpec, ring, span: int) -> AttentionSpec:
    """A segment's dense ring: the ``span`` consecutive ranks it covers."""
    return AttentionSpec(sub_ring_name(ring, span), spec.scale, spec.is_causal)


def _check_plain(attn_mask, mask_inputs, plan, sinks, spec: AttentionSpec) -> None:
    given = (attn_mask, plan, sinks)
    if spec.dilation is None or mask_inputs or any(x is not None for x in given):
        raise ValueError(
            "dilated_attention takes a spec with a dilation and no mask, plan or sinks "
            "(is_causal=True is supported)"
        )


dilated_attention_op, dilated_attention_backward_op = attention_ops(
    "dilated_attention", _forward, _backward
)
