"""Attention over a joint sequence: ``ringify::joint_attention`` and ``ringify::joint_memory_attention``.

Diffusion transformers (SD3, Flux, CogVideoX) attend over text and image tokens put end to
end: keys ``cat(text, image)``. The image part is long and sharded over the ring; the text
part is short and every rank holds it whole. Each query row's softmax runs over both, so
its result is two attentions merged by their log-sum-exp:

- to the sharded keys: the ring (sharded queries, ``joint_attention`` over ``ring_attention``)
  or each rank's part merged over the ring (replicated queries, ``joint_memory_attention``
  over ``memory_attention``);
- to the replicated keys: one local block on every rank.

Both follow the attention ops' protocol (``protocol.py``): ``attn_mask`` is the sharded
part's op's own, and ``mask_inputs`` are ``[k_text, v_text]``, then the columns of a mask
over the text keys where there is one (its rows broadcast: a padding mask); their gradients
come back as the protocol's input gradients. With sharded queries the text keys' gradient is
this rank's rows' part: the pass sums it over the ring (``copy_to_ring``).

Backward: each part's gradients from the merged ``out`` and ``lse`` (the blocks' final
probabilities), as the ring does per block.
"""

from __future__ import annotations

from ringify.runtime.attention.blocks import bias_backward, block_backward, block_forward
from ringify.runtime.attention.memory_attention import (
    memory_attention_backward_op,
    memory_attention_op,
)
from ringify.runtime.attention.ops import ring_attention_backward_op, ring_attention_op
from ringify.runtime.attention.protocol import (
    accumulation_dtype,
    attention_ops,
    gradients_of,
    in_dim_order_of,
    merge_block,
)
from ringify.runtime.attention.sinks import sink_grad, with_sinks
from ringify.runtime.masks.program import additive_mask, sum_to


def _joint(part, part_backward):
    """The protocol's forward and backward of queries over ``part``'s sharded keys and the
    text keys given as ``mask_inputs``."""

    def forward(q, k, v, attn_mask, text, key_len, spec, plan=None, sinks=None, step_masks=None):
        out, lse = part(q, k, v, attn_mask, [], key_len, spec, plan, None, step_masks)
        k_text, v_text, *mask = text
        bias = additive_mask(mask[0], q.dtype) if mask else None
        block = block_forward(q, k_text, v_text, is_causal=False, scale=spec.scale, bias=bias)
        acc = accumulation_dtype(q.dtype)
        out, lse = out.to(acc), lse.to(acc)  # the part's own: merged into in place
        merge_block(out, lse, *block)
        if sinks is not None:  # once per row, over both parts
            out, lse = with_sinks(out, lse, sinks)
        return in_dim_order_of(q, out, q.dtype), lse

    def backward(
        grad_out, q, k, v, out, lse, attn_mask, text, key_len, spec, plan=None, sinks=None,
        step_masks=None, mask_grad=False, input_grads=None,
    ):  # fmt: skip
        dq, dk, dv, dmask, _, _ = part_backward(
            grad_out, q, k, v, out, lse, attn_mask, [], key_len, spec, plan, None, step_masks,
            mask_grad=mask_grad,
        )  # fmt: skip
        k_text, v_text, *mask = text
        bias = additive_mask(mask[0], q.dtype) if mask else None
        block = (grad_out, q, k_text, v_text, out, lse)
        dq_text, *dkv_text = block_backward(*block, is_causal=False, scale=spec.scale, bias=bias)
        dtext = list(gradients_of((k_text, v_text), tuple(dkv_text)))
        wanted = input_grads or [False] * len(text)
        if mask and wanted[2]:  # a learned bias over the text keys
            dbias = bias_backward(*block, is_causal=False, scale=spec.scale, bias=bias)
            dtext.append(sum_to(dbias, mask[0].shape).to(mask[0].dtype))
        dsinks = q.new_empty(0) if sinks is None else sink_grad(grad_out, out, lse, sinks)
        grads = gradients_of((q, k, v), (dq + dq_text, dk, dv))
        return *grads, dmask, [d for d, w in zip(dtext, wanted, strict=False) if w], dsinks

    return forward, backward


joint_attention_op, joint_attention_backward_op = attention_ops(
    "joint_attention", *_joint(ring_attention_op, ring_attention_backward_op)
)
joint_memory_attention_op, joint_memory_attention_backward_op = attention_ops(
    "joint_memory_attention", *_joint(memory_attention_op, memory_attention_backward_op)
)
