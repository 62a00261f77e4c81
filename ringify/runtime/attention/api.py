"""``ring_attention()``: the public entry to the ring ops, and the validation of its inputs.

Checks everything the ring cannot compute exactly before any communication, with
an error that names the fix, then dispatches to ``ringify::ring_attention`` or,
with a ``Dilation``, ``ringify::dilated_attention``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringify.runtime.attention.dilated_ops import dilated_attention_op
from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.attention.ops import ring_attention_op
from ringify.runtime.attention.protocol import DTYPES
from ringify.runtime.attention.spec import AttentionSpec, sdpa_scale
from ringify.runtime.collectives.agreement import check_ranks_agree
from ringify.runtime.collectives.layout import check_layout
from ringify.runtime.collectives.ring import check_backend_serves, resolve_ring


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

    Each eager call starts with one small collective: every rank raises at once if
    the ranks' shapes or flags differ or any rank's inputs are invalid (on CUDA it
    runs on a side stream and does not wait for queued work). A compiled graph
    skips it; ``ringify()`` checks its calls before they reach the graph.
    """
    ring = resolve_ring(group)
    error = None
    try:  # every rank validates, then all agree: a rank's bad input stops every rank at once
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
        if dilation is not None:
            if attn_mask is not None:
                raise ValueError(
                    "dilated attention takes no attn_mask (is_causal=True is supported)"
                )
            dilation.check_ring(q.shape[2], ring.size, layout)
    except ValueError as e:
        if torch.compiler.is_compiling():
            raise
        error = e
    if not torch.compiler.is_compiling():  # a compiled graph cannot hold the host-side check
        _check_ranks_agree(
            ring, q, k, v, attn_mask, is_causal, scale, enable_gqa, layout, dilation, error
        )
    scale = sdpa_scale(scale, q.shape[-1])
    rows, value_dim = q.shape[2], v.shape[-1]
    q, k, v = equal_head_dims(q, k, v)
    if dilation is not None:
        spec = AttentionSpec.dilated(ring.name, scale, is_causal, dilation)
        # Heads are dilated by their own index: give every q head its k/v head.
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        out, _ = dilated_attention_op(q, k, v, None, [], rows * ring.size, spec)
    else:
        spec = AttentionSpec(ring.name, scale, is_causal, layout)
        out, _ = ring_attention_op(q, k, v, attn_mask, [], rows * ring.size, spec)
    return out[..., :value_dim]


def equal_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q, k and v with one head dim: the narrower side (v's in MLA, 128 beside 192) padded
    with zeros, which changes no score and no output column, since the ring's kernels take
    one head dim (as FA2 does); the caller keeps the output's first v-head-dim columns."""
    width = max(q.shape[-1], v.shape[-1])
    return tuple(
        torch.nn.functional.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x
        for x in (q, k, v)
    )


def _check_ranks_agree(
    ring, q, k, v, attn_mask, is_causal, scale, enable_gqa, layout, dilation, error
):
    """Every rank passes or every rank raises (a rank's own ``error`` included), never a hang."""
    check_ranks_agree(
        ring,
        {
            "q": _described(q),
            "k": _described(k),
            "v": _described(v),
            "attn_mask": _described(attn_mask),
            "is_causal": is_causal,
            "scale": scale,
            "enable_gqa": enable_gqa,
            "layout": layout,
            "dilation": dilation,
        },
        "their ring_attention call",
        fix="\nevery rank must pass its shard of the same full q, k, v (same shapes and dtype), "
        "the same mask shape and the same flags",
        error=error,
        device=q.device,
    )


def _described(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), str(t.dtype))


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
    if any(0 in t.shape for t in (q, k, v)):
        raise ValueError(
            "q, k and v must not be empty (no heads, no positions or no batch); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}: skip empty batches"
        )
    if len({q.dtype, k.dtype, v.dtype}) > 1 or q.dtype not in DTYPES:
        raise ValueError(
            f"q, k and v must share one dtype among {[str(d) for d in DTYPES]}; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if len({q.device, k.device, v.device}) > 1:
        raise ValueError(
            f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}"
        )
    (b, h, s, d), (bk, hk, sk, dk) = q.shape, k.shape
    if k.shape[:3] != v.shape[:3] or b != bk or d != dk:
        raise ValueError(
            "k must have q's batch size and head_dim, and v k's batch, heads and length (v's "
            f"head_dim may differ); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
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
    try:
        torch.broadcast_shapes(mask.shape, full)
        broadcasts = mask.dim() <= 4
    except RuntimeError:
        broadcasts = False
    if mask.dim() < 2 or not broadcasts or mask.shape[-2] not in (1, s):
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {full}: it must hold "
            f"this rank's {s} query rows and all {s * ring_size} key columns of the full sequence "
            "(the full mask's rows sharded like q, e.g. with ringify.runtime.shard(mask, -2))"
        )
