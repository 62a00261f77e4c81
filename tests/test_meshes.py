"""ringify on one dim of a DeviceMesh: a (dp, cp) mesh of 4 gloo ranks, each dp replica its
own batch, each cp ring splitting it; against the unmodified model on that batch."""

from __future__ import annotations

import pytest
import torch

from ringify import ringify
from ringify.testing.models import NanoGPT


def ring_on_the_cp_dim():
    """(largest difference from the unmodified model, the errors of a wrong mesh spelling)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # a batch per replica
    idx, targets = (torch.randint(0, 64, (2, 16), generator=g) for _ in range(2))
    torch.manual_seed(0)
    model = NanoGPT().double()
    results = []
    for run in (model, ringify(model, ring_size=2, mesh=mesh["cp"])):
        model.zero_grad(set_to_none=True)
        logits, loss = run(idx, targets)
        loss.backward()
        results.append([logits.detach(), *(p.grad for p in model.parameters())])
    err = max((a - b).abs().max().item() for a, b in zip(*results, strict=True))
    errors = []
    for kwargs in ({"mesh": mesh}, {"mesh": mesh["cp"], "group": mesh["cp"].get_group()}):
        with pytest.raises(ValueError) as e:
            ringify(model, ring_size=2, **kwargs)
        errors.append(str(e.value))
    return err, errors


def test_ring_on_one_dim_of_a_dp_cp_mesh(ranks):
    for err, (two_dims, both) in ranks(4).run(ring_on_the_cp_dim):
        assert err <= 1e-10, err
        assert 'mesh["cp"]' in two_dims and "2 dims" in two_dims
        assert "not both" in both
