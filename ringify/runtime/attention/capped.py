"""One block of attention whose scores are soft-capped, ``cap * tanh(s / cap)``, and its backward.

No fused kernel of ATen caps scores (FA2's own ``softcap`` argument is not exposed through
ATen's SDPA, and its CPU kernel has none), so a capped block runs the math formulation on
every device: the scores of at most ``ROWS`` query rows at a time (O(rows x t) memory per
chunk, never the block's whole s x t beside its probabilities), capped, biased, masked,
then normalised by their log-sum-exp, as ``blocks.math_forward`` does for dtypes no fused
kernel serves. The backward maps dS through the cap's derivative, ``1 - tanh^2``.

Shapes as in ``blocks.py``: q_BHsD, k_BKtD / v_BKtD (H a multiple of K), out_BHsD, lse_BHs.
"""

from __future__ import annotations

import torch

ROWS = 1024  # query rows per chunk of a capped block


def capped_forward(
    q_BHsD: torch.Tensor,
    k_BKtD: torch.Tensor,
    v_BKtD: torch.Tensor,
    *,
    softcap: float,
    is_causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of softmax(cap(q k^T * scale) + bias) v, top-left causal; in the
    accumulation dtype (float64 for float64 inputs, else float32). Rows that see no key:
    out 0, lse -inf, as every block kernel here returns them."""
    acc = torch.float64 if q_BHsD.dtype == torch.float64 else torch.float32
    k, v = (expand_kv(q_BHsD, x).to(acc) for x in (k_BKtD, v_BKtD))
    outs, lses = [], []
    for rows in _chunks(q_BHsD.shape[2]):
        scores, _ = _capped_scores(q_BHsD[:, :, rows].to(acc), k, rows, softcap, scale,
                                   is_causal, bias)  # fmt: skip
        lse = torch.logsumexp(scores, -1)
        probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
        outs.append(probs @ v)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def capped_backward(
    dout_BHsD: torch.Tensor,
    q_BHsD: torch.Tensor,
    k_BKtD: torch.Tensor,
    v_BKtD: torch.Tensor,
    out_BHsD: torch.Tensor,
    lse_BHs: torch.Tensor,
    *,
    softcap: float,
    is_causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    bias_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` of one capped block given the *merged* ``out`` and ``lse`` of its
    rows (so its probabilities are the global ones), and with ``bias_grad`` the gradient of
    its bias, (B, H, s, t), last. In the accumulation dtype; dk and dv with K heads."""
    acc = lse_BHs.dtype
    k, v = (expand_kv(q_BHsD, x).to(acc) for x in (k_BKtD, v_BKtD))
    lse_all = lse_BHs.masked_fill(lse_BHs == float("-inf"), float("inf"))  # empty rows: P = 0
    dq_parts, dbias_parts = [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rows in _chunks(q_BHsD.shape[2]):
        q, dout, out = (x[:, :, rows].to(acc) for x in (q_BHsD, dout_BHsD, out_BHsD))
        scores, tanh = _capped_scores(q, k, rows, softcap, scale, is_causal, bias)
        probs = torch.exp(scores - lse_all[:, :, rows].unsqueeze(-1))
        delta = (dout * out).sum(-1, keepdim=True)
        dcapped = probs * (dout @ v.transpose(-1, -2) - delta)  # the gradient of the bias too
        dscores = dcapped * (1 - tanh.square()) * scale
        dq_parts.append(dscores @ k)
        dk += dscores.transpose(-1, -2) @ q
        dv += probs.transpose(-1, -2) @ dout
        if bias_grad:
            dbias_parts.append(dcapped)
    grads = (torch.cat(dq_parts, 2), sum_kv_groups(dk, k_BKtD), sum_kv_groups(dv, v_BKtD))
    return (*grads, torch.cat(dbias_parts, 2)) if bias_grad else grads


def _capped_scores(q, k, rows: slice, softcap: float, scale: float, is_causal: bool, bias):
    """The capped, biased and masked scores of the chunk ``rows`` and ``tanh`` of the
    scaled scores over the cap (the cap's derivative is 1 - tanh^2)."""
    tanh = torch.tanh((q @ k.transpose(-1, -2)) * (scale / softcap))
    scores = tanh * softcap
    if bias is not None:
        scores = scores + (bias if bias.shape[2] == 1 else bias[:, :, rows]).to(scores.dtype)
    if is_causal:  # top-left: row i sees keys 0..i
        i = torch.arange(rows.start, rows.stop, device=q.device).unsqueeze(-1)
        j = torch.arange(k.shape[2], device=q.device)
        scores = scores.masked_fill(j > i, float("-inf"))
    return scores, tanh


def _chunks(s: int) -> list[slice]:
    return [slice(i, min(i + ROWS, s)) for i in range(0, s, ROWS)]


def expand_kv(q_BHsD: torch.Tensor, kv_BKtD: torch.Tensor) -> torch.Tensor:
    """Repeat kv heads for GQA, for kernels that need H == K (local to one block only)."""
    groups = q_BHsD.shape[1] // kv_BKtD.shape[1]
    return kv_BKtD if groups == 1 else kv_BKtD.repeat_interleave(groups, dim=1)


def sum_kv_groups(dkv_BHtD: torch.Tensor, kv_BKtD: torch.Tensor) -> torch.Tensor:
    """A gradient over H heads summed back onto ``kv``'s K heads (``expand_kv``'s adjoint)."""
    b, h, t, d = dkv_BHtD.shape
    heads = kv_BKtD.shape[1]
    return dkv_BHtD if h == heads else dkv_BHtD.view(b, heads, h // heads, t, d).sum(2)
