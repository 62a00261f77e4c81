"""The ring-attention custom ops: exact SDPA over a sequence sharded across the ranks of a ring.

``torch.ops.ringify.ring_attention(q, k, v, attn_mask, is_causal, scale, group_name,
layout, key_len, tiles_per_chunk=0) -> (out, lse)`` is a custom op with a fake
kernel and autograd, whose backward is the custom op
``ringify::ring_attention_backward``; AOTAutograd and Inductor see each as one
opaque node. Output strides are a function of q's, so the fake kernels can state
them: ``out`` has q's dim order in memory, as ATen's CPU flash kernel returns it
(for a model's q, a view of (B, S, H, D), a following
``out.transpose(1, 2).reshape(B, S, H * D)`` is then free); ``lse`` and the
gradients are contiguous.

Shapes: q_BHSD is this rank's query shard (S = local rows), k_BKSD / v_BKSD its
key/value shard with K kv heads (H % K == 0: GQA/MQA travel unexpanded).

``key_len``: keys at global positions >= key_len are padding and are cut off.
``tiles_per_chunk``: 0 lets the op choose (``schedule.py``); tests and benchmarks
force a tiling with it.

Forward, P ranks: the K/V tiles of each sub-ring (see ``tiles.py``) travel round
the ring for P-1 steps; at step i this rank holds the tiles of rank
(rank - i) mod P, attends to them from each of its query tiles with a fused
kernel while the next tiles are already in flight, and merges the results into
float32 accumulators by log-sum-exp.
Backward: K/V tiles travel again; the dK/dV accumulator of each tile travels
with it, every rank adds its contribution, and after P steps it arrives home.
"""

from __future__ import annotations

import torch

from ringify.runtime.block_attention import (
    accumulation_dtype,
    bias_backward,
    block_backward,
    block_forward,
    empty_attention_outputs,
    empty_in_dim_order_of,
    in_dim_order_of,
    merge_block,
)
from ringify.runtime.p2p import start_rotation
from ringify.runtime.ring import Ring, ring_by_name
from ringify.runtime.schedule import (
    needs_positions,
    ring_visits,
    shard_tiles,
    tile_bias,
    tile_of,
    tile_pairs,
)

_DKV_TAG = 1


def _tiling(ring: Ring, q, attn_mask, is_causal: bool, layout: str, key_len: int, per_chunk: int):
    """``rank -> that rank's tiles`` for this call (the same function on every rank)."""
    rows = q.shape[2]
    positional = needs_positions(attn_mask, is_causal, key_len, rows * ring.size)
    return lambda rank: shard_tiles(rank, ring.size, rows, layout, positional, per_chunk)


