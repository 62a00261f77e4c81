"""Attention on one (query block, key block) pair with ATen's fused kernels, and the LSE merge.

Shapes (SDPA layout): q_BHsD (H query heads), k_BKtD / v_BKtD (K kv heads,
H % K == 0), out_BHsD, lse_BHs. Every kernel returns the log-sum-exp of each
query row, which is what lets blocks be merged exactly and lets the backward
recompute a block's softmax from the *global* ``out`` and ``lse``.

Kernel choice follows the device of the inputs:
- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (handles GQA natively).
  Half-precision blocks run the float32 kernel: partial results are never
  rounded to 8 mantissa bits (so the error does not grow with the ring), and on
  CPUs without AMX the float32 kernel is also the faster one (measured 3x in the
  backward on the reference machine);
- CUDA: flash for fp16/bf16 (``attention/flash.py`` keeps its contracts: a dense lse, and
  causal blocks squared, since FA2 aligns a non-square causal mask bottom-right; GQA's
  K/V go in with their own heads, as SDPA's ``enable_gqa`` hands them to FA2),
  memory-efficient for fp32 (top-left causal, as SDPA); float64 (no fused CUDA kernel)
  uses the math formulation below.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ringify.runtime.attention.capped import (
    capped_backward,
    capped_forward,
    expand_kv,
    sum_kv_groups,
)
from ringify.runtime.attention.flash import flash_backward, flash_forward
from ringify.runtime.attention.protocol import unit_last_stride

aten = torch.ops.aten


def block_forward(
    q_BHsD: torch.Tensor,
    k_BKtD: torch.Tensor,
    v_BKtD: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    empty_rows: bool = True,
    softcap: float = 0.0,
    query_nans: Callable[[], torch.Tensor] | None = None,
    nan_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_BHsD, lse_BHs)`` of softmax(q k^T * scale + bias) v; causal masks are top-left aligned.

    ``bias`` is an additive mask broadcastable to (B, H, s, t) (see ``additive_mask``).
    A row it masks entirely gets out = 0 and lse = -inf, so that merging it is a no-op;
    ``empty_rows=False`` says that the caller knows no row is (nothing to correct).
    ``softcap`` > 0: the scores are capped before the bias (``capped.py``).
    ``query_nans``: gives q's rows holding a NaN (B, H, s), which the caller keeps for every
    block of the same rows (``QueryNaNs.of``); asked by the CPU kernel's check alone, which
    else scans q here. ``nan_out=False``: that check marks a row's lse alone, not its output
    (a pass over the block's output); a caller that merges the blocks (``merge_block`` spreads
    a NaN lse to the row) marks the merged rows once (``mark_nan_rows``).
    """
    if softcap:
        return capped_forward(
            q_BHsD, k_BKtD, v_BKtD, softcap=softcap, is_causal=is_causal, scale=scale, bias=bias
        )
    q_BHsD, k_BKtD, v_BKtD = unit_last_stride(q_BHsD, k_BKtD, v_BKtD)
    if bias is not None:
        out, lse = _masked_forward(q_BHsD, k_BKtD, v_BKtD, bias, scale)
        if not empty_rows:
            return out, lse
        empty = (bias == float("-inf")).all(-1).expand(lse.shape)
        return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))
    if q_BHsD.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            *_cpu_kernel_inputs(q_BHsD, k_BKtD, v_BKtD), 0.0, is_causal, scale=scale
        )
        # The kernel reads a row whose scores are all NaN as fully masked (out 0,
        # lse 0), where SDPA gives NaN: the NaN that signals divergence would be
        # hidden. Such a row has lse exactly 0 and a NaN in its q or a key it sees.
        # (Scanned every time: asking first whether any lse is 0 is a host read.)
        # The kernel's outputs are new: marked in place, no copy of the block's output.
        q_nan = None if query_nans is None else query_nans()
        nan_rows = (lse == 0) & _rows_seeing_nan(q_BHsD, k_BKtD, is_causal, q_nan)
        if nan_out:
            out.masked_fill_(nan_rows.unsqueeze(-1), float("nan"))
        return out, lse.masked_fill_(nan_rows, float("nan"))
    if q_BHsD.dtype in (torch.float16, torch.bfloat16):  # FA2 takes GQA's K/V heads as they are
        return flash_forward(q_BHsD, k_BKtD, v_BKtD, is_causal=is_causal, scale=scale)
    k_BHtD, v_BHtD = expand_kv(q_BHsD, k_BKtD), expand_kv(q_BHsD, v_BKtD)
    if q_BHsD.dtype == torch.float32:
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(
            q_BHsD, k_BHtD, v_BHtD, None, True, 0.0, is_causal, scale=scale
        )
        return out, lse[..., : q_BHsD.shape[2]]  # the kernel pads lse rows to a multiple of 32
    return math_forward(q_BHsD, k_BHtD, v_BHtD, is_causal=is_causal, scale=scale)


