"""The protocol every sequence-sharded attention op follows: one schema, fakes and autograd.

``attention_ops(name, forward, backward)`` registers ``ringify::<name>`` and
``ringify::<name>_backward`` from two plain functions. Every such op takes the same
arguments and returns the same things, so a kind of attention (the ring, dilated, a
replicated query's merge over a sharded memory) is its forward and backward only:

    forward(q, k, v, attn_mask, mask_inputs, key_len, spec, plan=None, sinks=None,
            step_masks=None) -> (out, lse)
    backward(grad_out, q, k, v, out, lse, attn_mask, mask_inputs, key_len, spec, plan=None,
             sinks=None, step_masks=None, mask_grad=False, input_grads=None)
        -> (dq, dk, dv, d attn_mask, d mask_inputs, d sinks)

``spec`` is an ``AttentionSpec`` (``spec.py``); ``plan`` a ``RingPlan`` (``masks/plan.py``);
``step_masks`` the plan's two tensors from ``ringify::step_masks`` (``masks/step_masks.py``)
or None.
d attn_mask is empty unless ``mask_grad`` (a learned bias); d mask_inputs holds a gradient
for each input ``input_grads`` asks for (a learned program), in order; d sinks is empty
without sinks. ``out`` has q's dim order in memory, ``lse`` is contiguous, and dq, dk and
dv have their inputs' dim orders (``outputs.py``), which the fake kernels state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ringify.runtime.attention.outputs import empty_attention_outputs, empty_gradients_of
from ringify.runtime.attention.spec import SPEC_TYPE
from ringify.runtime.masks.plan import PLAN_TYPE

# Written out: an optional opaque argument (the plan) is beyond ``infer_schema``.
_CALL = f"Tensor? attn_mask, Tensor[] mask_inputs, SymInt key_len, {SPEC_TYPE} spec"
_EXTRAS = f"{PLAN_TYPE}? plan=None, Tensor? sinks=None, Tensor[]? step_masks=None"
FORWARD = f"(Tensor q, Tensor k, Tensor v, {_CALL}, {_EXTRAS}) -> (Tensor, Tensor)"
BACKWARD = (
    f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_CALL}, "
    f"{_EXTRAS}, bool mask_grad=False, bool[]? input_grads=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor[], Tensor)"
)
_FORWARD_ARGS = 10  # q, k, v, attn_mask, mask_inputs, key_len, spec, plan, sinks, step_masks


def attention_ops(name: str, forward: Callable, backward: Callable) -> tuple:
    """``(op, backward op)``: ``ringify::<name>`` with its fake and autograd, whose backward
    is ``ringify::<name>_backward``; AOTAutograd and Inductor see each as one opaque node."""
    forward_op = torch.library.custom_op(
        f"ringify::{name}", forward, mutates_args=(), schema=FORWARD
    )
    backward_op = torch.library.custom_op(
        f"ringify::{name}_backward", backward, mutates_args=(), schema=BACKWARD
    )
    forward_op.register_fake(_forward_fake)
    backward_op.register_fake(_backward_fake)
    forward_op.register_autograd(
        functools.partial(_backward, backward_op), setup_context=_setup_context
    )
    return forward_op, backward_op


def _forward_fake(
    q, k, v, attn_mask, mask_inputs, key_len, spec, plan=None, sinks=None, step_masks=None
):
    return empty_attention_outputs(q)


def _backward_fake(
    grad_out, q, k, v, out, lse, attn_mask, mask_inputs, key_len, spec, plan=None, sinks=None,
    step_masks=None, mask_grad=False, input_grads=None,
):  # fmt: skip
    grads = empty_gradients_of((q, k, v))
    dmask = torch.empty_like(attn_mask) if mask_grad else q.new_empty(0)
    wanted = input_grads or [False] * len(mask_inputs)
    dinputs = [torch.empty_like(x) for x, w in zip(mask_inputs, wanted, strict=True) if w]
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return *grads, dmask, dinputs, dsinks


def _setup_context(ctx, inputs, output):
    # the call may leave the plan, the sinks and the step's masks to their defaults
    q, k, v, attn_mask, mask_inputs, ctx.key_len, ctx.spec, ctx.plan, sinks, step_masks = (
        *inputs,
        *[None] * (_FORWARD_ARGS - len(inputs)),
    )
    ctx.input_grads = [x.requires_grad for x in mask_inputs]
    ctx.n_step_masks = None if step_masks is None else len(step_masks)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, sinks, *(step_masks or ()), *mask_inputs)
    ctx.mark_non_differentiable(lse)


def _backward(backward_op, ctx, grad_out, _grad_lse):
    q, k, v, out, lse, attn_mask, sinks, *rest = ctx.saved_tensors
    n_masks = ctx.n_step_masks or 0
    step_masks = None if ctx.n_step_masks is None else rest[:n_masks]
    mask_inputs = rest[n_masks:]
    mask_grad = ctx.needs_input_grad[3]  # a learned bias
    dq, dk, dv, dmask, dinputs, dsinks = backward_op(
        grad_out, q, k, v, out, lse, attn_mask, mask_inputs, ctx.key_len, ctx.spec, ctx.plan,
        sinks, step_masks, mask_grad=mask_grad, input_grads=ctx.input_grads,
    )  # fmt: skip
    given = iter(dinputs)
    learned = [next(given) if want else None for want in ctx.input_grads]
    grads = [dq, dk, dv, dmask if mask_grad else None, learned, None, None, None]
    grads.append(dsinks if sinks is not None and ctx.needs_input_grad[8] else None)
    grads.append(None if step_masks is None else [None] * n_masks)  # the step's masks
    return tuple(grads[: len(ctx.needs_input_grad)])
