"""Mamba-1's selective scan: one op, and state passing round the ring, not a gather.

``selective_scan`` (blocks of about sqrt(S) positions, the backward recomputing the states)
against the loop HF's torch path writes, position by position, float64, values and every
gradient (a, b, c and the initial state); ``ring_selective_scan`` of each rank's part against
the op on the full sequence, on 2 and 4 ranks, both layouts, a padded sequence whose padding
holds garbage. The pass's fold is checked on the graph: the loop unrolled by export becomes one
node, and a loop whose last state is read elsewhere is left as it is. Whole models (Mamba,
FalconMamba, Jamba, Zamba) in ``test_hybrid.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringify.passes.folds.scans import fold_selective_scans
from ringify.runtime import shard
from ringify.runtime.selective_scan import selective_scan, selective_scan_op

F64 = torch.float64


def loop(a, b, c, h0=None, cast=F64):
    """The recurrence as HF's torch path writes it (``mamba_selective_scan``)."""
    h = torch.zeros_like(b[:, :, 0]) if h0 is None else h0
    ys = []
    for t in range(a.shape[2]):
        h = a[:, :, t] * h + b[:, :, t]
        ys.append(torch.matmul(h.to(cast), c[:, t].unsqueeze(-1))[:, :, 0])
    return torch.stack(ys, -1), h


def inputs(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(2, 3, length, 4, generator=g, dtype=F64) * 0.5 + 0.5  # decays in (0.5, 1)
    b = torch.randn(2, 3, length, 4, generator=g, dtype=F64)
    c = torch.randn(2, length, 4, generator=g, dtype=F64)
    h0 = torch.randn(2, 3, 4, generator=g, dtype=F64)
    return a, b, c, h0


@pytest.mark.parametrize("length", [1, 2, 5, 16, 37, 100])
@pytest.mark.parametrize("initial", [False, True])
def test_the_op_is_the_loop(length, initial):
    tensors = [t.requires_grad_() for t in inputs(length)]
    a, b, c, h0 = tensors
    h0 = h0 if initial else None
    got = selective_scan_op(a, b, c, h0, F64, F64)
    want = loop(a, b, c, h0)
    seeds = [torch.randn_like(w) for w in want]
    used = [t for t in tensors if t is not None and (initial or t is not tensors[3])]
    for outs in ((0, 1), (0,)):  # y and the last state; y alone (the last state unused)
        grads = [
            torch.autograd.grad(sum((r[i] * seeds[i]).sum() for i in outs), used, retain_graph=True)
            for r in (got, want)
        ]
        for x, y in zip(*grads, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_the_op_keeps_the_model_dtypes():
    """States in the promoted dtype (float32 decays, float32 zeros: float32), y in the cast's;
    each no further from the float64 truth than twice the model's own loop is."""
    a, b, c, _ = inputs(100)
    true_y, true_last = loop(a, b, c)
    a, b, c = a.float(), b.float(), c.bfloat16()
    y, last = selective_scan_op(a, b, c, None, torch.float32, torch.bfloat16)
    want_y, want_last = loop(a, b, c, cast=torch.bfloat16)
    assert (y.dtype, last.dtype) == (torch.bfloat16, torch.float32)
    for got, want, truth in ((y, want_y, true_y), (last, want_last, true_last)):
        own = (want.double() - truth).abs().max()
        assert (got.double() - truth).abs().max() <= 2 * own


def _mine(x, dim, padded, layout):
    """This rank's part of a full-sequence tensor, zeros in the padding."""
    pad = list(x.shape)
    pad[dim] = padded - x.shape[dim]
    return shard(torch.cat([x, x.new_zeros(pad)], dim), dim, layout=layout)


def ring_scan_matches_full(layout):
    import torch.distributed as dist

    from ringify.runtime.selective_scan import ring_selective_scan

    name = dist.group.WORLD.group_name
    padded = 3 * dist.get_world_size() * 2
    worst = 0.0
    for length in (padded, padded - 4):
        a, b, c, _ = inputs(padded, seed=length)
        a[:, :, length:], c[:, length:] = float("nan"), float("inf")  # garbage in the padding
        full = [t.narrow(1 + (t is not c), 0, length).clone().requires_grad_() for t in (a, b, c)]
        want = selective_scan(*full, F64, F64)
        seed = torch.randn(want.shape, dtype=F64, generator=torch.Generator().manual_seed(9))
        want.backward(seed)
        parts = [
            shard(t, 1 + (t is not c), layout=layout).clone().requires_grad_() for t in (a, b, c)
        ]
        got = ring_selective_scan(*parts, F64, F64, padded, length, name, layout)
        zeros = torch.zeros(2, 3, padded - length, dtype=F64)
        got.backward(shard(torch.cat([seed, zeros], 2), 2, layout=layout))
        real = shard(torch.arange(padded) < length, 0, layout=layout)

        pairs = [(got.detach()[:, :, real], _mine(want.detach(), 2, padded, layout)[:, :, real])]
        pairs += [
            (p.grad.narrow(d, 0, p.shape[d])[(slice(None),) * d + (real,)],
             _mine(f.grad, d, padded, layout)[(slice(None),) * d + (real,)])
            for p, f, d in zip(parts, full, (2, 2, 1), strict=True)
        ]  # fmt: skip
        assert all(torch.isfinite(x).all() for x, _ in pairs)
        worst = max([worst] + [(x - y).abs().max().item() for x, y in pairs])
    return worst


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_scan_is_the_scan_of_the_full_sequence(ranks, world, layout):
    for worst in ranks(world).run(ring_scan_matches_full, layout):
        assert worst <= 1e-12


class _Mixer(nn.Module):
    """HF's Mamba-1 loop on given a, b, c; ``keep_last``: its last state also returned (as a
    cache would read it), which leaves the loop as it is."""

    def __init__(self, keep_last: bool):
        super().__init__()
        self.keep_last = keep_last

    def forward(self, a, b, c):
        y, h = loop(a, b, c)
        return (y, h) if self.keep_last else y


@pytest.mark.parametrize("keep_last", [False, True])
def test_the_unrolled_loop_folds_into_one_node(keep_last):
    a, b, c, _ = inputs(6)
    gm = torch.export.export(_Mixer(keep_last), (a, b, c), strict=False).module()
    graph = gm.graph
    steps = sum(n.target is torch.ops.aten.select.int for n in graph.nodes)
    assert fold_selective_scans(gm) == (0 if keep_last else 1)
    scans = [n for n in graph.nodes if n.target is selective_scan]
    assert len(scans) == (0 if keep_last else 1)
    left = sum(n.target is torch.ops.aten.select.int for n in graph.nodes)
    assert left == (steps if keep_last else 0)
    if scans:
        assert scans[0].meta["val"].shape == (2, 3, 6)
