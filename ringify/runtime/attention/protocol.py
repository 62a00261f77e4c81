"""The protocol every sequence-sharded attention op follows: one schema, fakes and autograd.

``attention_ops(name, forward, backward)`` registers ``ringify::<name>`` and
``ringify::<name>_backward`` from two plain functions. Every such op takes the same
arguments and returns the same things, so a kind of attention (the ring, dilated, a
replicated query's merge over a sharded memory, a joint sequence's, a decode step's) is its
forward and backward only:

    forward(q, k, v, attn_mask, inputs, key_len, spec, plan=None, sinks=None,
            step_masks=None) -> (out, lse)
    backward(grad_out, q, k, v, out, lse, attn_mask, inputs, key_len, spec, plan=None,
             sinks=None, step_masks=None, mask_grad=False, input_grads=None)
        -> (dq, dk, dv, d attn_mask, d inputs, d sinks)

``spec`` is an ``AttentionSpec`` (``spec.py``); ``plan`` a ``RingPlan`` (``masks/call_plan.py``);
``step_masks`` the plan's two tensors from ``ringify::step_masks`` (``masks/step_masks.py``)
or None. ``inputs`` are the op's further tensors: a mask program's O(S) inputs (the ring),
the text keys and values (``joint.py``), the new key and value (a decode step).
d attn_mask is empty unless ``mask_grad`` (a learned bias); d inputs holds a gradient
for each input ``input_grads`` asks for, in order; d sinks is empty without sinks. ``out``
has q's dim order in memory (its last dim v's), ``lse`` is contiguous, and dq, dk and dv
have their inputs' dim orders (below), which the fake kernels state.

What a ring call returns and in which dtypes: the accumulation dtype, the bias dtype of a
block's kernel, outputs laid out in q's dim order and gradients in their inputs'.

A ring call's running result: the blocks' ``(out, lse)`` merged by log-sum-exp
(``merge_block``). Merging a block into an empty accumulator (lse = -inf) takes the block
exactly. So the first block that covers every row is taken as the accumulator instead of
being merged into a zeroed one: no zero-filled buffers and no merge to launch (on a GPU,
about a dozen launches per call). Its rows that see no key already hold out = 0 and
lse = -inf (``block_forward``'s contract), as a merge leaves them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ringify.runtime.attention.spec import SPEC_TYPE
from ringify.runtime.attention.transport import ShardRows
from ringify.runtime.masks.call_plan import PLAN_TYPE

# Written out: an optional opaque argument (the plan) is beyond ``infer_schema``.
_CALL = f"Tensor? attn_mask, Tensor[] inputs, SymInt key_len, {SPEC_TYPE} spec"
_EXTRAS = f"{PLAN_TYPE}? plan=None, Tensor? sinks=None, Tensor[]? step_masks=None"
FORWARD = f"(Tensor q, Tensor k, Tensor v, {_CALL}, {_EXTRAS}) -> (Tensor, Tensor)"
BACKWARD = (
    f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_CALL}, "
    f"{_EXTRAS}, bool mask_grad=False, bool[]? input_grads=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor[], Tensor)"
)
_FORWARD_ARGS = 10  # q, k, v, attn_mask, inputs, key_len, spec, plan, sinks, step_masks


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
    q, k, v, attn_mask, inputs, key_len, spec, plan=None, sinks=None, step_masks=None
):
    return empty_attention_outputs(q, v.shape[-1])


def _backward_fake(
    grad_out, q, k, v, out, lse, attn_mask, inputs, key_len, spec, plan=None, sinks=None,
    step_masks=None, mask_grad=False, input_grads=None,
):  # fmt: skip
    grads = empty_gradients_of((q, k, v))
    dmask = torch.empty_like(attn_mask) if mask_grad else q.new_empty(0)
    wanted = input_grads or [False] * len(inputs)
    dinputs = [torch.empty_like(x) for x, w in zip(inputs, wanted, strict=True) if w]
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return *grads, dmask, dinputs, dsinks


def _setup_context(ctx, inputs, output):
    # the call may leave the plan, the sinks and the step's masks to their defaults
    q, k, v, attn_mask, tensors, ctx.key_len, ctx.spec, ctx.plan, sinks, step_masks = (
        *inputs,
        *[None] * (_FORWARD_ARGS - len(inputs)),
    )
    ctx.input_grads = [x.requires_grad for x in tensors]
    ctx.n_step_masks = None if step_masks is None else len(step_masks)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, sinks, *(step_masks or ()), *tensors)
    ctx.mark_non_differentiable(lse)


def _backward(backward_op, ctx, grad_out, _grad_lse):
    q, k, v, out, lse, attn_mask, sinks, *rest = ctx.saved_tensors
    n_masks = ctx.n_step_masks or 0
    step_masks = None if ctx.n_step_masks is None else rest[:n_masks]
    inputs = rest[n_masks:]
    mask_grad = ctx.needs_input_grad[3]  # a learned bias
    dq, dk, dv, dmask, dinputs, dsinks = backward_op(
        grad_out, q, k, v, out, lse, attn_mask, inputs, ctx.key_len, ctx.spec, ctx.plan,
        sinks, step_masks, mask_grad=mask_grad, input_grads=ctx.input_grads,
    )  # fmt: skip
    given = iter(dinputs)
    learned = [next(given) if want else None for want in ctx.input_grads]
    grads = [dq, dk, dv, dmask if mask_grad else None, learned, None, None, None]
    grads.append(dsinks if sinks is not None and ctx.needs_input_grad[8] else None)
    grads.append(None if step_masks is None else [None] * n_masks)  # the step's masks
    return tuple(grads[: len(ctx.needs_input_grad)])


DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks are merged in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bias_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype a block's bias is made in, once, for its kernel: q's own where the kernel adds
    a bias in q's dtype (CUDA's efficient kernel, for fp16/bf16: half the bytes a step keeps,
    and no conversion per call), else the accumulation dtype (the CPU kernels compute in it)."""
    if q.device.type != "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        return q.dtype
    return accumulation_dtype(q.dtype)


