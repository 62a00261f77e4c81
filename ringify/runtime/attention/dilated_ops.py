"""The dilated (LongNet) attention custom ops, over a sequence sharded ``contiguous`` across a ring.

``torch.ops.ringify.dilated_attention(q, k, v, is_causal, scale, group_name,
segment_lengths, dilation_rates) -> (out, lse)``: a custom op with a fake kernel
and autograd, like ``ring_attention``. Rank r holds positions [r*c, (r+1)*c).

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

from ringify.runtime.attention.blocks import block_backward, block_forward, merge_block
from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.attention.ops import ring_attention_backward_op, ring_attention_op
from ringify.runtime.attention.outputs import (
    accumulation_dtype,
    empty_attention_outputs,
    empty_in_dim_order_of,
    in_dim_order_of,
)
from ringify.runtime.collectives.ring import ring_by_name, sub_ring_name


def _pieces(rows: int, heads: int, ring_size: int, segments, rates):
    """Every (w, rate, offset) piece of the pattern, in the same order on every rank."""
    seq = rows * ring_size
    for w, rate in Dilation(tuple(segments), tuple(rates)).pairs(seq):
        for offset in range(min(rate, heads)):
            yield w, rate, offset


def _kept(x: torch.Tensor, rate: int, offset: int, start: int, stop: int) -> torch.Tensor:
    """The rows of heads ``offset::rate`` that a segment starting at local row ``start`` keeps
    (every rate-th from ``start + offset``, up to ``stop``): a strided view, no copy."""
    return x[:, offset::rate, start + offset : stop : rate]


@torch.library.custom_op("ringify::dilated_attention", mutates_args=())
def dilated_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float,
    group_name: str,
    segment_lengths: list[int],
    dilation_rates: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    ring = ring_by_name(group_name)
    b, h, c, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    out = empty_in_dim_order_of(q, acc).zero_()
    lse = torch.full((b, h, c), float("-inf"), dtype=acc, device=q.device)
    for w, rate, o in _pieces(c, h, ring.size, segment_lengths, dilation_rates):
        if w <= c:  # one kernel call per segment, on views: no copies of q, k, v
            for start in range(0, c, w):
                kept = [_kept(x, rate, o, start, start + w) for x in (q, k, v, out, lse)]
                out_o, lse_o = block_forward(*kept[:3], is_causal=is_causal, scale=scale)
                merge_block(kept[3], kept[4], out_o, lse_o)
        else:
            qo, ko, vo = (_kept(x, rate, o, 0, c).contiguous() for x in (q, k, v))
            span = w // c
            out_o, lse_o = ring_attention_op(
                qo, ko, vo, None, is_causal, scale, sub_ring_name(ring, span), "contiguous",
                qo.shape[2] * span, "", [],
            )  # fmt: skip
            merge_block(_kept(out, rate, o, 0, c), _kept(lse, rate, o, 0, c), out_o, lse_o)
    return in_dim_order_of(q, out.to(q.dtype)), lse


@dilated_attention_op.register_fake
def _(q, k, v, is_causal, scale, group_name, segment_lengths, dilation_rates):
    return empty_attention_outputs(q)


@torch.library.custom_op("ringify::dilated_attention_backward", mutates_args=())
def dilated_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float,
    group_name: str,
    segment_lengths: list[int],
    dilation_rates: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = ring_by_name(group_name)
    h, c = q.shape[1:3]
    acc = accumulation_dtype(q.dtype)
    grads = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v)]
    for w, rate, o in _pieces(c, h, ring.size, segment_lengths, dilation_rates):
        if w <= c:
            for start in range(0, c, w):
                kept = [_kept(x, rate, o, start, start + w) for x in (grad_out, q, k, v, out, lse)]
                block = block_backward(*kept, is_causal=is_causal, scale=scale)
                for total, g in zip(grads, block[:3], strict=True):
                    _kept(total, rate, o, start, start + w).add_(g)
        else:
            span = w // c
            pieces = [_kept(x, rate, o, 0, c).contiguous() for x in (grad_out, q, k, v, out, lse)]
            block = ring_attention_backward_op(
                *pieces, None, is_causal, scale, sub_ring_name(ring, span), "contiguous",
                pieces[1].shape[2] * span, "", [],
            )  # fmt: skip
            for total, g in zip(grads, block[:3], strict=True):
                _kept(total, rate, o, 0, c).add_(g)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v), strict=True))


@dilated_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, is_causal, scale, group_name, segments, rates):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, *ctx.flags = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grads = dilated_attention_backward_op(grad_out, q, k, v, out, lse, *ctx.flags)
    return *grads, *([None] * len(ctx.flags))


dilated_attention_op.register_autograd(_backward, setup_context=_setup_context)
