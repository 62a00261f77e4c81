"""Dropout outside attention on a sharded sequence: independent draws per position, as in
the unmodified model (statistically: the masks are not its bits), a gradient that uses the
forward's mask, and the same mask again when a checkpoint recomputes it. Random draws shaped
like the sequence that a router samples from (Gumbel noise, a coin per token): the unmodified
model's own numbers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ringify import ringify
from ringify.testing.models import AttendedRouter

P_DROP = 0.5


class _Dropped(torch.nn.Module):
    """Returns the dropped activations (which show the mask) next to an attention over them."""

    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(8, dtype=torch.float64))
        self.checkpointed = checkpointed

    def _forward(self, x):
        h = F.dropout(x * self.scale, P_DROP, self.training)
        q = h.view(*x.shape[:2], 2, 4).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return h, out.transpose(1, 2).reshape(x.shape)

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


def dropout_draws(ring_size: int, checkpointed: bool):
    """(masks of two calls, (S, D) each, every position; the input's gradient of the first
    call; the largest difference between the gradient and mask * 1 / (1 - p))."""
    torch.manual_seed(0)
    model = ringify(_Dropped(checkpointed), ring_size=ring_size)
    x = torch.ones(1, 256, 8, dtype=torch.float64, requires_grad=True)
    h, out = model(x)
    (h.sum() + 0 * out.sum()).backward()
    second, _ = model(x)
    masks = [(h != 0)[0].detach(), (second != 0)[0]]
    scale = 1 / (1 - P_DROP)
    values = h[h != 0]
    err = max(
        (values - scale).abs().max().item(),
        (x.grad[0] - masks[0] * scale).abs().max().item(),
    )
    return masks, err


@pytest.mark.parametrize("ring_size, checkpointed", [(2, False), (4, False), (2, True)])
def test_dropout_draws_independently_per_position(ranks, ring_size, checkpointed):
    results = ranks(ring_size).run(dropout_draws, ring_size, checkpointed)
    (first, second), err = results[0]
    for masks, _ in results[1:]:  # the gathered output is the same on every rank
        assert all(torch.equal(a, b) for a, b in zip(masks, (first, second), strict=True))
    assert err == 0, err  # kept values scaled exactly; the gradient used the forward's mask
    n = first.numel()
    sigma = math.sqrt(n * P_DROP * (1 - P_DROP))
    assert abs(first.sum().item() - n * (1 - P_DROP)) < 5 * sigma
    assert not torch.equal(first, second)  # a new draw per call
    # Every rank's part is a different draw: under the zigzag layout of 2P chunks, each
    # chunk's mask agrees with another chunk's about half the time, not always.
    chunks = first.view(2 * ring_size, -1)
    for i in range(2 * ring_size):
        for j in range(i + 1, 2 * ring_size):
            agree = (chunks[i] == chunks[j]).double().mean().item()
            assert 0.3 < agree < 0.7, (i, j, agree)


class _SampledRouter(AttendedRouter):
    """Attention, then each token's expert sampled with Gumbel noise (``exponential_``, as
    PhiMoE samples in training) and its output halved on a coin (``rand_like``)."""

    def forward(self, x):
        y = self.attended(x)
        scores = self.router(y)
        chosen = (scores - torch.empty_like(scores).exponential_().log()).max(-1)[1]
        coin = torch.rand_like(scores[..., :1]) > 0.5
        out = torch.einsum("bsd,bsde->bse", y, self.experts[chosen])
        return out * torch.where(coin, 1.0, 0.5) * scores.softmax(-1).amax(-1, keepdim=True)


def sampled(world: int, length: int) -> dict:
    torch.manual_seed(0)
    model = _SampledRouter().double()
    x = torch.randn(2, length, 8, dtype=torch.float64)
    ringified = ringify(model, ring_size=world)
    ringified(x)  # traced first: the trace draws on fake tensors

    def run(fn):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)  # every rank's generator as the unmodified model's
        out = fn(x)
        out.sum().backward()
        return [out.detach(), *(p.grad for p in model.parameters())]

    want, got = run(model), run(ringified)
    return {
        "worst": max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)),
        "gathers": [g.op for g in ringified.report().gathers],
    }


@pytest.mark.parametrize(("world", "length"), [(2, 16), (4, 30)])
def test_a_routers_draws_are_the_unmodified_models(ranks, world, length):
    """Each draw is made whole, as the unmodified model makes it from the same generator,
    and each rank keeps its share (padding included on 4 ranks): exact, nothing gathered."""
    for r in ranks(world).run(sampled, world, length):
        assert r["worst"] < 1e-12 and r["gathers"] == [], r
