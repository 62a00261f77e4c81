"""FlashAttention-2 through ATen (CUDA fp16/bf16 blocks), with the two contracts it does not check.

- **A dense lse.** FA2's backward reads the log-sum-exp through its data pointer as a
  dense (B, H, s) array, with no stride check. The ring hands a block a tile's rows of
  the merged lse, a strided slice: read as dense it is another row's lse, silently. It
  is made contiguous here, as torch's context parallel and ring-flash-attention do.
- **Top-left causal.** FA2 aligns a non-square causal mask bottom-right (query i sees
  keys j <= i + t - s); SDPA and every other block kernel here align it top-left
  (j <= i). A diagonal tile of a padded sequence is non-square (1024 queries, 1022 real
  keys), so a causal block with s != t runs as square parts (``causal_parts``), for
  which both alignments agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringify.runtime.attention.protocol import unit_last_stride
from ringify.runtime.masks.calls import Varlen

aten = torch.ops.aten


def causal_parts(s: int, t: int) -> list[tuple[slice, slice, bool]]:
    """A top-left causal s x t block as (query rows, keys, is_causal) parts, each square
    causal or unmasked. s < t: keys s.. are seen by no query. s > t: rows t.. see every key.
    ::

        s < t: [\\  ]      s > t: [\\ ]
               [ \\ ]  .          [ \\]
                                 [■■]  full
    """
    if s <= t:
        return [(slice(0, s), slice(0, s), True)]
    return [(slice(0, t), slice(0, t), True), (slice(t, s), slice(0, t), False)]


def flash_forward(
    q_BHsD: torch.Tensor,
    k_BHtD: torch.Tensor,
    v_BHtD: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block with top-left causal alignment, on FA2."""
    return top_left(_forward_kernel, q_BHsD, k_BHtD, v_BHtD, is_causal=is_causal, scale=scale)


def flash_backward(
    dout_BHsD: torch.Tensor,
    q_BHsD: torch.Tensor,
    k_BKtD: torch.Tensor,
    v_BKtD: torch.Tensor,
    out_BHsD: torch.Tensor,
    lse_BHs: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block with top-left causal alignment, on FA2; dK/dV with the
    K kv heads (FA2 sums each group)."""
    tensors = (dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD, lse_BHs)
    return top_left_backward(_backward_kernel, *tensors, is_causal=is_causal, scale=scale)


def top_left(kernel: Callable, q, k, v, *, is_causal: bool, scale: float):
    """``kernel(q, k, v, is_causal, scale) -> (out, lse)`` made top-left causal whatever its
    own alignment of non-square blocks: only square causal or unmasked parts reach it."""
    s, t = q.shape[2], k.shape[2]
    if not is_causal or s == t:
        return kernel(q, k, v, is_causal, scale)
    parts = [kernel(q[:, :, r], k[:, :, c], v[:, :, c], m, scale) for r, c, m in causal_parts(s, t)]
    return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)


def top_left_backward(kernel: Callable, dout, q, k, v, out, lse, *, is_causal: bool, scale: float):
    """``kernel(dout, q, k, v, out, lse, is_causal, scale) -> (dq, dk, dv)`` made top-left
    causal as ``top_left``; every part's lse is dense."""
    s, t = q.shape[2], k.shape[2]
    if not is_causal or s == t:
        return kernel(dout, q, k, v, out, lse.contiguous(), is_causal, scale)
    dq, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, causal in causal_parts(s, t):
        part = (dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows])
        dq_part, dk_part, dv_part = kernel(*part, lse[:, :, rows].contiguous(), causal, scale)
        dq.append(dq_part)
        dk[:, :, keys].add_(dk_part)
        dv[:, :, keys].add_(dv_part)
    return torch.cat(dq, 2), dk, dv


def _forward_kernel(q, k, v, is_causal, scale):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal, False, scale=scale
    )
    return out, lse


def _backward_kernel(dout, q, k, v, out, lse, is_causal, scale):
    s, t = q.shape[2], k.shape[2]
    no_rng = torch.zeros(2, dtype=torch.int64, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.float(), None, None, s, t, 0.0, is_causal, no_rng, no_rng,
        scale=scale,
    )  # fmt: skip


def varlen_forward(q_sHD, k_tKD, v_tKD, varlen: Varlen, *, scale: float):
    """``(out, lse)``, (1, H, s, D) and (1, H, s), of one varlen call on FA2's layout: q's rows
    and k/v's keys its sequences', side by side, (rows, heads, D) views of a batch of one
    (``tiles.sequence_rows``: FA2 takes the row and head strides as arguments), GQA's K/V
    heads as they are."""
    q, k, v = unit_last_stride(q_sHD, k_tKD, v_tKD)
    cu_q, cu_k = varlen.cu_seqlens
    out, lse, *_ = aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, varlen.max_rows, varlen.max_keys, 0.0, varlen.is_causal, False,
        scale=scale, window_size_left=varlen.window[0], window_size_right=varlen.window[1],
    )  # fmt: skip
    return _batch_of_one(out), lse.unsqueeze(0)  # lse: (heads, rows)


def varlen_backward(dout_sHD, q_sHD, k_tKD, v_tKD, out_sHD, lse_BHs, varlen: Varlen, *,
                    scale: float):  # fmt: skip
    """``(dq, dk, dv)``, (1, heads, rows, D) each, of one varlen call on FA2's layout (as
    ``varlen_forward``) from the merged ``out`` and ``lse`` (float32, the accumulation dtype
    of FA2's fp16/bf16); the lse is made dense (FA2 reads it through its pointer), dK/dV
    come back with K heads."""
    dout, q, k, v, out = unit_last_stride(dout_sHD, q_sHD, k_tKD, v_tKD, out_sHD)
    cu_q, cu_k = varlen.cu_seqlens
    no_rng = torch.zeros(2, dtype=torch.int64, device=q.device)
    dq, dk, dv = aten._flash_attention_backward(
        dout, q, k, v, out, lse_BHs[0].contiguous(), cu_q, cu_k, varlen.max_rows,
        varlen.max_keys, 0.0, varlen.is_causal, no_rng, no_rng, scale=scale,
        window_size_left=varlen.window[0], window_size_right=varlen.window[1],
    )  # fmt: skip
    return _batch_of_one(dq), _batch_of_one(dk), _batch_of_one(dv)


def _batch_of_one(x_sHD: torch.Tensor) -> torch.Tensor:
    """FA2's (s, H, D) as (1, H, s, D), one view op; the batch stride that of a dense
    (B, S, H, D) (one batch: any stride will do), so that a whole result is found in a
    model's dim order, not copied."""
    rows, heads, d = x_sHD.shape
    s_row, s_head, s_d = x_sHD.stride()
    return x_sHD.as_strided(
        (1, heads, rows, d), (rows * s_row, s_head, s_row, s_d), x_sHD.storage_offset()
    )
