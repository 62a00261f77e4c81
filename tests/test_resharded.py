"""Regions on a share of another dim: the all-to-all ops and what the pass finds.

``ringify::to_dim`` and ``from_dim`` (``runtime/collectives/reshard.py``) against the whole
tensor on 2 and 4 ranks, float64, both layouts, with and without padding, the dim before or
after the sequence: values, and gradients through each (each is the other's backward). The
models are in ``test_hybrid.py``.
"""

from __future__ import annotations

import pytest
import torch

from ringify.runtime.collectives.layout import padded_length, shard_for_rank


def exchange(length: int, seq_dim: int, dim: int, layout: str):
    import torch.distributed as dist

    from ringify.runtime.collectives.reshard import from_dim_op, to_dim_op
    from ringify.runtime.collectives.ring import resolve_ring

    ring = resolve_ring(None)
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    shape = [2, 3, 3]
    shape.insert(seq_dim, length)
    shape[dim] = 2 * size
    whole = torch.randn(shape, generator=g, dtype=torch.float64)
    weights = torch.randn(shape, generator=g, dtype=torch.float64)
    padded = padded_length(length, size, layout)
    spec = [0, 0] * (len(shape) - seq_dim - 1) + [0, padded - length]
    mine = shard_for_rank(torch.nn.functional.pad(whole, spec), seq_dim, rank, size, layout)
    x = mine.clone().requires_grad_(True)
    share = slice(2 * rank, 2 * rank + 2)
    index = [slice(None)] * len(shape)
    index[dim] = share
    y = to_dim_op(x, seq_dim, dim, ring.name, layout, length)
    (y * weights[tuple(index)]).sum().backward()
    # every share of every position reaches one rank: the gradient is the weights' shard
    want_grad = shard_for_rank(torch.nn.functional.pad(weights, spec), seq_dim, rank, size, layout)
    back = from_dim_op(
        y.detach().requires_grad_(True), seq_dim, dim, ring.name, layout, padded, -7.0
    )
    pad_rows = shard_for_rank(
        torch.nn.functional.pad(whole, spec, value=-7.0), seq_dim, rank, size, layout
    )
    z = y.detach().requires_grad_(True)
    (from_dim_op(z, seq_dim, dim, ring.name, layout, padded) * mine).sum().backward()
    return {
        "to_dim": (y - whole[tuple(index)]).abs().max().item(),
        "to_dim grad": (x.grad - want_grad).abs().max().item(),
        "from_dim": (back - pad_rows).abs().max().item(),
        # the padded positions have no gradient; every other reaches its share
        "from_dim grad": (z.grad - whole[tuple(index)]).abs().max().item(),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("length", "seq_dim", "dim"), [(16, 1, 2), (13, 2, 1)])
def test_to_dim_and_back(ranks, world, layout, length, seq_dim, dim):
    for r in ranks(world).run(exchange, length, seq_dim, dim, layout):
        assert max(r.values()) == 0.0, r
