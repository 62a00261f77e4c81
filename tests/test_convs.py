"""Convolutions along the sequence: a halo exchange, not a gather.

``ring_conv1d`` of each rank's part against ``same_conv1d`` of the full sequence (values
and the gradients of x, kernel and bias), on 2 and 4 ranks, both layouts: odd and even
kernels, depthwise and grouped, halos wider than a chunk, a padded sequence whose
padding holds garbage. The pass's fold is checked on the graph (a ``conv1d`` with its cut
becomes one node); whole models (Wav2Vec2) in ``test_model_families.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringify.passes.folds.convs import fold_sequence_convs
from ringify.runtime import shard
from ringify.runtime.collectives.neighbours import same_conv1d

KERNELS = [(3, 1, 1, 4), (4, 2, 1, 4), (8, 4, 3, 4), (5, 2, 2, 1), (1, 0, 0, 2), (9, 4, 4, 4)]


def ring_conv_matches_full(layout):
    import torch.distributed as dist

    from ringify.runtime.collectives.neighbours import ring_conv1d

    name = dist.group.WORLD.group_name
    padded = 3 * dist.get_world_size() * 2  # chunks of 3: a 9-wide kernel spans two
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for length in (padded, padded - 4):
        for kernel, left, right, groups in KERNELS:
            full = torch.randn(2, 4, length, generator=g, dtype=torch.float64)
            weight = torch.randn(4, 4 // groups, kernel, generator=g, dtype=torch.float64)
            bias = torch.randn(4, generator=g, dtype=torch.float64)
            tensors = [t.clone().requires_grad_() for t in (full, weight, bias)]
            want = same_conv1d(*tensors, left, right, groups)
            seed = torch.randn(want.shape, generator=g, dtype=torch.float64)
            want.backward(seed)
            garbage = torch.randn(2, 4, padded - length, generator=g, dtype=torch.float64)
            part = shard(torch.cat([full, garbage], 2), 2, layout=layout).requires_grad_()
            w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
            got = ring_conv1d(part, w, b, left, right, groups, padded, length, name, layout)
            zeros = torch.zeros_like(garbage)
            got.backward(shard(torch.cat([seed, zeros], 2), 2, layout=layout))
            real = shard(torch.arange(padded) < length, 0, layout=layout)
            for w_ in (w, b):
                dist.all_reduce(w_.grad)  # each rank's part of the kernel's gradient
            pairs = [
                (
                    got.detach()[..., real],
                    shard(torch.cat([want.detach(), zeros], 2), 2, layout=layout)[..., real],
                ),
                (
                    part.grad[..., real],
                    shard(torch.cat([tensors[0].grad, zeros], 2), 2, layout=layout)[..., real],
                ),
                (w.grad, tensors[1].grad),
                (b.grad, tensors[2].grad),
            ]
            worst = max([worst] + [(a - c).abs().max().item() for a, c in pairs])
    return worst


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_conv_is_the_convolution_of_the_full_sequence(ranks, world, layout):
    for worst in ranks(world).run(ring_conv_matches_full, layout):
        assert worst <= 1e-12


class _Convs(nn.Module):
    """``same``: padded by half the kernel (its last output cut when the kernel is even);
    ``causal``: padded by kernel - 1, the first S outputs kept (Mamba's)."""

    def __init__(self, kernel: int, kind: str):
        super().__init__()
        self.kind = kind
        padding = kernel - 1 if kind == "causal" else kernel // 2
        self.conv = nn.Conv1d(8, 8, kernel, padding=padding, groups=2)

    def forward(self, x):
        y = self.conv(x)
        if self.kind == "causal":
            return y[..., : x.shape[-1]]
        return y[:, :, :-1] if self.conv.kernel_size[0] % 2 == 0 else y


@pytest.mark.parametrize(("kernel", "kind"), [(3, "same"), (4, "same"), (4, "causal")])
def test_a_length_keeping_convolution_is_folded_into_one_node(kernel, kind):
    x = torch.randn(2, 8, 10, dtype=torch.float64)
    model = _Convs(kernel, kind).double()
    gm = torch.export.export(model, (x,), strict=False).module()
    assert fold_sequence_convs(gm) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert same_conv1d in targets and torch.ops.aten.conv1d.default not in targets
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=1e-14)
