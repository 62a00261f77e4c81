"""``ringify::with_zero_grads(x, others)``: ``x``, with a zero gradient for ``others``.

Where the pass splits one op into parts and the model drops a part's result, the inputs
of that part would get no gradient (``None``) where the unmodified op gave them zeros: an
optimizer then skips them (no weight decay, no momentum step). Passing a kept result
through this op gives them their zeros again.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("ringify::with_zero_grads", mutates_args=())
def with_zero_grads_op(x: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    return x.clone()


@with_zero_grads_op.register_fake
def _(x, others):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.others = [(o.shape, o.dtype, o.device) for o in inputs[1]]


def _backward(ctx, grad):
    return grad, [torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.others]


with_zero_grads_op.register_autograd(_backward, setup_context=_setup_context)
with_zero_grads = torch.ops.ringify.with_zero_grads.default