def block_backward(
    dout_BHsD: torch.Tensor,
    q_BHsD: torch.Tensor,
    k_BKtD: torch.Tensor,
    v_BKtD: torch.Tensor,
    out_BHsD: torch.Tensor,
    lse_BHs: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    empty_rows: bool = True,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block, given the *merged* output and lse of its query rows.

    With the global ``out`` and ``lse`` the kernel's recomputed probabilities are
    the global ones, so the block gradients sum exactly to the full gradient.
    ``empty_rows=False``: no row of the block is masked entirely (so none has lse -inf).
    """
    if softcap:
        return capped_backward(
            dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD, lse_BHs,
            softcap=softcap, is_causal=is_causal, scale=scale, bias=bias,
        )  # fmt: skip
    dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD = unit_last_stride(
        dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD
    )
    if bias is not None:
        # A row masked everywhere (lse = -inf) has no gradient: lse = +inf makes its
        # recomputed probabilities exp(s - lse) exactly 0 instead of NaN.
        if empty_rows:
            lse_BHs = lse_BHs.masked_fill(lse_BHs == float("-inf"), float("inf"))
        return _masked_backward(dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD, lse_BHs, bias, scale)
    if q_BHsD.device.type == "cpu":
        dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD = _cpu_kernel_inputs(
            dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD
        )
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD, lse_BHs, 0.0, is_causal, scale=scale
        )
    if q_BHsD.dtype in (torch.float16, torch.bfloat16):  # dK/dV come back with K heads
        return flash_backward(
            dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD, lse_BHs, is_causal=is_causal, scale=scale
        )
    k_BHtD, v_BHtD = expand_kv(q_BHsD, k_BKtD), expand_kv(q_BHsD, v_BKtD)
    s = q_BHsD.shape[2]
    if q_BHsD.dtype == torch.float32:
        padded_lse = F.pad(lse_BHs.float(), (0, -s % 32))
        no_rng = torch.zeros((), dtype=torch.int64, device=q_BHsD.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout_BHsD,
            q_BHsD,
            k_BHtD,
            v_BHtD,
            None,
            out_BHsD,
            padded_lse,
            no_rng,
            no_rng,
            0.0,
            [True, True, True, False],
            is_causal,
            scale=scale,
        )
    else:
        dq, dk, dv = math_backward(
            dout_BHsD, q_BHsD, k_BHtD, v_BHtD, out_BHsD, lse_BHs, is_causal=is_causal, scale=scale
        )
    return dq, sum_kv_groups(dk, k_BKtD), sum_kv_groups(dv, v_BKtD)


def _masked_forward(q_BHsD, k_BKtD, v_BKtD, bias, scale):
    if q_BHsD.device.type == "cpu":
        q_BHsD, k_BKtD, v_BKtD = _cpu_kernel_inputs(q_BHsD, k_BKtD, v_BKtD)
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q_BHsD, k_BKtD, v_BKtD, 0.0, False, attn_mask=bias.to(q_BHsD.dtype), scale=scale
        )
    k_BHtD, v_BHtD = expand_kv(q_BHsD, k_BKtD), expand_kv(q_BHsD, v_BKtD)
    if q_BHsD.dtype == torch.float64:
        return math_forward(q_BHsD, k_BHtD, v_BHtD, is_causal=False, scale=scale, bias=bias)
    # Flash takes no mask: the memory-efficient kernel does, for every half/float dtype.
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(
        q_BHsD, k_BHtD, v_BHtD, _cuda_bias(bias, q_BHsD, k_BHtD), True, 0.0, False, scale=scale
    )
    return out, lse[..., : q_BHsD.shape[2]]


def _masked_backward(dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD, lse_BHs, bias, scale):
    if q_BHsD.device.type == "cpu":
        dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD = _cpu_kernel_inputs(
            dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD
        )
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD, lse_BHs, 0.0, False,
            attn_mask=bias.to(q_BHsD.dtype), scale=scale,
        )  # fmt: skip
    k_BHtD, v_BHtD = expand_kv(q_BHsD, k_BKtD), expand_kv(q_BHsD, v_BKtD)
    if q_BHsD.dtype == torch.float64:
        dq, dk, dv = math_backward(
            dout_BHsD, q_BHsD, k_BHtD, v_BHtD, out_BHsD, lse_BHs,
            is_causal=False, scale=scale, bias=bias,
        )  # fmt: skip
    else:
        s = q_BHsD.shape[2]
        no_rng = torch.zeros((), dtype=torch.int64, device=q_BHsD.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout_BHsD, q_BHsD, k_BHtD, v_BHtD, _cuda_bias(bias, q_BHsD, k_BHtD), out_BHsD,
            F.pad(lse_BHs.float(), (0, -s % 32)), no_rng, no_rng, 0.0,
            [True, True, True, False], False, scale=scale,
        )  # fmt: skip
    return dq, sum_kv_groups(dk, k_BKtD), sum_kv_groups(dv, v_BKtD)


def _cuda_bias(bias, q_BHsD, k_BHtD):
    """The efficient kernel wants a (B, H, s, t) bias whose rows are 16-byte aligned; its batch
    and head dims may be broadcast (stride 0), as SDPA's own ``preprocess_mask`` expands them:
    only the bias's own dims are written, never a dense (B, H, s, t) copy."""
    b, h, s, _ = q_BHsD.shape
    t = k_BHtD.shape[2]
    own = (*bias.shape[:2], s, t)
    fits = bias.stride(-1) == 1 and bias.stride(-2) % 8 == 0 and bias.data_ptr() % 16 == 0
    if bias.dtype == q_BHsD.dtype and fits:
        aligned = bias.expand(own)
    else:
        padded = torch.empty(*own[:3], t + (-t % 8), dtype=q_BHsD.dtype, device=q_BHsD.device)
        aligned = padded[..., :t]
        aligned.copy_(bias.expand(own))
    return aligned.expand(b, h, s, t)


def math_forward(
    q_BHsD: torch.Tensor,
    k_BHtD: torch.Tensor,
    v_BHtD: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused reference formulation for dtypes no fused kernel serves (O(s*t) memory)."""
    scores = (q_BHsD @ k_BHtD.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    if is_causal:
        scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v_BHtD, lse


def math_backward(
    dout_BHsD: torch.Tensor,
    q_BHsD: torch.Tensor,
    k_BHtD: torch.Tensor,
    v_BHtD: torch.Tensor,
    out_BHsD: torch.Tensor,
    lse_BHs: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash-attention backward identities: dS = P * (dP - rowsum(dO * O))."""
    scores = (q_BHsD @ k_BHtD.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    if is_causal:
        scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
    probs = torch.exp(scores - lse_BHs.to(scores.dtype).unsqueeze(-1))
    dprobs = dout_BHsD @ v_BHtD.transpose(-1, -2)
    delta = (dout_BHsD * out_BHsD).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    return dscores @ k_BHtD, dscores.transpose(-1, -2) @ q_BHsD, probs.transpose(-1, -2) @ dout_BHsD


def bias_backward(
    dout_BHsD: torch.Tensor,
    q_BHsD: torch.Tensor,
    k_BKtD: torch.Tensor,
    v_BKtD: torch.Tensor,
    out_BHsD: torch.Tensor,
    lse_BHs: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    bias: torch.Tensor,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The gradient of one block's additive mask (a learned bias): dS = P * (dP - rowsum(dO * O))
    with the merged ``out`` and ``lse``, (B, H, s, t) in ``lse``'s dtype; O(s * t), as the
    block's mask itself. No fused kernel returns it."""
    if softcap:
        args = (dout_BHsD, q_BHsD, k_BKtD, v_BKtD, out_BHsD, lse_BHs)
        kwargs = {"softcap": softcap, "is_causal": is_causal, "scale": scale, "bias": bias}
        return capped_backward(*args, **kwargs, bias_grad=True)[3]
    acc = lse_BHs.dtype
    q, k, v = (x.to(acc) for x in (q_BHsD, expand_kv(q_BHsD, k_BKtD), expand_kv(q_BHsD, v_BKtD)))
    dout, out = dout_BHsD.to(acc), out_BHsD.to(acc)
    scores = (q @ k.transpose(-1, -2)) * scale + bias.to(acc)
    if is_causal:
        scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
    lse = lse_BHs.masked_fill(lse_BHs == float("-inf"), float("inf"))  # empty rows: P = 0
    probs = torch.exp(scores - lse.unsqueeze(-1))
    delta = (dout * out).sum(-1, keepdim=True)
    return probs * (dout @ v.transpose(-1, -2) - delta)


def mark_nan_rows(out_BHsD: torch.Tensor, lse_BHs: torch.Tensor) -> torch.Tensor:
    """``out`` with NaN in every row whose lse is NaN (blocks run with ``nan_out=False``), in
    place: one pass over a call's merged output instead of one per block."""
    return out_BHsD.masked_fill_(lse_BHs.isnan().unsqueeze(-1), float("nan"))


class QueryNaNs:
    """The rows of a call's queries that hold a NaN, per block of rows, each worked out once:
    every key tile a call visits is attended from the same query rows (``block_forward``)."""

    def __init__(self, q) -> None:
        self._q, self._rows = q, {}  # q: a tensor or ``ShardRows``, rows on dim 2

    @property
    def asked(self) -> bool:
        """Whether a block asked for them (the CPU kernel's check ran)."""
        return bool(self._rows)

    def of(self, rows: slice) -> Callable[[], torch.Tensor]:
        """What gives the NaN rows of ``rows`` (worked out when first asked)."""
        return functools.partial(self._nans, (rows.start, rows.stop))

    def _nans(self, key: tuple[int, int]) -> torch.Tensor:
        if key not in self._rows:
            self._rows[key] = _rows_holding_nan(self._q[slice(*key)])
        return self._rows[key]


def _rows_holding_nan(x: torch.Tensor) -> torch.Tensor:
    """Whether each row (over the last dim) of ``x`` holds a NaN. ``amax`` propagates NaN, and
    an inf stays an inf: one read of ``x``, where ``isnan().any()`` writes and reads a bool copy
    of it (8x the time on this CPU)."""
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1], dtype=torch.bool)
    return x.amax(-1).isnan()


def _rows_seeing_nan(q_BHsD, k_BKtD, is_causal: bool, q_nan=None) -> torch.Tensor:
    """(B, H, s): the rows whose scores include a NaN (in the row's q or a key it sees)."""
    q_nan = _rows_holding_nan(q_BHsD) if q_nan is None else q_nan
    k_nan, groups = _rows_holding_nan(k_BKtD), q_BHsD.shape[1] // k_BKtD.shape[1]
    k_nan = k_nan if groups == 1 else k_nan.repeat_interleave(groups, 1)  # (B, H, t)
    s, t = q_nan.shape[-1], k_nan.shape[-1]
    if is_causal:  # row i sees keys 0..i (top-left)
        seen = k_nan.cummax(-1).values[..., torch.arange(s, device=k_nan.device).clamp(max=t - 1)]
    else:
        seen = k_nan.any(-1, keepdim=True).expand_as(q_nan)
    return q_nan | seen


def _cpu_kernel_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors)


def _above_diagonal(scores: torch.Tensor) -> torch.Tensor:
    s, t = scores.shape[-2:]
    return torch.ones(s, t, dtype=torch.bool, device=scores.device).triu(1)


def serves_varlen(q: torch.Tensor) -> bool:
    """Whether a block of ``q`` may run as FA2 varlen calls (``masks/calls.py``): FA2's own
    blocks (fp16/bf16 off the CPU), one sequence (the calls' rows are the batch's), and a
    head dim FA2 takes as it is (a multiple of 8, at most 256)."""
    fa2 = q.device.type != "cpu" and q.dtype in (torch.float16, torch.bfloat16)
    return fa2 and q.shape[0] == 1 and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def runs_varlen(q: torch.Tensor, softcap: float) -> bool:
    """Whether a ring call of ``q`` runs open pairs as FA2 varlen calls: FA2's own blocks
    (``serves_varlen``) and no soft cap (FA2 through ATen takes none). The one answer: the
    pass lays a step's masks out by it (``masks/step_masks.py``), the ring op runs by it."""
    return serves_varlen(q) and not softcap
