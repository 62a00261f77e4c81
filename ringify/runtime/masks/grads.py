"""The gradient of a learned mask program (T5's bias table, learned slopes), block by block.

The ring op's backward has each block's dS (``bias_backward``: the gradient of the
mask over that block). This maps it back through the block's program to the
inputs that require a gradient, in reverse over the instructions, by hand: the
op's body runs below autograd, and no S x S graph is ever recorded. Only float
values carry a gradient; comparisons, integer and bool casts, and positions stop
it. The pass keeps a learned mask whose gradient would pass through an op outside
``DIFFERENTIABLE`` (``ringify/passes/folds/mask_programs.py``). The whole-mask op
``program_mask`` (an attention that is not a ring) takes its gradient from here too.
"""

from __future__ import annotations

import torch

from ringify.runtime.masks.program import (
    MaskProgram,
    as_4d,
    input_tiles,
    parse,
    program_mask_op,
    resolve,
    run_op,
    steps,
)

DIFFERENTIABLE = frozenset({
    "cast", "const", "embed", "tril", "triu", "neg.default", "exp.default",
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Scalar",
    "mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar",
    "where.self", "where.ScalarSelf", "where.ScalarOther",
    "masked_fill.Scalar", "masked_fill.Tensor",
})  # fmt: skip


def add_program_grads(
    program: MaskProgram, inputs: list, grads: list, rows: slice, cols: slice, grad_mask
) -> None:
    """Add into ``grads[i]`` (a buffer shaped like ``inputs[i]``, or None: not wanted) the
    gradient of input i, from ``grad_mask``: the gradient of the mask at ``rows`` x ``cols``."""
    device = grad_mask.device
    results = list(steps(program, inputs, rows, cols, device, keep=True))
    tiles = input_tiles(program, inputs, rows, cols)
    into = input_tiles(
        program, [g if g is not None else x for g, x in zip(grads, inputs, strict=True)], rows, cols
    )
    q_pos = torch.arange(rows.start, rows.stop, device=device).view(-1, 1)
    k_pos = torch.arange(cols.start, cols.stop, device=device)
    pending = {len(results) - 1: grad_mask}  # instruction -> the gradient of its result
    for j in reversed(range(len(program.code))):
        g = pending.pop(j, None)
        if g is None:
            continue
        op, args, _ = program.code[j]
        vals = [resolve(a, tiles, results, q_pos, k_pos, lambda x: x) for a in args]
        for a, grad in zip(args, _vjp(op, vals, results[j], g, q_pos, k_pos), strict=True):
            if grad is None or not isinstance(a, dict):
                continue
            if "op" in a and results[a["op"]].is_floating_point():
                grad = _sum_to(grad, results[a["op"]].shape)
                pending[a["op"]] = pending[a["op"]] + grad if a["op"] in pending else grad
            elif "in" in a and grads[a["in"]] is not None:
                view = into[a["in"]]
                view += _sum_to(grad, view.shape).to(view.dtype)


def _vjp(op: str, vals: list, out, g, q_pos, k_pos) -> list:
    """The gradient of each argument of ``op`` (None where none flows), from ``g``."""
    none = [None] * len(vals)
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    if op == "cast":
        return [g if torch.is_tensor(vals[0]) and vals[0].is_floating_point() else None]
    if op in ("tril", "triu"):
        return [run_op(op, [g, vals[1]], g.dtype, q_pos, k_pos, g.device), None]
    if op == "embed":
        table, index = vals
        return [_embedding_grad(table, index, g), None]
    name = op.split(".")[0]
    alpha = vals[2] if len(vals) > 2 else 1
    if name == "add":
        return [g, g * alpha, None][: len(vals)]
    if name == "sub":
        return [g, -g * alpha, None][: len(vals)]
    if name == "rsub":
        return [-g * alpha, None, None][: len(vals)]
    if name == "neg":
        return [-g]
    if name == "exp":
        return [g * out]
    if name == "mul":
        return [g * vals[1], g * vals[0] if torch.is_tensor(vals[1]) else None]
    if name == "div":
        a, b = vals
        return [g / b, -g * a / (b * b) if torch.is_tensor(b) else None]
    if name == "where":  # (condition, where true, where false)
        return [None, torch.where(vals[0], g, zero), torch.where(vals[0], zero, g)]
    if name == "masked_fill":  # (x, mask, value)
        value = torch.where(vals[1], g, zero).sum() if op == "masked_fill.Tensor" else None
        return [torch.where(vals[1], zero, g), None, value]
    return none


def _embedding_grad(table: torch.Tensor, index: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The table's gradient from ``g`` (…, E, rows, cols) of ``embed``'s result."""
    g = _sum_to(g, (1, table.shape[1], *g.shape[-2:]))[0].permute(1, 2, 0)  # rows, cols, E
    index = index.reshape(index.shape[-2:]).expand(g.shape[:2])
    out = torch.zeros(table.shape, dtype=g.dtype, device=g.device)
    return out.index_put_((index,), g, accumulate=True)


def _sum_to(g: torch.Tensor, shape) -> torch.Tensor:
    """``g`` summed over the dims along which ``shape`` was broadcast to reach ``g``'s."""
    shape = tuple(shape)
    lead = g.dim() - len(shape)
    g = g.sum(tuple(range(lead))) if lead > 0 else g.reshape((1,) * -lead + tuple(g.shape))
    dims = tuple(d for d, s in enumerate(shape) if s == 1 and g.shape[d] != 1)
    return (g.sum(dims, keepdim=True) if dims else g).reshape(shape)


def _setup_context(ctx, inputs, output):
    text, mask_inputs, shape, _ = inputs
    ctx.text, ctx.shape = text, shape
    ctx.wanted = [x.requires_grad for x in mask_inputs]
    ctx.save_for_backward(*mask_inputs)


def _backward(ctx, grad):
    """A whole mask's program (an attention that is not a ring): its learned inputs' gradient."""
    inputs = ctx.saved_tensors
    grads = [torch.zeros_like(x) if w else None for x, w in zip(inputs, ctx.wanted, strict=True)]
    if any(ctx.wanted):
        rows, cols = (slice(0, n) for n in ctx.shape[-2:])
        add_program_grads(parse(ctx.text), list(inputs), grads, rows, cols, as_4d(grad))
    return None, grads, None, None


program_mask_op.register_autograd(_backward, setup_context=_setup_context)
