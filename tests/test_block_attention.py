"""The per-block kernels and the LSE merge, on one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringify.runtime.attention.blocks import block_forward, math_backward, math_forward
from ringify.runtime.attention.protocol import merge_block


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_math_kernels_match_sdpa(is_causal):
    """The unfused formulation (CUDA float64's path) against SDPA, forward and backward."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 12, 8, generator=g, dtype=torch.float64) for _ in range(4))
    out, lse = math_forward(q, k, v, is_causal=is_causal, scale=0.3)
    grads = math_backward(dout, q, k, v, out, lse, is_causal=is_causal, scale=0.3)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=0.3)
    ref.backward(dout)
    scores = (q @ k.transpose(-1, -2)) * 0.3
    if is_causal:
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    for got, want in zip(
        (out, lse, *grads), (ref, scores.logsumexp(-1), *(t.grad for t in leaves)), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_merge_of_split_keys_is_attention_over_all_keys():
    """Merging blocks over disjoint key sets equals one block over their union (float32 merge)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out_acc = torch.zeros_like(q)
    lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    for keys in (slice(0, 2), slice(2, 3), slice(3, 5)):
        merge_block(
            out_acc,
            lse_acc,
            *block_forward(q, k[:, :, keys], v[:, :, keys], is_causal=False, scale=0.5),
        )
    out, lse = block_forward(q, k, v, is_causal=False, scale=0.5)
    torch.testing.assert_close(out_acc, out, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse_acc, lse, rtol=0, atol=1e-14)
