"""Mamba-1's selective scan as one op, on one device and along a sequence sharded over the ring.

The recurrence, for a, b of shape (B, D, S, N), c of shape (B, S, N) and a state h0
(B, D, N) or zeros::

    h[:, :, t] = a[:, :, t] * h[:, :, t - 1] + b[:, :, t]
    y[:, :, t] = (h[:, :, t] * c[:, None, t]).sum(-1)            y: (B, D, S)

is what the torch path of HF's Mamba-1 mixers (Mamba, FalconMamba, Jamba, Zamba) computes
with a Python loop over positions, which ``torch.export`` unrolls; ``passes/folds/scans.py``
folds the unrolled loop back into ``selective_scan``.

``ringify::selective_scan`` computes it without a loop per position: positions go in
blocks of about sqrt(S), every block advanced at once, one loop step per position of a
block (about 10 sqrt(S) small kernels a call, not S). Each block is first run from zero for
its last state and its product of ``a``; the blocks' states on entry follow from those in
order; then each block runs again from its state on entry. Within a block the arithmetic
is the model's loop's own; across blocks it is reassociated. The forward makes nothing of
the size of ``a`` (it keeps one step's states, (B, D, blocks, N)), and the backward
recomputes the states, as Mamba's CUDA kernel does, into the buffer that becomes a's
gradient.

``ring_selective_scan`` is the same over a sharded sequence, by state passing, not a gather:
each chunk's product of ``a`` and its last state from zero are gathered (B x D x N numbers
per chunk), every chunk's carried-in state follows from those in global order, and each
chunk runs the scan from it. The backward flows back through the same gather.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ringify.runtime.collectives.layout import chunks_per_rank
from ringify.runtime.collectives.sharding import gather_op, take_shard_op


def selective_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``y`` of the recurrence from a zero state, on a full sequence (the folded graph's node)."""
    return selective_scan_op(a, b, c, None, state_dtype, out_dtype)[0]


