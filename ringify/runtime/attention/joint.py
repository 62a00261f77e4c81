"""Attention over a joint sequence: ``ringify::joint_attention``.

Diffusion transformers (SD3, Flux, CogVideoX) attend over text and image tokens put end to
end: keys ``cat(text, image)``. The image part is long and sharded over the ring; the text
part is short and every rank holds it whole. Each query row's softmax runs over both, so
its result is two attentions merged by their log-sum-exp:

- to the sharded keys: the ring (sharded queries, ``ring_attention``) or each rank's part
  merged over the ring (replicated queries, ``memory_attention``);
- to the replicated keys (``extra``): one local block on every rank.

``mask`` and ``mask_extra``: the columns of a mask whose rows broadcast (a padding mask of
the text keys), over the sharded keys (at their global, padded positions for the ring; this
rank's for the memory merge) and over the extra keys.

Backward: each part's gradients from the merged ``out`` and ``lse`` (the blocks' final
probabilities), as the ring does per block. The extra keys' gradient from sharded queries
is this rank's rows' part: the pass sums it over the ring (``copy_to_ring``).
"""

from __future__ import annotations

import torch

from ringify.runtime.attention.blocks import block_backward, block_forward, merge_block
from ringify.runtime.attention.memory import memory_attention_backward_op, memory_attention_op
from ringify.runtime.attention.ops import ring_attention_backward_op, ring_attention_op
from ringify.runtime.attention.protocol import (
    accumulation_dtype,
    empty_attention_outputs,
    empty_gradients_of,
    gradients_of,
    in_dim_order_of,
)
from ringify.runtime.attention.spec import SPEC_TYPE, AttentionSpec
from ringify.runtime.masks.plan import PLAN_TYPE, RingPlan
from ringify.runtime.masks.program import additive_mask

_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor k_extra, Tensor v_extra, SymInt key_len, "
    f"{SPEC_TYPE} spec, bool queries_sharded, Tensor? mask=None, Tensor? mask_extra=None"
)
_PLAN = f"{PLAN_TYPE}? plan=None"  # written out: an optional opaque is beyond infer_schema


@torch.library.custom_op(
    "ringify::joint_attention", mutates_args=(), schema=f"({_ARGS}, {_PLAN}) -> (Tensor, Tensor)"
)
def joint_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_extra: torch.Tensor,
    v_extra: torch.Tensor,
    key_len: int,
    spec: AttentionSpec,
    queries_sharded: bool,
    mask: torch.Tensor | None = None,
    mask_extra: torch.Tensor | None = None,
    plan: RingPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = spec.scale
    if queries_sharded:
        out, lse = ring_attention_op(q, k, v, mask, [], key_len, spec, plan)
    else:
        out, lse = memory_attention_op(q, k, v, mask, [], key_len, spec)
    bias = None if mask_extra is None else additive_mask(mask_extra, q.dtype)
    extra_out, extra_lse = block_forward(
        q, k_extra, v_extra, is_causal=False, scale=scale, bias=bias
    )
    acc = accumulation_dtype(q.dtype)
    out_acc, lse_acc = out.to(acc), lse.to(acc).clone()
    merge_block(out_acc, lse_acc, extra_out, extra_lse)
    return in_dim_order_of(q, out_acc, q.dtype), lse_acc


@joint_attention_op.register_fake
def _(q, k, v, k_extra, v_extra, key_len, spec, sharded, *masks):
    return empty_attention_outputs(q)


@torch.library.custom_op(
    "ringify::joint_attention_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor k_extra, Tensor v_extra, "
        f"Tensor out, Tensor lse, SymInt key_len, {SPEC_TYPE} spec, bool queries_sharded, "
        f"Tensor? mask=None, Tensor? mask_extra=None, {_PLAN}) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
)
def joint_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_extra: torch.Tensor,
    v_extra: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_len: int,
    spec: AttentionSpec,
    queries_sharded: bool,
    mask: torch.Tensor | None = None,
    mask_extra: torch.Tensor | None = None,
    plan: RingPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dk_extra, dv_extra); with sharded queries the extra keys' gradients are
    this rank's rows' part."""
    scale = spec.scale
    op = ring_attention_backward_op if queries_sharded else memory_attention_backward_op
    dq, dk, dv, *_ = op(grad_out, q, k, v, out, lse, mask, [], key_len, spec, plan)
    block = (grad_out, q, k_extra, v_extra, out, lse)
    bias = None if mask_extra is None else additive_mask(mask_extra, q.dtype)
    dq_extra, dk_extra, dv_extra = block_backward(*block, is_causal=False, scale=scale, bias=bias)
    grads = (dq + dq_extra, dk, dv, dk_extra, dv_extra)
    return gradients_of((q, k, v, k_extra, v_extra), grads)


@joint_attention_backward_op.register_fake
def _(grad_out, q, k, v, k_extra, v_extra, out, lse, *flags):
    return empty_gradients_of((q, k, v, k_extra, v_extra))


def _setup_context(ctx, inputs, output):
    q, k, v, k_extra, v_extra, *flags = inputs
    # key_len, spec, sharded; then the masks (padding: no gradient) and the plan, which the
    # call may leave to their defaults
    flags = [*flags, None, None, None][:6]
    ctx.flags, ctx.plan = flags[:3], flags[5]
    ctx.save_for_backward(q, k, v, k_extra, v_extra, *output, *flags[3:5])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_lse):
    *tensors, mask, mask_extra = ctx.saved_tensors
    grads = joint_attention_backward_op(
        grad_out, *tensors, *ctx.flags, mask, mask_extra, plan=ctx.plan
    )
    return *grads, *([None] * (len(ctx.flags) + 3))


joint_attention_op.register_autograd(_backward, setup_context=_setup_context)
