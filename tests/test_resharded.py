"""Regions on a share of another dim: the all-to-all ops and what the pass finds.

``ringify::to_dim`` and ``from_dim`` (``runtime/collectives/reshard.py``) against the whole
tensor on 2 and 4 ranks, float64, both layouts, with and without padding, the dim before or
after the sequence: values, gradients through each (each is the other's backward), and
their fake kernels' shapes. A small model whose region is cut before an op that needs its
dim whole. The models are in ``test_hybrid.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ringify.passes.sharding.shares import spec_of
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
    with FakeTensorMode() as mode:  # the fake kernels state what the ops return
        fake_y = to_dim_op(mode.from_tensor(mine), seq_dim, dim, ring.name, layout, length)
        fake_back = from_dim_op(fake_y, seq_dim, dim, ring.name, layout, padded, -7.0)
    return {
        "fake shapes": float(fake_y.shape != y.shape or fake_back.shape != back.shape),
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


class Flipped(nn.Module):
    """A mixer that reads its sequence backwards (``flip``: no sequence rule), a per-head scale,
    and a norm over each head's channels with the heads merged into the rows (as a gated
    norm is written): the flip's region runs on a share of the heads and is cut before the
    merge, which needs the heads whole; the norm runs on the sequence's shards."""

    def __init__(self, channels: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.inp, self.out = nn.Linear(channels, channels), nn.Linear(channels, channels)
        self.scale = nn.Parameter(torch.randn(heads, 1))

    def forward(self, x):
        b, s, c = x.shape
        v = self.inp(x).view(b, s, self.heads, -1).flip(1) * self.scale
        rows = v.reshape(-1, v.shape[-1])
        rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.out(rows.view(b, s, c))


def flipped(length: int):
    from ringify.testing.runs import ringified_run

    torch.manual_seed(0)
    model = Flipped().double()
    x = torch.randn(1, length, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(1, length, 16, dtype=torch.float64)

    def step(fn):
        model.zero_grad(set_to_none=True)
        out = fn(x)
        (out * weights).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want = step(model)
    ringified, run = ringified_run(model)
    got = step(run)
    report = ringified.report()
    return {
        "out": (got[0] - want[0]).abs().max().item(),
        "grads": max((got[1][n] - want[1][n]).abs().max().item() for n in want[1]),
        "gathers": [g.node for g in report.gathers],
        "resharded": [(r.entered, r.nodes) for r in report.resharded],
    }


@pytest.mark.parametrize(("world", "length"), [(2, 16), (4, 13)])
def test_a_region_cut_before_an_op_that_needs_its_dim_whole(ranks, world, length):
    for r in ranks(world).run(flipped, length):
        assert r["out"] <= 1e-12 and r["grads"] <= 1e-12, r
        assert r["gathers"] == [], r
        [(entered, nodes)] = r["resharded"]
        # the flip and the scale, on a share of each head's channels (the last dim is tried
        # first); the norm that needs them whole runs on the sequence's shards
        assert [d for _, d in entered] == [3] and nodes == 2, r


def two_reshapes():
    from ringify.passes.sharding.shares import ask, mesh_of
    from ringify.runtime.collectives.ring import resolve_ring

    spec = spec_of(mesh_of(resolve_ring(None).name, "cpu"), torch.empty(1, 32, 4, 16), 2)
    aten = torch.ops.aten
    chunks = ask(aten.reshape.default, (spec, [1, -1, 16, 4, 16]), {}).output_spec
    merged = ask(aten.reshape.default, (spec, [1, 32, -1]), {}).output_spec
    return [p.dim for p in chunks.placements], [p.dim for p in merged.placements]


def test_dtensor_is_asked_per_shape(ranks):
    """One spec reshaped two ways gets two answers (DTensor caches its answers; the op's
    schema info keys them by the shape too): the heads at dim 3 of the chunks, dim 2 merged."""
    for chunks, merged in ranks(2).run(two_reshapes):
        assert chunks == [3] and merged == [2]
