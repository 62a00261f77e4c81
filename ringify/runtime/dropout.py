"""Dropout on a sequence shard: independent draws per position, as in the unmodified model.

Every rank of a ring holds the same default generator state (same seed, same calls), so
``aten.dropout`` on each rank's shard would drop the same local positions on every rank:
position ``i`` of each rank's part dropped together. ``ringify::sequence_dropout`` draws
one seed from the default CPU generator (one draw on every rank, so the ranks stay in
step) and the mask from a generator seeded with that seed and the rank: independent
per rank, hence per position. A checkpoint's recompute restores the default generator
and so redraws the same mask. The masks are not the unmodified model's bit for bit
(that one stream draws the whole sequence), only equal in distribution.

The rank is read when the op runs, never at trace time (see ``collectives/sharding.py``).
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.ring import ring_by_name

_SEEDS = 1 << 62


@torch.library.custom_op(
    "ringify::sequence_dropout", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def sequence_dropout(
    x: torch.Tensor, p: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dropout(x, p), the mask kept)`` with this rank's own draw."""
    ring = ring_by_name(group_name)
    seed = int(torch.randint(_SEEDS, (), dtype=torch.int64))
    generator = torch.Generator(x.device).manual_seed(
        (seed + ring.rank * 0x9E3779B97F4A7C15) % _SEEDS
    )
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(
        1 - p, generator=generator
    )
    return x * keep * _scale(p), keep


@sequence_dropout.register_fake
def _(x, p, group_name):
    return torch.empty_like(x), torch.empty(x.shape, dtype=torch.bool, device=x.device)


def _scale(p: float) -> float:
    return 0.0 if p >= 1 else 1 / (1 - p)


def _setup_context(ctx, inputs, output):
    ctx.p = inputs[1]
    ctx.save_for_backward(output[1])


def _backward(ctx, grad, _):
    (keep,) = ctx.saved_tensors
    return grad * keep * _scale(ctx.p), None, None


sequence_dropout.register_autograd(_backward, setup_context=_setup_context)