@torch.library.custom_op("ringify::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    group_name: str,
    layout: str,
    key_len: int,
    tiles_per_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    ring = ring_by_name(group_name)
    acc = accumulation_dtype(q.dtype)
    rows = q.shape[2]
    if ring.size == 1 and attn_mask is None and key_len >= rows:
        out, lse = block_forward(q, k, v, is_causal=is_causal, scale=scale)
        return in_dim_order_of(q, out.to(q.dtype)), lse.to(acc).contiguous()

    tiling = _tiling(ring, q, attn_mask, is_causal, layout, key_len, tiles_per_chunk)
    mine = tiling(ring.rank)
    out_acc = empty_in_dim_order_of(q, acc).zero_()
    lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    # Each sub-ring's K/V tiles make their own trip round the ring; at each step this
    # rank attends to the tiles it holds from each of its query tiles.
    for own, _, held, kv in ring_visits(ring, k, v, tiling):
        for i, r, causal, keys in tile_pairs(mine, held, is_causal, key_len):
            k_blk, v_blk = kv[i][:, :, :keys], kv[len(own) + i][:, :, :keys]
            bias = tile_bias(attn_mask, r, held[i], keys, acc)
            out_blk, lse_blk = block_forward(
                q[:, :, r], k_blk, v_blk, is_causal=causal, scale=scale, bias=bias
            )
            merge_block(out_acc[:, :, r], lse_acc[:, :, r], out_blk, lse_blk)
    return in_dim_order_of(q, out_acc.to(q.dtype)), lse_acc


@ring_attention_op.register_fake
def _(q, k, v, attn_mask, is_causal, scale, group_name, layout, key_len, tiles_per_chunk=0):
    return empty_attention_outputs(q)


@torch.library.custom_op("ringify::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    group_name: str,
    layout: str,
    key_len: int,
    tiles_per_chunk: int = 0,
    mask_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d attn_mask): the last is empty unless ``mask_grad`` (a learned bias)."""
    ring = ring_by_name(group_name)
    grad_out = grad_out.contiguous()
    rows = q.shape[2]
    no_mask_grad = q.new_empty(0)
    if ring.size == 1 and attn_mask is None and key_len >= rows:
        dq, dk, dv = block_backward(grad_out, q, k, v, out, lse, is_causal=is_causal, scale=scale)
        grads = (g.to(t.dtype).contiguous() for g, t in zip((dq, dk, dv), (q, k, v), strict=True))
        return *grads, no_mask_grad

    acc = accumulation_dtype(q.dtype)
    tiling = _tiling(ring, q, attn_mask, is_causal, layout, key_len, tiles_per_chunk)
    mine = tiling(ring.rank)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k, v))
    dmask = torch.zeros(attn_mask.shape, dtype=acc, device=q.device) if mask_grad else None
    pending_dkv = None  # the accumulators of the held tiles, on their way to the next rank
    for own, step, held, kv in ring_visits(ring, k, v, tiling):
        dkv_here = [None] * len(kv)  # this rank's share of the held tiles' gradients
        for i, r, causal, keys in tile_pairs(mine, held, is_causal, key_len):
            block = (
                grad_out[:, :, r],
                q[:, :, r],
                kv[i][:, :, :keys],
                kv[len(own) + i][:, :, :keys],
                out[:, :, r],
                lse[:, :, r],
            )
            bias = tile_bias(attn_mask, r, held[i], keys, acc)
            dq_blk, dk_blk, dv_blk = block_backward(
                *block, is_causal=causal, scale=scale, bias=bias
            )
            if dmask is not None:
                tile = tile_of(dmask, r, held[i], keys)
                dbias = bias_backward(*block, is_causal=causal, scale=scale, bias=bias)
                broadcast = [d for d in range(4) if tile.shape[d] == 1 < dbias.shape[d]]
                tile += dbias.sum(broadcast, keepdim=True) if broadcast else dbias
            dq_acc[:, :, r] += dq_blk
            _accumulate(dkv_here, i, dk_blk, kv[i], acc)
            _accumulate(dkv_here, len(own) + i, dv_blk, kv[len(own) + i], acc)
        # The tiles' gradient accumulators: started here at step 0 (zero for a tile no
        # query sees, e.g. all padding), else they travelled with the tiles.
        if step == 0:
            dkv = [
                torch.zeros(t.shape, dtype=acc, device=t.device) if g is None else g
                for g, t in zip(dkv_here, kv, strict=True)
            ]
        else:
            dkv = pending_dkv.wait()
            for total, here in zip(dkv, dkv_here, strict=True):
                if here is not None:
                    total += here
        if ring.size > 1:
            pending_dkv = start_rotation(ring, dkv, tag=_DKV_TAG)
        if step == ring.size - 1:  # after P rotations the accumulators are home
            home = pending_dkv.wait() if ring.size > 1 else dkv
            for t, dk_home, dv_home in zip(own, home[: len(own)], home[len(own) :], strict=True):
                dk[:, :, t.rows], dv[:, :, t.rows] = dk_home, dv_home
    dmask = no_mask_grad if dmask is None else dmask.to(attn_mask.dtype)
    return dq_acc.to(q.dtype), dk, dv, dmask


def _accumulate(grads: list, slot: int, grad: torch.Tensor, tile: torch.Tensor, acc) -> None:
    """Add one block's dK or dV (over the tile's first ``grad.shape[2]`` rows: the rest are
    padding keys the kernel never saw) into ``grads[slot]``, kept contiguous so that it
    can be sent as it is."""
    keys = grad.shape[2]
    if grads[slot] is None and keys == tile.shape[2]:
        grads[slot] = grad.to(acc, memory_format=torch.contiguous_format)
        return
    if grads[slot] is None:
        grads[slot] = torch.zeros(tile.shape, dtype=acc, device=tile.device)
    grads[slot][:, :, :keys] += grad


@ring_attention_backward_op.register_fake
def _(
    grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, group_name, layout, key_len,
    tiles=0, mask_grad=False,
):  # fmt: skip
    grads = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    return *grads, torch.empty_like(attn_mask) if mask_grad else q.new_empty(0)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, *ctx.flags = inputs  # is_causal, scale, group, layout, key_len, tiles
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    mask_grad = ctx.needs_input_grad[3]  # a learned bias
    dq, dk, dv, dmask = ring_attention_backward_op(
        grad_out, q, k, v, out, lse, attn_mask, *ctx.flags, mask_grad=mask_grad
    )
    return dq, dk, dv, dmask if mask_grad else None, *([None] * len(ctx.flags))


ring_attention_op.register_autograd(_backward, setup_context=_setup_context)