def empty_in_dim_order_of(
    q: torch.Tensor, dtype: torch.dtype, last: int | None = None
) -> torch.Tensor:
    """An empty tensor shaped like ``q`` (its last dim ``last`` where given: a value head dim
    other than q's) whose dims lie in memory in q's order (by stride), densely: unlike
    ``empty_like``, also for a q that is a strided slice of a bigger tensor."""
    if last is None or last == q.shape[-1]:
        return torch.empty_strided(q.shape, _dense_strides(q), dtype=dtype, device=q.device)
    shape = (*q.shape[:-1], last)
    strides = _dense_strides_of(shape, q.stride())
    return torch.empty_strided(shape, strides, dtype=dtype, device=q.device)


def in_dim_order_of(
    q: torch.Tensor, out: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``out`` in q's dim order (``empty_in_dim_order_of``) and in ``dtype`` (default its
    own): itself if it already is (strides compared without allocating: nothing launched),
    else a copy."""
    dtype = out.dtype if dtype is None else dtype
    if out.dtype == dtype and is_in_dim_order_of(q, out):
        return out
    return empty_in_dim_order_of(q, dtype).copy_(out)


def is_in_dim_order_of(q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` (q's shape) lies densely in memory in q's dim order."""
    return out.stride() == _dense_strides(q)


def _dense_strides(q: torch.Tensor) -> tuple[int, ...]:
    """The strides of a dense tensor of q's shape whose dims lie in memory in q's order."""
    shape, stride = tuple(q.shape), q.stride()
    try:
        return _kept_dense_strides(shape, stride)
    except TypeError:  # symbolic sizes are not hashable
        return _dense_strides_of(shape, stride)


def _dense_strides_of(shape: tuple, stride: tuple) -> tuple:
    order = sorted(range(len(shape)), key=lambda d: -stride[d])  # outermost first; stable
    strides, size = [0] * len(shape), 1
    for d in reversed(order):
        strides[d], size = size, size * shape[d]
    return tuple(strides)


_kept_dense_strides = functools.lru_cache(maxsize=256)(_dense_strides_of)  # asked in every call


def empty_attention_outputs(
    q: torch.Tensor, value_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(out, lse)`` as the attention ops return them: ``out`` in q's dim order (its
    last dim ``value_dim`` where v's differs from q's), ``lse`` (B, H, S) in the accumulation
    dtype. The ops' fake kernels are this, so the graph pass, which fills ``meta["val"]``
    from the fake kernels, states shapes exactly once."""
    lse = q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))
    return empty_in_dim_order_of(q, q.dtype, value_dim), lse


def gradients_of(
    inputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """Each gradient in its input's dtype and dim order, as SDPA's backward gives them: a model's
    q, k and v are views of its projections, (B, S, H, D) in memory, and a gradient laid out so
    goes back through their transpose and reshape without a copy. Itself where it already is."""
    return tuple(in_dim_order_of(x, g, x.dtype) for x, g in zip(inputs, grads, strict=True))


def empty_gradients_of(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Empty gradients as ``gradients_of`` lays them out (the backward ops' fakes)."""
    return tuple(empty_in_dim_order_of(x, x.dtype) for x in inputs)


