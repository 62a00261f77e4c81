"""Attention with a sink logit per head and a soft cap of the scores, defined on full tensors.

gpt-oss concatenates a learned logit per head to every row of scores before the softmax and
drops its column after: a *sink*, one more term in each row's denominator that attends to
nothing. Gemma 2 caps its scores, ``cap * tanh(s / cap)``, before adding the mask. Neither
is an argument of SDPA, so the pass reads such attention (written by hand) into a call of
``attention`` below, which it treats as it treats SDPA: the ring op takes ``sinks`` and
``softcap`` (``ops.py``). Called on full tensors, it is the definition: the math on the
whole scores, as a model that runs unsharded (or gathered) computes them.

``dilated_attention`` is LongNet's dilated attention on full tensors, the same way.

Shapes: q_BHsD, k_BKtD and v_BKtD (H a multiple of K with ``enable_gqa``), ``attn_mask``
as SDPA takes it, ``sinks`` broadcastable to (B, H, 1, 1).
"""

from __future__ import annotations

import torch

from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.attention.protocol import accumulation_dtype
from ringify.runtime.attention.spec import sdpa_scale


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """SDPA's result with the scores capped (``softcap`` > 0) before the mask is added, and a
    sink logit per head in every row's softmax (``sinks``), whose column is dropped."""
    if dropout_p:
        raise ValueError("attention with sinks or a soft cap takes no dropout")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    scale = sdpa_scale(scale, query.shape[-1])
    scores = (query @ key.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    if is_causal:
        s, t = scores.shape[-2:]
        above = torch.ones(s, t, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return probs @ value


def joint_attention(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float | None = None,
    masks: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """SDPA of ``query`` over keys and values given in parts along the sequence (a joint
    sequence of text and image tokens), not causal; ``masks``: each key part's columns of a
    mask whose rows broadcast (a padding mask of the text keys). The pass keeps the parts
    apart so that each is placed on its own (``passes/folds/joints.py``)."""
    key, value = torch.cat(keys, 2), torch.cat(values, 2)
    mask = None if masks is None else torch.cat(masks, -1)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale
    )


def kept_mask(
    seq_len: int, heads: int, w: int, r: int, is_causal: bool, device=None
) -> torch.Tensor:
    """(heads, S, S) bool: which key each query of each head attends to under pair (w, r)."""
    pos = torch.arange(seq_len, device=device)
    segment, offset = pos // w, pos % w
    head_offset = (torch.arange(heads, device=device) % r)[:, None]
    kept = offset[None, :] % r == head_offset  # (heads, S)
    allowed = (segment[:, None] == segment[None, :]) & kept[:, :, None] & kept[:, None, :]
    if is_causal:
        allowed &= pos[None, :] <= pos[:, None]
    return allowed


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dilation: Dilation,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Dilated attention on full ``(B, H, S, D)`` tensors, written for clarity (O(S^2) memory).

    The reference the ring version is tested against: each pair is dense attention
    under its mask, its (out, lse) merged into the result by log-sum-exp.
    """
    h, s, d = q.shape[1:]
    dilation.check_length(s)
    scale = d**-0.5 if scale is None else scale
    acc = accumulation_dtype(q.dtype)
    outs, lses = [], []
    for w, r in dilation.pairs(s):
        allowed = kept_mask(s, h, w, r, is_causal, q.device)
        scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # -inf on rows the pair does not keep
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        outs.append(probs @ v.to(acc))
        lses.append(lse)
    lses = torch.stack(lses)
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total).nan_to_num(0.0)  # a row no pair keeps: all weights 0
    return (weights.unsqueeze(-1) * torch.stack(outs)).sum(0).to(q.dtype)