def ring_selective_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state_dtype: torch.dtype,
    out_dtype: torch.dtype,
    padded: int,
    length: int,
    group_name: str,
    layout: str,
) -> torch.Tensor:
    """``selective_scan`` of the full (padded) sequence of ``length`` positions, this rank's
    positions of it; a, b and c hold this rank's chunks along dims 2, 2 and 1."""
    if padded != length:  # the padding: a = b = c = 0, so nothing crosses it either way
        positions = take_shard_op(torch.arange(padded, device=a.device), 0, group_name, layout)
        real = (positions < length).view(-1, 1)
        a, b = (
            torch.where(real, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in (a, b)
        )
        c = torch.where(real, c, torch.zeros((), dtype=c.dtype, device=c.device))
    per_rank = chunks_per_rank(layout)
    chunks = list(
        zip(a.chunk(per_rank, 2), b.chunk(per_rank, 2), c.chunk(per_rank, 1), strict=True)
    )
    # each chunk's product of a, and its last state from zero: how it maps a state on entry
    # to its state on exit, gathered in the sequence's global chunk order
    products = torch.stack([ai.to(state_dtype).prod(2) for ai, _, _ in chunks], 2)
    lasts = torch.stack(
        [selective_scan_op(ai, bi, None, None, state_dtype, out_dtype)[1] for ai, bi, _ in chunks],
        2,
    )
    products = gather_op(products, 2, group_name, layout)
    lasts = gather_op(lasts, 2, group_name, layout)
    entering = [torch.zeros_like(lasts[:, :, 0])]
    for k in range(lasts.shape[2] - 1):
        entering.append(products[:, :, k] * entering[-1] + lasts[:, :, k])
    mine = take_shard_op(torch.stack(entering, 2), 2, group_name, layout)
    outs = [
        selective_scan_op(ai, bi, ci, mine[:, :, j], state_dtype, out_dtype)[0]
        for j, (ai, bi, ci) in enumerate(chunks)
    ]
    return torch.cat(outs, 2)


def _blocks(length: int) -> tuple[int, int]:
    """(positions per block, positions padded at the end): a divisor of ``length`` near its
    square root where one is, so that nothing is padded (a padded tail copies a and b)."""
    root = max(1, math.isqrt(length))
    block = next((d for d in range(root, root // 4, -1) if length % d == 0), root)
    return block, -length % block


def _in_blocks(x: torch.Tensor, dim: int, block: int, tail: int, fill: float = 0.0):
    """``x`` with ``dim`` split into (blocks, block): a view, unless a tail is padded (with
    ``fill``: a = 1 and b = 0 carry the last state through unchanged)."""
    if tail:
        x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, tail], value=fill)
    return x.unflatten(dim, (x.shape[dim] // block, block))


def _entries(a, b, h0, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's state on entry (B, D, blocks, N), and the state after the last position;
    a, b: (B, D, blocks, block, N)."""
    last, product = b[:, :, :, 0].to(dtype), a[:, :, :, 0].to(dtype)
    for t in range(1, a.shape[3]):
        step = a[:, :, :, t].to(dtype)
        last = step * last + b[:, :, :, t]
        product = product * step
    entry = torch.zeros_like(last[:, :, 0]) if h0 is None else h0.to(dtype)
    entries = []
    for k in range(a.shape[2]):
        entries.append(entry)
        entry = product[:, :, k] * entry + last[:, :, k]
    return torch.stack(entries, 2), entry


@torch.library.custom_op("ringify::selective_scan", mutates_args=())
def selective_scan_op(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    h0: torch.Tensor | None,
    state_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, the last state)``; the states in ``state_dtype`` (the model's type promotion of
    a, b and its initial state), ``y`` in ``out_dtype``. With ``c`` ``None``, ``y`` is empty,
    (B, D, 0): the last state alone is asked for."""
    length = a.shape[2]
    block, tail = _blocks(length)
    a5, b5 = _in_blocks(a, 2, block, tail, 1.0), _in_blocks(b, 2, block, tail)
    entries, last = _entries(a5, b5, h0, state_dtype)
    if c is None:
        return a.new_empty((*a.shape[:2], 0), dtype=out_dtype), last
    c4 = _in_blocks(c, 1, block, tail)
    y = a.new_empty(a5.shape[:4], dtype=out_dtype)
    h = entries
    for t in range(block):  # each position's state, from each block's state on entry
        h = a5[:, :, :, t] * h + b5[:, :, :, t]
        y[:, :, :, t] = (h.to(out_dtype) * c4[:, None, :, t]).sum(-1)
    return y.flatten(2, 3).narrow(2, 0, length).clone(), last


@selective_scan_op.register_fake
def _(a, b, c, h0, state_dtype, out_dtype):
    batch, channels, length, state = a.shape
    return (
        a.new_empty((batch, channels, 0 if c is None else length), dtype=out_dtype),
        a.new_empty((batch, channels, state), dtype=state_dtype),
    )


def _setup(ctx, inputs, output):
    a, b, c, h0, ctx.state_dtype, ctx.out_dtype = inputs
    ctx.save_for_backward(a, b, c, h0)


def _backward(ctx, grad_y, grad_last):
    """The adjoint ``g[t] = dL/dh[t] + a[t + 1] * g[t + 1]`` runs backward in blocks, as the
    forward runs forward; each state, once read, is overwritten by ``g[t] * h[t - 1]``."""
    a, b, c, h0 = ctx.saved_tensors
    dtype, out_dtype = ctx.state_dtype, ctx.out_dtype
    length = a.shape[2]
    block, tail = _blocks(length)
    a5, b5 = _in_blocks(a, 2, block, tail, 1.0), _in_blocks(b, 2, block, tail)
    entries, _ = _entries(a5, b5, h0, dtype)
    states = torch.empty(a5.shape, dtype=dtype, device=a.device)
    h = entries
    for t in range(block):
        h = a5[:, :, :, t] * h + b5[:, :, :, t]
        states[:, :, :, t] = h
    with_y = grad_y is not None and c is not None
    if with_y:
        c4, gy = _in_blocks(c, 1, block, tail), _in_blocks(grad_y, 2, block, tail)
        grad_c = torch.empty(c4.shape, dtype=out_dtype, device=a.device)
    zero = torch.zeros_like(entries)
    outside = zero.clone()  # dL/dh from beyond the loop: the last state's
    if grad_last is not None:
        outside[:, :, -1] = grad_last

    def direct(t):  # dL/dh[t] through y[t], and at a block's end what comes from outside
        own = (gy[:, :, :, t, None] * c4[:, None, :, t]).to(dtype) if with_y else zero
        return own + outside if t == block - 1 else own

    # each block from zero on its right: its adjoint at its first position and the product
    # of a over its later positions; then what flows into each block from the next one
    g, product = direct(block - 1), torch.ones_like(entries)
    for t in range(block - 2, -1, -1):
        step = a5[:, :, :, t + 1].to(dtype)
        g, product = direct(t) + step * g, product * step
    flowing = [torch.zeros_like(entries[:, :, 0])]
    for k in range(a5.shape[2] - 1, 0, -1):
        first = product[:, :, k] * flowing[-1] + g[:, :, k]
        flowing.append(a5[:, :, k, 0].to(dtype) * first)
    g = torch.stack(flowing[::-1], 2)
    grad_b = torch.empty_like(states)
    for t in range(block - 1, -1, -1):
        g = direct(t) + (g if t == block - 1 else a5[:, :, :, t + 1] * g)
        grad_b[:, :, :, t] = g
        if with_y:
            grad_c[:, :, t] = (gy[:, :, :, t, None] * states[:, :, :, t].to(out_dtype)).sum(1)
        states[:, :, :, t] = g * (states[:, :, :, t - 1] if t else entries)  # a's gradient
    grad_h0 = None if h0 is None else (a5[:, :, 0, 0] * g[:, :, 0]).to(h0.dtype)

    def unblocked(x, dim, like):
        return x.flatten(dim, dim + 1).narrow(dim, 0, length).to(like.dtype)

    grad_c = unblocked(grad_c, 1, c) if with_y else None
    return unblocked(states, 2, a), unblocked(grad_b, 2, b), grad_c, grad_h0, None, None


selective_scan_op.register_autograd(_backward, setup_context=_setup)
