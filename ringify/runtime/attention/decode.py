"""One decode step's attention over a KV cache split across the ring: ``ringify::decode_attention``.

Each rank holds its part of every layer's cache (``ringify/generation/step.py``); the
new token's query, key and value are computed on every rank (one row: cheap). Each rank
attends with that query to its cached keys, and to the new key where it is the rank
that stores it (``own_new``: so that the new key counts once; a block of its own, merged
in, so that the cache is never copied to append it). The partial results merge over the
ring by log-sum-exp (``memory.merge_over_ring``: two all-reduces of (B, H, 1) and
(B, H, 1, D + 1)). No K/V travel.

``keep``: the mask row at this rank's key columns, its cached keys' positions then the new
token's (bool: kept; float: added), or ``None`` where every key is visible. ``spec`` is the
``AttentionSpec`` every attention op takes (its ring, scale and ``softcap``, which caps each
block's scores: Gemma 2); ``sinks`` (a logit per head, gpt-oss) join each row's softmax
once, after the ring's merge.
"""

from __future__ import annotations

import torch

from ringify.runtime.attention.blocks import (
    block_forward,
    math_forward,
    merge_block,
)
from ringify.runtime.attention.memory import merge_over_ring
from ringify.runtime.attention.protocol import accumulation_dtype, empty_attention_outputs
from ringify.runtime.attention.sinks import with_sinks
from ringify.runtime.attention.spec import SPEC_TYPE, AttentionSpec
from ringify.runtime.masks.program import additive_mask


@torch.library.custom_op(
    "ringify::decode_attention",
    mutates_args=(),
    schema=(  # written out: an opaque argument is beyond ``infer_schema``
        "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_new, Tensor v_new, Tensor? keep, "
        f"bool own_new, {SPEC_TYPE} spec, Tensor? sinks=None) -> Tensor"
    ),
)
def decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    keep: torch.Tensor | None,
    own_new: bool,
    spec: AttentionSpec,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    cached = None if keep is None else keep[..., : k_cache.shape[2]]
    out, lse = _block(q, k_cache, v_cache, cached, spec.scale, spec.softcap)
    if own_new:  # the new key's block merged in: the cache is not copied to append it
        out, lse = out.to(accumulation_dtype(q.dtype)), lse.to(accumulation_dtype(q.dtype))
        new = None if keep is None else keep[..., k_cache.shape[2] :]
        merge_block(out, lse, *_block(q, k_new, v_new, new, spec.scale, spec.softcap))
    out, lse = merge_over_ring(q, out, lse, spec.group_name)
    if sinks is not None:  # once per row, after the ring's merge
        out, _ = with_sinks(out, lse, sinks)
    return empty_attention_outputs(q, v_cache.shape[-1])[0].copy_(out)


def _block(q, k, v, keep, scale, softcap):
    """One block's ``(out, lse)``. With GQA the query heads sharing a kv head are one head's
    rows (a decode row per query head): the kernel reads the cache with its own K heads,
    never a copy expanded to H heads, whatever kernel the device picks. A value head dim
    other than q's (MLA) runs the math formulation: one row of scores, O(cache)."""
    b, h, s, d = q.shape
    kv, dv = k.shape[1], v.shape[-1]
    if s == 1 and h != kv:
        if keep is not None and keep.dim() == 4 and keep.shape[1] == h:
            keep = keep.reshape(keep.shape[0], kv, h // kv, keep.shape[-1])
        out, lse = _block(q.reshape(b, kv, h // kv, d), k, v, keep, scale, softcap)
        return out.reshape(b, h, 1, dv), lse.reshape(b, h, 1)
    bias = None if keep is None else additive_mask(keep, q.dtype)
    if dv != d:
        acc = accumulation_dtype(q.dtype)
        q, k, v = (x.to(acc) for x in (q, k, v))
        return math_forward(q, k, v, is_causal=False, scale=scale, bias=bias)
    return block_forward(q, k, v, is_causal=False, scale=scale, bias=bias, softcap=softcap)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, k_new, v_new, keep, own_new, spec, sinks=None):
    return empty_attention_outputs(q, v_cache.shape[-1])[0]


decode_attention = decode_attention_op._opoverload