class Accumulator:
    """The merged ``(out, lse)`` of a call's query rows ``q`` (rows on dim 2), in ``dtype``:
    ``out`` in q's dim order, ``lse`` (B, H, S) dense, as the ring op returns them."""

    def __init__(self, q: torch.Tensor, dtype: torch.dtype):
        self._q, self._dtype = q, dtype
        self._out: ShardRows | None = None
        self._lse: ShardRows | None = None

    def merge(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold the block of query rows ``rows`` in."""
        if self._out is None and rows.start == 0 and rows.stop == self._q.shape[2]:
            out = in_dim_order_of(self._q, out, self._dtype)  # itself where it already is
            self._out, self._lse = ShardRows(out), ShardRows(dense(lse, self._dtype))
            return
        if self._out is None:
            self._start_empty()
        merge_block(self._out[rows], self._lse[rows], out, lse)

    def results(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` in the accumulation dtype (empty rows: 0 and -inf)."""
        if self._out is None:  # no block had work: every row saw nothing
            self._start_empty()
        return self._out.tensor, self._lse.tensor

    def _start_empty(self) -> None:
        q = self._q
        out = empty_in_dim_order_of(q, self._dtype).zero_()
        lse = torch.full(q.shape[:3], float("-inf"), dtype=self._dtype, device=q.device)
        self._out, self._lse = ShardRows(out), ShardRows(lse)


class RowSum:
    """A sum of blocks of rows (dim 2) of a tensor shaped ``shape``, in ``dtype``, dense: a
    call's dQ, a slot's dK/dV on its way round the ring (``start``: the total arriving, added
    to in place), or its dK/dV arriving home. With no ``start``, the first block that covers
    every row is taken as the sum (0 + x is x), so that no zeroed buffer is filled and
    added to. ``like``: the sum lies in that tensor's dim order (a call's dQ in q's, which the
    kernels' dQ blocks have), else dense."""

    def __init__(
        self, shape, dtype: torch.dtype, device: torch.device, start: torch.Tensor | None = None,
        like: torch.Tensor | None = None,
    ):  # fmt: skip
        self._shape, self._dtype, self._device, self._like = shape, dtype, device, like
        self._sum = None if start is None else ShardRows(start)

    def add(self, rows: slice, grad: torch.Tensor) -> None:
        """Add ``grad`` into rows ``rows``."""
        if self._sum is None and rows.start == 0 and rows.stop == self._shape[2]:
            like = self._like
            taken = (
                dense(grad, self._dtype)
                if like is None
                else in_dim_order_of(like, grad, self._dtype)
            )
            self._sum = ShardRows(taken)
            return
        if self._sum is None:
            self._sum = ShardRows(self._zeros())
        self._sum[rows].add_(grad)

    def result(self) -> torch.Tensor:
        """The sum (zero where nothing was added)."""
        return self._zeros() if self._sum is None else self._sum.tensor

    def _zeros(self) -> torch.Tensor:
        if self._like is None:
            return torch.zeros(self._shape, dtype=self._dtype, device=self._device)
        return empty_in_dim_order_of(self._like, self._dtype).zero_()


def dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` contiguous in ``dtype``: itself where it already is, else one copy. (``Tensor.to``
    with ``memory_format=torch.contiguous_format`` returns a tensor of the same dtype as it is,
    strided or not.)"""
    if x.dtype != dtype:
        return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)
    return x if x.is_contiguous() else x.contiguous()


def unit_last_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fused kernels read the head dim as contiguous memory (SDPA copies first, too):
    a k stored head-dim-major and transposed, or a channels-last q, would be misread."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def merge_block(
    out_acc_BHsD: torch.Tensor,
    lse_acc_BHs: torch.Tensor,
    out_BHsD: torch.Tensor,
    lse_BHs: torch.Tensor,
) -> None:
    """Fold one block's ``(out, lse)`` into the running accumulators, in place.

    out = (e^lse_acc * out_acc + e^lse * out) / (e^lse_acc + e^lse), written with the
    weights sigmoid(lse_acc - lse) and sigmoid(lse - lse_acc), so that nothing is
    exponentiated unguarded and each side is scaled by its own weight (an inf in
    either side stays inf, as in SDPA; a NaN stays NaN). An empty accumulator
    (lse_acc = -inf) takes the block exactly (its weight 0); an empty block row
    (lse = -inf, a masked-out row) leaves it as it is; when both are empty the
    accumulator stays 0.
    """
    acc = out_acc_BHsD.dtype
    lse_BHs = lse_BHs.to(acc)
    both_empty = (lse_BHs == float("-inf")) & (lse_acc_BHs == float("-inf"))
    keep = torch.sigmoid(lse_acc_BHs - lse_BHs).masked_fill_(both_empty, 1.0).unsqueeze(-1)
    take = torch.sigmoid(lse_BHs - lse_acc_BHs).masked_fill_(both_empty, 0.0).unsqueeze(-1)
    out_acc_BHsD.mul_(keep).addcmul_(out_BHsD.to(acc), take)
    torch.logaddexp(lse_acc_BHs, lse_BHs, out=lse_acc_BHs)
