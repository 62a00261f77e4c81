"""FSDP2 and tensor parallelism with ringify on a (dp, cp) gloo mesh: one FSDP2 unit around
the ringified model is exact (per-layer units: test_fsdp.py); an FSDP2 output cast and
DTensor parameters outside FSDP and TP layers are refused on every rank, naming what
composes, also when they appear after a first call (which would otherwise run the cached
graph on the old parameters); TP applied after a first call is traced again (TP itself:
test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from ringify import ringify
from ringify.testing import outcome
from ringify.testing.models import NanoGPT


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))


def _batch():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]


def one_fsdp_unit_around_the_ring(order: str):
    """Largest difference of logits and gradients from the unmodified model (every rank
    on the same batch, so the dp average is that batch's gradient); FSDP applied to the
    ringified module, or to the model before ringify."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    idx, targets = _batch()
    torch.manual_seed(0)
    reference = NanoGPT().double()
    logits, loss = reference(idx, targets)
    loss.backward()
    want = [logits.detach(), *(p.grad for p in reference.parameters())]
    torch.manual_seed(0)
    model = NanoGPT().double()
    if order == "ringify first":
        sharded = fully_shard(ringify(model, ring_size=2, mesh=mesh["cp"]), mesh=mesh["dp"])
    else:
        sharded = ringify(fully_shard(model, mesh=mesh["dp"]), ring_size=2, mesh=mesh["cp"])
    logits, loss = sharded(idx, targets)
    loss.backward()
    got = [logits.detach(), *(p.grad.full_tensor() for p in model.parameters())]
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("order", ["ringify first", "fully_shard first"])
def test_one_fsdp2_unit_around_the_ringified_model_is_exact(ranks, order):
    for err in ranks(4).run(one_fsdp_unit_around_the_ring, order):
        assert err <= 1e-10, err


def fsdp_with_mixed_precision():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _mesh()
    torch.manual_seed(0)
    model = NanoGPT().double()
    policy = MixedPrecisionPolicy(output_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    ringified = fully_shard(ringify(model, ring_size=2, mesh=mesh["cp"]), mesh=mesh["dp"])
    idx, targets = _batch()
    return outcome(lambda: ringified(idx, targets))


def test_fsdp2_output_dtype_is_refused_on_every_rank(ranks):
    for kind, message, _ in ranks(4).run(fsdp_with_mixed_precision):
        assert kind == "ValueError" and "output_dtype" in message, message
        assert "blocks.0" in message


def _called_once():
    """(mesh, model, its ringified module, a call's inputs), after a first call."""
    mesh = _mesh()
    torch.manual_seed(0)
    model = NanoGPT().double()
    ringified = ringify(model, ring_size=2, mesh=mesh["cp"])
    inputs = _batch()
    ringified(*inputs)
    return mesh, model, ringified, inputs


def tensor_parallel_after_a_call():
    """(retraced, the largest difference from the first call's logits)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh, model, ringified, inputs = _called_once()
    before = ringified(*inputs)[0]
    style = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model.blocks[0], mesh["dp"], {"fc": style})
    after = ringified(*inputs)[0]
    return ringified.traces, (after - before).abs().max().item()


def test_tensor_parallel_applied_after_a_call_is_traced_again_not_run_on_old_weights(ranks):
    for traces, err in ranks(4).run(tensor_parallel_after_a_call):
        assert traces == 2 and err <= 1e-12, (traces, err)


def a_dtensor_swapped_in_after_a_call():
    """A parameter replaced by a DTensor by hand (no hooks, same shape): the cached graph
    must not be reused."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh, model, ringified, inputs = _called_once()
    fc = model.blocks[0].fc
    fc.weight = torch.nn.Parameter(distribute_tensor(fc.weight.detach(), mesh["dp"], [Replicate()]))
    return outcome(lambda: ringified(*inputs))


def test_a_dtensor_swapped_in_after_a_call_is_refused(ranks):
    for kind, message, _ in ranks(4).run(a_dtensor_swapped_in_after_a_call):
        assert kind == "ValueError" and "DTensor" in message, message
