"""Ring attention: exact SDPA over a sequence sharded across the ranks of a ring.

``torch.ops.ringify.ring_attention(q, k, v, attn_mask, is_causal, scale, group_name,
layout, tiles_per_chunk, key_len) -> (out, lse)`` is a custom op with a fake
kernel and autograd, whose backward is the custom op
``ringify::ring_attention_backward``; AOTAutograd and Inductor see each as one
opaque node. Output strides are a function of q's, so the fake kernels can state
them: ``out`` has q's dim order in memory, as ATen's CPU flash kernel returns it
(for a model's q, a view of (B, S, H, D), a following
``out.transpose(1, 2).reshape(B, S, H * D)`` is then free); ``lse`` and the
gradients are contiguous.

Shapes: q_BHSD is this rank's query shard (S = local rows), k_BKSD / v_BKSD its
key/value shard with K kv heads (H % K == 0: GQA/MQA travel unexpanded).

Forward, P ranks: the K/V tiles of each sub-ring (see ``tiles.py``) travel round
the ring for P-1 steps; at step i this rank holds the tiles of rank
(rank - i) mod P, attends to them from each of its query tiles with a fused
kernel while the next tiles are already in flight, and merges the results into
float32 accumulators by log-sum-exp.
Backward: K/V tiles travel again; the dK/dV accumulator of each tile travels
with it, every rank adds its contribution, and after P steps it arrives home.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ringify.runtime.block_attention import (
    accumulation_dtype,
    additive_mask,
    block_backward,
    block_forward,
    merge_block,
)
from ringify.runtime.dilation import Dilation
from ringify.runtime.groups import Ring, check_backend_serves, resolve_ring, ring_by_name
from ringify.runtime.layout import LAYOUTS, check_layout
from ringify.runtime.ring import start_rotation
from ringify.runtime.tiles import Tile, rank_tiles, sub_ring_tiles, tiles_per_chunk, visibility

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_KV_TAG, _DKV_TAG = 0, 1


def _shard_tiles(ring: Ring, rank: int, rows: int, positional: bool, layout: str, tiles: int):
    # Without a causal mask, a mask or padding, positions do not matter: tile the
    # shard as one chunk.
    return rank_tiles(rank, ring.size, rows, layout if positional else "contiguous", tiles)


def _ring_visits(ring: Ring, k, v, rows: int, positional: bool, layout: str, tiles: int):
    """Walk every sub-ring round the ring: yields ``(own, step, held, kv)``.

    ``own``: this rank's tiles of the sub-ring; ``held``: the tiles of rank
    (rank - step) held at this step; ``kv``: their K tiles, then their V tiles.
    The rotation to the next step is started before yielding, so it is in flight
    while the caller computes, and waited on when the caller asks for the next step.
    """
    mine = _shard_tiles(ring, ring.rank, rows, positional, layout, tiles)
    for j in range(tiles):
        own = sub_ring_tiles(mine, j)
        kv = [x[:, :, t.rows] for x in (k, v) for t in own]
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = start_rotation(ring, kv, tag=_KV_TAG) if step < ring.size - 1 else None
            held = sub_ring_tiles(_shard_tiles(ring, src, rows, positional, layout, tiles), j)
            yield own, step, held, kv
            if pending is not None:
                kv = pending.wait()


def _tile_pairs(mine: list[Tile], held: list[Tile], is_causal: bool, key_len: int):
    """Every tile pair with work: ``(index into held, query rows, kernel's is_causal, keys)``.

    ``keys`` is how many leading rows of the held tile are real keys: the rows at
    global positions >= ``key_len`` are padding and are cut off (a tile of padding only
    is skipped).
    """
    for i, k_tile in enumerate(held):
        keys = min(k_tile.rows.stop - k_tile.rows.start, key_len - k_tile.start)
        if keys <= 0:
            continue
        for q_tile in mine:
            causal = visibility(q_tile, k_tile, is_causal)
            if causal is not None:
                yield i, q_tile.rows, causal, keys


def _block_bias(mask: torch.Tensor | None, rows: slice, k_tile: Tile, keys: int, dtype):
    """The additive mask of one tile pair: this rank's query rows, the held tile's key columns."""
    if mask is None:
        return None
    return additive_mask(mask[..., rows, k_tile.start : k_tile.start + keys], dtype)


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
    tiles_per_chunk: int,
    key_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    ring = ring_by_name(group_name)
    acc = accumulation_dtype(q.dtype)
    rows = q.shape[2]
    if ring.size == 1 and attn_mask is None and key_len >= rows:
        out, lse = block_forward(q, k, v, is_causal=is_causal, scale=scale)
        return in_layout_of(q, out.to(q.dtype)), lse.to(acc).contiguous()
    if ring.size > 1:
        _check_ranks_agree(ring, q, k, v, is_causal, scale, layout)

    positional = _positional(attn_mask, is_causal, key_len, rows * ring.size)
    mine = _shard_tiles(ring, ring.rank, rows, positional, layout, tiles_per_chunk)
    out_acc = empty_in_layout_of(q, acc).zero_()
    lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    # Each sub-ring's K/V tiles make their own trip round the ring; at each step this
    # rank attends to the tiles it holds from each of its query tiles.
    visits = _ring_visits(ring, k, v, rows, positional, layout, tiles_per_chunk)
    for own, _, held, kv in visits:
        for i, r, causal, keys in _tile_pairs(mine, held, is_causal, key_len):
            k_blk, v_blk = kv[i][:, :, :keys], kv[len(own) + i][:, :, :keys]
            bias = _block_bias(attn_mask, r, held[i], keys, acc)
            out_blk, lse_blk = block_forward(
                q[:, :, r], k_blk, v_blk, is_causal=causal, scale=scale, bias=bias
            )
            merge_block(out_acc[:, :, r], lse_acc[:, :, r], out_blk, lse_blk)
    return in_layout_of(q, out_acc.to(q.dtype)), lse_acc


def empty_in_layout_of(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor shaped like ``q`` whose dims lie in memory in q's order (by stride),
    densely: unlike ``empty_like``, also for a q that is a strided slice of a bigger tensor."""
    order = sorted(range(q.dim()), key=lambda d: -q.stride(d))  # outermost first; stable
    dense = torch.empty([q.shape[d] for d in order], dtype=dtype, device=q.device)
    return dense.permute([order.index(d) for d in range(q.dim())])


def in_layout_of(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` in q's layout (``empty_in_layout_of``): itself if it already is, else a copy."""
    target = empty_in_layout_of(q, out.dtype)
    return out if out.stride() == target.stride() else target.copy_(out)


def _positional(attn_mask, is_causal: bool, key_len: int, total_rows: int) -> bool:
    """Whether the op needs each tile's global positions (else any tiling will do)."""
    return is_causal or attn_mask is not None or key_len < total_rows


def fake_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) as the attention ops return them, for their fake kernels."""
    lse = q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))
    return empty_in_layout_of(q, q.dtype), lse


@ring_attention_op.register_fake
def _(q, k, v, attn_mask, is_causal, scale, group_name, layout, tiles_per_chunk, key_len):
    return fake_outputs(q)


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
    tiles_per_chunk: int,
    key_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = ring_by_name(group_name)
    grad_out = grad_out.contiguous()
    rows = q.shape[2]
    if ring.size == 1 and attn_mask is None and key_len >= rows:
        dq, dk, dv = block_backward(grad_out, q, k, v, out, lse, is_causal=is_causal, scale=scale)
        return tuple(
            g.to(t.dtype).contiguous() for g, t in zip((dq, dk, dv), (q, k, v), strict=True)
        )

    acc = accumulation_dtype(q.dtype)
    positional = _positional(attn_mask, is_causal, key_len, rows * ring.size)
    mine = _shard_tiles(ring, ring.rank, rows, positional, layout, tiles_per_chunk)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k, v))
    pending_dkv = None  # the accumulators of the held tiles, on their way to the next rank
    visits = _ring_visits(ring, k, v, rows, positional, layout, tiles_per_chunk)
    for own, step, held, kv in visits:
        dkv_here = [None] * len(kv)  # this rank's share of the held tiles' gradients
        for i, r, causal, keys in _tile_pairs(mine, held, is_causal, key_len):
            dq_blk, dk_blk, dv_blk = block_backward(
                grad_out[:, :, r],
                q[:, :, r],
                kv[i][:, :, :keys],
                kv[len(own) + i][:, :, :keys],
                out[:, :, r],
                lse[:, :, r],
                is_causal=causal,
                scale=scale,
                bias=_block_bias(attn_mask, r, held[i], keys, acc),
            )
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
    return dq_acc.to(q.dtype), dk, dv


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
def _(grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, group_name, layout, tiles, key_len):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, *ctx.flags = inputs  # is_causal, scale, group, layout, tiles, key_len
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward_op(grad_out, q, k, v, out, lse, attn_mask, *ctx.flags)
    return dq, dk, dv, None, *([None] * len(ctx.flags))


ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    dilation: Dilation | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on the full sequence, restricted to this rank's rows.

    q, k, v are this rank's shards ``(B, H, S_local, D)`` under ``layout`` (see
    ``ringify.runtime.shard``). ``attn_mask`` (bool, True attends, or float, added
    to the scores) holds this rank's query rows and every key column of the full
    sequence: broadcastable to ``(B, H, S_local, S_local * ring_size)``; the ring
    cuts out the columns of each K/V block it receives. ``group=None`` is the
    default process group; without torch.distributed, or with one rank, this is
    plain local attention.

    With a ``Dilation`` (layout ``contiguous``, no mask) it is LongNet's dilated
    attention instead (``ringify.runtime.dilated_attention`` on the full sequence).
    """
    ring = resolve_ring(group)
    check_layout(layout)
    check_inputs(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
        layout=layout,
        ring_size=ring.size,
    )
    check_backend_serves(ring, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    rows = q.shape[2]
    if dilation is not None:
        from ringify.runtime.dilated_ring_attention import check_dilation, dilated_attention_op

        if attn_mask is not None:
            raise ValueError("dilated attention takes no attn_mask (is_causal=True is supported)")
        check_dilation(dilation, rows, ring.size, layout)
        # Heads are dilated by their own index: give every q head its k/v head.
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        segments, rates = list(dilation.segment_lengths), list(dilation.dilation_rates)
        out, _ = dilated_attention_op(q, k, v, is_causal, scale, ring.name, segments, rates)
        return out
    tiles = tiles_per_chunk(rows, layout if is_causal or attn_mask is not None else "contiguous")
    out, _ = ring_attention_op(
        q, k, v, attn_mask, is_causal, scale, ring.name, layout, tiles, rows * ring.size
    )
    return out


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    layout: str,
    ring_size: int,
) -> None:
    """Raise a ``ValueError`` naming the fix for inputs the ring cannot compute exactly."""
    if attn_mask is not None:
        _check_mask(attn_mask, q, k, is_causal, ring_size)
    if dropout_p != 0.0:
        raise ValueError(
            f"ring_attention does not support dropout (dropout_p={dropout_p}); pass dropout_p=0.0 "
            "(put the model in eval mode or set its attention dropout to 0)"
        )
    if any(t.dim() != 4 for t in (q, k, v)):
        raise ValueError(
            "q, k and v must be 4-D (batch, heads, seq, head_dim); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if len({q.dtype, k.dtype, v.dtype}) > 1 or q.dtype not in _DTYPES:
        raise ValueError(
            f"q, k and v must share one dtype among {[str(d) for d in _DTYPES]}; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if len({q.device, k.device, v.device}) > 1:
        raise ValueError(
            f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}"
        )
    (b, h, s, d), (bk, hk, sk, dk) = q.shape, k.shape
    if k.shape != v.shape or b != bk or d != dk:
        raise ValueError(
            "k and v must have q's batch size and head_dim and match each other; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if s != sk:
        raise ValueError(
            f"ring_attention is self-attention: q and k need the same local sequence length "
            f"(got {s} and {sk}); cross-attention is not supported"
        )
    if h != hk and not enable_gqa:
        raise ValueError(
            f"q has {h} heads but k/v have {hk}; pass enable_gqa=True for grouped-query attention"
        )
    if h % hk:
        raise ValueError(
            f"grouped-query attention needs q's heads ({h}) to be a multiple of k/v's heads ({hk})"
        )
    if is_causal and layout == "zigzag" and s % 2:
        raise ValueError(
            f"the zigzag layout holds two equal chunks per rank, but the local sequence length "
            f"is {s} (odd); shard the full sequence with ringify.runtime.shard(..., "
            f"layout='zigzag') from a length divisible by 2 * ring_size"
        )


def _check_mask(mask: torch.Tensor, q, k, is_causal: bool, ring_size: int) -> None:
    b, h, s = q.shape[:3]
    full = (b, h, s, s * ring_size)
    if is_causal:
        raise ValueError(
            "pass either attn_mask or is_causal=True, not both (as F.scaled_dot_product_attention)"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"attn_mask must be bool (True attends) or floating; got {mask.dtype}")
    if mask.requires_grad:
        raise ValueError(
            "ring_attention's attn_mask is not differentiable (a learned attention bias is not "
            "supported); pass attn_mask.detach() if its gradient is not needed"
        )
    try:
        torch.broadcast_shapes(mask.shape, full)
        broadcasts = mask.dim() <= 4
    except RuntimeError:
        broadcasts = False
    if not broadcasts or (mask.dim() >= 2 and mask.shape[-2] != s):
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {full}: it must hold "
            f"this rank's {s} query rows and all {s * ring_size} key columns of the full sequence "
            "(the full mask's rows sharded like q, e.g. with ringify.runtime.shard(mask, -2))"
        )


def _check_ranks_agree(ring: Ring, q, k, v, is_causal: bool, scale: float, layout: str) -> None:
    """Raise on every rank (instead of hanging the ring) if the ranks disagree on the call."""
    mine = [*q.shape, k.shape[1], _DTYPES.index(q.dtype), is_causal, scale, LAYOUTS.index(layout)]
    local = torch.tensor(mine, dtype=torch.float64, device=q.device)
    everyone = [torch.empty_like(local) for _ in range(ring.size)]
    dist.all_gather(everyone, local, group=ring.group)
    rows = [t.tolist() for t in everyone]
    if any(row != rows[0] for row in rows):
        names = (
            "batch",
            "heads",
            "seq",
            "head_dim",
            "kv_heads",
            "dtype",
            "is_causal",
            "scale",
            "layout",
        )
        described = "; ".join(
            f"rank {r}: " + ", ".join(f"{n}={x:g}" for n, x in zip(names, row, strict=True))
            for r, row in enumerate(rows)
        )
        raise ValueError(
            "the ranks of the ring called ring_attention with different arguments; every rank must "
            f"pass shards of the same shape, dtype and flags ({described})"
        )
