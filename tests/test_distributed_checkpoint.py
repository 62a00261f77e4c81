"""Checkpoints through PyTorch's own API, as torchtitan and accelerate take them: on a (dp, cp) =
(2, 2) gloo mesh, HF Llama in float64 takes a training step ringified (bare, inside DDP, and
under per-layer FSDP2), then ``get_state_dict`` / ``dcp.save`` write the model and its AdamW
state. The checkpoint loads into the unmodified model (``dcp.load`` / ``set_state_dict``),
exactly; and into a fresh ringified model, whose next step is the continuing model's."""

from __future__ import annotations

import pytest
import torch

from ringify import ringify
from ringify.testing.hf_models import llama

LENGTH, LAYERS = 16, 2


def _model(seed: int):
    torch.manual_seed(seed)
    return llama(layers=LAYERS).double()


def _wrapped(model, how: str, mesh):
    """``model`` ringified over cp, then wrapped as ``how`` says; what to call and checkpoint."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if how == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
    ringified = ringify(model, ring_size=2, mesh=mesh["cp"])
    if how == "ddp":
        return DistributedDataParallel(ringified, process_group=mesh["dp"].get_group())
    if how == "fsdp2":
        return fully_shard(ringified, mesh=mesh["dp"])
    return ringified


def _step(top, optimizer, ids) -> None:
    top(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(state: dict) -> dict:
    """Every tensor of a (possibly sharded) state dict, whole."""
    from torch.distributed.tensor import DTensor

    def whole(x):
        if isinstance(x, DTensor):
            return x.full_tensor()
        if isinstance(x, dict):
            return {k: whole(v) for k, v in x.items()}
        return x.detach().clone() if isinstance(x, torch.Tensor) else x

    return whole(state)


def round_trip(how: str, folder: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    # each dp replica its own batch; bare, nothing keeps replicas alike: one batch for all
    g = torch.Generator().manual_seed(0 if how == "bare" else mesh["dp"].get_local_rank())
    batches = [torch.randint(1, 64, (2, LENGTH), generator=g) for _ in range(2)]

    model = _model(0)
    top = _wrapped(model, how, mesh)
    optimizer = torch.optim.AdamW(top.parameters(), lr=1e-2)
    _step(top, optimizer, batches[0])
    saved_model, saved_optim = get_state_dict(top, optimizer)
    dcp.save({"model": saved_model, "optim": saved_optim}, checkpoint_id=folder)
    want = _full(saved_model)

    # into the unmodified model: every weight as the ringified model left it
    plain = _model(1)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    state = dict(zip(("model", "optim"), get_state_dict(plain, plain_optim), strict=True))
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        plain, plain_optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    into_plain = max((p.detach() - want[n]).abs().max().item() for n, p in plain.named_parameters())
    moments = max(
        (plain_optim.state[p]["exp_avg"] - _full(saved_optim)["state"][n]["exp_avg"])
        .abs()
        .max()
        .item()
        for n, p in plain.named_parameters()
    )

    # into a fresh ringified model: it resumes, its next step the continuing model's
    resumed = _wrapped(_model(2), how, mesh)
    resumed_optim = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    state = dict(zip(("model", "optim"), get_state_dict(resumed, resumed_optim), strict=True))
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        resumed, resumed_optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    _step(top, optimizer, batches[1])
    _step(resumed, resumed_optim, batches[1])
    after = _full(get_state_dict(top, optimizer)[0])
    resumed_after = _full(get_state_dict(resumed, resumed_optim)[0])
    resumes = max((resumed_after[n] - after[n]).abs().max().item() for n in after)
    keys = sorted(saved_model) == sorted(plain.state_dict())
    return {"into plain": into_plain, "moments": moments, "resumes": resumes, "keys": keys}


@pytest.mark.parametrize("how", ["bare", "ddp", "fsdp2"])
def test_dcp_round_trips_a_ringified_model(ranks, tmp_path, how):
    for r in ranks(4).run(round_trip, how, str(tmp_path)):
        assert r["keys"], r  # the unmodified model's keys
        assert r["into plain"] == 0.0 and r["moments"] == 0.0, r
        assert r["resumes"] == 0.0, r
